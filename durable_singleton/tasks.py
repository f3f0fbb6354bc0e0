"""Celery tasks: thin shells that call the engine.

``execute_run`` runs one turn of a run and is safe to deliver twice (R6);
``execute_runs`` runs the turns of many, one after the other (a batched or
coalesced send);
``tick`` is the periodic beat task (S8), sent to a queue of its own,
:data:`TICK_QUEUE`, that a worker of its own consumes, so bodies that hold
every other worker's slots never hold it up (O5).
"""

from __future__ import annotations

import threading
import time

from celery import shared_task
from django.db import close_old_connections

from .conf import get_settings
from .dispatch import EXECUTE_MANY_TASK, EXECUTE_TASK, TICK_TASK
from .runtime import get_engine

__all__ = [
    "EXECUTE_MANY_TASK",
    "EXECUTE_TASK",
    "TICK_QUEUE",
    "TICK_TASK",
    "beat_schedule",
    "execute_run",
    "execute_runs",
    "tick",
]

#: The Celery queue of the tick (O5). Only the tick's own worker consumes it
#: (``celery -A yourproject worker -Q durable_tick -P solo -c 1``): a tick on
#: the bodies' queue waits for a free pool process, and long bodies hold all
#: of them.
TICK_QUEUE = "durable_tick"

#: A tick message that arrives less than this share of ``TICK_SECONDS`` after
#: the end of this process's previous tick is dropped: it waited in the queue
#: behind that tick (its worker was down or a tick ran long), and running it
#: now would run ticks back to back (O5).
TICK_MIN_GAP = 0.5

_last_tick_lock = threading.Lock()
#: When this process's previous tick ended (``time.monotonic()``); empty before the first.
_last_tick_end: list[float] = []


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
    """Run one engine tick; return how many turns it dispatched, or -1 when
    this message was dropped because it arrived less than
    :data:`TICK_MIN_GAP` x ``TICK_SECONDS`` after this process's previous tick
    ended (it had queued up behind it; O5)."""
    gap = TICK_MIN_GAP * get_settings().TICK_SECONDS
    with _last_tick_lock:
        if _last_tick_end and time.monotonic() - _last_tick_end[0] < gap:
            return -1
    close_old_connections()
    try:
        return len(get_engine().tick().dispatched)
    finally:
        close_old_connections()
        with _last_tick_lock:
            _last_tick_end[:] = [time.monotonic()]


def beat_schedule(seconds: float | None = None, queue: str = TICK_QUEUE) -> dict[str, dict[str, object]]:
    """Return the beat entry for the tick, every ``seconds`` (default:
    ``TICK_SECONDS``), sent to Celery queue ``queue`` (default
    :data:`TICK_QUEUE`, ``"durable_tick"``), which one worker of its own
    consumes (O5). A message not taken within two periods (at least 5 s)
    expires: ticks that could not run do not pile up.

    Add it to your Celery app: ``app.conf.beat_schedule.update(beat_schedule())``.
    """
    period = seconds if seconds is not None else get_settings().TICK_SECONDS
    return {
        "durable-singleton-tick": {
            "task": TICK_TASK,
            "schedule": period,
            "options": {"queue": queue, "expires": max(5.0, 2 * period)},
        }
    }
