"""Re-encoding stored payloads with a codec store's current codec (S13).

Rows are rewritten in primary-key batches, each batch in one transaction
that locks its rows first (``select_for_update``; on SQLite the transaction's
write lock), so a worker's concurrent write to a run is never overwritten:
it either lands before the batch reads the row or waits for the batch.
"""

from __future__ import annotations

from typing import Any

from django.db import connections, transaction

from ..exceptions import ConfigurationError
from ..models import Run, ScheduleState, Signal, Step
from .codec import CodecStore

__all__ = ["reencode_all"]

_TABLES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (Run, ("input", "output", "error")),
    (Step, ("result",)),
    (Signal, ("payload",)),
    (ScheduleState, ("input",)),
)


def reencode_all(store: CodecStore, *, batch: int = 500, dry_run: bool = False) -> dict[str, tuple[int, int]]:
    """Re-encode every payload column; return {table: (rows seen, rows changed)}.

    Raises :class:`~durable_singleton.codecs.PayloadDecodeError` for a payload the
    codec cannot decode (nothing of that batch is written), and
    :class:`~durable_singleton.exceptions.ConfigurationError` when the codec
    store does not wrap a database store.
    """
    db = store.inner.database
    if db is None:
        raise ConfigurationError("re-encoding rewrites database rows; the codec store does not wrap a database store")
    counts: dict[str, tuple[int, int]] = {}
    for model, columns in _TABLES:
        seen = changed = 0
        last: Any = None
        while True:
            ids = model.objects.using(db).order_by("pk")
            if last is not None:
                ids = ids.filter(pk__gt=last)
            page_ids = list(ids.values_list("pk", flat=True)[:batch])
            if not page_ids:
                break
            last = page_ids[-1]
            with transaction.atomic(using=db):
                rows = model.objects.using(db).filter(pk__in=page_ids).order_by("pk")
                if connections[db].vendor != "sqlite":
                    rows = rows.select_for_update()
                for row in rows.values("pk", *columns):
                    seen += 1
                    updates = {}
                    for column in columns:
                        if row[column] is None:
                            continue
                        value, different = store.codec.reencode(row[column])
                        if different:
                            updates[column] = value
                    if updates:
                        changed += 1
                        if not dry_run:
                            model.objects.using(db).filter(pk=row["pk"]).update(**updates)
        counts[model._meta.db_table] = (seen, changed)
    return counts
