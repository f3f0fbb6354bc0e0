"""Fill ``Run.step_count`` for runs whose steps were stored before 0004.

0004 added the column with 0 for every existing run. The claim skips reading a
run's steps when its ``step_count`` is 0 (R4: no one else stores a step under
the new lease), so a run that had stored steps before 0004 would run them
again. This sets each run's count to its stored steps where it is lower; runs
without steps are left alone. Reversing it changes nothing.
"""

from typing import Any

from django.db import migrations
from django.db.models import Count


def fill_step_count(apps: Any, schema_editor: Any) -> None:
    Run = apps.get_model("durable_singleton", "Run")
    Step = apps.get_model("durable_singleton", "Step")
    db = schema_editor.connection.alias
    counts = Step.objects.using(db).order_by().values("run_id").annotate(n=Count("id"))
    for row in counts.iterator():
        Run.objects.using(db).filter(pk=row["run_id"], step_count__lt=row["n"]).update(step_count=row["n"])


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0007_not_before"),
    ]

    operations = [
        migrations.RunPython(fill_step_count, migrations.RunPython.noop, elidable=True),
    ]
