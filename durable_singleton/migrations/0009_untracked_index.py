"""A partial index of the untracked runs of each key (S12): the count of a key's
holders of an older release, in a statement planned without the key's value
(the PostgreSQL claim message reads it from the run's row), finds none at
once instead of reading every waiter of the key through ``ds_run_queue_idx``.

PostgreSQL and SQLite only, as raw SQL: MariaDB and MySQL have no partial
indexes (their claims take the ORM path, planned with the key's value), and a
``Meta`` index with a condition would raise Django's check ``models.W037``
there. Reversing it drops the index where it was made.
"""

from typing import Any

from django.db import migrations

NAME = "ds_run_untracked_idx"
VENDORS = ("postgresql", "sqlite")


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor not in VENDORS:
        return
    quote = schema_editor.quote_name
    table = quote(apps.get_model("durable_singleton", "Run")._meta.db_table)
    columns = ", ".join(quote(c) for c in ("workflow_name", "singleton_key", "status"))
    schema_editor.execute(
        f"CREATE INDEX {quote(NAME)} ON {table} ({columns})"
        f" WHERE {quote('singleton_key')} IS NOT NULL AND NOT {quote('singleton_tracked')}"
    )


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor in VENDORS:
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(NAME)}")


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0008_fill_step_count"),
    ]

    operations = [migrations.RunPython(create, drop)]
