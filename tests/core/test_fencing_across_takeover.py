"""Adversarial: fencing tokens across a lease takeover (K1, R5, S10)."""

from __future__ import annotations

from typing import Any

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from tests.core.test_turn_protocol_faults import TokenCheckingStore, _set_lease
from tests.helpers import claim


def test_a_recovered_holder_gets_a_larger_token_than_its_stalled_executor(engine: Engine, registry: Registry) -> None:
    """K1, R5, S10: worker 1 holds A and stalls (a SIGSTOP, a GC pause) past its
    lease; recovery re-drives A on worker 2, which writes to an external system
    with ctx.fencing_token. When worker 1 wakes and writes with the token it was
    given, the external system must refuse it: the takeover's token is larger.

    Before the fix the recovery kept A's token, so both executors wrote with the
    same number and the stale write overwrote the recovering executor's."""
    external = TokenCheckingStore()

    def body(ctx: Any, input: Any) -> None:
        assert external.write("worker 2", ctx.fencing_token)

    registry.add("fenced", "1", body, singleton={"key": lambda i: "K"})
    engine.start("fenced", {}, run_id="A")
    first = claim(engine, "A", "worker-1")  # worker 1's turn, which then stalls
    assert first.state.value == "run"
    stale_token = first.run.fencing_token
    assert external.write("worker 1 (before the stall)", stale_token)
    _set_lease(engine, "A", -1)
    engine.dispatcher.queue.clear()
    assert engine.tick().recovered == ["A"]
    engine.dispatcher.drain()
    a = engine.get("A")
    assert a.status == "completed" and a.recoveries == 1
    assert a.fencing_token is not None and a.fencing_token > stale_token
    assert not external.write("worker 1 (late, after waking up)", stale_token)


def test_tokens_still_increase_after_a_recovery(engine: Engine, registry: Registry) -> None:
    """K1: a recovery's token is taken from the key's counter, so the next
    admission's token is larger still, and no two executions share one."""
    seen: list[tuple[str, int]] = []
    registry.add(
        "tok", "1", lambda ctx, i: seen.append((ctx.run_id, ctx.fencing_token)), singleton={"key": lambda i: "K"}
    )
    engine.start("tok", {}, run_id="A")
    engine.start("tok", {}, run_id="B")
    first = claim(engine, "A", "worker-1")
    _set_lease(engine, "A", -1)
    engine.dispatcher.queue.clear()
    engine.tick()
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed"
    tokens = [first.run.fencing_token] + [t for _, t in seen]
    assert [r for r, _ in seen] == ["A", "B"]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3, tokens
