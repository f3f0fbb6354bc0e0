"""Settings of the soak: the test project's, with the soak app and short leases.

The lease, renewal and tick are short so that a frozen or killed worker is
taken over within seconds; MariaDB runs at its default REPEATABLE READ (what
a new install gives, S13a) unless ``SOAK_MYSQL_ISOLATION`` says otherwise.
"""

from __future__ import annotations

import os

from testproject.settings import *  # noqa: F403
from testproject.settings import DATABASES, DURABLE_SINGLETON, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "soak"]

if DATABASES["default"]["ENGINE"].endswith("mysql"):
    DATABASES["default"]["OPTIONS"] = {
        "isolation_level": os.environ.get("SOAK_MYSQL_ISOLATION", "repeatable read"),
        "charset": "utf8mb4",
    }
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

DURABLE_SINGLETON = {
    **DURABLE_SINGLETON,
    "LEASE_SECONDS": float(os.environ.get("DURABLE_LEASE_SECONDS", "4")),
    "LEASE_RENEW_SECONDS": float(os.environ.get("DURABLE_LEASE_RENEW_SECONDS", "1")),
    "MAX_RECOVERIES": int(os.environ.get("DURABLE_MAX_RECOVERIES", "100")),
    "TICK_SECONDS": float(os.environ.get("DURABLE_TICK_SECONDS", "0.5")),
    "REDELIVERY_SECONDS": float(os.environ.get("DURABLE_REDELIVERY_SECONDS", "3")),
    "SIGNAL_FALLBACK_SECONDS": float(os.environ.get("DURABLE_SIGNAL_FALLBACK_SECONDS", "10")),
}

# The engine's warnings (a failed tick job while a server restarts, a fenced
# turn) go to SOAK_DIR/engine.log, appended by every process of the soak.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s %(message)s"}},
    "handlers": {
        "file": {
            "class": "logging.FileHandler",
            "filename": os.path.join(os.environ.get("SOAK_DIR", "."), "engine.log"),
            "formatter": "plain",
        }
    },
    "loggers": {"durable_singleton": {"handlers": ["file"], "level": os.environ.get("DURABLE_LOG_LEVEL", "WARNING")}},
}
