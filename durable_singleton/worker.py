"""Workers without Celery (O1): the embedded worker's start, and the
foreground worker behind ``manage.py durable_worker``.

With ``DISPATCH = "thread"`` a process runs its own worker threads and tick
thread once it starts serving:

* :func:`start_embedded_worker` starts them; call it from ``wsgi.py`` /
  ``asgi.py`` after the application is built (``runserver`` imports
  ``WSGI_APPLICATION`` in the process that serves, so it starts there too);
* the ``request_started`` receiver connected in ``ready()`` starts them at
  the first request of a process that did not.

Neither fires in ``migrate``, ``makemigrations``, ``check``, ``shell`` or any
other management command, nor under Django's test environment (pytest-django
and ``manage.py test`` call ``setup_test_environment()``) unless asked with
``force=True``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

from .dispatch import ThreadDispatcher

__all__ = ["ForegroundWorker", "connect", "expire_own_leases", "start_embedded_worker"]

logger = logging.getLogger("durable_singleton.worker")


def _in_test_environment() -> bool:
    # setup_test_environment() (Django's runner, pytest-django) creates the outbox.
    from django.core import mail

    return hasattr(mail, "outbox")


def start_embedded_worker(*, force: bool = False) -> bool:
    """Start the default engine's embedded worker if ``DISPATCH`` is ``"thread"``.

    Returns True if this call started it; False if it was running already,
    ``DISPATCH`` is another mode, or the process is in Django's test
    environment and ``force`` is False. Idempotent and thread-safe; safe to
    call in ``wsgi.py``/``asgi.py`` (a forked child starts its own threads).
    """
    from .conf import get_settings

    if get_settings().DISPATCH != "thread":
        return False
    if not force and _in_test_environment():
        return False
    from .runtime import get_engine

    dispatcher = get_engine().dispatcher
    return isinstance(dispatcher, ThreadDispatcher) and dispatcher.start()


def _start_on_request(sender: Any, **kwargs: Any) -> None:
    try:
        start_embedded_worker()
    except Exception:  # a misconfiguration is reported by the checks; never fail a request
        logger.exception("could not start the embedded worker")


def connect() -> None:
    """Connect the ``request_started`` receiver that starts the embedded worker (idempotent)."""
    from django.core.signals import request_started

    request_started.connect(_start_on_request, dispatch_uid="durable_singleton.start_embedded_worker")


def expire_own_leases(engine: Any, run_ids: list[str]) -> int:
    """Hand back the turns this process still holds on ``run_ids``: expire
    their leases now, so the next tick re-drives them (R5, D4) instead of
    waiting ``LEASE_SECONDS``. Returns the number of runs handed back.

    Only runs leased by this process (owner ``host:pid:...``) are touched;
    a body still running here is fenced from then on (its later step writes
    are refused because its lease expired). Only the Django store has
    leases outside the process; other stores return 0.
    """
    db = getattr(engine.store, "db", None)
    if db is None or not run_ids:
        return 0
    from .models import Run

    prefix = f"{socket.gethostname()}:{os.getpid()}:"
    # The engine's clock, not the database's: the claim compares the stored
    # expiry exactly, and SQLite's CURRENT_TIMESTAMP is stored in another format.
    now = engine.now()
    return int(
        Run.objects.using(db)
        .filter(pk__in=run_ids, status="running", lease_owner__startswith=prefix)
        .update(lease_expires_at=now, wake_at=now)
    )


class ForegroundWorker:
    """Worker threads and the tick in the foreground, until SIGTERM or SIGINT.

    ``threads``: worker threads (>= 1); ``tick_seconds``: period of the tick
    (> 0); ``grace_seconds``: how long a stop waits for the turns in hand
    before handing them back with :func:`expire_own_leases`.
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        tick_seconds: float | None = None,
        grace_seconds: float | None = None,
        engine: Any = None,
    ) -> None:
        from .runtime import build_engine, get_engine

        if engine is None:
            engine = get_engine()
            if not isinstance(engine.dispatcher, ThreadDispatcher):
                # DISPATCH is "celery" or "manual": this worker still runs turns
                # itself, on an engine of its own with the same store settings.
                engine = build_engine(dataclasses.replace(engine.settings, DISPATCH="thread"))
        self.engine = engine
        self.dispatcher: ThreadDispatcher = engine.dispatcher
        if threads is not None:
            self.dispatcher.threads = threads
        if tick_seconds is not None:
            self.dispatcher.tick_seconds = tick_seconds
        self.grace_seconds = engine.settings.LEASE_SECONDS if grace_seconds is None else grace_seconds
        self.stopping = threading.Event()
        self.hurry = threading.Event()

    def request_stop(self, signum: int = 0, frame: Any = None) -> None:
        """Ask the worker to stop (a signal handler); a second request stops
        waiting for the turns in hand and hands them back at once."""
        if self.stopping.is_set():
            if signum:
                logger.info("received %s again: handing back the turns in hand now", signal.Signals(signum).name)
            self.hurry.set()
            return
        if signum:
            logger.info("received %s: stopping", signal.Signals(signum).name)
        self.stopping.set()

    def run(self) -> list[str]:
        """Start, wait for a stop request, stop gracefully; return the runs handed back."""
        started = time.monotonic()
        self.dispatcher.start()
        self.stopping.wait()
        left = self.dispatcher.stop(timeout=self.grace_seconds, hurry=self.hurry)
        handed_back = expire_own_leases(self.engine, left) if left else 0
        if left:
            logger.warning(
                "%d turns still running after %.3g s; %d handed back to the tick: %s",
                len(left),
                self.grace_seconds,
                handed_back,
                ", ".join(left),
            )
        logger.info("stopped after %.1f s", time.monotonic() - started)
        return left
