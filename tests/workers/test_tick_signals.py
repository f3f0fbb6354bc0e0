"""What the tick tells its observers (O4, S7): found by a new user's trial.

Before the fix the tick's catch-up granted a waiter its slot without the
``run_admitted`` signal every other grant sends (so the admissions metric and
the admission log missed each run whose slot came from the tick), and
``tick_finished`` reported the time between the end of the tick and the
heartbeat's write, about 0, as the tick's duration."""

from __future__ import annotations

import time
from typing import Any

from durable_singleton import signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from tests.conftest import Monitor
from tests.helpers import audited, connected, waiter_behind_a_freed_slot


def test_a_waiter_granted_by_the_catch_up_is_announced_as_admitted(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S7, O4: the tick's catch-up grants B the slot A freed without a handoff;
    ``run_admitted`` fires for B once, as for a handoff's grant, and B's turn is sent."""
    waiter_behind_a_freed_slot(engine, registry, monitor)
    admitted: list[str] = []

    def receiver(sender: Any, run: Any, **kwargs: Any) -> None:
        admitted.append(run.run_id)

    with connected(receiver, signals.run_admitted):
        assert engine.tick().caught_up == ["B"]
    assert admitted == ["B"]
    assert engine.dispatcher.sent == ["B"]


def test_tick_finished_reports_how_long_the_jobs_took(engine: Engine, registry: Registry) -> None:
    """O4: a tick whose job takes at least 0.3 s (here: the execution-timeout
    job settles a run, and a ``run_finished`` receiver takes 0.3 s) reports at
    least that in ``tick_finished``, and no more than the tick's own wall time."""
    registry.add("slowish", "1", lambda ctx, i: ctx.sleep(3600), timeout=0.05)
    engine.start("slowish", {}, run_id="T")
    assert engine.execute("T") == "suspended"
    time.sleep(0.1)
    reported: list[float] = []

    def slow(sender: Any, run: Any, **kwargs: Any) -> None:
        time.sleep(0.3)

    def finished(sender: Any, seconds: float, **kwargs: Any) -> None:
        reported.append(seconds)

    signals.run_finished.connect(slow)
    signals.tick_finished.connect(finished)
    try:
        began = time.monotonic()
        report = engine.tick()
        wall = time.monotonic() - began
    finally:
        signals.run_finished.disconnect(slow)
        signals.tick_finished.disconnect(finished)
    assert "T" in report.timed_out
    assert len(reported) == 1 and 0.3 <= reported[0] <= wall, (reported, wall)


def test_a_receiver_that_raises_holds_back_no_run(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S7, O4: receivers of run_admitted, run_parked, run_finished and run_dead
    that raise are logged and change nothing: A's handoff still grants B and B
    runs next on this thread (execute_chain), and both complete."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    engine.dispatcher.queue.clear()

    def boom(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("a user's receiver failed")

    hooked = (signals.run_admitted, signals.run_parked, signals.run_finished, signals.run_dead, signals.run_created)
    for signal in hooked:
        signal.connect(boom)
    try:
        engine.start("wf", {"k": "K"}, run_id="C")
        engine.dispatcher.queue.clear()
        assert engine.execute_chain("A") == "completed"
    finally:
        for signal in hooked:
            signal.disconnect(boom)
    assert engine.get("A").status == "completed" and engine.get("B").status == "completed"
    engine.dispatcher.drain()
    assert engine.get("C").status == "completed"
