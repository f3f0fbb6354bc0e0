"""Settings of the run of Django's tests/tasks suite (tests/django_suite/run.py).

As Django's tests/runtests.py does, the test package ``tasks`` is an
installed app. The database is a SQLite file in a temporary directory (its
own, so the run can go beside the pytest SQLite pass), in the immediate
transaction mode the store needs (S13). Turns go to the manual dispatcher;
the stand-in backends drain it or leave it (tests/django_suite/backends.py).
"""

from __future__ import annotations

import os
import tempfile

SECRET_KEY = "django-tasks-suite-insecure-key"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "durable_singleton",
    "tasks",
]
_DB_DIR = os.environ.get("DS_DJANGO_SUITE_DB_DIR") or tempfile.gettempdir()
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(_DB_DIR, f"django_suite_{os.getpid()}.sqlite3"),
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
        "TEST": {"NAME": os.path.join(_DB_DIR, f"test_django_suite_{os.getpid()}.sqlite3")},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
TIME_ZONE = "UTC"
TASKS = {"default": {"BACKEND": "durable_singleton.tasks_backend.DurableSingletonBackend"}}
DURABLE_SINGLETON = {"DISPATCH": "manual"}
