"""The store seam: everything the engine asks of durable storage.

:class:`BaseStore` lists every method the engine calls. A store is a
subclass: the Django ORM store, the in-memory store, or a user's own (set
``DURABLE_SINGLETON["STORE"]`` to its dotted path). The contract is stated by
the conformance suite in :mod:`durable_singleton.testing.conformance`.

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
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from ..admission import ADMITTED_TAG, TRACKED_TAG, holds_slot, key_tag
from ..statuses import PARKED_STATUSES, TERMINAL_STATUSES, RunStatus

__all__ = [
    "TERMINAL_STATUSES",
    "AdmissionResult",
    "BaseStore",
    "Finish",
    "Limits",
    "RetryPolicy",
    "RunRecord",
    "SignalRecord",
    "StepRecord",
    "Turn",
    "TurnState",
]

#: Declared singleton limits by workflow name (the latest registered version's, S2).
Limits = Mapping[str, int]


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

    @property
    def tags(self) -> list[str]:
        """Return the run's tags: caller tags, ``singleton:<key>`` and markers (S1, S12)."""
        tags = list(self.user_tags)
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
    """Outcome of ``try_admit_singleton`` (S5, S14)."""

    ADMITTED = "admitted"  # a holder now (or already): run the body
    PARKED = "parked"  # denied: parked suspended with a retry wake_at, lease released
    GONE = "gone"  # no longer active or no longer ours (cancelled, fenced): do nothing


class TurnState(enum.Enum):
    """What :meth:`BaseStore.begin_turn` did."""

    RUN = "run"  # the lease is ours and the run holds its slot (or needs none): run the body
    PARKED = "parked"  # denied admission: parked as a waiter, no lease (S5 step 5)
    SKIPPED = "skipped"  # not claimable: terminal, leased by a live executor, or changed under us (R6)
    SETTLED = "settled"  # settled in the claim: a requested cancel, or dead past MAX_RECOVERIES (D4, D6)


@dataclass(frozen=True)
class Turn:
    """Outcome of :meth:`BaseStore.begin_turn`.

    ``run`` is the run as this turn left it (None if it does not exist);
    ``recovered`` tells that an expired lease was taken over (D4);
    ``granted`` are waiters given a slot by a settle in this claim (S7);
    ``admitted`` tells that this claim gave the run its slot (not a
    confirmation of an earlier admission).
    """

    state: TurnState
    run: RunRecord | None = None
    recovered: bool = False
    granted: tuple[RunRecord, ...] = ()
    admitted: bool = False


@dataclass(frozen=True)
class Finish:
    """Outcome of a settling write: ``run`` as settled (None if the compare-and-set
    lost), and the waiters its freed slots were granted to, oldest first (S7)."""

    run: RunRecord | None
    granted: tuple[RunRecord, ...] = field(default=())

    @property
    def settled(self) -> bool:
        """Tell whether this write settled the run."""
        return self.run is not None


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

    Times: every "now" comparison (lease expiry, wake times, deadlines) is
    made on the store's clock (:meth:`now`), never the caller's (R5).
    """

    supports_atomic_admission: bool = True
    supports_bulk_start: bool = False

    # -- the clock ---------------------------------------------------------
    @abstractmethod
    def now(self) -> datetime:
        """Return the store's current time (aware, UTC): the clock of leases (R5)."""

    # -- connections -----------------------------------------------------------
    def is_unreachable(self, exc: BaseException) -> bool:
        """Tell whether ``exc``, raised by a call to this store, means the
        store could not be reached (a dropped connection, a restart, a
        timeout) rather than a fault of the call itself. A body whose store
        call fails so is interrupted, not failed (docs/durability.rst). The
        default: ``ConnectionError`` and ``TimeoutError``."""
        return isinstance(exc, (ConnectionError, TimeoutError))

    def discard_broken_connection(self) -> None:
        """Drop this thread's connection to the store if a failure left it
        unusable, so the next call opens a new one. The default does nothing
        (a store without connections)."""
        return None

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
        :func:`~durable_singleton.admission.cap_in_force` (K2). An existing
        ``run_id`` is returned, never rejected.
        """

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

    @abstractmethod
    def get_run(self, run_id: str) -> RunRecord | None:
        """Return the run, or None."""

    @abstractmethod
    def queue_is_deep(self, workflow_name: str, key: str, limit: int) -> bool:
        """Tell whether the key already has ``limit`` holders and ``limit`` waiters (S8a)."""

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
    ) -> Turn:
        """Take ``run_id``'s lease for one turn and admit or park it (S4, S5, R5, R6).

        Claimable: a parked run, or a running run whose lease expired on the
        store's clock (a recovery, which counts ``recoveries``). In one
        transaction: a run with a requested cancel is settled ``cancelled``
        and one past ``max_recoveries`` settles ``dead``, both granting the
        freed slot (``SETTLED``); a holder's claim is a confirmation; a waiter
        is admitted when it is among the oldest waiters that fit the key's free
        slots (``RUN``), else parked with a retry ``wake_at`` (``PARKED``).

        ``known`` is the run as this process just granted it (a handoff); a
        store may use it to skip its first read.

        This default, for a store without an atomic claim, is a read followed
        by a decision (S14): it can briefly over-admit.
        """
        from ..admission import Candidate, decide_admission, limit_in_force, retry_delay

        turn = self.claim_run(run_id, owner, lease_seconds)
        run = turn.run
        if turn.state is not TurnState.RUN or run is None or run.singleton_key is None or run.admitted:
            return turn
        if run.cancel_requested:
            done = self.finish(run, owner, RunStatus.CANCELLED, error=CANCELLED_ERROR, limits=limits)
            return Turn(TurnState.SETTLED, done.run or run, granted=done.granted)
        limit = limit_in_force(limits.get(run.workflow_name, run.singleton_limit))
        candidates = [
            Candidate(r.run_id, r.created_at, r.status, r.tags)
            for r in self.active_runs_for_key(run.workflow_name, run.singleton_key)
        ]
        if decide_admission(candidates, run_id, limit):
            return Turn(TurnState.RUN, run.evolve(admitted=True), recovered=turn.recovered, admitted=True)
        wake = self.now() + _seconds(retry_delay(retry.seconds, retry.jitter))
        if self.park(run_id, owner, RunStatus.SUSPENDED, wake_at=wake, reason="singleton") == "parked":
            return Turn(TurnState.PARKED, run)
        return Turn(TurnState.SKIPPED, run)

    def claim_run(self, run_id: str, owner: str, lease_seconds: float) -> Turn:
        """Take the lease without admission (used by the S14 fallback of :meth:`begin_turn`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither begin_turn nor claim_run")

    @abstractmethod
    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        """Extend an unexpired lease held by ``owner`` to now + ``lease_seconds`` (R5).

        An expired lease is never renewed: its holder is fenced from then on.
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
    ) -> Finish:
        """Settle a run terminal and grant its freed slot, in one transaction (R2, S7, S12).

        With ``owner``: only a running run ``owner`` leases unexpired. Without:
        only a run whose status is in ``expect`` (default: parked statuses),
        never a running one (R5a). The same write drops the markers; the
        oldest waiters that fit the key's free slots become holders with a
        fencing token (K1) and are returned, to be dispatched. ``finished_at``
        stamps the run (default: the store's clock).
        """

    # -- operator actions --------------------------------------------------------
    @abstractmethod
    def request_cancel(self, run_id: str, *, limits: Limits) -> Finish | RunRecord | None:
        """Cancel a run (D6): a parked run settles ``cancelled`` at once (a
        :class:`Finish` with its grants); a running run is marked and stops at
        its next step boundary (the run is returned). None if not found; a
        terminal run is returned unchanged."""

    @abstractmethod
    def reset_for_retry(self, run_id: str, redelivery_seconds: float, deadline_at: datetime | None) -> RunRecord | None:
        """Put a failed or dead run back to ``pending`` as a waiter with its stored key (D9)."""

    @abstractmethod
    def release(self, workflow_name: str, key: str, *, limits: Limits) -> tuple[RunRecord, ...]:
        """Grant the key's free slots to its oldest waiters; return them (S7, S8)."""

    @abstractmethod
    def delete_run(self, run_id: str) -> RunRecord | None:
        """Delete a run with its steps and signals; return what was deleted."""

    @abstractmethod
    def add_signal(self, run_id: str, name: str, payload: Any) -> RunRecord | None:
        """Buffer a signal for an active run and make a run waiting on it due (D2); None if not active."""

    @abstractmethod
    def load_signals(self, run_id: str) -> list[SignalRecord]:
        """Return the run's buffered signals in the order they were sent."""

    @abstractmethod
    def children(self, run_id: str) -> list[str]:
        """Return the ids of the active children of ``run_id`` (D6, D7)."""

    # -- the tick --------------------------------------------------------------
    @abstractmethod
    def due_runs(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Take up to ``batch`` parked runs whose ``wake_at`` came, oldest first; push
        their ``wake_at`` by ``redelivery_seconds`` so no other tick sends them
        again meanwhile (S7a, S8); return (run_id, workflow_name)."""

    @abstractmethod
    def expired_leases(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Take up to ``batch`` running runs whose lease expired, oldest first, the
        same way (D4, S8b); return (run_id, workflow_name)."""

    @abstractmethod
    def overdue_runs(self, batch: int) -> list[RunRecord]:
        """Return up to ``batch`` active runs whose execution deadline passed (D5)."""

    @abstractmethod
    def request_timeout_cancel(self, run_id: str) -> bool:
        """Mark a running run for cancellation at its next boundary if it is still running (D5, R5a)."""

    @abstractmethod
    def catch_up(self, *, limits: Limits, batch: int) -> tuple[RunRecord, ...]:
        """Grant the free slots of up to ``batch`` keys that have waiters (S8a, S8b)."""

    # -- reads -----------------------------------------------------------------
    @abstractmethod
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        """Return the active runs of one workflow and key (any namespace), oldest first."""

    @abstractmethod
    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        """Count the key's active runs, in ``namespace`` if given (S15)."""

    @abstractmethod
    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        """Return runs, oldest first (for tests, the demo and tooling)."""


#: The error stored on a run cancelled by request (D6).
CANCELLED_ERROR = {"code": "cancelled", "message": "cancelled"}
#: The error stored on a run cancelled by its execution timeout (D5).
TIMEOUT_ERROR = {"code": "execution_timeout", "message": "execution timeout passed"}


def _seconds(value: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=value)


def warn_fallback(store: BaseStore) -> None:
    """Warn that ``store`` admits by a scan that can briefly over-admit (S14)."""
    import logging

    from ..exceptions import SingletonFallbackWarning

    message = (
        f"store {type(store).__name__} has no atomic try_admit_singleton; singleton admission "
        "falls back to a scan that can briefly over-admit"
    )
    logging.getLogger("durable_singleton").warning(message)
    warnings.warn(message, SingletonFallbackWarning, stacklevel=3)
