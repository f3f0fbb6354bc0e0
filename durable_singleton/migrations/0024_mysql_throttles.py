"""The MariaDB/MySQL room's throttles (durable_singleton.stores.mysql,
sql/mysql/throttle.sql): ``ds_throttle_keys_of`` (a run's throttle keys in the lock
order) and ``ds_throttle_front`` (a locked throttle key's window, free admissions,
opening and first waiters). ``ds_admit_quota`` is created again: it claims a waiter
that carries throttles too, its throttle keys locked first, each key's window counted at
one reading of the database's clock after the locks, its admission recorded at that time
or the run parked until the window opens; ``ds_claim``, which calls it for such a
waiter, with it. Before, a run that carries throttles was claimed by the ORM path on
MariaDB: 16 round trips where a run without them takes 1 (X6b-X6d, X3e, S13, R5).

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

PROCEDURES = (*mysql.PROCEDURES_0024, "ds_admit_quota", "ds_claim")
create, _drop = mysql.migration_steps(PROCEDURES)
_drop_new = mysql.migration_steps(mysql.PROCEDURES_0024)[1]


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0023_throttle_priority"),
    ]

    operations = [
        # Backwards: the new procedures are dropped; the two created again stay as they are
        # (the text of 0022 is not kept): the room is then not installed (mysql.installed)
        # and the ORM path serves.
        migrations.RunPython(create, _drop_new, elidable=False),
    ]
