"""A parent's ``call_child`` replays after its finished child was deleted (O2, D7, R4; #18 item 6).

Before: ``call_child`` read the child's row on every replay. Once retention,
``durable_purge`` or an admin delete removed the finished child, a parent that
had received its output and parked after it (a sleep past
``RETENTION_SECONDS``) replayed into "waiting for the child", its re-check
saw the child gone and sent its own turn again: it looped forever. Now the
parent stores the outcome it first saw as its own step and replays that.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import ChildWorkflowError
from durable_singleton.retention import purge_finished
from durable_singleton.testing import make_engine
from tests.helpers import tick_until


def _declare(engine: Engine) -> None:
    def child(ctx: Any, input: Any) -> Any:
        if input == "fail":
            raise ValueError("the child failed")
        return {"echo": input}

    def parent(ctx: Any, input: Any) -> Any:
        try:
            got = ctx.call_child("co-child", input, run_id=f"{ctx.run_id}:c")
        except ChildWorkflowError as exc:
            got = {"child": exc.status}
        ctx.sleep(0.2)  # parked past the child's retention
        return got

    engine.registry.add("co-child", "1", child)
    engine.registry.add("co-parent", "1", parent)


def _remove(engine: Engine, how: str, run_id: str) -> None:
    if how == "delete_run":  # what the admin's delete and the post_delete receiver do
        assert engine.store.delete_run(run_id) is not None
    else:
        if engine.store.database is None:
            pytest.skip("retention purges the Django store's runs")
        report = purge_finished(engine, before=engine.now() + timedelta(hours=1))
        assert report.runs >= 1
    assert engine.store.get_run(run_id) is None


@pytest.mark.parametrize("how", ["delete_run", "purge"])
@pytest.mark.parametrize(("child_input", "expected"), [("ok", {"echo": "ok"}), ("fail", {"child": "failed"})])
def test_a_parent_replays_its_child_s_outcome_after_the_child_was_deleted(
    engine: Engine, how: str, child_input: str, expected: Any
) -> None:
    """O2, D7, R4: the parent received the child's outcome (output, or a
    failure it handled), then slept; the finished child is removed; the
    parent's replay returns the same outcome from its own step and completes.
    Before: it parked waiting for the child and sent its own turn without end."""
    _declare(engine)
    engine.start("co-parent", child_input, run_id="cop")
    engine.dispatcher.drain()
    assert engine.get("cop").status == "suspended"
    assert engine.get("cop:c").is_terminal
    _remove(engine, how, "cop:c")
    tick_until(engine, lambda: engine.get("cop").is_terminal, "the parent woke and ended")
    done = engine.get("cop")
    assert (done.status, done.output) == ("completed", expected)
    assert [s.name for s in engine.store.load_steps("cop").values()].count("durable:child-outcome") == 1


def test_a_child_deleted_before_its_parent_saw_its_outcome_fails_the_parent_once(engine: Engine) -> None:
    """D7, R4: the child is deleted while the parent waits for it: the parent,
    woken, stores the outcome "missing" and raises ChildWorkflowError with
    that status; it does not wait for a child that can never end."""
    _declare(engine)
    engine.registry.add("co-strict", "1", lambda ctx, input: ctx.call_child("co-child", input, run_id="strict:c"))
    engine.start("co-strict", "ok", run_id="strict")
    assert engine.execute("strict") == "suspended"
    assert engine.store.delete_run("strict:c") is not None
    engine.wake("strict")
    engine.dispatcher.drain(max_turns=20)
    failed = engine.get("strict")
    assert failed.status == "failed"
    assert failed.error["type"] == "ChildWorkflowError"
    assert "missing" in failed.error["message"]


def test_a_parent_of_an_older_release_replays_its_call_child_from_the_child_s_row(engine: Engine) -> None:
    """R4, D7: a parent whose call_child ran under an older release (one
    position: the child's start; its next call, a sleep, stored right after)
    replays under this one: the child's row is its outcome, the sleep replays
    from its own position, and the parent completes with the child's output."""
    engine.registry.add("co-child", "1", lambda ctx, input: {"echo": input})

    def older(ctx: Any, input: Any) -> Any:  # what call_child did before: start, then read the row
        child_id = ctx.start_child("co-child", input)
        child = ctx.engine.store.get_run(child_id)
        if child is None or not child.is_terminal:
            ctx.block("child", poll_seconds=0)
        ctx.sleep(0.2)
        return child.output

    engine.registry.add("co-upgrade", "1", older)
    engine.start("co-upgrade", "ok", run_id="old")
    engine.dispatcher.drain()
    engine.tick()
    engine.dispatcher.drain()
    assert engine.get("old").status == "suspended"
    assert [s.name for s in engine.store.load_steps("old").values()] == ["durable:child", "durable:sleep"]

    newer = make_engine(engine.store, registry=Registry())
    newer.registry.add("co-child", "1", lambda ctx, input: {"echo": input})
    newer.registry.add("co-upgrade", "1", lambda ctx, input: [ctx.call_child("co-child", input), ctx.sleep(0.2)][0])
    tick_until(newer, lambda: newer.get("old").is_terminal, "the parent woke and ended")
    done = newer.get("old")
    assert (done.status, done.output) == ("completed", {"echo": "ok"}), done.error
    assert [s.name for s in newer.store.load_steps("old").values()] == ["durable:child", "durable:sleep"]
