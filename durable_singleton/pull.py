"""``DISPATCH = "worker"``: turns go through the database to ``durable_worker`` processes (O1, O6, O7).

A process that dispatches a turn (a view, a shell, a command, a body, the
tick) writes a turn notice in its transaction
(:func:`~durable_singleton.stores.turns.add_notices`) and runs no body. A
``manage.py durable_worker`` process runs :class:`PullDispatcher`'s threads:

* ``threads`` worker threads, each executing a taken turn with
  ``execute_chain`` (as the Celery task does): a waiter its handoff admits
  runs next on the same thread (S7);
* a fetcher that takes notices when a worker thread is free, woken by
  LISTEN/NOTIFY on PostgreSQL (a listener thread) and by a poll every
  ``WORKER_POLL_SECONDS`` elsewhere; the notices are taken with ``SKIP
  LOCKED`` where the database has it, and the claim of each turn still
  decides admission (S5, R6);
* the tick thread, which runs the tick only while it holds the tick's lease
  (one process at a time, on the database's clock), and first takes back
  the runs of dead workers (O6);
* a heartbeat thread that refreshes the process's row in the worker registry.

A notice taken by a process that dies is lost with it: the run keeps its
``wake_at`` and the tick dispatches it again (S8).
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import socket
import threading
import time
from collections.abc import Sequence

from .dispatch import TICK_THREAD, ThreadDispatcher, announce
from .identity import process_name
from .stores.base import BaseStore
from .stores.turns import (
    Listener,
    add_notices,
    can_notify,
    hold_tick_lease,
    register_worker,
    release_dead_workers,
    release_tick_lease,
    take_notices,
    tick_lease_keeper,
    tick_lease_seconds,
    unregister_worker,
)

__all__ = ["LISTEN_FALLBACK_SECONDS", "PullDispatcher"]

logger = logging.getLogger("durable_singleton.worker")

#: While LISTEN works, how often the fetcher still looks for notices, in
#: seconds (a notice sent while the listener reconnected).
LISTEN_FALLBACK_SECONDS = 2.0


class PullDispatcher(ThreadDispatcher):
    """Write each turn as a notice in the database; in a ``durable_worker``, take them.

    ``threads``: worker threads (>= 1); ``tick_seconds``: the tick's period;
    ``poll_seconds``: the fetcher's poll where the database cannot notify;
    ``heartbeat_seconds`` and ``dead_seconds``: the registry's refresh and
    the silence after which a worker is dead (O6); all in seconds. ``queues``:
    the queues whose notices this process takes (empty: all). Nothing runs
    until :meth:`start`; a dispatch only writes a notice, and a start writes
    its notice in its own transaction (:attr:`dispatches_in_transaction`, O1a).
    """

    dispatches_in_transaction = True
    kind = "pull worker"

    def __init__(
        self,
        store: BaseStore,
        threads: int,
        tick_seconds: float,
        *,
        poll_seconds: float = 0.2,
        heartbeat_seconds: float = 2.0,
        dead_seconds: float = 10.0,
        queues: Sequence[str] = (),
    ) -> None:
        super().__init__(store, threads, tick_seconds)
        self.poll_seconds = poll_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.dead_seconds = dead_seconds
        self.queues: tuple[str, ...] = tuple(queues)
        #: The registry row's name and the prefix of this process's lease owners (O6).
        self.name = process_name()
        self.listening = False
        self._wake = threading.Event()
        self._slots = threading.Semaphore(threads)
        self._queue_of: dict[str, str] = {}

    # -- every process: dispatch -------------------------------------------------
    def _db(self) -> str:
        alias = self._alias()
        assert alias is not None, "DISPATCH 'worker' needs the Django store (E007)"
        return alias

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        """Write a notice of ``run_id``'s turn in the current transaction (O7):
        a rolled-back start leaves none, and on PostgreSQL the commit NOTIFYs
        the workers."""
        self.dispatch_many([run_id], queue)

    def dispatch_many(self, run_ids: Sequence[str], queue: str | None = None) -> None:
        """Write one notice per run, in one INSERT, in the current transaction."""
        if not run_ids:
            return
        # The tick's redelivery of a run still waiting for a free thread adds no second notice (S8).
        tick = threading.current_thread().name == TICK_THREAD
        add_notices(self._db(), list(run_ids), queue, unless_pending=tick)
        self.notice_written()

    def notice_written(self) -> None:
        """In a durable_worker, have its own fetcher look at once after the commit."""
        if self.running:
            self.on_commit(self._wake.set)

    # -- a durable_worker ------------------------------------------------------
    def _start_threads(self) -> None:
        db = self._db()
        self._stop.clear()
        self._slots = threading.Semaphore(self.threads)
        register_worker(
            db,
            name=self.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            mode="worker",
            threads=self.threads,
            queues=",".join(self.queues),
        )
        self.listening = False
        if can_notify(db):
            try:
                listener = Listener(db)
            except Exception as exc:
                logger.warning("database %r cannot LISTEN (%s): polling every %g s", db, exc, self.poll_seconds)
            else:
                self.listening = True
                self._spawn(self._listen, "durable-listen", listener)
        for n in range(self.threads):
            self._spawn(self._work, f"durable-worker-{n}")
        self._spawn(self._fetch, "durable-fetch")
        self._spawn(self._heartbeat, "durable-heartbeat")
        self._arm_wake_timer()
        self._spawn(self._tick, TICK_THREAD)
        self._started_at = time.monotonic()
        announce("durable_worker started in pid %d: %s", os.getpid(), self.describe())

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._workers.append(thread)

    def describe(self) -> str:
        """The worker's shape in words, with how it is woken (O1)."""
        if not self.running and not self._workers:
            wake = "not started"
        elif self.listening:
            wake = "woken by LISTEN/NOTIFY"
        else:
            wake = f"the database cannot notify: polling every {self.poll_seconds:g} s"
        queues = ", ".join(self.queues) if self.queues else "all queues"
        return f"{super().describe()}, {queues}, {wake}"

    def stop(self, timeout: float = 30.0, *, hurry: threading.Event | None = None) -> list[str]:
        """Stop as :meth:`ThreadDispatcher.stop`; the turns taken but not begun
        are written back as notices, the tick's lease is ended and the
        registry row deleted (a clean stop, O6)."""
        self._stop.set()
        self._wake.set()
        self._disarm_wake_timer()
        taken: dict[str, str] = {}
        while True:
            try:
                run_id = self._queue.get_nowait()
            except queue_module.Empty:
                break
            if run_id is not None:
                taken[run_id] = self._queue_of.pop(run_id, "")
        left = super().stop(timeout, hurry=hurry)
        if self._alias() is None:
            return left
        db = self._db()
        try:
            if taken:
                self._write_back(db, taken)
            release_tick_lease(db, self.name)
            unregister_worker(db, self.name)
        except Exception:  # the runs keep their wake_at; the row goes stale and is removed (S8, O6)
            logger.exception("could not write back turns or leave the worker registry")
        finally:
            self.close_thread_resources()
        return left

    @staticmethod
    def _write_back(db: str, taken: dict[str, str]) -> None:
        """Write the notices of turns taken but not begun back, each to its queue."""
        for queue in set(taken.values()):
            add_notices(db, [run_id for run_id, q in taken.items() if q == queue], queue or None)
        logger.info("%d turns taken but not begun written back: %s", len(taken), ", ".join(taken))

    def _work(self) -> None:
        assert self.engine is not None
        name = threading.current_thread().name
        try:
            while True:
                run_id = self._queue.get()
                if run_id is None or self._stop.is_set():
                    return
                self.in_hand[name] = run_id
                self._queue_of.pop(run_id, None)
                try:
                    self.refresh_connections()
                    outcome = self.engine.execute_chain(run_id)
                    logger.debug("turn of run %s: %s", run_id, outcome, extra={"run_id": run_id})
                except BaseException:  # keep the worker alive; the tick re-drives the run (R7)
                    logger.exception("turn of run %s failed", run_id, extra={"run_id": run_id})
                finally:
                    self.in_hand.pop(name, None)
                    self._slots.release()
                    self.refresh_connections()
        finally:
            self.close_thread_resources()

    def _fetch(self) -> None:
        db = self._db()
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.5):
                    continue
                free = 1
                while free < self.threads and self._slots.acquire(blocking=False):
                    free += 1
                self._wake.clear()
                run_ids: dict[str, str] = {}
                try:
                    self.refresh_connections()
                    run_ids = take_notices(db, free, self.queues)
                except Exception:
                    logger.exception("could not take turn notices; trying again")
                for _ in range(free - len(run_ids)):
                    self._slots.release()
                if self._stop.is_set():
                    if run_ids:  # taken as the stop came: written back for another worker
                        self._write_back(db, run_ids)
                    return
                for run_id, queue in run_ids.items():
                    self._queue_of[run_id] = queue
                    self._queue.put(run_id)
                if len(run_ids) < free:
                    self._wake.wait(LISTEN_FALLBACK_SECONDS if self.listening else self.poll_seconds)
        finally:
            self.close_thread_resources()

    def _listen(self, listener: Listener) -> None:
        try:
            while not self._stop.is_set():
                try:
                    if listener.wait(1.0):
                        self._wake.set()
                except Exception as exc:
                    listener.close()
                    logger.warning("LISTEN connection lost (%s): polling until it is back", exc)
                    self.listening = False
                    while not self._stop.wait(1.0):
                        try:
                            listener = Listener(self._db())
                        except Exception:
                            continue
                        self.listening = True
                        self._wake.set()  # look for what was sent meanwhile
                        logger.info("LISTEN connection back")
                        break
        finally:
            listener.close()
            self.close_thread_resources()

    def _heartbeat(self) -> None:
        db = self._db()
        try:
            while not self._stop.wait(self.heartbeat_seconds):
                try:
                    self.refresh_connections()
                    register_worker(
                        db,
                        name=self.name,
                        host=socket.gethostname(),
                        pid=os.getpid(),
                        mode="worker",
                        threads=self.threads,
                        queues=",".join(self.queues),
                    )
                except Exception:
                    logger.exception("could not refresh this worker's registry row")
                finally:
                    self.refresh_connections()
        finally:
            self.close_thread_resources()

    def _tick(self) -> None:
        assert self.engine is not None
        db = self._db()
        lease = tick_lease_seconds(self.tick_seconds)
        try:
            while not self._stop.is_set():
                held = False
                try:
                    self.refresh_connections()
                    if hold_tick_lease(db, self.name, lease):
                        held = True
                        release_dead_workers(db, self.dead_seconds, alive=self.name)
                        self.engine.tick(holding=tick_lease_keeper(db, self.name, lease))
                except Exception:
                    logger.exception("tick failed")
                finally:
                    self.refresh_connections()
                # The tick's holder keeps the wake timer between its ticks (X6d, S8); the others wait.
                if self._wait_for_tick(self._stop) if held else self._stop.wait(self.tick_seconds):
                    return
        finally:
            self.close_thread_resources()
