"""Indexes a generic plan cannot misread (S5, S12; issue 32 item 3).

The PostgreSQL fast path prepares its statements, and a worker's prepared
statement settles on a generic plan, planned without the key's value. With the
statistics a busy table has (about one run per key) such a plan read a key's
queue through whichever index on the key looked cheapest, then sorted every
run of the key to keep the first ``2 x limit``: ``ds_run_legacy_idx``
(workflow, key, tracked, status) or ``ds_run_key_idx`` (key alone). At 10,000
waiters the claim read 10,001 rows.

- ``ds_run_legacy_idx`` is dropped on PostgreSQL, where the partial
  ``ds_run_untracked_idx`` (migration 0009) serves the count of a key's
  untracked holders, in the fast path's statements and in the ORM's
  (``NOT singleton_tracked``). SQLite, MariaDB and MySQL keep it: their
  statements are planned with the key's value, MariaDB and MySQL have no
  partial index, and SQLite does not match the ORM's ``singleton_tracked =
  False`` to the partial index's ``NOT singleton_tracked``. The model no longer
  declares it, so it is left alone there.
- ``ds_run_key_idx`` (the admin's key filter) carries the queue's order after
  the key: ``singleton_key, workflow_name, singleton_slot, created_at, run_id,
  not_before``. Read through it or through ``ds_run_queue_idx``, the front of a
  queue comes in order and the read stops after ``2 x limit`` rows.

Reversing it puts both indexes back as they were.
"""

from typing import Any

from django.db import migrations, models

LEGACY = "ds_run_legacy_idx"
#: Where ds_run_untracked_idx (migration 0009) serves the legacy index's lookup and the legacy
#: index misled generic plans.
PARTIAL = ("postgresql",)


def drop_legacy(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor in PARTIAL:
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(LEGACY)}")


def create_legacy(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor not in PARTIAL:
        return
    quote = schema_editor.quote_name
    table = quote(apps.get_model("durable_singleton", "Run")._meta.db_table)
    columns = ", ".join(quote(c) for c in ("workflow_name", "singleton_key", "singleton_tracked", "status"))
    schema_editor.execute(f"CREATE INDEX {quote(LEGACY)} ON {table} ({columns})")


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0013_trace_parent"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.RemoveIndex(model_name="run", name=LEGACY)],
            database_operations=[migrations.RunPython(drop_legacy, create_legacy)],
        ),
        migrations.RemoveIndex(model_name="run", name="ds_run_key_idx"),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                fields=["singleton_key", "workflow_name", "singleton_slot", "created_at", "run_id", "not_before"],
                name="ds_run_key_idx",
            ),
        ),
    ]
