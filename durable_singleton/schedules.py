"""Firing schedules (S17, S16): a workflow started once per window of an
interval or a cron expression.

A schedule is declared in code on a workflow (``@workflow(...,
schedules=[Schedule(...)])``) or kept as a row an operator manages in the
admin. Either way its state lives in the store
(:meth:`~durable_singleton.stores.base.BaseStore.schedule_state`; the Django
store's :class:`~durable_singleton.models.ScheduleState` row): the next window
not yet fired and whether it is paused. The tick calls
:func:`fire_due_schedules`, which takes each due schedule under its row lock,
decides which windows to fire (the catch-up policy) by the store's clock read
under that lock (R8: a process clock that stepped never fires a window early
or late), starts one run per window with the deterministic run id
``schedule:<name>:<window>`` (idempotent by run id, R3), records each
window's outcome (:class:`~durable_singleton.models.ScheduleFiring`) and
moves the cursor past that time in the same transaction. Two ticks on two
machines fire a window once: the second finds the cursor moved.

The declarations (:class:`Schedule`, :class:`Overlap`, :class:`CatchUp`) are
:mod:`durable_singleton.schedule_specs`'; they are named here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from .core import Core
from .exceptions import DurableSingletonError, SingletonQueueFullError, ValidationError
from .schedule_specs import CatchUp, FiringOutcome, Overlap, Schedule, coerce_schedules, schedule_run_id
from .stores.base import BaseStore, FiringRecord, ScheduleRow, ScheduleStore

__all__ = [
    "CatchUp",
    "FiringOutcome",
    "Overlap",
    "Schedule",
    "ScheduleReport",
    "coerce_schedules",
    "fire_due_schedules",
    "pause_schedule",
    "resume_schedule",
    "schedule_run_id",
    "schedule_store_for",
]

logger = logging.getLogger("durable_singleton")


def schedule_store_for(store: BaseStore) -> ScheduleStore:
    """Return where run store ``store`` keeps schedule state (its
    :meth:`~durable_singleton.stores.base.BaseStore.schedule_state`)."""
    return store.schedule_state()


@dataclass
class ScheduleReport:
    """What :func:`fire_due_schedules` did: window outcomes by run id."""

    outcomes: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def declared_schedules(core: Core) -> list[Schedule]:
    """Return the schedules declared in code on the core's registered workflows (latest versions)."""
    found: list[Schedule] = []
    for definition in list(core.registry.latest.values()):
        found.extend(getattr(definition, "schedules", ()))
    return found


def _sync(core: Core, states: ScheduleStore, now: datetime | None) -> None:
    """Write code-declared schedules to their rows: one read when nothing changed, so a
    row deleted behind the process's back is declared again at the next tick."""
    specs = declared_schedules(core)
    if specs:
        states.sync_declared(specs, now)


# -- firing ------------------------------------------------------------------
def fire_due_schedules(core: Core, now: datetime | None, batch: int) -> ScheduleReport:
    """Fire the windows of at most ``batch`` due schedules (S17, S8b).

    ``now``: the time to fire by (an aware datetime), or None for the store's
    clock, read under each schedule's row lock (R8; the engine's tick passes
    :meth:`~durable_singleton.core.Core.caller_now`, None on its default clock).
    Each schedule is fired under its row lock: the windows due by that time
    are chosen by its catch-up policy, each is started with its deterministic
    run id (S16: the queue cap applies; a rejected window is recorded), and the
    cursor moves past that time. Errors of one schedule are logged and skipped;
    this function never raises. Returns what it did.
    """
    report = ScheduleReport()
    try:
        states = schedule_store_for(core.store)
        _sync(core, states, now)
        names = states.due(now, batch)
    except Exception as exc:  # the tick goes on without schedules this time (S8b)
        logger.exception("schedules: could not read due schedules")
        report.errors.append(f"*: {exc}")
        return report
    for name in names:
        try:
            _fire_one(core, states, name, now, report)
        except Exception as exc:  # one bad schedule must not stop the others (S8b)
            logger.exception("schedule %s: firing failed", name)
            report.errors.append(f"{name}: {exc}")
    return report


def _fire_one(core: Core, states: ScheduleStore, name: str, now: datetime | None, report: ScheduleReport) -> None:
    with states.locked(name, now) as row:
        if row is None:
            return  # fired by a racing tick, paused, or removed meanwhile
        spec = row.spec
        assert row.next_fire_at is not None and row.locked_at is not None
        at = row.locked_at  # the store's clock under the lock, or the caller's time (R8)
        keep = spec.catch_up_limit if spec.catch_up == CatchUp.ALL else 1
        windows, older, following = spec.due_windows(row.next_fire_at, at, keep)
        missed_from = row.next_fire_at if older else None
        if spec.catch_up == CatchUp.NONE and windows and (at - windows[-1]).total_seconds() > spec.grace:
            missed_from = missed_from or windows[0]
            older += len(windows)
            windows = []
        if older:
            assert missed_from is not None
            last_missed = windows[0] - timedelta(microseconds=1) if windows else following - timedelta(microseconds=1)
            states.record(
                FiringRecord(
                    name,
                    missed_from,
                    "",
                    FiringOutcome.MISSED,
                    f"{older} window(s) from {missed_from:%Y-%m-%d %H:%M:%S} UTC to "
                    f"{last_missed:%Y-%m-%d %H:%M:%S} UTC not fired (catch_up={spec.catch_up})",
                    recorded_at=at,
                )
            )
        for window in windows:
            record = replace(_fire_window(core, spec, row, window), recorded_at=at)
            states.record(record)
            report.outcomes[record.run_id] = record.outcome
        row.next_fire_at = following
        if windows:
            row.last_window_at = windows[-1]


def _fire_window(core: Core, spec: Schedule, row: ScheduleRow, window: datetime) -> FiringRecord:
    run_id = schedule_run_id(spec.name, window)
    if core.store.get_run(run_id) is not None:
        return FiringRecord(spec.name, window, run_id, FiringOutcome.EXISTED)
    if spec.overlap == Overlap.SKIP and row.last_run_id:
        previous = core.store.get_run(row.last_run_id)
        if previous is not None and not previous.is_terminal:
            return FiringRecord(
                spec.name, window, run_id, FiringOutcome.SKIPPED, f"run {previous.run_id} is still {previous.status}"
            )
    try:
        core.start(spec.workflow, spec.input, run_id=run_id)
    except SingletonQueueFullError as exc:
        logger.warning("schedule %s: window %s rejected: %s", spec.name, window, exc)
        return FiringRecord(spec.name, window, run_id, FiringOutcome.REJECTED, str(exc))
    except DurableSingletonError as exc:
        logger.warning("schedule %s: window %s failed to start: %s", spec.name, window, exc)
        return FiringRecord(spec.name, window, run_id, FiringOutcome.FAILED, f"{type(exc).__name__}: {exc}")
    row.last_run_id = run_id
    return FiringRecord(spec.name, window, run_id, FiringOutcome.STARTED)


# -- operator actions ----------------------------------------------------------
def pause_schedule(core: Core, name: str) -> None:
    """Pause schedule ``name``: no window fires until it is resumed.

    Raises :class:`ValidationError` if there is no such schedule.
    """
    _set_paused(core, name, True)


def resume_schedule(core: Core, name: str) -> None:
    """Resume schedule ``name``: the windows that passed while it was paused are
    due, and the next tick fires them as its catch-up policy says (S17):
    ``"latest"`` the newest, ``"all"`` at most ``catch_up_limit`` newest,
    ``"none"`` only one at most ``grace`` seconds old; the others are recorded
    as missed.

    Raises :class:`ValidationError` if there is no such schedule.
    """
    _set_paused(core, name, False)


def _set_paused(core: Core, name: str, paused: bool) -> None:
    states = schedule_store_for(core.store)
    _sync(core, states, core.caller_now())
    if not states.set_paused(name, paused, core.caller_now()):
        raise ValidationError(f"no schedule named {name!r}")
