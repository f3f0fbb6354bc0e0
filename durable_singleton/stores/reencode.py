"""Re-encoding stored payloads with a codec store's current codec (S13).

Rows are rewritten in primary-key batches. On PostgreSQL and MySQL/MariaDB
each batch is one transaction that locks its rows first
(``select_for_update``), so a worker's concurrent write to a run is never
overwritten: it either lands before the batch reads the row or waits for the
batch; other rows stay free.

SQLite has one write lock for the whole database, and a batch that held it
for 500 rows after 500 rows starved every worker's claim and settle (#18).
There a batch is at most :data:`SQLITE_BATCH` rows; their new values are
computed before the lock is taken; the write transaction re-reads them and
rewrites only the columns still as they were read (a column a worker
rewrote meanwhile already holds the current codec's encoding); and the lock is left free for at
least as long as the batch held it, so waiting writers get it.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import connections, transaction

from ..exceptions import ConfigurationError
from ..models import Run, ScheduleState, Signal, Step
from .codec import CodecStore

__all__ = ["SQLITE_BATCH", "reencode_all"]

#: Rows per write transaction on SQLite, whatever ``batch`` says.
SQLITE_BATCH = 50

#: The shortest pause between two SQLite batches, in seconds.
SQLITE_MIN_PAUSE_SECONDS = 0.01

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
    if connections[db].vendor == "sqlite":
        return {
            model._meta.db_table: _reencode_sqlite(store, db, model, columns, min(batch, SQLITE_BATCH), dry_run)
            for model, columns in _TABLES
        }
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
                rows = model.objects.using(db).filter(pk__in=page_ids).order_by("pk").select_for_update()
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


def _reencoded(store: CodecStore, row: dict[str, Any], columns: tuple[str, ...]) -> dict[str, Any]:
    """Return the columns of ``row`` whose payload the codec writes differently, re-encoded."""
    updates = {}
    for column in columns:
        if row[column] is not None:
            value, different = store.codec.reencode(row[column])
            if different:
                updates[column] = value
    return updates


def _reencode_sqlite(
    store: CodecStore, db: str, model: Any, columns: tuple[str, ...], batch: int, dry_run: bool
) -> tuple[int, int]:
    """Re-encode one table on SQLite, leaving the write lock free between small batches."""
    seen = changed = 0
    last: Any = None
    while True:
        rows = model.objects.using(db).order_by("pk")
        if last is not None:
            rows = rows.filter(pk__gt=last)
        page = list(rows.values("pk", *columns)[:batch])
        if not page:
            return seen, changed
        last = page[-1]["pk"]
        seen += len(page)
        # The codec's work (decrypt, encrypt) is done before the lock is taken.
        planned = {row["pk"]: (row, updates) for row in page if (updates := _reencoded(store, row, columns))}
        if dry_run or not planned:
            changed += len(planned)
            continue
        began = time.monotonic()
        with transaction.atomic(using=db):  # IMMEDIATE: the write lock (S13)
            current = model.objects.using(db).filter(pk__in=list(planned)).values("pk", *columns)
            for now in current:
                read, updates = planned[now["pk"]]
                # A column a worker rewrote meanwhile already holds the current codec's encoding.
                kept = {c: v for c, v in updates.items() if now[c] == read[c]}
                if kept:
                    model.objects.using(db).filter(pk=now["pk"]).update(**kept)
                    changed += 1
        held = time.monotonic() - began
        time.sleep(max(held, SQLITE_MIN_PAUSE_SECONDS))
