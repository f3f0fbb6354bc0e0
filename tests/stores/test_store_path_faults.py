"""Attacks on the core paths merged last (tester ``breakcore``): the ORM path's
short cuts (f7cfc61), the MariaDB room's ``ds_take_lease`` (a80a945), the quota
keys column (84a2f90, e97cf53) and the rolling upgrade it must survive.

Real databases only: the DATABASE_URL database (SQLite, PostgreSQL, MariaDB),
real threads. Each test names the SPEC rule it attacks.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import QuotaMembership, Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.conftest import run_threads
from tests.helpers import claim, holds_when_asked
from tests.helpers import drain as _drain

pytestmark = pytest.mark.django_db(transaction=True)

ERP = Quota("erp-api", key=lambda i: i["tenant"], limit=1)
mysql_only = pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB room's stored procedures")


def _completes_with_the_room_off(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A start of ``room-plain`` runs to completed on the ORM path, and the
    store logs a warning that the MariaDB room is off."""
    run_id = engine.start("room-plain", {}).run_id
    with caplog.at_level("WARNING", logger="durable_singleton.stores.mysql"):
        _drain(engine)
    assert engine.get(run_id).status == RunStatus.COMPLETED, engine.get(run_id)
    assert any("room off" in r.getMessage() for r in caplog.records), caplog.records


@pytest.fixture
def quota_engine() -> Engine:
    registry = Registry()
    registry.add("charge", "1", holds_when_asked, quotas=[ERP])
    return make_engine("django", registry=registry)


def test_a_quota_carrier_an_older_release_inserted_without_quota_keys_keeps_its_quota(
    quota_engine: Engine,
) -> None:
    """X3, X3b, R1 (rolling upgrade, e97cf53): a process of the release before 0015
    still running inserts a run that carries quota ``erp-api`` the old way: its
    membership, its ``quota_slot`` and its ``quota:`` tag, and no ``quota_keys``
    (NULL). Its quota is recorded (the membership 0015 reads), so while another run
    holds the quota's only slot it must not run: quota limit 1 is never exceeded."""
    engine = quota_engine
    holder = engine.start("charge", {"tenant": "t", "hold": True}).run_id
    _drain(engine)
    assert engine.get(holder).status == RunStatus.SUSPENDED
    old = engine.start("charge", {"tenant": "t"}).run_id
    engine.dispatcher.sent.clear()  # type: ignore[attr-defined]
    # What the older release wrote: the same rows, the quota keys as a tag, no column.
    Run.objects.filter(pk=old).update(quota_keys=None, tags=["quota:erp-api:t"])
    assert QuotaMembership.objects.filter(run_id=old).exists()
    claim(engine, old)
    stored = Run.objects.get(pk=old)
    holders = QuotaMembership.objects.filter(quota="erp-api", key="t", slot="holder").count()
    assert stored.status != RunStatus.RUNNING, (stored.status, stored.quota_slot, holders)
    assert "erp-api" in engine.explain(old).sentence  # K3: explain names the quota it waits for
    # The holder ends: the old run is admitted, runs and gives the slot back (no leak, X3f).
    engine.signal(holder, "go")
    _drain(engine)
    for _ in range(5):
        engine.tick()
        _drain(engine)
    assert engine.get(old).status == RunStatus.COMPLETED, engine.get(old)
    last = engine.start("charge", {"tenant": "t"}).run_id
    _drain(engine)
    assert engine.get(last).status == RunStatus.COMPLETED, engine.get(last)
    leaked = list(
        QuotaMembership.objects.filter(quota="erp-api", key="t", slot="holder").values_list("run_id", flat=True)
    )
    assert not leaked, ([old, holder, last], leaked)


@mysql_only
def test_the_procedure_dropped_while_a_worker_runs_falls_back_to_the_orm_path_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S6, R5a (a80a945; docs/operations.rst): a store that found ``ds_take_lease``
    keeps using it; when the procedures are dropped under it (an operator, or
    ``migrate`` backwards), the next claim is refused by the server, logged once, and
    served on the ORM path: the run completes, nothing is left half-claimed. Created
    again (as ``migrate`` forwards does), they serve a new store. The procedures are
    dropped with ``mysql.uninstall``, the reverse of migrations 0016 and 0017: a
    ``migrate`` backwards past 0019 would also drop ``Run.priority``, which this
    release's code writes (X8)."""
    from durable_singleton.stores import mysql

    registry = Registry()
    registry.add("room-plain", "1", lambda ctx, i: None)
    engine = make_engine(DjangoStore(), registry=registry)
    first = engine.start("room-plain", {}).run_id
    _drain(engine)
    assert engine.get(first).status == RunStatus.COMPLETED
    assert engine.store._mysql_room() is not None  # type: ignore[attr-defined]
    try:
        mysql.uninstall(connection)
        assert not mysql.installed(connection.alias)
        _completes_with_the_room_off(engine, caplog)
    finally:
        mysql.install(connection)
    assert mysql.installed(connection.alias)
    fresh = make_engine(DjangoStore(), registry=registry)
    third = fresh.start("room-plain", {}).run_id
    _drain(fresh)
    assert fresh.get(third).status == RunStatus.COMPLETED


@mysql_only
def test_a_cancel_racing_the_call_is_never_run_over() -> None:
    """D6, R6, R5a: cancels land on a plain run's row from another thread while
    ``ds_take_lease`` claims it; whichever commits first wins and the other sees it:
    a run claimed keeps no ignored cancel flag it read as False, and a cancelled run
    is never leased."""
    registry = Registry()
    registry.add("room-plain", "1", lambda ctx, i: None)
    engine = make_engine(DjangoStore(), registry=registry)
    ids = [engine.start("room-plain", {}).run_id for _ in range(20)]
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    rows = {r.run_id: r for r in Run.objects.filter(pk__in=ids)}  # the turns' reads, before the cancels
    go = threading.Barrier(2)

    def cancel() -> None:
        try:
            go.wait(30)
            for run_id in ids:
                Run.objects.filter(pk=run_id, status=RunStatus.PENDING).update(cancel_requested=True)
        finally:
            connections.close_all()

    thread = threading.Thread(target=cancel)
    thread.start()
    go.wait(30)
    taken = {
        run_id: engine.store._take_lease(rows[run_id], {"recoveries": 0}, "tester", 30)  # type: ignore[attr-defined]
        for run_id in ids
    }
    thread.join(60)
    for run_id in ids:
        stored = Run.objects.get(pk=run_id)
        if taken[run_id]:
            assert stored.status == RunStatus.RUNNING and stored.lease_owner == "tester"
        else:
            assert stored.cancel_requested and stored.status == RunStatus.PENDING, stored


def test_racing_starts_under_a_raised_override_never_pass_limit_plus_the_cap() -> None:
    """S15, K2, S8a (f7cfc61's one-statement start): six threads start runs of one key
    (declared limit 1, max_queue_depth 1) while its runtime override is 2: the runs
    not refused are never more than the limit in force plus the cap (3), and each
    refusal is SingletonQueueFullError."""
    from durable_singleton.definitions import Singleton
    from durable_singleton.exceptions import SingletonQueueFullError
    from durable_singleton.models import SingletonKey

    registry = Registry()
    registry.add("capped", "1", holds_when_asked, singleton=Singleton(key=lambda i: "K", limit=1, max_queue_depth=1))
    engine = make_engine("django", registry=registry)
    engine.start("capped", {"hold": True})
    SingletonKey.objects.filter(workflow_name="capped", key="K").update(limit_override=2)

    def start(i: int) -> str:
        try:
            engine.start("capped", {"hold": True})
            return "started"
        except SingletonQueueFullError:
            return "refused"

    outcomes = run_threads(6, start)
    assert len(outcomes) == 6 and set(outcomes) <= {"started", "refused"}, outcomes
    active = Run.objects.filter(workflow_name="capped").exclude(status__in=["completed", "cancelled"]).count()
    assert active <= 3, (active, outcomes)


@mysql_only
def test_a_procedure_whose_definer_was_dropped_turns_the_room_off(caplog: pytest.LogCaptureFixture) -> None:
    """S6, R5a (docs/operations.rst: "a definer that is dropped later makes every
    CALL fail, which the store takes as 'not installed'"): ``ds_claim`` (a turn's
    claim, since 0017) created by a user the DBA dropped since (error 1449 at every
    CALL). The claim must take the ORM path, logged, and the run complete; it must
    not fail every turn."""
    from durable_singleton.stores import mysql

    registry = Registry()
    registry.add("room-plain", "1", lambda ctx, i: None)
    text = mysql.statements()["ds_claim"].replace(
        "CREATE PROCEDURE", "CREATE DEFINER = 'ds_gone_definer'@'%' PROCEDURE", 1
    )
    with connection.cursor() as cursor:
        cursor.execute("DROP USER IF EXISTS 'ds_gone_definer'@'%'")
        cursor.execute("CREATE USER 'ds_gone_definer'@'%'")
        cursor.execute("GRANT ALL PRIVILEGES ON *.* TO 'ds_gone_definer'@'%'")
        cursor.execute("DROP PROCEDURE IF EXISTS ds_claim")
        cursor.execute(text)
        cursor.execute("DROP USER 'ds_gone_definer'@'%'")
    try:
        engine = make_engine(DjangoStore(), registry=registry)
        _completes_with_the_room_off(engine, caplog)
    finally:
        mysql.install(connection)


@pytest.mark.skipif(
    connection.vendor != "postgresql" or connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold") is None,
    reason="PostgreSQL with prepare_threshold in OPTIONS (the fast path prepares its statements)",
)
def test_a_connection_lost_during_execute_is_never_sent_again() -> None:
    """R5a, K1, S7 (72c7067): the handoff's statements are prepared; its ``EXECUTE``
    waits on the holder's row lock and the backend is terminated. The message may
    have committed as far as the process knows: it raises, and is not sent again
    on a new connection (the holder, still locked by the other transaction while the
    error is seen, stays running and the key's counter does not move)."""
    import time

    from durable_singleton.models import SingletonKey
    from durable_singleton.stores import pg

    registry = Registry()
    registry.add("lost-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    engine = make_engine(DjangoStore(), registry=registry)
    limits = engine.limits()

    def holder_turn(key: str) -> Any:
        engine.start("lost-keyed", {"k": key}, run_id=f"{key}-holder")
        engine.start("lost-keyed", {"k": key}, run_id=f"{key}-waiter")
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        turn = claim(engine, f"{key}-holder", "lost-owner", 60)
        assert turn.run.status == RunStatus.RUNNING, turn
        return turn

    fast = engine.store._fast()  # type: ignore[attr-defined]
    assert fast is not None
    warm = holder_turn("warm")
    assert fast.finish(warm.run, "lost-owner", "completed", None, None, limits, None).run is not None
    turn = holder_turn("lost")
    before = SingletonKey.objects.get(workflow_name="lost-keyed", key="lost").last_token
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    other = connection.get_new_connection(connection.get_connection_params())
    killed: list[bool] = []
    resent: list[int] = []

    def terminate() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            waiting = other.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (pid,)
            ).fetchone()
            if waiting:
                killed.append(other.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0])
            time.sleep(0.02)
        # A resend on a new connection would wait behind the same lock: watch for it a while,
        # and end it too (the test then fails on ``resent``, it does not hang).
        watch = time.monotonic() + 3
        while time.monotonic() < watch:
            again = other.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid NOT IN (%s, pg_backend_pid())"
                " AND wait_event_type = 'Lock' AND datname = current_database()",
                (pid,),
            ).fetchall()
            for (resend,) in again:
                resent.append(resend)
                other.execute("SELECT pg_terminate_backend(%s)", (resend,))
            time.sleep(0.05)

    try:
        other.execute(f"SELECT 1 FROM {pg.RUN} WHERE run_id = 'lost-holder' FOR UPDATE")
        killer = threading.Thread(target=terminate)
        killer.start()
        try:
            with pytest.raises(Exception):  # noqa: B017  # the driver's error for the lost connection
                fast.finish(turn.run, "lost-owner", "completed", None, None, limits, None)
        finally:
            killer.join()
        assert killed == [True]
        assert not resent, resent  # the message that may have committed was not sent again
    finally:
        other.rollback()
        other.close()
    connection.close()
    holder = Run.objects.get(pk="lost-holder")
    assert (holder.status, holder.lease_owner) == (RunStatus.RUNNING, "lost-owner"), holder
    assert SingletonKey.objects.get(workflow_name="lost-keyed", key="lost").last_token == before


@mysql_only
def test_migration_0016_by_a_user_without_routine_grants_warns_and_the_store_serves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S6 (docs/operations.rst: "a user without CREATE ROUTINE: the migration logs a
    warning and creates nothing"): a database user with only SELECT, INSERT, UPDATE
    and DELETE runs migration 0016 forwards and backwards. MariaDB refuses such a user
    even ``DROP PROCEDURE IF EXISTS`` of a missing procedure (error 1370), which
    failed ``migrate``; each direction must warn and go on, and that user's store sees
    no room (the procedures are invisible to it) and serves on the ORM path."""
    import importlib

    from durable_singleton.stores import mysql

    migration = importlib.import_module("durable_singleton.migrations.0016_mysql_procedures")
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute("DROP USER IF EXISTS 'ds_no_routines'@'%'")
        cursor.execute("CREATE USER 'ds_no_routines'@'%' IDENTIFIED BY 'ds-no-routines'")
        cursor.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{name}`.* TO 'ds_no_routines'@'%'")
    limited = type(connections[connection.alias])(
        {**connection.settings_dict, "USER": "ds_no_routines", "PASSWORD": "ds-no-routines"}, alias="ds_no_routines"
    )
    try:
        mysql.uninstall(connection)
        with caplog.at_level("WARNING", logger="durable_singleton.migrations"):
            with limited.schema_editor() as editor:
                migration.create(None, editor)
            with limited.schema_editor() as editor:
                migration.drop(None, editor)
        assert [r.getMessage()[:48] for r in caplog.records] == [
            "durable_singleton: stored procedures not created",
            "durable_singleton: stored procedures not dropped",
        ], caplog.records
        assert not mysql.installed(connection.alias)
        mysql.install(connection)  # a DBA created them; the limited user may not EXECUTE them
        with limited.cursor() as cursor:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.ROUTINES WHERE ROUTINE_SCHEMA = DATABASE()"
                " AND ROUTINE_NAME = 'ds_take_lease'"
            )
            assert cursor.fetchone()[0] == 0  # invisible to it: room_of finds none, the ORM path serves
    finally:
        limited.close()
        mysql.install(connection)
        with connection.cursor() as cursor:
            cursor.execute("DROP USER IF EXISTS 'ds_no_routines'@'%'")


@mysql_only
def test_a_store_that_finds_no_procedure_says_it_takes_the_orm_path(caplog: pytest.LogCaptureFixture) -> None:
    """S6 (docs/operations.rst, the fallback): a process whose database has no
    ``ds_take_lease`` it may call (never created, or invisible to a user without
    ``EXECUTE``) serves on the ORM path and says so once, as it does when a CALL is
    refused; it used to fall back without a word."""
    from durable_singleton.stores import mysql

    registry = Registry()
    registry.add("room-plain", "1", lambda ctx, i: None)
    mysql.uninstall(connection)
    try:
        engine = make_engine(DjangoStore(), registry=registry)
        run_id = engine.start("room-plain", {}).run_id
        with caplog.at_level("WARNING", logger="durable_singleton.stores.mysql"):
            _drain(engine)
            _drain(engine)
        assert engine.get(run_id).status == RunStatus.COMPLETED
        said = [r.getMessage() for r in caplog.records if "room off" in r.getMessage()]
        assert len(said) == 1, caplog.records
    finally:
        mysql.install(connection)
