"""The MariaDB/MySQL room's settle, handoff and claim procedures (durable_singleton.stores.mysql,
sql/mysql/handoff.sql and sql/mysql/claims.sql): ``ds_grant_waiters``, ``ds_send_runs``,
``ds_settle_handoff`` and ``ds_claim``.

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
        mysql.install(schema_editor.connection, mysql.PROCEDURES_0017)
    except DatabaseError as exc:
        # The user may not create (or drop) routines; the ORM path serves (S14-style fallback).
        if not mysql.not_allowed(exc):
            raise
        logger.warning("durable_singleton: stored procedures not created (%s); the ORM path serves MySQL", exc)


def drop(apps, schema_editor):
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
        ("durable_singleton", "0016_mysql_procedures"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
