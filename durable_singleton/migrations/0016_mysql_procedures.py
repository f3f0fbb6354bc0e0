"""The MariaDB/MySQL room's stored procedures (durable_singleton.stores.mysql, sql/mysql/*.sql).

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

import logging

from django.db import DatabaseError, migrations

logger = logging.getLogger("durable_singleton.migrations")


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    from durable_singleton.stores import mysql

    try:
        mysql.install(schema_editor.connection)
    except DatabaseError as exc:
        # 1044/1142/1227: the user may not create routines; the ORM path serves (S14-style fallback).
        code = getattr(exc.__cause__, "args", None) or exc.args
        if not code or code[0] not in (1044, 1142, 1227, 1419):
            raise
        logger.warning("durable_singleton: stored procedures not created (%s); the ORM path serves MySQL", exc)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    from durable_singleton.stores import mysql

    mysql.uninstall(schema_editor.connection)


class Migration(migrations.Migration):

    dependencies = [
        ("durable_singleton", "0015_quota_keys"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
