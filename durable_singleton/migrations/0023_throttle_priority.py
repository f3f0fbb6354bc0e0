"""A throttle key's queue in the one order of X8a (X6c): ``ThrottleMembership.priority``,
a copy of its run's priority written with the membership, and ``ds_throttle_order_idx``
rebuilt on (throttle, key, priority DESC, created_at, run), so a claim reads the front of
a throttle key's queue in admission order and stops after ``limit`` rows (S13).

The column is added with a database default of 0, so a process of the release before,
still running during a rolling upgrade, goes on inserting memberships (priority 0: its
throttled runs of another priority wait among the priority 0 until it is gone; the
limit and the window hold, S12, X8d). The memberships already stored take their run's
priority. On SQLite Django rebuilds the table to add the column; every index of this
table is in the model's state, so the rebuild keeps them.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def copy_priority(apps: Any, schema_editor: Any) -> None:
    db = schema_editor.connection.alias
    membership = apps.get_model("durable_singleton", "ThrottleMembership")
    run = apps.get_model("durable_singleton", "Run")
    priority = run.objects.using(db).filter(run_id=OuterRef("run_id")).values("priority")[:1]
    membership.objects.using(db).exclude(run__priority=0).update(priority=Subquery(priority))


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0022_mysql_quotas"),
    ]

    operations = [
        migrations.AddField(
            model_name="throttlemembership",
            name="priority",
            field=models.SmallIntegerField(db_default=0, default=0, verbose_name="priority"),
        ),
        migrations.RunPython(copy_priority, migrations.RunPython.noop),
        migrations.RemoveIndex(model_name="throttlemembership", name="ds_throttle_order_idx"),
        migrations.AddIndex(
            model_name="throttlemembership",
            index=models.Index(
                fields=["throttle", "key", "-priority", "created_at", "run"], name="ds_throttle_order_idx"
            ),
        ),
    ]
