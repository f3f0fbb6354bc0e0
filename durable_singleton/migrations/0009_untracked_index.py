"""A partial index of the untracked runs of each key (S12): the count of a key's
holders of an older release, in a statement planned without the key's value
(the PostgreSQL claim message), reads none at once instead of every waiter
of the key. PostgreSQL and SQLite only: Django creates no partial index on
MariaDB or MySQL."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0008_fill_step_count"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("singleton_key__isnull", False), ("singleton_tracked", False)),
                fields=["workflow_name", "singleton_key", "status"],
                name="ds_run_untracked_idx",
            ),
        ),
    ]
