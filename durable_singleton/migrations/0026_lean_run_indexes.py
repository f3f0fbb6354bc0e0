"""Fewer index entries per run on PostgreSQL and SQLite (issue 31: many keys one by one).

A run's row is written three times (its start, its claim, its settle); each
write of ``status`` is a new row version, and every index of the run table
takes an entry for it unless the index is partial and the version is outside
it. Each entry is WAL that the start's commit waits to flush. Here:

- ``ds_run_lease_idx`` (status, lease_expires_at), ``ds_run_deadline_idx``
  (status, deadline_at) and ``ds_run_debounce_idx`` (debounce_key,
  workflow_name, status) keep only the rows whose ``lease_expires_at``,
  ``deadline_at`` or ``debounce_key`` is set. Every query they serve compares
  that column (the tick's expired leases and overdue deadlines, D4, D5; a
  debounced start's open run, X7a), which implies it is set: both planners
  prove it. A settled run has none of them set.
- ``ds_run_due_idx`` (status, wake_at) keeps the parked runs
  (``statuses.PARKED_STATUSES``) on PostgreSQL, the runs whose ``wake_at`` is
  set on SQLite. PostgreSQL proves the tick's due runs (S8) and the audit's
  overdue waiters (K4: ``wake_at`` unset or not after a time, pending or
  suspended) inside the parked runs; SQLite matches a status list only as
  written, not the ORM's bound parameters, and proves ``wake_at`` set from
  the due runs' comparison.
- On PostgreSQL ``ds_run_untracked_idx`` (migration 0009) keeps only the
  untracked runs that count as holders (S12:
  ``admission.HOLDING_LEGACY_STATUSES``), as the count it serves reads them.
  Every settle clears ``singleton_tracked``, so before, every ended keyed run
  stayed in it for good. SQLite keeps it as it was: its planner did not match
  the claim's status list to the index's, and read a key's every run through
  ``ds_run_legacy_idx`` instead.
- On PostgreSQL, Django's ``varchar_pattern_ops`` index on ``run_id``
  (``..._like``, created for a character primary key) is dropped. Only
  ``durable_explain``'s prefix lookup used it; that lookup reads the table
  instead (a management command, not a hot path).

The model's ``Meta`` still declares the four indexes whole: a ``Meta`` index
with a condition would warn on MariaDB and MySQL (``models.W037``), which have
no partial index and keep them whole. Reversing it puts every index back as
it was.

On PostgreSQL the migration writes no lock that stops the run table's writes
(a rolling deploy keeps starting and settling runs while it runs): it is not
atomic, and each index is built under another name with ``CREATE INDEX
CONCURRENTLY``, the old one dropped with ``DROP INDEX CONCURRENTLY`` and the
new one renamed (each statement its own transaction). Run again after an
interruption, it starts over: a half-built index of the new name (left
invalid) is dropped first. Inside a transaction (a caller's ``atomic``) it
builds as SQLite does: ``DROP INDEX`` then ``CREATE INDEX``, which hold back
the table's writes until that transaction ends.
"""

from typing import Any

from django.db import migrations

#: (index, its columns, the column it keeps the rows of that have it set).
SET_ONLY = (
    ("ds_run_lease_idx", ("status", "lease_expires_at"), "lease_expires_at"),
    ("ds_run_deadline_idx", ("status", "deadline_at"), "deadline_at"),
    ("ds_run_debounce_idx", ("debounce_key", "workflow_name", "status"), "debounce_key"),
)
DUE = "ds_run_due_idx"
DUE_COLUMNS = ("status", "wake_at")
#: statuses.PARKED_STATUSES.
PARKED = ("pending", "suspended", "blocked")
UNTRACKED = "ds_run_untracked_idx"
UNTRACKED_COLUMNS = ("workflow_name", "singleton_key", "status")
#: admission.HOLDING_LEGACY_STATUSES, in its order.
HOLDING_LEGACY = ("running", "suspended", "blocked")
VENDORS = ("postgresql", "sqlite")


def _table(apps: Any, schema_editor: Any) -> str:
    return str(schema_editor.quote_name(apps.get_model("durable_singleton", "Run")._meta.db_table))


def _concurrently(schema_editor: Any) -> bool:
    """Whether indexes are built and dropped without a lock that stops the table's writes:
    PostgreSQL outside a transaction (the migration is not atomic)."""
    connection = schema_editor.connection
    return bool(connection.vendor == "postgresql" and not connection.in_atomic_block)


def _drop(schema_editor: Any, name: str) -> None:
    how = "CONCURRENTLY " if _concurrently(schema_editor) else ""
    schema_editor.execute(f"DROP INDEX {how}IF EXISTS {schema_editor.quote_name(name)}")


def _create(schema_editor: Any, table: str, name: str, columns: tuple[str, ...], where: str | None) -> None:
    quote = schema_editor.quote_name
    listed = ", ".join(quote(c) for c in columns)
    condition = f" WHERE {where}" if where else ""
    if not _concurrently(schema_editor):
        _drop(schema_editor, name)
        schema_editor.execute(f"CREATE INDEX {quote(name)} ON {table} ({listed}){condition}")
        return
    # Built beside the old one, which serves until it is dropped; then renamed to its name.
    building = f"{name}_building"
    _drop(schema_editor, building)  # an interrupted run's, invalid
    schema_editor.execute(f"CREATE INDEX CONCURRENTLY {quote(building)} ON {table} ({listed}){condition}")
    _drop(schema_editor, name)
    schema_editor.execute(f"ALTER INDEX {quote(building)} RENAME TO {quote(name)}")


def _in(schema_editor: Any, column: str, values: tuple[str, ...]) -> str:
    return f"{schema_editor.quote_name(column)} IN ({', '.join(repr(v) for v in values)})"


def _untracked_where(schema_editor: Any, holding: bool) -> str:
    quote = schema_editor.quote_name
    where = f"{quote('singleton_key')} IS NOT NULL AND NOT {quote('singleton_tracked')}"
    return f"{where} AND {_in(schema_editor, 'status', HOLDING_LEGACY)}" if holding else where


def _like_index(schema_editor: Any, table_name: str) -> str:
    """The name Django gave the ``varchar_pattern_ops`` index of ``run_id``."""
    return str(schema_editor._create_index_name(table_name, ["run_id"], suffix="_like"))


def lean(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in VENDORS:
        return
    table = _table(apps, schema_editor)
    quote = schema_editor.quote_name
    for name, columns, column in SET_ONLY:
        _create(schema_editor, table, name, columns, f"{quote(column)} IS NOT NULL")
    parked = _in(schema_editor, "status", PARKED) if vendor == "postgresql" else f"{quote('wake_at')} IS NOT NULL"
    _create(schema_editor, table, DUE, DUE_COLUMNS, parked)
    if vendor == "postgresql":
        _create(schema_editor, table, UNTRACKED, UNTRACKED_COLUMNS, _untracked_where(schema_editor, True))
        db_table = apps.get_model("durable_singleton", "Run")._meta.db_table
        _drop(schema_editor, _like_index(schema_editor, db_table))


def whole(apps: Any, schema_editor: Any) -> None:
    vendor = schema_editor.connection.vendor
    if vendor not in VENDORS:
        return
    table = _table(apps, schema_editor)
    for name, columns, _column in SET_ONLY:
        _create(schema_editor, table, name, columns, None)
    _create(schema_editor, table, DUE, DUE_COLUMNS, None)
    if vendor == "postgresql":
        _create(schema_editor, table, UNTRACKED, UNTRACKED_COLUMNS, _untracked_where(schema_editor, False))
        db_table = apps.get_model("durable_singleton", "Run")._meta.db_table
        quote = schema_editor.quote_name
        how = "CONCURRENTLY " if _concurrently(schema_editor) else ""
        schema_editor.execute(
            f"CREATE INDEX {how}IF NOT EXISTS {quote(_like_index(schema_editor, db_table))}"
            f" ON {table} ({quote('run_id')} varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    # Not atomic: PostgreSQL builds the indexes concurrently, one transaction per statement.
    atomic = False

    dependencies = [
        ("durable_singleton", "0025_mysql_key_locks"),
    ]

    operations = [migrations.RunPython(lean, whole)]
