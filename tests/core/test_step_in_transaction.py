"""A ``ctx`` write inside a transaction the body opened (R5, #18 item 15).

docs/durability.rst says not to wrap ``ctx.step`` in ``transaction.atomic()``:
the step's write (``save_step`` updates the run's row) then holds the run's
row lock until the body's transaction ends, so the lease renewal, a cancel
and the tick wait for the body, and a body longer than the lease is taken
over while it still holds the lock. Before, nothing said so: the step ran and
was stored when the block committed. Now the boundary compares the store's
transaction depth with the depth at the start of the turn and raises
:class:`StepInTransactionError` before anything runs or is written.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Step
from durable_singleton.testing import make_engine
from testproject.inventory.models import BodyAudit

pytestmark = pytest.mark.django_db(transaction=True)


def _engine() -> tuple[Engine, list[int]]:
    engine = make_engine("django", registry=Registry())
    calls: list[int] = []
    engine.registry.add_step("tx:step", lambda n: calls.append(n) or n)
    return engine, calls


def _audit(run_id: str) -> None:
    from django.utils import timezone

    BodyAudit.objects.create(run_id=run_id, workflow_name="tx", key="k", entered_at=timezone.now(), pid=0)


@pytest.mark.parametrize("call", ["step", "sleep", "start_child"])
def test_a_ctx_write_inside_the_body_s_own_atomic_block_fails_the_run_with_a_typed_error(call: str) -> None:
    """R5, R4: ``ctx.step`` (or a sleep, or a child start) inside
    ``transaction.atomic()`` on the store's database raises
    StepInTransactionError: the handler does not run, no step is stored, the
    body's own writes in the block roll back, and the run fails with the
    error (a step earlier, outside the block, stays stored once). Before: the
    step ran and was stored, holding the run's row lock until the block ended."""
    engine, calls = _engine()
    engine.registry.add("tx-child", "1", lambda ctx, input: input)

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("tx:step", 1)
        with transaction.atomic(using=engine.store.database):
            _audit(ctx.run_id)
            if call == "step":
                ctx.step("tx:step", 2)
            elif call == "sleep":
                ctx.sleep(60)
            else:
                ctx.start_child("tx-child", 1)
        return "done"

    engine.registry.add("tx", "1", body)
    run = engine.start("tx", None, run_id=f"tx-{call}")
    assert engine.execute(run.run_id) == "failed"
    failed = engine.get(run.run_id)
    assert failed.error["type"] == "StepInTransactionError", failed.error
    assert "transaction.atomic()" in failed.error["message"]
    assert calls == [1]
    assert list(Step.objects.filter(run_id=run.run_id).values_list("position", flat=True)) == [0]
    assert not BodyAudit.objects.filter(run_id=run.run_id).exists()
    assert engine.store.get_run(f"tx-{call}:child:1") is None


def test_a_body_s_own_transaction_beside_its_steps_and_a_turn_run_inside_a_caller_s_transaction_work() -> None:
    """R5: a transaction the body opens for its own queries, with the steps
    outside it, is fine; so is a turn executed inside a transaction its caller
    had open (the depth counts from the start of the turn)."""
    engine, calls = _engine()

    def body(ctx: Any, input: Any) -> Any:
        with transaction.atomic(using=engine.store.database):
            _audit(ctx.run_id)
        return ctx.step("tx:step", input)

    engine.registry.add("tx-beside", "1", body)
    first = engine.start("tx-beside", 1, run_id="tx-beside-1")
    assert engine.execute(first.run_id) == "completed"
    with transaction.atomic(using=engine.store.database):
        second = engine.start("tx-beside", 2, run_id="tx-beside-2")
        assert engine.execute(second.run_id) == "completed"
    assert calls == [1, 2]
    assert engine.get("tx-beside-2").output == 2
