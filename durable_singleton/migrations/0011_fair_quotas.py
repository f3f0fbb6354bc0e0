"""Fair quotas (X4): a membership's sub-key (tenant), weight and tag, the admission order (tag, created_at, run) and a sub-key's last tag as indexes."""


import durable_singleton.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_singleton', '0010_quotas'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='quotamembership',
            name='ds_quota_queue_idx',
        ),
        migrations.AddField(
            model_name='quotamembership',
            name='sub_key',
            field=durable_singleton.models.ExactCharField(blank=True, default='', max_length=127, verbose_name='sub-key'),
        ),
        migrations.AddField(
            model_name='quotamembership',
            name='tag',
            field=models.BigIntegerField(default=0, verbose_name='fair tag'),
        ),
        migrations.AddField(
            model_name='quotamembership',
            name='weight',
            field=models.PositiveIntegerField(default=1, verbose_name='weight'),
        ),
        migrations.AddIndex(
            model_name='quotamembership',
            index=models.Index(fields=['quota', 'key', 'slot', 'tag', 'created_at', 'run'], name='ds_quota_order_idx'),
        ),
        migrations.AddIndex(
            model_name='quotamembership',
            index=models.Index(fields=['quota', 'key', 'sub_key', 'tag'], name='ds_quota_fair_idx'),
        ),
    ]
