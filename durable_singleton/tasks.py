"""Celery tasks: thin shells that call the engine.

``execute_run`` runs one turn of a run and is safe to deliver twice (R6);
``execute_runs`` runs the turns of many, one after the other (a batched or
coalesced send);
``tick`` is the periodic beat task (S8), on the default queue: the fallback
of the tick thread each Celery worker's main process runs
(:mod:`durable_singleton.celery_tick`). Both take the tick's lease on the
database's clock, so one tick runs at a time and a tick that could not run
does not run back to back with another (O5, O1b).
"""

from __future__ import annotations

import os
import socket
import uuid

from celery import shared_task
from django.db import close_old_connections

from .conf import get_settings
from .dispatch import EXECUTE_MANY_TASK, EXECUTE_TASK, TICK_TASK
from .runtime import get_engine
from .stores.turns import hold_tick_lease, tick_lease_keeper, tick_lease_seconds

__all__ = [
    "EXECUTE_MANY_TASK",
    "EXECUTE_TASK",
    "TICK_MIN_GAP",
    "TICK_TASK",
    "beat_schedule",
    "execute_run",
    "execute_runs",
    "tick",
]

#: After a beat tick ends, the tick's lease is kept for this share of
#: ``TICK_SECONDS``: a tick message that queued up behind it (its worker was
#: down or busy, or a tick ran long) finds the lease held and does nothing,
#: so ticks do not run back to back (O5).
TICK_MIN_GAP = 0.5


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
    """Run one engine tick if the tick's lease is free; return how many turns
    it dispatched, or -1 when another holds the lease: a Celery worker's tick
    thread, a ``durable_worker``, or the previous beat tick for
    :data:`TICK_MIN_GAP` x ``TICK_SECONDS`` after it ended (this message had
    queued up behind it). The lease is on the database's clock (O5, O1b); a
    store without a Django database has none and always ticks."""
    close_old_connections()
    try:
        engine = get_engine()
        db = engine.store.database
        if db is None:
            return len(engine.tick().dispatched)
        period = get_settings().TICK_SECONDS
        owner = f"beat:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        lease = tick_lease_seconds(period)
        if not hold_tick_lease(db, owner, lease):
            return -1
        try:
            return len(engine.tick(holding=tick_lease_keeper(db, owner, lease)).dispatched)
        finally:
            hold_tick_lease(db, owner, TICK_MIN_GAP * period)
    finally:
        close_old_connections()


def beat_schedule(seconds: float | None = None, queue: str | None = None) -> dict[str, dict[str, object]]:
    """Return the beat entry for the tick, every ``seconds`` (default:
    ``TICK_SECONDS``), sent to Celery queue ``queue`` (default None: the
    default queue, which every ``celery worker`` consumes). It is the
    fallback of the tick thread in each worker's main process
    (:mod:`durable_singleton.celery_tick`), and a no-op while one holds the
    tick's lease (O5). A message not taken within two periods (at least 5 s)
    expires: ticks that could not run do not pile up.

    Add it to your Celery app: ``app.conf.beat_schedule.update(beat_schedule())``.
    """
    period = seconds if seconds is not None else get_settings().TICK_SECONDS
    options: dict[str, object] = {"expires": max(5.0, 2 * period)}
    if queue:
        options["queue"] = queue
    return {"durable-singleton-tick": {"task": TICK_TASK, "schedule": period, "options": options}}
