"""The MariaDB/MySQL room's ``ds_claim`` and ``ds_settle_handoff`` created again
(durable_singleton.stores.mysql, sql/mysql/*.sql): their result sets, the CALLs of
``ds_send_runs`` included, are sent before their COMMIT, so a CALL refused in them
(``ds_send_runs`` missing) leaves nothing written and the ORM path serves whole (S4,
S7, R5a). Before, a claim or a settle committed and then failed: the store took the
ORM path over a run the procedure had already admitted or settled. ``ds_grant_waiters``
is created again too: its queue read's row count (twice the key's limit) is a BIGINT, as a
limit up to MAX_LIMIT doubles past INT ("Out of range value for column 'front_rows'").

Created on MySQL/MariaDB only; nothing on the other databases. A database user
without ``CREATE ROUTINE`` gets a warning and no procedure: the store then takes
the ORM path (docs/operations.rst)."""

from django.db import migrations

from durable_singleton.stores import mysql

PROCEDURES = ("ds_grant_waiters", "ds_settle_handoff", "ds_claim")
create, _drop = mysql.migration_steps(PROCEDURES)


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0020_run_priority"),
    ]

    operations = [
        # Backwards: the text of 0017 is not kept; the procedures as they are serve as well.
        migrations.RunPython(create, migrations.RunPython.noop, elidable=False),
    ]
