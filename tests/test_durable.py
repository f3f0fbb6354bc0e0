"""Durable primitives beside the gate: D1, D2, S18, F13."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError, RunNotFoundError, SignalTimeoutError


def test_sleep_parks_and_the_tick_resumes(engine: Engine, registry: Registry) -> None:
    """D1: sleep parks the run suspended with wake_at; the tick resumes it."""
    registry.add("nap", "1", lambda ctx, i: ctx.sleep(0.1) or "awake")
    run = engine.start("nap")
    assert engine.execute(run.run_id) == "suspended"
    parked = engine.get(run.run_id)
    assert parked.status == "suspended" and parked.park_reason == "sleep"
    engine.dispatcher.queue.clear()
    assert engine.tick().dispatched == []
    time.sleep(0.12)
    assert engine.tick().dispatched == [run.run_id]
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == "awake"


def test_sleep_until_an_aware_datetime(engine: Engine, registry: Registry) -> None:
    target = engine.now() + timedelta(seconds=0.05)
    registry.add("until", "1", lambda ctx, i: ctx.sleep_until(target) or "ok")
    run = engine.start("until")
    assert engine.execute(run.run_id) == "suspended"
    assert engine.get(run.run_id).wake_at == target
    time.sleep(0.06)
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


def test_signal_timeout_raises_a_typed_error_in_the_body(engine: Engine, registry: Registry) -> None:
    """D2: when the timeout passes, SignalTimeoutError is raised inside the body (and replays the same)."""

    def body(ctx: Any, input: Any) -> str:
        try:
            ctx.wait_for_signal("never", timeout=0.05)
        except SignalTimeoutError:
            return "timed out"
        return "signalled"

    registry.add("impatient", "1", body)
    run = engine.start("impatient")
    assert engine.execute(run.run_id) == "suspended"
    assert engine.get(run.run_id).wake_at <= engine.now() + timedelta(seconds=0.05)  # type: ignore[operator]
    time.sleep(0.06)
    engine.dispatcher.queue.clear()
    assert engine.tick().dispatched == [run.run_id], "the deadline is the wake-up"
    engine.dispatcher.drain()
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
    engine = make(LEASE_SECONDS=0.05)
    calls: list[str] = []
    registry.add("victim", "1", lambda ctx, i: calls.append(ctx.run_id), singleton={"key": lambda i: "k"})
    engine.start("victim", {}, run_id="A")
    claim = engine.store.claim_run("A", "doomed", 0.05, engine.now())
    assert claim.run is not None
    engine.cancel("A")
    assert engine.get("A").status == "running" and engine.get("A").cancel_requested
    time.sleep(0.06)  # the worker died; its lease expires
    engine.dispatcher.queue.clear()
    assert "A" in engine.tick().dispatched
    engine.dispatcher.drain()
    assert engine.get("A").status == "cancelled" and calls == []
    for _ in range(2):
        engine.tick()
        engine.dispatcher.drain()
    assert engine.execute("A") == "skipped"
    assert engine.get("A").status == "cancelled"
