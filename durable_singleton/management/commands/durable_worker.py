"""``manage.py durable_worker``: worker threads and the tick in the foreground (O1)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...checks import remote_workflows, unrouted_queues
from ...conf import get_settings
from ...worker import ForegroundWorker
from ._options import count_option, seconds_option

#: Bounds of the options: threads per process, seconds between ticks (the
#: tick drives wake-ups, recovery and the catch-up, S8), seconds of grace.
MAX_THREADS = 1024
MAX_TICK_SECONDS = 3600.0
MAX_GRACE = 86400.0
MAX_POLL_SECONDS = 60.0
#: A queue name is held by the turn notice's column.
MAX_QUEUE_LENGTH = 191


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
        parser.add_argument(
            "--queues",
            default=None,
            help="DISPATCH 'worker' only: comma-separated queues whose turns this worker takes; 'default' is the "
            "queue of workflows declared without one (default: every queue).",
        )
        parser.add_argument(
            "--poll-seconds",
            type=float,
            default=None,
            help="DISPATCH 'worker' only: seconds between looks for turns where the database cannot notify, "
            "> 0 and <= 60 (default: WORKER_POLL_SECONDS).",
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
        queues, poll = self._pull_options(settings.DISPATCH, options["queues"], options["poll_seconds"])
        if remote := remote_workflows():
            # This worker runs every turn on its own threads: a remote body's
            # turn would be handed back to itself without end (E005).
            names = ", ".join(f"{name!r} (queue {queue!r})" for name, queue in remote)
            raise CommandError(
                f"remote workflows are registered: {names}; their bodies run in another service's Celery "
                "worker, which this worker is not. Run Celery workers here, or do not declare them in this process."
            )
        self._log_to_stderr(options["verbosity"])
        if unrouted := unrouted_queues(queues):
            self.stderr.write(
                f"durable_worker: no registered workflow sends its turns to queue(s) {', '.join(unrouted)} "
                "(check --queues for a misspelled name: a queue no worker takes leaves its runs waiting)."
            )
        worker = ForegroundWorker(
            threads=threads, tick_seconds=tick, grace_seconds=grace, queues=queues, poll_seconds=poll
        )
        signal.signal(signal.SIGTERM, worker.handle_signal)
        signal.signal(signal.SIGINT, worker.handle_signal)
        # SIGUSR1 prints every thread's stack to stderr, as a Celery worker does: what a worker
        # that does not stop is waiting for (ForegroundWorker.dump_stacks).
        signal.signal(signal.SIGUSR1, worker.dump_stacks)
        worker.start()  # the ready line says how the worker is woken (O1)
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
    def _pull_options(dispatch: str, queues: str | None, poll: float | None) -> tuple[tuple[str, ...], float | None]:
        """Check ``--queues`` and ``--poll-seconds`` (``DISPATCH = "worker"`` only); raise CommandError."""
        if dispatch != "worker":
            given = [flag for flag, value in (("--queues", queues), ("--poll-seconds", poll)) if value is not None]
            if given:
                raise CommandError(
                    f"{' and '.join(given)} need DISPATCH 'worker' (durable_worker processes that take turns from "
                    f"the database); DISPATCH is {dispatch!r}."
                )
            return (), None
        names: tuple[str, ...] = ()
        if queues is not None:
            names = tuple(dict.fromkeys(name.strip() for name in queues.split(",")))
            bad = [name for name in names if not name or len(name) > MAX_QUEUE_LENGTH or not name.isprintable()]
            if not names or bad:
                raise CommandError(
                    f"--queues must be comma-separated queue names of 1 to {MAX_QUEUE_LENGTH} printable characters, "
                    f"got {queues!r:.200}."
                )
        if poll is not None:
            poll = seconds_option(poll, "--poll-seconds", high=MAX_POLL_SECONDS, strict=True)
        return names, poll

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
