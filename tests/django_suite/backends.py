"""The stand-ins that Django's tests/tasks suite gets for its two built-in backends.

Django's tests name ``django.tasks.backends.immediate.ImmediateBackend`` and
``django.tasks.backends.dummy.DummyBackend`` in their ``TASKS`` settings;
the runner points both paths here (tests/django_suite/run.py). Each is the
durable backend with only what a test needs to observe it:

- :class:`ImmediateBackend` runs the turns right after ``enqueue`` (it drains
  the manual dispatcher, as a worker would) and returns the result as stored.
- :class:`DummyBackend` leaves them queued, and offers the dummy backend's
  test API over real runs: ``results`` reads back every run it enqueued,
  ``clear()`` deletes them.

Everything else (enqueue, the run, get_result, check, the signals) is
:class:`~durable_singleton.tasks_backend.DurableSingletonBackend`'s.
"""

from __future__ import annotations

from typing import Any

from django.tasks import Task, TaskResult

from durable_singleton.runtime import get_engine
from durable_singleton.tasks_backend import DurableSingletonBackend


class ImmediateBackend(DurableSingletonBackend):
    """The durable backend whose turns run at once, on the enqueuing thread."""

    def enqueue[**P, R](self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        result = super().enqueue(task, args, kwargs)
        get_engine().dispatcher.drain()
        result.refresh()
        return result


class DummyBackend(DurableSingletonBackend):
    """The durable backend whose turns wait, with the dummy backend's ``results`` and ``clear()``."""

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self._ids: list[str] = []

    def enqueue[**P, R](self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        result = super().enqueue(task, args, kwargs)
        self._ids.append(result.id)
        return result

    @property
    def results(self) -> list[TaskResult[..., Any]]:
        """Return the results of the runs this backend enqueued, as stored now."""
        return [self.get_result(run_id) for run_id in self._ids]

    def clear(self) -> None:
        """Delete the runs this backend enqueued, and forget their queued turns."""
        engine = get_engine()
        for run_id in self._ids:
            engine.store.delete_run(run_id)
        self._ids.clear()
        engine.dispatcher.queue.clear()
