"""The lanes of one workflow over the last minutes, for the admin's lanes page (issue #19).

One lane per busy key: the runs that held one of its slots in the window,
each a span from its admission (``admitted_at``, stamped by the claim) to its
end (``finished_at``; still open while it holds the slot, S6), and the key's
waiters in admission order with their positions (S5 step 3). Admissions are
the spans' starts; a handoff is a release followed by the admission of a run
that was already waiting when the slot freed (S7). Nothing here writes.

Bounded whatever the history: the busy keys are the queue table's
(:func:`~durable_singleton.queues.queue_table`, at most ``max_keys``), their
first waiters :func:`~durable_singleton.queues.queue_members`, and the spans
one query of at most ``max_spans`` rows; five queries in all. A span still
held by a run whose lease was not renewed for longer than the renewal
interval carries that lease (:func:`~durable_singleton.renewals.lease_state`, K3).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.db.models import Q
from django.db.models.functions import Coalesce

from .admission import holds_slot, holds_slot_q, limit_in_force
from .conf import Settings
from .definitions import Registry, registry
from .exceptions import InvalidInputError
from .models import Run
from .queues import QueueRow, queue_members, queue_table, singleton_options
from .renewals import LeaseState, lease_state
from .statuses import SlotState

__all__ = [
    "DEFAULT_MINUTES",
    "MAX_MINUTES",
    "Handoff",
    "Hold",
    "Lane",
    "Lanes",
    "window_minutes",
    "workflow_lanes",
]

#: A release and the admission it led to can be stamped by two clocks of different precision
#: (SQLite's CURRENT_TIMESTAMP has milliseconds, the store's ``now()`` microseconds): spans that
#: overlap by less than this are drawn one after the other.
_PRECISION = timedelta(milliseconds=1)

#: The window shown when none is asked for, and the longest one, in minutes.
DEFAULT_MINUTES = 10
MAX_MINUTES = 60


@dataclass(frozen=True)
class Hold:
    """A run's time in a slot: from ``start`` (its admission) to ``end`` (None: it holds now).

    ``slot`` is the row of the lane it is drawn on (0-based): spans on one
    row never overlap, so a key with limit 2 needs at most 2 rows (more only
    when a lowered limit or an older release left extra holders, S12).
    ``unrenewed``: the lease of a holder not renewed for longer than the
    renewal interval (K3), else None.
    """

    run_id: str
    status: str
    created_at: datetime
    start: datetime
    end: datetime | None
    slot: int = 0
    unrenewed: LeaseState | None = None

    def seconds(self, now: datetime) -> float:
        """Return how long the run held (or has held until ``now``) its slot, in seconds."""
        return max(((self.end or now) - self.start).total_seconds(), 0.0)


@dataclass(frozen=True)
class Handoff:
    """The slot ``released_by`` freed at ``released_at`` went to ``admitted``, waiting by then (S7)."""

    released_by: str
    admitted: str
    released_at: datetime
    admitted_at: datetime
    from_slot: int
    to_slot: int

    @property
    def gap_seconds(self) -> float:
        """Return the seconds between the release and the admission."""
        return max((self.admitted_at - self.released_at).total_seconds(), 0.0)


@dataclass(frozen=True)
class Lane:
    """One key: its limit in force (K2), whether it is paused, its spans, handoffs and waiters."""

    key: str
    limit: int
    paused: bool
    holds: list[Hold]
    handoffs: list[Handoff]
    #: The first waiters' run ids in admission order: position ``i + 1`` is ``waiters[i]``.
    waiters: list[str]
    waiting: int
    holders: int
    #: Waiters a free slot of the key would admit but for a shared quota they carry (X3d).
    waiting_for_quota: int = 0

    @property
    def slots(self) -> int:
        """Return the rows the lane needs: its limit, or more if more spans overlapped."""
        return max([self.limit, *(h.slot + 1 for h in self.holds)])

    def admissions(self, since: datetime) -> list[Hold]:
        """Return the spans that began at or after ``since`` (the admissions in the window)."""
        return [h for h in self.holds if h.start >= since]


@dataclass(frozen=True)
class Lanes:
    """The lanes of ``workflow`` from ``start`` to ``now``."""

    workflow: str
    start: datetime
    now: datetime
    lanes: list[Lane]
    #: More busy keys than ``max_keys``: the busiest are shown.
    more_keys: bool = False
    #: More spans than ``max_spans`` in the window: the oldest are left out.
    spans_cut: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def minutes(self) -> float:
        """Return the window's length in minutes."""
        return (self.now - self.start).total_seconds() / 60


def window_minutes(value: object) -> int:
    """Return ``value`` as a window length in whole minutes, 1 to :data:`MAX_MINUTES`.

    Raises :class:`~durable_singleton.exceptions.InvalidInputError` for anything
    else (not a whole number, or out of bounds).
    """
    try:
        minutes = int(str(value))
    except ValueError:
        raise InvalidInputError(f"minutes must be a whole number from 1 to {MAX_MINUTES}, got {value!r}") from None
    if not 1 <= minutes <= MAX_MINUTES:
        raise InvalidInputError(f"minutes must be from 1 to {MAX_MINUTES}, got {minutes}")
    return minutes


def _assign_slots(holds: list[Hold]) -> list[Hold]:
    """Put each span on the lowest row free at its start (spans sorted by start)."""
    ends: list[datetime | None] = []
    placed = []
    for hold in holds:
        row = next((i for i, end in enumerate(ends) if end is not None and end <= hold.start + _PRECISION), len(ends))
        if row == len(ends):
            ends.append(hold.end)
        else:
            ends[row] = hold.end
        placed.append(replace(hold, slot=row))
    return placed


def _handoffs(holds: list[Hold]) -> list[Handoff]:
    """Pair each admission with the latest earlier release of the lane whose slot it took: a run
    that was waiting (created) by the time the slot freed. Each release hands off at most once."""
    released = sorted((h for h in holds if h.end is not None), key=lambda h: h.end or h.start)
    used: set[str] = set()
    out = []
    for hold in sorted(holds, key=lambda h: h.start):
        candidates = [
            r
            for r in released
            if r.run_id not in used
            and r.run_id != hold.run_id
            and r.end is not None
            and hold.created_at <= r.end <= hold.start + _PRECISION
        ]
        if not candidates:
            continue
        source = candidates[-1]
        used.add(source.run_id)
        assert source.end is not None
        out.append(Handoff(source.run_id, hold.run_id, source.end, hold.start, source.slot, hold.slot))
    return out


def workflow_lanes(
    workflow: str,
    *,
    now: datetime,
    minutes: int = DEFAULT_MINUTES,
    first_key: str | None = None,
    max_keys: int = 30,
    waiters_per_key: int = 12,
    max_spans: int = 2000,
    reg: Registry = registry,
    using: str | None = None,
    settings: Settings | None = None,
) -> Lanes:
    """Return the lanes of ``workflow`` over the ``minutes`` before ``now`` (the store's clock).

    With ``settings``, each span still held by a run whose lease was not
    renewed for longer than the renewal interval at ``now`` (then the
    database's clock, R5) carries it (``Hold.unrenewed``, K3).

    Lanes are the keys with active runs (the ``max_keys`` with most waiters
    when there are more), then keys that held a slot in the window, up to
    ``max_keys`` in all, each group in key order; ``first_key`` comes first
    whenever it has a lane. Each lists its spans in the window, its first
    ``waiters_per_key`` waiters, its counts and its limit in force (K2; the
    declared limit for a key without active runs).

    Raises :class:`~durable_singleton.exceptions.InvalidInputError` if
    ``minutes`` is not 1 to :data:`MAX_MINUTES` or a bound is below 1.
    """
    minutes = window_minutes(minutes)
    if min(max_keys, waiters_per_key, max_spans) < 1:
        raise InvalidInputError("max_keys, waiters_per_key and max_spans must be >= 1")
    start = now - timedelta(minutes=minutes)
    busy = queue_table(workflow=workflow, sort="-waiting", limit=max_keys + 1, reg=reg, using=using)
    rows: dict[str, QueueRow] = {row.key: row for row in busy.rows[:max_keys]}
    more = busy.keys > max_keys
    runs = Run.objects.using(using) if using else Run.objects.all()
    spans = list(
        runs.filter(workflow_name=workflow, singleton_key__isnull=False)
        .filter(holds_slot_q() | Q(admitted_at__isnull=False, finished_at__gte=start))
        .annotate(began=Coalesce("admitted_at", "started_at", "created_at"))
        .order_by("-began", "-run_id")
        .values_list(
            "run_id",
            "singleton_key",
            "status",
            "created_at",
            "began",
            "finished_at",
            "singleton_slot",
            "singleton_tracked",
            "lease_owner",
            "lease_expires_at",
        )[: max_spans + 1]
    )
    cut = len(spans) > max_spans
    by_key: dict[str, list[Hold]] = {}
    for run_id, key, status, created_at, began, finished_at, slot, tracked, owner, expires in spans[:max_spans]:
        holding = holds_slot(status, key=key, admitted=slot == SlotState.HOLDER, tracked=tracked)
        end = None if holding else finished_at
        if end is None and not holding:
            continue  # admitted once, neither holding nor finished (handed back for a retry)
        lease = lease_state(status, owner, expires, settings=settings, now=now) if settings is not None else None
        unrenewed = lease if lease is not None and lease.unrenewed else None
        by_key.setdefault(str(key), []).append(Hold(run_id, status, created_at, began, end, unrenewed=unrenewed))
    order = sorted(rows)  # by key, so that a refresh does not reorder the lanes
    for key in sorted(by_key):
        if key not in rows and len(order) < max_keys:
            order.append(key)
        elif key not in rows:
            more = True
    if first_key is not None and first_key in order:
        order.remove(first_key)
        order.insert(0, first_key)
    members = queue_members(list(rows.values()), per_key=waiters_per_key, using=using)
    declared = singleton_options(reg).get(workflow)
    lanes = []
    for key in order:
        holds = _assign_slots(sorted(by_key.get(key, []), key=lambda h: (h.start, h.run_id)))
        row = rows.get(key)
        if row is not None:
            limit, paused = limit_in_force(row.limit, row.limit_override), row.paused
        else:
            limit, paused = (declared[0] if declared else 1), False
        lanes.append(
            Lane(
                key=key,
                limit=limit,
                paused=paused,
                holds=holds,
                handoffs=_handoffs(holds),
                waiters=members[workflow, key].waiters if row is not None else [],
                waiting=row.waiting if row is not None else 0,
                holders=row.holders if row is not None else 0,
                waiting_for_quota=row.waiting - row.waiting_for_key
                if row is not None and row.waiting_for_key is not None and row.free_slots > 0
                else 0,
            )
        )
    return Lanes(workflow=workflow, start=start, now=now, lanes=lanes, more_keys=more, spans_cut=cut)
