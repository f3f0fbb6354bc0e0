"""The W3C traceparent current at a run's start (O8): each turn's span continues that trace."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_singleton", "0012_workers"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="trace_parent",
            field=models.CharField(blank=True, max_length=64, null=True, verbose_name="trace parent"),
        ),
    ]
