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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connections, transaction

from ..models import ScheduleFiring, ScheduleState
from ..schedule_specs import Schedule
from .base import FiringRecord, ScheduleRow, ScheduleStore

__all__ = ["DjangoScheduleStore", "spec_of"]


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


class DjangoScheduleStore(ScheduleStore):
    """Schedule state in the database of a :class:`~durable_singleton.stores.django.DjangoStore`."""

    def __init__(self, store: Any, codec: Any = None) -> None:
        self.store = store
        self.codec = codec

    @property
    def db(self) -> str:
        """Return the database alias (the run store's)."""
        return str(self.store.db)

    def _rows(self) -> Any:
        return ScheduleState.objects.using(self.db)

    def sync_declared(self, specs: Sequence[Schedule], now: datetime) -> None:
        if not specs:
            return
        existing = {row.name: row for row in self._rows().filter(name__in=[s.name for s in specs])}
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
                        self._rows().create(
                            name=spec.name, source="code", next_fire_at=spec.first_window_at_or_after(now), **fields
                        )
                except IntegrityError:
                    pass  # another process declared it first
                continue
            if all(getattr(row, k) == v for k, v in fields.items()) and row.source == "code":
                continue
            timing = ("every_seconds", "cron", "timezone")
            changes: dict[str, Any] = {**fields, "source": "code"}
            if any(getattr(row, k) != fields[k] for k in timing):
                changes["next_fire_at"] = spec.first_window_at_or_after(now)
            self._rows().filter(pk=row.pk).update(**changes, updated_at=now)

    def due(self, now: datetime, batch: int) -> list[str]:
        for state in self._rows().filter(paused=False, next_fire_at__isnull=True)[:batch]:
            # A row an operator added without a cursor starts at its first window from now.
            first = spec_of(state, self.codec).first_window_at_or_after(now)
            self._rows().filter(pk=state.pk, next_fire_at__isnull=True).update(next_fire_at=first, updated_at=now)
        return list(
            self._rows()
            .filter(paused=False, next_fire_at__lte=now)
            .order_by("next_fire_at", "name")
            .values_list("name", flat=True)[:batch]
        )

    @contextmanager
    def locked(self, name: str, now: datetime) -> Iterator[ScheduleRow | None]:
        db = self.db
        with transaction.atomic(using=db):
            rows = self._rows().filter(name=name, paused=False, next_fire_at__lte=now)
            if connections[db].vendor != "sqlite":
                skip = connections[db].features.has_select_for_update_skip_locked
                rows = rows.select_for_update(skip_locked=skip)
            state = rows.first()
            if state is None:
                yield None
                return
            row = ScheduleRow(
                spec=spec_of(state, self.codec),
                source=state.source,
                paused=state.paused,
                next_fire_at=state.next_fire_at,
                last_window_at=state.last_window_at,
                last_run_id=state.last_run_id,
            )
            yield row
            self._rows().filter(pk=state.pk).update(
                next_fire_at=row.next_fire_at,
                last_window_at=row.last_window_at,
                last_run_id=row.last_run_id,
                updated_at=now,
            )

    def record(self, firing: FiringRecord) -> None:
        schedule = self._rows().only("pk").get(name=firing.schedule)
        try:
            with transaction.atomic(using=self.db):
                ScheduleFiring.objects.using(self.db).create(
                    schedule=schedule,
                    window_at=firing.window_at,
                    run_id=firing.run_id,
                    outcome=str(firing.outcome),
                    detail=firing.detail,
                )
        except IntegrityError:
            pass  # the window was recorded already

    def set_paused(self, name: str, paused: bool, now: datetime) -> bool:
        with transaction.atomic(using=self.db):
            rows = self._rows().filter(name=name)
            if connections[self.db].vendor != "sqlite":
                rows = rows.select_for_update()
            state = rows.first()
            if state is None:
                return False
            changes: dict[str, Any] = {"paused": paused, "updated_at": now}
            if state.paused and not paused:
                changes["next_fire_at"] = spec_of(state, self.codec).first_window_at_or_after(now)
            self._rows().filter(pk=state.pk).update(**changes)
            return True

    def firings(self, name: str) -> list[FiringRecord]:
        return [
            FiringRecord(name, f.window_at, f.run_id, f.outcome, f.detail)
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
