"""A step result too large to store fails the run once, the same on every database.

Found by the breaker of issue #12. MariaDB refuses a write larger than its
``max_allowed_packet`` (16 MB by default) by dropping the connection: error
2006 "Server has gone away", an ``OperationalError``, which the engine
rightly reads as the store being unreachable. A step whose result was that
large therefore interrupted its turn; the run was handed back, the step ran
again (its side effects with it), its result was refused again, and so on
every ``ADMISSION_RETRY_SECONDS``, without end. PostgreSQL and SQLite stored
the same result. Now a result (or an output) over ``MAX_RESULT_BYTES`` is
refused before it is written, with a typed error, on every database (section 7).
"""

from __future__ import annotations

from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.exceptions import ConfigurationError
from durable_singleton.statuses import Outcome
from durable_singleton.testing import make_engine


def _engine(store_kind: str, **settings: Any) -> Any:
    return make_engine(store_kind, registry=Registry(), ADMISSION_RETRY_SECONDS=0.1, **settings)


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_step_result_past_the_servers_packet_limit_fails_the_run_at_once(store_kind: str) -> None:
    """Section 7, R4: a 17 MB step result (past MariaDB's default 16 MB packet)
    is refused with InvalidInputError naming MAX_RESULT_BYTES; the run fails
    once, the step having executed once, and nothing of it is stored."""
    engine = _engine(store_kind)
    executions: list[int] = []

    def huge(n: int) -> str:
        executions.append(n)
        return "x" * (17 * 1024 * 1024)

    engine.registry.add_step("size:huge", huge)
    engine.registry.add("size", "1", lambda ctx, input: len(ctx.step("size:huge", 1)), singleton={"key": lambda i: "k"})
    run = engine.start("size", None, run_id="size-1")
    outcome = engine.execute(run.run_id)
    failed = engine.get(run.run_id)
    assert (outcome, failed.status) == (Outcome.FAILED, "failed"), f"{outcome}: the step ran {len(executions)} times"
    assert failed.error["type"] == "InvalidInputError" and "MAX_RESULT_BYTES" in failed.error["message"]
    assert executions == [1]
    assert engine.store.load_steps(run.run_id) == {}
    assert not failed.admitted


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_results_and_outputs_over_the_setting_are_refused_and_none_lifts_it(store_kind: str) -> None:
    """Section 7: MAX_RESULT_BYTES bounds step results and the workflow's
    output; an output over it fails the run; None accepts any size (and is
    accepted for MAX_INPUT_BYTES too, as its reference says)."""
    engine = _engine(store_kind, MAX_RESULT_BYTES=1000)
    engine.registry.add_step("size:echo", lambda n: "y" * n)
    engine.registry.add("size-step", "1", lambda ctx, input: ctx.step("size:echo", input) and "ok")
    engine.registry.add("size-out", "1", lambda ctx, input: "z" * input)
    small = engine.start("size-step", 900)
    big = engine.start("size-step", 1001)
    out = engine.start("size-out", 1001)
    engine.dispatcher.drain()
    assert engine.get(small.run_id).status == "completed"
    for run in (big, out):
        done = engine.get(run.run_id)
        assert (done.status, done.error["type"]) == ("failed", "InvalidInputError"), done.error
    unlimited = _engine(store_kind, MAX_RESULT_BYTES=None, MAX_INPUT_BYTES=None)
    unlimited.registry.add_step("size:echo", lambda n: "y" * n)
    unlimited.registry.add("size-step", "1", lambda ctx, input: len(ctx.step("size:echo", input)))
    run = unlimited.start("size-step", 5000)
    unlimited.dispatcher.drain()
    assert unlimited.get(run.run_id).output == 5000
    with pytest.raises(ConfigurationError, match="MAX_RESULT_BYTES"):
        _engine(store_kind, MAX_RESULT_BYTES=0)


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_body_exception_with_a_huge_message_fails_the_run_with_a_bounded_error(store_kind: str) -> None:
    """R2, section 7: the run's stored error keeps at most ERROR_TEXT_CHARS of
    the exception's message and of its traceback (which repeats the message).
    On MariaDB a 17 MB message made the error past ``max_allowed_packet``: the
    settle lost its connection, the turn was handed back and the body failed
    the same way again, without end. The run fails once, on every database."""
    from django.db import connection

    from durable_singleton.engine import ERROR_TEXT_CHARS

    engine = _engine(store_kind)
    size = 17 * 1024 * 1024 if store_kind == "django" and connection.vendor == "mysql" else 200_000
    bodies: list[int] = []

    def body(ctx: Any, input: Any) -> None:
        bodies.append(1)
        raise ValueError("x" * size)

    engine.registry.add("loud", "1", body, singleton={"key": lambda i: "k"})
    run = engine.start("loud", None, run_id="loud-1")
    assert engine.execute(run.run_id) == Outcome.FAILED
    error = engine.get(run.run_id).error
    assert error["type"] == "ValueError" and error["message"].startswith("xxx")
    assert len(error["message"]) <= ERROR_TEXT_CHARS and len(error["traceback"]) <= ERROR_TEXT_CHARS
    assert "ValueError" in error["traceback"]
    assert bodies == [1]
