"""Workers that pull (O1, O6, O7): the turn notices a ``durable_worker`` takes
(``DISPATCH = "worker"``), the registry of live worker processes, and on
PostgreSQL the trigger that NOTIFYs the channel ``durable_singleton_turn``
when a transaction that wrote notices commits (a rolled-back start notifies
nobody). The function is versioned by name (``_v1``), so a later release can
ship another beside it during a rolling deploy."""

from typing import Any

from django.db import migrations, models

CHANNEL = "durable_singleton_turn"
FUNCTION = "durable_singleton_notify_turn_v1"
TRIGGER = "durable_singleton_turn_notify"


def create_trigger(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("durable_singleton", "TurnNotice")._meta.db_table)
    schema_editor.execute(
        f"CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger AS $$\n"
        f"BEGIN\n"
        f"    PERFORM pg_notify('{CHANNEL}', '');\n"
        f"    RETURN NULL;\n"
        f"END;\n"
        f"$$ LANGUAGE plpgsql"
    )
    schema_editor.execute(
        f"CREATE TRIGGER {TRIGGER} AFTER INSERT ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {FUNCTION}()"
    )


def drop_trigger(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    table = schema_editor.quote_name(apps.get_model("durable_singleton", "TurnNotice")._meta.db_table)
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON {table}")
    schema_editor.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0011_fair_quotas"),
    ]

    operations = [
        migrations.CreateModel(
            name="WorkerProcess",
            fields=[
                ("name", models.CharField(max_length=191, primary_key=True, serialize=False, verbose_name="name")),
                ("host", models.CharField(max_length=191, verbose_name="host")),
                ("pid", models.PositiveIntegerField(verbose_name="pid")),
                ("mode", models.CharField(max_length=16, verbose_name="mode")),
                ("threads", models.PositiveIntegerField(verbose_name="threads")),
                ("queues", models.CharField(blank=True, default="", max_length=191, verbose_name="queues")),
                ("started_at", models.DateTimeField(verbose_name="started at")),
                ("last_seen_at", models.DateTimeField(verbose_name="last seen at")),
            ],
            options={
                "verbose_name": "worker process",
                "verbose_name_plural": "worker processes",
                "ordering": ["host", "pid"],
            },
        ),
        migrations.CreateModel(
            name="TurnNotice",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("run_id", models.CharField(max_length=191, verbose_name="run")),
                ("queue", models.CharField(default="default", max_length=191, verbose_name="queue")),
            ],
            options={
                "verbose_name": "turn notice",
                "verbose_name_plural": "turn notices",
                "indexes": [
                    models.Index(fields=["queue", "id"], name="ds_turn_queue_idx"),
                    models.Index(fields=["run_id"], name="ds_turn_run_idx"),
                ],
            },
        ),
        migrations.RunPython(create_trigger, drop_trigger),
    ]
