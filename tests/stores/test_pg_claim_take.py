"""Adversarial: a run without a key takes its lease in its claim message on
PostgreSQL (``pg.CLAIM_TAKE``, e0046d4, #17). Every test runs against both
paths of the Django store, the fast path (raw SQL, PostgreSQL only) and the
ORM path (``DjangoStore(raw_sql=False)``), which must agree; elsewhere both
parameters take the ORM path.

Each test cites the SPEC rules it guards.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.conftest import run_threads
from tests.helpers import claim, hold_in_transaction

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["fast", "orm"])
def raw_sql(request: pytest.FixtureRequest) -> bool:
    return request.param == "fast"


def _engine(registry: Registry, raw_sql: bool, **settings: Any) -> Engine:
    engine = make_engine(DjangoStore(raw_sql=None if raw_sql else False), registry=registry, **settings)
    fast = engine.store._fast()  # type: ignore[attr-defined]
    if raw_sql and connection.vendor == "postgresql":
        assert fast is not None, "the fast path is not in use"
    if not raw_sql:
        assert fast is None
    return engine


def _threads(n: int, target: Any) -> list[Any]:
    """:func:`tests.conftest.run_threads` (30 s), re-raising the first exception a thread raised."""
    results = run_threads(n, target, timeout=30)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _row(run_id: str) -> Run:
    return Run.objects.get(pk=run_id)


# -- R6: two deliveries at once ---------------------------------------------------------------------
@pytest.mark.parametrize("rounds", [6])
def test_two_deliveries_of_a_plain_turn_at_once_run_the_body_once(
    registry: Registry, raw_sql: bool, rounds: int
) -> None:
    """R6, S4, R5a: several deliveries of the same turn of a parked run without
    a key, at once on their own connections: one claim wins (attempts + 1),
    the others skip; the body runs once."""
    calls: list[str] = []
    lock = threading.Lock()

    def body(ctx: Any, input: Any) -> str:
        with lock:
            calls.append(ctx.run_id)
        return "ok"

    registry.add("plain", "1", body)
    engine = _engine(registry, raw_sql)
    for r in range(rounds):
        engine.start("plain", {}, run_id=f"p{r}")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    for r in range(rounds):
        outcomes = _threads(4, lambda i, r=r: engine.execute(f"p{r}"))
        assert sorted(outcomes).count("skipped") == 3, outcomes
        run = engine.get(f"p{r}")
        assert run.status == RunStatus.COMPLETED and run.attempts == 1, (run.status, run.attempts)
    assert sorted(calls) == sorted(f"p{r}" for r in range(rounds)), calls


def test_two_claims_at_once_of_a_plain_run_one_wins_attempts_once(registry: Registry, raw_sql: bool) -> None:
    """R6, R5a, S4: raw claims (begin_turn) at once: exactly one RUN, attempts 1,
    the lease the winner's."""
    registry.add("plain", "1", lambda ctx, i: None)
    engine = _engine(registry, raw_sql)
    for r in range(5):
        engine.start("plain", {}, run_id=f"c{r}")
        turns = _threads(6, lambda i, r=r: claim(engine, f"c{r}", owner=f"o{i}"))
        won = [t for t in turns if t.state is TurnState.RUN]
        assert len(won) == 1, [t.state for t in turns]
        row = _row(f"c{r}")
        assert row.attempts == 1 and row.status == RunStatus.RUNNING
        assert row.lease_owner == won[0].run.lease_owner
        assert won[0].run.attempts == 1


# -- S9, D6: a claim racing a cancel -----------------------------------------------------------------
def test_a_claim_racing_a_cancel_never_runs_a_cancelled_run(registry: Registry, raw_sql: bool) -> None:
    """S9, D6, R5a: claims and ``engine.cancel`` of a parked run without a key at
    once: either the cancel finds it parked and it ends ``cancelled`` with no
    body run, or a claim won first and the running body, held after its first
    step until the cancel returned, stops at its next step boundary
    (cancelled); never ``completed`` after an accepted cancel."""
    registry.add_step("s", lambda x: x)
    ran: list[str] = []
    gates: dict[str, threading.Event] = {}

    def body(ctx: Any, input: Any) -> str:
        ran.append(ctx.run_id)
        ctx.step("s", 1)
        gates[ctx.run_id].wait(3)  # the cancel has returned: a flag it set is seen at the next boundary
        ctx.step("s", 2)
        return "done"

    registry.add("plain", "1", body)
    engine = _engine(registry, raw_sql)
    for r in range(8):
        run_id = f"x{r}"
        gates[run_id] = threading.Event()
        engine.start("plain", {}, run_id=run_id)
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

        def go(i: int, run_id: str = run_id) -> Any:
            if i == 0:
                try:
                    return engine.cancel(run_id)
                finally:
                    gates[run_id].set()
            return engine.execute(run_id)

        results = _threads(3, go)
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        cancel = results[0]
        run = engine.get(run_id)
        assert cancel.status in (RunStatus.CANCELLED, RunStatus.RUNNING), cancel.status
        assert run.status == RunStatus.CANCELLED, (run_id, cancel.status, run.status, ran)
        assert len(engine.store.load_steps(run_id)) <= 1, run_id  # a running body stopped at its next boundary
        if cancel.status == RunStatus.CANCELLED:
            assert run_id not in ran, (run_id, ran)  # cancelled while parked: no body after it


@pytest.mark.skipif(connection.vendor == "sqlite", reason="a row lock held by another transaction")
@pytest.mark.parametrize("write", ["cancelled", "flag"])
def test_a_claim_blocked_behind_a_cancel_in_flight_does_not_take_the_run(
    registry: Registry, raw_sql: bool, write: str
) -> None:
    """S9, D6, R5a, R6: a cancel's transaction holds the run's row (it wrote the
    cancel, not yet committed) while a turn's claim arrives: the claim waits
    for the row and must judge the row as the cancel left it, never take the
    lease of a cancelled run, nor run its body, nor undo the cancel."""
    from django.db import transaction

    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="k")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    locked = threading.Event()

    def go(i: int) -> Any:
        if i == 0:
            with transaction.atomic():
                if write == "cancelled":
                    Run.objects.filter(pk="k").update(status=RunStatus.CANCELLED, wake_at=None)
                else:
                    Run.objects.filter(pk="k").update(cancel_requested=True)
                locked.set()
                import time

                time.sleep(0.6)
            return None
        locked.wait(5)
        return engine.execute("k")

    barrier_free = _threads(2, go)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    row = _row("k")
    assert ran == [], (ran, barrier_free)
    assert row.attempts == 0 and row.lease_owner is None, (row.status, row.attempts, row.lease_owner)
    if write == "cancelled":
        assert row.status == RunStatus.CANCELLED, row.status
    else:  # a flag alone (no turn sent by this synthetic write): never running, never a body
        assert row.status in (RunStatus.CANCELLED, RunStatus.PENDING) and row.cancel_requested, row.status


def test_a_cancelled_parked_run_is_not_taken_by_a_late_turn(registry: Registry, raw_sql: bool) -> None:
    """S9, D6: a turn delivered after a parked run was cancelled runs no body and
    leaves it ``cancelled`` (no attempt counted)."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="c")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.cancel("c")
    assert engine.execute("c") == "skipped"
    assert engine.get("c").status == RunStatus.CANCELLED and ran == []
    assert engine.get("c").attempts == 0


def test_a_cancel_requested_flag_on_a_parked_run_settles_it_cancelled(registry: Registry, raw_sql: bool) -> None:
    """S9, D6, R5a: a parked run whose ``cancel_requested`` is set (a cancel that
    reached it while it ran, then it parked) is never taken: its turn settles
    it ``cancelled`` and no body runs."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="c")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk="c").update(status=RunStatus.SUSPENDED, cancel_requested=True)
    engine.execute("c")
    assert engine.get("c").status == RunStatus.CANCELLED and ran == []


def _signal_waiter(registry: Registry) -> list[Any]:
    """Register the workflow ``waiter`` (no key) whose body waits for the signal
    ``go`` and returns it; return the list each pass past the wait appends the
    signal's payload to (from any thread)."""
    after: list[Any] = []
    lock = threading.Lock()

    def body(ctx: Any, input: Any) -> Any:
        got = ctx.wait_for_signal("go")
        with lock:
            after.append(got)
        return got

    registry.add("waiter", "1", body)
    return after


# -- D2: a run waiting for a signal ---------------------------------------------------------------
def test_a_turn_delivered_before_the_signal_does_not_pass_the_wait_nor_lose_it(
    registry: Registry, raw_sql: bool
) -> None:
    """D2, R6: a run waiting for a signal gets a turn early (a duplicate): it
    replays to the wait and parks again (one attempt more, no step past the
    wait); the signal sent later is then received, once."""
    after = _signal_waiter(registry)
    engine = _engine(registry, raw_sql)
    engine.start("waiter", {}, run_id="w")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    run = engine.get("w")
    assert run.status == RunStatus.SUSPENDED and run.attempts == 1
    assert engine.execute("w") == RunStatus.SUSPENDED or engine.get("w").status == RunStatus.SUSPENDED
    run = engine.get("w")
    assert run.status == RunStatus.SUSPENDED and run.attempts == 2, (run.status, run.attempts)
    assert after == []
    engine.signal("w", "go", {"v": 1})
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    run = engine.get("w")
    assert run.status == RunStatus.COMPLETED and run.output == {"v": 1}, (run.status, run.output)
    assert after == [{"v": 1}] and run.attempts == 3


def test_duplicate_turns_after_a_signal_deliver_it_once(registry: Registry, raw_sql: bool) -> None:
    """D2, R6: after the signal, several deliveries of the wake-up turn at once:
    the body passes the wait once."""
    after = _signal_waiter(registry)
    engine = _engine(registry, raw_sql)
    engine.start("waiter", {}, run_id="w")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.signal("w", "go", 7)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    _threads(4, lambda i: engine.execute("w"))
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    run = engine.get("w")
    assert run.status == RunStatus.COMPLETED and after == [7], (run.status, after)
    assert run.attempts == 2, run.attempts


# -- D1: a sleeping run ---------------------------------------------------------------------------
def test_a_sleeping_run_whose_turn_arrives_early_sleeps_on(registry: Registry, raw_sql: bool) -> None:
    """D1, R6: a run sleeping an hour gets a turn early: it replays, parks again
    with the same wake time, one attempt more, and nothing after the sleep runs."""
    after: list[str] = []

    def body(ctx: Any, input: Any) -> str:
        ctx.sleep(3600)
        after.append("woke")
        return "woke"

    registry.add("sleeper", "1", body)
    engine = _engine(registry, raw_sql)
    engine.start("sleeper", {}, run_id="s")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    first = engine.get("s")
    assert first.status == RunStatus.SUSPENDED and first.attempts == 1
    engine.execute("s")
    again = engine.get("s")
    assert again.status == RunStatus.SUSPENDED and after == [], (again.status, after)
    assert again.attempts == 2
    assert again.wake_at is not None and abs((again.wake_at - first.wake_at).total_seconds()) < 1  # type: ignore[operator]


# -- X5: a delayed start ---------------------------------------------------------------------------
def test_a_delayed_start_is_not_run_early(registry: Registry, raw_sql: bool) -> None:
    """X5, R5: a run without a key started with ``not_before`` an hour ahead: a
    turn delivered now runs no body, counts no attempt, leaves it pending with
    ``wake_at`` at its ``not_before``."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    run = engine.start("plain", {}, run_id="d", not_before=3600)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    for _ in range(2):
        assert engine.execute("d") == "skipped"
    row = _row("d")
    assert ran == [] and row.status == RunStatus.PENDING and row.attempts == 0, (ran, row.status, row.attempts)
    assert row.lease_owner is None and row.wake_at == row.not_before
    assert run.not_before is not None


def test_a_delayed_start_whose_time_passed_on_the_database_clock_runs(registry: Registry, raw_sql: bool) -> None:
    """X5, R5: once ``not_before`` has passed (database clock), the turn runs it, once."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="d", not_before=3600)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert engine.execute("d") == "skipped"
    Run.objects.filter(pk="d").update(not_before=engine.store.now() - timedelta(seconds=1))
    engine.execute("d")
    assert ran == ["d"] and engine.get("d").status == RunStatus.COMPLETED and engine.get("d").attempts == 1


def test_a_suspended_run_with_a_future_not_before_is_not_taken(registry: Registry, raw_sql: bool) -> None:
    """X5: not_before gates every parked status, not only pending (both paths
    agree on a suspended run whose not_before is ahead)."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="d")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk="d").update(status=RunStatus.SUSPENDED, not_before=engine.store.now() + timedelta(hours=1))
    engine.execute("d")
    row = _row("d")
    assert ran == [] and row.status == RunStatus.SUSPENDED and row.attempts == 0, (ran, row.status)


# -- R5, D4: running runs ---------------------------------------------------------------------------
def test_a_running_run_with_a_live_lease_is_not_taken(registry: Registry, raw_sql: bool) -> None:
    """R5, R6: a running run without a key, lease unexpired: a turn skips it and
    changes nothing (owner, expiry, attempts)."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="r")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    turn = claim(engine, "r", owner="holder")
    assert turn.state is TurnState.RUN
    before = _row("r")
    assert engine.execute("r") == "skipped"
    after = _row("r")
    assert ran == []
    assert (after.status, after.lease_owner, after.lease_expires_at, after.attempts, after.recoveries) == (
        before.status,
        before.lease_owner,
        before.lease_expires_at,
        before.attempts,
        before.recoveries,
    )


def test_a_running_run_with_an_expired_lease_is_recovered_once(registry: Registry, raw_sql: bool) -> None:
    """D4, R5, R6: an expired lease: several turns at once, one recovers it
    (recoveries + 1, attempts + 1) and the body completes once."""
    ran: list[str] = []
    lock = threading.Lock()

    def body(ctx: Any, input: Any) -> None:
        with lock:
            ran.append(ctx.run_id)

    registry.add("plain", "1", body)
    engine = _engine(registry, raw_sql)
    engine.start("plain", {}, run_id="r")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert claim(engine, "r", owner="crashed").state is TurnState.RUN
    Run.objects.filter(pk="r").update(lease_expires_at=engine.store.now() - timedelta(seconds=1))
    outcomes = _threads(3, lambda i: engine.execute("r"))
    row = _row("r")
    assert ran == ["r"], (ran, outcomes)
    assert row.status == RunStatus.COMPLETED and row.recoveries == 1 and row.attempts == 2, (
        row.status,
        row.recoveries,
        row.attempts,
    )


def test_past_max_recoveries_a_run_without_a_key_goes_dead(registry: Registry, raw_sql: bool) -> None:
    """D4: an expired lease at MAX_RECOVERIES: the turn makes it ``dead``
    (recoveries + 1), no body runs."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, raw_sql, MAX_RECOVERIES=2)
    engine.start("plain", {}, run_id="r")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert claim(engine, "r", owner="crashed").state is TurnState.RUN
    Run.objects.filter(pk="r").update(recoveries=2, lease_expires_at=engine.store.now() - timedelta(seconds=1))
    engine.execute("r")
    row = _row("r")
    assert ran == [] and row.status == RunStatus.DEAD and row.recoveries == 3, (ran, row.status, row.recoveries)


# -- remote workflows, children -------------------------------------------------------------------
def test_a_remote_workflow_is_handed_back_parked(registry: Registry, raw_sql: bool) -> None:
    """S4, R5a: a workflow this worker has no body for: the claim takes its lease,
    the turn hands it back pending with its lease dropped and sends it to its
    queue; each hand-back counts one attempt; the paths agree."""
    registry.add("remote", "1", None, queue="elsewhere", remote=True)
    engine = _engine(registry, raw_sql)
    engine.start("remote", {}, run_id="rm")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    for n in (1, 2):
        assert engine.execute("rm") == "parked"
        row = _row("rm")
        assert row.status == RunStatus.PENDING and row.lease_owner is None and row.attempts == n, (
            row.status,
            row.lease_owner,
            row.attempts,
        )


def test_a_child_run_without_a_key_runs_once_and_wakes_its_parent(registry: Registry, raw_sql: bool) -> None:
    """D7, R6: a parent calls a child (both without a key); duplicate deliveries
    of the child's turn at once run its body once; the parent completes with
    the child's output."""
    child_calls: list[str] = []
    lock = threading.Lock()

    def child(ctx: Any, input: Any) -> int:
        with lock:
            child_calls.append(ctx.run_id)
        return int(input) * 2

    def parent(ctx: Any, input: Any) -> Any:
        return ctx.call_child("child", 21)

    registry.add("child", "1", child)
    registry.add("parent", "1", parent)
    engine = _engine(registry, raw_sql)
    engine.start("parent", {}, run_id="P")
    engine.execute("P")  # starts the child, parks
    kids = list(Run.objects.filter(parent_run_id="P").values_list("run_id", flat=True))
    assert len(kids) == 1
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    _threads(3, lambda i: engine.execute(kids[0]))
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert child_calls == kids, child_calls
    assert engine.get(kids[0]).attempts == 1
    p = engine.get("P")
    assert p.status == RunStatus.COMPLETED and p.output == 42, (p.status, p.output)


def test_cancelling_a_parent_cancels_a_parked_child_no_child_body_runs(registry: Registry, raw_sql: bool) -> None:
    """D6, S9: cancel a parent while its child (without a key) is parked; then
    deliver the child's turn: no child body runs, the child is cancelled."""
    child_calls: list[str] = []
    registry.add("child", "1", lambda ctx, i: child_calls.append(ctx.run_id))
    registry.add("parent", "1", lambda ctx, i: ctx.call_child("child", 1))
    engine = _engine(registry, raw_sql)
    engine.start("parent", {}, run_id="P")
    engine.execute("P")
    kid = Run.objects.get(parent_run_id="P").run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.cancel("P")
    engine.execute(kid)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert child_calls == [] and engine.get(kid).status == RunStatus.CANCELLED
    assert engine.get("P").status == RunStatus.CANCELLED


# -- attempts --------------------------------------------------------------------------------------
def test_attempts_count_one_per_turn(registry: Registry, raw_sql: bool) -> None:
    """D4, R5a: a body that sleeps 0 three times (each a turn): the attempts
    counted equal the turns that ran it, on both paths."""
    registry.add("multi", "1", lambda ctx, i: [ctx.sleep(0.01) for _ in range(3)] and "ok")
    engine = _engine(registry, raw_sql)
    engine.start("multi", {}, run_id="m")
    turns = 0
    import time

    while engine.get("m").status != RunStatus.COMPLETED and turns < 20:
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        time.sleep(0.02)
        engine.execute("m")
        turns += 1
    row = engine.get("m")
    assert row.status == RunStatus.COMPLETED and row.attempts == turns, (row.status, row.attempts, turns)


def test_a_blocked_run_without_a_key_is_re_driven(registry: Registry, raw_sql: bool) -> None:
    """D3, R6: a blocked run without a key, its turn delivered twice at once: one
    turn replays the body (one attempt), it blocks again; nothing past the block."""
    past: list[str] = []
    entered: list[str] = []

    def body(ctx: Any, input: Any) -> None:
        entered.append(ctx.run_id)
        ctx.block("waiting on the world", poll_seconds=60)
        past.append("x")

    registry.add("blk", "1", body)
    engine = _engine(registry, raw_sql)
    engine.start("blk", {}, run_id="b")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("b").status == RunStatus.BLOCKED and engine.get("b").attempts == 1
    _threads(2, lambda i: engine.execute("b"))
    row = engine.get("b")
    # The two deliveries may overlap (one skips) or follow each other (each replays): one attempt per replay.
    assert row.status == RunStatus.BLOCKED and past == [], (row.status, past)
    assert row.attempts == len(entered) and len(entered) in (2, 3), (row.attempts, entered)


class _SignalAfterLoad(DjangoStore):
    """Lands ``engine.signal`` right after a turn's body read the run's signals (none yet)."""

    engine: Any = None
    armed = False

    def load_signals(self, run_id: str) -> Any:
        loaded = super().load_signals(run_id)
        if self.armed:
            self.armed = False
            self.engine.signal(run_id, "go", "late")
        return loaded


@pytest.mark.parametrize("early", [True, False], ids=["early-turn", "first-turn"])
def test_a_signal_landing_while_an_early_turn_parks_is_not_lost(registry: Registry, raw_sql: bool, early: bool) -> None:
    """D2, R5a, R6: a run without a key waiting for a signal; a turn (an early
    duplicate, or its first) reads no signal, then the signal lands before the
    body parks: the park must not strand it: the run completes with it, the
    body passing the wait once."""
    after = _signal_waiter(registry)
    store = _SignalAfterLoad(raw_sql=None if raw_sql else False)
    engine = make_engine(store, registry=registry)
    store.engine = engine
    engine.start("waiter", {}, run_id="w")
    if early:
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        assert engine.get("w").status == RunStatus.SUSPENDED
    else:
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    store.armed = True
    engine.execute("w")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    run = engine.get("w")
    assert run.status == RunStatus.COMPLETED and run.output == "late" and after == ["late"], (
        run.status,
        run.output,
        after,
    )


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's prepared statements (the fast path)")
@pytest.mark.parametrize("dropped", ["claim_take", "read", "claim_admit"])
def test_a_claim_message_whose_statement_was_deallocated_takes_the_lease_once(registry: Registry, dropped: str) -> None:
    """R6, R5a, S4: a prepared statement of the claim message dropped behind the
    process's back (a pooler's DEALLOCATE): the message fails as a whole (its
    take rolled back) and is sent again: one lease, attempts 1, the body once."""
    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, True)
    engine.start("plain", {}, run_id="a")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.start("plain", {}, run_id="b")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.execute("a")  # prepares the claim message on this connection
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements")
        names = [r[0] for r in cursor.fetchall() if r[0].startswith(f"ds_{dropped}_")]
        if not names:
            pytest.skip(f"no statement {dropped} in this commit's claim message")
        assert len(names) == 1, names
        cursor.execute(f"DEALLOCATE {names[0]}")
    engine.execute("b")
    row = _row("b")
    assert ran == ["a", "b"] and row.status == RunStatus.COMPLETED and row.attempts == 1, (ran, row.attempts)


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path")
def test_a_claim_inside_a_callers_transaction_that_rolls_back_takes_nothing(registry: Registry) -> None:
    """R5a, R6: a turn executed inside a caller's transaction that then rolls
    back: the claim's take is undone with it (the run is parked again, no
    attempt counted), and a later turn runs it once."""
    from django.db import transaction

    ran: list[str] = []
    registry.add("plain", "1", lambda ctx, i: ran.append(ctx.run_id))
    engine = _engine(registry, True)
    engine.start("plain", {}, run_id="t")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

    class BoomError(Exception):
        pass

    with pytest.raises(BoomError), transaction.atomic():
        assert claim(engine, "t").state is TurnState.RUN
        raise BoomError
    row = _row("t")
    assert row.status == RunStatus.PENDING and row.attempts == 0 and row.lease_owner is None
    engine.execute("t")
    assert ran == ["t"] and engine.get("t").attempts == 1


@pytest.mark.skipif(connection.vendor == "sqlite", reason="a row lock held by another transaction")
@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
@pytest.mark.parametrize("holder", ["lock", "write"])
def test_a_claim_that_waited_for_the_runs_row_takes_a_whole_lease(
    registry: Registry, raw_sql: bool, holder: str, keyed: bool
) -> None:
    """R5, R6, R8, S4: a run without a key whose row another transaction holds
    (``SELECT ... FOR UPDATE``) for longer than ``LEASE_SECONDS``, a lock the
    claim waits for: once taken, its body must start with about a whole lease
    by the database's clock, so that no recovery claim is granted beside the
    live body (a lease measured from before the wait is expired at the body's
    start: the tick's turn takes the run over and a second body runs beside
    the first). Fails on 19c900b too (both paths): an older bug."""
    lease = 2.0
    seen: list[tuple[Any, Any]] = []
    beside: list[Any] = []

    def body(ctx: Any, input: Any) -> None:
        seen.append((Run.objects.get(pk=ctx.run_id).lease_expires_at, engine.store.now()))
        if len(seen) == 1:  # a tick's recovery claim while this body runs (its own connection)
            t = threading.Thread(target=lambda: (beside.append(engine.execute("L")), connections.close_all()))
            t.start()
            t.join(10)

    registry.add("plain", "1", body, singleton={"key": lambda i: "K"} if keyed else None)
    engine = _engine(registry, raw_sql, LEASE_SECONDS=lease, LEASE_RENEW_SECONDS=lease / 2)
    engine.start("plain", {}, run_id="L")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

    def hold() -> None:
        if holder == "lock":  # SELECT ... FOR UPDATE (a signal's or a cancel's read of the run)
            list(Run.objects.select_for_update().filter(pk="L"))
        else:  # a write that leaves the run parked (updated_at, as a signal's wake-up does)
            Run.objects.filter(pk="L").update(park_reason="held")

    other = hold_in_transaction(hold, lease + 1.0)
    engine.execute("L")
    other.join(30)
    expires, now = seen[0]
    assert len(seen) == 1 and beside == ["skipped"], (
        f"a second body ran beside the live one: {len(seen)} bodies, {beside}"
    )
    assert expires is not None and (expires - now).total_seconds() > lease / 2, (
        f"the body began with {(expires - now).total_seconds()} s of its {lease} s lease"
    )
