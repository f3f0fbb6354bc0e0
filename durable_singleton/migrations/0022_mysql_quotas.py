"""The MariaDB/MySQL room's shared quotas (durable_singleton.stores.mysql,
sql/mysql/quota.sql): ``ds_admit_quota`` (a quota waiter's claim, called by
``ds_claim``), ``ds_take_quota_lease`` (a quota holder's confirmation) and
``ds_settle_quotas`` (the settle of a run that carries quotas and the handoff of
its slots), with the procedures they share (``ds_lock_key``, ``ds_quota_keys_of``,
``ds_quota_front``, ``ds_send_granted``). ``ds_grant_waiters`` is created again: it
takes the carriers a handoff admits (X3h); ``ds_settle_handoff`` and ``ds_claim``,
which call it, with it. Before, a run that carries quotas took the ORM path on
MariaDB: 25 to 30 round trips where a run without quotas takes 4 (X3c-X3i, S13).

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

PROCEDURES = (*mysql.PROCEDURES_0022, "ds_grant_waiters", "ds_settle_handoff", "ds_claim")
create, _drop = mysql.migration_steps(PROCEDURES)
_drop_new = mysql.migration_steps(mysql.PROCEDURES_0022)[1]


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0021_mysql_commit_last"),
    ]

    operations = [
        # Backwards: the new procedures are dropped; the three created again stay as they are
        # (the text of 0021 is not kept: they serve the ORM path's quota runs as well).
        migrations.RunPython(create, _drop_new, elidable=False),
    ]
