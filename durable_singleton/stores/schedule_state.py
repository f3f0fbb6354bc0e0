"""Schedule state in the database (S17): one row per schedule, one per window
fired; what :meth:`DjangoStore.schedule_state
<durable_singleton.stores.django.DjangoStore.schedule_state>` returns.

Only this module takes the schedule row's lock. A tick fires a schedule in
one transaction: lock the row (``select_for_update``, skipping a row another
tick holds where the database can; on SQLite the IMMEDIATE transaction holds
the write lock), re-check that it is still due, start the windows' runs,
record them, move the cursor, commit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connections, transaction

from ..exceptions import ValidationError
from ..models import ScheduleFiring, ScheduleState
from ..querysets import DbNow
from ..schedule_specs import Schedule
from .base import FiringRecord, ScheduleRow, ScheduleStore

__all__ = ["EDITABLE_FIELDS", "DjangoScheduleStore", "spec_of"]


def spec_of(row: ScheduleState, codec: Any = None) -> Schedule:
    """Return the validated :class:`Schedule` a row describes; ``codec`` decodes its input (S13).

    Raises :class:`~durable_singleton.exceptions.InvalidWorkflowError` for a row
    whose fields are invalid (an operator's typo in the admin), and
    :class:`~durable_singleton.codecs.PayloadDecodeError` for an input ``codec``
    cannot decode.
    """
    return Schedule(
        name=row.name,
        every=row.every_seconds,
        cron=row.cron or None,
        timezone=row.timezone,
        input=codec.decode(row.input) if codec is not None else row.input,
        overlap=row.overlap,
        catch_up=row.catch_up,
        catch_up_limit=row.catch_up_limit,
        grace=row.grace_seconds,
    ).check(row.workflow_name)


#: The fields of a row that state its spec (:func:`spec_of`).
_SPEC_FIELDS = (
    "workflow_name",
    "every_seconds",
    "cron",
    "timezone",
    "input",
    "overlap",
    "catch_up",
    "catch_up_limit",
    "grace_seconds",
)


def _fields_of(spec: Schedule) -> dict[str, Any]:
    return {
        "workflow_name": spec.workflow,
        "every_seconds": spec.every,
        "cron": spec.cron or "",
        "timezone": spec.timezone,
        "input": spec.input,
        "overlap": str(spec.overlap),
        "catch_up": str(spec.catch_up),
        "catch_up_limit": spec.catch_up_limit,
        "grace_seconds": spec.grace,
    }


#: The fields of a row an operator edits (:meth:`DjangoScheduleStore.edit`); the name is part of every run id.
EDITABLE_FIELDS = (*_SPEC_FIELDS, "paused")
_TIMING_FIELDS = ("every_seconds", "cron", "timezone")


class DjangoScheduleStore(ScheduleStore):
    """Schedule state in the database of a :class:`~durable_singleton.stores.django.DjangoStore`.

    A ``now`` of None is the database's clock (R8): read with the row's lock
    held where a window is decided (:meth:`locked`, :meth:`edit`), written by
    the statement itself (``DbNow``) where a time is only stored.
    """

    def __init__(self, store: Any, codec: Any = None) -> None:
        self.store = store
        self.codec = codec

    @property
    def db(self) -> str:
        """Return the database alias (the run store's)."""
        return str(self.store.db)

    def _rows(self) -> Any:
        return ScheduleState.objects.using(self.db)

    def _now(self, now: datetime | None) -> datetime:
        return now if now is not None else self.store.now()

    def sync_declared(self, specs: Sequence[Schedule], now: datetime | None) -> None:
        if not specs:
            return
        existing = {row.name: row for row in self._rows().filter(name__in=[s.name for s in specs])}
        stamp: Any = now if now is not None else DbNow()
        for spec in specs:
            fields = _fields_of(spec)
            row = existing.get(spec.name)
            if self.codec is not None:
                fields["input"] = self.codec.encode(spec.input)
                if row is not None and self.codec.decode(row.input) == spec.input:
                    fields["input"] = row.input  # the same input: keep its ciphertext
            if row is None:
                try:
                    with transaction.atomic(using=self.db):
                        first = spec.first_window_at_or_after(self._now(now))
                        self._rows().create(name=spec.name, source="code", next_fire_at=first, **fields)
                except IntegrityError:
                    pass  # another process declared it first
                continue
            if all(getattr(row, k) == v for k, v in fields.items()) and row.source == "code":
                continue
            changes: dict[str, Any] = {**fields, "source": "code"}
            if any(getattr(row, k) != fields[k] for k in _TIMING_FIELDS):
                changes["next_fire_at"] = spec.first_window_at_or_after(self._now(now))
            self._rows().filter(pk=row.pk).update(**changes, updated_at=stamp)

    def due(self, now: datetime | None, batch: int) -> list[str]:
        stamp: Any = now if now is not None else DbNow()
        for state in self._rows().filter(paused=False, next_fire_at__isnull=True)[:batch]:
            # A row an operator added without a cursor starts at its first window from now.
            first = spec_of(state, self.codec).first_window_at_or_after(self._now(now))
            self._rows().filter(pk=state.pk, next_fire_at__isnull=True).update(next_fire_at=first, updated_at=stamp)
        return list(
            self._rows()
            .filter(paused=False, next_fire_at__lte=now if now is not None else DbNow())
            .order_by("next_fire_at", "name")
            .values_list("name", flat=True)[:batch]
        )

    @contextmanager
    def locked(self, name: str, now: datetime | None) -> Iterator[ScheduleRow | None]:
        db = self.db
        with transaction.atomic(using=db):
            rows = self._rows().filter(name=name, paused=False, next_fire_at__lte=now if now is not None else DbNow())
            if connections[db].vendor != "sqlite":
                skip = connections[db].features.has_select_for_update_skip_locked
                rows = rows.select_for_update(skip_locked=skip)
            state = rows.first()
            if state is None:
                yield None
                return
            # The windows are decided by the database's clock read now, with the row
            # locked, not by a clock read before a lock wait (R8).
            locked_at = self._now(now)
            row = ScheduleRow(
                spec=spec_of(state, self.codec),
                source=state.source,
                paused=state.paused,
                next_fire_at=state.next_fire_at,
                last_window_at=state.last_window_at,
                last_run_id=state.last_run_id,
                locked_at=locked_at,
            )
            yield row
            self._rows().filter(pk=state.pk).update(
                next_fire_at=row.next_fire_at,
                last_window_at=row.last_window_at,
                last_run_id=row.last_run_id,
                updated_at=locked_at,
            )

    def record(self, firing: FiringRecord) -> None:
        schedule = self._rows().only("pk").get(name=firing.schedule)
        try:
            with transaction.atomic(using=self.db):
                made = ScheduleFiring.objects.using(self.db).create(
                    schedule=schedule,
                    window_at=firing.window_at,
                    run_id=firing.run_id,
                    outcome=str(firing.outcome),
                    detail=firing.detail,
                )
                # created_at is auto_now_add, this process's clock: the record's time is the store's (R8).
                recorded_at: Any = firing.recorded_at if firing.recorded_at is not None else DbNow()
                ScheduleFiring.objects.using(self.db).filter(pk=made.pk).update(created_at=recorded_at)
        except IntegrityError:
            pass  # the window was recorded already

    def set_paused(self, name: str, paused: bool, now: datetime | None) -> bool:
        return self.edit(name, {"paused": paused}, now)

    def edit(self, name: str, changes: Mapping[str, Any], now: datetime | None = None) -> bool:
        """Apply an operator's change of schedule ``name`` under its row lock (S17, R8).

        ``changes`` maps fields of :data:`EDITABLE_FIELDS` to their new values
        (``input`` as plain JSON: this store's codec encodes it); only these
        fields are written, so the cursor a racing tick moved stays moved. A
        change of timing (``every_seconds``, ``cron``, ``timezone``) puts the
        cursor at the first window >= ``now`` (None: the database's clock,
        read with the row locked). Pausing and resuming keep the cursor: the
        windows that passed while the schedule was paused are due, and the
        next firing picks them by its catch-up policy. A schedule declared in
        code takes ``paused`` only (its code owns the rest).

        Returns False if there is no such schedule. Raises
        :class:`~durable_singleton.exceptions.ValidationError` for a field
        that is not editable here and
        :class:`~durable_singleton.exceptions.InvalidWorkflowError` for a
        change that makes the schedule invalid; either writes nothing.
        """
        unknown = sorted(set(changes) - set(EDITABLE_FIELDS))
        if unknown:
            raise ValidationError(f"schedule {name!r}: not an editable field: {', '.join(unknown)}")
        values = dict(changes)
        if "input" in values and self.codec is not None:
            values["input"] = self.codec.encode(values["input"])
        with transaction.atomic(using=self.db):
            rows = self._rows().filter(name=name)
            if connections[self.db].vendor != "sqlite":
                rows = rows.select_for_update()
            state = rows.first()
            if state is None:
                return False
            if state.source == ScheduleState.Source.CODE and set(values) - {"paused"}:
                raise ValidationError(f"schedule {name!r} is declared in code: only pausing it is an operator's")
            timing_changed = any(k in values and values[k] != getattr(state, k) for k in _TIMING_FIELDS)
            for field_name, value in values.items():
                setattr(state, field_name, value)
            state.cron = state.cron or ""
            spec = spec_of(state, self.codec)  # InvalidWorkflowError: nothing written
            if timing_changed:
                values["next_fire_at"] = spec.first_window_at_or_after(self._now(now))
            self._rows().filter(pk=state.pk).update(**values, updated_at=now if now is not None else DbNow())
            return True

    def firings(self, name: str) -> list[FiringRecord]:
        return [
            FiringRecord(name, f.window_at, f.run_id, f.outcome, f.detail, f.created_at)
            for f in ScheduleFiring.objects.using(self.db).filter(schedule__name=name).order_by("window_at")
        ]

    def get(self, name: str) -> ScheduleRow | None:
        state = self._rows().filter(name=name).first()
        if state is None:
            return None
        return ScheduleRow(
            spec=spec_of(state, self.codec),
            source=state.source,
            paused=state.paused,
            next_fire_at=state.next_fire_at,
            last_window_at=state.last_window_at,
            last_run_id=state.last_run_id,
        )
