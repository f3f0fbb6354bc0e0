"""Settings of the second service: the same database and broker as the test
project (``DATABASE_URL``, ``CELERY_BROKER_URL``), but only durable_singleton
and this service's own app, whose ``workflows`` module holds the remote body."""

from __future__ import annotations

from testproject.settings import (  # noqa: F401 - the shared database and broker
    BASE_DIR,
    CELERY_ACCEPT_CONTENT,
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP,
    CELERY_BROKER_URL,
    CELERY_TASK_IGNORE_RESULT,
    CELERY_TASK_SERIALIZER,
    CELERY_WORKER_PREFETCH_MULTIPLIER,
    DATABASES,
    DEFAULT_AUTO_FIELD,
    LOGGING,
    SECRET_KEY,
    TIME_ZONE,
    USE_TZ,
)

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "durable_singleton",
    "testproject.remote_service",
]
#: Written into each remote body's output, so a test sees which service ran it.
SERVICE_NAME = "remote"
DURABLE_SINGLETON = {"DISPATCH": "celery"}
