"""Shared quotas (X3): the run's quota marker and one membership row per quota key a run carries."""

import django.db.models.deletion
import durable_singleton.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_singleton', '0009_untracked_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='run',
            name='quota_slot',
            field=models.CharField(blank=True, choices=[('holder', 'holder'), ('waiter', 'waiter')], max_length=6, null=True, verbose_name='quota slot'),
        ),
        migrations.CreateModel(
            name='QuotaMembership',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('quota', durable_singleton.models.ExactCharField(max_length=64, verbose_name='quota')),
                ('key', durable_singleton.models.ExactCharField(max_length=127, verbose_name='key')),
                ('slot', models.CharField(blank=True, choices=[('holder', 'holder'), ('waiter', 'waiter')], max_length=6, null=True, verbose_name='slot')),
                ('fencing_token', models.BigIntegerField(blank=True, null=True, verbose_name='fencing token')),
                ('created_at', models.DateTimeField(verbose_name='created at')),
                ('run', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='quota_memberships', to='durable_singleton.run')),
            ],
            options={
                'verbose_name': 'quota membership',
                'verbose_name_plural': 'quota memberships',
                'ordering': ['quota', 'key', 'created_at', 'run'],
                'indexes': [models.Index(fields=['quota', 'key', 'slot', 'created_at', 'run'], name='ds_quota_queue_idx')],
                'constraints': [models.UniqueConstraint(fields=('run', 'quota'), name='ds_quota_run_uniq')],
            },
        ),
    ]
