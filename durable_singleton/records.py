"""The records the rules, the seams and the core pass around: a run as
stored (R1), a memoized step (R4) and a buffered signal (D2).

:mod:`durable_singleton.stores.base` names them too; they live here, below
the seam, so the declarations (:mod:`durable_singleton.definitions`) can name
a run without importing the store seam; :class:`PurgeReport` is what a
retention purge deleted (O2). :class:`KeyQueue`, :class:`WorkerRecord`,
:class:`Beat`, :class:`SlotCount` and :class:`KeyCount` are what the store's
reads for the services return (explain, the worker registry, the tick's
heartbeat, the metrics, health and the slot audit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from .admission import ADMITTED_TAG, TRACKED_TAG, holds_quota_slot, holds_slot, key_tag, queue_place, quota_tag
from .statuses import PARKED_STATUSES, TERMINAL_STATUSES

__all__ = [
    "Beat",
    "KeyCount",
    "KeyQueue",
    "PurgeReport",
    "QueueHolder",
    "RunRecord",
    "SignalRecord",
    "SlotCount",
    "StepRecord",
    "ThrottleWaitCount",
    "WorkerRecord",
]


@dataclass(frozen=True)
class RunRecord:
    """A run as stored (R1). ``tags`` includes the key tag and reserved markers."""

    run_id: str
    workflow_name: str
    workflow_version: str
    namespace: str
    status: str
    input: Any
    created_at: datetime
    updated_at: datetime
    output: Any = None
    error: Any = None
    user_tags: tuple[str, ...] = ()
    singleton_key: str | None = None
    singleton_limit: int | None = None
    admitted: bool = False
    tracked: bool = False
    wake_at: datetime | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    admitted_at: datetime | None = None
    attempts: int = 0
    recoveries: int = 0
    parent_run_id: str | None = None
    park_reason: str = ""
    cancel_requested: bool = False
    deadline_at: datetime | None = None
    fencing_token: int | None = None
    step_count: int = 0
    #: The delayed start (X5): the run is not claimed or admitted before this time (None: no delay).
    not_before: datetime | None = None
    #: The quota keys the run carries, as (quota name, key) pairs sorted, fixed at start (X3, X3b).
    quota_keys: tuple[tuple[str, str], ...] = ()
    #: The run's quota marker (X3c): ``"holder"`` admitted in every limit, ``"waiter"``, None (no quotas, terminal).
    quota_slot: str | None = None
    #: The run's sub-key and weight in each fair quota it carries, as (quota name, sub-key, weight),
    #: fixed at start (X4); what a store writes on the memberships. The Django store's records read
    #: back from the database leave it empty: the memberships hold it.
    quota_shares: tuple[tuple[str, str, int], ...] = ()
    #: The fencing token of each quota slot, as (quota name, token), as the claim that
    #: started this turn took or confirmed them (X3f); empty on a record read back.
    quota_tokens: tuple[tuple[str, int], ...] = ()
    #: The queue cap of each quota the run carries that declares ``max_queue_depth``, as
    #: (quota name, declared limit, max_queue_depth), fixed at start: what a store counts
    #: at the insert (S15, X3j); empty on a record read back.
    quota_caps: tuple[tuple[str, int, int], ...] = ()
    #: The throttle keys the run carries, as (throttle name, key, declared limit, period in
    #: seconds), sorted, fixed at start (X6). A run that carries one carries the quota marker
    #: (``quota_slot``) too: every grant but its own claim sends it a turn (X3h).
    throttle_keys: tuple[tuple[str, str, int, float], ...] = ()
    #: The W3C ``traceparent`` current when the run was started, or None (O8,
    #: ``durable_singleton.tracing``): each turn's span is its child.
    trace_parent: str | None = None
    #: The debounce key (X7), computed once at the run's first start, or None (not debounced).
    debounce_key: str | None = None
    #: The latest start time a later start of the burst may give the run: the burst's first
    #: start plus ``max_seconds``, on the store's clock (X7); None when not debounced.
    debounce_until: datetime | None = None
    #: The run's priority inside its key (X8): -100 to 100, higher admitted first; fixed at start.
    priority: int = 0

    @property
    def tags(self) -> list[str]:
        """Return the run's tags: caller tags, ``quota:<name>:<key>``, ``singleton:<key>``
        and markers (S1, S12, X3b)."""
        tags = list(self.user_tags)
        tags.extend(quota_tag(name, key) for name, key in self.quota_keys)
        if self.singleton_key is not None:
            tags.append(key_tag(self.singleton_key))
            if self.tracked:
                tags.append(TRACKED_TAG)
            if self.admitted:
                tags.append(ADMITTED_TAG)
        return tags

    @property
    def holds_slot(self) -> bool:
        """Tell whether the run holds a slot of its key (S5, S12): :func:`~durable_singleton.admission.holds_slot`."""
        return holds_slot(self.status, key=self.singleton_key, admitted=self.admitted, tracked=self.tracked)

    @property
    def holds_quota_slots(self) -> bool:
        """Tell whether the run holds a slot of each quota key it carries (X3c):
        :func:`~durable_singleton.admission.holds_quota_slot`."""
        return holds_quota_slot(self.status, self.quota_slot)

    @property
    def queue_place(self) -> tuple[int, datetime, str]:
        """Return the run's sort key in its key's queue, higher priority first, then oldest
        (S5 step 3, X8): :func:`~durable_singleton.admission.queue_place`."""
        return queue_place(self.priority, self.created_at, self.run_id)

    @property
    def is_terminal(self) -> bool:
        """Tell whether the status is terminal (R2)."""
        return self.status in TERMINAL_STATUSES

    @property
    def is_parked(self) -> bool:
        """Tell whether the run is active and not running (no lease)."""
        return self.status in PARKED_STATUSES

    def evolve(self, **changes: Any) -> RunRecord:
        """Return a copy with ``changes`` applied."""
        return replace(self, **changes)


@dataclass(frozen=True)
class StepRecord:
    """A memoized step result (R4)."""

    position: int
    name: str
    result: Any
    started_at: datetime
    finished_at: datetime


@dataclass(frozen=True)
class SignalRecord:
    """A buffered signal (D2)."""

    seq: int
    name: str
    payload: Any
    created_at: datetime


@dataclass
class PurgeReport:
    """What a purge deleted (or, dry, would delete): runs by status and workflow, steps and signals."""

    runs: int = 0
    steps: int = 0
    signals: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    by_workflow: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {
            "runs": self.runs,
            "steps": self.steps,
            "signals": self.signals,
            "by_status": dict(sorted(self.by_status.items())),
            "by_workflow": dict(sorted(self.by_workflow.items())),
            "dry_run": self.dry_run,
        }


@dataclass(frozen=True)
class QueueHolder:
    """A holder of a key's slot as a queue report names it (S5): ``since`` is
    when it took its slot (its claim's stamp, else the start of a run admitted
    on its first turn, else None), lease fields as stored (R5)."""

    run_id: str
    status: str
    since: datetime | None
    namespace: str
    lease_owner: str | None
    lease_expires_at: datetime | None


@dataclass(frozen=True)
class KeyQueue:
    """A key's queue as one run sees it (S5, X5).

    ``holders``: the oldest holders, at most the number asked for;
    ``holder_count``: all of them; ``depth``: every waiter of the key;
    ``due_ahead``/``not_due_ahead``: the waiters queued before the run whose
    delayed start is due / not due yet (X5: one not due blocks no one), in
    the queue's order (``admission.QUEUE_ORDER``: priority, then creation,
    X8); ``peers_ahead``: those of ``due_ahead`` of the run's own priority;
    ``waiting``: the run itself waits for a slot of its key."""

    holders: tuple[QueueHolder, ...]
    holder_count: int
    depth: int
    due_ahead: int
    not_due_ahead: int
    waiting: bool
    peers_ahead: int = 0


@dataclass(frozen=True)
class WorkerRecord:
    """A registered ``durable_worker`` process (O6), times on the database's clock."""

    name: str
    host: str
    pid: int
    mode: str
    threads: int
    queues: str
    started_at: datetime
    last_seen_at: datetime


@dataclass(frozen=True)
class Beat:
    """A heartbeat row (O5): when the named job last completed, and who ran it."""

    name: str
    at: datetime
    owner: str


def since_admitted(admitted_at: datetime | None, started_at: datetime | None, attempts: int) -> datetime | None:
    """When a holder took its slot: the claim's stamp, else the start of a run admitted on its first turn."""
    if admitted_at is not None:
        return admitted_at
    return started_at if attempts <= 1 else None


@dataclass(frozen=True)
class SlotCount:
    """The holders and waiters of one workflow's singleton keys, or of one quota's
    keys (``name`` ``quota:<name>``, X3j), over all its keys (O4): ``holders``
    hold a slot (S5, S12; a quota's: X3c), ``waiters`` wait for one, due or not
    (X5); ``oldest_waiter_at`` is the ``created_at`` of the oldest waiter (None:
    no waiter)."""

    name: str
    holders: int
    waiters: int
    oldest_waiter_at: datetime | None


@dataclass(frozen=True)
class ThrottleWaitCount:
    """The waiters of one throttle over all its keys (O4, X6): ``name`` is
    ``throttle:<name>``; ``waiters`` the active runs that carry it and wait
    (``quota_slot`` = ``waiter``), due or not (X5); ``over_rate`` those among
    them parked over its rate until its window opens (their ``not_before``
    later than the store's now, X6d); ``oldest_waiter_at`` the ``created_at``
    of the oldest waiter (None: no waiter)."""

    name: str
    waiters: int
    over_rate: int
    oldest_waiter_at: datetime | None


@dataclass(frozen=True)
class KeyCount:
    """A count on one key of a limit (K4): ``name`` is its workflow, or its
    quota or throttle as ``quota:<name>`` or ``throttle:<name>`` (X3j, X6);
    ``count`` what the read counted (its holders, its waiters, or a throttle's
    admissions within a window); ``last_admitted_at`` the latest admission
    among them (None: none stamped); ``stored_limit`` the largest limit stored
    on its runs (None: none stored, or not a singleton key)."""

    name: str
    key: str
    count: int
    last_admitted_at: datetime | None = None
    stored_limit: int | None = None
