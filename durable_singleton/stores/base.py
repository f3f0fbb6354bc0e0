"""The store seam: everything the engine asks of durable storage.

:class:`BaseStore` lists every method the engine and its features call: the
turn protocol's (abstract), and the features' seam methods with defaults
behind capability flags (key controls, ``supports_key_controls``; schedule
state, ``supports_schedules``; the ``database`` alias and the ``codec``). A
store is a subclass: the Django ORM store, the in-memory store, the codec
store, or a user's own (set ``DURABLE_SINGLETON["STORE"]`` to its dotted
path). The contract is stated by the conformance suite in
:mod:`durable_singleton.testing.conformance`; ``tests/stores/test_custom_store.py``
runs it on a store with only the abstract methods and the claim.

The turn protocol (docs/design.rst):

* :meth:`BaseStore.begin_turn` takes a run's lease and, for a singleton run,
  admits or parks it, in one transaction (S4, S5, R6).
* :meth:`BaseStore.finish` settles a run terminal and grants its freed slot
  to the oldest waiters, in one transaction (S7).
* Every other write to a run is a compare-and-set on what was read, fenced by
  the lease owner and an unexpired lease on the store's clock (R5, R5a).
"""

from __future__ import annotations

import enum
import threading
import warnings
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any, TypeVar

from ..admission import is_due, queue_ttl_expired, quota_lock_name, throttle_lock_name
from ..codecs import Codec
from ..conf import Settings
from ..exceptions import UnsupportedByStoreError
from ..records import (
    Beat,
    KeyCount,
    KeyQueue,
    PurgeReport,
    QueueHolder,
    RunRecord,
    SignalRecord,
    SlotCount,
    StepRecord,
    ThrottleWaitCount,
    WorkerRecord,
    since_admitted,
)
from ..renewals import lease_state
from ..schedule_specs import Schedule
from ..statuses import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    WAKEABLE_STATUSES,
    ParkReason,
    Rung,
    RunStatus,
    SlotState,
    Verdict,
)

T = TypeVar("T")

__all__ = [
    "TERMINAL_STATUSES",
    "AdmissionResult",
    "BaseStore",
    "ControlChange",
    "ControlChangeRecord",
    "ControlResult",
    "Debounced",
    "Finish",
    "FiringRecord",
    "Limits",
    "MemoryScheduleStore",
    "QueueTtls",
    "RenewalBusy",
    "RetryPolicy",
    "RunRecord",
    "ScheduleRow",
    "ScheduleStore",
    "SignalRecord",
    "StepRecord",
    "Superseding",
    "Turn",
    "TurnState",
    "cancel_error",
    "control_records",
    "handed_off",
    "stamped",
]

#: Declared singleton limits by workflow name (the latest registered version's, S2).
Limits = Mapping[str, int]
#: Declared queue TTLs in seconds by workflow name (the latest registered version's, X2).
QueueTtls = Mapping[str, float]


@dataclass(frozen=True)
class RetryPolicy:
    """How long a denied waiter waits before its own retry, in seconds (S5 step 5, S8a).

    The first ``limit`` waiters of a key retry after ``seconds`` +/- ``jitter``;
    waiters further back after ``backlog_seconds`` (they are woken by the
    handoff or the tick's catch-up first).
    """

    seconds: float = 1.0
    jitter: float = 0.25
    backlog_seconds: float = 3600.0


class AdmissionResult(enum.Enum):
    """Outcome of a singleton admission (S5, S14); ``begin_turn`` admits or parks a turn itself."""

    ADMITTED = "admitted"  # a holder now (or already): run the body
    PARKED = "parked"  # denied: parked suspended with a retry wake_at, lease released
    GONE = "gone"  # no longer active or no longer ours (cancelled, fenced): do nothing


class TurnState(enum.Enum):
    """What :meth:`BaseStore.begin_turn` did."""

    RUN = "run"  # the lease is ours and the run holds its slot (or needs none): run the body
    PARKED = "parked"  # denied admission: parked as a waiter, no lease (S5 step 5)
    SKIPPED = "skipped"  # not claimable: terminal, leased by a live executor, changed under us (R6), not due (X5)
    SETTLED = "settled"  # settled in the claim: a requested cancel, or dead past MAX_RECOVERIES (D4, D6)


@dataclass(frozen=True)
class Turn:
    """Outcome of :meth:`BaseStore.begin_turn`.

    ``run`` is the run as this turn left it (None if it does not exist);
    ``recovered`` tells that an expired lease was taken over (D4);
    ``granted`` are waiters given a slot by a settle in this claim (S7);
    ``admitted`` tells that this claim gave the run its slot (not a
    confirmation of an earlier admission); ``throttled`` names the throttle
    whose full window parked it (X6); ``steps`` are the run's stored
    steps when the claim knows them (its own write returned a step count of
    0: none, and nobody else can store one under this turn's lease, R4), None
    when the engine loads them (:meth:`BaseStore.load_steps`).
    """

    state: TurnState
    run: RunRecord | None = None
    recovered: bool = False
    granted: tuple[RunRecord, ...] = ()
    admitted: bool = False
    steps: Mapping[int, StepRecord] | None = None
    #: The throttle whose full window parked the run until it opens (X6), or None.
    throttled: str | None = None


@dataclass(frozen=True)
class Superseding:
    """Outcome of :meth:`BaseStore.start_superseding` (X1): the run as stored and
    whether this call created it (R3); the waiters it replaced, settled
    ``cancelled`` with code ``replaced``; the parked holders it cancelled at
    once; the running holders it asked to stop at their next step boundary (D6).
    Only a call that created its run changed any other run."""

    run: RunRecord
    created: bool
    replaced: tuple[RunRecord, ...] = ()
    cancelled: tuple[RunRecord, ...] = ()
    stopping: tuple[RunRecord, ...] = ()


@dataclass(frozen=True)
class Debounced:
    """Outcome of :meth:`BaseStore.start_debounced` (X7): the run as stored, whether
    this call inserted it, and whether it folded this start into an open run (that
    run's input and start time changed). Neither: the start's run id was known (R3,
    X7c) and nothing changed."""

    run: RunRecord
    created: bool
    folded: bool = False


class RenewalBusy(Exception):  # noqa: N818  (a state the renewer waits out, not an error)
    """Raised by :meth:`BaseStore.renew_lease` when another transaction holds the
    run's row lock and the renewal did not wait for it (R5): nothing was written
    and the lease is not lost; the renewer tries again at the lease's next interval."""


@dataclass(frozen=True)
class Finish:
    """Outcome of a settling write: ``run`` as settled (None if the compare-and-set
    lost), and the runs its handoff sends a turn (:func:`handed_off`): the waiters its
    freed slots were granted to, oldest first (S7, X3h), then the waiters sent a turn
    as they are, whose own claims decide."""

    run: RunRecord | None
    granted: tuple[RunRecord, ...] = field(default=())

    @property
    def settled(self) -> bool:
        """Tell whether this write settled the run."""
        return self.run is not None


def handed_off(granted: Iterable[RunRecord], turns: Iterable[RunRecord]) -> tuple[RunRecord, ...]:
    """Return the runs a handoff sends a turn, in the order every store sends them (S7, X3h):
    the ones it admitted (``granted``) in their queue order (:attr:`RunRecord.queue_place`:
    higher priority first, then oldest, X8), the order of their tokens in each limit; then
    the waiters sent a turn as they are (``turns``, in their place), each once."""
    admitted = sorted(granted, key=lambda g: g.queue_place)
    seen = {g.run_id for g in admitted}
    rest: list[RunRecord] = []
    for run in turns:
        if run.run_id not in seen:
            seen.add(run.run_id)
            rest.append(run)
    return (*admitted, *rest)


@dataclass(frozen=True)
class ControlChangeRecord:
    """One recorded key-control change (K2): ``key`` is "" for a workflow-wide
    change; ``field`` is ``paused`` or ``limit_override``; ``by`` who, ``at``
    when; ``keys`` how many keys it changed."""

    workflow: str
    key: str
    field: str
    old: Any
    new: Any
    by: str
    reason: str
    at: datetime
    keys: int = 1


@dataclass(frozen=True)
class ControlChange:
    """What a key-control change sets: ``paused`` (None: unchanged) and
    ``override`` (unchanged while ``keep_override``)."""

    paused: bool | None = None
    override: int | None = None
    keep_override: bool = True


@dataclass(frozen=True)
class ControlResult:
    """A key's controls before and after a change (K2)."""

    key: str
    old_paused: bool
    old_override: int | None
    paused: bool
    override: int | None


def control_records(
    workflow: str, key: str, results: Sequence[ControlResult], by: str, reason: str, now: datetime
) -> list[ControlChangeRecord]:
    """Return one record per changed field of ``results``; a workflow-wide change (``key`` "") counts its keys."""
    out = []
    for name, before, after in (("paused", "old_paused", "paused"), ("limit_override", "old_override", "override")):
        old_of, new_of = attrgetter(before), attrgetter(after)
        changed = [r for r in results if old_of(r) != new_of(r)]
        if not changed:
            continue
        if key:
            old, new = old_of(changed[0]), new_of(changed[0])
        else:
            olds = {old_of(r) for r in changed}
            old = olds.pop() if len(olds) == 1 else "mixed"
            new = new_of(changed[0])
        out.append(ControlChangeRecord(workflow, key, name, old, new, by, reason, now, keys=len(changed)))
    return out


@dataclass
class ScheduleRow:
    """A schedule's stored state, as the store hands it to the firing code.

    ``locked_at``: set by :meth:`ScheduleStore.locked` only, the time the
    windows are decided by: the store's clock read under the row's lock, or
    the caller's ``now`` (R8).
    """

    spec: Schedule
    source: str
    paused: bool
    next_fire_at: datetime | None
    last_window_at: datetime | None = None
    last_run_id: str | None = None
    locked_at: datetime | None = None


@dataclass(frozen=True)
class FiringRecord:
    """One window's outcome, as stored (:class:`~durable_singleton.models.ScheduleFiring`)."""

    schedule: str
    window_at: datetime
    run_id: str
    outcome: str
    detail: str = ""
    #: When the outcome was recorded: the :attr:`ScheduleRow.locked_at` of the
    #: firing (R8); None on a record not yet stored.
    recorded_at: datetime | None = None


class ScheduleStore(ABC):
    """Where a store keeps schedule state (S17): :meth:`BaseStore.schedule_state` returns one.

    Every ``now`` is the caller's time (an aware datetime: a test's clock, an
    engine's injected one), or None: then the store reads its own clock (the
    database's) at the moment it writes, so a process clock that stepped never
    decides a window or moves a cursor (R8).
    """

    @abstractmethod
    def sync_declared(self, specs: Sequence[Schedule], now: datetime | None) -> None:
        """Create a row for each code-declared schedule, or update its spec if it changed;
        a new row, or a change of timing, puts the cursor at the first window >= ``now``."""

    @abstractmethod
    def due(self, now: datetime | None, batch: int) -> list[str]:
        """Return the names of at most ``batch`` unpaused schedules due by ``now``, oldest first."""

    @abstractmethod
    def locked(self, name: str, now: datetime | None) -> Any:
        """Context manager: yield the row of ``name`` under its lock if it is still due by
        ``now`` (None: the store's clock, read once the lock is held), else None; the row's
        ``locked_at`` is that time. What the body sets on the row (and :meth:`record`) is
        saved on exit."""

    @abstractmethod
    def record(self, firing: FiringRecord) -> None:
        """Store one window's outcome (at most one per schedule and window), recorded at
        ``firing.recorded_at`` (None: the store's clock)."""

    @abstractmethod
    def set_paused(self, name: str, paused: bool, now: datetime | None) -> bool:
        """Pause or resume ``name``. Resuming keeps the cursor: the windows that passed while
        it was paused are due, and the next firing picks them by the schedule's catch-up
        policy (S17). Return False if there is no such schedule."""

    @abstractmethod
    def firings(self, name: str) -> list[FiringRecord]:
        """Return the recorded window outcomes of ``name``, oldest window first."""

    @abstractmethod
    def get(self, name: str) -> ScheduleRow | None:
        """Return the row of ``name``, or None."""


class MemoryScheduleStore(ScheduleStore):
    """Schedule state in this process's memory, one lock for all schedules: the
    default of :meth:`BaseStore.schedule_state`. ``clock`` is the store's clock
    (a ``now`` of None reads it)."""

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self._lock = threading.RLock()
        self._rows: dict[str, ScheduleRow] = {}
        self._firings: dict[tuple[str, datetime], FiringRecord] = {}
        self._clock = clock or (lambda: datetime.now(UTC))

    def sync_declared(self, specs: Sequence[Schedule], now: datetime | None) -> None:
        with self._lock:
            now = now or self._clock()
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

    def due(self, now: datetime | None, batch: int) -> list[str]:
        with self._lock:
            now = now or self._clock()
            due = [r for r in self._rows.values() if not r.paused and r.next_fire_at and r.next_fire_at <= now]
            due.sort(key=lambda r: (r.next_fire_at, r.spec.name))
            return [r.spec.name for r in due[:batch]]

    @contextmanager
    def locked(self, name: str, now: datetime | None) -> Iterator[ScheduleRow | None]:
        with self._lock:
            now = now or self._clock()
            row = self._rows.get(name)
            if row is None or row.paused or row.next_fire_at is None or row.next_fire_at > now:
                yield None
                return
            work = replace(row, locked_at=now)
            yield work
            self._rows[name] = replace(work, locked_at=None)

    def record(self, firing: FiringRecord) -> None:
        with self._lock:
            stored = replace(firing, recorded_at=firing.recorded_at or self._clock())
            self._firings.setdefault((firing.schedule, firing.window_at), stored)

    def set_paused(self, name: str, paused: bool, now: datetime | None) -> bool:
        with self._lock:
            row = self._rows.get(name)
            if row is None:
                return False
            row.paused = paused
            return True

    def firings(self, name: str) -> list[FiringRecord]:
        with self._lock:
            return sorted((f for (n, _), f in self._firings.items() if n == name), key=lambda f: f.window_at)

    def get(self, name: str) -> ScheduleRow | None:
        with self._lock:
            row = self._rows.get(name)
            return replace(row) if row is not None else None


def stamped(run: RunRecord, backlog_wake_at: datetime | None, now: datetime) -> tuple[RunRecord, datetime | None]:
    """``run`` and its backlog wake moved so that it is created at ``now``, the store's
    clock, its other times keeping their distance to its creation: how a store with
    ``stamps_starts`` writes a start's ``created_at`` (R8)."""
    shift = now - run.created_at
    run = run.evolve(
        created_at=run.created_at + shift,
        updated_at=run.updated_at + shift,
        wake_at=run.wake_at + shift if run.wake_at is not None else None,
        deadline_at=run.deadline_at + shift if run.deadline_at is not None else None,
    )
    return run, backlog_wake_at + shift if backlog_wake_at is not None else None


class BaseStore(ABC):
    """Durable storage of runs, steps and signals: the methods the engine calls.

    Capability flags:

    ``supports_atomic_admission``
        True when :meth:`begin_turn` admits inside one transaction that
        serializes competing claims of a key (S5, S13). A store that sets it
        False gets the engine's scan fallback, which can briefly over-admit,
        and a :class:`~durable_singleton.exceptions.SingletonFallbackWarning` (S14).
    ``supports_bulk_start``
        True when :meth:`create_runs` writes a batch in one statement.
    ``supports_key_controls``
        True when the store keeps runtime key controls (K2: pause, limit
        override, their records) and its claim reads them under the key's
        lock (:meth:`apply_key_controls`). False (the default): a change raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError`; reads
        say no key is paused or overridden.
    ``supports_on_busy``
        True when :meth:`start_superseding` replaces waiters and stops holders
        under the key's lock with the insert (X1). False (the default): a
        start of a workflow declared ``on_busy="replace_queued"`` or
        ``"cancel_in_progress"`` raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError` and
        writes nothing. (``"skip"`` needs nothing of a store: it is the queue cap.)
    ``supports_schedules``
        True when :meth:`schedule_state` keeps schedule state in the store,
        shared by every process that uses it (S17). False (the default): in
        this process's memory (:class:`MemoryScheduleStore`), so each process
        fires from its own cursor; a window's run still starts once, by its
        run id (R3).
    ``supports_quotas``
        True when a claim admits a run that carries shared quotas only when
        each of its limits has room, under the locks of all of them, and a
        settle frees its quota slots (X3); it needs ``supports_atomic_admission``
        too (:attr:`admits_quotas`). False (the default): a start of a
        workflow that declares ``quotas`` raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError` and
        writes nothing.
    ``supports_debounce``
        True when :meth:`start_debounced` folds a start into its debounce
        key's open run under that key's lock (X7). False (the default): a
        start of a workflow declared with ``debounce`` raises
    ``supports_throttles``
        True when a claim admits a run that carries throttles (X6) only when
        each throttle key has admitted fewer than its limit within the last
        ``period`` seconds on the store's clock, records the admission in the
        same transaction, and parks an over-rate run with its ``wake_at`` at the
        window's opening; it needs :attr:`admits_quotas` too (a throttle
        carrier waits as a quota carrier does). False (the default): a start of
        a workflow that declares ``throttles`` raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError` and
        writes nothing.
    ``supports_queue_ttl``
        True when :meth:`expire_waiter` ends a waiter by a compare-and-set
        that refuses a run admitted meanwhile (X2). False (the default): the
        tick ends no waiter by its ``queue_ttl`` and logs a warning once.
    ``supports_slot_repairs``
        True when the slot audit's repairs (:meth:`drop_holder_marker`,
        :meth:`wake_waiter`, :meth:`redrive_lease`) write their
        compare-and-sets (K4). False (the default): each returns False and
        writes nothing, so ``audit_slots(repair=True)`` reports its findings
        unrepaired.

    Times: every "now" comparison (lease expiry, wake times, deadlines) is
    made on the store's clock (:meth:`now`), never the caller's (R5).
    """

    supports_atomic_admission: bool = True
    supports_bulk_start: bool = False
    supports_key_controls: bool = False
    supports_on_busy: bool = False
    supports_schedules: bool = False
    supports_queue_ttl: bool = False
    supports_quotas: bool = False
    supports_debounce: bool = False
    supports_throttles: bool = False
    supports_slot_repairs: bool = False

    @property
    def admits_quotas(self) -> bool:
        """Whether a start of a workflow that declares quotas is accepted (X3): the
        store says ``supports_quotas`` and admits in its own claim
        (``supports_atomic_admission``); the S14 fallback's scan knows no quota."""
        return bool(self.supports_quotas and self.supports_atomic_admission)

    #: True when :meth:`start_run` with ``stamp`` writes a run's ``created_at``
    #: on the store's own clock at the insert (R8), so the engine need not read
    #: that clock before a start.
    stamps_starts: bool = False
    #: The codec payloads are stored encoded with (a
    #: :class:`~durable_singleton.stores.codec.CodecStore`'s), or None: stored as given.
    codec: Codec | None = None

    # -- the clock ---------------------------------------------------------
    @abstractmethod
    def now(self) -> datetime:
        """Return the store's current time (aware, UTC): the clock of leases (R5)."""

    # -- connections -----------------------------------------------------------
    @property
    def database(self) -> str | None:
        """Return the Django database alias this store keeps its data in (its
        transactions and on-commit hooks are that database's), or None for a
        store outside Django's databases (the default)."""
        return None

    def is_unreachable(self, exc: BaseException) -> bool:
        """Tell whether ``exc``, raised by a call to this store, means the
        store could not be reached (a dropped connection, a restart, a
        timeout) rather than a fault of the call itself. A body whose store
        call fails so is interrupted, not failed (docs/durability.rst). The
        default: ``ConnectionError`` and ``TimeoutError``."""
        return isinstance(exc, (ConnectionError, TimeoutError))

    def transaction_depth(self) -> int:
        """Return how many transactions this thread has open on the store's
        database (nested ``transaction.atomic()`` blocks count one each). A
        body's context compares it with the depth at the start of its turn,
        so a ``ctx`` write inside a transaction the body opened raises
        :class:`~durable_singleton.exceptions.StepInTransactionError` instead
        of holding the run's row lock (R5). The default: 0 (a store outside
        Django's databases has no transaction a body could hold open)."""
        return 0

    def discard_broken_connection(self) -> None:
        """Drop this thread's connection to the store if a failure left it
        unusable, so the next call opens a new one. The default does nothing
        (a store without connections)."""
        return None

    #: True when :meth:`start_run_with_notice` writes a run and its turn notice together.
    writes_turn_notices: bool = False

    def start_run_with_notice(
        self,
        run: RunRecord,
        *,
        queue: str | None,
        cap: int | None,
        cap_namespace: str | None = None,
        deep_limit: int | None = None,
        backlog_wake_at: datetime | None = None,
        stamp: bool = False,
    ) -> tuple[RunRecord, bool]:
        """:meth:`start_run`, and in the same transaction, if it created ``run``
        and did not park it behind a deep queue (S8a), the run's turn notice
        for ``queue`` (None: the default queue) (``DISPATCH = "worker"``, O1a,
        O7). Outside a caller's transaction a named transient error retries
        both together; inside one they commit or roll back with it. Raises
        what :meth:`start_run` raises, and
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError` on a
        store without ``writes_turn_notices`` (the default)."""
        raise UnsupportedByStoreError(f"store {type(self).__name__} writes no turn notices")

    def in_transaction(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` in one transaction of the store's database and return its
        result: the writes of ``fn`` (a start and its turn notice, O1a, O7)
        commit together or not at all. Outside a caller's transaction a named
        transient error rolls ``fn`` back whole and it is called again, a
        bounded number of times; inside one, ``fn`` joins it (a savepoint) and
        its error is raised (the caller's transaction is what retries). The
        default calls ``fn`` (a store outside Django's databases has no
        transaction)."""
        return fn()

    # -- starting ------------------------------------------------------------
    @abstractmethod
    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        """Insert ``run`` unless ``run_id`` exists; return (run, created) (R3).

        With ``cap`` set (the declared ``limit + max_queue_depth``; the run's
        ``singleton_limit`` is the declared limit), the existence check, the
        count of the key's active runs (in ``cap_namespace`` if given) and the
        insert are serialized on the key; raises
        :class:`~durable_singleton.exceptions.SingletonQueueFullError` when the
        count reached the cap in force, writing nothing (S15, S16): a store
        with key controls applies the key's runtime override with
        :func:`~durable_singleton.admission.cap_in_force` (K2). Each of the
        run's ``quota_caps`` is counted the same way on its quota key (its
        active members, holders and waiters, of every workflow), under the
        quota key's lock taken before the singleton key's (X3e), and a full
        one raises :class:`~durable_singleton.exceptions.QuotaQueueFullError`
        (X3j). An existing ``run_id`` is returned, never rejected.
        """

    def start_run(
        self,
        run: RunRecord,
        *,
        cap: int | None,
        cap_namespace: str | None = None,
        deep_limit: int | None = None,
        backlog_wake_at: datetime | None = None,
        stamp: bool = False,
    ) -> tuple[RunRecord, bool]:
        """Insert ``run`` as :meth:`create_run` does, created parked when its key's queue is deep (S8a).

        With ``deep_limit`` (the declared limit) and a key, a run whose key already
        has as many holders and waiters as its limit in force
        (:meth:`queue_is_deep` with :func:`~durable_singleton.admission.limit_in_force`
        of ``deep_limit`` and the key's runtime override, K2) is created with
        ``wake_at`` = ``backlog_wake_at``
        and the park reason ``singleton``: it waits for the handoff or the tick's
        catch-up instead of a turn that could only park. Returns (the run as
        stored, created): an existing ``run_id`` is returned as stored (R3, S16).
        Raises :class:`~durable_singleton.exceptions.SingletonQueueFullError` as
        :meth:`create_run` does. ``stamp`` (only asked of a store with
        ``stamps_starts``): ``created_at`` is a provisional time; the store
        writes its own clock's now instead and moves ``updated_at``,
        ``wake_at``, ``deadline_at`` and ``backlog_wake_at`` by the same amount
        (R8). This default makes the two calls; a store may fold the check
        into its insert.
        """
        if stamp and self.stamps_starts and run.created_at.tzinfo is not None:
            run, backlog_wake_at = stamped(run, backlog_wake_at, self.now())
        if run.singleton_key is not None and deep_limit is not None:
            from ..admission import limit_in_force

            override = self.key_control_state(run.workflow_name, run.singleton_key)[1]
            limit = limit_in_force(deep_limit, override)
            if self.queue_is_deep(run.workflow_name, run.singleton_key, limit, priority=run.priority):
                run = replace(run, wake_at=backlog_wake_at, park_reason=ParkReason.SINGLETON.value)
        return self.create_run(run, cap=cap, cap_namespace=cap_namespace)

    def create_runs(
        self, runs: Sequence[RunRecord], *, caps: Mapping[str, int | None], cap_namespace: str | None = None
    ) -> list[tuple[RunRecord, bool] | BaseException]:
        """Insert a batch; per run, (run, created) or the exception its start raised.

        ``caps`` maps a workflow name to its cap (``limit + max_queue_depth``).
        The default inserts one by one; a store may do it in one statement.
        """
        results: list[tuple[RunRecord, bool] | BaseException] = []
        for run in runs:
            try:
                results.append(self.create_run(run, cap=caps.get(run.workflow_name), cap_namespace=cap_namespace))
            except Exception as exc:  # reported per run, as a single start would raise it
                results.append(exc)
        return results

    def lock_superseding_batch(self, runs: Sequence[RunRecord]) -> None:
        """Before a batch of superseding starts (``start_many`` of a workflow declared
        ``on_busy="replace_queued"`` or ``"cancel_in_progress"``, one
        :meth:`start_superseding` per run, in input order): lock every key those starts
        lock, all at once in the one global order, when they share one transaction that
        holds each lock to its commit (X3e, X1). Two such batches over the same keys in
        other orders would otherwise each hold a key the other waits for. ``runs``: the
        batch's new runs, each with its singleton key. The default does nothing (a store
        without row locks, or one whose starts commit one by one)."""
        return None

    def start_superseding(
        self, run: RunRecord, *, on_busy: str, limits: Limits, cap_namespace: str | None = None
    ) -> Superseding:
        """Insert ``run`` unless ``run_id`` exists, replacing and stopping the key's
        other runs as ``on_busy`` says, all under the key's lock in one transaction (X1).
        The run's ``quota_caps`` are counted as :meth:`create_run` counts them (in
        ``cap_namespace`` if given), without the runs this start ends at once (the
        waiters it replaces, the parked holders it cancels): a full quota key
        raises :class:`~durable_singleton.exceptions.QuotaQueueFullError` and
        nothing is written (X3j).

        ``run`` has a singleton key; ``on_busy`` is ``"replace_queued"`` or
        ``"cancel_in_progress"``. Under the lock: an existing ``run_id`` is
        returned and nothing changes (R3); else the key's active runs are read,
        :func:`~durable_singleton.admission.superseded` names the waiters to
        replace (each settled ``cancelled`` with :data:`REPLACED_ERROR` by a
        compare-and-set on its status as read, R5a) and the holders to stop (a
        running one gets its cancel requested, as :meth:`request_cancel` does;
        a parked one is settled ``cancelled`` at once), and the run is inserted
        ``pending``, a waiter like any other (S5). No slot is granted here: the
        run's own turn claims it. The default raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError`
        (``supports_on_busy`` False).
        """
        raise UnsupportedByStoreError(
            f"store {type(self).__name__} cannot start with on_busy={on_busy!r} (supports_on_busy is False)"
        )

    def start_debounced(
        self,
        run: RunRecord,
        *,
        seconds: float,
        max_seconds: float,
        timeout: float | None,
        cap: int | None,
        cap_namespace: str | None = None,
        explicit_id: bool = False,
    ) -> Debounced:
        """Start ``run`` (its ``debounce_key`` set) as a debounced start, in one
        transaction under the debounce key's lock, taken before any other key's (X7, S13).

        Under the lock: a run with ``run_id``, or a start of that id folded
        before (X7c), is returned and nothing changes (R3). Else the key's open
        run (X7a: of the workflow, namespace, singleton key and quota keys of
        ``run``, ``pending``, holding no slot and no lease, its ``not_before``
        later than the store's now) takes ``run``'s input, and its
        ``not_before`` and ``wake_at`` become the store's now plus ``seconds``,
        at most its ``debounce_until``, its ``deadline_at`` that plus
        ``timeout`` seconds (D5), by a compare-and-set on that state (R5a); with
        ``explicit_id`` the start's id is recorded as folded into it (X7c).
        Without an open run, ``run`` is inserted as :meth:`create_run` does (its
        caps counted, S15, X3j) with ``created_at`` the store's now,
        ``not_before`` and ``wake_at`` that plus ``seconds`` and
        ``debounce_until`` that plus ``max_seconds``: a delayed start (X5).
        Times on the store's clock (R5). The default raises
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError`
        (``supports_debounce`` False).
        """
        raise UnsupportedByStoreError(
            f"store {type(self).__name__} cannot debounce starts (supports_debounce is False)"
        )

    @abstractmethod
    def get_run(self, run_id: str) -> RunRecord | None:
        """Return the run, or None."""

    @abstractmethod
    def queue_is_deep(self, workflow_name: str, key: str, limit: int, *, priority: int = 0) -> bool:
        """Tell whether the key already has ``limit`` holders and ``limit`` waiters
        that a start of ``priority`` queues behind, those of a priority at least
        its own (S8a, X8)."""

    # -- a turn ----------------------------------------------------------------
    def begin_turn(
        self,
        run_id: str,
        owner: str,
        *,
        lease_seconds: float,
        limits: Limits,
        max_recoveries: int,
        retry: RetryPolicy,
        known: RunRecord | None = None,
        ttls: QueueTtls | None = None,
    ) -> Turn:
        """Take ``run_id``'s lease for one turn and admit or park it (S4, S5, R5, R6).

        Claimable: a parked run, or a running run whose lease expired on the
        store's clock (a recovery, which counts ``recoveries``). In one
        transaction: a run with a requested cancel is settled ``cancelled``
        and one past ``max_recoveries`` settles ``dead``, both granting the
        freed slot (``SETTLED``); a holder's claim is a confirmation; a waiter
        is admitted when it is among the oldest waiters that fit the key's free
        slots (``RUN``), else parked with a retry ``wake_at`` (``PARKED``). A
        parked run whose ``not_before`` has not come on the store's clock
        (:func:`~durable_singleton.admission.is_due`) is not claimed
        (``SKIPPED``) and its ``wake_at`` is set to its ``not_before``; the free
        slots skip it for the due waiters behind it (X5).

        ``known`` is the run as this process just granted it (a handoff); a
        store may use it to skip its first read. ``ttls``: the declared
        ``queue_ttl`` in seconds by workflow name (``Engine.queue_ttls()``;
        None or a workflow not named: no TTL); a waiter past its TTL by the
        store's clock (:func:`~durable_singleton.admission.waiter_expired`) is
        granted no slot, the claimant included (it is parked; the tick ends it,
        X2), and so in every grant below.

        This default, for a store without an atomic claim, is a read followed
        by a decision (S14): it can briefly over-admit.
        """
        from ..admission import Candidate, decide_admission, declared_limit, limit_in_force, retry_delay, turn_rung

        now = self.now()
        seen = self.get_run(run_id)
        expired = seen is not None and (seen.lease_expires_at is None or seen.lease_expires_at <= now)
        due = seen is not None and is_due(seen.not_before, now)
        rung = turn_rung(seen, expired=expired, due=due, max_recoveries=max_recoveries)
        if rung is Rung.SKIP or rung is Rung.NOT_DUE:
            # Gone, finished or leased (R6); or a delayed start before its time (X5): its wake_at is not_before.
            return Turn(TurnState.SKIPPED, seen)
        turn = self.claim_run(run_id, owner, lease_seconds)
        run = turn.run
        if turn.state is not TurnState.RUN or run is None:
            return turn
        if rung is Rung.CANCEL or rung is Rung.DEAD or run.cancel_requested:
            status, error = RunStatus.CANCELLED, cancel_error(run.deadline_at, now)
            if rung is Rung.DEAD and not run.cancel_requested:
                status, run = RunStatus.DEAD, run.evolve(recoveries=run.recoveries + 1)
                error = {"code": "max_recoveries", "message": f"lease expired {run.recoveries} times"}
            done = self.finish(run, owner, status, error=error, limits=limits, ttls=ttls)
            return Turn(TurnState.SETTLED, done.run or run, granted=done.granted)
        if run.singleton_key is None or run.admitted:
            return turn  # no key, or a holder (S6); the fallback knows no quota (X3 needs an atomic claim)
        limit = limit_in_force(declared_limit(limits, run.workflow_name, (run.singleton_limit,)))
        candidates = [
            Candidate(r.run_id, r.created_at, r.status, r.tags, r.not_before, r.priority)
            for r in self.active_runs_for_key(run.workflow_name, run.singleton_key)
        ]
        if decide_admission(candidates, run_id, limit, self.now(), (ttls or {}).get(run.workflow_name)):
            return Turn(TurnState.RUN, run.evolve(admitted=True), recovered=turn.recovered, admitted=True)
        wake = self.now() + _seconds(retry_delay(retry.seconds, retry.jitter))
        if self.park(run_id, owner, RunStatus.SUSPENDED, wake_at=wake, reason=ParkReason.SINGLETON) == Verdict.PARKED:
            return Turn(TurnState.PARKED, run)
        return Turn(TurnState.SKIPPED, run)

    def claim_run(self, run_id: str, owner: str, lease_seconds: float) -> Turn:
        """Take the lease without admission (used by the S14 fallback of :meth:`begin_turn`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither begin_turn nor claim_run")

    @abstractmethod
    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend an unexpired lease held by ``owner`` to now + ``lease_seconds`` (R5).

        An expired lease is never renewed: its holder is fenced from then on.
        A store whose rows lock may raise :class:`RenewalBusy` instead of waiting
        for another transaction's lock on the run's row.
        """

    @abstractmethod
    def check_boundary(self, run_id: str, owner: str, lease_seconds: float) -> str:
        """At a step boundary renew the lease; return "ok", "cancelled" or "fenced" (R5, D6)."""

    @abstractmethod
    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        """Store a step result if ``owner`` still leases the run and no cancel
        was requested (R4, R5a); False if fenced or the position exists."""

    @abstractmethod
    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        """Return the run's memoized steps by position (R4)."""

    @abstractmethod
    def park(self, run_id: str, owner: str, status: str, *, wake_at: datetime | None, reason: str = "") -> str:
        """Park a running run leased by ``owner`` as ``suspended`` or ``blocked`` (D1-D3).

        Returns "parked"; "cancelled" when a cancel was requested (nothing is
        written: the caller settles the run cancelled, D6); or "fenced".
        """

    @abstractmethod
    def finish(
        self,
        run: RunRecord,
        owner: str | None,
        status: str,
        *,
        output: Any = None,
        error: Any = None,
        limits: Limits,
        expect: Sequence[str] | None = None,
        finished_at: datetime | None = None,
        ttls: QueueTtls | None = None,
    ) -> Finish:
        """Settle a run terminal and grant its freed slot, in one transaction (R2, S7, S12).

        With ``owner``: only a running run ``owner`` leases unexpired. Without:
        only a run whose status is in ``expect`` (default: parked statuses),
        never a running one (R5a). The same write drops the markers; the
        oldest waiters that fit the key's free slots become holders with a
        fencing token (K1) and are returned, to be dispatched; a waiter past
        its ``queue_ttl`` in ``ttls`` (seconds by workflow name, as in
        :meth:`begin_turn`) by the store's clock is skipped (X2). ``finished_at``
        stamps the run (default: the store's clock).
        """

    # -- operator actions --------------------------------------------------------
    @abstractmethod
    def request_cancel(
        self, run_id: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> Finish | RunRecord | None:
        """Cancel a run (D6): a parked run settles ``cancelled`` at once (a
        :class:`Finish` with its grants, skipping waiters past their TTL in
        ``ttls``, X2); a running run is marked and stops at its next step
        boundary (the run is returned). None if not found; a terminal run is
        returned unchanged."""

    @abstractmethod
    def reset_for_retry(self, run_id: str, redelivery_seconds: float, deadline_at: datetime | None) -> RunRecord | None:
        """Put a failed or dead run back to ``pending`` as a waiter with its stored key (D9)."""

    @abstractmethod
    def release(
        self, workflow_name: str, key: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> tuple[RunRecord, ...]:
        """Grant the key's free slots to its oldest waiters, skipping those past
        their TTL in ``ttls`` (X2); return them (S7, S8)."""

    def quota_queue(self, name: str, key: str, run_id: str) -> tuple[int | None, int, list[str]]:
        """Return the place of ``run_id`` in the queue of the quota key
        ``(name, key)`` (X3, K3): its 1-based position among the key's due
        waiters oldest first (None if not among them), their number, and the
        holders' run ids. The default (``supports_quotas`` False): (None, 0, [])."""
        return None, 0, []

    def throttle_state(self, name: str, key: str, period: float) -> tuple[int, datetime | None]:
        """Return (admissions of the throttle key ``(name, key)`` within the last
        ``period`` seconds on the store's clock, when the oldest of them leaves the
        window) (X6, K3), without locks. The default: (0, None)."""
        return 0, None

    def wake_throttled(self, name: str, key: str, limit: int, *, retrying: bool = True) -> tuple[RunRecord, ...]:
        """Make parked waiters of the throttle key ``(name, key)`` due now and return them
        as stored, in the queue order (``admission.QUEUE_ORDER``, X8a): the first ``limit``
        (an int >= 1) parked over the rate (park reason ``throttled:``, X6d) get their
        ``not_before`` and ``wake_at`` at the store's now; with ``retrying``, every waiter
        parked on its retry delay (``singleton``: the key was paused, or another limit held
        it back) and already due by ``not_before`` gets its ``wake_at``, however many: no
        window's opening wakes such a waiter, and one behind the limit was parked on the
        backlog's delay (``BACKLOG_RETRY_SECONDS``), so a resume that woke only the first
        left the others at the key's front for that long. Each is a compare-and-set on the
        run still parked so. No admission is decided here: their own claims count the
        window (those it denies are parked until their window opens). Called after a key
        control that admits more (K2), and without ``retrying`` after a waiter of the key
        left its queue unadmitted (a cancel, its ``queue_ttl``, X6d).
        The default (``supports_throttles`` False): none."""
        return ()

    def prune_throttle_admissions(self, periods: Mapping[str, float], batch: int) -> int:
        """Delete up to ``batch`` recorded throttle admissions that no window counts
        any more: older than their throttle's ``period`` in ``periods`` (by name) on
        the store's clock (X6); return how many. The default: 0."""
        return 0

    def quota_tokens(self, run_id: str) -> dict[str, int]:
        """Return the fencing token of each quota slot the run holds, by quota
        name (X3f); empty if it holds none. The default (``supports_quotas``
        False) holds none."""
        return {}

    @abstractmethod
    def delete_run(self, run_id: str) -> RunRecord | None:
        """Delete a run with its steps and signals; return what was deleted."""

    @abstractmethod
    def add_signal(self, run_id: str, name: str, payload: Any, *, signal_id: str | None = None) -> RunRecord | None:
        """Buffer a signal for an active run and make a run waiting on it due (D2); None if not active.

        With ``signal_id``, a signal of the run with that id already stored
        (by any process, whatever the run's status since) is kept and nothing
        is stored: the run is returned (first wins, D2).
        """

    @abstractmethod
    def load_signals(self, run_id: str) -> list[SignalRecord]:
        """Return the run's buffered signals in the order they were sent."""

    @abstractmethod
    def children(self, run_id: str) -> list[str]:
        """Return the ids of the active children of ``run_id`` (D6, D7)."""

    def children_of_cancelled(self, batch: int) -> list[str]:
        """Return up to ``batch`` ids of active runs whose parent is cancelled,
        oldest first, leaving out running ones already marked for
        cancellation (they stop at their next boundary): the cancel cascades
        the tick finishes (D6). The default scans :meth:`list_runs`; a store
        with a query language answers it in one query."""
        runs = self.list_runs()
        cancelled = {r.run_id for r in runs if r.status == RunStatus.CANCELLED}
        return [
            r.run_id
            for r in runs
            if r.parent_run_id in cancelled
            and not r.is_terminal
            and not (r.status == RunStatus.RUNNING and r.cancel_requested)
        ][:batch]

    # -- the tick --------------------------------------------------------------
    @abstractmethod
    def due_runs(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Take up to ``batch`` parked runs whose ``wake_at`` came, oldest first; push
        their ``wake_at`` by ``redelivery_seconds`` so no other tick sends them
        again meanwhile (S7a, S8); return (run_id, workflow_name)."""

    def seconds_to_next_wake(self, horizon: float) -> float | None:
        """Return the seconds from the store's clock's now to the earliest ``wake_at``
        of a parked run, if one comes within ``horizon`` seconds (0 when one is due
        already); None if none does, or if the store does not say (the default: the
        tick's period alone paces the wakes). The embedded and pulling workers' tick
        thread sleeps until then and sends the due runs, so a run parked until a
        time (a throttle's opening, X6d; a delayed start, X5) is sent at its time
        rather than at the next tick (S8)."""
        return None

    @abstractmethod
    def expired_leases(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Take up to ``batch`` running runs whose lease expired, oldest first, the
        same way (D4, S8b); return (run_id, workflow_name)."""

    @abstractmethod
    def overdue_runs(self, batch: int) -> list[RunRecord]:
        """Return up to ``batch`` active runs whose execution deadline passed (D5)."""

    def expired_waiters(self, ttls: QueueTtls, batch: int) -> list[RunRecord]:
        """Return up to ``batch`` waiters that outlived their workflow's queue TTL (X2), oldest first.

        ``ttls``: seconds by workflow name (workflows not named have none). A
        waiter is a parked tracked run of a key without a slot (S5, S12); it outlived ``ttl``
        when :func:`~durable_singleton.admission.queue_ttl_expired` says so at
        the store's clock (R5). Reads only: :meth:`expire_waiter` decides. The
        default scans :meth:`list_runs`; a store with a query language answers
        it in one query.
        """
        if not ttls:
            return []
        now = self.now()
        runs = [
            r
            for r in self.list_runs()
            if r.workflow_name in ttls
            and r.singleton_key is not None
            and r.tracked
            and r.is_parked
            and not r.holds_slot
            and queue_ttl_expired(r.created_at, ttls[r.workflow_name], now)
        ]
        return sorted(runs, key=lambda r: (r.created_at, r.run_id))[:batch]

    def expire_waiter(self, run: RunRecord, ttl: float, *, limits: Limits, ttls: QueueTtls | None = None) -> Finish:
        """End waiter ``run`` ``cancelled`` with ``QUEUE_TTL_ERROR`` and grant the
        slots its key has free, in one transaction (X2, S7, R5a).

        A compare-and-set: only if the run is still a parked waiter of its key
        (no slot: a run admitted since it was read keeps its slot and runs)
        and, by the store's clock, outlived ``ttl`` seconds from its
        ``created_at``; the freed slots skip the waiters past their TTL in
        ``ttls`` (X2). Returns an unsettled :class:`Finish` otherwise. The
        default raises :class:`~durable_singleton.exceptions.UnsupportedByStoreError`
        (``supports_queue_ttl`` is False).
        """
        raise UnsupportedByStoreError(f"{type(self).__name__} cannot end waiters by their queue_ttl (X2)")

    @abstractmethod
    def request_timeout_cancel(self, run_id: str) -> bool:
        """Mark a running run for cancellation at its next boundary if it is still running (D5, R5a)."""

    @abstractmethod
    def catch_up(self, *, limits: Limits, batch: int, ttls: QueueTtls | None = None) -> tuple[RunRecord, ...]:
        """Grant the free slots of up to ``batch`` keys that have waiters,
        skipping those past their TTL in ``ttls`` (S8a, S8b, X2), and those whose
        first waiters all carry quotas without room for them (X3h): a grant would
        only send them turns that park them again."""

    # -- reads -----------------------------------------------------------------
    @abstractmethod
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        """Return the active runs of one workflow and key (any namespace), oldest first."""

    @abstractmethod
    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        """Count the key's active runs, in ``namespace`` if given (S15)."""

    # -- key controls (K2) -------------------------------------------------------
    def apply_key_controls(
        self,
        workflow: str,
        keys: Sequence[str] | None,
        change: ControlChange,
        *,
        by: str,
        reason: str,
        now: datetime,
    ) -> list[ControlResult]:
        """Apply ``change`` to each of ``keys`` (None: every key of ``workflow``
        the store knows), each under the key's claim lock, and record it
        (:func:`control_records`) in the same transaction; return each key's
        controls before and after. A claim that runs after the change sees it (S5).

        The default raises :class:`~durable_singleton.exceptions.UnsupportedByStoreError`
        (``supports_key_controls`` False).
        """
        raise UnsupportedByStoreError(
            f"store {type(self).__name__} keeps no key controls (supports_key_controls is False)"
        )

    def key_control_state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        """Return (paused, limit override or None) of one key (K2). The default: (False, None)."""
        return False, None

    def key_control_history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        """Return the newest ``limit`` recorded changes of a key (with its
        workflow-wide ones), or of a workflow (``key`` None), newest first (K2).
        The default: none."""
        return []

    # -- schedule state ----------------------------------------------------------
    def schedule_state(self, codec: Codec | None = None) -> ScheduleStore:
        """Return where this store keeps schedule state (S17): the same object
        at every call. ``codec`` encodes the stored schedule inputs (a
        :class:`~durable_singleton.stores.codec.CodecStore` passes its own). The
        default keeps the state in this process's memory, where nothing is
        encoded (``supports_schedules`` False)."""
        with _schedule_states_lock:
            found = _schedule_states.get(self)
            if found is None:
                store = weakref.ref(self)  # the state must not keep its store alive

                def clock() -> datetime:
                    owner = store()
                    assert owner is not None, "a store's schedule state outlived the store"
                    return owner.now()

                found = _schedule_states[self] = MemoryScheduleStore(clock)
            return found

    @abstractmethod
    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        """Return runs, oldest first (for tests, the demo and tooling)."""

    # -- reads and writes for the services (explain, commands, worker, heartbeat) --
    # The services call these instead of reaching the ORM behind ``database``.
    # The defaults serve any store from the methods above; the Django store
    # answers each in bounded queries on the database's clock.

    def select_runs(
        self,
        *,
        limit: int,
        run_ids: Sequence[str] = (),
        workflow_name: str | None = None,
        key: str | None = None,
        statuses: Sequence[str] = (),
        created_before: datetime | None = None,
        namespace: str | None = None,
        oldest_first: bool = False,
    ) -> list[RunRecord]:
        """Return at most ``limit`` runs (>= 0) that match every filter given:
        ``run_ids`` (empty: any), exact ``workflow_name`` and singleton ``key``,
        ``statuses`` (empty: any), created before ``created_before``, in
        ``namespace`` (None: any). Newest first, or oldest first with
        ``oldest_first`` (by creation, then run id)."""
        wanted = set(run_ids)
        runs = [
            r
            for r in self.list_runs(workflow_name=workflow_name, namespace=namespace)
            if (not wanted or r.run_id in wanted)
            and (key is None or r.singleton_key == key)
            and (not statuses or r.status in statuses)
            and (created_before is None or r.created_at < created_before)
        ]
        if not oldest_first:
            runs.reverse()
        return runs[:limit]

    def key_queue(self, run: RunRecord, named: int) -> KeyQueue:
        """Return the queue of ``run``'s singleton key as ``run`` sees it (S5,
        X5): its oldest ``named`` holders (>= 0), how many hold and wait, and
        the due and not-due waiters ahead of ``run``, on the store's clock.
        ``run`` must have a singleton key."""
        assert run.singleton_key is not None
        active = list(self.active_runs_for_key(run.workflow_name, run.singleton_key))
        order = attrgetter("created_at", "run_id")
        held = sorted((r for r in active if r.holds_slot), key=order)
        waiters = sorted((r for r in active if r.tracked and not r.admitted), key=attrgetter("queue_place"))
        now = self.now()
        earlier = [w for w in waiters if w.queue_place < run.queue_place]
        due_ahead = sum(1 for w in earlier if is_due(w.not_before, now))
        peers_ahead = sum(1 for w in earlier if is_due(w.not_before, now) and w.priority == run.priority)
        holders = tuple(
            QueueHolder(
                r.run_id,
                r.status,
                since_admitted(r.admitted_at, r.started_at, r.attempts),
                r.namespace,
                r.lease_owner,
                r.lease_expires_at,
            )
            for r in held[:named]
        )
        waiting = any(w.run_id == run.run_id for w in waiters)
        return KeyQueue(holders, len(held), len(waiters), due_ahead, len(earlier) - due_ahead, waiting, peers_ahead)

    def recent_completions(self, workflow_name: str, key: str, count: int) -> list[tuple[datetime | None, datetime]]:
        """Return (admitted or started, finished) of the last ``count`` (>= 0)
        completed runs of singleton key ``key``, the latest finish first."""
        done = [
            r
            for r in self.list_runs(workflow_name=workflow_name)
            if r.singleton_key == key and r.status == RunStatus.COMPLETED and r.finished_at is not None
        ]
        done.sort(key=lambda r: r.finished_at or r.created_at, reverse=True)
        return [(r.admitted_at or r.started_at, r.finished_at) for r in done[:count] if r.finished_at is not None]

    def hand_back_leases(self, run_ids: Sequence[str], owner_prefix: str) -> int:
        """Expire now, on the store's clock (R5, R8), the leases of the running
        runs of ``run_ids`` whose lease owner starts with ``owner_prefix``
        (a process's ``host:pid:token:``), and make them due, so the next tick
        re-drives them (D4). Returns how many were handed back. The default:
        a store whose leases live and die with its process hands back none."""
        return 0

    def worker_processes(self) -> list[WorkerRecord] | None:
        """Return the registered ``durable_worker`` processes by host and pid
        (O6), or None for a store that keeps no worker registry (the default)."""
        return None

    def record_beat(self, name: str, at: datetime, owner: str) -> bool:
        """Write heartbeat ``name`` (a job such as the tick): completed ``at``
        by ``owner`` (O5). Returns True if a row was written; the default keeps
        none. Raises the database's error on a Django store."""
        return False

    def purge_finished(
        self,
        *,
        before: datetime,
        statuses: Sequence[str],
        workflow_name: str | None,
        key: str | None,
        limit: int | None,
        dry_run: bool,
    ) -> PurgeReport:
        """Delete (or, ``dry_run``, count) the runs in ``statuses`` (terminal
        ones, checked by the caller) finished before ``before``, of
        ``workflow_name`` and ``key`` when given, at most ``limit`` (None:
        all), oldest first, with their steps and signals (O2). The default: a
        store that keeps no runs beyond its process deletes none."""
        return PurgeReport(dry_run=dry_run)

    def beat(self, name: str) -> Beat | None:
        """Return heartbeat ``name``, or None if it was never written (or the store keeps none)."""
        return None

    # -- reads and writes for the metrics, health and the slot audit (O3, O4, K4) --
    # The defaults answer from :meth:`list_runs` (a scan, as :meth:`select_runs`
    # does); the Django store answers each in one bounded or grouped query.

    def slot_counts(self) -> list[SlotCount]:
        """Return the holders, waiters and oldest waiter of every workflow with
        a singleton run, and of every quota with a member (labelled
        ``quota:<name>``, X3j), over all their keys, by name (O4, S5, X3c)."""
        groups: dict[str, list[Any]] = {}

        def count(name: str, holds: bool, waits: bool, created_at: datetime) -> None:
            group = groups.setdefault(name, [0, 0, None])
            group[0] += holds
            group[1] += waits
            if waits and (group[2] is None or created_at < group[2]):
                group[2] = created_at

        for r in self.list_runs():
            if r.is_terminal:
                continue
            if r.singleton_key is not None and (r.tracked or r.holds_slot):
                count(r.workflow_name, r.holds_slot, r.tracked and not r.admitted, r.created_at)
            if r.quota_slot is not None:
                for name in sorted({name for name, _ in r.quota_keys}):
                    count(quota_lock_name(name), r.holds_quota_slots, r.quota_slot == SlotState.WAITER, r.created_at)
        return [SlotCount(name, *groups[name]) for name in sorted(groups)]

    def throttle_waiter_counts(self) -> list[ThrottleWaitCount]:
        """Return, for every throttle with a waiter, its waiters over all its
        keys, those parked over its rate (``not_before`` later than the store's
        now, R5, X6d) and the ``created_at`` of its oldest waiter, named
        ``throttle:<name>``, by name (O4, X6). A run's throttles are its
        ``throttle_keys``."""
        now = self.now()
        groups: dict[str, list[Any]] = {}
        for r in self.list_runs():
            if r.status not in ACTIVE_STATUSES or r.quota_slot != SlotState.WAITER:
                continue
            for name in sorted({t[0] for t in r.throttle_keys}):
                group = groups.setdefault(throttle_lock_name(name), [0, 0, None])
                group[0] += 1
                group[1] += not is_due(r.not_before, now)
                if group[2] is None or r.created_at < group[2]:
                    group[2] = r.created_at
        return [ThrottleWaitCount(name, *groups[name]) for name in sorted(groups)]

    def count_backlog(self, created_by: datetime) -> int:
        """Count the ``pending`` runs never started (no attempt) created at or
        before ``created_by`` that do not wait for a slot of their key: no
        worker took their first turn (O3)."""
        return sum(
            1
            for r in self.list_runs()
            if r.status == RunStatus.PENDING
            and r.attempts == 0
            and r.created_at <= created_by
            and not (r.singleton_key is not None and r.tracked and not r.admitted)
        )

    def unrenewed_leases(
        self, *, settings: Settings, now: datetime, limit: int
    ) -> tuple[dict[str, int], list[RunRecord]]:
        """Return the running runs whose lease was not renewed for longer than
        the renewal interval (:func:`~durable_singleton.renewals.lease_state`,
        K3) at ``now``, a time the caller read from :meth:`now` (R5): their
        number by workflow name, and the first ``limit`` (>= 0) of them by
        lease expiry, then run id. ``settings`` gives ``LEASE_SECONDS`` and
        ``LEASE_RENEW_SECONDS``."""
        found = []
        for r in self.list_runs():
            lease = lease_state(r.status, r.lease_owner, r.lease_expires_at, settings=settings, now=now)
            if lease is not None and lease.unrenewed:
                found.append(r)
        counts: dict[str, int] = {}
        for r in found:
            counts[r.workflow_name] = counts.get(r.workflow_name, 0) + 1
        found.sort(key=lambda r: (r.lease_expires_at, r.run_id))
        return counts, found[:limit]

    def controlled_keys(self) -> dict[tuple[str, str], tuple[bool, int | None]]:
        """Return (paused, limit override or None) of every key that is paused
        or overridden, by (workflow or ``quota:``/``throttle:`` name, key) (K2).
        The default: none (``supports_key_controls`` False)."""
        return {}

    def limit_changed_at(self, workflow: str, key: str) -> datetime | None:
        """Return when the limit override of ``(workflow, key)`` last changed,
        its own or its workflow-wide one (K2), or None if it never did (the
        default: a store that keeps no key controls)."""
        return None

    def key_holder_counts(self) -> list[KeyCount]:
        """Return, for every key with a holder, the number of holders, their
        latest admission and the largest limit stored on them: the singleton
        keys (S5, S12), then the quota keys as ``quota:<name>`` (X3c, X3j)."""
        singles: dict[tuple[str, str], list[Any]] = {}
        quotas: dict[tuple[str, str], list[Any]] = {}

        def count(groups: dict[tuple[str, str], list[Any]], ident: tuple[str, str], r: RunRecord) -> None:
            group = groups.setdefault(ident, [0, None, None])
            group[0] += 1
            if r.admitted_at is not None and (group[1] is None or r.admitted_at > group[1]):
                group[1] = r.admitted_at
            if r.singleton_limit and (group[2] is None or r.singleton_limit > group[2]):
                group[2] = r.singleton_limit

        for r in self.list_runs():
            if r.holds_slot and r.singleton_key is not None:
                count(singles, (r.workflow_name, r.singleton_key), r)
            if r.holds_quota_slots:
                for name, key in r.quota_keys:
                    count(quotas, (quota_lock_name(name), key), r)
        return [
            KeyCount(name, key, n, last, stored if groups is singles else None)
            for groups in (singles, quotas)
            for (name, key), (n, last, stored) in sorted(groups.items())
        ]

    def throttle_window_counts(self, name: str, since: datetime) -> list[KeyCount]:
        """Return, for every key of the throttle ``name`` with an admission
        recorded after ``since``, their number and the latest, named
        ``throttle:<name>`` (X6). The default: none (``supports_throttles`` False)."""
        return []

    def inactive_holders(self, limit: int) -> list[RunRecord]:
        """Return at most ``limit`` (>= 0) runs marked as holding a slot that
        are not active (K4, S12), oldest first."""
        return [r for r in self.list_runs() if r.admitted and r.status not in ACTIVE_STATUSES][:limit]

    def overdue_waiter_keys(self, since: datetime) -> list[KeyCount]:
        """Return the singleton keys with a waiter that carries no quota (X3d),
        ``pending`` or ``suspended``, due by its ``not_before`` on the store's
        clock (X5, R5), whose ``wake_at`` is unset or not after ``since``:
        their number and the largest limit stored on them (K4)."""
        now = self.now()
        groups: dict[tuple[str, str], list[Any]] = {}
        for r in self.list_runs():
            if (
                r.singleton_key is not None
                and r.tracked
                and not r.admitted
                and r.quota_slot is None
                and r.status in WAKEABLE_STATUSES
                and is_due(r.not_before, now)
                and (r.wake_at is None or r.wake_at <= since)
            ):
                group = groups.setdefault((r.workflow_name, r.singleton_key), [0, None])
                group[0] += 1
                if r.singleton_limit and (group[1] is None or r.singleton_limit > group[1]):
                    group[1] = r.singleton_limit
        return [KeyCount(w, k, n, None, stored) for (w, k), (n, stored) in sorted(groups.items())]

    def overdue_quota_waiters(self, since: datetime, limit: int) -> list[RunRecord]:
        """Return up to ``limit`` runs waiting in their quotas (``quota_slot`` = ``waiter``,
        X3c), ``pending`` or ``suspended``, not cancelled, due by their ``not_before`` on
        the store's clock (X5, R5), whose ``wake_at`` is unset or not after ``since``,
        oldest first (K4: the candidates of a stalled quota waiter; the audit decides)."""
        now = self.now()
        found = [
            r
            for r in self.list_runs()
            if r.quota_slot == SlotState.WAITER
            and r.status in WAKEABLE_STATUSES
            and not r.cancel_requested
            and is_due(r.not_before, now)
            and (r.wake_at is None or r.wake_at <= since)
        ]
        return sorted(found, key=lambda r: (r.created_at, r.run_id))[:limit]

    def overdue_throttle_keys(self, since: datetime) -> list[KeyCount]:
        """Return the throttle keys, named ``throttle:<name>``, with a waiter
        (``quota_slot`` = ``waiter``), ``pending`` or ``suspended`` and not
        asked to cancel, due by its ``not_before`` on the store's clock (X5,
        R5; a run parked over the rate is due from its window's opening, X6d),
        whose ``wake_at`` is unset or not after ``since``: their number (K4).
        A run's throttles are its ``throttle_keys``."""
        now = self.now()
        groups: dict[tuple[str, str], int] = {}
        for r in self.list_runs():
            if (
                r.quota_slot == SlotState.WAITER
                and r.status in WAKEABLE_STATUSES
                and not r.cancel_requested
                and is_due(r.not_before, now)
                and (r.wake_at is None or r.wake_at <= since)
            ):
                for ident in sorted({(throttle_lock_name(t[0]), t[1]) for t in r.throttle_keys}):
                    groups[ident] = groups.get(ident, 0) + 1
        return [KeyCount(name, key, n) for (name, key), n in sorted(groups.items())]

    def due_throttle_waiters(self, name: str, key: str, limit: int) -> list[RunRecord]:
        """Return the first ``limit`` (>= 0) active waiters of the throttle key
        ``(name, key)`` (``name`` as declared, without ``throttle:``) that are
        due by their ``not_before`` on the store's clock, in the queue order
        (``admission.queue_place``: higher priority first, then oldest): the ones its
        window's room goes to (X5, X6c, X8a, K4)."""
        now = self.now()
        waiters = [
            r
            for r in self.list_runs()
            if r.quota_slot == SlotState.WAITER
            and r.status in ACTIVE_STATUSES
            and is_due(r.not_before, now)
            and any(t[0] == name and t[1] == key for t in r.throttle_keys)
        ]
        return sorted(waiters, key=lambda r: r.queue_place)[:limit]

    def key_freed_since(self, workflow_name: str, key: str, since: datetime) -> bool:
        """Tell whether a run of singleton key ``key`` finished after ``since`` (K4)."""
        return any(
            r.singleton_key == key and r.finished_at is not None and r.finished_at > since
            for r in self.list_runs(workflow_name=workflow_name)
        )

    def due_waiters(self, workflow_name: str, key: str, limit: int) -> list[RunRecord]:
        """Return the first ``limit`` (>= 0) waiters of singleton key ``key``
        that are due on the store's clock, in admission order: the ones its
        free slots go to (S5 step 3, X5, X8)."""
        now = self.now()
        waiters = [
            r
            for r in self.active_runs_for_key(workflow_name, key)
            if r.tracked and not r.admitted and is_due(r.not_before, now)
        ]
        return sorted(waiters, key=attrgetter("queue_place"))[:limit]

    def unredriven_leases(self, since: datetime, limit: int) -> list[RunRecord]:
        """Return at most ``limit`` (>= 0) ``running`` runs whose lease expired
        at or before ``since`` and whose ``wake_at`` is unset or not after it:
        no tick re-drove them (K4, D4); the earliest expiry first."""
        found = [
            r
            for r in self.list_runs()
            if r.status == RunStatus.RUNNING
            and r.lease_expires_at is not None
            and r.lease_expires_at <= since
            and (r.wake_at is None or r.wake_at <= since)
        ]
        return sorted(found, key=lambda r: (r.lease_expires_at, r.run_id))[:limit]

    def drop_holder_marker(self, run_id: str) -> bool:
        """Drop the holder marker of run ``run_id`` if it is still marked and
        not active (K4's repair of an inactive holder, R5a); return whether it
        was dropped. The default drops none (``supports_slot_repairs`` False)."""
        return False

    def wake_waiter(self, run_id: str) -> bool:
        """Make run ``run_id`` due now on the store's clock (R8) if it is still
        ``pending`` or ``suspended`` (K4's repair of a stalled waiter, R5a);
        return whether it was woken. The default wakes none (``supports_slot_repairs`` False)."""
        return False

    def wake_throttle_waiter(self, run_id: str, wake_at: datetime | None) -> bool:
        """Make run ``run_id`` due now on the store's clock (R8) if it is still a
        ``pending`` or ``suspended`` waiter (``quota_slot`` = ``waiter``) with
        the ``wake_at`` read, ``wake_at`` (None: unset) (K4's repair of a
        throttled waiter no tick sent, X6d, R5a); return whether it was woken.
        The default wakes none (``supports_slot_repairs`` False)."""
        return False

    def redrive_lease(self, run_id: str, lease_expires_at: datetime) -> bool:
        """Make run ``run_id`` due now on the store's clock (R8) if it is still
        ``running`` with the lease expiry read, ``lease_expires_at`` (K4's
        repair of an expired lease no tick re-drove, D4, R5a); return whether
        it was. The default re-drives none (``supports_slot_repairs`` False)."""
        return False


_schedule_states: weakref.WeakKeyDictionary[BaseStore, ScheduleStore] = weakref.WeakKeyDictionary()
_schedule_states_lock = threading.Lock()

#: The error stored on a run cancelled by request (D6).
CANCELLED_ERROR = {"code": RunStatus.CANCELLED.value, "message": RunStatus.CANCELLED.value}
#: The error stored on a waiter replaced by a newer start of its key (X1).
REPLACED_ERROR = {"code": "replaced", "message": "replaced by a newer start of its key (on_busy)"}
#: The error stored on a run cancelled by its execution timeout (D5).
TIMEOUT_ERROR = {"code": "execution_timeout", "message": "execution timeout passed"}


def cancel_error(deadline_at: datetime | None, now: datetime) -> dict[str, str]:
    """The error of a run a requested cancel ends (R6, D5, D6): ``execution_timeout``
    (:data:`TIMEOUT_ERROR`) when its ``deadline_at`` passed by ``now`` (the store's clock,
    R5, R8), else ``cancelled`` (:data:`CANCELLED_ERROR`). The tick asks a live body past
    its deadline to stop by the same request an operator's cancel makes; whoever settles
    the run (the body at its next step, or a claim of its turn after its holder crashed)
    names the cause by this one rule."""
    if deadline_at is not None and now >= deadline_at:
        return dict(TIMEOUT_ERROR)
    return dict(CANCELLED_ERROR)


#: The error stored on a waiter ended by its key's ``queue_ttl`` (X2).
QUEUE_TTL_ERROR = {"code": "queue_ttl_expired", "message": "not admitted within the queue_ttl of its creation"}


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


def warn_fallback(store: BaseStore) -> None:
    """Warn that ``store`` admits by a scan that can briefly over-admit (S14)."""
    import logging

    from ..exceptions import SingletonFallbackWarning

    message = (
        f"store {type(store).__name__} has no atomic admission in begin_turn; singleton admission "
        "falls back to a scan that can briefly over-admit"
    )
    logging.getLogger("durable_singleton").warning(message)
    warnings.warn(message, SingletonFallbackWarning, stacklevel=3)
