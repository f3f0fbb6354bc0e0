"""Schedules: a workflow started once per window of an interval or a cron
expression (S17, S16).

A schedule is declared in code on a workflow (``@workflow(...,
schedules=[Schedule(...)])``) or kept as a row an operator manages in the
admin. Either way its state lives in one row
(:class:`~durable_singleton.models.ScheduleState`): the next window not yet
fired and whether it is paused. The tick calls :func:`fire_due_schedules`,
which takes each due schedule under its row lock, decides which windows to
fire (the catch-up policy), starts one run per window with the deterministic
run id ``schedule:<name>:<window>`` (idempotent by run id, R3), records each
window's outcome (:class:`~durable_singleton.models.ScheduleFiring`) and
moves the cursor past ``now`` in the same transaction. Two ticks on two
machines fire a window once: the second finds the cursor moved.

Windows of an interval schedule are aligned to the Unix epoch (``every=300``
fires at :00, :05, ...); windows of a cron schedule are computed by croniter
in the schedule's time zone.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .exceptions import DurableSingletonError, InvalidWorkflowError, SingletonQueueFullError, ValidationError

if TYPE_CHECKING:
    from croniter import croniter

    from .engine import Engine

__all__ = [
    "CatchUp",
    "FiringOutcome",
    "Overlap",
    "Schedule",
    "ScheduleReport",
    "fire_due_schedules",
    "pause_schedule",
    "resume_schedule",
    "schedule_run_id",
]

logger = logging.getLogger("durable_singleton")

SCHEDULE_NAME_MAX_LENGTH = 100
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A cron expression whose missed windows are counted one by one stops counting here.
_COUNT_BOUND = 10_000


class Overlap(enum.StrEnum):
    """What a window does while the schedule's previous run is still active (S17)."""

    ALLOW = "allow"  # start it anyway (a singleton key then queues it)
    SKIP = "skip"  # record the window as skipped, start nothing


class CatchUp(enum.StrEnum):
    """Which windows fire when the tick reaches several due windows at once
    (the tick was down, or the schedule lagged)."""

    NONE = "none"  # only a window at most ``grace`` seconds old; older ones are missed
    LATEST = "latest"  # the newest due window, however old; older ones are missed
    ALL = "all"  # every due window, oldest first, at most ``catch_up_limit`` (the newest ones)


class FiringOutcome(enum.StrEnum):
    """What became of one window (a :class:`~durable_singleton.models.ScheduleFiring`)."""

    STARTED = "started"  # a run was created for the window
    EXISTED = "existed"  # the window's run already existed (R3): nothing new
    SKIPPED = "skipped"  # overlap="skip" and the previous run was still active
    REJECTED = "rejected"  # the key's queue cap refused the start (S15, S16)
    MISSED = "missed"  # dropped by the catch-up policy (one record for a stretch of windows)
    FAILED = "failed"  # the start raised another typed error (unknown workflow, bad key)


@dataclass(frozen=True)
class Schedule:
    """A schedule of one workflow (S17).

    ``name``: unique across the project, at most 100 characters of letters,
    digits and ``_.:-``; it is part of every window's run id.
    ``every``: the interval in whole seconds (>= 1), windows aligned to the
    Unix epoch; or ``cron``: a five-field cron expression evaluated in
    ``timezone`` (an IANA name, default ``"UTC"``). Exactly one of the two.
    ``input``: the JSON input of every run.
    ``overlap``: ``"allow"`` or ``"skip"`` (:class:`Overlap`).
    ``catch_up``: ``"none"``, ``"latest"`` (default) or ``"all"``
    (:class:`CatchUp`); ``catch_up_limit`` bounds ``"all"`` (default 10);
    ``grace``: seconds a window may be late and still fire under ``"none"``.
    ``workflow`` is filled in by the workflow the schedule is declared on.

    :meth:`check` raises :class:`InvalidWorkflowError` naming the field.
    """

    name: str
    every: int | None = None
    cron: str | None = None
    timezone: str = "UTC"
    input: Any = None
    overlap: str = Overlap.ALLOW
    catch_up: str = CatchUp.LATEST
    catch_up_limit: int = 10
    grace: float = 60.0
    workflow: str = ""

    def check(self, workflow: str) -> Schedule:
        """Return this schedule validated and bound to ``workflow``.

        Raises :class:`InvalidWorkflowError` naming the workflow and the field.
        """
        where = f"schedules[{self.name!r}]"
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name) or len(self.name) > SCHEDULE_NAME_MAX_LENGTH:
            raise InvalidWorkflowError(
                workflow, f"{where}.name", f"must match [A-Za-z0-9][A-Za-z0-9_.:-]* within {SCHEDULE_NAME_MAX_LENGTH}"
            )
        if (self.every is None) == (self.cron is None):
            raise InvalidWorkflowError(workflow, where, "give exactly one of every= (seconds) or cron=")
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise InvalidWorkflowError(
                workflow, f"{where}.every", f"must be an int of seconds >= 1, got {self.every!r}"
            )
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise InvalidWorkflowError(workflow, f"{where}.timezone", f"unknown time zone {self.timezone!r}") from None
        if self.cron is not None:
            from croniter import croniter

            if not isinstance(self.cron, str) or not croniter.is_valid(self.cron) or len(self.cron.split()) != 5:
                raise InvalidWorkflowError(
                    workflow, f"{where}.cron", f"not a five-field cron expression: {self.cron!r}"
                )
        if self.overlap not in Overlap.__members__.values():
            raise InvalidWorkflowError(workflow, f"{where}.overlap", f"must be 'allow' or 'skip', got {self.overlap!r}")
        if self.catch_up not in CatchUp.__members__.values():
            raise InvalidWorkflowError(
                workflow, f"{where}.catch_up", f"must be 'none', 'latest' or 'all', got {self.catch_up!r}"
            )
        limit = self.catch_up_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidWorkflowError(workflow, f"{where}.catch_up_limit", f"must be an int >= 1, got {limit!r}")
        if isinstance(self.grace, bool) or not isinstance(self.grace, int | float) or self.grace < 0:
            raise InvalidWorkflowError(workflow, f"{where}.grace", f"must be seconds >= 0, got {self.grace!r}")
        from .context import to_json_value
        from .exceptions import InvalidInputError

        try:
            value = to_json_value(self.input, "schedule input")
        except InvalidInputError as exc:
            raise InvalidWorkflowError(workflow, f"{where}.input", str(exc)) from None
        del zone
        return replace(
            self,
            workflow=workflow,
            input=value,
            overlap=Overlap(self.overlap),
            catch_up=CatchUp(self.catch_up),
            grace=float(self.grace),
        )

    # -- windows -------------------------------------------------------------
    def first_window_at_or_after(self, moment: datetime) -> datetime:
        """Return the first window start >= ``moment`` (aware datetime, UTC)."""
        return self.next_window(moment - timedelta(microseconds=1))

    def next_window(self, after: datetime) -> datetime:
        """Return the first window start strictly after ``after`` (UTC)."""
        if self.every is not None:
            elapsed = (after - _EPOCH) // timedelta(seconds=self.every)
            return _EPOCH + timedelta(seconds=self.every * (elapsed + 1))
        found = self._cron_from(after).get_next(datetime)
        return found.astimezone(UTC)

    def due_windows(self, start: datetime, now: datetime, keep: int) -> tuple[list[datetime], int, datetime]:
        """Return (the newest ``keep`` windows in [start, now], how many older ones
        there were, the first window after ``now``), starting at the first window >= ``start``."""
        start = self.first_window_at_or_after(start)  # a cursor an operator set by hand
        if self.every is not None:
            step = timedelta(seconds=self.every)
            if start > now:
                return [], 0, start
            total = (now - start) // step + 1
            first_kept = max(0, total - keep)
            return [start + step * n for n in range(first_kept, total)], first_kept, start + step * total
        kept: list[datetime] = []
        older = 0
        window = start
        while window <= now:
            kept.append(window)
            if len(kept) > keep:
                kept.pop(0)
                older += 1
            if older >= _COUNT_BOUND:
                # A cron schedule stalled for very long: stop counting, keep the newest.
                window = self.next_window(now)
                kept = self._windows_before(window, now, keep)
                break
            window = self.next_window(window)
        return kept, older, window

    def _cron_from(self, start: datetime) -> croniter:
        """Return a croniter over ``cron`` in the schedule's time zone, from ``start``."""
        from croniter import croniter

        # check() refuses a schedule with neither or both of every= and cron=.
        assert self.cron is not None, "a schedule without every= has a cron expression"
        return croniter(self.cron, start.astimezone(ZoneInfo(self.timezone)))

    def _windows_before(self, after_now: datetime, now: datetime, keep: int) -> list[datetime]:
        it = self._cron_from(after_now)
        found: list[datetime] = []
        while len(found) < keep:
            prev = it.get_prev(datetime).astimezone(UTC)
            if prev > now:
                continue
            found.append(prev)
        return sorted(found)

    @property
    def timing(self) -> str:
        """Describe when it fires, e.g. ``every 300 s`` or ``cron 0 3 * * * (Europe/Paris)``."""
        if self.every is not None:
            return f"every {self.every} s"
        return f"cron {self.cron} ({self.timezone})"


def schedule_run_id(name: str, window: datetime) -> str:
    """Return the run id of ``name``'s window starting at ``window`` (S17): deterministic,
    so every tick on every machine starts the same run (R3)."""
    return f"schedule:{name}:{window.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


@dataclass
class ScheduleReport:
    """What :func:`fire_due_schedules` did: window outcomes by run id."""

    outcomes: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# -- state -------------------------------------------------------------------
@dataclass
class ScheduleRow:
    """A schedule's stored state, as the store hands it to the firing code."""

    spec: Schedule
    source: str
    paused: bool
    next_fire_at: datetime | None
    last_window_at: datetime | None = None
    last_run_id: str | None = None


@dataclass(frozen=True)
class FiringRecord:
    """One window's outcome, as stored (:class:`~durable_singleton.models.ScheduleFiring`)."""

    schedule: str
    window_at: datetime
    run_id: str
    outcome: str
    detail: str = ""


class ScheduleStore:
    """Where schedule state lives; :func:`schedule_store_for` picks one for an engine's store."""

    def sync_declared(self, specs: Sequence[Schedule], now: datetime) -> None:
        """Create a row for each code-declared schedule, or update its spec if it changed."""
        raise NotImplementedError

    def due(self, now: datetime, batch: int) -> list[str]:
        """Return the names of at most ``batch`` unpaused schedules due by ``now``, oldest first."""
        raise NotImplementedError

    def locked(self, name: str, now: datetime) -> Any:
        """Context manager: yield the row of ``name`` under its lock if it is still due, else None;
        what the body sets on the row (and :meth:`record`) is saved on exit."""
        raise NotImplementedError

    def record(self, firing: FiringRecord) -> None:
        """Store one window's outcome (at most one per schedule and window)."""
        raise NotImplementedError

    def set_paused(self, name: str, paused: bool, now: datetime) -> bool:
        """Pause or resume ``name``; resuming moves the cursor to the first window >= ``now``.
        Return False if there is no such schedule."""
        raise NotImplementedError

    def firings(self, name: str) -> list[FiringRecord]:
        """Return the recorded window outcomes of ``name``, oldest window first."""
        raise NotImplementedError

    def get(self, name: str) -> ScheduleRow | None:
        """Return the row of ``name``, or None."""
        raise NotImplementedError


class MemoryScheduleStore(ScheduleStore):
    """Schedule state for the in-memory store: one lock for all schedules."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rows: dict[str, ScheduleRow] = {}
        self._firings: dict[tuple[str, datetime], FiringRecord] = {}

    def sync_declared(self, specs: Sequence[Schedule], now: datetime) -> None:
        with self._lock:
            for spec in specs:
                row = self._rows.get(spec.name)
                if row is None:
                    self._rows[spec.name] = ScheduleRow(spec, "code", False, spec.first_window_at_or_after(now))
                elif row.spec != spec:
                    timing_changed = (row.spec.every, row.spec.cron, row.spec.timezone) != (
                        spec.every,
                        spec.cron,
                        spec.timezone,
                    )
                    row.spec = spec
                    if timing_changed:
                        row.next_fire_at = spec.first_window_at_or_after(now)

    def due(self, now: datetime, batch: int) -> list[str]:
        with self._lock:
            due = [r for r in self._rows.values() if not r.paused and r.next_fire_at and r.next_fire_at <= now]
            due.sort(key=lambda r: (r.next_fire_at, r.spec.name))
            return [r.spec.name for r in due[:batch]]

    @contextmanager
    def locked(self, name: str, now: datetime) -> Iterator[ScheduleRow | None]:
        with self._lock:
            row = self._rows.get(name)
            if row is None or row.paused or row.next_fire_at is None or row.next_fire_at > now:
                yield None
                return
            work = replace(row)
            yield work
            self._rows[name] = work

    def record(self, firing: FiringRecord) -> None:
        with self._lock:
            self._firings.setdefault((firing.schedule, firing.window_at), firing)

    def set_paused(self, name: str, paused: bool, now: datetime) -> bool:
        with self._lock:
            row = self._rows.get(name)
            if row is None:
                return False
            if row.paused and not paused:
                row.next_fire_at = row.spec.first_window_at_or_after(now)
            row.paused = paused
            return True

    def firings(self, name: str) -> list[FiringRecord]:
        with self._lock:
            return sorted((f for (n, _), f in self._firings.items() if n == name), key=lambda f: f.window_at)

    def get(self, name: str) -> ScheduleRow | None:
        with self._lock:
            row = self._rows.get(name)
            return replace(row) if row is not None else None


_stores: weakref.WeakKeyDictionary[Any, ScheduleStore] = weakref.WeakKeyDictionary()
_stores_lock = threading.Lock()


def schedule_store_for(store: Any) -> ScheduleStore:
    """Return the schedule state store that goes with run store ``store``.

    A store wrapping another (``inner``, as the codec store does) shares its
    inner store's schedules, and a codec store's codec encodes their inputs
    (S13). A store with a database alias (``db``) keeps schedules in the
    database; any other keeps them in memory beside it.
    """
    codec = getattr(store, "codec", None)
    while getattr(store, "inner", None) is not None:
        store = store.inner
    with _stores_lock:
        found = _stores.get(store)
        if found is None:
            if getattr(store, "db", None) is not None:
                from .schedule_store import DjangoScheduleStore

                found = DjangoScheduleStore(store, codec)
            else:
                found = MemoryScheduleStore()
            _stores[store] = found
        return found


def declared_schedules(engine: Engine) -> list[Schedule]:
    """Return the schedules declared in code on the engine's registered workflows (latest versions)."""
    found: list[Schedule] = []
    for definition in list(engine.registry.latest.values()):
        found.extend(getattr(definition, "schedules", ()))
    return found


def _sync(engine: Engine, states: ScheduleStore, now: datetime) -> None:
    """Write code-declared schedules to their rows: one read when nothing changed, so a
    row deleted behind the process's back is declared again at the next tick."""
    specs = declared_schedules(engine)
    if specs:
        states.sync_declared(specs, now)


# -- firing ------------------------------------------------------------------
def fire_due_schedules(engine: Engine, now: datetime, batch: int) -> ScheduleReport:
    """Fire the windows of at most ``batch`` due schedules (S17, S8b).

    Each schedule is fired under its row lock: the windows due by ``now`` are
    chosen by its catch-up policy, each is started with its deterministic run
    id (S16: the queue cap applies; a rejected window is recorded), and the
    cursor moves past ``now``. Errors of one schedule are logged and skipped;
    this function never raises. Returns what it did.
    """
    report = ScheduleReport()
    try:
        states = schedule_store_for(engine.store)
        _sync(engine, states, now)
        names = states.due(now, batch)
    except Exception as exc:  # the tick goes on without schedules this time (S8b)
        logger.exception("schedules: could not read due schedules")
        report.errors.append(f"*: {exc}")
        return report
    for name in names:
        try:
            _fire_one(engine, states, name, now, report)
        except Exception as exc:  # one bad schedule must not stop the others (S8b)
            logger.exception("schedule %s: firing failed", name)
            report.errors.append(f"{name}: {exc}")
    return report


def _fire_one(engine: Engine, states: ScheduleStore, name: str, now: datetime, report: ScheduleReport) -> None:
    with states.locked(name, now) as row:
        if row is None:
            return  # fired by a racing tick, paused, or removed meanwhile
        spec = row.spec
        assert row.next_fire_at is not None
        keep = spec.catch_up_limit if spec.catch_up == CatchUp.ALL else 1
        windows, older, following = spec.due_windows(row.next_fire_at, now, keep)
        missed_from = row.next_fire_at if older else None
        if spec.catch_up == CatchUp.NONE and windows and (now - windows[-1]).total_seconds() > spec.grace:
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
                )
            )
        for window in windows:
            record = _fire_window(engine, spec, row, window)
            states.record(record)
            report.outcomes[record.run_id] = record.outcome
        row.next_fire_at = following
        if windows:
            row.last_window_at = windows[-1]


def _fire_window(engine: Engine, spec: Schedule, row: ScheduleRow, window: datetime) -> FiringRecord:
    run_id = schedule_run_id(spec.name, window)
    if engine.store.get_run(run_id) is not None:
        return FiringRecord(spec.name, window, run_id, FiringOutcome.EXISTED)
    if spec.overlap == Overlap.SKIP and row.last_run_id:
        previous = engine.store.get_run(row.last_run_id)
        if previous is not None and not previous.is_terminal:
            return FiringRecord(
                spec.name, window, run_id, FiringOutcome.SKIPPED, f"run {previous.run_id} is still {previous.status}"
            )
    try:
        engine.start(spec.workflow, spec.input, run_id=run_id)
    except SingletonQueueFullError as exc:
        logger.warning("schedule %s: window %s rejected: %s", spec.name, window, exc)
        return FiringRecord(spec.name, window, run_id, FiringOutcome.REJECTED, str(exc))
    except DurableSingletonError as exc:
        logger.warning("schedule %s: window %s failed to start: %s", spec.name, window, exc)
        return FiringRecord(spec.name, window, run_id, FiringOutcome.FAILED, f"{type(exc).__name__}: {exc}")
    row.last_run_id = run_id
    return FiringRecord(spec.name, window, run_id, FiringOutcome.STARTED)


# -- operator actions ----------------------------------------------------------
def pause_schedule(engine: Engine, name: str) -> None:
    """Pause schedule ``name``: no window fires until it is resumed.

    Raises :class:`ValidationError` if there is no such schedule.
    """
    _set_paused(engine, name, True)


def resume_schedule(engine: Engine, name: str) -> None:
    """Resume schedule ``name``; windows that passed while it was paused are not fired,
    the next one is the first window at or after now.

    Raises :class:`ValidationError` if there is no such schedule.
    """
    _set_paused(engine, name, False)


def _set_paused(engine: Engine, name: str, paused: bool) -> None:
    states = schedule_store_for(engine.store)
    _sync(engine, states, engine.now())
    if not states.set_paused(name, paused, engine.now()):
        raise ValidationError(f"no schedule named {name!r}")


def coerce_schedules(workflow: str, value: Sequence[Schedule] | Mapping[str, Any] | None) -> tuple[Schedule, ...]:
    """Return validated schedules bound to ``workflow``; raise :class:`InvalidWorkflowError`."""
    if value is None:
        return ()
    if isinstance(value, Schedule | Mapping | str):
        raise InvalidWorkflowError(workflow, "schedules", "must be a sequence of Schedule")
    out = []
    names = set()
    for item in value:
        if isinstance(item, Mapping):
            item = Schedule(**item)
        if not isinstance(item, Schedule):
            raise InvalidWorkflowError(workflow, "schedules", f"expected Schedule, got {type(item).__name__}")
        checked = item.check(workflow)
        if checked.name in names:
            raise InvalidWorkflowError(workflow, "schedules", f"duplicate schedule name {checked.name!r}")
        names.add(checked.name)
        out.append(checked)
    return tuple(out)
