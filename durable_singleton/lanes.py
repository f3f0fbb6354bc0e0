"""The lanes of one workflow over the last minutes, for the admin's lanes page (issue #19).

One lane per busy key: the runs that held one of its slots in the window,
each a span from its admission (``admitted_at``, stamped by the claim) to its
end (``finished_at``; still open while it holds the slot, S6), and the key's
waiters in admission order with their positions (S5 step 3). Admissions are
the spans' starts; a handoff is a release followed by the admission of a run
that was already waiting when the slot freed (S7). Nothing here writes.

A shared quota's key has a lane too (X3, :func:`quota_lanes`; a workflow's
lanes end with the keys of the quotas it carries): its holders and waiters
are every workflow's that carries the quota. A membership keeps no time of
its own: a run is admitted when every limit it carries has room and takes a
slot in each at once (X3, X3h), and every store path that marks a membership
a holder stamps the run's ``admitted_at`` in the same transaction (the claim,
the handoff's grant, the PostgreSQL fast path's messages); a takeover keeps
it (K1, X3f) and a retry clears it with the slots (X3g, D9). So a quota
key's span is its run's, from ``admitted_at`` to ``finished_at``.

Bounded whatever the history: the busy keys are the queue table's
(:func:`~durable_singleton.queues.queue_table`, at most ``max_keys``), their
first waiters :func:`~durable_singleton.queues.queue_members`, and the spans
one query of at most ``max_spans`` rows; five queries in all, and four more
for the quota keys (:func:`~durable_singleton.queues.quota_table`'s two, the
spans, the first waiters with their counts by cause). A span still
held by a run whose lease was not renewed for longer than the renewal
interval carries that lease (:func:`~durable_singleton.renewals.lease_state`, K3).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Case, Count, F, Q, RowRange, Sum, Value, When, Window
from django.db.models.functions import Coalesce, RowNumber

from .admission import (
    QUOTA_ORDER,
    holds_quota_slot,
    holds_quota_slot_q,
    holds_slot,
    holds_slot_q,
    limit_in_force,
    order_expressions,
    quota_waiter_q,
)
from .conf import Settings
from .definitions import Registry, registry
from .exceptions import InvalidInputError
from .models import QuotaMembership, Run
from .querysets import DbNow
from .queues import (
    Cause,
    QueueRow,
    QuotaRow,
    queue_members,
    queue_table,
    quota_slot_cause,
    quota_table,
    quota_workflows,
    singleton_options,
)
from .renewals import LeaseState, lease_state
from .statuses import SlotState

__all__ = [
    "DEFAULT_MINUTES",
    "MAX_MINUTES",
    "Handoff",
    "Hold",
    "Lane",
    "Lanes",
    "Member",
    "quota_lanes",
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
class Member:
    """A run drawn in a shared quota key's lane (X3): its workflow, its own singleton key
    (None: it has none) and, for a waiter, why it waits (X3d,
    :func:`~durable_singleton.queues.quota_slot_cause`; None for a holder)."""

    workflow: str
    singleton_key: str | None
    cause: Cause | None = None


@dataclass(frozen=True)
class Lane:
    """One key: its limit in force (K2), whether it is paused, its spans, handoffs and waiters.

    A shared quota key's lane (``quota`` set, X3) draws every workflow's runs that
    carry the quota: ``members`` says whose each drawn run is and why each drawn
    waiter waits; ``causes`` counts the key's due waiters by cause (positions past
    its free slots wait for the quota; those within them for their own key or a
    worker, X3d), ``not_due`` its delayed starts not due yet (X5)."""

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
    #: Waiters parked over a throttle's rate until its window opens (X6d).
    throttled: int = 0
    #: The shared quota whose key this is (X3); None: a singleton key of the workflow.
    quota: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    causes: dict[Cause, int] = field(default_factory=dict)
    not_due: int = 0

    @property
    def due(self) -> int:
        """Return the waiters in line now: ``waiting`` less those not due yet (X5)."""
        return self.waiting - self.not_due

    @property
    def slots(self) -> int:
        """Return the rows the lane needs: its limit, or more if more spans overlapped."""
        return max([self.limit, *(h.slot + 1 for h in self.holds)])

    def admissions(self, since: datetime) -> list[Hold]:
        """Return the spans that began at or after ``since`` (the admissions in the window)."""
        return [h for h in self.holds if h.start >= since]


@dataclass(frozen=True)
class Lanes:
    """The lanes of ``workflow`` (or, with ``quota``, of that shared quota's keys) from ``start`` to ``now``."""

    workflow: str
    start: datetime
    now: datetime
    lanes: list[Lane]
    #: The shared quota the lanes were narrowed to (:func:`quota_lanes`); None: a workflow's.
    quota: str | None = None
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


def _window_start(now: datetime, minutes: object, *bounds: int) -> datetime:
    """Return the start of the window of ``minutes`` before ``now``, once ``minutes``
    (1 to :data:`MAX_MINUTES`) and every bound (at least 1) are checked.

    Raises :class:`~durable_singleton.exceptions.InvalidInputError` otherwise.
    """
    whole = window_minutes(minutes)
    if min(bounds) < 1:
        raise InvalidInputError("max_keys, waiters_per_key and max_spans must be >= 1")
    return now - timedelta(minutes=whole)


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
    start = _window_start(now, minutes, max_keys, waiters_per_key, max_spans)
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
                waiting_for_quota=row.waiting_for_quota if row is not None else 0,
                throttled=row.throttled if row is not None else 0,
            )
        )
    # Then the keys of the shared quotas its runs carry, every workflow's runs on them (X3).
    quotas = quota_workflows(reg).get(workflow, ())
    shared, more_quota, cut_quota = _quota_lanes(
        quotas,
        now=now,
        start=start,
        first_key=None,
        max_keys=max_keys,
        waiters_per_key=waiters_per_key,
        max_spans=max_spans,
        reg=reg,
        using=using,
        settings=settings,
    )
    return Lanes(
        workflow=workflow,
        start=start,
        now=now,
        lanes=lanes + shared,
        more_keys=more or more_quota,
        spans_cut=cut or cut_quota,
    )


def quota_lanes(
    quota: str,
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
    """Return the lanes of shared quota ``quota``'s keys over the ``minutes`` before ``now``
    (the store's clock), each with every workflow's holders and first waiters (X3, X3d).

    As :func:`workflow_lanes` does for a workflow's keys: the keys with active members
    (the ``max_keys`` with most waiters when there are more), then keys that held a slot
    in the window, up to ``max_keys`` in all, each group in key order; ``first_key``
    first. A span is its run's, from ``admitted_at`` (the admission in every limit at
    once, X3) to ``finished_at``; waiters are the due ones in the quota's admission
    order (``admission.QUOTA_ORDER``), each with its cause. The
    limit is the key's in force (K2), the declared ``Quota.limit`` for a key without
    active members, 1 for a quota this process does not declare. Four queries.

    Raises :class:`~durable_singleton.exceptions.InvalidInputError` if
    ``minutes`` is not 1 to :data:`MAX_MINUTES` or a bound is below 1.
    """
    start = _window_start(now, minutes, max_keys, waiters_per_key, max_spans)
    lanes, more, cut = _quota_lanes(
        (quota,),
        now=now,
        start=start,
        first_key=first_key,
        max_keys=max_keys,
        waiters_per_key=waiters_per_key,
        max_spans=max_spans,
        reg=reg,
        using=using,
        settings=settings,
    )
    return Lanes(workflow="", quota=quota, start=start, now=now, lanes=lanes, more_keys=more, spans_cut=cut)


def _quota_lanes(
    names: tuple[str, ...] | list[str],
    *,
    now: datetime,
    start: datetime,
    first_key: str | None,
    max_keys: int,
    waiters_per_key: int,
    max_spans: int,
    reg: Registry,
    using: str | None,
    settings: Settings | None,
) -> tuple[list[Lane], bool, bool]:
    """Return the lanes of the keys of quotas ``names`` from ``start`` to ``now``, whether
    more keys than ``max_keys`` had some, and whether spans were left out (``max_spans``):
    no query without a name, else four (the busy keys and their controls, the spans,
    the first waiters)."""
    quotas = sorted(set(names))
    if not quotas:
        return [], False, False
    busy = quota_table(limit=max_keys + 1, quotas=quotas, reg=reg, using=using)
    rows: dict[tuple[str, str], QuotaRow] = {(r.quota, r.key): r for r in busy[:max_keys]}
    more = len(busy) > max_keys
    memberships = (QuotaMembership.objects.using(using) if using else QuotaMembership.objects.all()).filter(
        quota__in=quotas
    )
    # Every membership that holds a slot, and every one whose run was admitted and ended in the
    # window: the run's admission is the membership's (X3), its end the release of all its slots (X3g).
    spans = list(
        memberships.filter(holds_quota_slot_q() | Q(run__admitted_at__isnull=False, run__finished_at__gte=start))
        .annotate(began=Coalesce("run__admitted_at", "run__started_at", "run__created_at"))
        .order_by("-began", "-run_id")
        .values_list(
            "quota",
            "key",
            "run_id",
            "slot",
            "run__workflow_name",
            "run__singleton_key",
            "run__status",
            "run__created_at",
            "began",
            "run__finished_at",
            "run__lease_owner",
            "run__lease_expires_at",
        )[: max_spans + 1]
    )
    cut = len(spans) > max_spans
    by_key: dict[tuple[str, str], list[Hold]] = {}
    members: dict[tuple[str, str], dict[str, Member]] = {}
    for quota, key, run_id, slot, workflow, own_key, status, created_at, began, finished_at, owner, expires in spans[
        :max_spans
    ]:
        holding = holds_quota_slot(status, slot)
        end = None if holding else finished_at
        if end is None and not holding:
            continue  # admitted once, neither holding nor finished (back in line for a retry)
        lease = lease_state(status, owner, expires, settings=settings, now=now) if settings is not None else None
        unrenewed = lease if lease is not None and lease.unrenewed else None
        by_key.setdefault((quota, key), []).append(
            Hold(str(run_id), status, created_at, began, end, unrenewed=unrenewed)
        )
        members.setdefault((quota, key), {})[str(run_id)] = Member(workflow, own_key)
    order = sorted(rows)
    for pair in sorted(by_key):
        if pair not in rows and len(order) < max_keys:
            order.append(pair)
        elif pair not in rows:
            more = True
    focus = next((pair for pair in order if pair[1] == first_key), None) if first_key is not None else None
    if focus is not None:
        order.remove(focus)
        order.insert(0, focus)
    waiters, causes = _quota_waiters(memberships, rows, waiters_per_key)
    declared = {q.name: q.limit for q in list(reg.quotas.values())}
    lanes = []
    for pair in order:
        quota, key = pair
        holds = _assign_slots(sorted(by_key.get(pair, []), key=lambda h: (h.start, h.run_id)))
        row = rows.get(pair)
        drawn = waiters.get(pair, [])
        due = causes.get(pair, {})
        lanes.append(
            Lane(
                key=key,
                quota=quota,
                limit=row.limit if row is not None else declared.get(quota, 1),
                paused=row.paused if row is not None else False,
                holds=holds,
                handoffs=_handoffs(holds),
                waiters=[run_id for run_id, _ in drawn],
                waiting=row.waiting if row is not None else 0,
                holders=row.holders if row is not None else 0,
                members={**members.get(pair, {}), **dict(drawn)},
                causes={cause: n for cause, n in due.items() if n},
                not_due=(row.waiting - sum(due.values())) if row is not None else 0,
            )
        )
    return lanes, more, cut


def _quota_waiters(
    memberships: Any, rows: dict[tuple[str, str], QuotaRow], per_key: int
) -> tuple[dict[tuple[str, str], list[tuple[str, Member]]], dict[tuple[str, str], dict[Cause, int]]]:
    """Return the first ``per_key`` due waiters of each quota key of ``rows`` in the quota's
    admission order (``admission.QUOTA_ORDER``, X3d, X5 on the
    database's clock) with their causes, and each key's due waiters counted by cause,
    in one query whatever the queues' lengths.

    Each waiter is numbered in its key, and a running sum counts the waiters of their own
    singleton key up to it: read at position ``min(free slots, due waiters)``, it splits
    the waiters within the free slots between their own key and a worker, as
    :func:`~durable_singleton.queues.quota_slot_cause` judges each; the others wait for
    the quota."""
    drawn: dict[tuple[str, str], list[tuple[str, Member]]] = {}
    counts: dict[tuple[str, str], dict[Cause, int]] = {}
    if not rows:
        return drawn, counts
    chosen = Q()
    for quota, key in sorted(rows):
        chosen |= Q(quota=quota, key=key)
    reach = Q(place__lte=per_key) | Q(place=F("due"))
    for (quota, key), row in sorted(rows.items()):
        if row.free_slots > 0:
            reach |= Q(quota=quota, key=key, place=row.free_slots)
    partition = [F("quota"), F("key")]
    order = order_expressions(QUOTA_ORDER)
    keyed = Case(When(run__singleton_slot=SlotState.WAITER, then=Value(1)), default=Value(0))
    numbered = (
        memberships.filter(chosen)
        .filter(quota_waiter_q(DbNow()))
        .annotate(
            place=Window(RowNumber(), partition_by=partition, order_by=order),
            due=Window(Count("pk"), partition_by=partition),
            keyed_before=Window(Sum(keyed), partition_by=partition, order_by=order, frame=RowRange(None, 0)),
        )
        .filter(reach)
    )
    found: dict[tuple[str, str], dict[int, int]] = {}
    totals: dict[tuple[str, str], int] = {}
    for quota, key, place, due, keyed_before, run_id, workflow, own_key, own_slot in numbered.order_by(
        "quota", "key", "place"
    ).values_list(
        "quota",
        "key",
        "place",
        "due",
        "keyed_before",
        "run_id",
        "run__workflow_name",
        "run__singleton_key",
        "run__singleton_slot",
    ):
        pair = (quota, key)
        totals[pair] = int(due)
        found.setdefault(pair, {})[int(place)] = int(keyed_before or 0)  # SUM is a decimal on MariaDB
        if place <= per_key:
            cause = quota_slot_cause(own_slot, place, rows[pair].free_slots)
            drawn.setdefault(pair, []).append((str(run_id), Member(workflow, own_key, cause)))
    for pair, due in totals.items():
        within = min(rows[pair].free_slots, due)
        for_key = found[pair].get(within, 0) if within else 0
        counts[pair] = {
            Cause.NEEDS_QUOTA: due - within,
            Cause.NEEDS_KEY: for_key,
            Cause.NEEDS_WORKER: within - for_key,
        }
    return drawn, counts
