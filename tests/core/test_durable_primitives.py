"""Durable primitives beside the gate: D1, D2, S18, F13."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError, RunNotFoundError, SignalTimeoutError
from tests.helpers import claim, sleep_past, sleep_past_lease, tick_until


def test_sleep_parks_and_the_tick_resumes(engine: Engine, registry: Registry) -> None:
    """D1: sleep parks the run suspended with wake_at; the tick resumes it, not before
    wake_at. The sleep is 1 s so that the first tick comes before it even on a loaded
    machine (0.1 s was outlasted there); the tick is then polled, not awaited blindly."""
    registry.add("nap", "1", lambda ctx, i: ctx.sleep(1.0) or "awake")
    run = engine.start("nap")
    assert engine.execute(run.run_id) == "suspended"
    parked = engine.get(run.run_id)
    assert parked.status == "suspended" and parked.park_reason == "sleep"
    assert parked.wake_at is not None
    engine.dispatcher.queue.clear()
    assert engine.tick().dispatched == []
    deadline = time.monotonic() + 30
    while not (dispatched := engine.tick().dispatched):
        assert time.monotonic() < deadline, "the tick never resumed the sleeping run"
        time.sleep(0.02)
    assert dispatched == [run.run_id]
    assert engine.store.now() >= parked.wake_at, "resumed before its wake time"
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == "awake"


def test_sleep_until_an_aware_datetime(make: Callable[..., Engine], registry: Registry) -> None:
    """D1: on a clock the test moves (frozen near real time; leases stay on the
    database's clock, R5), so the turn after the target is after it by the body's clock."""
    now = [datetime.now(UTC)]
    engine = make(clock=lambda: now[0])
    target = engine.now() + timedelta(seconds=1)
    registry.add("until", "1", lambda ctx, i: ctx.sleep_until(target) or "ok")
    run = engine.start("until")
    assert engine.execute(run.run_id) == "suspended"
    assert engine.get(run.run_id).wake_at == target
    now[0] = target + timedelta(seconds=0.5)
    assert engine.execute(run.run_id) == "completed"


def _waiter(registry: Registry, names: list[str], timeout: float | None = None) -> list[Any]:
    seen: list[Any] = []

    def body(ctx: Any, input: Any) -> list[Any]:
        got = [ctx.wait_for_signal(name, timeout=timeout) for name in names]
        seen.append(got)
        return got

    registry.add("waiter", "1", body, singleton={"key": lambda i: "k"})
    return seen


def test_signals_sent_before_the_wait_are_buffered_in_order(engine: Engine, registry: Registry) -> None:
    """D2: signals sent before the wait are buffered, in order, each delivered once."""
    _waiter(registry, ["approve", "approve", "ship"])
    run = engine.start("waiter", {}, run_id="w")
    engine.signal("w", "approve", {"n": 1})
    engine.signal("w", "ship", "now")
    engine.signal("w", "approve", {"n": 2})
    engine.signal("w", "approve", {"n": 3})
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == [{"n": 1}, {"n": 2}, "now"]


def test_waiting_run_is_woken_by_its_signal_and_has_a_fallback_wake(engine: Engine, registry: Registry) -> None:
    """D2: a waiting run parks with a long fallback wake_at; the signal wakes it at once."""
    _waiter(registry, ["go"])
    engine.start("waiter", {}, run_id="w")
    assert engine.execute("w") == "suspended"
    parked = engine.get("w")
    assert parked.park_reason == "signal:go" and parked.admitted, "a waiting holder keeps its slot"
    fallback = parked.wake_at - engine.now()  # type: ignore[operator]
    assert timedelta(seconds=250) < fallback <= timedelta(seconds=engine.settings.SIGNAL_FALLBACK_SECONDS)
    engine.dispatcher.queue.clear()
    engine.signal("w", "go", 42)
    assert list(engine.dispatcher.queue) == ["w"]
    engine.dispatcher.drain()
    assert engine.get("w").output == [42]


def test_signal_timeout_raises_a_typed_error_in_the_body(make: Callable[..., Engine], registry: Registry) -> None:
    """D2: when the timeout passes, SignalTimeoutError is raised inside the body (and replays the same).

    The body's clock is one the test moves (frozen near real time; leases and
    the tick stay on the database's clock, R5): with the real clock a turn
    slower than the 0.05 s timeout ran past it without suspending."""
    now = [datetime.now(UTC)]
    engine = make(clock=lambda: now[0])

    def body(ctx: Any, input: Any) -> str:
        try:
            ctx.wait_for_signal("never", timeout=0.05)
        except SignalTimeoutError:
            return "timed out"
        return "signalled"

    registry.add("impatient", "1", body)
    run = engine.start("impatient")
    assert engine.execute(run.run_id) == "suspended"
    # The wake-up is the 0.05 s deadline, not the default park: 0.5 s of slack
    # for the offset between the corrected process clock and the store's (R8).
    assert engine.get(run.run_id).wake_at <= engine.now() + timedelta(seconds=0.5)  # type: ignore[operator]
    now[0] += timedelta(seconds=1)  # the timeout has passed by the body's clock
    sleep_past(engine, "wake_at", run.run_id)  # and by the store's
    engine.dispatcher.queue.clear()
    assert engine.tick().dispatched == [run.run_id], "the deadline is the wake-up"
    engine.dispatcher.drain()
    # The body judges the deadline on its own corrected clock: a turn a hair early parks again.
    tick_until(engine, lambda: engine.get(run.run_id).is_terminal, "the wait timed out")
    assert engine.get(run.run_id).output == "timed out"
    on_time = engine.start("impatient")
    engine.signal(on_time.run_id, "never", "in time")
    engine.dispatcher.drain()
    assert engine.get(on_time.run_id).output == "signalled"


def test_signal_to_a_missing_or_finished_run_and_bad_payload(engine: Engine, registry: Registry) -> None:
    registry.add("plain", "1", lambda c, i: None)
    run = engine.start("plain")
    engine.dispatcher.drain()
    with pytest.raises(RunNotFoundError):
        engine.signal(run.run_id, "late")
    with pytest.raises(RunNotFoundError):
        engine.signal("missing", "x")
    other = engine.start("plain")
    with pytest.raises(InvalidInputError):
        engine.signal(other.run_id, "x", {"bad": object()})


def test_signal_with_start_queues_on_a_busy_key(make: Callable[..., Engine], registry: Registry) -> None:
    """S18: signal_with_start does not bypass the gate: on a busy key the run
    queues; the buffered signal is seen by the body only once admitted."""
    engine = make()
    seen = _waiter(registry, ["go"])
    holder = engine.signal_with_start("waiter", {}, run_id="A", signal="go", payload="for A")
    assert engine.execute("A") == "completed"
    engine.start("waiter", {}, run_id="H")
    assert engine.execute("H") == "suspended"  # H holds the slot, waiting for its own signal
    queued = engine.signal_with_start("waiter", {}, run_id="B", signal="go", payload="for B")
    assert queued.status == "pending"
    assert engine.execute("B") == "parked"
    assert seen == [["for A"]]
    again = engine.signal_with_start("waiter", {}, run_id="B", signal="go", payload="second")
    assert again.run_id == "B", "idempotent by run_id (R3)"
    engine.signal("H", "go", "for H")
    engine.dispatcher.drain()
    assert seen == [["for A"], ["for H"], ["for B"]]
    assert holder.run_id == "A"


def test_holder_cancelled_then_killed_ends_cancelled_after_recovery(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """F13, D6: a holder cancelled, then killed before noticing, ends cancelled after recovery, not re-run."""
    engine = make()  # the dead worker's claim takes a 0.05 s lease; the recovering turn the default
    calls: list[str] = []
    registry.add("victim", "1", lambda ctx, i: calls.append(ctx.run_id), singleton={"key": lambda i: "k"})
    engine.start("victim", {}, run_id="A")
    assert claim(engine, "A", "doomed", 0.05).state.value == "run"
    engine.cancel("A")
    assert engine.get("A").status == "running" and engine.get("A").cancel_requested
    sleep_past_lease(engine, "A")  # the worker died; its lease expires
    engine.dispatcher.queue.clear()
    assert "A" in engine.tick().dispatched
    engine.dispatcher.drain()
    assert engine.get("A").status == "cancelled" and calls == []
    for _ in range(2):
        engine.tick()
        engine.dispatcher.drain()
    assert engine.execute("A") == "skipped"
    assert engine.get("A").status == "cancelled"


def test_call_child_returns_its_output_and_inherits_the_namespace(engine: Engine, registry: Registry) -> None:
    """D7: deterministic child ids (``<parent>:child:<position>``; a call_child
    takes two positions, its start and the outcome it stored, #18 item 6);
    the parent parks until the child is done, then replays."""
    registry.add("child", "1", lambda ctx, i: i * 10)
    registry.add("parent", "1", lambda ctx, i: [ctx.call_child("child", 1), ctx.call_child("child", 2)])
    engine.namespace = "acme"
    run = engine.start("parent", None, run_id="P")
    engine.dispatcher.drain()
    assert engine.get("P").output == [10, 20]
    child = engine.get("P:child:0")
    assert child.parent_run_id == "P" and child.namespace == "acme"
    assert engine.get("P:child:2").output == 20
    assert run.run_id == "P"


def test_failed_and_rejected_children_reach_the_parent(engine: Engine, registry: Registry) -> None:
    """D7, S16: a failed child raises ChildWorkflowError in the parent; a child
    start rejected by its queue cap is delivered as a failed child, not swallowed."""
    from durable_singleton.exceptions import ChildWorkflowError

    def failing(ctx: Any, i: Any) -> None:
        raise RuntimeError("child broke")

    registry.add("failing", "1", failing)
    registry.add("capped", "1", lambda ctx, i: None, singleton={"key": lambda i: "one", "max_queue_depth": 0})

    def parent(ctx: Any, input: Any) -> list[str]:
        outcomes = []
        for name in ("failing", "capped"):
            try:
                ctx.call_child(name, {})
                outcomes.append("ok")
            except ChildWorkflowError as exc:
                outcomes.append(exc.status)
        return outcomes

    registry.add("parent", "1", parent)
    engine.start("capped", {}, run_id="blocker")  # fills the capped key (limit 1, depth 0)
    engine.start("parent", None, run_id="P")
    engine.dispatcher.queue.clear()
    for _ in range(6):
        for run_id in ("P", "P:child:0"):
            engine.execute(run_id)
    assert engine.get("P").output == ["failed", "rejected"]
    assert engine.store.get_run("P:child:2") is None, "the rejected child wrote nothing"


class _SignalArrivesAfterLook:
    """Store proxy: the first look at the signals misses one that lands right after it."""

    def __init__(self, store: Any, engine: Engine) -> None:
        self._store, self._engine, self._raced = store, engine, False

    def load_signals(self, run_id: str) -> Any:
        seen = self._store.load_signals(run_id)
        if not self._raced:
            self._raced = True
            self._store.add_signal(run_id, "go", "raced")
        return seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_signal_arriving_while_the_body_parks_is_not_lost(engine: Engine, registry: Registry) -> None:
    """D2, F6: a signal that lands between the body's look and its park write
    (when engine.signal still sees the run running) re-dispatches the run."""
    registry.add("racy", "1", lambda ctx, i: ctx.wait_for_signal("go"))
    run = engine.start("racy")
    engine.store = _SignalArrivesAfterLook(engine.store, engine)
    engine.dispatcher.queue.clear()
    assert engine.execute(run.run_id) == "suspended"
    assert list(engine.dispatcher.queue) == [run.run_id], "the recheck after parking dispatched it again"
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == "raced"


def test_emit_starts_subscribers_once_per_event_id(engine: Engine, registry: Registry) -> None:
    """D8, S16: emit starts every subscribed workflow, idempotently per event_id."""
    registry.add("on-order", "1", lambda ctx, i: i["order"], events=["order.created"])
    registry.add("also", "1", lambda ctx, i: "also", events=["order.created"])
    registry.add("other", "1", lambda ctx, i: None, events=["order.cancelled"])
    first = engine.emit("order.created", {"order": 7}, event_id="e1")
    again = engine.emit("order.created", {"order": 7}, event_id="e1")
    assert sorted(r.run_id for r in first) == ["event:e1:also", "event:e1:on-order"]
    assert [r.run_id for r in again] == [r.run_id for r in first]
    engine.dispatcher.drain()
    assert engine.get("event:e1:on-order").output == 7
    assert len(engine.store.list_runs()) == 2
