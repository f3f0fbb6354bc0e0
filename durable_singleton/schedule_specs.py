"""Schedule declarations (S17): a :class:`Schedule` names a workflow's
windows (an interval or a cron expression), what a window does while the
previous run is active (:class:`Overlap`) and which missed windows fire
(:class:`CatchUp`).

Pure rules: the windows of a schedule and the run id of a window. Firing
them is :mod:`durable_singleton.schedules`' (a service), keeping their state
is the store's (:meth:`~durable_singleton.stores.base.BaseStore.schedule_state`).

Windows of an interval schedule are aligned to the Unix epoch (``every=300``
fires at :00, :05, ...); windows of a cron schedule are computed by croniter
in the schedule's time zone.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .exceptions import InvalidInputError, InvalidWorkflowError
from .values import to_json_value

if TYPE_CHECKING:
    from croniter import croniter

__all__ = [
    "SCHEDULE_NAME_MAX_LENGTH",
    "CatchUp",
    "FiringOutcome",
    "Overlap",
    "Schedule",
    "coerce_schedules",
    "schedule_run_id",
]

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
