"""The turn protocol under the faults the independent testers found on c40f28b (issue #8).

Each test names the defect it reproduces and the rule it checks; each failed on
c40f28b (the old tick settled without an owner check, judged times by the
process's clock, sliced the catch-up with a lowered limit, read before the key
lock, and ignored a requested cancel at park) and passes on the rebuilt protocol.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from durable_singleton import signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    InvalidInputError,
    InvalidRunIdError,
    RunNotFoundError,
    SingletonKeyError,
    SingletonQueueFullError,
)
from durable_singleton.testing import make_engine
from tests.conftest import Monitor, run_threads, spawn, vendor
from tests.helpers import (
    audited,
    claim,
    connected,
    free_slot_without_handoff,
    plant_run_fields,
    store_method_replaced,
    waiter_behind_a_freed_slot,
)

django_only = pytest.mark.django_db(transaction=True)


def _set_lease(engine: Engine, run_id: str, seconds_from_now: float) -> None:
    """Move a running run's lease expiry on the store's own clock."""
    plant_run_fields(engine.store, run_id, lease_expires_at=engine.store.now() + timedelta(seconds=seconds_from_now))


def _set_deadline(engine: Engine, run_id: str, seconds_from_now: float) -> None:
    """Move a run's deadline on the store's own clock."""
    plant_run_fields(engine.store, run_id, deadline_at=engine.store.now() + timedelta(seconds=seconds_from_now))


def _gated(registry: Registry, monitor: Monitor, gate: threading.Event, **options: Any) -> None:
    """A singleton workflow whose body enters, waits for ``gate``, then takes a step."""
    registry.add_step("proto:work", lambda x: x)

    def body(ctx: Any, input: dict[str, Any]) -> None:
        monitor.enter(input["k"], ctx.run_id)
        try:
            assert gate.wait(30)
            ctx.step("proto:work", 1)
        finally:
            monitor.exit(input["k"])

    registry.add("gated", "1", body, singleton={"key": lambda i: i["k"]}, **options)


# -- defect 1: a timeout racing a claim (R5a, D5) -----------------------------------------


def test_timeout_sweep_never_settles_a_run_claimed_after_it_read_it(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """Defect 1, R5a, D5, S9: the sweep reads A as parked and overdue; a worker
    claims A before the sweep writes; the sweep's settle is a compare-and-set on
    the parked status, so it changes nothing, and B never runs beside A's body.
    A is stopped at its next step boundary by the next tick's cancel request."""
    gate = threading.Event()
    _gated(registry, monitor, gate, timeout=3600)
    engine.start("gated", {"k": "K"}, run_id="A")
    engine.start("gated", {"k": "K"}, run_id="B")
    engine.dispatcher.queue.clear()
    _set_deadline(engine, "A", -1)
    real = engine.store.overdue_runs
    worker: list[threading.Thread] = []

    def read_then_claim(batch: int) -> Any:
        stale = real(batch)
        worker.append(spawn(engine.execute, "A"))  # a worker claims A after the sweep read it
        deadline = time.monotonic() + 10
        while monitor.current["K"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return stale

    with store_method_replaced(engine, "overdue_runs", read_then_claim):
        report = engine.tick()
    assert "A" not in report.timed_out and engine.get("A").status == "running"
    engine.dispatcher.drain()
    assert monitor.entered == ["A"] and monitor.highest["K"] == 1
    assert "A" in engine.tick().timed_out  # now read as running: asked to stop at its boundary
    gate.set()
    worker[0].join(60)
    assert not worker[0].is_alive(), "a thread of the test is still running"
    a = engine.get("A")
    assert a.status == "cancelled" and a.error["code"] == "execution_timeout"
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed" and monitor.highest["K"] == 1


@django_only
def test_a_tick_whose_clock_runs_ahead_frees_no_live_holder(registry: Registry, monitor: Monitor) -> None:
    """Defect 1 (clock), R5, D5: a tick on a process whose clock is 60 s ahead
    judges deadlines and leases on the database's clock: a holder with 30 s to
    go is neither timed out nor recovered."""
    gate = threading.Event()
    _gated(registry, monitor, gate, timeout=30)
    honest = make_engine("django", registry=registry)
    ahead = make_engine(honest.store, registry=registry, clock=lambda: timezone.now() + timedelta(seconds=60))
    honest.start("gated", {"k": "K"}, run_id="A")
    honest.start("gated", {"k": "K"}, run_id="B")
    worker = spawn(honest.execute, "A")
    try:
        deadline = time.monotonic() + 10
        while monitor.current["K"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        report = ahead.tick()
        assert report.timed_out == [] and report.recovered == []
        a = honest.get("A")
        assert a.status == "running" and not a.cancel_requested
    finally:
        gate.set()
        worker.join(10)
    assert honest.get("A").status == "completed"


# -- defect 2: recovery on the database's clock (R5, D4) -----------------------------------


@django_only
def test_a_recovering_process_whose_clock_is_behind_redrives_at_once(registry: Registry, monitor: Monitor) -> None:
    """Defect 2, R5, D4: a process whose clock is 60 s behind re-drives an expired
    lease as soon as it expired on the database's clock, not 60 s later."""
    audited(registry, monitor)
    behind = make_engine("django", registry=registry, clock=lambda: timezone.now() - timedelta(seconds=60))
    behind.start("wf", {"k": "K"}, run_id="A")
    assert claim(behind, "A", "crashed").state.value == "run"
    _set_lease(behind, "A", -0.5)
    behind.dispatcher.queue.clear()
    report = behind.tick()
    assert report.recovered == ["A"]
    behind.dispatcher.drain()
    assert behind.get("A").status == "completed" and behind.get("A").recoveries == 1


# -- defect 3: a lowered limit never breaks the tick (S8b) ---------------------------------


def test_lowering_a_limit_between_deploys_keeps_the_tick_working(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """Defect 3, S8b, K2: limit 2 with two holders and a waiter, then a deploy with
    limit 1: the tick raises nothing, still sends due runs of other keys, never
    evicts a holder, and the waiter is admitted once holders drop below 1."""
    after = Registry()
    for reg, limit in ((registry, 2), (after, 1)):
        reg.add("wide", "1", lambda c, i: None, singleton={"key": lambda i: "K", "limit": limit})
        reg.add("plain", "1", lambda c, i: None)
    old = make()
    for name in ("H1", "H2", "W"):
        old.start("wide", {}, run_id=name)
    for name in ("H1", "H2"):
        assert claim(old, name).state.value == "run"
    assert claim(old, "W").state.value == "parked"
    new = make_engine(old.store, registry=after)
    new.start("plain", {}, run_id="P")
    new.dispatcher.queue.clear()
    report = new.tick()
    assert report.errors == []
    assert all(new.get(h).admitted for h in ("H1", "H2")), "a lowered limit never evicts a holder"
    assert not new.get("W").admitted
    free_slot_without_handoff(new, "H1")
    assert new.tick().caught_up == [], "one holder left: at limit 1 the waiter still waits"
    free_slot_without_handoff(new, "H2")
    assert new.tick().caught_up == ["W"]


# -- defect 4 and 5: MySQL/MariaDB isolation and session time zone (S13a) ---------------------


def _mysql_only() -> None:
    if vendor() != "mysql":
        pytest.skip("MySQL/MariaDB only: isolation level and session time zone (S13a)")


@django_only
def test_cap_is_exact_at_repeatable_read(registry: Registry) -> None:
    """Defect 4, S13a, S15: at MariaDB's default REPEATABLE READ, 30 racing capped
    starts create exactly limit + max_queue_depth runs: the reads after the key
    lock see the latest commits."""
    _mysql_only()
    engine = make_engine("django", registry=registry)
    registry.add("capped", "1", lambda c, i: None, singleton={"key": lambda i: "K", "max_queue_depth": 3})

    def racer(i: int) -> str:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT @@session.tx_isolation")
            assert cursor.fetchone()[0] == "REPEATABLE-READ"
        try:
            engine.start("capped", {}, run_id=f"rr-{i:02d}")
            return "started"
        except SingletonQueueFullError:
            return "full"

    results = run_threads(30, racer)
    assert sorted(results) == ["full"] * 26 + ["started"] * 4
    assert len(engine.store.list_runs(workflow_name="capped")) == 4


@django_only
@pytest.mark.parametrize("zone", ["+02:00", "-05:00"])
def test_session_time_zone_never_moves_a_lease(registry: Registry, monitor: Monitor, zone: str) -> None:
    """Defect 5, S13a, R5: with a non-UTC session time zone a first turn is not
    fenced, and an expired lease is recovered at once, not hours later."""
    _mysql_only()
    with connection.cursor() as cursor:
        cursor.execute(f"SET time_zone = '{zone}'")
    try:
        audited(registry, monitor)
        engine = make_engine("django", registry=registry)
        engine.start("wf", {"k": "K"}, run_id="first")
        assert engine.execute("first") == "completed"
        engine.start("wf", {"k": "K"}, run_id="crashed")
        assert claim(engine, "crashed", "gone").state.value == "run"
        _set_lease(engine, "crashed", -0.5)
        engine.dispatcher.queue.clear()
        assert engine.tick().recovered == ["crashed"]
        engine.dispatcher.drain()
        assert engine.get("crashed").status == "completed"
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")


# -- defect 6: recovery has its own batch (S8b) ----------------------------------------------


def test_crashed_holders_are_recovered_while_due_waiters_fill_a_batch(make: Callable[..., Engine]) -> None:
    """Defect 6, S8b, D4: with TICK_BATCH 20, 40 due parked runs and 5 crashed
    holders with expired leases: one tick sends 20 due runs and re-drives all 5."""
    engine = make(TICK_BATCH=20)
    engine.registry.add("plain", "1", lambda c, i: None)
    engine.registry.add("held", "1", lambda c, i: None, singleton={"key": lambda i: i["k"]})
    for n in range(5):
        engine.start("held", {"k": f"K{n}"}, run_id=f"crashed-{n}")
        assert claim(engine, f"crashed-{n}", "dead-worker").state.value == "run"
        _set_lease(engine, f"crashed-{n}", -1)
    for n in range(40):
        engine.start("plain", {}, run_id=f"due-{n:02d}")
    engine.dispatcher.queue.clear()
    for n in range(40):
        _make_due(engine, f"due-{n:02d}")
    report = engine.tick()
    assert sorted(report.recovered) == [f"crashed-{n}" for n in range(5)]
    assert len(report.dispatched) == 25


def _make_due(engine: Engine, run_id: str) -> None:
    plant_run_fields(engine.store, run_id, wake_at=engine.store.now() - timedelta(seconds=1))


# -- defect 7: the same run id racing on a capped key (R3, S16) --------------------------------


@django_only
def test_same_run_id_racing_on_a_capped_key_returns_the_run(registry: Registry) -> None:
    """Defect 7, R3, S16: ten starts of one run_id at once on a key capped at one
    run all return that run; none is refused by the cap."""
    if vendor() == "sqlite":
        pytest.skip("SQLite has one writer: starts cannot race")
    engine = make_engine("django", registry=registry)
    registry.add("capped", "1", lambda c, i: None, singleton={"key": lambda i: "K", "max_queue_depth": 0})
    for rep in range(5):
        run_id = f"same-{rep}"
        results = run_threads(10, lambda i, run_id=run_id: engine.start("capped", {}, run_id=run_id))
        assert [r.run_id if not isinstance(r, BaseException) else repr(r) for r in results] == [run_id] * 10
        engine.dispatcher.drain()


# -- defect 8: a wake is sent once (S7a) -----------------------------------------------------


def test_two_ticks_send_a_caught_up_waiter_once(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """Defect 8, S7a: a waiter granted by the catch-up is sent once; the next
    tick and a concurrent one do not send it again within the redelivery window."""
    waiter_behind_a_freed_slot(engine, registry, monitor)
    reports = [engine.tick(), engine.tick()]
    run_threads(3, lambda i: engine.tick())
    assert engine.dispatcher.sent.count("B") == 1
    assert reports[0].caught_up == ["B"] and reports[1].caught_up == []


def test_a_handoff_and_a_racing_tick_send_the_waiter_once(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """Defect 8, S7, S7a: the release grants B and sends it; ticks at the same
    moment do not send B again."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    engine.dispatcher.queue.clear()
    assert engine.execute("B") == "parked"
    assert list(engine.dispatcher.queue) == ["A"], "B's claim granted the free slot to A, the oldest"
    engine.dispatcher.queue.clear()
    engine.dispatcher.sent.clear()
    done = threading.Event()

    def ticking(i: int) -> None:
        while not done.is_set():
            engine.tick()
            time.sleep(0.001)

    tickers = [spawn(ticking, i) for i in range(2)]
    try:
        assert engine.execute("A") == "completed"
        time.sleep(0.05)
    finally:
        done.set()
        for t in tickers:
            t.join(60)
    assert not any(t.is_alive() for t in tickers), "a thread of the test is still running"
    assert engine.dispatcher.sent.count("B") == 1


# -- defect 9: children follow their parent (D6, D7) -----------------------------------------


def _family(registry: Registry) -> None:
    registry.add("child", "1", lambda ctx, i: ctx.sleep(3600))
    registry.add("parent", "1", lambda ctx, i: ctx.call_child("child", {}))


def test_cancelling_a_parent_cancels_its_children(engine: Engine, registry: Registry) -> None:
    """Defect 9, D6: a cancelled parent's active children are cancelled too."""
    _family(registry)
    engine.start("parent", {}, run_id="P")
    assert engine.execute("P") == "suspended"
    child_id = "P:child:0"
    assert engine.execute(child_id) == "suspended"
    engine.cancel("P")
    assert engine.get("P").status == "cancelled"
    assert engine.get(child_id).status == "cancelled"


def test_a_child_cancelled_while_parked_wakes_its_parent_at_once(engine: Engine, registry: Registry) -> None:
    """Defect 9, D7: a child cancelled (or timed out) while parked wakes the
    parent that waits on it at once, not after the 300 s fallback."""
    _family(registry)
    engine.start("parent", {}, run_id="P")
    assert engine.execute("P") == "suspended"
    assert engine.execute("P:child:0") == "suspended"
    engine.dispatcher.queue.clear()
    engine.cancel("P:child:0")
    assert "P" in engine.dispatcher.queue
    engine.dispatcher.drain()
    parent = engine.get("P")
    assert parent.status == "failed" and "cancelled" in str(parent.error)


# -- defect 10: a cancel is never parked over (D6) --------------------------------------------


def test_a_cancel_landing_before_a_sleeps_park_settles_the_run(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """Defect 10, D6, S7: a cancel that lands between the sleep's step write and
    the park settles the run cancelled at once and hands its slot to B; nothing
    waits for the sleep's wake time."""
    registry.add("sleepy", "1", lambda ctx, i: ctx.sleep(3600), singleton={"key": lambda i: "K"})
    engine.start("sleepy", {}, run_id="A")
    engine.start("sleepy", {}, run_id="B")
    engine.dispatcher.queue.clear()
    real = engine.store.park

    def cancel_then_park(run_id: str, *args: Any, **kwargs: Any) -> str:
        spawn(engine.cancel, run_id).join(10)
        return real(run_id, *args, **kwargs)

    with store_method_replaced(engine, "park", cancel_then_park):
        assert engine.execute("A") == "cancelled"
    a = engine.get("A")
    assert a.status == "cancelled" and not a.admitted
    assert engine.get("B").admitted and "B" in engine.dispatcher.queue, "the slot went to B at once"


# -- defect 11: bad input (section 7, R1, S1) ---------------------------------------------------


@pytest.mark.parametrize("bad", ["store:\x00A", "store:\ud800", "   ", "tab\there"])
def test_a_key_function_returning_unstorable_text_writes_nothing(engine: Engine, registry: Registry, bad: str) -> None:
    """Defect 11, S1, section 7: a key with NUL, a lone surrogate, only spaces or a
    control character raises SingletonKeyError and leaves no row."""
    registry.add("wf", "1", lambda c, i: None, singleton={"key": lambda i: bad})
    with pytest.raises(SingletonKeyError):
        engine.start("wf", {}, run_id="r")
    assert engine.store.get_run("r") is None and engine.store.list_runs() == []


@pytest.mark.parametrize("bad", ["\ud800", "   ", "\t", "a\x00b", "x\x1fy"])
def test_bad_run_ids_are_typed_errors_everywhere(engine: Engine, registry: Registry, bad: str) -> None:
    """Defect 11, R1: a run id with a lone surrogate, only whitespace or a control
    character is refused by start (InvalidRunIdError, no row) and not found by
    get, cancel and signal (RunNotFoundError), never an untyped error."""
    registry.add("wf", "1", lambda c, i: None)
    with pytest.raises(InvalidRunIdError):
        engine.start("wf", {}, run_id=bad)
    for call in (engine.get, engine.cancel, lambda r: engine.signal(r, "go")):
        with pytest.raises(RunNotFoundError):
            call(bad)
    assert engine.store.list_runs() == []


def test_oversize_input_is_refused_before_any_write(make: Callable[..., Engine]) -> None:
    """Defect 11, section 7: an input over MAX_INPUT_BYTES raises InvalidInputError and writes nothing."""
    engine = make(MAX_INPUT_BYTES=100_000)
    engine.registry.add("wf", "1", lambda c, i: None)
    with pytest.raises(InvalidInputError, match="MAX_INPUT_BYTES"):
        engine.start("wf", {"blob": "x" * 200_000}, run_id="big")
    assert engine.store.get_run("big") is None
    engine.start("wf", {"blob": "x" * 50_000}, run_id="ok")
    with pytest.raises(InvalidInputError):
        engine.signal("ok", "s", "y" * 200_000)


@django_only
def test_run_created_is_not_sent_for_a_rolled_back_start(registry: Registry) -> None:
    """Defect 11, O4: lifecycle signals go out after commit; a start whose
    transaction rolled back sends no ``run_created``."""
    engine = make_engine("django", registry=registry)
    registry.add("wf", "1", lambda c, i: None)
    seen: list[str] = []
    receiver = lambda sender, run, **kw: seen.append(run.run_id)  # noqa: E731
    with connected(receiver, signals.run_created):
        with pytest.raises(RuntimeError), transaction.atomic():
            engine.start("wf", {}, run_id="rolled-back")
            raise RuntimeError("the view failed")
        engine.start("wf", {}, run_id="kept")
    assert seen == ["kept"] and engine.store.get_run("rolled-back") is None


# -- K1: fencing tokens -------------------------------------------------------------------------


class TokenCheckingStore:
    """An external system that keeps the highest token it has seen and refuses
    a write with a lower one (K1): the pattern docs/design.rst shows."""

    def __init__(self) -> None:
        self.highest = 0
        self.writes: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def write(self, who: str, token: int) -> bool:
        with self._lock:
            if token < self.highest:
                return False
            self.highest = token
            self.writes.append((who, token))
            return True


def test_fencing_tokens_strictly_increase_per_key(engine: Engine, registry: Registry) -> None:
    """K1: every admission of a key stamps a larger token, across grants, claims
    and retries; the body reads it as ctx.fencing_token; keys count separately."""
    seen: dict[str, list[int]] = {}

    def body(ctx: Any, input: dict[str, Any]) -> None:
        assert ctx.fencing_token is not None
        seen.setdefault(input["k"], []).append(ctx.fencing_token)

    registry.add("tok", "1", body, singleton={"key": lambda i: i["k"], "limit": 2})
    for n in range(6):
        engine.start("tok", {"k": "K"}, run_id=f"K-{n}")
        engine.start("tok", {"k": "L"}, run_id=f"L-{n}")
    engine.dispatcher.drain()
    for key in ("K", "L"):
        assert len(seen[key]) == 6 and seen[key] == sorted(seen[key]) and len(set(seen[key])) == 6


def test_a_stale_holder_is_refused_by_a_token_checking_store(engine: Engine, registry: Registry) -> None:
    """K1, R5: a holder whose lease was taken over writes with its older token and
    is refused by an external store that keeps the highest token seen."""
    external = TokenCheckingStore()
    registry.add("fenced", "1", lambda ctx, i: None, singleton={"key": lambda i: "K"})
    engine.start("fenced", {}, run_id="A")
    engine.start("fenced", {}, run_id="B")
    first = claim(engine, "A", "slow-worker")
    assert first.state.value == "run" and first.run.fencing_token is not None
    old_token = first.run.fencing_token
    engine.cancel("A")  # the operator gives up on the slow holder; the slot moves on after its lease
    _set_lease(engine, "A", -1)
    engine.dispatcher.queue.clear()
    engine.tick()
    engine.dispatcher.drain()
    assert engine.get("A").status == "cancelled"
    b = engine.get("B")
    assert b.status == "completed" and b.fencing_token is not None and b.fencing_token > old_token
    assert external.write("B", b.fencing_token)
    assert not external.write("A (late)", old_token)
    assert external.writes == [("B", b.fencing_token)]


@django_only
def test_the_tick_and_a_turn_work_with_debug_sql_logging(registry: Registry, monitor: Monitor) -> None:
    """R5, S8b: with DEBUG on (a new project's default), Django formats each SQL
    statement for its log; the database clock's SQL must survive that, so no
    tick job fails and turns run."""
    audited(registry, monitor)
    engine = make_engine("django", registry=registry)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    connection.force_debug_cursor = True
    try:
        assert engine.tick().errors == []
        engine.dispatcher.drain()
        assert engine.tick().errors == []
    finally:
        connection.force_debug_cursor = False
    assert engine.get("A").status == "completed" and engine.get("B").status == "completed"
