"""One Celery message, many turns (``execute_runs``, issue #17): a long body
holds back none of the batch's other turns past ``max_seconds`` (S7, S8, R6).

Before the fix the turns not begun were sent on only when a turn ended, so a
blocking body kept every run behind it in the message waiting for the tick's
redelivery (found by CI in tests/workers/test_network_partition.py: run B began 5.5 s late,
on the tick's second send, behind run A's body)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine


def _blocking(registry: Registry, gate: threading.Event, entered: list[str]) -> None:
    def body(ctx: Any, input: dict[str, Any]) -> str:
        entered.append(ctx.run_id)
        if input.get("block"):
            assert gate.wait(30), "the gate never opened"
        return "ok"

    registry.add("batched", "1", body, singleton={"key": lambda i: i["k"]})


def test_turns_behind_a_long_body_are_sent_on_while_it_runs(make: Callable[..., Engine], registry: Registry) -> None:
    """A batch of three runs on three keys whose first body blocks: after
    ``max_seconds`` the two not begun are sent on (in two messages) while the
    first body still runs; the batch executes only its first turn, each body
    runs once, and all three complete."""
    gate, entered = threading.Event(), []
    _blocking(registry, gate, entered)
    engine = make()
    for run_id, block in (("A", True), ("B", False), ("C", False)):
        engine.start("batched", {"k": run_id, "block": block}, run_id=run_id)
    engine.dispatcher.queue.clear()
    outcomes: list[str] = []
    batch = threading.Thread(target=lambda: outcomes.extend(engine.execute_batch(["A", "B", "C"], max_seconds=0.2)))
    started = time.monotonic()
    batch.start()
    try:
        # Under load A's claim may end after max_seconds: B and C are sent on first, A enters after.
        while sorted(engine.dispatcher.queue) != ["B", "C"] or entered != ["A"]:
            assert time.monotonic() - started < 30, (
                f"B and C were not sent on while A ran: {engine.dispatcher.queue}, entered {entered}"
            )
            time.sleep(0.02)
        assert batch.is_alive(), "A's body still runs while B and C are sent on"
    finally:
        gate.set()
        batch.join(30)
    assert outcomes == ["completed"], "the batch executed A only: B and C were sent on, not run twice (R6)"
    engine.dispatcher.drain()
    assert sorted(entered) == ["A", "B", "C"]
    assert {engine.get(r).status for r in "ABC"} == {"completed"}


def test_a_quick_batch_runs_every_turn_itself(make: Callable[..., Engine], registry: Registry) -> None:
    """A batch whose bodies end in time executes each turn here and sends nothing on."""
    gate, entered = threading.Event(), []
    _blocking(registry, gate, entered)
    engine = make()
    for run_id in "ABC":
        engine.start("batched", {"k": run_id}, run_id=run_id)
    engine.dispatcher.queue.clear()
    assert engine.execute_batch(["A", "B", "C"], max_seconds=30) == ["completed"] * 3
    assert list(engine.dispatcher.queue) == [] and entered == ["A", "B", "C"]
