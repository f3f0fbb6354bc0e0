"""Runtime key controls in the database (K2): on the key's lock row
(``SingletonKey.paused`` and ``limit_override``), records in
``KeyControlChange``; what :class:`~durable_singleton.stores.django.DjangoStore`'s
key-control seam methods do.

The row lock is the claim's (:meth:`DjangoStore.lock_key
<durable_singleton.stores.django.DjangoStore.lock_key>`, in key order; on
SQLite the transaction's write lock), so no claim runs between a change and
its record (S5, S13).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.db.models import F, Max, Q

from ..admission import QUOTA_PREFIX
from ..models import KeyControlChange, QuotaMembership, Run, SingletonKey
from ..statuses import ACTIVE_STATUSES
from .base import ControlChange, ControlChangeRecord, ControlResult, control_records

__all__ = ["apply", "controlled", "history", "limit_changed_at", "state"]


def apply(
    store: Any,
    workflow: str,
    keys: Sequence[str] | None,
    change: ControlChange,
    *,
    by: str,
    reason: str,
    now: datetime,
) -> list[ControlResult]:
    """Apply ``change`` on ``store``'s database (see ``BaseStore.apply_key_controls``)."""
    db = store.db
    rows = SingletonKey.objects.using(db)
    to_lock = keys
    if keys is None:
        # Every key of the workflow: those with a lock row and those whose runs
        # have none yet (started uncapped, never claimed), or a paused workflow
        # would admit their runs at their first claim (K2). A quota's lock name
        # (``quota:<name>``) has its keys in its active runs' memberships (X3b).
        # Read before the transaction: its first statement is a lock (S13a).
        active = {key for key in _active_keys(db, workflow) if key is not None}
        known = set(rows.filter(workflow_name=workflow).values_list("key", flat=True))
        if active - known:
            to_lock = sorted(known | active)
    with transaction.atomic(using=db):
        if to_lock is not None:
            # The claim's own key lock, in key order: it creates a missing row the
            # way a claim does (on MySQL/MariaDB an upsert, which takes no gap lock:
            # an INSERT IGNORE here deadlocked with racing claims, S13a).
            for k in sorted(set(to_lock)):
                store.lock_key(workflow, k)
        scope = rows.filter(workflow_name=workflow, **({"key__in": list(keys)} if keys is not None else {}))
        if connections[db].vendor == "sqlite":
            scope.update(paused=F("paused"))  # the write lock before the read (S13)
            locked = list(scope.order_by("key"))
        else:
            locked = list(scope.select_for_update().order_by("key"))
        results = []
        for row in locked:
            paused = row.paused if change.paused is None else change.paused
            override = row.limit_override if change.keep_override else change.override
            results.append(ControlResult(row.key, row.paused, row.limit_override, paused, override))
            if (paused, override) != (row.paused, row.limit_override):
                rows.filter(pk=row.pk).update(paused=paused, limit_override=override)
        label = keys[0] if keys is not None and len(keys) == 1 else ""
        KeyControlChange.objects.using(db).bulk_create(
            [
                KeyControlChange(
                    workflow_name=r.workflow,
                    key=r.key,
                    field=r.field,
                    old_value=r.old,
                    new_value=r.new,
                    changed_by=r.by,
                    reason=r.reason,
                    changed_at=r.at,
                    keys=r.keys,
                )
                for r in control_records(workflow, label, results, by, reason, now)
            ]
        )
        return results


def state(store: Any, workflow: str, key: str) -> tuple[bool, int | None]:
    """Return (paused, override) of one key on ``store``'s database."""
    row = (
        SingletonKey.objects.using(store.db)
        .filter(workflow_name=workflow, key=key)
        .values_list("paused", "limit_override")
        .first()
    )
    return (bool(row[0]), row[1]) if row else (False, None)


def _active_keys(db: str, workflow: str) -> Any:
    """The distinct keys of ``workflow``'s active runs: their singleton keys, or for a
    quota's lock name ``quota:<name>`` (K2 on a quota key, X3j) their keys of that quota."""
    if workflow.startswith(QUOTA_PREFIX):
        members = QuotaMembership.objects.using(db).filter(
            quota=workflow[len(QUOTA_PREFIX) :], run__status__in=ACTIVE_STATUSES
        )
        return members.order_by().values_list("key", flat=True).distinct()
    runs = Run.objects.using(db).filter(workflow_name=workflow, singleton_key__isnull=False, status__in=ACTIVE_STATUSES)
    return runs.order_by().values_list("singleton_key", flat=True).distinct()


def history(store: Any, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
    """Return the newest ``limit`` recorded changes on ``store``'s database, newest first."""
    rows = KeyControlChange.objects.using(store.db).filter(workflow_name=workflow)
    if key is not None:
        rows = rows.filter(Q(key=key) | Q(key=""))
    return [
        ControlChangeRecord(
            r.workflow_name, r.key, r.field, r.old_value, r.new_value, r.changed_by, r.reason, r.changed_at, r.keys
        )
        for r in rows.order_by("-changed_at", "-pk")[:limit]
    ]


def controlled(store: Any) -> dict[tuple[str, str], tuple[bool, int | None]]:
    """Return (paused, override) of every paused or overridden key on ``store``'s database."""
    rows = SingletonKey.objects.using(store.db).filter(Q(paused=True) | Q(limit_override__isnull=False))
    return {
        (workflow, key): (bool(paused), override)
        for workflow, key, paused, override in rows.values_list("workflow_name", "key", "paused", "limit_override")
    }


def limit_changed_at(store: Any, workflow: str, key: str) -> datetime | None:
    """Return when the limit override of ``(workflow, key)`` (or its workflow-wide one) last changed."""
    changes = KeyControlChange.objects.using(store.db).filter(
        workflow_name=workflow, key__in=(key, ""), field="limit_override"
    )
    at: datetime | None = changes.aggregate(at=Max("changed_at"))["at"]
    return at
