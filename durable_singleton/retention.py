"""Retention of finished runs (O2): the tick's batch and ``manage.py durable_purge``.

A finished run (``completed``, ``failed``, ``cancelled``, ``dead``) whose
``finished_at`` is older than ``RETENTION_SECONDS`` is deleted with its steps
and signals, by the store (:meth:`~durable_singleton.stores.base.BaseStore.purge_finished`).
On the Django store candidates are read oldest first,
``stores.retention.READ_PAGE`` at a time; deletes go
in transactions of at most ``stores.retention.CHUNK`` runs; each
transaction locks the runs it deletes and re-checks that they are still
finished, so a run retried meanwhile (back to ``pending``, D9) is never
touched, and no lock is held longer than one small delete.

Only the Django store keeps runs beyond the process; another store deletes
nothing (the seam's default).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from datetime import datetime, timedelta

from .admission import KEY_MAX_LENGTH
from .core import Core
from .records import PurgeReport
from .stores.base import TERMINAL_STATUSES
from .values import check_int, check_text

__all__ = ["RETENTION_EVERY_SECONDS", "purge_finished", "retention_batch"]

logger = logging.getLogger("durable_singleton")

RETENTION_EVERY_SECONDS = 60.0


def purge_finished(
    engine: Core,
    *,
    before: datetime,
    statuses: Iterable[str] = TERMINAL_STATUSES,
    workflow: str | None = None,
    key: str | None = None,
    limit: int | None = None,
    dry_run: bool = False,
) -> PurgeReport:
    """Delete finished runs that finished before ``before``, with their steps and signals.

    ``statuses``: a subset of the terminal statuses (an active status raises
    :class:`~durable_singleton.exceptions.ValidationError`: active runs are
    never purged); ``workflow``/``key``: exact workflow name and singleton
    key (text a column can hold, else ``ValidationError``); ``limit``: delete
    at most this many runs, 1 to :data:`~durable_singleton.values.MAX_INT`
    (None: all that match);
    ``dry_run``: count what would go, delete nothing. Oldest first, in
    transactions of at most ``stores.retention.CHUNK`` runs (the Django store).
    """
    from .exceptions import ValidationError

    statuses = tuple(statuses)
    active = [s for s in statuses if s not in TERMINAL_STATUSES]
    if active or not statuses:
        raise ValidationError(
            f"only finished runs can be purged (statuses {', '.join(TERMINAL_STATUSES)}); got {active or 'none'}"
        )
    if limit is not None:
        check_int(limit, "limit", low=1)
    if workflow is not None:
        check_text(workflow, "workflow")
    if key is not None:
        check_text(key, "key", KEY_MAX_LENGTH)
    return engine.store.purge_finished(
        before=before, statuses=statuses, workflow_name=workflow, key=key, limit=limit, dry_run=dry_run
    )


# Per engine: when its last batch ran (its clock) and whether it was full.
_last_batch: weakref.WeakKeyDictionary[Core, tuple[datetime, bool]] = weakref.WeakKeyDictionary()


def retention_batch(engine: Core, now: datetime) -> int:
    """The tick's retention batch (O2, S8b): delete at most ``RETENTION_BATCH``
    runs that finished more than ``RETENTION_SECONDS`` before ``now``.

    Runs at most every :data:`RETENTION_EVERY_SECONDS` per engine (by the
    engine's clock), or at the next tick while the previous batch was full. Errors are logged and
    swallowed, so retention never stops the tick. Returns the runs deleted.
    """
    settings = engine.settings
    if settings.RETENTION_SECONDS is None:
        return 0
    last = _last_batch.get(engine)
    if last is not None and not last[1] and (now - last[0]).total_seconds() < RETENTION_EVERY_SECONDS:
        return 0
    try:
        report = purge_finished(
            engine, before=now - timedelta(seconds=settings.RETENTION_SECONDS), limit=settings.RETENTION_BATCH
        )
    except Exception:
        logger.exception("retention batch failed")
        _last_batch[engine] = (now, False)
        return 0
    _last_batch[engine] = (now, report.runs >= settings.RETENTION_BATCH)
    if report.runs:
        logger.info(
            "retention: deleted %d finished runs (%d steps, %d signals)", report.runs, report.steps, report.signals
        )
    return report.runs
