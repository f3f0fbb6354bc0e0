"""The Celery app of the benchmark: the test project's app on bench settings, tick every TICK_SECONDS."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from durable_singleton.tasks import beat_schedule
from testproject.celery import app

app.conf.beat_schedule = beat_schedule(float(os.environ.get("BENCH_TICK_SECONDS", "1")))
# Celery's Django fixup closes every database connection before and after each
# task unless this is set (CONN_MAX_AGE is not consulted): keep them, and
# reconnect after this many tasks. Every system measured gets the same.
app.conf["CELERY_DB_REUSE_MAX"] = int(os.environ.get("BENCH_DB_REUSE_MAX", "100000"))

__all__ = ["app"]
