"""Breaking the fast path of issue #17 (the PostgreSQL raw statements, the
stamped start, the deep-queue start): each test is a break found by reading
the new code against the SPEC, and fails on the commit before its fix.

* A claim whose message waited for its key's lock took a lease measured from
  the message's arrival (``STATEMENT_TIMESTAMP()``), not from its write: a wait
  longer than ``LEASE_SECONDS`` admitted the run with a lease already expired,
  so the tick could recover it while its body ran (R5, R8, S9).
* A delayed start on PostgreSQL (which stamps ``created_at`` with the
  database's clock, so skips the clock's correction) computed ``not_before``,
  ``wake_at`` and ``deadline_at`` from a process clock not corrected since it
  stepped (R8, X5).
* A start on a key whose limit an operator raised was created parked as if
  the key's queue were deep under its declared limit, while it had a free slot
  (K2, S8a).
* The one lease renewer of a process waited for a row lock another
  transaction held on one run: every other body of the process lost its
  lease meanwhile (R5, S9).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.core.test_database_clock import step_clock
from tests.helpers import hold_in_transaction


def _near(value: datetime | None, expected: datetime, tolerance: float = 5.0) -> bool:
    return value is not None and abs((value - expected).total_seconds()) <= tolerance


@pytest.mark.django_db(transaction=True)
def test_a_claim_that_waited_for_its_key_lock_takes_a_whole_lease(registry: Registry) -> None:
    """R5, R8, S9: W's claim waits for its key's lock (held by another
    transaction for longer than ``LEASE_SECONDS``); once admitted, its body
    starts with a lease of about ``LEASE_SECONDS`` from then, by the database's
    clock, and its settle is accepted. Before the fix, on PostgreSQL, the
    admission message measured the lease from its arrival: the body started
    with its lease expired (a tick could recover the run and run a second body
    beside it) and its settle was refused (fenced)."""
    lease = 2.0
    seen: list[tuple[datetime | None, datetime]] = []

    def body(ctx: Any, input: Any) -> None:
        seen.append((Run.objects.get(pk=ctx.run_id).lease_expires_at, engine.store.now()))

    registry.add("lock-wait", "1", body, singleton={"key": lambda i: "K"})
    engine = make_engine(DjangoStore(), registry=registry, LEASE_SECONDS=lease, LEASE_RENEW_SECONDS=lease / 2)
    engine.start("lock-wait", {}, run_id="W")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    holder = hold_in_transaction(
        lambda: engine.store.lock_key("lock-wait", "K"),  # type: ignore[attr-defined]
        lease + 1.0,
    )
    outcome = engine.execute("W")
    holder.join(30)
    assert len(seen) == 1, seen
    expires, now = seen[0]
    assert expires is not None and (expires - now).total_seconds() > lease / 2, (
        f"the body began with {(expires - now).total_seconds() if expires else None} s of its {lease} s lease"
    )
    assert outcome == RunStatus.COMPLETED and engine.get("W").status == RunStatus.COMPLETED


@pytest.mark.parametrize("delta", [timedelta(hours=1), timedelta(seconds=-60)], ids=["forward", "back"])
def test_a_delayed_start_of_a_stepped_process_is_timed_on_the_store_clock(
    make: Callable[..., Engine], registry: Registry, delta: timedelta
) -> None:
    """R8, X5: with the process clock stepped after its last correction, a
    start with ``not_before=30`` (seconds from now) stores ``not_before`` and
    ``wake_at`` 30 s after the store's now and its deadline 30 s + the timeout
    after it; one with ``not_before=0`` is due now, its redelivery window and
    deadline counted from now; with and without a queue cap (the capped start
    takes the store's locked path). Before the fix, on PostgreSQL (whose start
    stamps ``created_at`` itself and so skipped the correction), they were off
    by the step: an hour late, or a minute early."""
    registry.add("later", "1", lambda ctx, i: None, timeout=600)
    capped = {"key": lambda i: "K", "max_queue_depth": 5}
    registry.add("later-capped", "1", lambda ctx, i: None, timeout=600, singleton=capped)
    engine = make()
    step_clock(engine, delta)
    for name in ("later", "later-capped"):
        engine.start(name, {}, run_id=f"{name}-30", not_before=30)
        engine.start(name, {}, run_id=f"{name}-0", not_before=0)
    now = engine.store.now()
    redelivery = timedelta(seconds=engine.settings.REDELIVERY_SECONDS)
    for name in ("later", "later-capped"):
        later, due = engine.get(f"{name}-30"), engine.get(f"{name}-0")
        assert _near(later.not_before, now + timedelta(seconds=30)), (name, later.not_before, now)
        assert _near(later.wake_at, now + timedelta(seconds=30)), (name, later.wake_at, now)
        assert _near(later.deadline_at, now + timedelta(seconds=630)), (name, later.deadline_at, now)
        assert _near(due.not_before, now), (name, due.not_before, now)
        assert _near(due.wake_at, now + redelivery), (name, due.wake_at, now)
        assert _near(due.deadline_at, now + timedelta(seconds=600)), (name, due.deadline_at, now)


def test_a_start_on_a_key_whose_limit_was_raised_is_sent_its_turn(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """K2, S8a: key K's limit is raised from its declared 1 to 3; with H holding
    a slot (asleep) and W waiting for its first turn, a third start N finds two
    free slots: it is sent its turn and admitted, beside H and W, without
    waiting for a tick. Before the fix the start judged the queue deep by the
    declared limit (1 holder and 1 waiter) and created N parked, with no turn,
    until the tick's catch-up (or its backlog retry) admitted it."""

    def body(ctx: Any, input: Any) -> None:
        if input.get("hold"):
            ctx.sleep(3600)

    registry.add("raised", "1", body, singleton={"key": lambda i: "K", "limit": 1})
    engine = make()
    engine.controls.override_limit("raised", "K", 3)
    engine.start("raised", {"hold": True}, run_id="H")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("H").admitted and engine.get("H").status == RunStatus.SUSPENDED
    engine.start("raised", {}, run_id="W")
    started = engine.start("raised", {}, run_id="N")
    assert started.park_reason == "", f"N was created parked ({started.park_reason!r}) beside two free slots"
    assert "N" in engine.dispatcher.queue, "N's first turn was not sent"  # type: ignore[attr-defined]
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("W").status == RunStatus.COMPLETED and engine.get("N").status == RunStatus.COMPLETED


@pytest.mark.django_db(transaction=True)
def test_a_run_locked_by_another_transaction_holds_back_no_other_lease(registry: Registry) -> None:
    """R5, S9: bodies A and B run in one process, whose one renewer thread
    renews both leases. Another transaction holds A's row lock for longer than
    ``LEASE_SECONDS`` (a view that signalled A inside its request's
    transaction, say): B's lease is renewed meanwhile and B completes. Before
    the fix the renewal of A waited for the lock, B's renewals queued behind it
    on the same thread, B's lease expired and its settle was refused (fenced).
    SQLite locks the whole database, so every write waits there: not run."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: a writer holds back every write")
    lease = 1.5
    entered: set[str] = set()
    go = threading.Event()

    def body(ctx: Any, input: Any) -> None:
        entered.add(ctx.run_id)
        assert go.wait(30), "the test never let the bodies finish"

    registry.add("renewed", "1", body)
    engine = make_engine(DjangoStore(), registry=registry, LEASE_SECONDS=lease, LEASE_RENEW_SECONDS=0.3)
    for run_id in ("A", "B"):
        engine.start("renewed", {}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    outcomes: dict[str, str] = {}

    def execute(run_id: str) -> None:
        try:
            outcomes[run_id] = engine.execute(run_id)
        finally:
            connections.close_all()

    bodies = [threading.Thread(target=execute, args=(r,), daemon=True) for r in ("A", "B")]
    for thread in bodies:
        thread.start()
    deadline = time.monotonic() + 10
    while entered != {"A", "B"}:
        assert time.monotonic() < deadline, f"the bodies did not start: {entered}"
        time.sleep(0.01)
    released = threading.Event()

    def lock_a() -> None:
        try:
            with transaction.atomic():
                Run.objects.select_for_update().get(pk="A")
                time.sleep(lease + 1.5)
        finally:
            released.set()
            connections.close_all()

    locker = threading.Thread(target=lock_a, daemon=True)
    locker.start()
    assert released.wait(30)
    go.set()
    for thread in (*bodies, locker):
        thread.join(30)
    assert outcomes.get("B") == RunStatus.COMPLETED, f"B's lease was not renewed while A's row was locked: {outcomes}"
