"""Dispatchers: how a run's next turn reaches a worker.

* :class:`CeleryDispatcher` sends the ``durable_singleton.execute_run`` task
  after the current transaction commits.
* :class:`ThreadDispatcher` (``DISPATCH = "thread"``) is the embedded worker:
  an in-process pool of worker threads and a tick thread, no external service.
  It is started when the process starts serving (see
  :mod:`durable_singleton.worker`) or by ``manage.py durable_worker``; a
  process that never starts it (``migrate``, ``shell``, tests) leaves its
  runs to the tick of a process that did (O1).
* :class:`ManualDispatcher` queues turns for a test to drain on its own thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue as queue_module
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from celery import current_app

from . import signals
from .conf import Settings
from .dispatcher import Dispatcher, TurnRunner
from .exceptions import ConfigurationError
from .stores.base import BaseStore

__all__ = [
    "EXECUTE_MANY_TASK",
    "EXECUTE_TASK",
    "TICK_TASK",
    "CeleryDispatcher",
    "ManualDispatcher",
    "ThreadDispatcher",
    "build_dispatcher",
    "wait_sending_wakes",
]

logger = logging.getLogger("durable_singleton")
#: The embedded worker's start and stop lines (see :func:`announce`).
lifecycle_logger = logging.getLogger("durable_singleton.worker")

#: How long :meth:`ThreadDispatcher.stop` waits for the tick thread beyond the
#: worker threads, in seconds: a tick holds no lease, so one still in a
#: database call when the process exits loses nothing (its transaction is
#: rolled back) and must not hold up the stop.
TICK_JOIN_SECONDS = 1.0
TICK_THREAD = "durable-tick"
#: The wake timer (:meth:`ThreadDispatcher._wait_for_tick`) sleeps this long past the
#: earliest ``wake_at``, in seconds, so the run is due by the database's clock when the
#: due runs are read (the process's sleep and the database's clock differ by a few ms).
WAKE_TIMER_LAG_SECONDS = 0.005
#: The least sleep between two sends of the wake timer, in seconds: many wakes close
#: together are sent in one read (each read sends every due run), and the timer never
#: spins on a wake it could not send.
WAKE_TIMER_MIN_SECONDS = 0.02


def announce(message: str, *args: object) -> None:
    """Log a worker's start or stop line at INFO on ``durable_singleton.worker``;
    if no handler would show it (Django's default ``LOGGING`` under
    ``runserver`` has none for this app), also write it to stderr, so a
    process always says that its worker started and stopped (O1)."""
    lifecycle_logger.info(message, *args)
    if not lifecycle_logger.hasHandlers():
        print(f"durable_singleton: {message % args}", file=sys.stderr, flush=True)


#: The Celery task that executes one turn (``durable_singleton.tasks.execute_run``).
EXECUTE_TASK = "durable_singleton.execute_run"
#: The Celery task that executes the turns of many runs, one after the other
#: (``durable_singleton.tasks.execute_runs``).
EXECUTE_MANY_TASK = "durable_singleton.execute_runs"
#: The Celery beat task that runs the tick (``durable_singleton.tasks.tick``).
TICK_TASK = "durable_singleton.tick"


class _DjangoCommit(Dispatcher):
    """Defers callbacks to ``transaction.on_commit`` of the store's database
    (:attr:`~durable_singleton.stores.base.BaseStore.database`)."""

    def __init__(self, store: BaseStore) -> None:
        self.store = store
        self.runner: TurnRunner | None = None

    @property
    def engine(self) -> TurnRunner | None:
        """The engine bound by :meth:`bind` (None before)."""
        return self.runner

    def _alias(self) -> str | None:
        return self.store.database

    def on_commit(self, fn: Callable[[], object]) -> None:
        alias = self._alias()
        if alias is None:
            fn()
            return
        from django.db import transaction

        transaction.on_commit(fn, using=alias, robust=True)

    def close_thread_resources(self) -> None:
        if self._alias() is not None:
            from django.db import connections

            connections.close_all()

    def refresh_connections(self) -> None:
        """Close this thread's database connections that are broken or past
        ``CONN_MAX_AGE``, so the next query opens a fresh one (O1). Best effort:
        a failure is logged, never raised, so a worker or tick thread that calls it
        between turns lives on (a connection that cannot be checked now is checked
        again before the next turn; under pytest-django, a thread between tests
        may not touch the database at all)."""
        if self._alias() is not None:
            from django.db import close_old_connections

            try:
                close_old_connections()
            except Exception as exc:
                logger.warning("could not check this thread's database connections: %s", exc)


def _send_turn(app: Any, run_id: str, options: dict[str, Any]) -> None:
    """Send the ``execute_run`` task for ``run_id`` by its name: through the task
    registered in ``app`` (so ``task_always_eager`` and the task's own options
    apply), else as a message by name."""
    task = app.tasks.get(EXECUTE_TASK)
    if task is not None:
        task.apply_async((run_id,), **options)
    else:
        app.send_task(EXECUTE_TASK, (run_id,), **options)


def _send_refused(run_ids: Sequence[str], exc: BaseException) -> None:
    """Log a refused send: one warning line per run naming the error, and the
    traceback only at DEBUG. A broker that is down is an expected event, not a
    fault of this package: every run keeps its ``wake_at`` and the tick sends
    it again (S8, F4)."""
    for run_id in run_ids:
        logger.warning(
            "could not send turn of run %s; the tick will re-send it (%s: %s) once the broker answers; "
            "the tick runs in each Celery worker and in beat: if neither runs, start them",
            run_id,
            type(exc).__name__,
            exc,
        )
    logger.debug("the refused send's traceback", exc_info=exc)


#: The options of every turn's send: one quick retry, then the tick re-sends (F4).
_SEND_OPTIONS: dict[str, Any] = {"retry": True, "retry_policy": {"max_retries": 1, "interval_start": 0.1}}


def _current_app() -> Any:
    """Return the Celery app current on this thread (the object behind the
    ``current_app`` proxy), to send from another thread."""
    from celery import _state

    return _state.get_current_app()


def _send_turns(app: Any, run_ids: Sequence[str], queue: str | None, batch: int) -> None:
    """Send the turns of ``run_ids`` to ``queue`` through one producer: in
    messages of at most ``batch`` runs (``execute_runs``; a message of one run
    is ``execute_run``). A failed send is logged for each run it carried, not
    raised: every run keeps its ``wake_at`` and the tick sends it again (S8, F4)."""
    options: dict[str, Any] = dict(_SEND_OPTIONS)
    if queue:
        options["queue"] = queue
    chunks = [list(run_ids[n : n + batch]) for n in range(0, len(run_ids), max(batch, 1))]
    try:
        with app.producer_or_acquire() as producer:
            options["producer"] = producer
            while chunks:
                chunk = chunks[0]
                if len(chunk) == 1:
                    _send_turn(app, chunk[0], options)
                else:
                    task = app.tasks.get(EXECUTE_MANY_TASK)
                    if task is not None:
                        task.apply_async((chunk, queue), **options)
                    else:
                        app.send_task(EXECUTE_MANY_TASK, (chunk, queue), **options)
                chunks.pop(0)
    except Exception as exc:  # broker down: the durable timer re-sends (S8, F4)
        _send_refused([r for chunk in chunks for r in chunk], exc)


class _Coalescer:
    """Buffers first turns for up to ``window`` seconds, so that the starts of
    a process share Celery messages of up to ``batch`` runs (per Celery app
    and queue). A full batch is sent at once by the thread that fills it; the
    rest by one flusher thread per process when the window of its oldest run
    ends, and at interpreter exit."""

    def __init__(self, window: float, batch: int) -> None:
        self.window = window
        self.batch = batch
        self._wake = threading.Condition()
        self._pending: dict[tuple[Any, str | None], list[str]] = {}
        self._due: float | None = None
        self._thread: threading.Thread | None = None

    def add(self, app: Any, queue: str | None, run_id: str) -> None:
        """Buffer the turn of ``run_id`` (sent within ``window`` seconds)."""
        full: list[str] | None = None
        with self._wake:
            ids = self._pending.setdefault((app, queue), [])
            ids.append(run_id)
            if len(ids) >= self.batch:
                full = self._pending.pop((app, queue))
            else:
                if self._due is None:
                    self._due = time.monotonic() + self.window
                    self._wake.notify()
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name="durable-send", daemon=True)
                    self._thread.start()
                    atexit.register(self.flush)
        if full is not None:
            _send_turns(app, full, queue, self.batch)

    def flush(self) -> None:
        """Send every buffered turn now."""
        with self._wake:
            pending, self._pending, self._due = self._pending, {}, None
        for (app, queue), ids in pending.items():
            _send_turns(app, ids, queue, self.batch)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._due is None or self._due > time.monotonic():
                    self._wake.wait(None if self._due is None else self._due - time.monotonic())
            try:
                self.flush()
            except Exception:  # pragma: no cover - _send_turns logs its own failures
                logger.exception("coalesced send failed; the tick will re-send the turns")


def _terminate_handler_fired() -> bool:
    """Tell whether this process's billiard terminate handler ran (it then
    raises ``SystemExit`` in the task it interrupts): billiard's own answer
    where it has one (4.3.2 and later), else the flag that answer reads."""
    from billiard import common

    # Read by name: billiard's stubs know neither, and billiard before 4.3.2 has only the flag.
    fired = getattr(common, "terminate_handler_fired", None)
    if fired is not None:
        return bool(fired())
    return bool(getattr(common, "_should_have_exited", [False])[0])


class CeleryDispatcher(_DjangoCommit):
    """Send each turn as the Celery task ``durable_singleton.execute_run`` after commit.

    ``batch``: the most runs one message carries (``DISPATCH_BATCH``):
    :meth:`dispatch_many` sends messages of the task
    ``durable_singleton.execute_runs`` with up to that many run ids.
    ``coalesce_seconds``: the window of :meth:`dispatch_soon`
    (``DISPATCH_COALESCE_SECONDS``; 0: no coalescing), in seconds.

    A failed send is logged, not raised: the run keeps a ``wake_at`` and the
    tick sends it again (F4). So is a message lost after it was sent: each
    run it carried is sent again on its own by the tick, as a lost single
    turn is (S8).
    """

    def __init__(self, store: BaseStore, *, batch: int = 25, coalesce_seconds: float = 0.005) -> None:
        super().__init__(store)
        self.batch = batch
        self.coalesce_seconds = coalesce_seconds
        self._coalescer: _Coalescer | None = None
        self._coalescer_pid = os.getpid()
        self._coalescer_lock = threading.Lock()

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        def send() -> None:
            options: dict[str, Any] = dict(_SEND_OPTIONS)
            if queue:
                options["queue"] = queue
            try:
                _send_turn(current_app, run_id, options)
            except Exception as exc:  # broker down: the durable timer re-sends (S8, F4)
                _send_refused([run_id], exc)

        self.on_commit(send)

    def dispatch_soon(self, run_id: str, queue: str | None = None) -> None:
        """Send a started run's first turn within ``coalesce_seconds`` of the
        commit, in one message with the other starts of this process in that
        window (up to ``batch`` runs; a full batch is sent at once). With a
        window of 0, with ``batch`` 1, or on an eager Celery app
        (``task_always_eager``), the same as :meth:`dispatch`."""
        if self.coalesce_seconds <= 0 or self.batch <= 1:
            self.dispatch(run_id, queue)
            return

        def buffer() -> None:
            app = _current_app()
            if app.conf.task_always_eager:
                self.dispatch(run_id, queue)
            else:
                self._buffer().add(app, queue, run_id)

        self.on_commit(buffer)

    def _buffer(self) -> _Coalescer:
        """Return this process's send buffer (a new one after a ``fork``: the
        parent's thread does not exist in the child, and its runs are the parent's)."""
        if self._coalescer_pid != os.getpid():
            self._coalescer_pid = os.getpid()
            self._coalescer = None
            self._coalescer_lock = threading.Lock()
        with self._coalescer_lock:
            if self._coalescer is None:
                self._coalescer = _Coalescer(self.coalesce_seconds, self.batch)
            return self._coalescer

    def shutting_down(self) -> bool:
        """Tell whether this Celery worker process is shutting down (R7).

        A pool process (prefork) learns of a cold shutdown, a pool restart or
        a ``revoke(terminate=True)`` by SIGTERM, whose handler (billiard's)
        raises ``SystemExit`` inside the running task after it records that it
        fired; a warm shutdown waits for the task instead. A main process
        (the solo and threads pools) has Celery's shutdown flags, set by its
        SIGTERM, SIGINT and SIGQUIT handlers before a hard shutdown raises
        ``WorkerTerminate`` in the task. Either says so here.
        """
        if _terminate_handler_fired():
            return True
        from celery.worker import state

        # Set to an exit code, 0 included (a warm shutdown's): compared by identity, as Celery does.
        return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))

    def dispatch_many(self, run_ids: Sequence[str], queue: str | None = None) -> None:
        """Send many turns after commit through one producer (one broker
        connection), in messages of at most ``batch`` runs each."""
        if run_ids:
            ids = list(run_ids)
            self.on_commit(lambda: _send_turns(_current_app(), ids, queue, self.batch))


def wait_sending_wakes(
    engine: Any,
    seconds: float,
    period: float,
    stop: threading.Event,
    rearm: threading.Event,
    refresh: Callable[[], None] = lambda: None,
) -> bool:
    """Wait ``seconds`` (the time to the next tick) and, meanwhile, send each parked
    run at its ``wake_at`` (S8, X6d, X5): the workers' wake timer, the tick thread's
    sleep between two ticks (:class:`ThreadDispatcher`, :class:`~durable_singleton.pull.PullDispatcher`,
    :class:`~durable_singleton.celery_tick.WorkerTicker`).

    ``engine``: a :class:`~durable_singleton.core.Core`; ``period``: the tick's period,
    in seconds. The earliest ``wake_at`` within the wait, or within half a ``period``
    after it (the tick's due job runs after its other jobs, so the tick then waits for
    it), is read on the database's clock
    (:meth:`~durable_singleton.core.Core.seconds_to_next_wake`) as seconds from now;
    the timer sleeps that long (plus ``WAKE_TIMER_LAG_SECONDS``) and sends the due runs
    (:meth:`~durable_singleton.core.Core.dispatch_due`), which the store decides on
    its own clock (R5, R8): this process's clock only measures the sleep. ``rearm``
    set (a run this process parked over a throttle's rate, whose opening may come
    sooner; the stop) has the next wake read again, and the send already due keeps
    its time: a stream of parks postpones no send, and a send due before a read
    would end (the last read's duration) is made first. Reads and sends are
    ``WAKE_TIMER_MIN_SECONDS`` apart at least. ``refresh`` is called around each
    database call (the thread's connection check). Returns True when ``stop`` is
    set, False at the end of the wait."""
    began = time.monotonic()
    deadline = began + seconds
    send_at: float | None = None
    last_read = last_send = began - WAKE_TIMER_MIN_SECONDS
    read_took = 0.0  # the last read's duration: a send due sooner is not held up by a read
    read = True
    while not stop.is_set():
        now = time.monotonic()
        if send_at is not None and now >= send_at:
            send_at, read, last_send = None, True, now
            try:
                refresh()
                engine.dispatch_due()
            except Exception:
                logger.exception("wake timer: could not send the due runs")
            finally:
                refresh()
            continue
        if send_at is None and now >= deadline:
            return False
        until = deadline if send_at is None else send_at
        if read and (send_at is None or send_at - now > read_took):
            if now < last_read + WAKE_TIMER_MIN_SECONDS:  # too soon after the last read: at its time
                if stop.wait(min(until, last_read + WAKE_TIMER_MIN_SECONDS) - now):
                    break
                continue
            read, last_read = False, now
            rearm.clear()  # before the read: a park after it wakes the wait below
            try:
                refresh()
                wake = engine.seconds_to_next_wake(max(deadline - now, 0.0) + period / 2)
            except Exception:
                logger.exception("wake timer: could not read the next wake")
                wake = None
            read_took = time.monotonic() - now
            if wake is not None:
                at = max(time.monotonic() + wake + WAKE_TIMER_LAG_SECONDS, last_send + WAKE_TIMER_MIN_SECONDS)
                send_at = at if send_at is None else min(send_at, at)
        elif read:  # the send is due before a read would end: the send first, the read after it
            if stop.wait(until - now):
                break
        elif rearm.wait(until - now):
            read = True
    return True


class ThreadDispatcher(_DjangoCommit):
    """The embedded worker: ``threads`` worker threads and a tick thread, in process.

    Nothing runs until :meth:`start`. Before that (and after :meth:`stop`) a
    dispatch queues nothing: the run keeps the ``wake_at`` the engine stamped
    (``REDELIVERY_SECONDS`` after its start, or now for a woken waiter) and
    the tick of whichever process runs workers sends it (S8, O1).

    Every worker and tick iteration calls ``close_old_connections()`` before
    and after its unit of work, so a connection dropped by a database restart,
    an idle timeout or ``pg_terminate_backend`` is reopened (O1).
    """

    #: How its start and stop lines name it (O1).
    kind = "embedded worker"

    def __init__(self, store: BaseStore, threads: int, tick_seconds: float) -> None:
        super().__init__(store)
        self.threads = threads
        self.tick_seconds = tick_seconds
        self._queue: queue_module.Queue[str | None] = queue_module.Queue()
        #: The runs with a turn in this start's queue not taken yet by a worker thread.
        self._queued: set[str] = set()
        self._queued_lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        #: Threads of a stopped start still ending their turn or tick.
        self._ending: list[threading.Thread] = []
        self._stop = threading.Event()
        #: Set to make the wake timer read the next wake again (a throttled park, the stop).
        self._rearm = threading.Event()
        self._starting = threading.Lock()
        self._pid = os.getpid()
        self._started_at: float | None = None
        self.in_hand: dict[str, str] = {}

    @property
    def running(self) -> bool:
        """Tell whether this process's worker threads are started (not stopped since)."""
        return bool(self._workers) and self._pid == os.getpid()

    @property
    def threads_alive(self) -> bool:
        """Tell whether a thread of this dispatcher lives in this process: a
        started worker's, or one of a stopped worker still ending its turn or
        its tick (:meth:`stop` waits for those too)."""
        return self._pid == os.getpid() and any(t.is_alive() for t in self._workers + self._ending)

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        """Queue a turn for the worker threads, after commit, if they are started;
        none when the run has a turn in the queue that no thread has taken yet: that
        turn's claim comes after this commit and decides as this one would (S8, R6).
        A run's turn taken by a thread (in its claim or its body) gets another."""
        if self.running:
            turns, queued, lock = self._queue, self._queued, self._queued_lock

            def put() -> None:
                with lock:
                    if run_id in queued:
                        return
                    queued.add(run_id)
                turns.put(run_id)

            self.on_commit(put)

    def start(self) -> bool:
        """Start the worker and tick threads; False if they already run (thread-safe).

        The first tick runs at once, so work that was parked, due or stranded
        resumes within about a tick of the start, with no new dispatch (O1).
        After a ``fork`` the child starts its own threads (the parent's do not
        exist there).
        """
        with self._starting:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._workers = []
                self._ending = []
                self._queue = queue_module.Queue()
                self._queued = set()
                self.in_hand = {}
            if self._workers:
                return False
            self._start_threads()
            return True

    def _start_threads(self) -> None:
        # Each start's threads have their own stop event and queue: a thread of an
        # earlier start still in a database call or a turn when its stop returned
        # ends after it, and takes neither this start's turns nor its stop markers.
        self._stop = stop = threading.Event()
        turns: queue_module.Queue[str | None] = queue_module.Queue()
        self._queue = turns
        queued: set[str] = set()
        self._queued = queued
        for n in range(self.threads):
            thread = threading.Thread(
                target=self._run_worker, args=(turns, stop, queued), name=f"durable-worker-{n}", daemon=True
            )
            thread.start()
            self._workers.append(thread)
        self._arm_wake_timer()
        ticker = threading.Thread(target=self._run_tick, args=(stop,), name=TICK_THREAD, daemon=True)
        ticker.start()
        self._workers.append(ticker)
        self._started_at = time.monotonic()
        announce("%s started in pid %d: %s", self.kind, os.getpid(), self.describe())

    def describe(self) -> str:
        """Return the worker's shape in words: threads, tick period, store and
        database vendor, e.g. ``4 threads, tick every 1 s, store DjangoStore,
        database 'default' (postgresql)``."""
        store = type(self.store).__name__
        alias = self._alias()
        if alias is None:
            where = "no database"
        else:
            from django.db import connections

            where = f"database {alias!r} ({connections[alias].vendor})"
        return f"{self.threads} threads, tick every {self.tick_seconds:g} s, store {store}, {where}"

    def stop(self, timeout: float = 30.0, *, hurry: threading.Event | None = None) -> list[str]:
        """Stop the threads: drop queued turns, let the turns in hand finish.

        Waits at most ``timeout`` seconds in all, less if ``hurry`` is set
        meanwhile; returns the ids of the runs whose turns were still running
        then. Dropped turns keep their ``wake_at`` and are sent again by a
        tick (S8). The worker is stopped when this returns (:attr:`running`
        is False, :meth:`start` starts new threads) even if a thread is still
        in its turn or its tick: that thread ends after it, running nothing
        more.
        """
        self._stop.set()
        self._disarm_wake_timer()
        dropped = 0
        while True:
            try:
                if self._queue.get_nowait() is not None:
                    dropped += 1
            except queue_module.Empty:
                break
        for _ in range(self.threads):
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        threads = self._workers + self._ending
        for thread in threads:
            if thread.name == TICK_THREAD:
                continue
            while thread.is_alive() and time.monotonic() < deadline and not (hurry and hurry.is_set()):
                thread.join(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        for thread in threads:
            if thread.name == TICK_THREAD:
                # Sleeping, the tick wakes at once (the stop event); in a database call, it is left.
                thread.join(timeout=max(0.0, min(TICK_JOIN_SECONDS, deadline - time.monotonic())))
        left = sorted(self.in_hand.values())
        if dropped:
            logger.info("%s stopping: %d queued turns left to the tick", self.kind, dropped)
        was_running = bool(self._workers)
        self._workers = []
        self._ending = [thread for thread in threads if thread.is_alive()]
        if self._ending:
            logger.info(
                "%s stopping: %s end after their turn or tick",
                self.kind,
                ", ".join(sorted(thread.name for thread in self._ending)),
            )
        if was_running and self._started_at is not None:
            announce(
                "%s stopped in pid %d (up %.1f s): %d turns still in hand%s",
                self.kind,
                os.getpid(),
                time.monotonic() - self._started_at,
                len(left),
                f" ({', '.join(left)})" if left else "",
            )
            self._started_at = None
        return left

    def turn_taken(self, run_id: str) -> None:
        """:meth:`Dispatcher.turn_taken`: on one of this dispatcher's worker threads, the
        run in hand is now ``run_id`` (the stop hands back the turns in hand, O1, O6)."""
        name = threading.current_thread().name
        if name in self.in_hand:
            self.in_hand[name] = run_id

    def _run_worker(self, turns: queue_module.Queue[str | None], stop: threading.Event, queued: set[str]) -> None:
        assert self.engine is not None
        name = threading.current_thread().name
        try:
            while True:
                run_id = turns.get()
                if run_id is None or stop.is_set():
                    return
                with self._queued_lock:
                    queued.discard(run_id)  # taken: a dispatch from now on queues another turn
                self.in_hand[name] = run_id
                try:
                    self.refresh_connections()
                    outcome = self.engine.execute(run_id)
                    logger.debug("turn of run %s: %s", run_id, outcome, extra={"run_id": run_id})
                except BaseException:  # keep the worker alive, whatever left the turn; the tick re-drives the run (R7)
                    logger.exception("turn of run %s failed", run_id, extra={"run_id": run_id})
                finally:
                    self.in_hand.pop(name, None)
                    self.refresh_connections()
        finally:
            self.close_thread_resources()

    def _run_tick(self, stop: threading.Event) -> None:
        assert self.engine is not None
        try:
            while not stop.is_set():
                try:
                    self.refresh_connections()
                    self.engine.tick()
                except Exception:
                    logger.exception("tick failed")
                finally:
                    self.refresh_connections()
                if self._wait_for_tick(stop):
                    return
        finally:
            self.close_thread_resources()

    def _wait_for_tick(self, stop: threading.Event) -> bool:
        """Wait ``tick_seconds`` for the next tick, sending the parked runs at their
        ``wake_at`` meanwhile (:func:`wait_sending_wakes`, S8, X6d, X5). A run this
        process parks over a throttle's rate (the ``run_parked`` signal with
        ``throttle``) has the next wake read again. Returns True when ``stop`` (this
        start's stop event) is set."""
        assert self.engine is not None
        return wait_sending_wakes(
            self.engine, self.tick_seconds, self.tick_seconds, stop, self._rearm, self.refresh_connections
        )

    def _arm_wake_timer(self) -> None:
        """Have this process's throttled parks wake the wake timer (``run_parked``)."""
        signals.run_parked.connect(
            self._rearm_on_throttled_park, dispatch_uid=f"durable_singleton.wake_timer.{id(self)}"
        )

    def _disarm_wake_timer(self) -> None:
        """End the wake timer's wait (the stop) and its receiver."""
        self._rearm.set()
        signals.run_parked.disconnect(dispatch_uid=f"durable_singleton.wake_timer.{id(self)}")

    def _rearm_on_throttled_park(self, sender: Any, throttle: str | None = None, **kwargs: Any) -> None:
        """``run_parked`` receiver: a run parked over a throttle's rate (X6d) wakes the
        timer, which reads the next wake again (its opening may come before the tick)."""
        if throttle is not None:
            self._rearm.set()


class ManualDispatcher(_DjangoCommit):
    """Queue turns in memory; a test calls :meth:`drain` to execute them."""

    def __init__(self, store: BaseStore) -> None:
        super().__init__(store)
        self.queue: deque[str] = deque()
        self.sent: list[str] = []
        self._lock = threading.Lock()

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        def put() -> None:
            with self._lock:
                self.queue.append(run_id)
                self.sent.append(run_id)

        self.on_commit(put)

    def drain(self, max_turns: int = 10_000) -> int:
        """Execute queued turns (and the turns they queue) until none is left; return the count."""
        assert self.engine is not None
        turns = 0
        while turns < max_turns:
            with self._lock:
                if not self.queue:
                    return turns
                run_id = self.queue.popleft()
            self.engine.execute(run_id)
            turns += 1
        raise RuntimeError(f"drain did not finish within {max_turns} turns")


def build_dispatcher(settings: Settings, store: BaseStore) -> CeleryDispatcher | ThreadDispatcher | ManualDispatcher:
    """Return the dispatcher named by ``settings.DISPATCH``; raise
    :class:`~durable_singleton.exceptions.ConfigurationError` for another name."""
    if settings.DISPATCH == "celery":
        return CeleryDispatcher(
            store, batch=settings.DISPATCH_BATCH, coalesce_seconds=settings.DISPATCH_COALESCE_SECONDS
        )
    if settings.DISPATCH == "thread":
        return ThreadDispatcher(store, settings.WORKER_THREADS, settings.TICK_SECONDS)
    if settings.DISPATCH == "manual":
        return ManualDispatcher(store)
    raise ConfigurationError(
        f"DURABLE_SINGLETON['DISPATCH'] must be 'celery', 'thread' or 'manual', got {settings.DISPATCH!r}"
    )
