"""The test project's Celery app, with the durable_singleton tick in its beat schedule."""

from __future__ import annotations

import os

from celery import Celery

from durable_singleton.tasks import beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.conf.beat_schedule.update(beat_schedule())
