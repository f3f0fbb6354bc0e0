"""Fault tests on real Celery worker processes, Redis and PostgreSQL (issue #3).

Each test starts real ``celery worker`` processes (``tests/celery_workers.py``),
injects one fault by PID or by configuration (SIGKILL of the pool process
running a body or of a whole worker, Celery's hard time limit, SIGSTOP longer
than the lease, a broker that refuses the send, one turn delivered three
times) and judges the outcome from the stored runs and from the rows the
bodies write themselves: workflow ``fault-hold`` (testproject) writes one
``BodyAudit`` row per body entry, named ``<run_id>#<attempt>``, with the entry
and exit times and the PID of the process that ran it.

Workers run with a short lease, ``LEASE_SECONDS`` = 3 and
``LEASE_RENEW_SECONDS`` = 1: the worst pause a worker may take without being
taken over is 2 s (docs/durability.rst). The tick runs in this process every
``TICK`` seconds (``Engine.tick`` with the Celery dispatcher), the way a beat
process would run it. Bounds such as "within one lease plus one tick" get
``SLACK`` seconds on top for the broker's delivery and a loaded machine.
The measured recovery times go to ``artifacts/fault_recovery.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest
from django.db import connections
from django.db.models.functions import Now
from django.utils import timezone

from durable_singleton.dispatch import CeleryDispatcher, ManualDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run, Step
from durable_singleton.stores.django import DjangoStore
from durable_singleton.tasks import execute_run
from testproject.inventory.models import BodyAudit
from tests.celery_workers import REPO, CeleryWorkers, celery_stack_missing, celery_workers, worker_env
from tests.worker_processes import wait_for

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

T = TypeVar("T")

LEASE = 3.0
RENEW = 1.0
TICK = 0.5
#: Broker delivery, worker scheduling and the claim, on a loaded 2-core machine
#: (issue #19: at load 9 a few seconds were not enough). Still far below what
#: would re-drive a run without the mechanism under test (BACKLOG_RETRY_SECONDS, 1 h).
SLACK = 30.0
#: DURABLE_SINGLETON["REDELIVERY_SECONDS"] (default): a turn whose send was lost is re-sent after it.
REDELIVERY = 5.0
HOLD = "fault-hold"  # the default Celery queue: the module's shared workers
ISOLATED = "fault-hold-isolated"  # queue "ds-faults": a test's own workers
ISOLATED_QUEUE = "ds-faults"
ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "fault_recovery.json"
OUTCOME = re.compile(r"execute_run\[(?P<task>[0-9a-f-]+)\] succeeded in [0-9.e-]+s: '(?P<outcome>\w+)'")
#: A turn's log line of either task: ``execute_run`` (one outcome) or
#: ``execute_runs`` (a batch: the list of the outcomes of the turns it executed).
TURNS = re.compile(r"execute_runs?\[[0-9a-f-]+\] succeeded in [0-9.e-]+s: (?P<outcomes>'\w+'|\[[^\]]*\])")


def turn_outcomes(log: str) -> list[str]:
    """Return the outcomes of the turns a worker's ``log`` reports, in order,
    those of a batch (``execute_runs``) one by one."""
    return [o for m in TURNS.finditer(log) for o in re.findall(r"'(\w+)'", m["outcomes"])]


def lease_env(**extra: str) -> dict[str, str]:
    """Return a worker's environment with the short lease of this module."""
    return worker_env(DURABLE_LEASE_SECONDS=str(LEASE), DURABLE_LEASE_RENEW_SECONDS=str(RENEW), **extra)


@pytest.fixture(scope="module")
def pool(django_db_setup: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryWorkers]:
    """Two workers of two pool processes each on the default queue, shared by
    the module's tests (each test uses its own keys). Depends on the test
    database's setup, whose name the workers' ``DATABASE_URL`` carries."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    workers = CeleryWorkers(tmp_path_factory.mktemp("fault-pool"))
    try:
        workers.start(2, concurrency=2, env=lease_env(), extra_args=("--disable-prefetch",))
        yield workers
    finally:
        workers.stop()


def _alive(pid: int) -> bool:
    """Tell whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _entries(run_id: str) -> list[BodyAudit]:
    """Return the body entries of ``run_id``, oldest first."""
    return list(BodyAudit.objects.filter(run_id__startswith=f"{run_id}#").order_by("entered_at"))


def _seconds(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


def _record(name: str, figures: dict[str, Any]) -> None:
    """Merge one test's measurements into the artifact and print them."""
    ARTIFACT.parent.mkdir(exist_ok=True)
    data = json.loads(ARTIFACT.read_text()) if ARTIFACT.exists() else {}
    data[name] = {"lease_seconds": LEASE, "renew_seconds": RENEW, "tick_seconds": TICK, **figures}
    ARTIFACT.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"\n{name}: {json.dumps(figures)}")


class Driver:
    """Starts runs, runs the tick every ``TICK`` seconds while the test waits,
    and watches: the highest number of slot holders per key seen in the
    database, the moment each watched PID died, the lease expiries of runs."""

    def __init__(self, *workers: CeleryWorkers) -> None:
        store = DjangoStore()
        self.engine = Engine(store, CeleryDispatcher(store))
        self.engine.dispatcher.bind(self.engine)
        self.workers = workers
        self.ticking = True
        self.ticks = 0
        self._next_tick = 0.0
        self.tag = uuid.uuid4().hex[:8]
        self.keys: set[str] = set()
        self.run_ids: list[str] = []
        self.peak: dict[str, int] = defaultdict(int)
        self.deaths: dict[int, datetime] = {}
        self.watched: set[int] = set()
        self.leases: dict[str, set[datetime]] = defaultdict(set)

    def key(self, name: str) -> str:
        """Return a store id unique to this test; its key is ``store:<id>``."""
        store_id = f"{name}-{self.tag}"
        self.keys.add(f"store:{store_id}")
        return store_id

    def start(self, workflow: str, store_id: str, name: str, engine: Engine | None = None, **input: Any) -> str:
        """Start run ``<name>-<tag>`` of ``workflow`` on ``store:<store_id>``; return its id."""
        run_id = f"{name}-{self.tag}"
        (engine or self.engine).start(workflow, {"store_id": store_id, **input}, run_id=run_id)
        self.run_ids.append(run_id)
        return run_id

    def watch(self, pid: int) -> None:
        """Record the moment ``pid`` is first seen dead."""
        self.watched.add(pid)

    def poll(self) -> None:
        """Tick if one is due, then take one look at holders, PIDs and leases."""
        if self.ticking and time.monotonic() >= self._next_tick:
            self.engine.tick()
            self.ticks += 1
            self._next_tick = time.monotonic() + TICK
        holders = Counter(
            Run.objects.filter(singleton_key__in=self.keys, singleton_slot="holder").values_list(
                "singleton_key", flat=True
            )
        )
        for key, count in holders.items():
            self.peak[key] = max(self.peak[key], count)
        for pid in self.watched - set(self.deaths):
            if not _alive(pid):
                self.deaths[pid] = timezone.now()
        for run_id, expires in Run.objects.filter(pk__in=self.run_ids, status="running").values_list(
            "run_id", "lease_expires_at"
        ):
            if expires is not None:
                self.leases[run_id].add(expires)

    def until(self, what: str, predicate: Callable[[], T], timeout: float) -> T:
        """Poll (and tick) until ``predicate()`` is truthy; return its value.

        Raises AssertionError with the runs, the audit and the workers' logs
        after ``timeout`` seconds.
        """

        def polled() -> T:
            self.poll()
            return predicate()

        return wait_for(polled, timeout, f"{what}: not", self.report)  # type: ignore[no-any-return]

    def status(self, run_id: str) -> str:
        return Run.objects.values_list("status", flat=True).get(pk=run_id)

    def settled(self, *run_ids: str) -> bool:
        return not Run.objects.filter(
            pk__in=run_ids, status__in=("pending", "running", "suspended", "blocked")
        ).exists()

    def logs(self) -> str:
        return "\n".join(w.logs() for w in self.workers)

    def report(self) -> str:
        """Return the runs, the audit rows and the workers' logs, for a failure message."""
        runs = Run.objects.filter(pk__in=self.run_ids).order_by("created_at")
        lines = ["runs:"]
        lines += [
            f"  {r.run_id} {r.status} slot={r.singleton_slot} attempts={r.attempts} recoveries={r.recoveries}"
            f" lease={r.lease_expires_at} wake={r.wake_at} error={r.error}"
            for r in runs
        ]
        lines.append("body entries:")
        for run_id in self.run_ids:
            lines += [f"  {a.run_id} pid={a.pid} {a.entered_at} -> {a.exited_at}" for a in _entries(run_id)]
        lines.append(f"peak holders: {dict(self.peak)}; ticks: {self.ticks}")
        return "\n".join(lines) + "\n" + self.logs()

    def assert_serial(self, ends: dict[str, datetime] | None = None, exclude: Iterable[str] = ()) -> None:
        """Check that the bodies of two different runs of one key never overlap
        (S9), from the audit; an entry without exit ends at ``ends[entry]`` or at
        the death of its process. Never more than one holder was seen (S9)."""
        ends = dict(ends or {})
        for key in self.keys:
            rows = [a for a in BodyAudit.objects.filter(key=key).order_by("entered_at") if a.run_id not in exclude]
            spans = []
            for row in rows:
                end = row.exited_at or ends.get(row.run_id) or self.deaths.get(row.pid)
                assert end is not None, f"{row.run_id}: no exit and no known death\n{self.report()}"
                spans.append((row.entered_at, end, row.run_id.split("#")[0], row.run_id))
            for n, (start, _end, run, entry) in enumerate(spans):
                for _start0, end0, run0, entry0 in spans[:n]:
                    assert run0 == run or start >= end0, (
                        f"{entry} entered at {start} while {entry0} ran until {end0}\n{self.report()}"
                    )
        assert all(n <= 1 for n in self.peak.values()), f"more than one holder: {dict(self.peak)}\n{self.report()}"


@pytest.fixture
def driver(pool: CeleryWorkers) -> Iterator[Driver]:
    d = Driver(pool)
    yield d
    # A failed test can leave a body running (or stopped) in a shared pool
    # process: kill that process by the PID its body wrote; Celery replaces it.
    leftover = set(BodyAudit.objects.filter(key__in=d.keys, exited_at__isnull=True).values_list("pid", flat=True))
    for pid in leftover & _pool_pids(pool):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _waiting(first: str, *behind: str) -> bool:
    """Tell whether ``first`` was parked by its claim (S5) and the runs
    ``behind`` it wait too: parked, or created parked behind a deep queue (S8a)."""
    waiters = Run.objects.filter(singleton_slot="waiter")
    return waiters.filter(pk=first, status="suspended").exists() and waiters.filter(
        pk__in=behind, status__in=("pending", "suspended")
    ).count() == len(behind)


def _pool_pids(*workers: CeleryWorkers) -> set[int]:
    return {pid for group in workers for w in group.workers for pid in w.children()}


def test_sigkill_of_the_holders_pool_process_recovers_it_as_holder_then_fifo(
    driver: Driver, pool: CeleryWorkers
) -> None:
    """F9, F7, S10, D4, S9, S5: A holds (its body sleeps 30 s), B and C wait.
    SIGKILL of the pool process running A's body, by the PID A's body wrote:
    A keeps its slot while its lease runs out (S10); the tick re-drives A on
    another pool process as the holder, counting one recovery (D4); never more
    than one holder and no two bodies of the key at once (S9); then B, then C
    (creation order, S5). The recovery time, SIGKILL to A's next body entry,
    is at most one lease plus one tick (plus SLACK) and is recorded."""
    store_id = driver.key("k9")
    a = driver.start(HOLD, store_id, "A", seconds=30, seconds_after_recovery=1)
    (first,) = driver.until("A's body entered", lambda: _entries(a), 90)
    assert first.pid in _pool_pids(pool), f"A's body ran in {first.pid}, not a pool process\n{driver.report()}"
    b = driver.start(HOLD, store_id, "B", seconds=0.3)
    c = driver.start(HOLD, store_id, "C", seconds=0.3)
    driver.until("B and C waiting", lambda: _waiting(b, c), 60)

    expires = Run.objects.values_list("lease_expires_at", flat=True).get(pk=a)
    killed_at = timezone.now()
    os.kill(first.pid, signal.SIGKILL)
    driver.watch(first.pid)
    driver.until("A re-driven", lambda: len(_entries(a)) >= 2, LEASE + SLACK + 30)
    assert Run.objects.get(pk=a).singleton_slot == "holder"
    driver.until("A, B, C settled", lambda: driver.settled(a, b, c), 90)

    first, second = _entries(a)
    assert first.exited_at is None and second.exited_at is not None, driver.report()
    assert second.pid != first.pid
    run_a = Run.objects.get(pk=a)
    assert (run_a.status, run_a.recoveries) == ("completed", 1), driver.report()
    assert run_a.output["pid"] == second.pid
    assert [driver.status(r) for r in (b, c)] == ["completed", "completed"]
    (entry_b,), (entry_c,) = _entries(b), _entries(c)
    assert second.exited_at <= entry_b.entered_at and entry_b.exited_at <= entry_c.entered_at, driver.report()
    driver.assert_serial(ends={first.run_id: killed_at})

    recovery = _seconds(second.entered_at, killed_at)
    assert recovery <= LEASE + TICK + SLACK, f"recovery took {recovery:.2f} s\n{driver.report()}"
    _record(
        "sigkill_pool_process",
        {
            "recovery_seconds": round(recovery, 3),
            "lease_left_at_kill_seconds": round(_seconds(expires, killed_at), 3),
            "expiry_to_next_entry_seconds": round(_seconds(second.entered_at, expires), 3),
            "handoff_to_B_seconds": round(_seconds(entry_b.entered_at, second.exited_at), 3),
        },
    )


def test_sigkill_of_a_whole_worker_then_restart_recovers_under_a_burst_of_ticks(
    driver: Driver, celery_workers: CeleryWorkers
) -> None:
    """F7, S10, D4, R6, S9, S5: A holds on a worker of its own (queue
    ds-faults), B and C wait. SIGKILL of the worker's main process and its pool
    processes, by PID; a new worker starts. Once A's lease expired by the
    database's clock, recovery, three ticks and the waiters' own turns (A, B
    and C sent again) go off at once: never more than one holder; A is
    re-driven as the holder; then B, then C. Time from SIGKILL to A's next
    entry (worker restart included) is recorded."""
    (worker,) = celery_workers.start(1, concurrency=2, queues=ISOLATED_QUEUE, env=lease_env())
    driver.workers = (*driver.workers, celery_workers)
    store_id = driver.key("k7")
    a = driver.start(ISOLATED, store_id, "A", seconds=30, seconds_after_recovery=1)
    (first,) = driver.until("A's body entered", lambda: _entries(a), 90)
    pool_pids = worker.children()
    assert first.pid in pool_pids, driver.report()
    b = driver.start(ISOLATED, store_id, "B", seconds=0.3)
    c = driver.start(ISOLATED, store_id, "C", seconds=0.3)
    driver.until("B and C waiting", lambda: _waiting(b, c), 60)

    driver.ticking = False
    killed_at = timezone.now()
    worker.kill()
    for pid in pool_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    worker.proc.wait(10)
    celery_workers.start(1, concurrency=2, queues=ISOLATED_QUEUE, env=lease_env())
    driver.until(
        "A's lease expired by the database clock",
        lambda: Run.objects.filter(pk=a, status="running", lease_expires_at__lte=Now()).exists(),
        LEASE + SLACK,
    )
    assert len(_entries(a)) == 1, "A was re-driven while nothing ticked\n" + driver.report()

    barrier = threading.Barrier(4)

    def tick() -> None:
        try:
            barrier.wait(10)
            driver.engine.tick()
        finally:
            connections.close_all()

    def resend() -> None:
        barrier.wait(10)
        for run_id in (a, b, c):
            execute_run.apply_async((run_id,), queue=ISOLATED_QUEUE)

    threads = [threading.Thread(target=tick) for _ in range(3)] + [threading.Thread(target=resend)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    driver.ticking = True
    driver.until("A re-driven", lambda: len(_entries(a)) >= 2, LEASE + SLACK + 30)
    driver.until("A, B, C settled", lambda: driver.settled(a, b, c), 90)

    first, second = _entries(a)
    run_a = Run.objects.get(pk=a)
    assert (run_a.status, run_a.recoveries) == ("completed", 1), driver.report()
    assert second.pid not in pool_pids and second.exited_at is not None
    (entry_b,), (entry_c,) = _entries(b), _entries(c)
    assert second.exited_at <= entry_b.entered_at and entry_b.exited_at <= entry_c.entered_at, driver.report()
    assert [driver.status(r) for r in (b, c)] == ["completed", "completed"]
    driver.assert_serial(ends={first.run_id: killed_at})
    _record("sigkill_worker_then_restart", {"recovery_seconds": round(_seconds(second.entered_at, killed_at), 3)})


def test_hard_time_limit_kills_the_holder_and_the_key_moves_on(driver: Driver, celery_workers: CeleryWorkers) -> None:
    """F9, D4, S8, S10: a worker with Celery's hard time limit of 2 s
    (``--time-limit=2``) and ``MAX_RECOVERIES`` = 1; A's body sleeps 30 s, B
    waits. The worker terminates A's pool process with SIGTERM, which a pool
    process cannot tell from a shutdown's (R7): the first time A is handed
    back with its slot (``shutdown:1``) and re-driven at once; past
    ``MAX_RECOVERIES`` hand-backs in a row it is left to its lease, the tick
    re-drives it (recovery 1), it is killed again, and the next recovery
    exceeds the maximum, so A becomes dead (error ``max_recoveries``, on_dead
    hook and run_dead signal logged) and frees its slot in the same write; B
    runs within one lease plus one tick of the last kill. A later start on
    the key is accepted and runs normally."""
    time_limit = 2.0
    celery_workers.start(
        1,
        concurrency=2,
        queues=ISOLATED_QUEUE,
        env=lease_env(DURABLE_MAX_RECOVERIES="1"),
        extra_args=(f"--time-limit={time_limit:g}",),
    )
    driver.workers = (*driver.workers, celery_workers)
    store_id = driver.key("kt")
    a = driver.start(ISOLATED, store_id, "A", seconds=30)
    (first,) = driver.until("A's body entered", lambda: _entries(a), 90)
    driver.watch(first.pid)
    b = driver.start(ISOLATED, store_id, "B", seconds=0.3)

    def watch_entries() -> bool:
        for row in _entries(a):
            driver.watch(row.pid)
        return driver.status(a) == "dead"

    driver.until("A dead", watch_entries, 3 * (time_limit + LEASE + SLACK) + 30)
    driver.until("B completed", lambda: driver.status(b) == "completed", 60)

    run_a = Run.objects.get(pk=a)
    assert run_a.error["code"] == "max_recoveries" and run_a.recoveries == 2, driver.report()
    assert run_a.singleton_slot is None and run_a.lease_owner is None
    entries = _entries(a)
    assert len(entries) == 3 and all(e.exited_at is None for e in entries), driver.report()
    first, second, third = entries
    driver.until("the killed processes seen dead", lambda: {e.pid for e in entries} <= set(driver.deaths), 60)
    (entry_b,) = _entries(b)
    # The time limit counts from the task's start, just before the body's entry.
    for entry, after, what in (
        (first, second.entered_at, "A handed back"),
        (second, third.entered_at, "A re-driven"),
        (third, entry_b.entered_at, "B admitted"),
    ):
        waited = _seconds(after, driver.deaths[entry.pid])
        assert waited <= LEASE + TICK + SLACK, f"{what} {waited:.2f} s after the kill\n{driver.report()}"
    logs = driver.logs()
    assert "Hard time limit" in logs and f"on_dead hook: run {a} is dead (max_recoveries)" in logs, logs
    assert f"run {a} of {ISOLATED} is dead" in logs, logs
    driver.assert_serial()

    d = driver.start(ISOLATED, store_id, "D", seconds=0.3)
    driver.until("a later start completed", lambda: driver.status(d) == "completed", 60)
    _record(
        "hard_time_limit",
        {
            "kill_to_redrive_seconds": round(_seconds(second.entered_at, driver.deaths[first.pid]), 3),
            "kill_to_next_holder_seconds": round(_seconds(entry_b.entered_at, driver.deaths[second.pid]), 3),
        },
    )


def test_lease_shorter_than_the_body_is_renewed_and_the_waiter_waits(driver: Driver) -> None:
    """F8, R5, S6: lease 3 s renewed every 1 s, A's body 8 s (more than twice
    the lease), B waiting, the tick running throughout: the renewals keep A's
    lease alive (its expiry moves on), nobody takes A over (one body entry, no
    recovery), and B's body starts only after A's ended."""
    store_id = driver.key("k8")
    body = 8.0
    a = driver.start(HOLD, store_id, "A", seconds=body)
    b = driver.start(HOLD, store_id, "B", seconds=0.3)
    driver.until("A and B completed", lambda: driver.settled(a, b), body + SLACK + 30)

    (entry_a,), (entry_b,) = _entries(a), _entries(b)
    run_a = Run.objects.get(pk=a)
    assert (run_a.status, run_a.recoveries) == ("completed", 0), driver.report()
    assert _seconds(entry_a.exited_at, entry_a.entered_at) >= body > 2 * LEASE
    assert entry_b.entered_at >= entry_a.exited_at, driver.report()
    assert len(driver.leases[a]) >= body / RENEW / 2, f"lease expiries seen: {sorted(driver.leases[a])}"
    assert f"run {a}: lease lost" not in driver.logs()
    driver.assert_serial()


def test_a_pause_longer_than_the_lease_is_taken_over_and_the_paused_worker_is_fenced(driver: Driver) -> None:
    """R5, D4, S6, S9 (the rule of docs/durability.rst): A's pool process is
    paused (SIGSTOP) inside A's body for longer than LEASE_SECONDS -
    LEASE_RENEW_SECONDS. No takeover before the lease ran out by the database
    clock; then another pool process re-drives A, which completes, and B runs.
    Resumed (SIGCONT), the paused process's renewal and step result are
    refused and its turn ends ``fenced``: the stored step result and output
    are the second executor's. Code already inside a step does run on after
    the takeover, which the audit shows (the paused entry exits last)."""
    store_id = driver.key("kp")
    a = driver.start(HOLD, store_id, "A", seconds=2.5, seconds_after_recovery=0.5)
    b = driver.start(HOLD, store_id, "B", seconds=0.3)
    (first,) = driver.until("A's body entered", lambda: _entries(a), 90)
    stopped_at = timezone.now()
    os.kill(first.pid, signal.SIGSTOP)
    try:
        driver.until("A completed by another process", lambda: driver.status(a) == "completed", LEASE + SLACK + 30)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    driver.until("B completed", lambda: driver.status(b) == "completed", 60)
    driver.until(
        "the paused turn fenced", lambda: f"run {a}: lease lost; this turn's writes are fenced" in driver.logs(), 60
    )
    driver.until("the paused body's exit", lambda: _entries(a)[0].exited_at is not None, 60)

    first, second = _entries(a)
    assert second.pid != first.pid
    takeover = _seconds(second.entered_at, stopped_at)
    # The last renewal was at most RENEW before the pause; the lease ran LEASE from it.
    assert takeover >= LEASE - RENEW - 0.1, f"taken over {takeover:.2f} s into the pause\n{driver.report()}"
    run_a = Run.objects.get(pk=a)
    assert (run_a.recoveries, run_a.output["pid"]) == (1, second.pid), driver.report()
    (step,) = Step.objects.filter(run_id=a)
    assert step.result == {"pid": second.pid}
    (entry_b,) = _entries(b)
    assert entry_b.entered_at >= second.exited_at
    assert first.exited_at > second.exited_at, driver.report()
    driver.assert_serial(exclude=[first.run_id])
    _record(
        "sigstop_takeover",
        {
            "pause_to_takeover_seconds": round(takeover, 3),
            "paused_body_exit_after_next_holder_entry": first.exited_at > entry_b.entered_at,
        },
    )


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


BROKEN_BROKER_SCRIPT = """
import json, sys
import django
django.setup()
from durable_singleton.runtime import get_engine
engine = get_engine()
a, b, c, key, other = sys.argv[1:6]
engine.start("fault-hold", {"store_id": key, "seconds": 0.3}, run_id=a)
engine.start("fault-hold", {"store_id": key, "seconds": 0.3}, run_id=b)
parked = engine.execute(b)
done = engine.execute(a)
engine.start("fault-hold", {"store_id": other, "seconds": 0.3}, run_id=c)
print(json.dumps({"b": parked, "a": done}))
"""


def test_broker_refusing_the_send_at_start_and_release_delays_the_key_by_at_most_a_tick(driver: Driver) -> None:
    """F4, S7, S8, S8a: a process whose broker refuses every connection (a
    closed port) starts A and B on one key and C on another (each send fails:
    logged, not raised), executes B's turn itself (B parks behind A) and then
    A's (A completes; the release wakes B and its send fails too). This
    process ticks against the real broker meanwhile. Within one lease plus one
    tick of A's end, B runs on a worker; C, whose first turn was never sent,
    runs within the redelivery interval plus one tick of its creation. No slot
    is held by a run nothing executes."""
    key, other = driver.key("k4"), driver.key("k4c")
    a, b, c = (f"{name}-{driver.tag}" for name in "ABC")
    driver.run_ids += [a, b, c]
    env = worker_env(CELERY_BROKER_URL=f"redis://127.0.0.1:{_closed_port()}/0")
    proc = subprocess.Popen(
        [sys.executable, "-c", BROKEN_BROKER_SCRIPT, a, b, c, key, other],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        driver.until("the process of the refused broker exited", lambda: proc.poll() is not None, 60)
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"b": "parked", "a": "completed"}, out
    for run_id in (a, b, c):
        assert f"could not send turn of run {run_id}; the tick will re-send it" in err, err

    driver.until("B and C completed", lambda: driver.settled(a, b, c), REDELIVERY + SLACK + 30)
    (entry_a,), (entry_b,), (entry_c,) = _entries(a), _entries(b), _entries(c)
    assert entry_a.pid == proc.pid and entry_b.pid != proc.pid and entry_c.pid != proc.pid
    assert [driver.status(r) for r in (a, b, c)] == ["completed"] * 3
    woken = _seconds(entry_b.entered_at, entry_a.exited_at)
    created_c = Run.objects.get(pk=c).created_at
    resent = _seconds(entry_c.entered_at, created_c)
    assert woken <= LEASE + TICK + SLACK, f"B ran {woken:.2f} s after A's end\n{driver.report()}"
    assert resent <= REDELIVERY + TICK + SLACK, f"C ran {resent:.2f} s after its start\n{driver.report()}"
    driver.assert_serial()
    _record(
        "broker_send_refused",
        {"release_lost_to_next_holder_seconds": round(woken, 3), "start_lost_to_body_seconds": round(resent, 3)},
    )


def test_duplicate_delivery_of_one_turn_runs_the_body_once(driver: Driver) -> None:
    """R6, F15: the first turn of each of six runs is sent three times at once
    to four pool processes on two workers: per run, one delivery wins the
    claim and completes the run, the two others end ``skipped`` without a
    write; the body entered once (one audit row, one stored step, one
    attempt)."""
    store = DjangoStore()
    quiet = Engine(store, ManualDispatcher(store))  # creates the runs, sends nothing
    quiet.dispatcher.bind(quiet)
    runs = [driver.start(HOLD, driver.key(f"kd{n}"), f"R{n}", engine=quiet, seconds=0.5) for n in range(6)]
    driver.ticking = False  # only the duplicates execute the runs
    tasks = {run_id: [execute_run.apply_async((run_id,)).id for _ in range(3)] for run_id in runs}

    def outcomes() -> dict[str, str] | None:
        """Return each task's outcome from the workers' logs, once all are there."""
        found = {m["task"]: m["outcome"] for m in OUTCOME.finditer(driver.logs())}
        return found if all(t in found for ids in tasks.values() for t in ids) else None

    seen = driver.until("every delivery reported", outcomes, 90)
    for run_id, ids in tasks.items():
        assert sorted(seen[t] for t in ids) == ["completed", "skipped", "skipped"], (run_id, driver.report())
        assert len(_entries(run_id)) == 1, driver.report()
        assert Step.objects.filter(run_id=run_id).count() == 1
        assert Run.objects.values_list("status", "attempts").get(pk=run_id) == ("completed", 1)
    logs = {w.name: w.log() for w in driver.workers[0].workers}
    handled = {name for name, log in logs.items() for ids in tasks.values() for t in ids if t in log}
    assert len(handled) == 2, f"deliveries reached only {handled}; the test did not exercise two workers"
    driver.assert_serial()
