"""The tick in each Celery worker's main process (``DISPATCH = "celery"``, O5, O1b).

:func:`connect` (called by the app's ``ready``) connects Celery's
``worker_ready`` and ``worker_shutdown`` signals: when a ``celery worker``
is ready, its main process (never a pool process) starts a
:class:`WorkerTicker` thread, which runs the tick every ``TICK_SECONDS``
only while it holds the tick's lease, the row ``durable_worker`` processes
take too (:func:`~durable_singleton.stores.turns.hold_tick_lease`, on the
database's clock): one tick at a time across every worker process, whatever
the bodies in the pool do. At the worker's shutdown the thread stops, ends
its lease (another worker's thread takes it at once) and closes its
database connections. ``CELERY_WORKER_TICK = False`` turns the thread off;
beat's tick task (``durable_singleton.tasks.tick``) takes the same
lease and is the fallback.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from . import signals
from .conf import get_settings
from .dispatch import wait_sending_wakes
from .identity import process_name
from .stores.turns import hold_tick_lease, release_tick_lease, tick_lease_keeper, tick_lease_seconds

__all__ = ["TICKER_THREAD", "WorkerTicker", "connect", "running_ticker"]

logger = logging.getLogger("durable_singleton.tick")

#: The name of the tick thread in a Celery worker's main process.
TICKER_THREAD = "durable-celery-tick"
#: How long a worker's shutdown waits for its tick thread to end, in seconds.
STOP_TIMEOUT = 30.0

_lock = threading.Lock()
_ticker: list[WorkerTicker] = []


class WorkerTicker:
    """A thread that ticks ``engine`` every ``tick_seconds`` while it holds the tick's lease (O5, O1b).

    ``engine``: an engine whose store is in Django database ``db`` (an
    alias); ``tick_seconds``: the period, in seconds. ``owner`` names this
    process in the lease row (``celery:<host>:<pid>:<token>``, see
    :func:`~durable_singleton.identity.process_name`). Each round takes or
    keeps the lease for :func:`~durable_singleton.stores.turns.tick_lease_seconds`
    and ticks only if it holds it, then closes the thread's connections (a
    pool process forked meanwhile shares none). A failed round is logged and
    the next one runs a period after it began (at least half a period
    after it ended). Each tick it runs is logged at INFO on
    ``durable_singleton.tick``. Between two ticks the holder's thread sends each
    parked run at its ``wake_at`` (a throttle's opening, X6d; a delayed start, X5)
    rather than at the next tick: the wake timer of the embedded worker
    (:func:`~durable_singleton.dispatch.wait_sending_wakes`, S8), the next wake read
    after each tick and each send, and again when a run this process parks over a
    throttle's rate (a solo or threads pool; a prefork pool's parks are read at the
    next send or tick), each database call on a connection closed after it.
    ``app``: the worker's Celery app, made the thread's current app, so the turns a
    tick sends go through it (None: the default app).
    """

    def __init__(self, engine: Any, db: str, tick_seconds: float, app: Any = None) -> None:
        self.engine = engine
        self.app = app
        self.db = db
        self.tick_seconds = tick_seconds
        self.owner = f"celery:{process_name()}"
        self._stop = threading.Event()
        #: Set to have the wake timer read the next wake again (a throttled park, the stop).
        self._rearm = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (a daemon)."""
        self._stop.clear()
        signals.run_parked.connect(self._rearm_on_throttled_park, dispatch_uid=f"durable_singleton.ticker.{id(self)}")
        self._thread = threading.Thread(target=self._run, name=TICKER_THREAD, daemon=True)
        self._thread.start()
        logger.info("tick thread of Celery worker %s started: a tick every %g s while it holds the tick's lease",
                    self.owner, self.tick_seconds)  # fmt: skip

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """Stop the thread and wait up to ``timeout`` seconds for it (it ends
        its lease and closes its connections as it leaves); return True if it
        ended."""
        self._stop.set()
        self._rearm.set()
        signals.run_parked.disconnect(dispatch_uid=f"durable_singleton.ticker.{id(self)}")
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _rearm_on_throttled_park(self, sender: Any, throttle: str | None = None, **kwargs: Any) -> None:
        """``run_parked`` receiver: a run parked over a throttle's rate (X6d) in this
        process has the wake timer read the next wake again."""
        if throttle is not None:
            self._rearm.set()

    @property
    def alive(self) -> bool:
        """Tell whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        from django.db import close_old_connections, connections

        lease = tick_lease_seconds(self.tick_seconds)
        if self.app is not None:
            self.app.set_current()
        try:
            while not self._stop.is_set():
                round_began = time.monotonic()
                held = False
                try:
                    close_old_connections()
                    held = hold_tick_lease(self.db, self.owner, lease)
                    if held:
                        began = time.monotonic()
                        holding = tick_lease_keeper(self.db, self.owner, lease)
                        dispatched = len(self.engine.tick(holding=holding).dispatched)
                        logger.info("durable tick by %s: %d turns dispatched in %.3f s",
                                    self.owner, dispatched, time.monotonic() - began)  # fmt: skip
                except Exception:
                    logger.exception("tick failed in Celery worker %s", self.owner)
                finally:
                    connections.close_all()
                # The period runs from the start of a round (a tick's own time does not stretch it),
                # and half a period at least follows a long one: never two ticks back to back (O5).
                rest = max(0.5 * self.tick_seconds, round_began + self.tick_seconds - time.monotonic())
                if held:  # the lease's holder sends the parked runs at their wake_at meanwhile (S8, X6d)
                    stopped = wait_sending_wakes(
                        self.engine, rest, self.tick_seconds, self._stop, self._rearm, connections.close_all
                    )
                else:
                    stopped = self._stop.wait(rest)
                if stopped:
                    break
        finally:
            try:
                release_tick_lease(self.db, self.owner)
            except Exception:  # the lease ends by itself (O1b)
                logger.exception("could not end the tick's lease of %s", self.owner)
            finally:
                connections.close_all()


def running_ticker() -> WorkerTicker | None:
    """Return this process's tick thread, if one was started."""
    with _lock:
        return _ticker[0] if _ticker else None


def _on_worker_ready(**kwargs: Any) -> None:
    """Start the tick thread in this worker's main process, unless
    ``DISPATCH`` is not ``"celery"``, ``CELERY_WORKER_TICK`` is False or the
    store has no Django database (no lease to take)."""
    settings = get_settings()
    if settings.DISPATCH != "celery" or not settings.CELERY_WORKER_TICK:
        return
    from .runtime import get_engine

    engine = get_engine()
    db = engine.store.database
    if db is None:
        logger.warning("no tick thread in this Celery worker: the store has no Django database for the tick's lease")
        return
    with _lock:
        if _ticker and _ticker[0].alive:
            return
        ticker = WorkerTicker(engine, db, settings.TICK_SECONDS, getattr(kwargs.get("sender"), "app", None))
        _ticker[:] = [ticker]
    ticker.start()


def _on_worker_shutdown(**kwargs: Any) -> None:
    """Stop this process's tick thread, which ends its lease."""
    with _lock:
        ticker = _ticker.pop() if _ticker else None
    if ticker is not None and not ticker.stop():
        logger.warning("the tick thread of %s did not end within %g s", ticker.owner, STOP_TIMEOUT)


def connect() -> None:
    """Connect the tick thread to Celery's ``worker_ready`` and
    ``worker_shutdown`` signals (idempotent; the app's ``ready`` calls it).
    Both are sent in a worker's main process only."""
    from celery.signals import worker_ready, worker_shutdown

    worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="durable_singleton.celery_tick.ready")
    worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="durable_singleton.celery_tick.shutdown")
