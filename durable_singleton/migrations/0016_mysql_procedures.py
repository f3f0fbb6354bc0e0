"""The MariaDB/MySQL room's stored procedures (durable_singleton.stores.mysql, sql/mysql/*.sql).

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

create, drop = mysql.migration_steps(mysql.PROCEDURES_0016)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0015_quota_keys"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
