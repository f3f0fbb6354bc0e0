"""The store protocol: everything the engine needs from durable storage.

The engine knows only this protocol. Writes that settle or park a run are
conditional on the run's current status and lease owner (compare-and-set),
so a stale worker cannot resurrect or overwrite a run (R2, R5).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from ..admission import ADMITTED_TAG, TRACKED_TAG, key_tag

__all__ = ["TERMINAL_STATUSES", "AdmissionResult", "RunRecord", "SignalRecord", "StateStore", "StepRecord"]

TERMINAL_STATUSES = ("completed", "failed", "cancelled", "dead")


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
    attempts: int = 0
    recoveries: int = 0
    parent_run_id: str | None = None
    park_reason: str = ""
    cancel_requested: bool = False
    deadline_at: datetime | None = None

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
    def is_terminal(self) -> bool:
        """Tell whether the status is terminal (R2)."""
        return self.status in TERMINAL_STATUSES

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


class AdmissionResult(enum.Enum):
    """Outcome of :meth:`StateStore.try_admit_singleton` (S5)."""

    ADMITTED = "admitted"  # a holder now (or already): run the body
    PARKED = "parked"  # denied: parked suspended with a retry wake_at, lease released
    GONE = "gone"  # no longer active or no longer ours (cancelled, fenced): do nothing


@dataclass(frozen=True)
class ClaimResult:
    """Outcome of :meth:`StateStore.claim_run`."""

    run: RunRecord | None
    recovered: bool = False


@runtime_checkable
class StateStore(Protocol):
    """Durable storage of runs, steps and signals.

    ``try_admit_singleton`` is optional (S14): a store without it gets the
    engine's racy fallback and a :class:`SingletonFallbackWarning`.
    """

    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        """Insert ``run`` unless ``run_id`` exists; return (run, created) (R3).

        With ``cap`` set, count the key's active runs (in ``cap_namespace`` if
        given) under the key's lock and
        raise :class:`SingletonQueueFullError` when the count reached ``cap``
        (S15), writing nothing.
        """
        ...

    def get_run(self, run_id: str) -> RunRecord | None:
        """Return the run, or None."""
        ...

    def claim_run(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> ClaimResult:
        """Take the run's lease for one turn if it is claimable (R5, R6).

        Claimable: ``pending``, ``suspended`` or ``blocked``, or ``running``
        with a lease that expired by ``now`` (a recovery). The run becomes
        ``running`` with ``lease_owner`` = ``owner``. Returns ``ClaimResult(None)``
        if another caller holds it or it is terminal.
        """
        ...

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> bool:
        """Extend the lease if ``owner`` still holds it on a running run (R5)."""
        ...

    def settle(
        self, run_id: str, owner: str | None, status: str, now: datetime, *, output: Any = None, error: Any = None
    ) -> bool:
        """Set a terminal ``status`` if the run is active (and leased by ``owner``
        when given), drop the markers in the same write; True if it did (R2, S12)."""
        ...

    def park(
        self, run_id: str, owner: str, status: str, now: datetime, *, wake_at: datetime | None, reason: str = ""
    ) -> bool:
        """Park a running run leased by ``owner`` as ``suspended`` or ``blocked``
        with ``wake_at``, releasing the lease; False if fenced."""
        ...

    def request_cancel(self, run_id: str, now: datetime) -> RunRecord | None:
        """Cancel a pending, suspended or blocked run at once; mark a running
        run for cancellation at its next step boundary (D6). None if not found."""
        ...

    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        """Return the run's memoized steps by position (R4)."""
        ...

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        """Store a step result if ``owner`` still leases the running run (R4, R5)."""
        ...

    def wake_singleton_waiters(self, workflow_name: str, key: str, limit: int, now: datetime) -> list[str]:
        """Make the oldest ``limit`` waiters of the key due now; return their ids (S7)."""
        ...

    def due_runs(self, now: datetime, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Return (run_id, workflow_name) of runs the tick must dispatch, pushing their next check by
        ``redelivery_seconds`` so concurrent ticks do not send them twice (S8)."""
        ...

    def singleton_catch_up(self, now: datetime, limits: dict[str, int]) -> list[str]:
        """Make due the oldest waiters of every key with a free slot (S8a)."""
        ...

    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        """Return the active runs of one workflow and key (any namespace)."""
        ...

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        """Return runs, oldest first (for tests, the demo and tooling)."""
        ...
