"""A cancel cascade that a store failure cut short is finished by the tick (D6, D5; #18 item 14).

Before: when the children of a run ended by its execution timeout (or by a
cancel) could not be cancelled because the store was away at that moment,
nothing retried it: they ran on until someone cancelled the parent again.
Now the failure is logged and the tick's ``cascade`` job cancels the active
children of cancelled runs, a bounded batch per tick.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton.engine import Engine
from tests.helpers import sleep_past


def _declare(engine: Engine, timeout: float | None) -> None:
    def parent(ctx: Any, input: Any) -> Any:
        ctx.start_child("cascade-child", None, run_id=f"{ctx.run_id}:child")
        ctx.sleep(3600)
        return "never"

    def child(ctx: Any, input: Any) -> Any:
        ctx.sleep(3600)
        return "never"

    engine.registry.add("cascade-parent", "1", parent, timeout=timeout)
    engine.registry.add("cascade-child", "1", child)


def _store_away_once(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the store's ``children`` fail once, as a dropped connection does."""
    failed: list[str] = []
    children = engine.store.children

    def away(run_id: str) -> list[str]:
        if not failed:
            failed.append(run_id)
            raise ConnectionError("the store went away")
        return children(run_id)

    monkeypatch.setattr(engine.store, "children", away)
    return failed


@pytest.mark.parametrize("ended_by", ["execution timeout", "cancel"])
def test_the_tick_cancels_the_children_of_a_cancelled_parent_whose_cascade_failed(
    make: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch, ended_by: str
) -> None:
    """D6, D5: the parent is settled ``cancelled`` (by the tick's timeout
    sweep, or by ``engine.cancel``) while the store fails to list its
    children; the child is left active. The tick's cascade job cancels it
    (in the same tick as the timeout sweep), without a second cancel of the
    parent."""
    engine = make()
    _declare(engine, timeout=0.2 if ended_by == "execution timeout" else None)
    engine.start("cascade-parent", None, run_id="cp")
    engine.dispatcher.drain()
    assert engine.get("cp").status == "suspended"
    assert engine.get("cp:child").status == "suspended"
    failed = _store_away_once(engine, monkeypatch)
    if ended_by == "execution timeout":
        sleep_past(engine, "deadline_at", "cp")
        report = engine.tick()  # its timeout sweep settles the parent; its cascade job follows
        assert report.timed_out == ["cp"]
    else:
        engine.cancel("cp")  # the cascade's failure is logged, not raised
        assert engine.get("cp:child").status == "suspended"  # the cut-short cascade
        report = engine.tick()
    assert failed == ["cp"]
    assert engine.get("cp").status == "cancelled"
    assert report.cancelled == ["cp:child"]
    assert engine.get("cp:child").status == "cancelled"
    assert engine.tick().cancelled == []


def test_the_cascade_job_takes_a_bounded_batch_oldest_first_and_leaves_live_parents_alone(
    make: Callable[..., Engine],
) -> None:
    """D6, S8b: children of cancelled parents are cancelled ``TICK_BATCH`` per
    tick, oldest first; a child whose parent is active, completed or failed
    is not touched."""
    engine = make(TICK_BATCH=2)
    _declare(engine, timeout=None)
    for n in range(3):
        engine.start("cascade-parent", None, run_id=f"p{n}")
    engine.start("cascade-parent", None, run_id="live")
    engine.dispatcher.drain()
    for n in range(3):  # cancelled parents whose children the cancel did not reach
        engine.store.request_cancel(f"p{n}", limits=engine.limits())
        assert engine.get(f"p{n}").status == "cancelled"
    assert engine.tick().cancelled == ["p0:child", "p1:child"]
    assert engine.tick().cancelled == ["p2:child"]
    assert engine.get("live:child").status == "suspended"
