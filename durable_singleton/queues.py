"""Read-only views of the per-key queues, for the admin and ``manage.py durable_queues``.

Every figure comes from a bounded number of queries, whatever the number of
keys and runs: the queue table is one grouped query (its totals computed by
window functions in the same query) and one for the runtime controls of the
page's keys (K2), a key's page four.
The order of a key's waiters is the claim's order,
``Run.objects.for_key(...).waiting()``: higher priority first, then by
(``created_at``, ``run_id``) (S5, X8, ``admission.QUEUE_ORDER``),
and its holders are ``holders()``: admitted runs and untracked runs of an
older release (S12). Nothing here writes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import router
from django.db.models import (
    BooleanField,
    Case,
    Count,
    F,
    FloatField,
    Func,
    IntegerField,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
    Window,
)
from django.db.models.functions import Cast, Coalesce, RowNumber

from .admission import (
    ACTIVE_STATUSES,
    QUEUE_ORDER,
    QUOTA_ORDER,
    ahead_q,
    free_slots,
    free_slots_sql,
    holds_quota_slot_q,
    holds_slot,
    holds_slot_q,
    key_only_waiter_q,
    limit_in_force,
    limit_in_force_sql,
    order_expressions,
    queue_cap,
    queue_ttl_expires_at,
    quota_lock_name,
    quota_waiter_q,
    quota_waiting_q,
    throttle_lock_name,
)
from .definitions import Registry, registry
from .models import QuotaMembership, Run, SingletonKey, Step, ThrottleAdmission, ThrottleMembership
from .querysets import DbNow, database_now
from .statuses import PARKED_STATUSES, ParkReason, RunStatus, SlotState

__all__ = [
    "FILTERS",
    "SORTS",
    "Cause",
    "KeyMembers",
    "KeyQueue",
    "Place",
    "QueuePage",
    "QueueRow",
    "QueuedRun",
    "QuotaKeyQueue",
    "QuotaRow",
    "ThrottleKeyQueue",
    "ThrottleRow",
    "format_age",
    "holder_since",
    "key_queue",
    "queue_members",
    "queue_table",
    "queue_ttl_left",
    "queue_ttl_words",
    "quota_key_queue",
    "quota_places",
    "quota_slot_cause",
    "quota_table",
    "quota_waiter_cause",
    "quota_workflows",
    "run_cause",
    "run_place",
    "singleton_options",
    "throttle_key_queue",
    "throttle_table",
    "throttle_workflows",
    "throttled_until",
]

#: Sort names accepted by :func:`queue_table` (prefix ``-`` for descending).
SORTS = ("workflow", "key", "limit", "holders", "waiting", "oldest", "fullness", "active")
#: Row filters accepted by :func:`queue_table`.
FILTERS = {
    "": "all keys with active runs",
    "waiting": "keys with waiters",
    "full": "keys whose queue is at its cap",
    "stalled": "keys with a free slot and a waiter it alone admits (one without quotas)",
}

_HOLDER_Q = holds_slot_q()
_WAITER_Q = Q(singleton_slot=SlotState.WAITER)
_THROTTLED_Q = _WAITER_Q & Q(park_reason__startswith=ParkReason.THROTTLED.value, not_before__gt=DbNow())


def format_age(seconds: float | None) -> str:
    """Return ``seconds`` as a short age: ``4.2 s``, ``3 min 12 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if seconds is None:
        return "—"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def _fullness(active: int, capacity: int | None) -> float | None:
    """Active runs (or members) / capacity: 1.0 = starts are refused; None without a cap."""
    if capacity is None:
        return None
    return active / capacity if capacity else 1.0


@dataclass(frozen=True)
class QueueRow:
    """One workflow and key with active runs.

    ``limit`` is the limit in force (:func:`~durable_singleton.admission.limit_in_force`:
    the key's runtime override, K2, else ``declared_limit``, the registered
    definition's, or the stored limit when the workflow is not registered
    here); ``max_queue_depth`` comes from the registered definition;
    ``capacity`` is ``limit + max_queue_depth``, the number of active runs at
    which ``start`` refuses new ones (S15), or None for an unbounded queue.
    """

    workflow: str
    key: str
    limit: int
    holders: int
    waiting: int
    active: int
    oldest_waiter_at: datetime | None
    max_queue_depth: int | None
    paused: bool = False
    limit_override: int | None = None
    declared_limit: int | None = None
    #: The waiters that carry no quota (:func:`~durable_singleton.admission.key_only_waiter_q`):
    #: those a free slot of the key alone admits; None: not counted (all of ``waiting``).
    waiting_for_key: int | None = None
    #: The waiters parked over a throttle's rate until its window opens (X6d: park reason
    #: ``throttled:``, ``not_before`` after the database's now); they carry the quota marker.
    throttled: int = 0

    @property
    def waiting_for_quota(self) -> int:
        """Return the waiters a free slot of the key would admit but for a shared quota
        they carry (X3d): those that carry the quota marker, less the ones parked over a
        throttle's rate (:attr:`throttled`); 0 without a free slot or a count."""
        if self.waiting_for_key is None or self.free_slots <= 0:
            return 0
        return max(self.waiting - self.waiting_for_key - self.throttled, 0)

    @property
    def stalled(self) -> bool:
        """Tell whether the key has a free slot and a waiter that slot alone would
        admit (S8a): one that carries no quota. A waiter that carries quotas may
        wait for one of them (X3d), so a free slot beside it alone is not stalled."""
        waiting = self.waiting if self.waiting_for_key is None else self.waiting_for_key
        return waiting > 0 and self.free_slots > 0

    @property
    def capacity(self) -> int | None:
        """Return ``limit + max_queue_depth``, or None without a cap
        (:func:`~durable_singleton.admission.queue_cap`)."""
        return queue_cap(self.limit, self.max_queue_depth)

    @property
    def fullness(self) -> float | None:
        """Return active runs / capacity (1.0 = starts are refused), or None without a cap."""
        return _fullness(self.active, self.capacity)

    @property
    def free_slots(self) -> int:
        """Return the slots a waiter could take now: none while paused, else the
        limit in force minus the holders, never negative (:func:`~durable_singleton.admission.free_slots`)."""
        return free_slots(self.limit, self.holders, paused=self.paused)

    def oldest_wait_seconds(self, now: datetime) -> float | None:
        """Return how long the oldest waiter has waited at ``now``, in seconds."""
        if self.oldest_waiter_at is None:
            return None
        return max((now - self.oldest_waiter_at).total_seconds(), 0.0)

    def as_dict(self, now: datetime) -> dict[str, Any]:
        """Return the row as JSON-ready values (times in ISO 8601, ages in seconds)."""
        return {
            "workflow": self.workflow,
            "key": self.key,
            "limit": self.limit,
            "holders": self.holders,
            "waiting": self.waiting,
            "active": self.active,
            "oldest_waiter_at": self.oldest_waiter_at.isoformat() if self.oldest_waiter_at else None,
            "oldest_wait_seconds": self.oldest_wait_seconds(now),
            "max_queue_depth": self.max_queue_depth,
            "capacity": self.capacity,
            "fullness": self.fullness,
            "paused": self.paused,
            "limit_override": self.limit_override,
            "throttled": self.throttled,
        }


@dataclass(frozen=True)
class QueuePage:
    """A page of :class:`QueueRow` and the totals over every matching key."""

    rows: list[QueueRow]
    keys: int
    holders: int
    waiting: int


def singleton_options(reg: Registry = registry) -> dict[str, tuple[int, int | None]]:
    """Return ``{workflow: (limit, queue depth)}`` of the latest registered versions
    (the depth is ``max_queue_depth``, 0 under ``on_busy="skip"``, X1)."""
    return {
        name: (d.singleton.limit, d.singleton.queue_depth)
        for name, d in list(reg.latest.items())
        if d.singleton is not None
    }


def quota_workflows(reg: Registry = registry) -> dict[str, tuple[str, ...]]:
    """Return ``{workflow: quota names}`` of the latest registered versions that carry
    shared quotas (X3), a workflow with no singleton key among them."""
    return {name: tuple(q.name for q in d.quotas) for name, d in list(reg.latest.items()) if d.quotas}


def throttle_workflows(reg: Registry = registry) -> dict[str, tuple[str, ...]]:
    """Return ``{workflow: throttle names}`` of the latest registered versions that
    carry throttles (X6)."""
    return {name: tuple(t.name for t in d.throttles) for name, d in list(reg.latest.items()) if d.throttles}


def queue_ttl_left(run: Run, now: datetime, reg: Registry = registry) -> float | None:
    """Return the seconds waiter ``run`` has left before the tick ends it by its
    workflow's ``queue_ttl`` (X2) at ``now``, the database's clock (R5):
    negative once it passed. None when the workflow declares no ``queue_ttl``
    or the run is not a parked waiter of its key."""
    ttl = reg.queue_ttls().get(run.workflow_name)
    if ttl is None or run.singleton_slot != SlotState.WAITER or run.status not in PARKED_STATUSES:
        return None
    return (queue_ttl_expires_at(run.created_at, ttl) - now).total_seconds()


def queue_ttl_words(left: float | None) -> str:
    """Say :func:`queue_ttl_left` as the admin's pages do: ``expires in 12.0 s``, or
    that the next tick ends it (X2); empty for None."""
    if left is None:
        return ""
    if left > 0:
        return f"expires in {format_age(left)}"
    return "queue_ttl passed: the next tick ends it (queue_ttl_expired)"


def _by_workflow(options: dict[str, int], default: Any) -> Max:
    """Return ``MAX(CASE workflow_name WHEN ... END)``: a per-workflow constant as an aggregate,
    so that it stays out of the GROUP BY (MariaDB groups much slower on expressions)."""
    whens = [When(workflow_name=name, then=Value(value)) for name, value in options.items()]
    if not whens:
        # A CASE without a WHEN is its default alone, and a bare NULL is text on PostgreSQL:
        # "integer + text" broke the table when no registered workflow had a queue cap.
        return Max(Cast(default, output_field=IntegerField()))
    return Max(Case(*whens, default=default, output_field=IntegerField()))


def _grouped(options: dict[str, tuple[int, int | None]], using: str | None) -> QuerySet[Any]:
    runs = Run.objects.using(using) if using else Run.objects.all()
    # The key's runtime controls (K2), read beside its runs: the limit in force and the free slots.
    controls = SingletonKey.objects.using(using or router.db_for_read(SingletonKey)).filter(
        workflow_name=OuterRef("workflow_name"), key=OuterRef("singleton_key")
    )
    override = Subquery(controls.values("limit_override")[:1], output_field=IntegerField())
    paused = Subquery(controls.values("paused")[:1], output_field=BooleanField())
    declared = _by_workflow({name: lim for name, (lim, _depth) in options.items()}, Coalesce("singleton_limit", 1))
    depth = _by_workflow(
        {name: depth for name, (_lim, depth) in options.items() if depth is not None},
        Value(None, output_field=IntegerField()),
    )
    return (
        runs.filter(singleton_key__isnull=False, status__in=ACTIVE_STATUSES)
        .order_by()
        .values("workflow_name", "singleton_key")
        .annotate(
            holders=Count("pk", filter=_HOLDER_Q),
            waiting=Count("pk", filter=_WAITER_Q),
            waiting_for_key=Count("pk", filter=key_only_waiter_q()),
            # Waiters parked over a throttle's rate until its window opens (X6d).
            throttled=Count("pk", filter=_THROTTLED_Q),
            active=Count("pk"),
            oldest_waiter_at=Min("created_at", filter=_WAITER_Q),
            declared_limit=declared,
            limit=limit_in_force_sql(declared, override),
            # The cap start applies: the limit in force + max_queue_depth (S15, K2).
            capacity=limit_in_force_sql(declared, override) + depth,
            free=free_slots_sql(limit_in_force_sql(declared, override), Count("pk", filter=_HOLDER_Q), paused),
        )
        .annotate(fullness=Cast(F("active"), FloatField()) / Cast(F("capacity"), FloatField()))
    )


def _with_controls(page: list[QueueRow], using: str | None) -> list[QueueRow]:
    """Mark the page's paused keys and keys with a limit override (K2), in one query."""
    if not page:
        return page
    keys = SingletonKey.objects.using(using or router.db_for_read(SingletonKey))
    controlled = {
        (w, k): (paused, override)
        for w, k, paused, override in keys.filter(
            workflow_name__in={row.workflow for row in page}, key__in={row.key for row in page}
        )
        .filter(Q(paused=True) | Q(limit_override__isnull=False))
        .values_list("workflow_name", "key", "paused", "limit_override")
    }
    out = []
    for row in page:
        found = controlled.get((row.workflow, row.key))
        if found is not None:
            paused, override = found
            row = replace(row, paused=paused, limit_override=override)
        out.append(row)
    return out


def _order(sort: str) -> list[Any]:
    descending = sort.startswith("-")
    name = sort.lstrip("-")
    if name not in SORTS:
        raise ValueError(f"unknown sort {sort!r}; use one of {', '.join(SORTS)} (prefix - for descending)")
    column = {"workflow": "workflow_name", "key": "singleton_key", "oldest": "oldest_waiter_at"}.get(name, name)
    expression = F(column).desc(nulls_last=True) if descending else F(column).asc(nulls_last=True)
    return [expression, "workflow_name", "singleton_key"]


def queue_table(
    *,
    workflow: str | None = None,
    key_contains: str | None = None,
    only: str = "",
    sort: str = "-waiting",
    offset: int = 0,
    limit: int | None = 100,
    reg: Registry = registry,
    using: str | None = None,
) -> QueuePage:
    """Return the queue table: every workflow and key with active runs, in two queries.

    ``workflow``: exact workflow name; ``key_contains``: a substring of the
    key; ``only``: one of :data:`FILTERS`; ``sort``: one of :data:`SORTS`,
    ``-`` first for descending (``oldest`` sorts by the oldest waiter's
    creation, so ``oldest`` puts the longest wait first). ``offset``/``limit``
    page the rows (``limit=None``: all).

    Raises ValueError for an unknown ``sort`` or ``only``.
    """
    if only not in FILTERS:
        raise ValueError(f"unknown filter {only!r}; use one of {', '.join(repr(f) for f in FILTERS)}")
    options = singleton_options(reg)
    rows = _grouped(options, using)
    if workflow:
        rows = rows.filter(workflow_name=workflow)
    if key_contains:
        rows = rows.filter(singleton_key__icontains=key_contains)
    if only == "waiting":
        rows = rows.filter(waiting__gt=0)
    elif only == "full":
        rows = rows.filter(fullness__gte=1.0)
    elif only == "stalled":
        rows = rows.filter(waiting_for_key__gt=0, free__gt=0)
    ordered = rows.annotate(
        total_keys=_OverAll("COUNT(*)"),
        total_holders=_OverAll("SUM(%(expressions)s)", F("holders")),
        total_waiting=_OverAll("SUM(%(expressions)s)", F("waiting")),
    ).order_by(*_order(sort))
    window = list(ordered[offset : offset + limit] if limit is not None else ordered[offset:])
    page = [
        QueueRow(
            workflow=r["workflow_name"],
            key=r["singleton_key"],
            limit=r["limit"],
            declared_limit=r["declared_limit"],
            holders=r["holders"],
            waiting=r["waiting"],
            active=r["active"],
            oldest_waiter_at=r["oldest_waiter_at"],
            max_queue_depth=options.get(r["workflow_name"], (0, None))[1],
            waiting_for_key=r["waiting_for_key"],
            throttled=r["throttled"],
        )
        for r in window
    ]
    page = _with_controls(page, using)
    if window:
        first = window[0]
        return QueuePage(page, int(first["total_keys"]), int(first["total_holders"]), int(first["total_waiting"]))
    if offset == 0:
        return QueuePage(page, 0, 0, 0)
    return QueuePage(page, *_totals(rows))  # a page past the end: count what there is


@dataclass(frozen=True)
class QuotaRow:
    """One shared quota key with active members (X3, X3j): the limit in force
    (the key's runtime override, K2, else the declared ``Quota.limit``, else 1
    for a quota this process does not declare), its holders, its waiters and
    when the oldest waiter was created. ``workflow`` is ``quota:<name>``, the
    name the key controls and the audit use. ``max_queue_depth`` is the
    declared ``Quota.max_queue_depth`` (None: unbounded, or a quota this
    process does not declare); ``capacity`` is ``limit + max_queue_depth``,
    the active members at which ``start`` refuses new ones (S15, X3j)."""

    quota: str
    key: str
    limit: int
    holders: int
    waiting: int
    oldest_waiter_at: datetime | None
    paused: bool = False
    limit_override: int | None = None
    max_queue_depth: int | None = None

    @property
    def active(self) -> int:
        """Return the key's active members: holders and waiters."""
        return self.holders + self.waiting

    @property
    def capacity(self) -> int | None:
        """Return ``limit + max_queue_depth``, or None without a cap (S15, X3j,
        :func:`~durable_singleton.admission.queue_cap`)."""
        return queue_cap(self.limit, self.max_queue_depth)

    @property
    def fullness(self) -> float | None:
        """Return active members / capacity (1.0 = starts are refused), or None without a cap."""
        return _fullness(self.active, self.capacity)

    @property
    def workflow(self) -> str:
        """Return ``quota:<name>`` (X3b)."""
        return quota_lock_name(self.quota)

    @property
    def free_slots(self) -> int:
        """Return the slots a waiter could take now (:func:`~durable_singleton.admission.free_slots`)."""
        return free_slots(self.limit, self.holders, paused=self.paused)


def quota_table(
    *, limit: int = 50, quotas: Iterable[str] | None = None, reg: Registry = registry, using: str | None = None
) -> list[QuotaRow]:
    """Return up to ``limit`` quota keys with active members, most waiters first
    (X3j): one grouped query on ``ds_quota_order_idx`` and one of their controls.
    ``quotas``: only the keys of these quota names (None: every quota)."""
    memberships = QuotaMembership.objects.using(using) if using else QuotaMembership.objects.all()
    if quotas is not None:
        memberships = memberships.filter(quota__in=sorted(set(quotas)))
    waiting = quota_waiting_q()
    groups = list(
        memberships.filter(slot__isnull=False, run__status__in=ACTIVE_STATUSES)
        .values("quota", "key")
        .annotate(
            holders=Count("pk", filter=holds_quota_slot_q()),
            waiting=Count("pk", filter=waiting),
            oldest_waiter_at=Min("created_at", filter=waiting),
        )
        .order_by("-waiting", "quota", "key")[:limit]
    )
    keys = SingletonKey.objects.using(using or router.db_for_read(SingletonKey))
    controls = {
        (w, k): (paused, override)
        for w, k, paused, override in keys.filter(
            workflow_name__in={quota_lock_name(g["quota"]) for g in groups}, key__in={g["key"] for g in groups}
        ).values_list("workflow_name", "key", "paused", "limit_override")
    }
    declared = {q.name: (q.limit, q.max_queue_depth) for q in list(reg.quotas.values())}
    rows = []
    for g in groups:
        paused, override = controls.get((quota_lock_name(g["quota"]), g["key"]), (False, None))
        limit, depth = declared.get(g["quota"], (1, None))
        rows.append(
            QuotaRow(
                quota=g["quota"],
                key=g["key"],
                limit=limit_in_force(limit, override),
                max_queue_depth=depth,
                holders=g["holders"],
                waiting=g["waiting"],
                oldest_waiter_at=g["oldest_waiter_at"],
                paused=bool(paused),
                limit_override=override,
            )
        )
    return rows


@dataclass(frozen=True)
class ThrottleRow:
    """One throttle key with active runs (X6, K3), as of ``as_of`` (the database's
    clock, R5): its limit in force (the key's runtime override, K2, else the declared
    ``Throttle.limit``, else the one its runs' starts recorded) per ``period``
    seconds, the admissions recorded in the window that ends at ``as_of``, its
    waiters (active runs not yet admitted), how many of them are ``throttled``
    (parked over the rate: their ``not_before``, the window's opening, is later than
    ``as_of``), the earliest such opening ``next_admission_at`` and when the oldest
    waiter was created. ``workflow`` is ``throttle:<name>``, the name the key
    controls and the audit use."""

    throttle: str
    key: str
    limit: int
    period: float
    admitted: int
    waiting: int
    throttled: int
    next_admission_at: datetime | None
    oldest_waiter_at: datetime | None
    as_of: datetime
    paused: bool = False
    limit_override: int | None = None
    declared: bool = True

    @property
    def workflow(self) -> str:
        """Return ``throttle:<name>`` (X6)."""
        return throttle_lock_name(self.throttle)

    @property
    def free_admissions(self) -> int:
        """Return the admissions the window has room for now: none while paused."""
        return free_slots(self.limit, self.admitted, paused=self.paused)

    def as_dict(self) -> dict[str, Any]:
        """Return the row as JSON-ready values (times as ISO 8601, durations in seconds)."""
        return {
            "workflow": self.workflow,
            "throttle": self.throttle,
            "key": self.key,
            "limit": self.limit,
            "period": self.period,
            "admitted_in_window": self.admitted,
            "waiting": self.waiting,
            "throttled": self.throttled,
            "next_admission_at": None if self.next_admission_at is None else self.next_admission_at.isoformat(),
            "oldest_waiter_at": None if self.oldest_waiter_at is None else self.oldest_waiter_at.isoformat(),
            "oldest_wait_seconds": None
            if self.oldest_waiter_at is None
            else round((self.as_of - self.oldest_waiter_at).total_seconds(), 3),
            "paused": self.paused,
            "limit_override": self.limit_override,
            "declared": self.declared,
        }


def throttle_table(
    *,
    limit: int = 50,
    throttles: Iterable[str] | None = None,
    reg: Registry = registry,
    using: str | None = None,
) -> list[ThrottleRow]:
    """Return up to ``limit`` throttle keys with waiters (active runs not yet
    admitted), most waiters first (X6, K3): one grouped query on the memberships
    (the only one when no key has waiters), then one read of the database's clock
    (R5), one of the keys' controls and one count of recorded admissions per
    throttle listed. ``throttles``: only the
    keys of these throttle names (None: every throttle)."""
    db = using or router.db_for_read(ThrottleMembership)
    memberships = ThrottleMembership.objects.using(db)
    if throttles is not None:
        memberships = memberships.filter(throttle__in=sorted(set(throttles)))
    over_rate = Q(run__not_before__gt=DbNow())
    groups = list(
        memberships.filter(run__quota_slot=SlotState.WAITER, run__status__in=ACTIVE_STATUSES)
        .values("throttle", "key")
        .annotate(
            waiting=Count("pk"),
            throttled=Count("pk", filter=over_rate),
            next_admission_at=Min("run__not_before", filter=over_rate),
            oldest_waiter_at=Min("created_at"),
        )
        .order_by("-waiting", "throttle", "key")[:limit]
    )
    if not groups:
        return []
    now = database_now(db)  # the windows' end, one read (R5)
    controls = {
        (w, k): (paused, override)
        for w, k, paused, override in SingletonKey.objects.using(db)
        .filter(
            workflow_name__in={throttle_lock_name(g["throttle"]) for g in groups}, key__in={g["key"] for g in groups}
        )
        .values_list("workflow_name", "key", "paused", "limit_override")
    }
    declared = {t.name: (t.limit, float(t.period)) for t in list(reg.throttles.values())}
    for name in {g["throttle"] for g in groups} - set(declared):
        # A throttle this process does not declare: the limit and period its runs' starts recorded (X6a).
        stored = (
            memberships.filter(throttle=name, run__status__in=ACTIVE_STATUSES)
            .values_list("run__throttle_keys", flat=True)
            .first()
        )
        recorded = next((t for t in stored or [] if t[0] == name), None)
        if recorded is not None:
            declared[name] = (int(recorded[2]), float(recorded[3]))
    admitted: dict[tuple[str, str], int] = {}
    for name in sorted({g["throttle"] for g in groups}):
        period = declared.get(name, (1, 0.0))[1]
        counts = (
            ThrottleAdmission.objects.using(db)
            .filter(throttle=name, key__in={g["key"] for g in groups if g["throttle"] == name})
            .filter(admitted_at__gt=now - timedelta(seconds=period))
            .values("key")
            .annotate(n=Count("pk"))
            .order_by()
        )
        admitted.update(((name, c["key"]), c["n"]) for c in counts)
    rows = []
    for g in groups:
        paused, override = controls.get((throttle_lock_name(g["throttle"]), g["key"]), (False, None))
        known = declared.get(g["throttle"])
        rows.append(
            ThrottleRow(
                throttle=g["throttle"],
                key=g["key"],
                limit=limit_in_force(known[0] if known else 1, override),
                period=known[1] if known else 0.0,
                admitted=admitted.get((g["throttle"], g["key"]), 0),
                waiting=g["waiting"],
                throttled=g["throttled"],
                next_admission_at=g["next_admission_at"],
                oldest_waiter_at=g["oldest_waiter_at"],
                as_of=now,
                paused=bool(paused),
                limit_override=override,
                declared=g["throttle"] in reg.throttles,
            )
        )
    return rows


class _OverAll(Func):
    """``<aggregate> OVER ()``: a total over every row of a grouped query, in the same query."""

    window_compatible = True
    contains_over_clause = True
    output_field = IntegerField()

    def __init__(self, template: str, *expressions: Any) -> None:
        super().__init__(*expressions, template=f"{template} OVER ()")

    def get_group_by_cols(self) -> list[Any]:
        return []


def _totals(rows: QuerySet[Any]) -> tuple[int, int, int]:
    totals = rows.aggregate(keys=Count("singleton_key"), holders_sum=Sum("holders"), waiting_sum=Sum("waiting"))
    return totals["keys"] or 0, totals["holders_sum"] or 0, totals["waiting_sum"] or 0


@dataclass(frozen=True)
class QueuedRun:
    """A holder or a waiter of a key, as its queue page shows it."""

    run: Run
    position: int | None
    first_step_at: datetime | None
    #: Steps the run has finished, and the name of the last one (holders only; None for waiters).
    steps_done: int | None = None
    last_step: str | None = None

    @property
    def since(self) -> datetime | None:
        """Return when a holder took its slot, as well as it is known (see :func:`holder_since`)."""
        return holder_since(self.run, self.first_step_at)


@dataclass(frozen=True)
class KeyQueue:
    """One key's queue: holders, a page of waiters in admission order, counts."""

    workflow: str
    key: str
    limit: int
    max_queue_depth: int | None
    holders: list[QueuedRun]
    waiters: list[QueuedRun]
    waiting: int
    offset: int
    paused: bool = False
    declared_limit: int | None = None

    @property
    def capacity(self) -> int | None:
        """Return ``limit + max_queue_depth``, the cap ``start`` applies (S15), or None
        without a cap. ``limit`` is the limit in force, a runtime override included (K2)."""
        if self.max_queue_depth is None:
            return None
        return self.limit + self.max_queue_depth


def _first_step_at() -> Subquery:
    return Subquery(Step.objects.filter(run=OuterRef("pk")).order_by("position").values("started_at")[:1])


def _steps_done() -> Subquery:
    steps = Step.objects.filter(run=OuterRef("pk")).order_by().values("run")
    return Subquery(steps.annotate(n=Count("pk")).values("n")[:1], output_field=IntegerField())


def _last_step() -> Subquery:
    return Subquery(Step.objects.filter(run=OuterRef("pk")).order_by("-position").values("name")[:1])


def _annotated(run: Run, name: str) -> Any:
    """Return the value ``annotate(name=...)`` put on ``run``.

    The type checker cannot see annotations made through a custom queryset
    class (``RunQuerySet``), so they are read by name here, in one place.
    """
    return getattr(run, name)


def key_queue(
    workflow: str,
    key: str,
    *,
    offset: int = 0,
    limit: int = 100,
    reg: Registry = registry,
    using: str | None = None,
) -> KeyQueue:
    """Return the queue of one workflow and key in four queries.

    Holders are ``holders()`` in creation order (at most 200 are listed),
    with the steps each has finished; waiters are ``waiting()``, exactly the claim's order (S5 step 3),
    paged by ``offset``/``limit``, with their 1-based positions.
    """
    runs = (Run.objects.using(using) if using else Run.objects.all()).for_key(workflow, key)
    options = singleton_options(reg).get(workflow)
    holder_rows = list(
        runs.holders()
        .annotate(first_step_at=_first_step_at(), steps_done=_steps_done(), last_step=_last_step())
        .order_by("created_at", "run_id")[:200]
    )
    waiting = runs.waiting()
    total = waiting.count()
    waiter_rows = list(waiting.annotate(first_step_at=_first_step_at())[offset : offset + limit])
    if options is not None:
        key_limit, depth = options
    else:
        stored = [r.singleton_limit for r in [*holder_rows, *waiter_rows] if r.singleton_limit]
        key_limit, depth = (max(stored) if stored else 1), None
    # The key's runtime controls (K2): the limit in force and whether it admits.
    controls = (
        SingletonKey.objects.using(using or router.db_for_read(SingletonKey))
        .filter(workflow_name=workflow, key=key)
        .values_list("limit_override", "paused")
        .first()
    )
    override, paused = controls if controls is not None else (None, False)
    return KeyQueue(
        workflow=workflow,
        key=key,
        limit=limit_in_force(key_limit, override),
        paused=bool(paused),
        declared_limit=key_limit,
        max_queue_depth=depth,
        holders=[
            QueuedRun(
                r, None, _annotated(r, "first_step_at"), _annotated(r, "steps_done") or 0, _annotated(r, "last_step")
            )
            for r in holder_rows
        ],
        waiters=[QueuedRun(r, offset + n + 1, _annotated(r, "first_step_at")) for n, r in enumerate(waiter_rows)],
        waiting=total,
        offset=offset,
    )


def holder_since(run: Run, first_step_at: datetime | None) -> datetime | None:
    """Return when ``run`` took its slot, as well as the stored columns tell.

    ``admitted_at`` is stamped by the claim. For a run admitted before that
    column existed: a run admitted on its first turn took its slot at
    ``started_at``; otherwise the body's first step started just after
    admission; with neither, None.
    """
    if run.admitted_at is not None:
        return run.admitted_at
    if run.attempts <= 1 and run.started_at is not None:
        return run.started_at
    return first_step_at


@dataclass(frozen=True)
class Place:
    """Where a run stands in its key's queue (S5)."""

    kind: str  # "none", "holder", "waiter", "not-due", "legacy-pending", "terminal"
    position: int | None = None
    holders: tuple[str, ...] = ()
    since: datetime | None = None
    not_before: datetime | None = None  # "not-due": a delayed start before its time (X5)


def run_place(run: Run, *, using: str | None = None) -> Place:
    """Return ``run``'s place: holder since when, waiter at position N among the due
    waiters behind named holders, or a delayed start not due yet (X5, on the database's clock).

    At most three queries: the holders, whether it is due and the position, or a holder's first step.
    """
    if run.singleton_key is None:
        return Place("none")
    if run.status not in ACTIVE_STATUSES:
        return Place("terminal")
    runs = (Run.objects.using(using) if using else Run.objects.all()).for_key(run.workflow_name, run.singleton_key)
    admitted = run.singleton_slot == SlotState.HOLDER
    if holds_slot(run.status, key=run.singleton_key, admitted=admitted, tracked=run.singleton_tracked):
        if run.admitted_at is not None:
            return Place(SlotState.HOLDER, since=run.admitted_at)
        if run.attempts <= 1 and run.started_at is not None:
            return Place(SlotState.HOLDER, since=run.started_at)
        first = Step.objects.filter(run_id=run.pk).order_by("position").values_list("started_at", flat=True).first()
        return Place(SlotState.HOLDER, since=holder_since(run, first))
    holders = tuple(runs.holders().order_by("created_at", "run_id").values_list("run_id", flat=True)[:20])
    if run.singleton_slot != SlotState.WAITER:
        return Place("legacy-pending", holders=holders)
    if run.not_before is not None and runs.filter(pk=run.pk).not_due().exists():
        return Place("not-due", holders=holders, not_before=run.not_before)
    # Its position among the due waiters, as the claim and explain count it (S5 step 3, X5, K3).
    waiting = runs.due_waiting()
    ahead = waiting.filter(
        ahead_q(QUEUE_ORDER, {"priority": run.priority, "created_at": run.created_at, "run_id": run.run_id})
    )
    return Place(SlotState.WAITER, position=ahead.count() + 1, holders=holders)


@dataclass(frozen=True)
class QuotaKeyQueue:
    """One shared quota key (X3): its limit in force (K2), its holders across workflows,
    a page of its due waiters in admission order with 1-based positions, and counts.

    ``holders`` and ``waiters`` are ``(run, position)`` pairs (position None for a
    holder); ``waiting`` counts every due waiter, ``not_due`` the waiters whose
    ``not_before`` has not come (X5, not in line yet)."""

    quota: str
    key: str
    limit: int
    max_queue_depth: int | None
    holders: list[QueuedRun]
    waiters: list[QueuedRun]
    waiting: int
    not_due: int
    offset: int
    paused: bool = False
    declared: bool = True

    @property
    def workflow(self) -> str:
        """Return ``quota:<name>``, the key table's name of the quota (X3b)."""
        return quota_lock_name(self.quota)

    @property
    def free_slots(self) -> int:
        """Return the quota key's free slots: none while paused, else limit in force minus holders."""
        return free_slots(self.limit, len(self.holders), paused=self.paused)


def quota_key_queue(
    quota: str, key: str, *, offset: int = 0, limit: int = 100, reg: Registry = registry, using: str | None = None
) -> QuotaKeyQueue:
    """Return the queue of one quota key in five queries, whatever its length (X3, K3).

    Holders are the memberships that hold a slot (:func:`~durable_singleton.admission.holds_quota_slot_q`,
    at most 200, in creation order); waiters the due ones
    (:func:`~durable_singleton.admission.quota_waiter_q` on the database's clock, R5) in
    :data:`QUOTA_ORDER`, paged by ``offset``/``limit``: positions are the ones the
    store's ``quota_queue`` and ``explain`` give. The limit is the declared
    quota's (1 for a quota this process does not declare, as its claim uses) or
    the key's runtime override (K2)."""
    memberships = (QuotaMembership.objects.using(using) if using else QuotaMembership.objects.all()).filter(
        quota=quota, key=key
    )
    holders = list(
        memberships.filter(holds_quota_slot_q()).select_related("run").order_by("created_at", "run_id")[:200]
    )
    due = memberships.filter(quota_waiter_q(DbNow()))
    counts = memberships.filter(quota_waiting_q()).aggregate(
        waiting=Count("pk"), due=Count("pk", filter=quota_waiter_q(DbNow()))
    )
    waiters = list(due.select_related("run").order_by(*QUOTA_ORDER)[offset : offset + limit])
    keys = SingletonKey.objects.using(using or router.db_for_read(SingletonKey))
    control = keys.filter(workflow_name=quota_lock_name(quota), key=key).values_list("paused", "limit_override").first()
    paused, override = control if control is not None else (False, None)
    declared = reg.quotas.get(quota)
    return QuotaKeyQueue(
        quota=quota,
        key=key,
        limit=limit_in_force(declared.limit if declared else 1, override),
        max_queue_depth=declared.max_queue_depth if declared else None,
        holders=[QueuedRun(m.run, None, None) for m in holders],
        waiters=[QueuedRun(m.run, offset + n + 1, None) for n, m in enumerate(waiters)],
        waiting=counts["due"],
        not_due=counts["waiting"] - counts["due"],
        offset=offset,
        paused=bool(paused),
        declared=declared is not None,
    )


@dataclass(frozen=True)
class ThrottleKeyQueue:
    """One throttle key (X6, K3), as of ``as_of`` (the database's clock, R5): its
    limit in force per ``period`` seconds (K2: the key's override, else the declared
    ``Throttle.limit``, else the one its runs' starts recorded), the admissions
    recorded in the window that ends at ``as_of`` (``(run id, time)``, newest first, at
    most :data:`ADMISSIONS_LISTED`; ``admitted`` counts them all), a page of its
    waiters in its admission order (:data:`~durable_singleton.admission.QUEUE_ORDER`:
    higher priority first, then ``created_at``, ``run_id``; X6c, X8a) with 1-based
    positions among all its waiters, their number ``waiting``, how many are
    ``throttled`` (parked over the rate: ``not_before`` after ``as_of``) and the
    earliest such opening ``next_admission_at``."""

    throttle: str
    key: str
    limit: int
    period: float
    admissions: list[tuple[str, datetime]]
    admitted: int
    waiters: list[QueuedRun]
    waiting: int
    throttled: int
    next_admission_at: datetime | None
    as_of: datetime
    offset: int
    paused: bool = False
    limit_override: int | None = None
    declared: bool = True

    @property
    def workflow(self) -> str:
        """Return ``throttle:<name>``, the key table's name of the throttle (X6, K2)."""
        return throttle_lock_name(self.throttle)

    @property
    def free_admissions(self) -> int:
        """Return the admissions the window has room for now: none while paused."""
        return free_slots(self.limit, self.admitted, paused=self.paused)


#: Recorded admissions a throttle key's page lists (the count is always complete).
ADMISSIONS_LISTED = 200


def throttle_key_queue(
    throttle: str,
    key: str,
    *,
    offset: int = 0,
    limit: int = 100,
    reg: Registry = registry,
    using: str | None = None,
) -> ThrottleKeyQueue:
    """Return one throttle key's window and queue (X6, K3) in at most six queries,
    whatever its length, at one read of the database's clock (R5): the page
    ``offset``/``limit`` of its waiters (active runs not yet admitted, memberships on
    ``ds_throttle_order_idx``), their counts, the admissions in its window
    (``ds_throttle_window_idx``) and its controls (K2). A throttle this process does
    not declare is shown with the limit and period its runs' starts recorded."""
    db = using or router.db_for_read(ThrottleMembership)
    now = database_now(db)
    members = ThrottleMembership.objects.using(db).filter(
        throttle=throttle, key=key, run__quota_slot=SlotState.WAITER, run__status__in=ACTIVE_STATUSES
    )
    over_rate = Q(run__not_before__gt=now)
    counts = members.aggregate(
        waiting=Count("pk"),
        throttled=Count("pk", filter=over_rate),
        next_at=Min("run__not_before", filter=over_rate),
    )
    page = list(members.select_related("run").order_by(*QUEUE_ORDER)[offset : offset + limit])  # X6c, X8a
    declared = reg.throttles.get(throttle)
    if declared is not None:
        stated: tuple[int, float] = (declared.limit, float(declared.period))
    else:
        recorded = next(
            (t for m in page for t in (m.run.throttle_keys or []) if t[0] == throttle),
            None,
        )
        stated = (int(recorded[2]), float(recorded[3])) if recorded is not None else (1, 0.0)
    window = ThrottleAdmission.objects.using(db).filter(
        throttle=throttle, key=key, admitted_at__gt=now - timedelta(seconds=stated[1])
    )
    admissions = [
        (str(r), at)
        for r, at in window.order_by("-admitted_at").values_list("run_id", "admitted_at")[:ADMISSIONS_LISTED]
    ]
    control = (
        SingletonKey.objects.using(db)
        .filter(workflow_name=throttle_lock_name(throttle), key=key)
        .values_list("paused", "limit_override")
        .first()
    )
    paused, override = control if control is not None else (False, None)
    return ThrottleKeyQueue(
        throttle=throttle,
        key=key,
        limit=limit_in_force(stated[0], override),
        period=stated[1],
        admissions=admissions,
        admitted=window.count() if len(admissions) >= ADMISSIONS_LISTED else len(admissions),
        waiters=[QueuedRun(m.run, offset + n + 1, None) for n, m in enumerate(page)],
        waiting=counts["waiting"],
        throttled=counts["throttled"],
        next_admission_at=counts["next_at"],
        as_of=now,
        offset=offset,
        paused=bool(paused),
        limit_override=override,
        declared=declared is not None,
    )


def quota_places(run_ids: Iterable[str], *, using: str | None = None) -> dict[str, list[tuple[str, str, str]]]:
    """Return, for each of ``run_ids`` that carries quotas, its ``(quota, key, slot)`` triples
    (slot ``holder``, ``waiter`` or "" once released), in one query (X3b)."""
    ids = list(run_ids)
    out: dict[str, list[tuple[str, str, str]]] = {}
    if not ids:
        return out
    rows = (QuotaMembership.objects.using(using) if using else QuotaMembership.objects.all()).filter(run_id__in=ids)
    for run_id, quota, key, slot in rows.order_by("run_id", "quota").values_list("run_id", "quota", "key", "slot"):
        out.setdefault(str(run_id), []).append((quota, key, slot or ""))
    return out


class Cause(enum.StrEnum):
    """Why an active singleton run is not running a body right now, in words.

    The difference that matters to an operator: a run that waits for its key
    (a slot to free) and a run that could run but waits for a worker (every
    worker thread or process busy, or none running).
    """

    RUNNING = "running"
    # running, but its lease was not renewed for longer than the renewal interval: its worker may be gone (K3)
    UNRENEWED = "not renewed"
    PARKED = "holder, parked"  # sleeping, waiting for a signal or a child, blocked: keeps its slot (S6)
    NEEDS_WORKER = "waiting for a worker"  # admitted or admissible and due: no worker has taken its turn
    NEEDS_KEY = "waiting for the key"  # behind the holders: waits for a slot to free
    # its key has room (or it has none) but it waits in a shared quota's queue (X3d)
    NEEDS_QUOTA = "waiting for a quota"
    # over a throttle's rate: not due until its window opens, when the tick sends its turn (X6d)
    THROTTLED = "throttled"


def run_cause(
    *,
    status: str,
    holder: bool,
    wake_at: datetime | None,
    position: int | None,
    free_slots: int,
    now: datetime,
    unrenewed: bool = False,
    quota_waiter: bool = False,
    throttled: bool = False,
) -> Cause:
    """Return why an active singleton run is where it is.

    ``holder``: it holds a slot; ``position``: its 1-based place among the
    key's waiters (None for a holder); ``free_slots``: the key's limit minus
    its holders. A holder whose ``wake_at`` has come, and a waiter among the
    first ``free_slots``, wait for a worker (their turn is claimable now);
    another holder is parked (a later or no ``wake_at``); other waiters wait
    for the key. ``unrenewed``: a running run's lease was not renewed for
    longer than the renewal interval
    (:func:`~durable_singleton.renewals.lease_state`, K3). ``quota_waiter``: it
    waits in a quota key's queue (its ``quota_slot`` is ``waiter``, X3d): a waiter
    among the first ``free_slots`` of its key then waits for a quota, not a worker.
    ``throttled``: a waiter parked over a throttle's rate until its window opens
    (:func:`throttled_until`, X6d), wherever it stands in line.
    """
    if status == RunStatus.RUNNING:
        return Cause.UNRENEWED if unrenewed else Cause.RUNNING
    if holder:
        return Cause.NEEDS_WORKER if wake_at is not None and wake_at <= now else Cause.PARKED
    if throttled:
        return Cause.THROTTLED
    if position is not None and position <= free_slots:
        return Cause.NEEDS_QUOTA if quota_waiter else Cause.NEEDS_WORKER
    return Cause.NEEDS_KEY


def throttled_until(run: Run, now: datetime) -> datetime | None:
    """Return the window's opening a waiter is parked over a throttle's rate until
    (its ``not_before``, X6d), or None: not so parked, or the opening has come by
    ``now`` (the database's clock, R5)."""
    over = ParkReason.THROTTLED.matches(run.park_reason or "") and run.not_before is not None
    return run.not_before if over and run.not_before is not None and run.not_before > now else None


def quota_waiter_cause(run: Run, position: int, free_slots: int) -> Cause:
    """Return why a quota key's waiter at ``position`` (1-based, :data:`QUOTA_ORDER`) waits,
    the key having ``free_slots``: behind the quota's holders (X3d), else, among the
    first ``free_slots``, for a slot of its own singleton key (S5) or for a worker
    (:func:`quota_slot_cause` on the run's ``singleton_slot``)."""
    return quota_slot_cause(run.singleton_slot, position, free_slots)


def quota_slot_cause(singleton_slot: str | None, position: int, free_slots: int) -> Cause:
    """The rule of :func:`quota_waiter_cause` on a waiter's ``singleton_slot`` alone (X3d, S5):
    past the ``free_slots`` it waits for the quota, within them for its own key while it is
    that key's waiter (``singleton_slot`` is ``waiter``), else for a worker."""
    if position > free_slots:
        return Cause.NEEDS_QUOTA
    return Cause.NEEDS_KEY if singleton_slot == SlotState.WAITER else Cause.NEEDS_WORKER


def iter_rows(page: QueuePage, now: datetime) -> Iterable[dict[str, Any]]:
    """Yield the rows of ``page`` as JSON-ready dicts."""
    for row in page.rows:
        yield row.as_dict(now)


@dataclass(frozen=True)
class KeyMembers:
    """The run ids of one key's holders and its first waiters, in admission order (S5)."""

    holders: list[str]
    waiters: list[str]


def queue_members(
    rows: Iterable[QueueRow], *, per_key: int = 20, using: str | None = None
) -> dict[tuple[str, str], KeyMembers]:
    """Return ``{(workflow, key): KeyMembers}`` for the keys of ``rows``, in two queries.

    Holders are ``holders()`` in creation order, waiters ``waiting()``, the
    claim's order (S5 step 3); at most ``per_key`` (>= 1) of each per key
    (the row's ``holders``/``waiting`` counts say how many there are).
    Raises ValueError if ``per_key`` < 1.
    """
    if per_key < 1:
        raise ValueError(f"per_key must be >= 1, got {per_key!r}")
    pairs = {(row.workflow, row.key) for row in rows}
    members = {pair: KeyMembers([], []) for pair in pairs}
    if not pairs:
        return members
    chosen = Q()
    for workflow, key in sorted(pairs):
        chosen |= Q(workflow_name=workflow, singleton_key=key)
    runs = (Run.objects.using(using) if using else Run.objects.all()).filter(chosen)
    # Holders in creation order, waiters in the claim's (S5 step 3, X8).
    orders = {"holders": ("created_at", "run_id"), "waiters": QUEUE_ORDER}
    for queryset, field in ((runs.holders(), "holders"), (runs.waiting(), "waiters")):
        numbered = queryset.annotate(
            place=Window(
                RowNumber(),
                partition_by=[F("workflow_name"), F("singleton_key")],
                order_by=order_expressions(orders[field]),
            )
        ).filter(place__lte=per_key)
        for name, tagged, run_id in numbered.order_by(*orders[field]).values_list(
            "workflow_name", "singleton_key", "run_id"
        ):
            getattr(members[name, str(tagged)], field).append(run_id)
    return members
