"""Prepared statements that survive the server (S7, R5a; issue 32 item 6).

PostgreSQL with ``prepare_threshold`` set (the fast path prepares its
statements) and a persistent connection. Each condition is produced for real on
a test server: a statement timeout in the middle of the ``PREPARE`` message (its
later statements wait on a lock another connection holds), a column change by
another connection, a backend terminated while it prepares. After each, the
handoff puts the connection right, runs once, and the next message works.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run, SingletonKey
from durable_singleton.statuses import RunStatus
from durable_singleton.stores import pg
from durable_singleton.stores.base import Turn
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "postgresql"
        or connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold") is None,
        reason="PostgreSQL with prepare_threshold in OPTIONS (testproject sets it unless DATABASE_PREPARE=0)",
    ),
]

OWNER = "refusals"


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.add("pr-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    made = make_engine(DjangoStore(), registry=registry)
    made.now()
    return made


def _prepared() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements")
        return {row[0] for row in cursor.fetchall() if row[0].startswith("ds_")}


def _holder_and_waiter(engine: Engine, key: str) -> Turn:
    """Start a holder and a waiter of ``key``; return the holder's turn (its lease, ``OWNER``)."""
    engine.start("pr-keyed", {"k": key}, run_id=f"{key}-holder")
    engine.start("pr-keyed", {"k": key}, run_id=f"{key}-waiter")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    turn = engine.store.begin_turn(
        f"{key}-holder",
        OWNER,
        lease_seconds=60,
        limits=engine.limits(),
        max_recoveries=3,
        retry=engine._retry_policy(),
    )
    assert turn.run.status == RunStatus.RUNNING, turn
    return turn


def _finish(engine: Engine, turn: Turn) -> Any:
    fast = engine.store._fast()  # type: ignore[attr-defined]
    assert fast is not None
    return fast.finish(turn.run, OWNER, RunStatus.COMPLETED.value, None, None, engine.limits(), None)


def _handed_off_once(key: str) -> None:
    """The holder completed, the waiter took the next token, the key's counter moved once (K1)."""
    holder, waiter = Run.objects.get(pk=f"{key}-holder"), Run.objects.get(pk=f"{key}-waiter")
    assert holder.status == RunStatus.COMPLETED
    assert waiter.singleton_slot == "holder"
    assert waiter.fencing_token == holder.fencing_token + 1
    assert SingletonKey.objects.get(workflow_name="pr-keyed", key=key).last_token == waiter.fencing_token


def _other() -> Any:
    """A second connection to the test database (psycopg, in a transaction)."""
    return connection.get_new_connection(connection.get_connection_params())


def test_a_timeout_in_the_middle_of_prepare_leaves_no_statement_already_existing(engine: Engine) -> None:
    """S7, R5a (issue 32 item 6): the handoff's first two statements are prepared,
    the third waits on a lock of the run table and the statement timeout ends the
    message. The handoff raises and writes nothing; once the lock and the
    timeout are gone the next handoff on the same connection runs (before: every
    later handoff failed with "prepared statement ... already exists")."""
    connection.close()
    turn = _holder_and_waiter(engine, "T")
    finish = pg.FINISH_MESSAGE.statements[-1].name
    assert finish not in _prepared()
    other = _other()
    try:
        other.execute(f"LOCK TABLE {pg.RUN} IN ACCESS EXCLUSIVE MODE")
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = '300ms'")
        with pytest.raises(OperationalError):
            _finish(engine, turn)
    finally:
        other.rollback()
        other.close()
    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = 0")
    held = _prepared()
    assert pg.FINISH_MESSAGE.statements[0].name in held and finish not in held, held
    assert Run.objects.get(pk="T-holder").status == RunStatus.RUNNING
    assert _finish(engine, turn).run is not None
    _handed_off_once("T")


def test_a_column_changed_by_another_connection_is_prepared_again(engine: Engine) -> None:
    """S7, R5a (issue 32 item 6): another connection widens a column the handoff
    returns (a later release's migration in a rolling deploy); the prepared
    handoff's cached plan is refused ("cached plan must not change result type"),
    is deallocated and prepared again, and the handoff runs once."""
    connection.close()
    first = _holder_and_waiter(engine, "C1")
    _finish(engine, first)
    _handed_off_once("C1")
    turn = _holder_and_waiter(engine, "C2")
    assert pg.FINISH_MESSAGE.statements[-1].name in _prepared()
    other = _other()
    other.autocommit = True
    try:
        other.execute(f"ALTER TABLE {pg.RUN} ALTER COLUMN park_reason TYPE varchar(200)")
        assert _finish(engine, turn).run is not None
        _handed_off_once("C2")
    finally:
        other.execute(f"ALTER TABLE {pg.RUN} ALTER COLUMN park_reason TYPE varchar(191)")
        other.close()
        connection.close()


def test_a_connection_lost_in_the_middle_of_prepare_is_opened_again(engine: Engine) -> None:
    """S7, R5a (issue 32 item 6): the backend is terminated while its handoff's
    ``PREPARE`` waits on a lock: nothing of the handoff ran, so it is sent again,
    once, on a new connection, and hands off once."""
    connection.close()
    turn = _holder_and_waiter(engine, "L")
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    other = _other()
    killed: list[bool] = []

    def terminate() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            waiting = other.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (pid,)
            ).fetchone()
            if waiting:
                killed.append(other.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0])
                break
            time.sleep(0.02)
        other.rollback()

    try:
        other.execute(f"LOCK TABLE {pg.RUN} IN ACCESS EXCLUSIVE MODE")
        killer = threading.Thread(target=terminate)
        killer.start()
        try:
            assert _finish(engine, turn).run is not None
        finally:
            killer.join()
    finally:
        other.close()
    assert killed == [True]
    _handed_off_once("L")


def test_a_refusal_inside_a_transaction_does_not_poison_the_connection(engine: Engine) -> None:
    """S7 (issue 32 item 6): inside ``transaction.atomic()`` a refused statement is
    raised (the transaction is aborted, nothing is retried in it); the next
    handoff on the connection, after the rollback, runs."""
    from django.db import transaction

    connection.close()
    first = _holder_and_waiter(engine, "A1")
    _finish(engine, first)
    turn = _holder_and_waiter(engine, "A2")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    with pytest.raises(Exception, match="does not exist"), transaction.atomic():
        _finish(engine, turn)
    assert Run.objects.get(pk="A2-holder").status == RunStatus.RUNNING
    assert _finish(engine, turn).run is not None
    _handed_off_once("A2")
