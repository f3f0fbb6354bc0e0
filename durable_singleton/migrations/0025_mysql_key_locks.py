"""The MariaDB/MySQL room's key locks (durable_singleton.stores.mysql, sql/mysql/quota.sql):
``ds_key_ids`` reads the ids of the key rows a claim or a settle is about to lock, before
its transaction starts, and ``ds_lock_known_key`` locks a row so read by its primary key,
the record alone. Created first, then their callers again: ``ds_lock_key`` (the same
signature, for a procedure of an older release during a rolling deploy), ``ds_admit_quota``,
``ds_claim``, ``ds_settle_quotas`` and ``ds_settle_handoff``. Before, each locked a key row with an
upsert first, whose duplicate check on a row that exists takes a next-key lock: waiting,
it covers the gap before the row in the key table's unique index, and a holder of the row
that created a key row in that gap deadlocked with the waiter (S13a, X3e, section 7), as
the ORM path did before ``DjangoStore.lock_key`` locked the rows it knows by a locking read.

Created on MySQL/MariaDB only; nothing on the other databases. A database user without
``CREATE ROUTINE`` gets a warning and no procedure: the store then takes the ORM path
(docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

PROCEDURES = (
    *mysql.PROCEDURES_0025,
    "ds_lock_key",
    "ds_admit_quota",
    "ds_claim",
    "ds_settle_quotas",
    "ds_settle_handoff",
)
create, _drop = mysql.migration_steps(PROCEDURES)
_drop_new = mysql.migration_steps(mysql.PROCEDURES_0025)[1]


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0024_mysql_throttles"),
    ]

    operations = [
        # Backwards: the two new procedures are dropped; the five created again stay as they
        # are (the text of 0024 is not kept): the room is then not installed
        # (mysql.installed) and the ORM path serves.
        migrations.RunPython(create, _drop_new, elidable=False),
    ]
