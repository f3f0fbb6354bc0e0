"""Adversarial: a waiter granted a slot by a claim is sent at once, not queued
behind the claimant's body (S7, S8a)."""

from __future__ import annotations

from typing import Any

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from tests.helpers import two_waiters_behind_freed_slots


def test_a_slot_granted_by_a_claim_is_not_held_back_by_the_claimants_body(engine: Engine, registry: Registry) -> None:
    """S7, S8a: limit 2, two holders, W1 and W2 waiting. Both holders end by a
    path that grants nothing (a raw write, as after a lost push), then W1's turn
    runs through execute_chain (the Celery task): its claim admits W1 and grants
    the second free slot to W2. W2's turn must be sent at once; it was kept as
    this thread's follow-up, to run only after W1's body returned, so the free
    slot sat idle for the whole body (then a redelivery window for the tick)."""
    seen: dict[str, bool] = {}

    def body(ctx: Any, input: Any) -> None:
        if ctx.run_id == "W1":
            sent = engine.dispatcher.sent  # type: ignore[attr-defined]
            seen["W2 sent while W1 runs"] = "W2" in sent[sent.index("W1-turn-marker") :]

    registry.add("wf", "1", body, singleton={"key": lambda i: "K", "limit": 2})
    two_waiters_behind_freed_slots(engine, "wf")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.dispatcher.sent.append("W1-turn-marker")  # type: ignore[attr-defined]
    assert engine.execute_chain("W1") == "completed"
    assert seen == {"W2 sent while W1 runs": True}
