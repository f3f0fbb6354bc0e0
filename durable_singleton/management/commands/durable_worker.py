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
from ._options import count_option, seconds_option

#: Bounds of the options: threads per process, seconds between ticks (the
#: tick drives wake-ups, recovery and the catch-up, S8), seconds of grace.
MAX_THREADS = 1024
MAX_TICK_SECONDS = 3600.0
MAX_GRACE = 86400.0


class Command(BaseCommand):
    help = (
        "Run durable_singleton worker threads and the tick in the foreground, without Celery, until "
        "SIGTERM or SIGINT; then finish the turns in hand (up to --grace seconds) and hand back the rest."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--threads", type=int, default=None, help="Worker threads, 1 to 1024 (default: WORKER_THREADS)."
        )
        parser.add_argument(
            "--tick-seconds",
            type=float,
            default=None,
            help="Seconds between ticks, > 0 and <= 3600 (default: TICK_SECONDS).",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            help="Seconds a stop waits for turns in hand before handing them back, 0-86400 (default: LEASE_SECONDS).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        settings = get_settings()
        threads = options["threads"] if options["threads"] is not None else settings.WORKER_THREADS
        tick = options["tick_seconds"] if options["tick_seconds"] is not None else settings.TICK_SECONDS
        # Finite and bounded: an infinite period killed the tick thread
        # silently and NaN made it spin (section 7).
        threads = count_option(threads, "--threads", high=MAX_THREADS)
        tick = seconds_option(tick, "--tick-seconds", high=MAX_TICK_SECONDS, strict=True)
        grace = None if options["grace"] is None else seconds_option(options["grace"], "--grace", high=MAX_GRACE)
        if remote := remote_workflows():
            # This worker runs every turn on its own threads: a remote body's
            # turn would be handed back to itself without end (E005).
            names = ", ".join(f"{name!r} (queue {queue!r})" for name, queue in remote)
            raise CommandError(
                f"remote workflows are registered: {names}; their bodies run in another service's Celery "
                "worker, which this worker is not. Run Celery workers here, or do not declare them in this process."
            )
        self._log_to_stderr(options["verbosity"])
        worker = ForegroundWorker(threads=threads, tick_seconds=tick, grace_seconds=grace)
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
