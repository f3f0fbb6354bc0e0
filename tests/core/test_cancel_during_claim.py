"""Adversarial: a cancel that lands while a claim is in flight is never undone (S9, D6, R5a)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.models import Run
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import claim


class _CancelAfterRead(DjangoStore):
    """Lands ``engine.cancel`` in the window between a turn's read and its claim."""

    engine: Any = None
    armed = False

    def _read_for_turn(self, run_id: str) -> Any:
        return self._then_cancel(run_id, super()._read_for_turn(run_id))

    def _fast_claim(self, fast: Any, run_id: str, *args: Any) -> Any:  # the PostgreSQL fast path's read (#17)
        return self._then_cancel(run_id, super()._fast_claim(fast, run_id, *args))

    def _room_claim(self, room: Any, run_id: str, *args: Any) -> Any:  # MariaDB's ds_claim reads (#32)
        return self._then_cancel(run_id, super()._room_claim(room, run_id, *args))

    def _then_cancel(self, run_id: str, read: Any) -> Any:
        if self.armed:
            self.armed = False
            self.engine.cancel(run_id)
        return read


@pytest.mark.django_db(transaction=True)
def test_a_cancel_landing_during_a_recovery_claim_is_not_undone() -> None:
    """S9, D6, R5a: a holder crashed after its last step; the operator cancels it
    while the tick's recovery turn is between its read and its claim. The claim
    compared only status, attempts and lease, so it took the run over, the body
    replayed its stored steps (no boundary) and the run ended ``completed``: the
    accepted cancel was undone. The claim now compares the cancel flag it read
    too; the turn the cancel sends settles the run ``cancelled``."""
    registry = Registry()
    registry.add_step("s", lambda x: x)
    calls: list[str] = []

    def body(ctx: Any, input: Any) -> None:
        ctx.step("s", 1)
        calls.append(ctx.run_id)

    registry.add("wf", "1", body, singleton={"key": lambda i: "K"})
    store = _CancelAfterRead()
    engine = make_engine(store, registry=registry)
    store.engine = engine
    engine.start("wf", {}, run_id="A")
    engine.dispatcher.queue.clear()
    turn = claim(engine, "A", "crashed-worker")
    assert turn.state.value == "run"
    Run.objects.filter(pk="A").update(step_count=1)
    from durable_singleton.models import Step

    Step.objects.create(
        run_id="A", position=0, name="s", result=1, started_at=turn.run.created_at, finished_at=turn.run.created_at
    )
    Run.objects.filter(pk="A").update(lease_expires_at=store.now() - timedelta(seconds=1))
    store.armed = True
    engine.execute("A")  # the recovery turn; the cancel lands after its read
    engine.dispatcher.drain()  # the turn the cancel sent
    a = engine.get("A")
    assert a.status == "cancelled", (a.status, calls)
    assert calls == []
