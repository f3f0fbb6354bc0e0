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

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from .dispatch import ThreadDispatcher
from .identity import process_name
from .pull import PullDispatcher

__all__ = ["HAND_BACK_SECONDS", "ForegroundWorker", "connect", "expire_own_leases", "start_embedded_worker"]

logger = logging.getLogger("durable_singleton.worker")

#: How long a stopping worker waits for the database to take back the turns
#: it still holds (:func:`expire_own_leases`), in seconds. A hand-back that
#: waits longer (a row lock, a database that does not answer) is abandoned:
#: those runs' leases expire by themselves within ``LEASE_SECONDS`` (R5).
HAND_BACK_SECONDS = 10.0
#: How often the foreground worker's main thread wakes to run a pending stop
#: signal's handler, in seconds (:meth:`ForegroundWorker.run`).
STOP_POLL_SECONDS = 0.5


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
    if not (isinstance(dispatcher, ThreadDispatcher) and dispatcher.start()):
        return False
    # The process's exit (runserver's Ctrl-C or reload, a WSGI server's stop)
    # says so in the log; the turns still in hand keep their leases (R5).
    atexit.register(dispatcher.stop, timeout=0.0)
    return True


def _start_on_request(sender: Any, **kwargs: Any) -> None:
    try:
        start_embedded_worker()
    except Exception:  # a misconfiguration is reported by the checks; never fail a request
        logger.exception("could not start the embedded worker")


def connect() -> None:
    """Connect the ``request_started`` receiver that starts the embedded worker (idempotent)."""
    from django.core.signals import request_started

    request_started.connect(_start_on_request, dispatch_uid="durable_singleton.start_embedded_worker")


def hand_back(engine: Any, run_ids: list[str], *, seconds: float = HAND_BACK_SECONDS) -> int | None:
    """Run :func:`expire_own_leases` on a thread of its own for at most
    ``seconds``; return its count, or None if it did not finish in time (it
    waits on a lock or on a database that does not answer) or failed. A
    stopping process never waits longer than that for the database (O1)."""
    result: list[int] = []

    def expire() -> None:
        from django.db import connections

        try:
            result.append(expire_own_leases(engine, run_ids))
        except Exception:
            logger.exception("could not hand back runs %s", ", ".join(run_ids))
        finally:
            connections.close_all()

    thread = threading.Thread(target=expire, name="durable-hand-back", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def expire_own_leases(engine: Any, run_ids: list[str]) -> int:
    """Hand back the turns this process still holds on ``run_ids``: expire
    their leases now, so the next tick re-drives them (R5, D4) instead of
    waiting ``LEASE_SECONDS``. Returns the number of runs handed back.

    Only runs leased by this process (owner ``host:pid:token:turn``, see
    :func:`~durable_singleton.identity.process_name`) are touched, never
    those of another process that shares its host name and pid;
    a body still running here is fenced from then on (its later step writes
    are refused because its lease expired). The store writes it
    (:meth:`~durable_singleton.stores.base.BaseStore.hand_back_leases`), on
    its clock; a store whose leases die with its process returns 0.
    """
    if not run_ids:
        return 0
    return int(engine.store.hand_back_leases(run_ids, f"{process_name()}:"))


class ForegroundWorker:
    """Worker threads and the tick in the foreground, until SIGTERM or SIGINT.

    ``threads``: worker threads (>= 1); ``tick_seconds``: period of the tick
    (> 0); ``grace_seconds``: how long a stop waits for the turns in hand
    before handing them back with :func:`expire_own_leases`. With
    ``DISPATCH = "worker"`` the threads take turn notices from the database
    (:class:`~durable_singleton.pull.PullDispatcher`): ``queues`` names the
    queues taken (empty: all), ``poll_seconds`` the poll where the database
    cannot notify (default ``WORKER_POLL_SECONDS``). In another mode this
    worker runs its own embedded worker engine, as before.

    A stop takes at most ``grace_seconds`` for the turns in hand, plus
    ``TICK_JOIN_SECONDS`` (1 s) for a tick in progress, plus
    :data:`HAND_BACK_SECONDS` (10 s) for the hand-back. After :meth:`run`,
    ``uptime_seconds`` is the time from the start to the end of the stop,
    ``shutdown_seconds`` the time from the stop request to the end of the
    stop, and ``handed_back`` the runs handed back (None: the hand-back did
    not finish, those leases expire by themselves).
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        tick_seconds: float | None = None,
        grace_seconds: float | None = None,
        engine: Any = None,
        queues: tuple[str, ...] = (),
        poll_seconds: float | None = None,
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
        if isinstance(self.dispatcher, PullDispatcher):  # DISPATCH "worker": options of the fetch (O1)
            self.dispatcher.queues = tuple(queues)
            if poll_seconds is not None:
                self.dispatcher.poll_seconds = poll_seconds
        self.grace_seconds = engine.settings.LEASE_SECONDS if grace_seconds is None else grace_seconds
        self.stopping = threading.Event()
        self.hurry = threading.Event()
        self.stop_reason = "a stop request"
        self.uptime_seconds = 0.0
        self.shutdown_seconds = 0.0
        self.handed_back: int | None = 0
        self._stop_requested_at: float | None = None
        self._started_at: float | None = None
        self._signalled = 0  # a SIGTERM/SIGINT the main thread has not acted on yet (handle_signal)

    def request_stop(self, signum: int = 0, frame: Any = None) -> None:
        """Ask the worker to stop (from another thread, or from :meth:`run` for a signal
        :meth:`handle_signal` recorded; never from a signal handler itself); a second
        request stops waiting for the turns in hand and hands them back at once."""
        if self.stopping.is_set():
            if signum:
                logger.info("received %s again: handing back the turns in hand now", signal.Signals(signum).name)
            self.hurry.set()
            return
        self._stop_requested_at = time.monotonic()
        if signum:
            self.stop_reason = signal.Signals(signum).name
            logger.info("received %s: stopping", self.stop_reason)
        self.stopping.set()

    def handle_signal(self, signum: int, frame: Any = None) -> None:
        """The SIGTERM and SIGINT handler (``manage.py durable_worker``): records the signal,
        which :meth:`run`'s wait acts on within ``STOP_POLL_SECONDS`` (:meth:`request_stop`);
        a signal while stopping hurries the stop at once (``hurry``, which no thread waits
        on). A handler runs on the main thread between two bytecodes, and there it may have
        interrupted ``stopping.wait`` just after the wait took the event's lock back: setting
        ``stopping`` in the handler then waited for that lock forever, and the worker ignored
        every later SIGTERM (CI, after SIGSTOP and SIGCONT; the SIGUSR1 dump showed the
        handler inside ``Event.set`` under ``Event.wait``). A second signal before :meth:`run`
        acted on the first (within ``STOP_POLL_SECONDS``) hurries the stop too: a second
        request is never lost."""
        if self.stopping.is_set() or self._signalled:
            self.hurry.set()
        else:
            self._signalled = signum

    @staticmethod
    def dump_stacks(signum: int = 0, frame: Any = None) -> None:
        """The SIGUSR1 handler (``manage.py durable_worker``): write the stack of every thread
        to file descriptor 2 (stderr), most recent call first, as a Celery worker's SIGUSR1
        does, and change nothing. Python code on the main thread (it runs between two
        bytecodes, or inside a blocked lock's acquire, which signals interrupt): it reads
        the frames under the interpreter's lock, and writes with ``os.write``, no buffer's
        lock that the interrupted code may hold. ``faulthandler``'s dump, which reads the
        other threads' frames from the C signal handler while they run, crashed a worker
        with SIGSEGV in the middle of a dump (CI, pair Y)."""
        lines: list[str] = []
        for ident, top in sys._current_frames().items():
            lines.append(f"Thread 0x{ident:016x} (most recent call first):")
            current: FrameType | None = top
            while current is not None:
                code = current.f_code
                lines.append(f'  File "{code.co_filename}", line {current.f_lineno} in {code.co_name}')
                current = current.f_back
            lines.append("")
        data = ("\n".join(lines) + "\n").encode("utf-8", errors="replace")
        with contextlib.suppress(OSError):  # no stderr (a closed descriptor): no dump
            while data:
                data = data[os.write(2, data) :]

    def start(self) -> None:
        """Start the threads (idempotent): :meth:`run` calls it if it was not called."""
        if self._started_at is None:
            self._started_at = time.monotonic()
        self.dispatcher.start()

    def run(self) -> list[str]:
        """Start, wait for a stop request, stop gracefully; return the runs handed back."""
        self.start()
        assert self._started_at is not None
        started = self._started_at
        # A bounded wait: Python runs the SIGTERM handler on the main thread
        # only when it executes bytecode, and a signal the kernel delivers to
        # another thread (as it does after a SIGSTOP and SIGCONT) never wakes
        # an unbounded wait: the worker ignored SIGTERM and was SIGKILLed.
        while not self.stopping.wait(STOP_POLL_SECONDS):
            if self._signalled:
                self.request_stop(self._signalled)  # on the main thread, outside the wait (handle_signal)
        requested = self._stop_requested_at or time.monotonic()
        left = self.dispatcher.stop(timeout=self.grace_seconds, hurry=self.hurry)
        if self.hurry.is_set():
            logger.info("a second stop request: the turns in hand were not waited for")
        self.handed_back = hand_back(self.engine, left) if left else 0
        if left and self.handed_back is None:
            logger.warning(
                "%d turns still running after %.3g s; the database did not take them back within %.3g s, "
                "their leases expire by themselves: %s",
                len(left),
                self.grace_seconds,
                HAND_BACK_SECONDS,
                ", ".join(left),
            )
        elif left:
            logger.warning(
                "%d turns still running after %.3g s; %d handed back to the tick: %s",
                len(left),
                self.grace_seconds,
                self.handed_back,
                ", ".join(left),
            )
        ended = time.monotonic()
        self.uptime_seconds = ended - started
        self.shutdown_seconds = ended - requested
        logger.info("stopped %.1f s after %s (up %.1f s)", self.shutdown_seconds, self.stop_reason, self.uptime_seconds)
        return left
