"""Dispatchers: how a run's next turn reaches a worker.

* :class:`CeleryDispatcher` sends the ``durable_singleton.execute_run`` task
  after the current transaction commits.
* :class:`ThreadDispatcher` (``DISPATCH = "thread"``) is the embedded worker:
  an in-process pool of worker threads and a tick thread, started by the
  first dispatch of the process, no external service.
* :class:`ManualDispatcher` queues turns for a test to drain on its own thread.
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .conf import Settings

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["CeleryDispatcher", "ManualDispatcher", "ThreadDispatcher", "build_dispatcher"]

logger = logging.getLogger("durable_singleton")


class _DjangoCommit:
    """Defers callbacks to ``transaction.on_commit`` of the store's database."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        """Attach the engine whose turns this dispatcher executes."""
        self.engine = engine

    def _alias(self) -> str | None:
        return getattr(self.store, "db", None)

    def on_commit(self, fn: Callable[[], None]) -> None:
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


class CeleryDispatcher(_DjangoCommit):
    """Send each turn as the Celery task ``durable_singleton.execute_run`` after commit.

    A failed send is logged, not raised: the run keeps a ``wake_at`` and the
    tick sends it again (F4).
    """

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        def send() -> None:
            from .tasks import execute_run

            options: dict[str, Any] = {"retry": True, "retry_policy": {"max_retries": 1, "interval_start": 0.1}}
            if queue:
                options["queue"] = queue
            try:
                execute_run.apply_async((run_id,), **options)
            except Exception:  # broker down: the durable timer re-sends (S8, F4)
                logger.exception("could not send turn of run %s; the tick will re-send it", run_id)

        self.on_commit(send)


class ThreadDispatcher(_DjangoCommit):
    """The embedded worker: ``threads`` worker threads and a tick thread, in process."""

    def __init__(self, store: Any, threads: int, tick_seconds: float) -> None:
        super().__init__(store)
        self.threads = threads
        self.tick_seconds = tick_seconds
        self._queue: queue_module.Queue[str | None] = queue_module.Queue()
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._starting = threading.Lock()

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        """Queue a turn; the threads start with the first dispatch of the process."""
        self.start()
        self.on_commit(lambda: self._queue.put(run_id))

    def start(self) -> None:
        """Start the worker and tick threads (idempotent, thread-safe)."""
        with self._starting:
            if not self._workers:
                self._start_threads()

    def _start_threads(self) -> None:
        self._stop.clear()
        for n in range(self.threads):
            thread = threading.Thread(target=self._work, name=f"durable-worker-{n}", daemon=True)
            thread.start()
            self._workers.append(thread)
        ticker = threading.Thread(target=self._tick, name="durable-tick", daemon=True)
        ticker.start()
        self._workers.append(ticker)

    def stop(self) -> None:
        """Stop the threads after the turns they are running."""
        self._stop.set()
        for _ in range(self.threads):
            self._queue.put(None)
        for thread in self._workers:
            thread.join(timeout=30)
        self._workers.clear()

    def _work(self) -> None:
        assert self.engine is not None
        try:
            while True:
                run_id = self._queue.get()
                if run_id is None:
                    return
                try:
                    self.engine.execute(run_id)
                except Exception:  # keep the worker alive; the tick re-drives the run
                    logger.exception("turn of run %s failed", run_id)
        finally:
            self.close_thread_resources()

    def _tick(self) -> None:
        assert self.engine is not None
        try:
            while not self._stop.wait(self.tick_seconds):
                try:
                    self.engine.tick()
                except Exception:
                    logger.exception("tick failed")
        finally:
            self.close_thread_resources()


class ManualDispatcher(_DjangoCommit):
    """Queue turns in memory; a test calls :meth:`drain` to execute them."""

    def __init__(self, store: Any) -> None:
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


def build_dispatcher(settings: Settings, store: Any) -> Any:
    """Return the dispatcher named by ``settings.DISPATCH``."""
    from .exceptions import ConfigurationError

    if settings.DISPATCH == "celery":
        return CeleryDispatcher(store)
    if settings.DISPATCH == "thread":
        return ThreadDispatcher(store, settings.WORKER_THREADS, settings.TICK_SECONDS)
    if settings.DISPATCH == "manual":
        return ManualDispatcher(store)
    raise ConfigurationError(
        f"DURABLE_SINGLETON['DISPATCH'] must be 'celery', 'thread' or 'manual', got {settings.DISPATCH!r}"
    )
