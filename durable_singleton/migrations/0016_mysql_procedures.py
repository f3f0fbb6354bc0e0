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
        mysql.install(schema_editor.connection, mysql.PROCEDURES_0016)
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
        mysql.uninstall(schema_editor.connection, mysql.PROCEDURES_0016)
    except DatabaseError as exc:
        # A user without ALTER ROUTINE (MariaDB refuses it even DROP PROCEDURE IF EXISTS): any
        # procedure a DBA created stays; it writes only columns this migration's predecessors made.
        if not mysql.not_allowed(exc):
            raise
        logger.warning("durable_singleton: stored procedures not dropped (%s)", exc)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0015_quota_keys"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
