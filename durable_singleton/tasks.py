"""Celery tasks: thin shells that call the engine.

``execute_run`` runs one turn of a run and is safe to deliver twice (R6);
``execute_runs`` runs the turns of many, one after the other (a batched or
coalesced send);
``tick`` is the periodic beat task (S8).
"""

from __future__ import annotations

from celery import shared_task
from django.db import close_old_connections

from .conf import get_settings
from .dispatch import EXECUTE_MANY_TASK, EXECUTE_TASK, TICK_TASK
from .runtime import get_engine

__all__ = ["EXECUTE_MANY_TASK", "EXECUTE_TASK", "TICK_TASK", "beat_schedule", "execute_run", "execute_runs", "tick"]


@shared_task(name=EXECUTE_TASK, ignore_result=True)
def execute_run(run_id: str) -> str:
    """Execute one turn of ``run_id``, then the waiters its release woke (see
    :meth:`Engine.execute_chain`); returns the first turn's outcome."""
    close_old_connections()
    try:
        return get_engine().execute_chain(run_id)
    finally:
        close_old_connections()


@shared_task(name=EXECUTE_MANY_TASK, ignore_result=True)
def execute_runs(run_ids: list[str], queue: str | None = None) -> list[str]:
    """Execute the turns of ``run_ids`` (a list of run id strs) one after the
    other, each with its handoffs, for at most 2 s; the rest are sent on to
    ``queue`` (None: the default queue) in two messages (see
    :meth:`Engine.execute_batch`). Safe to deliver twice, as each turn is (R6).
    Returns the outcomes of the turns executed here."""
    close_old_connections()
    try:
        return get_engine().execute_batch(list(run_ids), queue)
    finally:
        close_old_connections()


@shared_task(name=TICK_TASK, ignore_result=True)
def tick() -> int:
    """Run one engine tick; return how many turns it dispatched."""
    close_old_connections()
    try:
        return len(get_engine().tick().dispatched)
    finally:
        close_old_connections()


def beat_schedule(seconds: float | None = None) -> dict[str, dict[str, object]]:
    """Return the beat entry for the tick, every ``seconds`` (default: ``TICK_SECONDS``).

    Add it to your Celery app: ``app.conf.beat_schedule.update(beat_schedule())``.
    """
    return {
        "durable-singleton-tick": {
            "task": TICK_TASK,
            "schedule": seconds if seconds is not None else get_settings().TICK_SECONDS,
            "options": {"expires": 5.0},
        }
    }
