"""A run's quota keys in their own column (X3b): tags hold the caller's tags only.

The release before quotas stored a caller's tags as given, so a tag spelled
``quota:<name>:<key>`` was read as a quota key after an upgrade. The keys a
start recorded are those with a membership: each such tag moves to the new
column; every other tag, whatever its spelling, stays a caller's tag. The column
is nullable: an older release's process, which does not know it, still inserts
runs during a rolling upgrade (NULL: no quota keys)."""

from django.db import migrations, models

QUOTA_PREFIX = "quota:"
BATCH = 500


def move_quota_tags(apps, schema_editor):
    Run = apps.get_model("durable_singleton", "Run")
    QuotaMembership = apps.get_model("durable_singleton", "QuotaMembership")
    db = schema_editor.connection.alias
    members = QuotaMembership.objects.using(db).order_by("run_id", "id").values_list("run_id", "quota", "key")
    keys: dict[str, list[list[str]]] = {}
    for run_id, quota, key in members.iterator():
        keys.setdefault(run_id, []).append([quota, key])
    ids = list(keys)
    for start in range(0, len(ids), BATCH):
        for run in Run.objects.using(db).filter(pk__in=ids[start : start + BATCH]).only("run_id", "tags"):
            carried = keys[run.run_id]
            spelled = {f"{QUOTA_PREFIX}{quota}:{key}" for quota, key in carried}
            run.tags = [tag for tag in run.tags or () if tag not in spelled]
            run.quota_keys = carried
            run.save(update_fields=["tags", "quota_keys"])


def restore_quota_tags(apps, schema_editor):
    Run = apps.get_model("durable_singleton", "Run")
    QuotaMembership = apps.get_model("durable_singleton", "QuotaMembership")
    db = schema_editor.connection.alias
    carriers = QuotaMembership.objects.using(db).values_list("run_id", flat=True).distinct()
    for run in Run.objects.using(db).filter(pk__in=carriers).only("run_id", "tags", "quota_keys").iterator():
        run.tags = [*(run.tags or ()), *(f"{QUOTA_PREFIX}{quota}:{key}" for quota, key in run.quota_keys or ())]
        run.save(update_fields=["tags"])


class Migration(migrations.Migration):

    dependencies = [
        ('durable_singleton', '0014_depth_independent_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='quota_keys',
            field=models.JSONField(blank=True, default=list, null=True, verbose_name='quota keys'),
        ),
        migrations.RunPython(move_quota_tags, restore_quota_tags, elidable=True),
    ]
