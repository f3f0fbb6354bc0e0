"""The second service's Celery app: ``celery -A testproject.remote_service.celery:app worker -Q remote``."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.remote_service.settings")

app = Celery("remote_service")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
