"""The MariaDB/MySQL room's settle, handoff and claim procedures (durable_singleton.stores.mysql,
sql/mysql/handoff.sql and sql/mysql/claims.sql): ``ds_grant_waiters``, ``ds_send_runs``,
``ds_settle_handoff`` and ``ds_claim``.

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

create, drop = mysql.migration_steps(mysql.PROCEDURES_0017)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0016_mysql_procedures"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
