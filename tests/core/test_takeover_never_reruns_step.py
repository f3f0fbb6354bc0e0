"""A takeover racing a frozen holder's step commit never runs the stored step again.

Found by the breaker of issue #12 (aimed at what the chaos soak's
``freeze_past_lease`` fault can hit at random): holder A is frozen (SIGSTOP,
a GC pause, a VM migration) inside ``save_step``'s transaction, after its
UPDATE of the run row and before its COMMIT, for longer than its lease. The
tick re-drives the run; the new turn B reads the run (lease expired,
``step_count`` still 0: A's write is not committed), then its claim waits on
A's row lock. A wakes and commits: its step's result is stored. B's claim
then passes its compare-and-set (status, attempts, owner, expired lease: all
unchanged by a step write) and B's body started from the ``step_count`` it
read before the lock: no stored step, so it executed step 0 again, after its
result was stored (R4; the soak checker's ``step_reexecuted``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection

from durable_singleton.definitions import Registry
from durable_singleton.models import Run, Step
from durable_singleton.querysets import DbNow
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.django_db(transaction=True)


def _lock_waits() -> int:
    """How many transactions wait on a lock now (PostgreSQL; MariaDB shows other
    sessions' transactions only with the PROCESS privilege: -1 there)."""
    if connection.vendor != "postgresql":
        return -1
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted")
        return int(cursor.fetchone()[0])


def _wait_for(condition: Any, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_takeover_waiting_on_a_frozen_step_commit_does_not_run_the_stored_step_again() -> None:
    """R4, R5, R6: step 0 executes once. A's step commit lands while B's claim
    waits on the row; B then replays A's stored result (or gives up its turn)
    instead of executing the step again, and the run completes with A's result."""
    if connection.vendor == "sqlite":
        pytest.skip("needs row locks and a second connection's lock wait (PostgreSQL, MariaDB)")
    engine = make_engine("django", registry=Registry(), LEASE_SECONDS=1.0, LEASE_RENEW_SECONDS=600.0)
    step_table = Step._meta.db_table
    executions: list[str] = []
    inserted, resume = threading.Event(), threading.Event()

    def freeze_after_the_step_insert(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("INSERT") and step_table in sql and not inserted.is_set():
            inserted.set()  # A's UPDATE of the run and its step INSERT are done, uncommitted: A freezes
            assert resume.wait(30), "the test never resumed the frozen holder"
        return result

    claiming = threading.Event()

    def see_the_claim(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # B's turn reaches the database: its claim (the fast path's claim message, or the
        # ORM path's read, then the takeover's row lock before its compare-and-set) waits on
        # A's row lock, which the lock-wait check below sees.
        claiming.set()
        return execute(sql, params, many, context)

    def side_effect(n: int) -> dict[str, Any]:
        executions.append(threading.current_thread().name)
        if threading.current_thread().name == "holder-A":
            connection.execute_wrappers.append(freeze_after_the_step_insert)  # this thread's connection only
        return {"n": n, "by": threading.current_thread().name}

    engine.registry.add_step("takeover:side", side_effect)
    engine.registry.add(
        "takeover",
        "1",
        lambda ctx, input: ctx.step("takeover:side", input["n"]),
        singleton={"key": lambda i: "k", "limit": 1},
    )
    run = engine.start("takeover", {"n": 7}, run_id="takeover-1")
    outcomes: dict[str, str] = {}

    def turn(name: str) -> None:
        if name == "B":
            connection.execute_wrappers.append(see_the_claim)
        try:
            outcomes[name] = engine.execute(run.run_id)
        finally:
            connection.execute_wrappers.clear()
            connection.close()

    holder = threading.Thread(target=turn, args=("A",), name="holder-A")
    holder.start()
    assert inserted.wait(15), "holder A never reached its step's INSERT"
    _wait_for(lambda: Run.objects.filter(pk=run.run_id, lease_expires_at__lte=DbNow()).exists(), "A's lease expiry")
    takeover = threading.Thread(target=turn, args=("B",), name="takeover-B")
    takeover.start()
    assert claiming.wait(15), "B never reached its claim"
    _wait_for(lambda: _lock_waits() != 0, "B's claim to wait on A's row lock")
    time.sleep(0.3)  # B's UPDATE reaches the server and waits on A's lock
    resume.set()  # A wakes and commits its step
    holder.join(30)
    takeover.join(30)
    assert not holder.is_alive() and not takeover.is_alive()

    assert Step.objects.filter(run_id=run.run_id).count() == 1
    assert executions == ["holder-A"], (
        f"step 0 was executed again after its result was stored: {executions} (outcomes {outcomes})"
    )
    for _ in range(5):  # B may have given its turn up: the run is re-driven after A's lease, as by the tick
        if engine.get(run.run_id).is_terminal:
            break
        _wait_for(lambda: not Run.objects.filter(pk=run.run_id, lease_expires_at__gt=DbNow()).exists(), "no live lease")
        engine.execute(run.run_id)
    done = engine.get(run.run_id)
    assert (done.status, done.output) == ("completed", {"n": 7, "by": "holder-A"})
