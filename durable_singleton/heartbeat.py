"""The tick's heartbeat (O3): one row (:class:`~durable_singleton.models.Heartbeat`,
kept by the store) that says when a tick last completed, and where, so
``manage.py durable_health`` can report a stale tick."""

from __future__ import annotations

import logging
import weakref
from datetime import datetime
from typing import Any

from django.db import DatabaseError

from . import signals
from .identity import process_name
from .records import Beat
from .stores.base import BaseStore

__all__ = ["HEARTBEAT_EVERY_SECONDS", "last_tick", "record_tick"]

#: A process writes the heartbeat at most this often (one UPDATE of one row).
HEARTBEAT_EVERY_SECONDS = 5.0

TICK = "tick"


_written: weakref.WeakKeyDictionary[Any, datetime] = weakref.WeakKeyDictionary()


def record_tick(engine: Any, now: datetime, seconds: float = 0.0) -> bool:
    """Record that ``engine`` completed a tick at ``now`` (the store's clock)
    that took ``seconds``: the ``tick_finished`` signal with that duration
    (which the metrics count), and the
    heartbeat row (at most every :data:`HEARTBEAT_EVERY_SECONDS` per engine).
    The store keeps it (:meth:`~durable_singleton.stores.base.BaseStore.record_beat`;
    the Django store in its database, the in-memory store in its memory,
    other stores none); returns True if
    this call wrote the row. Never raises for a database error (the
    tick goes on; a missing heartbeat is what health reports)."""
    signals.tick_finished.send_robust(sender=type(engine), seconds=max(0.0, seconds))
    last = _written.get(engine)
    if last is not None and (now - last).total_seconds() < HEARTBEAT_EVERY_SECONDS:
        return False
    try:
        if not engine.store.record_beat(TICK, now, process_name()):
            return False
    except DatabaseError:
        logging.getLogger("durable_singleton").exception("could not record the tick's heartbeat")
        return False
    _written[engine] = now
    return True


def last_tick(store: BaseStore) -> Beat | None:
    """Return the tick's heartbeat kept by ``store``, or None if no tick ever
    completed (or the store keeps none)."""
    return store.beat(TICK)
