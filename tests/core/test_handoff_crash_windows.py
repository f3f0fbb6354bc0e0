"""The crash windows of the handoff, with a real process kill (issue #17; S7, S7a, S8, D4, K1, S9).

A settle grants the freed slot to the oldest waiter in its own transaction
(the waiter becomes a holder with its fencing token and a ``wake_at`` one
``REDELIVERY_SECONDS`` ahead, still parked, no lease); after the commit the
releasing worker runs that waiter's turn itself (``Engine.execute_chain``),
whose confirmation claim takes the lease in one compare-and-set. A worker
killed between the two leaves a granted holder nobody runs; one killed after
the confirmation leaves a running holder whose lease nobody renews.

Each test starts two real Celery workers of one pool process each
(``tests/celery_workers.py``, lease 3 s renewed every 1 s) armed with a crash
point of :mod:`testproject.inventory.crash_hooks`: the worker that reaches it
SIGKILLs itself, main process and pool process, by PID. A (workflow
``handoff-kill``) holds the key until the test opens its gate; B waits,
parked by its claim, and C behind it (created parked, S8a). Nothing ticks until the kill (so no retry turn of B
is on its way); then this process runs the tick every ``TICK`` seconds. The
measured delays are printed and merged into ``artifacts/handoff_crash.json``.
Needs PostgreSQL or MariaDB and Redis (worker processes share the database).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.db import connection

from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus, SlotState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.tasks import execute_run
from testproject.inventory.crash_hooks import KILL_AT_ENV, KILL_MARK_ENV
from testproject.inventory.models import BodyAudit
from tests.celery_workers import CeleryWorkers, WorkerProcess, celery_stack_missing, celery_workers, worker_env

__all__ = ["celery_workers"]  # the fixture

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

T = TypeVar("T")

WORKFLOW = "handoff-kill"  # no queue of its own: a handoff runs the granted turn on the releasing worker
LEASE = 3.0
RENEW = 1.0
TICK = 0.5
#: DURABLE_SINGLETON["REDELIVERY_SECONDS"], the default: a granted waiter's wake_at is this far ahead.
REDELIVERY = 5.0
#: Broker delivery and scheduling on a loaded 2-core machine (issue #19).
SLACK = 30.0
#: The database's clock and the workers' clocks are one host's; their reads differ by this much at most.
CLOCKS = 0.5
ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "handoff_crash.json"


class Stack:
    """Two armed workers, the tick of this process, the runs of one key and what was seen."""

    def __init__(self, workers: CeleryWorkers, tmp_path: Path, kill_at: str, tag: str) -> None:
        store = DjangoStore()
        self.engine = Engine(store, CeleryDispatcher(store))
        self.engine.dispatcher.bind(self.engine)
        self.workers = workers
        self.tag = tag
        self.store_id = f"hk-{tag}"
        self.key = f"store:{self.store_id}"
        self.gate = tmp_path / "gate"
        self.mark = tmp_path / "killed.json"
        self.ticking = False
        self.peak = 0
        self._next_tick = 0.0
        self.children: dict[int, set[int]] = {}
        env = worker_env(
            DURABLE_LEASE_SECONDS=str(LEASE),
            DURABLE_LEASE_RENEW_SECONDS=str(RENEW),
            **{KILL_AT_ENV: kill_at.format(tag=tag), KILL_MARK_ENV: str(self.mark)},
        )
        self.procs = workers.start(2, concurrency=1, env=env, extra_args=("--disable-prefetch",))

    def run_id(self, name: str) -> str:
        return f"{name}-{self.tag}"

    def start(self, name: str, **input: Any) -> str:
        run_id = self.run_id(name)
        self.engine.start(WORKFLOW, {"store_id": self.store_id, **input}, run_id=run_id)
        return run_id

    def poll(self) -> None:
        """Tick if one is due (and ticking is on); record the most holders the key had."""
        if self.ticking and time.monotonic() >= self._next_tick:
            self.engine.tick()
            self._next_tick = time.monotonic() + TICK
        holders = Run.objects.filter(singleton_key=self.key, singleton_slot=SlotState.HOLDER).count()
        self.peak = max(self.peak, holders)

    def until(self, what: str, predicate: Callable[[], T], timeout: float) -> T:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if value := predicate():
                return value
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{self.report()}"
            time.sleep(0.05)

    def entries(self, run_id: str) -> list[BodyAudit]:
        return list(BodyAudit.objects.filter(run_id__startswith=f"{run_id}#").order_by("entered_at"))

    def status(self, run_id: str) -> str:
        return str(Run.objects.values_list("status", flat=True).get(pk=run_id))

    def waiting(self, first: str, behind: str) -> bool:
        """``first`` was parked by its claim (S5) and ``behind`` waits too: parked
        by its claim, or created parked behind the deep queue (S8a)."""
        waiters = Run.objects.filter(singleton_slot=SlotState.WAITER)
        return (
            waiters.filter(pk=first, status=RunStatus.SUSPENDED).exists()
            and waiters.filter(pk=behind, status__in=(RunStatus.PENDING, RunStatus.SUSPENDED)).exists()
        )

    def refused_meanwhile(self, run_id: str) -> None:
        """Deliver a turn of ``run_id`` (a waiter behind the granted holder) to
        the surviving worker and wait until its claim was refused: parked, still
        a waiter, its attempts one higher (S5, S9)."""
        attempts = Run.objects.values_list("attempts", flat=True).get(pk=run_id)
        execute_run.apply_async((run_id,))
        self.until(
            f"{run_id}'s claim refused",
            lambda: Run.objects.filter(
                pk=run_id, attempts=attempts + 1, status=RunStatus.SUSPENDED, singleton_slot=SlotState.WAITER
            ).exists(),
            60,
        )

    def killed(self) -> dict[str, Any] | None:
        """What the crash point wrote, once it fired and the worker it killed is gone."""
        try:
            seen: dict[str, Any] = json.loads(self.mark.read_text())
        except (OSError, ValueError):  # not fired yet, or being written
            return None
        worker = self.worker_of(seen["pid"])
        return seen if worker is not None and not worker.alive() else None

    def worker_of(self, pid: int) -> WorkerProcess | None:
        return next((w for w in self.procs if pid in self.children[w.pid]), None)

    def remember_children(self) -> None:
        """Note each worker's pool processes (a killed worker's are gone afterwards)."""
        self.children = {w.pid: set(w.children()) for w in self.procs}

    def report(self) -> str:
        lines = ["runs:"]
        for r in Run.objects.filter(singleton_key=self.key).order_by("created_at"):
            lines.append(
                f"  {r.run_id} {r.status} slot={r.singleton_slot} token={r.fencing_token} attempts={r.attempts}"
                f" recoveries={r.recoveries} owner={r.lease_owner} lease={r.lease_expires_at} wake={r.wake_at}"
            )
        lines.append("body entries:")
        lines += [
            f"  {a.run_id} pid={a.pid} {a.entered_at} -> {a.exited_at}"
            for a in BodyAudit.objects.filter(key=self.key).order_by("entered_at")
        ]
        mark = self.mark.read_text() if self.mark.exists() else "(not fired)"
        lines.append(f"crash point: {mark}; peak holders {self.peak}")
        return "\n".join(lines) + "\n" + self.workers.logs()

    def assert_serial(self) -> None:
        """The key's bodies never overlapped and it never had two holders (S9)."""
        rows = list(BodyAudit.objects.filter(key=self.key).order_by("entered_at"))
        for before, after in itertools.pairwise(rows):
            assert before.exited_at is not None and before.exited_at <= after.entered_at, self.report()
        assert self.peak <= 1, f"{self.peak} holders at once\n{self.report()}"


@pytest.fixture
def stack_of(celery_workers: CeleryWorkers, tmp_path: Path) -> Iterator[Callable[[str], Stack]]:
    if reason := celery_stack_missing(("postgresql", "mysql")):
        pytest.skip(reason)
    yield lambda kill_at: Stack(celery_workers, tmp_path, kill_at, os.urandom(4).hex())


def _seconds(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


def _record(name: str, figures: dict[str, Any]) -> None:
    """Merge one test's measurements into the artifact and print them."""
    ARTIFACT.parent.mkdir(exist_ok=True)
    data = json.loads(ARTIFACT.read_text()) if ARTIFACT.exists() else {}
    entry = {"lease_seconds": LEASE, "redelivery_seconds": REDELIVERY, "tick_seconds": TICK, **figures}
    data[f"{name}:{connection.vendor}"] = entry
    ARTIFACT.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"\n{name} on {connection.vendor}: {json.dumps(figures)}")


def _recovered(stack: Stack, b: str, c: str) -> tuple[BodyAudit, BodyAudit, Run]:
    """Start the tick; once B and C completed, return the one body entry of each and B's run."""
    stack.ticking = True
    stack.until("B and C completed", lambda: stack.status(b) == stack.status(c) == RunStatus.COMPLETED, 120)
    (entry_b,), (entry_c,) = stack.entries(b), stack.entries(c)
    return entry_b, entry_c, Run.objects.get(pk=b)


def _c_after_b(stack: Stack, entry_b: BodyAudit, entry_c: BodyAudit) -> None:
    """C's body entered after B's exited, and no two bodies of the key overlapped."""
    assert entry_c.entered_at >= entry_b.exited_at, stack.report()
    stack.assert_serial()


def _hold_then_handoff(stack: Stack) -> tuple[str, str, str, BodyAudit]:
    """A holds the key at its gate, B and C wait parked; then the gate opens. Returns A, B, C, A's entry."""
    a = stack.start("A", gate=str(stack.gate))
    (entry_a,) = stack.until("A's body entered", lambda: stack.entries(a), 120)
    b = stack.start("B", seconds=0.2)
    c = stack.start("C", seconds=0.2)
    stack.until("B parked by its claim, C waiting", lambda: stack.waiting(b, c), 60)
    stack.remember_children()
    assert stack.worker_of(entry_a.pid) is not None, f"A ran in {entry_a.pid}, no pool process\n{stack.report()}"
    stack.gate.touch()
    return a, b, c, entry_a


def test_a_worker_killed_after_the_handoff_commit_leaves_a_granted_waiter_the_tick_sends(
    stack_of: Callable[[str], Stack],
) -> None:
    """S7, S7a, S8, K1, S9, D4: the worker that settles A is SIGKILLed right
    after its settle + handoff committed, before B's turn is run or sent (in
    ``run_admitted``). The commit stands: A completed, B granted (a holder with
    the next token, still parked, no lease, ``wake_at`` one redelivery window
    after its grant), C a waiter. No run enters the key meanwhile (a turn of C
    delivered then is refused: B holds its slot). The tick sends B once its ``wake_at`` has
    come: its body runs once, on the other worker, within REDELIVERY_SECONDS +
    a tick (+ slack) of the kill and not before its window; it is no recovery
    (``recoveries`` 0: it never ran) and it runs with the token of its grant.
    Then C."""
    stack = stack_of("handoff:B-{tag}")
    a, b, c, entry_a = _hold_then_handoff(stack)
    seen = stack.until("the worker killed in the handoff", stack.killed, 60)
    killed_at = datetime.fromtimestamp(seen["killed_at"], UTC)

    assert (seen["phase"], seen["run_id"], seen["pid"]) == ("handoff", b, entry_a.pid), stack.report()
    assert seen["lease_owner"] is None and seen["admitted"], seen
    run_a, run_b, run_c = (Run.objects.get(pk=r) for r in (a, b, c))
    assert (run_a.status, run_a.singleton_slot) == (RunStatus.COMPLETED, None), stack.report()
    # Granted in the committed handoff: a holder, parked, no lease, sent by nobody yet.
    assert run_b.status == RunStatus.SUSPENDED and run_b.singleton_slot == SlotState.HOLDER, stack.report()
    assert run_b.lease_owner is None and run_b.lease_expires_at is None, stack.report()
    assert run_b.fencing_token == run_a.fencing_token + 1 == seen["fencing_token"], stack.report()
    assert run_b.admitted_at is not None and run_b.wake_at is not None
    assert abs(_seconds(run_b.wake_at, run_b.admitted_at) - REDELIVERY) < 0.01, stack.report()
    assert run_c.singleton_slot == SlotState.WAITER and not stack.entries(b), stack.report()
    granted_token, granted_at = run_b.fencing_token, run_b.admitted_at
    stack.refused_meanwhile(c)  # a turn of C arrives while B is granted and unsent: refused
    run_b_now = Run.objects.get(pk=b)
    assert (run_b_now.status, run_b_now.lease_owner, run_b_now.attempts) == (run_b.status, None, run_b.attempts)

    entry_b, entry_c, run_b = _recovered(stack, b, c)
    assert run_b.recoveries == 0, f"B counted as a recovery\n{stack.report()}"
    assert run_b.fencing_token == granted_token == run_b.output["token"], stack.report()
    assert stack.worker_of(entry_b.pid) is not stack.worker_of(entry_a.pid), stack.report()
    assert entry_a.pid != entry_b.pid
    after_kill = _seconds(entry_b.entered_at, killed_at)
    after_grant = _seconds(entry_b.entered_at, granted_at)
    assert after_grant >= REDELIVERY - CLOCKS, f"B ran {after_grant:.2f} s after its grant\n{stack.report()}"
    assert after_kill <= REDELIVERY + TICK + SLACK, f"B ran {after_kill:.2f} s after the kill\n{stack.report()}"
    _c_after_b(stack, entry_b, entry_c)
    _record(
        "killed_after_handoff",
        {
            "kill_to_waiter_body_seconds": round(after_kill, 3),
            "grant_to_waiter_body_seconds": round(after_grant, 3),
            "waiter_recoveries": run_b.recoveries,
            "waiter_token": run_b.fencing_token,
        },
    )


def test_a_worker_killed_after_the_confirmation_claim_leaves_a_lease_the_tick_recovers(
    stack_of: Callable[[str], Stack],
) -> None:
    """S6, D4, K1, R5, S9: the handoff commits and the releasing worker runs
    B's turn itself; it is SIGKILLed after B's confirmation claim committed
    (B ``running`` under the worker's lease, which nobody renews) and before
    B's body did anything (the body's first statement). B keeps its slot; a
    turn of C delivered meanwhile is refused. Once the lease has expired by the database's clock
    the tick re-drives B on the other worker: a recovery (``recoveries`` 1)
    with a new token from the key's counter (the grant's + 1); its body runs
    once, within LEASE_SECONDS + a tick (+ slack) of the kill and not before
    the lease's expiry. Then C."""
    stack = stack_of("body:B-{tag}")
    a, b, c, entry_a = _hold_then_handoff(stack)
    seen = stack.until("the worker killed before B's body", stack.killed, 60)
    killed_at = datetime.fromtimestamp(seen["killed_at"], UTC)

    # The releasing worker's own process ran B's confirmation claim (no broker hop).
    assert (seen["phase"], seen["run_id"], seen["pid"]) == ("body", b, entry_a.pid), stack.report()
    run_a, run_b = Run.objects.get(pk=a), Run.objects.get(pk=b)
    assert run_a.status == RunStatus.COMPLETED
    assert (run_b.status, run_b.singleton_slot, run_b.recoveries) == (RunStatus.RUNNING, SlotState.HOLDER, 0)
    assert run_b.lease_owner == seen["lease_owner"] and str(run_b.lease_owner).split(":")[1] == str(entry_a.pid)
    assert run_b.fencing_token == run_a.fencing_token + 1 == seen["fencing_token"], stack.report()
    assert not stack.entries(b), stack.report()
    granted_token, expires = run_b.fencing_token, run_b.lease_expires_at
    assert expires is not None
    stack.refused_meanwhile(c)  # a turn of C arrives while B's lease runs out unrenewed: refused

    entry_b, entry_c, run_b = _recovered(stack, b, c)
    assert run_b.recoveries == 1, f"B not counted as a recovery\n{stack.report()}"
    assert run_b.fencing_token == granted_token + 1 == run_b.output["token"], stack.report()
    assert entry_a.pid != entry_b.pid
    after_kill = _seconds(entry_b.entered_at, killed_at)
    after_expiry = _seconds(entry_b.entered_at, expires)
    assert after_expiry >= -CLOCKS, f"B re-driven {-after_expiry:.2f} s before its lease expired\n{stack.report()}"
    assert after_kill <= LEASE + TICK + SLACK, f"B ran {after_kill:.2f} s after the kill\n{stack.report()}"
    _c_after_b(stack, entry_b, entry_c)
    _record(
        "killed_after_confirmation",
        {
            "kill_to_waiter_body_seconds": round(after_kill, 3),
            "lease_left_at_kill_seconds": round(_seconds(expires, killed_at), 3),
            "expiry_to_waiter_body_seconds": round(after_expiry, 3),
            "waiter_recoveries": run_b.recoveries,
            "waiter_token": run_b.fencing_token,
        },
    )
