"""Settings of the benchmark: the test project's, plus the peers and persistent connections.

Every system measured (plain Celery, durable_singleton, dj-queue, procrastinate)
shares these settings, the same PostgreSQL database and the same Redis.
"""

from __future__ import annotations

import os

from testproject.settings import *  # noqa: F403
from testproject.settings import DATABASES, DURABLE_SINGLETON, INSTALLED_APPS

# The peers run on PostgreSQL only; bench.scale (BENCH_PEERS=0) also runs on MariaDB.
PEERS = ["dj_queue", "procrastinate.contrib.django"] if os.environ.get("BENCH_PEERS", "1") == "1" else []
INSTALLED_APPS = [*INSTALLED_APPS, "bench", *PEERS]

# Workers keep their database connection between tasks, as a production
# deployment does (the test project closes it after every task).
DATABASES["default"]["CONN_MAX_AGE"] = None
DATABASES["default"]["CONN_HEALTH_CHECKS"] = False

# The baseline's round trip reads its result back from Redis.
CELERY_RESULT_BACKEND = os.environ.get("CELERY_BROKER_URL", "redis://")
CELERY_RESULT_EXPIRES = 600
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False

DURABLE_SINGLETON = {
    **DURABLE_SINGLETON,
    "TICK_SECONDS": float(os.environ.get("BENCH_TICK_SECONDS", "1")),
}

# dj-queue: a Django Tasks backend. Worker slots match the Celery side (see bench/peers.py).
# Without the peers (bench.scale), the test project's TASKS.
if PEERS:
    TASKS = {
        "default": {
            "BACKEND": "dj_queue.backend.DjQueueBackend",
            "QUEUES": [],
            "OPTIONS": {
                "mode": "fork",
                "workers": [
                    {
                        "queues": "*",
                        "processes": int(os.environ.get("BENCH_DJQ_PROCESSES", "2")),
                        "threads": int(os.environ.get("BENCH_DJQ_THREADS", "2")),
                        "polling_interval": float(os.environ.get("BENCH_DJQ_POLL", "0.1")),
                    }
                ],
                "dispatchers": [{"polling_interval": 1, "batch_size": 500}],
                "preserve_finished_jobs": True,
                "listen_notify": True,
                "use_skip_locked": True,
                "process_heartbeat_interval": 60,
            },
        }
    }

# procrastinate: tasks live in bench/peer_tasks.py.
PROCRASTINATE_AUTODISCOVER_MODULE_NAME = "peer_tasks"
PROCRASTINATE_READONLY_MODELS = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # The tick thread's line per tick, in Celery's log format: scenario 9 reads it (bench.procs.tick_lines).
    "formatters": {"celery": {"format": "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler"},
        "ticks": {"class": "logging.StreamHandler", "formatter": "celery"},
    },
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"durable_singleton.tick": {"handlers": ["ticks"], "level": "INFO", "propagate": False}},
}
