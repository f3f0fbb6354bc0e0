"""One lease renewer per process (issue #17; R5, R5a, O1, S9).

Every running body's lease is renewed by one thread of the process
(:mod:`durable_singleton.leases`), not by a thread started per turn:
``Thread.start()`` waits for the new thread to be scheduled, 0.7-2.6 ms of a
turn's wall time on a loaded machine (docs/design.rst, "Leases"). These tests
hold it to what the per-turn keeper did: many bodies at once keep their
leases, a renewal whose connection the server killed reconnects, and a lease
found taken over is dropped and fences its body.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections

from durable_singleton.definitions import Registry
from durable_singleton.leases import RENEWER_THREAD, renewer
from durable_singleton.statuses import Outcome, RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.conftest import run_threads
from tests.helpers import backend_id, kill_backend, sleep_past_lease
from tests.worker_processes import wait_for


class _Recording:
    """A store that records each lease renewal it answers: (owner, lease_seconds, renewed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.renewals: list[tuple[str, float, bool]] = []
        self.renewal_threads: set[str] = set()
        #: Called with a renewal's ``lease_seconds`` before it is made (a test holds one back).
        self.before_renewal: Callable[[float], None] = lambda lease_seconds: None

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        self.renewal_threads.add(threading.current_thread().name)
        self.before_renewal(lease_seconds)
        renewed = bool(super().renew_lease(run_id, owner, lease_seconds))  # type: ignore[misc]
        self.renewals.append((owner, lease_seconds, renewed))
        return renewed


class RecordingMemoryStore(_Recording, MemoryStore):
    pass


class RecordingDjangoStore(_Recording, DjangoStore):
    pass


def _store(store_kind: str) -> Any:
    return RecordingMemoryStore() if store_kind == "memory" else RecordingDjangoStore()


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name or t.name.startswith(f"{name}:")]


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_many_concurrent_bodies_share_one_renewer_thread(store_kind: str) -> None:
    """R5, S9: six bodies run at once, each a step longer than its lease; one
    thread of the process renews all six leases (no thread per turn), and every
    run completes without a takeover."""
    store = _store(store_kind)
    engine = make_engine(store, registry=Registry(), LEASE_SECONDS=2.0, LEASE_RENEW_SECONDS=0.2)
    inside = threading.Barrier(7, timeout=60)
    seen: dict[str, int] = {}
    first_leases: list[Any] = []
    leases_read = threading.Event()

    def every_lease_renewed_past_its_first() -> bool:
        renewed = {owner for owner, _, renewed in store.renewals if renewed}
        return len(renewed) == 6 and store.now() > first_leases[0]

    def long(seconds: float) -> float:
        inside.wait()  # all six bodies are inside their step
        assert leases_read.wait(60)
        # Held until each lease was renewed and the store's clock passed the leases the
        # claims took: a body longer than its lease, however slowly the machine runs it.
        wait_for(every_lease_renewed_past_its_first, 60, "every lease renewed past its first expiry")
        return seconds

    engine.registry.add_step("renewer:long", long)
    engine.registry.add(
        "renewer", "1", lambda ctx, i: ctx.step("renewer:long", 1.5), singleton={"key": str, "limit": 6}
    )
    runs = [engine.start("renewer", f"k-{n % 2}", run_id=f"renewer-{n}") for n in range(6)]
    worker = threading.Thread(target=run_threads, args=(6, lambda n: engine.execute(runs[n].run_id)))
    worker.start()
    inside.wait()
    first_leases.append(max(engine.get(run.run_id).lease_expires_at for run in runs))
    leases_read.set()
    seen["renewer threads"] = len(_threads(RENEWER_THREAD))
    seen["per-turn lease threads"] = len(_threads("lease"))
    worker.join(120)
    assert not worker.is_alive(), "a thread of the test is still running"
    assert seen == {"renewer threads": 1, "per-turn lease threads": 0}
    assert store.renewal_threads == {RENEWER_THREAD}
    assert len({owner for owner, _, renewed in store.renewals if renewed}) == 6, "every lease was renewed"
    for run in runs:
        done = engine.get(run.run_id)
        assert (done.status, done.recoveries) == (RunStatus.COMPLETED, 0), done.run_id


class KillableDjangoStore(DjangoStore):
    """The Django store that records, at each renewal, the server's id of the
    renewer thread's connection (SQLite: the connection object)."""

    def __init__(self) -> None:
        super().__init__()
        self.backends: list[Any] = []
        self.failures = 0
        #: SQLite: close the renewer's connection on its own thread after its next renewal.
        self.close_after_renewal = False

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        try:
            if connection.vendor == "sqlite":
                connection.ensure_connection()
                self.backends.append(connection.connection)
            else:
                self.backends.append(backend_id())
            renewed = super().renew_lease(run_id, owner, lease_seconds)
        except Exception:
            self.failures += 1
            raise
        if self.close_after_renewal:
            # Closed under Django, between two renewals, on the thread that owns it: a
            # close from another thread during a statement crashes the sqlite3 module.
            self.close_after_renewal = False
            connection.connection.close()
        return renewed


def _kill(store: KillableDjangoStore, backend: Any) -> None:
    if connection.vendor == "sqlite":
        store.close_after_renewal = True  # no server to kill it: the connection is closed under Django
        deadline = time.monotonic() + 10
        while store.close_after_renewal and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        kill_backend(backend)


@pytest.mark.django_db(transaction=True)
def test_a_renewal_on_a_killed_connection_reconnects(caplog: pytest.LogCaptureFixture) -> None:
    """O1, R5: the renewer's connection is killed by the server
    (``pg_terminate_backend``, ``KILL CONNECTION``; SQLite: closed under it)
    while a body runs a step longer than its lease. The next renewal fails,
    the renewer reconnects, the renewals after it succeed on a new connection,
    and the run completes, never taken over; the renewer thread lives on."""
    store = KillableDjangoStore()
    engine = make_engine(store, registry=Registry(), LEASE_SECONDS=1.0, LEASE_RENEW_SECONDS=0.15)
    engine.registry.add_step("renewer:long", lambda seconds: time.sleep(seconds) or seconds)
    engine.registry.add("renewer", "1", lambda ctx, i: ctx.step("renewer:long", 2.0) and "done")
    run = engine.start("renewer", None, run_id="renewer-killed")
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: (outcome.append(engine.execute(run.run_id)), connections.close_all()))
    with caplog.at_level(logging.WARNING, "durable_singleton"):
        worker.start()
        deadline = time.monotonic() + 10
        while not store.backends and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.backends, "a renewal ran"
        thread = renewer().thread
        first = store.backends[0]
        _kill(store, first)
        worker.join(60)
        assert not worker.is_alive(), "a thread of the test is still running"
    assert outcome == [Outcome.COMPLETED]
    assert store.failures >= 1, "a renewal met the killed connection"
    later = store.backends[store.backends.index(first) + 1 :]
    assert any(b != first for b in later), "a renewal ran on a new connection"
    assert "lease renewal failed; retrying" in caplog.text
    assert renewer().thread is thread and thread is not None and thread.is_alive()
    done = engine.get(run.run_id)
    assert (done.status, done.output, done.recoveries) == (RunStatus.COMPLETED, "done", 0)


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_lease_taken_over_is_dropped_and_its_body_fenced(store_kind: str) -> None:
    """R5, R5a, S9: A's lease (0.4 s, renewed late, every 1 s) expires and B's
    engine takes the run over. A's first renewal finds the lease B's: it is
    never tried again, A's body stops at its next boundary (fenced), and the
    same renewer thread goes on renewing B's lease until B completes.

    Nothing here is timed by a sleep: A's renewal is held back until B's claim
    is seen (on a loaded machine it could come before B's claim and renew A's
    lease, or B's claim before A's), and the bodies hold their step until the
    renewer renewed B's lease for longer than A's interval after dropping A's,
    so a second try of A's lease would have come while A's body still ran."""
    store = _store(store_kind)
    registry = Registry()
    a = make_engine(store, registry=registry, LEASE_SECONDS=0.4, LEASE_RENEW_SECONDS=1.0)
    b = make_engine(store, registry=registry, LEASE_SECONDS=30.0, LEASE_RENEW_SECONDS=0.2)
    taken_over = threading.Event()

    def hold_back_a(lease_seconds: float) -> None:
        if lease_seconds == 0.4:
            assert taken_over.wait(60), "B never took the run over"

    store.before_renewal = hold_back_a

    def a_dropped_long_ago() -> bool:
        answered = [n for n, (_, seconds, _) in enumerate(store.renewals) if seconds == 0.4]
        if not answered:
            return False
        later = [renewed for _, seconds, renewed in store.renewals[answered[0] + 1 :] if seconds == 30.0]
        # B's renewals are at least half its interval (0.1 s) apart: 12 span more than A's 1 s.
        return len(later) >= 12

    def hold(_: Any) -> None:
        wait_for(a_dropped_long_ago, 60, "A's renewal answered, then B's lease renewed for longer than A's interval")

    registry.add_step("renewer:hold", hold)
    registry.add_step("renewer:next", lambda x: x)

    def body(ctx: Any, input: Any) -> str:
        ctx.step("renewer:hold", None)
        ctx.step("renewer:next", 0)
        return ctx.owner  # type: ignore[no-any-return]

    registry.add("renewer", "1", body, singleton={"key": lambda i: "k"})
    run = a.start("renewer", None, run_id="renewer-fenced")
    outcomes: dict[str, str] = {}

    def turn(name: str, engine: Any) -> None:
        try:
            outcomes[name] = engine.execute(run.run_id)
        finally:
            connections.close_all()

    def lease_owner() -> str | None:
        current = a.get(run.run_id)
        return current.lease_owner if current.status == RunStatus.RUNNING else None

    first = threading.Thread(target=turn, args=("A", a))
    first.start()
    a_owner = wait_for(lease_owner, 60, "A claimed the run")
    sleep_past_lease(a, run.run_id, timeout=60)  # A's lease expired; its renewal is held back
    second = threading.Thread(target=turn, args=("B", b))
    second.start()
    wait_for(
        lambda: lease_owner() not in (None, a_owner),
        60,
        "B took the run over",
        lambda: f"outcomes {outcomes}, the run {a.get(run.run_id)}, B alive {second.is_alive()}",
    )
    taken_over.set()
    first.join(60)
    second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert outcomes == {"A": Outcome.FENCED, "B": Outcome.COMPLETED}
    a_renewals = [renewed for _, seconds, renewed in store.renewals if seconds == 0.4]
    assert a_renewals == [False], "A's lease was tried once, found taken over, and dropped"
    assert any(renewed for _, seconds, renewed in store.renewals if seconds == 30.0), "B's lease was renewed"
    done = b.get(run.run_id)
    assert (done.status, done.recoveries) == (RunStatus.COMPLETED, 1)
    assert store.renewal_threads == {RENEWER_THREAD}
