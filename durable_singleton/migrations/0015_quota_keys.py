"""A run's quota keys in their own column (X3b): the only source of its keys.

The release before quotas stored a caller's tags as given, so a tag spelled
``quota:<name>:<key>`` was read as a quota key after an upgrade. The keys a
start recorded are those with a membership: each such run gets them in the new
column; every other tag, whatever its spelling, stays a caller's tag. The tags
themselves are kept, and this release goes on writing a run's keys as tags too
(``admission.stored_tags``): a process of the release before, still running
during a rolling upgrade, reads a run's quotas from its tags. The column is
nullable: that process, which does not know it, still inserts runs (NULL: the
keys are the run's memberships, read by ``stores.django.record_of``)."""

from django.db import migrations, models

BATCH = 500


def copy_quota_keys(apps, schema_editor):
    Run = apps.get_model("durable_singleton", "Run")
    QuotaMembership = apps.get_model("durable_singleton", "QuotaMembership")
    db = schema_editor.connection.alias
    members = QuotaMembership.objects.using(db).order_by("run_id", "id").values_list("run_id", "quota", "key")
    keys: dict[str, list[list[str]]] = {}
    for run_id, quota, key in members.iterator():
        keys.setdefault(run_id, []).append([quota, key])
    ids = list(keys)
    for start in range(0, len(ids), BATCH):
        for run in Run.objects.using(db).filter(pk__in=ids[start : start + BATCH]).only("run_id"):
            run.quota_keys = keys[run.run_id]
            run.save(update_fields=["quota_keys"])


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0014_depth_independent_indexes"),
    ]

    operations = [
        # The column is added without a database default: on SQLite a default (or NOT NULL)
        # rebuilds the table, and the rebuild keeps only the indexes of the model's state,
        # dropping 0009's partial ds_run_untracked_idx and the ds_run_legacy_idx that 0014
        # keeps there (S12). ``default=list`` is Django's, applied when a row is built.
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.AddField(
                    model_name="run",
                    name="quota_keys",
                    field=models.JSONField(blank=True, null=True, verbose_name="quota keys"),
                ),
            ],
            state_operations=[
                migrations.AddField(
                    model_name="run",
                    name="quota_keys",
                    field=models.JSONField(blank=True, default=list, null=True, verbose_name="quota keys"),
                ),
            ],
        ),
        migrations.RunPython(copy_quota_keys, migrations.RunPython.noop, elidable=True),
    ]
