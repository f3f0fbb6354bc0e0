"""The run table's partial indexes (migration 0026, issue #31): a settled run leaves
the indexes of parked, leased, deadlined, debounced and untracked runs, and the
queries those indexes serve still read them (S8, S12, D4, D5, K4, X7a).

PostgreSQL and SQLite have partial indexes; MariaDB and MySQL keep every index
whole (the migration does nothing there).
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.db.models import Count, QuerySet

from durable_singleton.admission import legacy_holder_q
from durable_singleton.models import Run
from tests.helpers import apps_at, migrate_to_latest

pytestmark = pytest.mark.django_db(transaction=True)

PARTIAL = ("postgresql", "sqlite")
#: The index, and the condition it keeps its rows by, per vendor.
CONDITIONS = {
    "ds_run_due_idx": {
        "postgresql": "status)::text = ANY",
        "sqlite": '"wake_at" IS NOT NULL',
    },
    "ds_run_lease_idx": {"postgresql": "lease_expires_at IS NOT NULL", "sqlite": '"lease_expires_at" IS NOT NULL'},
    "ds_run_deadline_idx": {"postgresql": "deadline_at IS NOT NULL", "sqlite": '"deadline_at" IS NOT NULL'},
    "ds_run_debounce_idx": {"postgresql": "debounce_key IS NOT NULL", "sqlite": '"debounce_key" IS NOT NULL'},
    "ds_run_untracked_idx": {
        "postgresql": "'running'::character varying, 'suspended'::character varying, 'blocked'",
        "sqlite": 'NOT "singleton_tracked"',  # as migration 0009 made it: SQLite's claim reads it so
    },
}


def _definitions() -> dict[str, str]:
    """Each index of the run table by name: its SQL as the database keeps it."""
    table = Run._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", [table])
        elif connection.vendor == "sqlite":
            cursor.execute(
                "SELECT name, COALESCE(sql, '') FROM sqlite_master WHERE type = 'index' AND tbl_name = %s", [table]
            )
        else:
            cursor.execute(
                "SELECT DISTINCT index_name, '' FROM information_schema.statistics"
                " WHERE table_schema = DATABASE() AND table_name = %s",
                [table],
            )
        return {str(name): str(sql) for name, sql in cursor.fetchall()}


def _like_index() -> list[str]:
    return [
        name for name in _definitions() if name.startswith("durable_singleton_run_run_id") and name.endswith("_like")
    ]


def test_each_index_keeps_only_the_rows_its_queries_read() -> None:
    """#31, S8, S12, D4, D5, X7a: on PostgreSQL and SQLite the due, lease, deadline and
    debounce indexes are partial (a settled run, its wake, lease, deadline and debounce
    key cleared, is in none of them), on PostgreSQL ``ds_run_untracked_idx`` keeps the
    holding statuses alone (a settle drops a run's tracking) and there is no pattern
    index on ``run_id``; MariaDB and MySQL keep every index whole. Before migration
    0026 the four were whole and every settled keyed run stayed in the untracked index."""
    found = _definitions()
    for name, conditions in CONDITIONS.items():
        if connection.vendor in PARTIAL:
            assert " WHERE " in found[name].upper(), (name, found[name])
            assert conditions[connection.vendor] in found[name], (name, found[name])
        elif name != "ds_run_untracked_idx":
            assert name in found, sorted(found)
    assert _like_index() == [], _like_index()


def test_the_migration_reverses_to_whole_indexes_and_back() -> None:
    """#31: migrating back to 0025 puts every index back whole (and PostgreSQL's
    pattern index of ``run_id``); forward again makes them partial."""
    try:
        apps_at([("durable_singleton", "0025_mysql_key_locks")])
        found = _definitions()
        for name in CONDITIONS:
            if connection.vendor in PARTIAL:
                if name == "ds_run_untracked_idx":
                    assert "status" not in found[name].split("WHERE")[1], found[name]
                else:
                    assert " WHERE " not in found[name].upper(), (name, found[name])
        assert bool(_like_index()) == (connection.vendor == "postgresql"), sorted(found)
    finally:
        migrate_to_latest()
    test_each_index_keeps_only_the_rows_its_queries_read()


def _history(settled: int) -> None:
    """``settled`` ended keyed runs, 40 parked waiters, 10 running holders; then ANALYZE."""
    now = datetime.now(UTC)
    base = {"workflow_name": "lean", "workflow_version": "1", "created_at": now, "updated_at": now}
    rows = [
        Run(run_id=f"done-{i}", status="completed", singleton_key=f"k{i % 50}", finished_at=now, **base)
        for i in range(settled)
    ]
    rows += [
        Run(
            run_id=f"wait-{i}",
            status="suspended",
            singleton_key=f"k{i}",
            singleton_slot="waiter",
            singleton_tracked=True,
            wake_at=now + timedelta(seconds=i),
            **base,
        )
        for i in range(40)
    ]
    rows += [
        Run(
            run_id=f"hold-{i}",
            status="running",
            singleton_key=f"h{i}",
            singleton_slot="holder",
            singleton_tracked=True,
            lease_owner="w:1",
            lease_expires_at=now + timedelta(seconds=30),
            **base,
        )
        for i in range(10)
    ]
    Run.objects.bulk_create(rows, batch_size=1000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


@pytest.mark.skipif(connection.vendor not in PARTIAL, reason="MariaDB and MySQL have no partial index")
def test_the_ticks_and_audits_queries_read_the_partial_indexes() -> None:
    """S8, D4, D5, K4, S12, X7a: with 3,000 settled runs beside the active ones, each
    query a partial index serves reads that index, never the whole table: the due
    runs, expired leases, overdue deadlines, the audit's overdue waiters (PostgreSQL;
    SQLite matches no status list given as parameters), an older release's holders
    of a key (PostgreSQL; SQLite's ORM spelling of them reads its legacy index) and
    a debounced start's open run."""
    _history(3000)
    since = datetime.now(UTC)
    runs = Run.objects
    queries: dict[str, tuple[QuerySet[Run], str]] = {
        "due": (runs.due(), "ds_run_due_idx"),
        "lease_expired": (runs.lease_expired(), "ds_run_lease_idx"),
        "unredriven": (runs.unredriven(since), "ds_run_lease_idx"),
        "overdue": (runs.overdue(), "ds_run_deadline_idx"),
        "debounce": (runs.filter(debounce_key="x", workflow_name="lean"), "ds_run_debounce_idx"),
    }
    if connection.vendor == "postgresql":
        waiters = runs.overdue_waiters(since).values("workflow_name", "singleton_key").annotate(n=Count("pk"))
        queries["overdue_waiters"] = (waiters.order_by("workflow_name", "singleton_key"), "ds_run_due_idx")
        legacy = runs.filter(legacy_holder_q(), workflow_name="lean", singleton_key="k1")
        queries["legacy_holders"] = (legacy, "ds_run_untracked_idx")
    for name, (query, index) in queries.items():
        plan = query.explain()
        assert index in plan, f"{name}: {plan}"
        assert "Seq Scan on durable_singleton_run" not in plan, f"{name}: {plan}"


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL builds the indexes concurrently")
def test_the_migration_holds_back_no_write_of_the_run_table() -> None:
    """A rolling deploy migrates while runs start and settle (section 7, upgrades): with a
    transaction open on the run table (a worker's settle in flight), migration 0026 forward
    and back leaves other writes of the table free. Before, its ``DROP INDEX`` and ``CREATE
    INDEX`` queued for locks that conflict with every write, behind the open transaction,
    and each write queued behind them: a start waited until that transaction ended."""
    from django.db import connections

    now = datetime.now(UTC)
    base = {"workflow_name": "lean", "workflow_version": "1", "created_at": now, "updated_at": now}
    Run.objects.bulk_create([Run(run_id=f"held-{i}", status="pending", **base) for i in range(3)])
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # a transaction that wrote a run and stays open until released
        try:
            with transaction.atomic():
                Run.objects.filter(run_id="held-0").update(updated_at=now)
                holding.set()
                release.wait(60)
        finally:
            connections.close_all()

    def migrate(target: str) -> None:
        try:
            apps_at([("durable_singleton", target)])
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)
        finally:
            connections.close_all()

    for target in ("0025_mysql_key_locks", "0026_lean_run_indexes"):
        failures: list[BaseException] = []
        holder = threading.Thread(target=hold)
        holder.start()
        assert holding.wait(30)
        migration = threading.Thread(target=migrate, args=(target,))
        migration.start()
        time.sleep(1.0)  # the migration now waits for the open transaction
        assert migration.is_alive(), f"to {target}: it did not wait for the open transaction ({failures})"
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '5s'")
                began = time.monotonic()
                Run.objects.filter(run_id="held-1").update(updated_at=now)
                Run.objects.create(run_id=f"new-{target}", status="pending", **base)
            waited = time.monotonic() - began
        finally:
            release.set()
            holder.join(60)
            migration.join(120)
            holding.clear()
            release.clear()
        assert not failures, failures
        assert waited < 2.0, f"to {target}: a write waited {waited:.1f} s for the migration"
    test_each_index_keeps_only_the_rows_its_queries_read()
