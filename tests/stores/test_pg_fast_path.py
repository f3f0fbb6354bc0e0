"""The PostgreSQL fast path (durable_singleton.stores.pg, #17): the start, the
claim and the handoff are one round trip each, with no BEGIN or COMMIT, and a
run without stored steps does not read them (S5, S7, S8a, R3, R4, R5a).

On the other databases the store keeps the ORM path: these tests check that it
is not taken there. The rules the statements follow are checked by the
conformance suite (tests/stores/test_conformance.py) and the model-based test on
every database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import Outcome, RunStatus
from durable_singleton.stores import pg
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import round_trips as _round_trips

pytestmark = pytest.mark.django_db(transaction=True)


def _control(sql: str) -> bool:
    head = sql.strip().upper()
    return head in ("BEGIN", "COMMIT", "ROLLBACK") or "SAVEPOINT" in head


def _sent(fn: Callable[[], Any]) -> list[str]:
    """Return every statement ``fn`` sent on this thread's connection."""
    with CaptureQueriesContext(connection) as queries:
        fn()
    return [q["sql"] for q in queries.captured_queries]


def _prepared() -> set[str]:
    """The fast path's statements prepared on this thread's connection."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements")
        return {row[0] for row in cursor.fetchall() if row[0].startswith("ds_")}


def _chain(engine: Engine, key: str, n: int = 2) -> None:
    ids = [engine.start("fp-keyed", {"k": key}).run_id for _ in range(n)]
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.execute_chain(ids[0])
    assert {engine.get(r).status for r in ids} == {RunStatus.COMPLETED}


postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's prepared statements")
prepares = pytest.mark.skipif(
    connection.vendor != "postgresql" or connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold") is None,
    reason="PostgreSQL with prepare_threshold in OPTIONS (testproject sets it unless DATABASE_PREPARE=0)",
)


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.add_step("fp:step", lambda x: x)
    registry.add("fp-plain", "1", lambda ctx, i: None)
    registry.add("fp-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})

    def stepped(ctx: Any, i: Any) -> Any:
        return ctx.step("fp:step", i["n"])

    registry.add("fp-stepped", "1", stepped, singleton={"key": lambda i: i["k"]})
    made = make_engine(DjangoStore(), registry=registry)
    made.now()  # the engine's clock: read once here, not counted below
    return made


def test_the_record_covers_every_column_of_the_run_table() -> None:
    """R1: the raw statements read, write and return every column of the run
    table: a column added by a migration must be added to ``pg.COLUMNS`` (and to
    the start's INSERT) too."""
    assert sorted(pg.COLUMNS) == sorted(f.column for f in Run._meta.concrete_fields)


def test_each_transaction_of_a_run_is_one_round_trip_on_postgresql(engine: Engine) -> None:
    """S5, S7, R5a (#17): on PostgreSQL a singleton run on an idle key costs the
    start's INSERT, one claim message (its admission and the read) and one handoff
    message, with no BEGIN or COMMIT and no read of its (absent) steps; a waiter
    admitted by that handoff costs one confirmation claim. The MariaDB and SQLite
    rooms send no BEGIN or COMMIT either (#32)."""
    engine.start("fp-keyed", {"k": "K"}, run_id="a")
    engine.start("fp-keyed", {"k": "K"}, run_id="b")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    sql = _round_trips(lambda: engine.execute_chain("a"))
    assert engine.get("a").status == RunStatus.COMPLETED and engine.get("b").status == RunStatus.COMPLETED
    if connection.vendor != "postgresql":
        # The MariaDB and SQLite rooms: no transaction control either; MariaDB's four CALLs
        # (claim, settle with the grant, confirmation, settle) and its one check per store
        # that the procedures exist; SQLite's six statements (claim, settle and confirmation,
        # each grant followed by its token counter's move, K1).
        assert not any(_control(s) for s in sql), sql
        room = [s for s in sql if "information_schema.ROUTINES" not in s]
        assert len(room) == (4 if connection.vendor == "mysql" else 6), room
        return
    # admission + read of a (one message), handoff of a (grants b), confirmation of b, handoff of b.
    assert not any(_control(s) for s in sql), sql
    assert len(sql) == 4, sql
    assert "claim_admit" in sql[0] or "WITH me AS" in sql[0], sql
    assert not any("durable_singleton_step" in s for s in sql), "the steps were read"


def test_a_run_without_a_key_takes_its_lease_in_its_claim_message_on_postgresql(engine: Engine) -> None:
    """S4, S6, R5a (#17): on PostgreSQL a run without a key costs its claim
    message (which takes its lease: no read before a separate claim) and its
    settle; the ORM path elsewhere."""
    engine.start("fp-plain", {}, run_id="p")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    sql = _round_trips(lambda: engine.execute_chain("p"))
    assert engine.get("p").status == RunStatus.COMPLETED and engine.get("p").attempts == 1
    if connection.vendor != "postgresql":
        return
    assert not any(_control(s) for s in sql), sql
    assert len(sql) == 2, sql  # the claim message, the settle


def test_a_start_is_one_insert_on_postgresql_and_reports_only_what_it_inserted(engine: Engine) -> None:
    """R3, S16, S8a, R8 (#17): a start of a new id is the check of its id and one
    INSERT, with the backlog check folded in and ``created_at`` by the database's
    clock (no read of that clock first); a start of an existing id returns the
    stored run."""
    before = engine.store.now()
    sql = _round_trips(lambda: engine.start("fp-keyed", {"k": "K", "v": 1}, run_id="x"))
    assert before <= engine.get("x").created_at <= engine.store.now()
    if connection.vendor == "postgresql":
        # the id's check, the insert (as text, or by name when prepared)
        assert len(sql) == 2 and ("INSERT" in sql[1].upper() or sql[1].startswith("EXECUTE ds_start")), sql
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    again, created = engine.store.start_run(
        engine.get("x").evolve(input={"k": "K", "v": 2}), cap=None, deep_limit=1, backlog_wake_at=engine.now()
    )
    assert not created and again.input == {"k": "K", "v": 1}


def test_a_run_with_stored_steps_reads_them(engine: Engine) -> None:
    """R4: the steps are skipped only when the claim's own write saw none: a run
    parked after a step reads it on its next turn and does not run it again."""
    calls: list[int] = []
    engine.registry.add_step("fp:count", lambda x: calls.append(x) or x)

    def body(ctx: Any, i: Any) -> Any:
        ctx.step("fp:count", 1)
        return ctx.wait_for_signal("go")

    engine.registry.add("fp-waiter", "1", body)
    engine.start("fp-waiter", {}, run_id="s")
    assert engine.execute("s") == Outcome.SUSPENDED
    engine.signal("s", "go", "done")
    assert engine.execute("s") == Outcome.COMPLETED
    assert calls == [1] and engine.get("s").output == "done"


@prepares
def test_the_fast_path_prepares_each_statement_once_per_connection(engine: Engine) -> None:
    """#17, S7: with ``prepare_threshold`` set (tests/testproject: no pooler), the
    first runs on a connection prepare the fast path's statements, later runs
    send them by name only (``EXECUTE``: planned once, not at each handoff), and a
    new connection prepares them again."""
    connection.close()
    first = _sent(lambda: _chain(engine, "P1"))
    assert any(s.startswith("PREPARE ") for s in first), (len(first), [s[:50] for s in first])
    names = _prepared()
    assert {n.split("_")[1] for n in names} >= {"read", "take", "finish", "claim", "create", "lock", "start"}, names
    again = _sent(lambda: _chain(engine, "P2"))
    assert not any(s.startswith("PREPARE ") for s in again), again
    assert any("EXECUTE ds_finish_" in s for s in again), again
    connection.close()
    third = _sent(lambda: _chain(engine, "P3"))
    assert any(s.startswith("PREPARE ") for s in third), (len(third), [s[:60] for s in third])


@prepares
def test_statements_deallocated_behind_its_back_are_prepared_again(engine: Engine) -> None:
    """#17: a ``DEALLOCATE ALL`` (as a pooler's ``DISCARD ALL``) between two runs:
    the next message fails outside a transaction, nothing of it is committed, the
    statements are prepared again and the message is sent again; the runs
    complete once each."""
    _chain(engine, "D1")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert _prepared() == set()
    _chain(engine, "D2", n=3)
    assert any(n.startswith("ds_finish_") for n in _prepared())


@prepares
def test_a_statement_prepared_in_a_rolled_back_transaction_stays_prepared(engine: Engine) -> None:
    """#17: a start inside ``transaction.atomic()`` that rolls back prepared its
    INSERT in that transaction; ``PREPARE`` is not undone by the rollback, so the
    next start (outside and inside a transaction) sends it by name and works."""
    from django.db import transaction

    connection.close()

    class RollbackError(Exception):
        pass

    with pytest.raises(RollbackError), transaction.atomic():
        engine.start("fp-keyed", {"k": "R"}, run_id="rolled-back")
        raise RollbackError
    assert not Run.objects.filter(pk="rolled-back").exists()
    assert any(n.startswith("ds_start_keyed_") for n in _prepared())
    with transaction.atomic():
        engine.start("fp-keyed", {"k": "R"}, run_id="kept")
    assert Run.objects.filter(pk="kept").exists()


@postgresql_only
def test_without_prepare_threshold_the_text_is_sent_whole(engine: Engine) -> None:
    """#17: a connection without ``prepare_threshold`` (Django's default, for a
    pooler in transaction mode) never prepares: the statements go as text, and
    the runs complete."""
    connection.close()
    connection.ensure_connection()
    connection.connection.prepare_threshold = None
    try:
        sent = _sent(lambda: _chain(engine, "T1"))
        assert not any(s.startswith(("PREPARE ", "EXECUTE ")) for s in sent), sent
        assert _prepared() == set()
    finally:
        connection.close()


def test_the_untracked_runs_have_a_partial_index_where_the_database_has_them() -> None:
    """S12 (#17, migration 0009): PostgreSQL and SQLite keep a partial index of each
    key's untracked runs, which the claim message's count of older-release holders
    reads (planned without the key's value); MariaDB and MySQL have no partial index."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Run._meta.db_table)
    present = "ds_run_untracked_idx" in constraints
    assert present == (connection.vendor in ("postgresql", "sqlite")), sorted(constraints)


def test_the_legacy_index_is_dropped_on_postgresql_only() -> None:
    """S5, S12 (issue 32 item 3, migration 0014): on PostgreSQL the partial
    ``ds_run_untracked_idx`` serves the untracked holders' count and
    ``ds_run_legacy_idx``, which led generic plans of the queue read to sort every
    run of the key, is gone; SQLite, MariaDB and MySQL (planned with the key's
    value) keep it. The key index carries the queue's order after the key."""
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Run._meta.db_table)
    assert ("ds_run_legacy_idx" in constraints) == (connection.vendor != "postgresql"), sorted(constraints)
    assert constraints["ds_run_key_idx"]["columns"][:3] == ["singleton_key", "workflow_name", "singleton_slot"]
