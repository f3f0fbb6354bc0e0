"""The soak's Celery app: the test project's app on soak settings."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "soak.settings")

from testproject.celery import app

__all__ = ["app"]

# Celery's Django fixup closes the database connection around every task
# unless this is set: keep it, as a deployment with CONN_MAX_AGE does (a
# connection killed by a fault is replaced through CONN_HEALTH_CHECKS).
app.conf["CELERY_DB_REUSE_MAX"] = 1000
