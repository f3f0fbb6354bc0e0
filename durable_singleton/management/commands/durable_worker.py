"""``manage.py durable_worker``: worker threads and the tick in the foreground (O1)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...checks import remote_workflows
from ...conf import get_settings
from ...worker import ForegroundWorker


class Command(BaseCommand):
    help = (
        "Run durable_singleton worker threads and the tick in the foreground, without Celery, until "
        "SIGTERM or SIGINT; then finish the turns in hand (up to --grace seconds) and hand back the rest."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--threads", type=int, default=None, help="Worker threads (default: WORKER_THREADS).")
        parser.add_argument(
            "--tick-seconds", type=float, default=None, help="Seconds between ticks (default: TICK_SECONDS)."
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            help="Seconds a stop waits for running turns before handing them back (default: LEASE_SECONDS).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        settings = get_settings()
        threads = options["threads"] if options["threads"] is not None else settings.WORKER_THREADS
        tick = options["tick_seconds"] if options["tick_seconds"] is not None else settings.TICK_SECONDS
        if threads < 1:
            raise CommandError("--threads must be >= 1")
        if tick <= 0:
            raise CommandError("--tick-seconds must be > 0")
        if options["grace"] is not None and options["grace"] < 0:
            raise CommandError("--grace must be >= 0")
        if remote := remote_workflows():
            # This worker runs every turn on its own threads: a remote body's
            # turn would be handed back to itself without end (E005).
            names = ", ".join(f"{name!r} (queue {queue!r})" for name, queue in remote)
            raise CommandError(
                f"remote workflows are registered: {names}; their bodies run in another service's Celery "
                "worker, which this worker is not. Run Celery workers here, or do not declare them in this process."
            )
        self._log_to_stderr(options["verbosity"])
        worker = ForegroundWorker(threads=threads, tick_seconds=tick, grace_seconds=options["grace"])
        signal.signal(signal.SIGTERM, worker.request_stop)
        signal.signal(signal.SIGINT, worker.request_stop)
        self.stdout.write(
            f"durable_worker pid {os.getpid()}: {worker.dispatcher.describe()}, dispatch {settings.DISPATCH}; ready."
        )
        self.stdout.flush()
        left = worker.run()
        if worker.handed_back is None:
            handed = f"{len(left)} turns left to their leases (the database did not take them back)"
        else:
            handed = f"{worker.handed_back} turns handed back"
        self.stdout.write(
            f"durable_worker pid {os.getpid()}: stopped {worker.shutdown_seconds:.1f} s after {worker.stop_reason} "
            f"(up {worker.uptime_seconds:.1f} s); {handed}."
        )

    @staticmethod
    def _log_to_stderr(verbosity: int) -> None:
        """Show the worker's own log lines unless the project configured a handler."""
        logger = logging.getLogger("durable_singleton")
        if logger.handlers or logging.getLogger().handlers:
            return
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
