"""Runtime key controls (K2): pause, resume and override the limit of a key,
or of every key of a workflow, with a record of every change.

The controls live on the key's lock row (``SingletonKey.paused`` and
``limit_override`` in the database; ``MemoryStore.controls`` in memory),
where the claim reads them under the same lock (S5): a change is applied at
the next claim of every queued run, and no interleaving of a change with
racing claims admits more than the limit in force when each claim ran. A
lowered limit never evicts a holder; it only admits no one until the holders
drop below it. A paused key admits nothing while its queue keeps its order
and still accepts starts (the queue cap still applies). Resuming, raising or
clearing an override wakes the newly admissible waiters at once (S7).

Every change is written with who made it, when, the old and new value and
an optional reason (:class:`ControlChangeRecord`), in the same transaction
as the change.

A workflow-wide change applies to every key of the workflow that has a lock
row (every key that ever had a claim or a capped start) or an active run
(its lock row is created then), and is recorded once with an empty key; a
key first seen after the change starts uncontrolled.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .admission import KEY_MAX_LENGTH, effective_limit
from .exceptions import UnknownWorkflowError, ValidationError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "ControlChangeRecord",
    "KeyControlState",
    "KeyControlsMixin",
]

REASON_MAX_LENGTH = 1000
BY_MAX_LENGTH = 150


@dataclass(frozen=True)
class KeyControlState:
    """A key's controls (K2): ``paused``, ``limit_override`` (None: not set),
    ``declared_limit`` (the workflow's) and ``limit`` (the one in force)."""

    workflow: str
    key: str
    paused: bool
    limit_override: int | None
    declared_limit: int
    limit: int


@dataclass(frozen=True)
class ControlChangeRecord:
    """One recorded change (K2): ``key`` is "" for a workflow-wide change;
    ``field`` is ``paused`` or ``limit_override``; ``by`` who, ``at`` when."""

    workflow: str
    key: str
    field: str
    old: Any
    new: Any
    by: str
    reason: str
    at: datetime
    keys: int = 1


@dataclass
class _Change:
    """What to set: ``paused`` (None: unchanged) and ``override`` (``keep``: unchanged)."""

    paused: bool | None = None
    override: int | None = None
    keep_override: bool = True
    results: list[tuple[str, bool, int | None, bool, int | None]] = field(default_factory=list)


class ControlStore(ABC):
    """Where the controls and their records live; :func:`control_store_for` picks one."""

    @abstractmethod
    def apply(
        self, workflow: str, keys: Sequence[str] | None, change: _Change, by: str, reason: str, now: datetime
    ) -> list[tuple[str, bool, int | None, bool, int | None]]:
        """Apply ``change`` to each key (every key with a row when ``keys`` is None) under
        the key's lock and record it; return (key, old paused, old override, new paused,
        new override) per key."""

    @abstractmethod
    def state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        """Return (paused, override) of one key."""

    @abstractmethod
    def history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        """Return the newest ``limit`` changes of a key (and its workflow's), or of a workflow, newest first."""


def _records(
    workflow: str,
    key: str,
    results: list[tuple[str, bool, int | None, bool, int | None]],
    by: str,
    reason: str,
    now: datetime,
) -> list[ControlChangeRecord]:
    """One record per changed field; a workflow-wide change (``key`` "") counts its keys."""
    out = []
    for name, index in (("paused", 1), ("limit_override", 2)):
        changed = [r for r in results if r[index] != r[index + 2]]
        if not changed:
            continue
        if key:
            old, new = changed[0][index], changed[0][index + 2]
        else:
            olds = {r[index] for r in changed}
            old = olds.pop() if len(olds) == 1 else "mixed"
            new = changed[0][index + 2]
        out.append(ControlChangeRecord(workflow, key, name, old, new, by, reason, now, keys=len(changed)))
    return out


class MemoryControlStore(ControlStore):
    """Controls of a :class:`~durable_singleton.stores.memory.MemoryStore`: its ``controls`` dict, under its lock."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._records: list[ControlChangeRecord] = []
        self._lock = getattr(store, "_lock", None) or threading.RLock()

    def _known_keys(self, workflow: str) -> list[str]:
        keys = {k for (w, k) in self.store.controls if w == workflow}
        keys |= {r.singleton_key for r in self.store.list_runs(workflow_name=workflow) if r.singleton_key}
        return sorted(keys)

    def apply(
        self, workflow: str, keys: Sequence[str] | None, change: _Change, by: str, reason: str, now: datetime
    ) -> list[tuple[str, bool, int | None, bool, int | None]]:
        with self._lock:
            results = []
            for key in keys if keys is not None else self._known_keys(workflow):
                control = self.store.controls.setdefault((workflow, key), {})
                old_paused, old_override = bool(control.get("paused", False)), control.get("limit_override")
                new_paused = old_paused if change.paused is None else change.paused
                new_override = old_override if change.keep_override else change.override
                control["paused"], control["limit_override"] = new_paused, new_override
                results.append((key, old_paused, old_override, new_paused, new_override))
            self._records.extend(_records(workflow, keys[0] if keys else "", results, by, reason, now))
            return results

    def state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        with self._lock:
            control = self.store.controls.get((workflow, key), {})
            return bool(control.get("paused", False)), control.get("limit_override")

    def history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        with self._lock:
            found = [r for r in self._records if r.workflow == workflow and (key is None or r.key in (key, ""))]
            return sorted(found, key=lambda r: r.at, reverse=True)[:limit]


class DjangoControlStore(ControlStore):
    """Controls on the ``SingletonKey`` rows, records in ``KeyControlChange``; the
    row lock is the claim's (``select_for_update``; SQLite: the write lock)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def apply(
        self, workflow: str, keys: Sequence[str] | None, change: _Change, by: str, reason: str, now: datetime
    ) -> list[tuple[str, bool, int | None, bool, int | None]]:
        from django.db import connections, transaction
        from django.db.models import F

        from .models import KeyControlChange, SingletonKey

        db = self.store.db
        rows = SingletonKey.objects.using(db)
        to_lock = keys
        if keys is None:
            # Every key of the workflow: those with a lock row and those whose runs
            # have none yet (started uncapped, never claimed), or a paused workflow
            # would admit their runs at their first claim (K2). Read before the
            # transaction: its first statement is a lock (S13a).
            from .models import Run
            from .statuses import ACTIVE_STATUSES

            active = {
                key
                for key in Run.objects.using(db)
                .filter(workflow_name=workflow, singleton_key__isnull=False, status__in=ACTIVE_STATUSES)
                .order_by()
                .values_list("singleton_key", flat=True)
                .distinct()
                if key is not None
            }
            known = set(rows.filter(workflow_name=workflow).values_list("key", flat=True))
            if active - known:
                to_lock = sorted(known | active)
        with transaction.atomic(using=db):
            if to_lock is not None:
                # The claim's own key lock, in key order: it creates a missing row the
                # way a claim does (on MySQL/MariaDB an upsert, which takes no gap lock:
                # an INSERT IGNORE here deadlocked with racing claims, S13a).
                for k in sorted(set(to_lock)):
                    self.store.lock_key(workflow, k)
            scope = rows.filter(workflow_name=workflow, **({"key__in": list(keys)} if keys is not None else {}))
            if connections[db].vendor == "sqlite":
                scope.update(paused=F("paused"))  # the write lock before the read (S13)
                locked = list(scope.order_by("key"))
            else:
                locked = list(scope.select_for_update().order_by("key"))
            results = []
            for row in locked:
                new_paused = row.paused if change.paused is None else change.paused
                new_override = row.limit_override if change.keep_override else change.override
                results.append((row.key, row.paused, row.limit_override, new_paused, new_override))
                if (new_paused, new_override) != (row.paused, row.limit_override):
                    rows.filter(pk=row.pk).update(paused=new_paused, limit_override=new_override)
            key = keys[0] if keys is not None and len(keys) == 1 else ""
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
                    for r in _records(workflow, key, results, by, reason, now)
                ]
            )
            return results

    def state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        from .models import SingletonKey

        row = (
            SingletonKey.objects.using(self.store.db)
            .filter(workflow_name=workflow, key=key)
            .values_list("paused", "limit_override")
            .first()
        )
        return (bool(row[0]), row[1]) if row else (False, None)

    def history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        from django.db.models import Q

        from .models import KeyControlChange

        rows = KeyControlChange.objects.using(self.store.db).filter(workflow_name=workflow)
        if key is not None:
            rows = rows.filter(Q(key=key) | Q(key=""))
        return [
            ControlChangeRecord(
                r.workflow_name, r.key, r.field, r.old_value, r.new_value, r.changed_by, r.reason, r.changed_at, r.keys
            )
            for r in rows.order_by("-changed_at", "-pk")[:limit]
        ]


_stores: weakref.WeakKeyDictionary[Any, ControlStore] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()


def control_store_for(store: Any) -> ControlStore:
    """Return the control store of run store ``store`` (a wrapper's ``inner`` store's)."""
    while getattr(store, "inner", None) is not None:
        store = store.inner
    with _stores_lock:
        found = _stores.get(store)
        if found is None:
            found = DjangoControlStore(store) if getattr(store, "db", None) is not None else MemoryControlStore(store)
            _stores[store] = found
        return found


def _check_text(value: object, what: str, max_length: int, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value.strip()) or len(value) > max_length:
        raise ValidationError(f"{what} must be a {'' if empty else 'non-empty '}str of at most {max_length} characters")
    if any(ord(c) < 32 and c not in "\t\n" for c in value) or "\x00" in value:
        raise ValidationError(f"{what} must not contain control characters")
    return value


class KeyControlsMixin:
    """Adds the runtime key controls (K2) to the engine."""

    def _declared_limit(self, workflow: str) -> int:
        engine: Engine = self  # type: ignore[assignment]
        definition = engine.registry.get(workflow)
        if definition.singleton is None:
            raise ValidationError(f"workflow {workflow!r} is not a singleton workflow; it has no keys to control")
        return definition.singleton.limit

    def _control(self, workflow: str, key: str | None, change: _Change, by: str, reason: str) -> list[KeyControlState]:
        engine: Engine = self  # type: ignore[assignment]
        if not isinstance(workflow, str):
            raise UnknownWorkflowError(f"no workflow named {workflow!r}")
        declared = self._declared_limit(workflow)
        if key is not None:
            _check_text(key, "key", KEY_MAX_LENGTH)
        _check_text(by, "by", BY_MAX_LENGTH, empty=True)
        _check_text(reason, "reason", REASON_MAX_LENGTH, empty=True)
        if not change.keep_override and change.override is not None:
            value = change.override
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError(f"a limit override must be an int >= 1 or None, got {value!r}")
        controls = control_store_for(engine.store)
        results = controls.apply(workflow, [key] if key is not None else None, change, by, reason, engine.store.now())
        states = []
        for name, old_paused, old_override, paused, override in results:
            before = 0 if old_paused else effective_limit(declared, old_override)
            after = 0 if paused else effective_limit(declared, override)
            if after > before:
                engine.wake_key(workflow, name)  # newly admissible waiters, at once (S7)
            states.append(
                KeyControlState(workflow, name, paused, override, declared, effective_limit(declared, override))
            )
        return states

    def wake_key(self, workflow: str, key: str) -> list[str]:
        """Grant the free slots of one key to its oldest waiters and send their turns (S7);
        return their run ids. Called after a change that admits more (K2)."""
        engine: Engine = self  # type: ignore[assignment]
        granted = engine.store.release(workflow, key, limits=engine.limits())
        engine._hand_off(granted)
        return [r.run_id for r in granted]

    def pause_key(self, workflow: str, key: str, *, by: str = "", reason: str = "") -> KeyControlState:
        """Pause one key (K2): holders go on, nothing more is admitted, waiters keep their order.

        ``by`` names who (at most 150 characters), ``reason`` why (at most 1000).
        Raises :class:`UnknownWorkflowError` or :class:`ValidationError`; writes nothing then.
        """
        return self._control(workflow, key, _Change(paused=True), by, reason)[0]

    def resume_key(self, workflow: str, key: str, *, by: str = "", reason: str = "") -> KeyControlState:
        """Resume one key (K2) and wake the waiters its free slots admit (S7). Raises as :meth:`pause_key`."""
        return self._control(workflow, key, _Change(paused=False), by, reason)[0]

    def override_limit(
        self, workflow: str, key: str, limit: int | None, *, by: str = "", reason: str = ""
    ) -> KeyControlState:
        """Set one key's limit to ``limit`` (an int >= 1), or clear the override with None (K2).

        Lowering never evicts a holder; raising wakes the newly admissible waiters
        at once. Raises as :meth:`pause_key`.
        """
        return self._control(workflow, key, _Change(override=limit, keep_override=False), by, reason)[0]

    def pause_workflow(self, workflow: str, *, by: str = "", reason: str = "") -> list[KeyControlState]:
        """Pause every key of ``workflow`` that has a lock row or an active run (K2); see :meth:`pause_key`."""
        return self._control(workflow, None, _Change(paused=True), by, reason)

    def resume_workflow(self, workflow: str, *, by: str = "", reason: str = "") -> list[KeyControlState]:
        """Resume every key of ``workflow`` (K2); see :meth:`resume_key`."""
        return self._control(workflow, None, _Change(paused=False), by, reason)

    def override_workflow_limit(
        self, workflow: str, limit: int | None, *, by: str = "", reason: str = ""
    ) -> list[KeyControlState]:
        """Override (or, with None, clear) the limit of every key of ``workflow`` (K2); see :meth:`override_limit`."""
        return self._control(workflow, None, _Change(override=limit, keep_override=False), by, reason)

    def key_controls(self, workflow: str, key: str) -> KeyControlState:
        """Return one key's controls and the limit in force (K2). Raises :class:`UnknownWorkflowError`."""
        engine: Engine = self  # type: ignore[assignment]
        declared = self._declared_limit(workflow)
        paused, override = control_store_for(engine.store).state(workflow, key)
        return KeyControlState(workflow, key, paused, override, declared, effective_limit(declared, override))

    def control_history(self, workflow: str, key: str | None = None, *, limit: int = 50) -> list[ControlChangeRecord]:
        """Return the newest ``limit`` recorded changes of a key (with its workflow-wide
        ones) or of a workflow, newest first (K2)."""
        engine: Engine = self  # type: ignore[assignment]
        return control_store_for(engine.store).history(workflow, key, limit)
