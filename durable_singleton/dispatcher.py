"""The dispatcher seam: how a run's next turn reaches a worker.

:class:`Dispatcher` lists every method the engine calls on a dispatcher;
:mod:`durable_singleton.dispatch` has the three this package ships (Celery,
the embedded worker, manual). A dispatcher executes turns through the
:class:`TurnRunner` it is bound to (the engine), never by importing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Dispatcher", "TurnRunner"]


class TurnRunner(Protocol):
    """What a dispatcher calls on the engine it is bound to."""

    def execute(self, run_id: str) -> str:
        """Execute one turn of ``run_id``; return its outcome."""
        ...

    def execute_chain(self, run_id: str) -> str:
        """Execute one turn of ``run_id``, then the turns of the waiters its release woke."""
        ...

    def tick(self, holding: Callable[[], bool] | None = None) -> Any:
        """Run one tick (S8); ``holding``: the tick lease's check before each job (O1b)."""
        ...

    def dispatch_due(self) -> list[str]:
        """Send the parked runs whose ``wake_at`` came (the tick's due job, S8)."""
        ...

    def seconds_to_next_wake(self, horizon: float) -> float | None:
        """Seconds to the earliest ``wake_at`` within ``horizon`` seconds, or None (S8)."""
        ...


class Dispatcher(ABC):
    """Sends a run's next turn to a worker, after the current transaction commits.

    Subclasses implement :meth:`dispatch` and :meth:`on_commit`; the other
    methods have defaults. ``runner`` is the engine bound by :meth:`bind`.
    """

    runner: TurnRunner | None = None
    #: True when :meth:`dispatch` writes the turn in the caller's database
    #: transaction (a turn notice, ``DISPATCH = "worker"``): the engine then
    #: dispatches a start's first turn inside the start's own transaction, so
    #: the run and its turn commit together (O1a, O7).
    dispatches_in_transaction: bool = False

    def notice_written(self) -> None:
        """Called after the store wrote a start's turn notice itself
        (:meth:`~durable_singleton.stores.base.BaseStore.start_run_with_notice`,
        O1a); the default does nothing."""
        return None

    @abstractmethod
    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        """Send one turn of ``run_id`` to ``queue`` (None: the default) after commit;
        never raise for a lost send (the tick re-sends, S8)."""

    @abstractmethod
    def on_commit(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` after the current transaction commits (at once outside one)."""

    def dispatch_soon(self, run_id: str, queue: str | None = None) -> None:
        """Send a started run's first turn after commit; a dispatcher may hold
        it back a few milliseconds to share a message with other starts (the
        Celery dispatcher's ``DISPATCH_COALESCE_SECONDS``). The default is
        :meth:`dispatch`."""
        self.dispatch(run_id, queue)

    def dispatch_many(self, run_ids: Sequence[str], queue: str | None = None) -> None:
        """Send one turn of each run; the default sends them one by one."""
        for run_id in run_ids:
            self.dispatch(run_id, queue)

    def bind(self, runner: TurnRunner) -> None:
        """Attach the engine whose turns this dispatcher executes."""
        self.runner = runner

    def turn_taken(self, run_id: str) -> None:
        """Called on a worker thread when it goes on to the turn of ``run_id`` without
        taking it from this dispatcher: the next turn of a chain, a waiter its handoff
        admitted (:meth:`~durable_singleton.core.Core.execute_chain`, S7). A dispatcher
        that keeps the turns in hand for its stop (O1, O6) records it; the default
        does nothing."""
        return None

    def shutting_down(self) -> bool:
        """Tell whether the worker this process runs was asked to shut down
        (SIGTERM, SIGINT, its own stop), by the worker's own flag.

        The engine asks when a body raised a ``BaseException`` that is no
        ``Exception`` (``SystemExit``, ``KeyboardInterrupt``): True hands the
        run back with its slot and lets the exception stop the process; False
        (the default: nothing here interrupts a body to stop) means the body's
        own code raised it, and the run fails (R7).
        """
        return False

    def close_thread_resources(self) -> None:
        """Release this thread's resources (database connections) after a helper
        thread's work; the default has none."""
        return None
