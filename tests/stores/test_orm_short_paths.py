"""The ORM path's short cuts on every database (#32 item 1 and 2): a start reads the
database's clock, the key's override and its queue's depth in one statement; a run
claimed with no stored step reads no steps; a settle locks its key's row with one
statement on MySQL/MariaDB and SQLite (R4, R8, S8a, S13, K2).

On PostgreSQL the store is built with ``raw_sql=False`` so that the ORM path is the
one measured; the rules the statements follow are checked by the conformance suite
(tests/stores/test_conformance.py) and the model-based tests on every database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_singleton.engine import Engine
from durable_singleton.models import Run, SingletonKey
from durable_singleton.statuses import ParkReason, RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import drain_chains, keyed_registry

pytestmark = pytest.mark.django_db(transaction=True)

_STEP_TABLE = "durable_singleton_step"
_KEY_TABLE = "durable_singleton_singletonkey"


def _statements(fn: Callable[[], Any]) -> list[str]:
    """The statements ``fn`` sent on this thread's connection, transaction control left out."""
    with CaptureQueriesContext(connection) as queries:
        fn()
    sent = [q["sql"] for q in queries.captured_queries]
    return [s for s in sent if s.strip().upper().split(" ")[0] not in ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT")]


@pytest.fixture
def engine() -> Engine:
    return make_engine(DjangoStore(raw_sql=False), registry=keyed_registry("short-keyed"))


def test_a_start_reads_the_clock_the_override_and_the_depth_in_one_statement(engine: Engine) -> None:
    """A keyed start on the ORM path is one read (the database's clock, R8; the key's
    override, K2; the depth of its queue, S8a) and its INSERT: no separate clock read."""
    engine.now()  # the engine's clock reads the database's now every few minutes, not per start
    sent = _statements(lambda: engine.start("short-keyed", {"k": "one-read"}))
    assert len(sent) == 2, sent
    assert sent[-1].lstrip().upper().startswith("INSERT"), sent


def test_a_start_on_a_deep_queue_counts_with_the_keys_override(engine: Engine) -> None:
    """S8a, K2: the depth is judged against the limit in force. With an override of 2 on a
    key declared with limit 1, one holder and one waiter are not a deep queue (the start
    is sent a turn); two holders and two waiters are (the start is created parked)."""
    holder = engine.start("short-keyed", {"k": "deep", "park": True}).run_id
    drain_chains(engine)
    assert engine.get(holder).status == RunStatus.SUSPENDED
    SingletonKey.objects.filter(workflow_name="short-keyed", key="deep").update(limit_override=2)
    second = engine.start("short-keyed", {"k": "deep", "park": True}).run_id
    drain_chains(engine)  # admitted under the override: two holders
    assert engine.get(second).admitted
    waiter = engine.start("short-keyed", {"k": "deep"})
    assert not ParkReason.SINGLETON.matches(waiter.park_reason), "two holders, no waiter: not deep"
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.start("short-keyed", {"k": "deep"})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    # Its turns were dropped: pending waiters, two holders and two waiters in the queue.
    deep = engine.start("short-keyed", {"k": "deep"})
    assert ParkReason.SINGLETON.matches(deep.park_reason), deep
    assert deep.wake_at is not None and deep.wake_at > deep.created_at


def test_a_run_admitted_by_a_handoff_without_steps_reads_no_steps(engine: Engine) -> None:
    """R4: a waiter a handoff admits has stored no step; its claim, a compare-and-set on
    the run as granted, knows it, and its body starts without reading the steps."""
    holder = engine.start("short-keyed", {"k": "handoff", "park": True}).run_id
    drain_chains(engine)
    waiter = engine.start("short-keyed", {"k": "handoff"}).run_id
    drain_chains(engine)  # denied: parked behind the holder (S5)
    engine.signal(holder, "go")
    sent = _statements(lambda: drain_chains(engine))
    assert engine.get(waiter).status == RunStatus.COMPLETED
    # The holder, resumed, reads its steps (it stored one: the signal's); the waiter reads none.
    assert sum(_STEP_TABLE in s and s.lstrip().upper().startswith("SELECT") for s in sent) == 1, sent


@pytest.mark.skipif(connection.vendor == "postgresql", reason="PostgreSQL locks the key row with one SELECT already")
def test_a_settle_locks_its_key_with_one_statement(engine: Engine) -> None:
    """S13: the settle of a holder locks its key's row (the lock order: the key first) with
    one statement on MySQL/MariaDB (``SELECT ... FOR UPDATE`` of the row its claim created)
    and SQLite (an upsert that returns the row)."""
    engine.start("short-keyed", {"k": "settle"})
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    store = engine.store
    turn = store.begin_turn(
        queued.popleft(),
        "tester",
        lease_seconds=30,
        limits={"short-keyed": 1},
        max_recoveries=3,
        retry=engine._retry_policy(),
    )
    taken = turn.run
    assert taken is not None and turn.state == TurnState.RUN
    sent = _statements(lambda: store.finish(taken, "tester", RunStatus.COMPLETED, limits={"short-keyed": 1}))
    assert sum(_KEY_TABLE in s for s in sent) == 1, sent


mysql_only = pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB room's stored procedures")


@pytest.fixture
def room_engine() -> Engine:
    registry = keyed_registry("room-keyed")
    registry.add("room-plain", "1", lambda ctx, i: None)
    return make_engine("django", registry=registry)


@mysql_only
def test_a_holders_confirmation_is_one_call_on_mysql(room_engine: Engine) -> None:
    """S6, R5a: on MySQL/MariaDB the confirmation of a waiter a handoff admitted is one
    CALL of ``ds_take_lease`` (its row lock and its compare-and-set in the procedure's
    own transaction), not SET autocommit, the lock, the update, COMMIT, SET autocommit."""
    engine = room_engine
    holder = engine.start("room-keyed", {"k": "call", "park": True}).run_id
    drain_chains(engine)
    waiter = engine.start("room-keyed", {"k": "call"}).run_id
    drain_chains(engine)
    # The parked holder ends (as a cancel ends it) and hands its slot to the waiter (S7).
    done = engine.store.finish(engine.get(holder), None, RunStatus.CANCELLED, limits={"room-keyed": 1})
    assert [g.run_id for g in done.granted] == [waiter]
    granted = engine.get(waiter)
    assert granted.admitted and granted.status == RunStatus.SUSPENDED, granted
    store = engine.store
    assert store._mysql_room() is not None  # type: ignore[attr-defined]  # looked up once per database
    turn: list[Any] = []
    sent = _statements(
        lambda: turn.append(
            store.begin_turn(
                waiter,
                "tester",
                lease_seconds=30,
                limits={"room-keyed": 1},
                max_recoveries=3,
                retry=engine._retry_policy(),
                known=granted,
            )
        )
    )
    assert [s.split("(")[0] for s in sent] == ["CALL ds_take_lease"], sent
    assert turn[0].state == TurnState.RUN and turn[0].run.lease_owner == "tester"
    stored = engine.get(waiter)
    assert (stored.status, stored.lease_owner, stored.admitted) == (RunStatus.RUNNING, "tester", True)
    assert stored.attempts == granted.attempts + 1


@mysql_only
def test_a_confirmation_of_a_run_changed_under_the_turn_writes_nothing_on_mysql(room_engine: Engine) -> None:
    """R5a, R6: the procedure's compare is the run as the turn read it, its cancel flag
    included: a run whose cancel was requested after the read is not taken."""
    engine = room_engine
    run = engine.start("room-plain", {})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    as_read = Run(**_fields(run.run_id))  # the turn's read, before the cancel lands
    Run.objects.filter(pk=run.run_id).update(cancel_requested=True)
    taken = engine.store._take_lease(as_read, {"recoveries": 0}, "tester", 30)  # type: ignore[attr-defined]
    assert taken == 0
    stored = engine.get(run.run_id)
    assert (stored.status, stored.lease_owner, stored.attempts) == (RunStatus.PENDING, None, 0)


def _fields(run_id: str) -> dict[str, Any]:
    row = Run.objects.get(pk=run_id)
    return {f.attname: getattr(row, f.attname) for f in Run._meta.concrete_fields}


@mysql_only
def test_without_the_procedures_the_claim_takes_the_orm_path(room_engine: Engine) -> None:
    """The fallback (docs/operations.rst): a database where the procedures could not be
    created serves every claim on the ORM path, with the same decisions (S6, S7)."""
    from durable_singleton.stores import mysql

    mysql.uninstall(connection)
    try:
        engine = make_engine(DjangoStore(), registry=room_engine.registry)
        holder = engine.start("room-keyed", {"k": "fallback", "park": True}).run_id
        drain_chains(engine)
        waiter = engine.start("room-keyed", {"k": "fallback"}).run_id
        drain_chains(engine)
        engine.signal(holder, "go")
        sent = _statements(lambda: drain_chains(engine))
        assert not any(s.startswith("CALL") for s in sent), sent
        assert {engine.get(r).status for r in (holder, waiter)} == {RunStatus.COMPLETED}
    finally:
        mysql.install(connection)


@mysql_only
def test_the_procedures_lease_counts_from_after_the_wait_for_the_run_lock(room_engine: Engine) -> None:
    """R5, R8: a confirmation that waits for the run's row lock counts its lease on the
    database's clock from after the wait: the lease ends at least ``lease_seconds``
    after the moment the other transaction released the row, never short by the wait."""
    import threading

    from django.db import connections, transaction

    engine = room_engine
    run = engine.start("room-plain", {})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    as_read = Run(**_fields(run.run_id))
    released: list[Any] = []
    locked = threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                list(Run.objects.select_for_update().filter(pk=run.run_id).values_list("pk", flat=True))
                locked.set()
                with connection.cursor() as cursor:
                    for _ in range(600):  # until the claim waits for the row (a generous bound)
                        cursor.execute(
                            "SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = %s", ["LOCK WAIT"]
                        )
                        if cursor.fetchone()[0]:
                            break
                        threading.Event().wait(0.05)
                    cursor.execute("SELECT UTC_TIMESTAMP(6)")
                    released.append(cursor.fetchone()[0])
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(60)
    taken = engine.store._take_lease(as_read, {"recoveries": 0}, "tester", 30)  # type: ignore[attr-defined]
    holder.join(60)
    assert taken == 1
    stored = Run.objects.get(pk=run.run_id)
    assert stored.lease_expires_at is not None
    from datetime import UTC, timedelta

    assert stored.lease_expires_at >= released[0].replace(tzinfo=UTC) + timedelta(seconds=30), (stored, released)


def test_each_procedure_of_the_mysql_room_is_a_named_block() -> None:
    """#32: the room's SQL lives in named files, one ``-- name:`` block per statement,
    loaded by name through the one loader of every room (``durable_singleton.sql``):
    every procedure the migrations create has its block, sent under its name's
    comment, and the block creates that procedure."""
    from durable_singleton import sql
    from durable_singleton.stores import mysql

    blocks = mysql.statements()
    assert blocks == sql.statements("mysql")
    assert set(mysql.PROCEDURES) <= set(blocks)
    for name in mysql.PROCEDURES:
        lines = blocks[name].splitlines()
        assert lines[0] == f"/* durable_singleton:{name} */", lines[:2]
        assert lines[1] == f"CREATE PROCEDURE {name}(", lines[:2]


def _round_trips(fn: Callable[[], Any]) -> int:
    """The round trips ``fn`` made on this thread's connection, whatever sent them (the
    driver's own ``SET autocommit`` and ``COMMIT`` included): ``bench.roundtrips``."""
    from bench.roundtrips import RoundTrips

    with RoundTrips(connection) as trips:
        fn()
    return trips.total


@mysql_only
def test_a_run_on_an_idle_key_is_at_most_four_round_trips_on_mysql(room_engine: Engine) -> None:
    """#32 targets, S5, S7, R5a: on MySQL/MariaDB a singleton run on an idle key, start to
    settle, makes at most 4 round trips: the start (2: the clock and the depth, the
    insert), the claim and its admission (one CALL of ``ds_claim``), the settle and its
    handoff (one CALL of ``ds_settle_handoff``); 18 before the procedures."""
    engine = room_engine
    connection.ensure_connection()
    engine.store._mysql_room()  # type: ignore[attr-defined]  # the one-off lookup, not per run
    engine.now()  # the engine's clock reads the database's now and then, not per run (as bench.statements)
    run_ids: list[str] = []
    trips = _round_trips(
        lambda: (run_ids.append(engine.start("room-keyed", {"k": "idle-4"}).run_id), drain_chains(engine))
    )
    stored = engine.get(run_ids[0])
    assert stored.status == RunStatus.COMPLETED and stored.fencing_token == 1, stored
    assert trips <= 4, trips


@mysql_only
def test_a_handoff_admitted_run_is_at_most_four_round_trips_on_mysql(room_engine: Engine) -> None:
    """#32 targets, S6, S7, K1: a run admitted by its predecessor's handoff costs at most
    4 round trips on MySQL/MariaDB: its start deep in the queue (2), its share of the
    predecessor's settle and grant (one CALL of ``ds_settle_handoff`` for the settle and
    every grant), its confirmation (one CALL of ``ds_take_lease``); its own settle is
    the next run's handoff. 11 before ``ds_settle_handoff``."""
    engine = room_engine
    store = engine.store
    policy = engine._retry_policy()
    limits = {"room-keyed": 1}
    holder = engine.start("room-keyed", {"k": "handoff-4", "park": True}).run_id
    drain_chains(engine)
    first = engine.start("room-keyed", {"k": "handoff-4"}).run_id
    drain_chains(engine)
    second: list[str] = []
    start = _round_trips(lambda: second.append(engine.start("room-keyed", {"k": "handoff-4"}).run_id))
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # parked behind the holder (S8a)
    claimed = store.begin_turn(holder, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy)
    assert claimed.state == TurnState.RUN and claimed.run is not None, claimed
    done: list[Any] = []
    settle = _round_trips(
        lambda: done.append(store.finish(claimed.run, "tester", RunStatus.COMPLETED, limits=limits))  # type: ignore[arg-type]
    )
    assert done[0].settled and [g.run_id for g in done[0].granted] == [first], done[0]
    granted = done[0].granted[0]
    assert granted.admitted and granted.fencing_token == 2, granted
    turns: list[Any] = []
    confirm = _round_trips(
        lambda: turns.append(
            store.begin_turn(
                first, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy, known=granted
            )
        )
    )
    assert turns[0].state == TurnState.RUN and turns[0].run.fencing_token == 2, turns[0]
    assert (start, settle, confirm) == (2, 1, 1), (start, settle, confirm)
    assert not engine.get(second[0]).admitted  # it waits behind the new holder (S5)


@mysql_only
def test_a_settle_with_a_lost_lease_writes_nothing_in_the_procedure(room_engine: Engine) -> None:
    """R5a, R5, S7: ``ds_settle_handoff`` settles only on the owner's lease unexpired by
    the database's clock, judged after the key's lock: a lease that expired (or another
    owner's) settles nothing and grants nothing, in one CALL; the owner with a live
    lease then settles and hands the slot off."""
    engine = room_engine
    store = engine.store
    limits = {"room-keyed": 1}
    policy = engine._retry_policy()
    holder = engine.start("room-keyed", {"k": "stale", "park": True}).run_id
    drain_chains(engine)
    waiter = engine.start("room-keyed", {"k": "stale"}).run_id
    drain_chains(engine)
    claimed = store.begin_turn(holder, "owner-a", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy)
    assert claimed.state == TurnState.RUN and claimed.run is not None
    before = Run.objects.get(pk=waiter)
    stale = store.finish(claimed.run, "owner-b", RunStatus.COMPLETED, limits=limits)
    assert not stale.settled and not stale.granted, stale
    with connection.cursor() as cursor:  # the lease ran out by the database's clock (R5)
        cursor.execute(
            "UPDATE durable_singleton_run SET lease_expires_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND "
            "WHERE run_id = %s",
            [holder],
        )
    stale_after: list[Any] = []
    run = claimed.run
    sent = _statements(lambda: stale_after.append(store.finish(run, "owner-a", RunStatus.COMPLETED, limits=limits)))
    assert [s.split("(")[0] for s in sent] == ["CALL ds_settle_handoff"], sent
    assert not stale_after[0].settled and not stale_after[0].granted
    assert Run.objects.get(pk=holder).status == RunStatus.RUNNING
    after = Run.objects.get(pk=waiter)
    assert (after.singleton_slot, after.fencing_token, after.updated_at) == (
        before.singleton_slot,
        before.fencing_token,
        before.updated_at,
    )
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE durable_singleton_run SET lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND "
            "WHERE run_id = %s",
            [holder],
        )
    done = store.finish(claimed.run, "owner-a", RunStatus.COMPLETED, limits=limits)
    assert done.settled and [g.run_id for g in done.granted] == [waiter], done


@mysql_only
def test_a_claim_of_a_run_changed_since_its_read_is_decided_on_the_orm_path(room_engine: Engine) -> None:
    """R5a, R6, S9: ``ds_claim`` admits only a waiter as it read it; a waiter whose cancel
    was requested is no candidate: the procedure only reads it and the ORM path settles
    it cancelled, granting nothing to it (one CALL, then the ORM's settle)."""
    engine = room_engine
    store = engine.store
    limits = {"room-keyed": 1}
    waiter = engine.start("room-keyed", {"k": "changed"}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk=waiter).update(cancel_requested=True)
    sent = _statements(
        lambda: store.begin_turn(
            waiter, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
        )
    )
    assert [s for s in sent if s.startswith("CALL")][:1] == [s for s in sent if s.startswith("CALL ds_claim")][:1], sent
    assert any(s.startswith("CALL ds_claim") for s in sent), sent
    stored = Run.objects.get(pk=waiter)
    assert stored.status == RunStatus.CANCELLED and stored.fencing_token is None, stored


@mysql_only
def test_without_the_settle_procedure_the_handoff_takes_the_orm_path_and_says_so(
    room_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """S7, K1 (docs/operations.rst): a store that found the procedures, whose
    ``ds_settle_handoff`` is dropped under it, settles on the ORM path at the
    server's refusal, logged ("room off"), with the same grant and token; nothing is
    left half-settled."""
    from durable_singleton.stores import mysql

    engine = make_engine(DjangoStore(), registry=room_engine.registry)
    store = engine.store
    limits = {"room-keyed": 1}
    holder = engine.start("room-keyed", {"k": "dropped", "park": True}).run_id
    drain_chains(engine)
    waiter = engine.start("room-keyed", {"k": "dropped"}).run_id
    drain_chains(engine)
    claimed = store.begin_turn(
        holder, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
    )
    assert claimed.run is not None and store._mysql_room() is not None  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute("DROP PROCEDURE ds_settle_handoff")
    try:
        with caplog.at_level("WARNING", logger="durable_singleton.stores.mysql"):
            done = store.finish(claimed.run, "tester", RunStatus.COMPLETED, limits=limits)
        assert any("room off" in r.getMessage() for r in caplog.records), caplog.records
        assert done.settled and [g.run_id for g in done.granted] == [waiter], done
        assert Run.objects.get(pk=holder).status == RunStatus.COMPLETED
        assert Run.objects.get(pk=waiter).fencing_token == 2
    finally:
        mysql.install(connection)
