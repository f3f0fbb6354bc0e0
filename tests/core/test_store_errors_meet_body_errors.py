"""Store failures meet a body's own error handling, and the body's own database errors.

The breaker of issue #12 aimed real faults (``pg_terminate_backend`` / ``KILL
CONNECTION`` from another connection) at the two places where a body's code
and the engine's store calls share one connection (docs/durability.rst,
"When the store fails under a body"):

* a body that wraps ``ctx.step`` in ``except Exception`` cannot swallow the
  interruption of a store call: the run resumes, the step is not lost;
* a database error raised by the body's *own* query fails the run, as the
  docs say, even when the connection it broke is the one the engine settles
  the run on. Before, the settle met the same dead connection and raised out
  of the turn: the run was left ``running`` until its lease expired, then
  recovered (one more recovery towards ``dead``) and its step executed again.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from durable_singleton.definitions import Registry
from durable_singleton.models import Run
from durable_singleton.statuses import Outcome
from durable_singleton.testing import make_engine
from tests.helpers import kill_this_connection, tick_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _server_database() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to kill a connection")


def test_a_body_catching_exception_around_a_step_does_not_swallow_the_interruption() -> None:
    """R4, D4: the body catches ``Exception`` around its step (to log and go on);
    the connection dies under the step's store write. The interruption is not
    an ``Exception``: the body does not go on without the step, the run is
    handed back with its slot and, resumed, completes with the step's result."""
    engine = make_engine("django", registry=Registry(), ADMISSION_RETRY_SECONDS=0.1)
    executions: list[int] = []
    swallowed: list[BaseException] = []

    def side_effect(n: int) -> int:
        executions.append(n)
        if len(executions) == 1:
            kill_this_connection()
        return n * 2

    engine.registry.add_step("swallow:double", side_effect)

    def body(ctx: Any, input: Any) -> Any:
        try:
            result = ctx.step("swallow:double", 21)
        except Exception as exc:  # the user's catch-all
            swallowed.append(exc)
            result = None
        return result

    engine.registry.add("swallow", "1", body, singleton={"key": lambda i: "k", "limit": 1})
    run = engine.start("swallow", None, run_id="swallow-1")
    assert engine.execute(run.run_id) == Outcome.INTERRUPTED
    assert swallowed == []
    assert engine.get(run.run_id).admitted
    tick_until(engine, lambda: engine.get(run.run_id).is_terminal, "the interrupted run resumed and ended")
    done = engine.get(run.run_id)
    assert (done.status, done.output) == ("completed", 42)
    assert executions == [21, 21]


def test_a_database_error_of_the_body_s_own_query_fails_the_run_even_on_the_connection_it_broke() -> None:
    """R2, docs/durability.rst: the body's own query fails because its
    connection was killed. That is the body's exception: the run is settled
    ``failed`` with it at once (the engine's settle reconnects), not left
    ``running`` for the lease to expire and the step to run again."""
    engine = make_engine("django", registry=Registry(), LEASE_SECONDS=30.0)
    executions: list[int] = []

    def own_query(n: int) -> int:
        executions.append(n)
        kill_this_connection()
        return Run.objects.count()  # the body's own query, on the killed connection

    engine.registry.add_step("own-query:count", own_query)
    engine.registry.add(
        "own-query",
        "1",
        lambda ctx, input: ctx.step("own-query:count", 1),
        singleton={"key": lambda i: "k", "limit": 1},
    )
    run = engine.start("own-query", None, run_id="own-query-1")
    outcome = engine.execute(run.run_id)
    failed = engine.get(run.run_id)
    assert (outcome, failed.status) == (Outcome.FAILED, "failed"), (outcome, failed.status, failed.lease_owner)
    assert failed.error["type"] == "OperationalError"
    assert not failed.admitted, "the slot is released with the settle (S7)"
    assert executions == [1]
