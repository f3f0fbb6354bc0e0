"""Settings of the test project. The database comes from ``DATABASE_URL``
(SQLite in the project folder by default), the broker from ``CELERY_BROKER_URL``."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "testproject-insecure-key")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "durable_singleton",
    "testproject.inventory",
    "testproject.demo",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "testproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "testproject.wsgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}",
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "0")),
    ),
}
_engine = DATABASES["default"]["ENGINE"]
if _engine.endswith("sqlite3"):
    # SQLite has no row locks: every transaction takes the write lock first (S13, F16).
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # A file (not :memory:) so threads and worker processes share it; one per
    # test process, so parallel runs in one checkout do not collide.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / f"test_db_{os.getpid()}.sqlite3")}
elif _engine.endswith("mysql"):
    DATABASES["default"]["OPTIONS"] = {"isolation_level": "read committed", "charset": "utf8mb4"}
elif _engine.endswith("postgresql") and os.environ.get("DATABASE_PREPARE", "1") == "1":
    # No pooler in transaction mode in front of this server: the fast path may
    # prepare its statements (docs/scaling.rst; DATABASE_PREPARE=0: it does not).
    DATABASES["default"]["OPTIONS"] = {"prepare_threshold": 5}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

DURABLE_SINGLETON = {
    "DISPATCH": os.environ.get("DURABLE_DISPATCH", "celery"),
    "LEASE_SECONDS": float(os.environ.get("DURABLE_LEASE_SECONDS", "30")),
    "LEASE_RENEW_SECONDS": float(os.environ.get("DURABLE_LEASE_RENEW_SECONDS", "10")),
    "MAX_RECOVERIES": int(os.environ.get("DURABLE_MAX_RECOVERIES", "5")),
    "STORE": os.environ.get("DURABLE_STORE", "django"),
    "REDELIVERY_SECONDS": float(os.environ.get("DURABLE_REDELIVERY_SECONDS", "5")),
    "WORKER_HEARTBEAT_SECONDS": float(os.environ.get("DURABLE_WORKER_HEARTBEAT_SECONDS", "2")),
    "WORKER_DEAD_SECONDS": float(os.environ.get("DURABLE_WORKER_DEAD_SECONDS", "10")),
    "CELERY_WORKER_TICK": os.environ.get("DURABLE_CELERY_WORKER_TICK", "1") == "1",
}
# remote-sync's body runs in another service, which only Celery reaches
# (system check E005): declared only where turns go through Celery.
if DURABLE_SINGLETON["DISPATCH"] == "celery":
    INSTALLED_APPS.append("testproject.remote_client")

# django.tasks (Django 6.0+; ignored by 5.2): tasks run as durable runs,
# sync_store one per store at a time (docs/django_tasks.rst).
TASKS = {
    "default": {
        "BACKEND": "durable_singleton.tasks_backend.DurableSingletonBackend",
        "OPTIONS": {
            "SINGLETONS": {
                "testproject.inventory.jobs.sync_store": {
                    "key": "testproject.inventory.jobs.store_key",
                    "limit": 1,
                    "max_queue_depth": 2,
                },
            },
        },
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "durable_singleton": {"handlers": ["console"], "level": os.environ.get("DURABLE_LOG_LEVEL", "WARNING")}
    },
}
