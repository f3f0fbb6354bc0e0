"""A run's priority inside its key (X8): ``Run.priority`` and ``QuotaMembership.priority``,
and the queue indexes in the new order (priority DESC, created_at, run_id).

Both columns are added with a database default of 0, so a process of the release
before, still running during a rolling upgrade, goes on inserting runs and
memberships (they get the priority 0). On SQLite the column is added by ``ALTER
TABLE ... ADD COLUMN``, which SQLite allows for a NOT NULL column with a constant
default: Django's own ``AddField`` would rebuild the table there, and the rebuild
keeps only the indexes of the model's state, dropping 0009's partial
``ds_run_untracked_idx`` and the ``ds_run_legacy_idx`` that 0014 keeps (S12; 0015
met the same choice). The indexes are rebuilt in place: ``ds_run_queue_idx`` and
``ds_run_key_idx`` take ``priority DESC`` after the slot, ``ds_quota_order_idx``
after the fair tag, so the front of a queue is still read in order and the read
stops after ``2 x limit`` rows (S5, S13). On MySQL/MariaDB the room's
``ds_grant_waiters`` (0017) is created again, ordering its queue read by priority
too; reversed, the room's 0017 procedures are dropped (their text before this
migration is gone): the ORM path serves until 0017's procedures are created again.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import DatabaseError, migrations, models

logger = logging.getLogger("durable_singleton.migrations")

RUN_FIELDS = ["workflow_name", "singleton_key", "singleton_slot", "-priority", "created_at", "run_id", "not_before"]
KEY_FIELDS = ["singleton_key", "workflow_name", "singleton_slot", "-priority", "created_at", "run_id", "not_before"]
OLD_RUN_FIELDS = ["workflow_name", "singleton_key", "singleton_slot", "created_at", "run_id", "not_before"]
OLD_KEY_FIELDS = ["singleton_key", "workflow_name", "singleton_slot", "created_at", "run_id", "not_before"]


def _priority() -> models.SmallIntegerField[int, int]:
    return models.SmallIntegerField(default=0, db_default=0, verbose_name="priority")


def _adder(model_name: str) -> tuple[Any, Any]:
    def add(apps: Any, schema_editor: Any) -> None:
        model = apps.get_model("durable_singleton", model_name)
        field = model._meta.get_field("priority")
        if schema_editor.connection.vendor == "sqlite":
            quote = schema_editor.quote_name
            table = quote(model._meta.db_table)
            schema_editor.execute(f"ALTER TABLE {table} ADD COLUMN {quote('priority')} smallint DEFAULT 0 NOT NULL")
        else:
            schema_editor.add_field(model, field)

    def remove(apps: Any, schema_editor: Any) -> None:
        model = apps.get_model("durable_singleton", model_name)
        if schema_editor.connection.vendor == "sqlite":
            quote = schema_editor.quote_name
            schema_editor.execute(f"ALTER TABLE {quote(model._meta.db_table)} DROP COLUMN {quote('priority')}")
        else:
            schema_editor.remove_field(model, model._meta.get_field("priority"))

    return add, remove


def _add_priority(model_name: str) -> list[migrations.operations.base.Operation]:
    """The field in the state, then its column: the column's writer reads the field from
    the state, in both directions."""
    add, remove = _adder(model_name)
    field = migrations.AddField(model_name=model_name, name="priority", field=_priority())
    return [
        migrations.SeparateDatabaseAndState(state_operations=[field]),
        # Not in a transaction of its own: on MySQL/MariaDB a DDL statement may not run inside one.
        migrations.RunPython(add, remove, atomic=False),
    ]


def grant_by_priority(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    from durable_singleton.stores import mysql

    try:
        mysql.install(schema_editor.connection, ("ds_grant_waiters",))
    except DatabaseError as exc:
        # The user may not create (or drop) routines; the ORM path serves (S14-style fallback).
        if not mysql.not_allowed(exc):
            raise
        logger.warning("durable_singleton: ds_grant_waiters not re-created (%s); the ORM path serves MySQL", exc)


def drop_room(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    from durable_singleton.stores import mysql

    try:
        mysql.uninstall(schema_editor.connection, mysql.PROCEDURES_0017)
    except DatabaseError as exc:
        if not mysql.not_allowed(exc):
            raise
        logger.warning("durable_singleton: stored procedures not dropped (%s)", exc)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0019_throttle"),
    ]

    operations = [
        *_add_priority("run"),
        *_add_priority("quotamembership"),
        migrations.RemoveIndex(model_name="run", name="ds_run_queue_idx"),
        migrations.AddIndex(model_name="run", index=models.Index(fields=RUN_FIELDS, name="ds_run_queue_idx")),
        migrations.RemoveIndex(model_name="run", name="ds_run_key_idx"),
        migrations.AddIndex(model_name="run", index=models.Index(fields=KEY_FIELDS, name="ds_run_key_idx")),
        migrations.RemoveIndex(model_name="quotamembership", name="ds_quota_order_idx"),
        migrations.AddIndex(
            model_name="quotamembership",
            index=models.Index(
                fields=["quota", "key", "slot", "tag", "-priority", "created_at", "run"], name="ds_quota_order_idx"
            ),
        ),
        migrations.RunPython(grant_by_priority, drop_room, atomic=False),
    ]
