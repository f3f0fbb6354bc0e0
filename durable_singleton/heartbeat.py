"""The tick's heartbeat (O3): one row (:class:`~durable_singleton.models.Heartbeat`)
that says when a tick last completed, and where, so ``manage.py
durable_health`` can report a stale tick."""

from __future__ import annotations

import logging
import weakref
from datetime import datetime
from typing import Any

from django.db import DatabaseError

from . import signals
from .identity import process_name

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
    Only a store in a Django database (``store.database``) keeps it; returns
    True if this call wrote the row. Never raises for a database error (the
    tick goes on; a missing heartbeat is what health reports)."""
    signals.tick_finished.send_robust(sender=type(engine), seconds=max(0.0, seconds))
    db = engine.store.database
    if db is None:
        return False
    last = _written.get(engine)
    if last is not None and (now - last).total_seconds() < HEARTBEAT_EVERY_SECONDS:
        return False
    from .models import Heartbeat  # the models need the app registry: imported at the call

    owner = process_name()
    rows = Heartbeat.objects.using(db)
    try:
        if not rows.filter(name=TICK).update(at=now, owner=owner):
            rows.bulk_create([Heartbeat(name=TICK, at=now, owner=owner)], ignore_conflicts=True)
    except DatabaseError:
        logging.getLogger("durable_singleton").exception("could not record the tick's heartbeat")
        return False
    _written[engine] = now
    return True


def last_tick(using: str) -> Any:
    """Return the tick's :class:`~durable_singleton.models.Heartbeat` row on
    database ``using``, or None if no tick ever completed."""
    from .models import Heartbeat

    return Heartbeat.objects.using(using).filter(name=TICK).first()
