"""The in-memory store: a product feature for users' tests, not a stand-in
for the database tests. Every method runs inside one critical section, so
its claim is atomic (S13)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from ..admission import (
    ACTIVE_STATUSES,
    Candidate,
    decide_admission,
    is_holder,
    retry_delay,
)
from ..exceptions import SingletonQueueFullError
from .base import AdmissionResult, ClaimResult, RunRecord, SignalRecord, StepRecord

__all__ = ["MemoryStore"]

T = TypeVar("T")


class MemoryStore:
    """Runs, steps and signals in dictionaries guarded by one lock."""

    def __init__(
        self,
        *,
        admission_retry_seconds: float = 1.0,
        admission_retry_jitter: float = 0.25,
        backlog_retry_seconds: float = 3600.0,
    ) -> None:
        self._lock = threading.RLock()
        self._runs: dict[str, RunRecord] = {}
        self._steps: dict[str, dict[int, StepRecord]] = {}
        self._signals: dict[str, list[SignalRecord]] = {}
        self._signal_seq = 0
        self.admission_retry_seconds = admission_retry_seconds
        self.admission_retry_jitter = admission_retry_jitter
        self.backlog_retry_seconds = backlog_retry_seconds

    @contextmanager
    def _critical(self) -> Iterator[None]:
        with self._lock:
            yield

    def _replace(self, run: RunRecord, now: datetime, **changes: Any) -> RunRecord:
        new = run.evolve(updated_at=now, **changes)
        self._runs[run.run_id] = new
        return new

    def _key_runs(self, workflow_name: str, key: str) -> list[RunRecord]:
        return [
            r
            for r in self._runs.values()
            if r.workflow_name == workflow_name and r.singleton_key == key and r.status in ACTIVE_STATUSES
        ]

    def _waiters(self, workflow_name: str, key: str) -> list[RunRecord]:
        runs = [r for r in self._key_runs(workflow_name, key) if not is_holder(r.status, r.tags)]
        return sorted(runs, key=lambda r: (r.created_at, r.run_id))

    # -- runs --------------------------------------------------------------
    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        with self._critical():
            existing = self._runs.get(run.run_id)
            if existing is not None:
                return existing, False
            if cap is not None and run.singleton_key is not None:
                count = self.count_active_for_key(run.workflow_name, run.singleton_key, cap_namespace)
                if count >= cap:
                    limit = run.singleton_limit or 1
                    raise SingletonQueueFullError(run.workflow_name, run.singleton_key, cap - limit)
            self._runs[run.run_id] = run
            return run, True

    def queue_is_deep(self, workflow_name: str, key: str, limit: int) -> bool:
        """Tell whether the key already has ``limit`` holders and ``limit`` waiters (S8a)."""
        with self._critical():
            runs = self._key_runs(workflow_name, key)
            holders = sum(1 for r in runs if is_holder(r.status, r.tags))
            return holders >= limit and len(runs) - holders >= limit

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._critical():
            return self._runs.get(run_id)

    def delete_run(self, run_id: str) -> RunRecord | None:
        """Delete a run and its steps and signals; return what was deleted."""
        with self._critical():
            self._steps.pop(run_id, None)
            self._signals.pop(run_id, None)
            return self._runs.pop(run_id, None)

    def claim_run(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> ClaimResult:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal:
                return ClaimResult(None)
            recovered = False
            if run.status == "running":
                if run.lease_expires_at is not None and run.lease_expires_at > now:
                    return ClaimResult(None)
                recovered = run.lease_owner is not None
            claimed = self._replace(
                run,
                now,
                status="running",
                lease_owner=owner,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                wake_at=None,
                attempts=run.attempts + 1,
                recoveries=run.recoveries + (1 if recovered else 0),
                started_at=run.started_at or now,
            )
            return ClaimResult(claimed, recovered=recovered)

    def _leased(self, run_id: str, owner: str, now: datetime) -> RunRecord | None:
        run = self._runs.get(run_id)
        if run is None or run.status != "running" or run.lease_owner != owner:
            return None
        if run.lease_expires_at is None or run.lease_expires_at <= now:
            return None  # an expired lease is never renewed (R5)
        return run

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> bool:
        with self._critical():
            run = self._leased(run_id, owner, now)
            if run is None:
                return False
            self._replace(run, now, lease_expires_at=now + timedelta(seconds=lease_seconds))
            return True

    def check_boundary(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> str:
        """Renew the lease at a step boundary; return "ok", "cancelled" or "fenced" (R5, D6)."""
        with self._critical():
            run = self._leased(run_id, owner, now)
            if run is None:
                return "fenced"
            if run.cancel_requested:
                return "cancelled"
            self._replace(run, now, lease_expires_at=now + timedelta(seconds=lease_seconds))
            return "ok"

    def update_fields(self, run_id: str, owner: str, now: datetime, **changes: Any) -> bool:
        """Apply ``changes`` to a running run leased by ``owner``; False if fenced."""
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status != "running" or run.lease_owner != owner:
                return False
            self._replace(run, now, **changes)
            return True

    def settle(
        self, run_id: str, owner: str | None, status: str, now: datetime, *, output: Any = None, error: Any = None
    ) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal:
                return False
            if owner is not None and (run.status != "running" or run.lease_owner != owner):
                return False
            self._replace(
                run,
                now,
                status=status,
                output=output,
                error=error,
                admitted=False,
                tracked=False,
                lease_owner=None,
                lease_expires_at=None,
                wake_at=None,
                finished_at=now,
            )
            return True

    def park(
        self, run_id: str, owner: str, status: str, now: datetime, *, wake_at: datetime | None, reason: str = ""
    ) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status != "running" or run.lease_owner != owner:
                return False
            self._replace(
                run, now, status=status, wake_at=wake_at, park_reason=reason, lease_owner=None, lease_expires_at=None
            )
            return True

    def request_cancel(self, run_id: str, now: datetime) -> RunRecord | None:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal:
                return run
            if run.status == "running":
                return self._replace(run, now, cancel_requested=True, wake_at=now)
            return self._replace(
                run,
                now,
                status="cancelled",
                error={"code": "cancelled", "message": "cancelled"},
                admitted=False,
                tracked=False,
                lease_owner=None,
                lease_expires_at=None,
                wake_at=None,
                finished_at=now,
                cancel_requested=True,
            )

    def reset_for_retry(
        self, run_id: str, now: datetime, redelivery_seconds: float = 5.0, deadline_at: datetime | None = None
    ) -> RunRecord | None:
        """Put a failed or dead run back to ``pending`` through admission (D9)."""
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status not in ("failed", "dead"):
                return None
            return self._replace(
                run,
                now,
                status="pending",
                error=None,
                output=None,
                admitted=False,
                tracked=run.singleton_key is not None,
                wake_at=now + timedelta(seconds=redelivery_seconds),
                recoveries=0,
                finished_at=None,
                cancel_requested=False,
                deadline_at=deadline_at,
            )

    # -- admission ---------------------------------------------------------
    def try_admit_singleton(
        self, run_id: str, owner: str, limit: int, now: datetime, *, workflow_name: str = "", key: str = ""
    ) -> AdmissionResult:
        """Claim a slot for ``run_id`` or park it, in one critical section (S5)."""
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status != "running" or run.lease_owner != owner or run.singleton_key is None:
                return AdmissionResult.GONE
            if run.cancel_requested:
                return AdmissionResult.GONE  # a cancel landed during the claim: never undone (S9)
            if run.admitted:
                return AdmissionResult.ADMITTED
            if not run.tracked:
                # A run of an older release (S12): holder if it had run before.
                run = self._replace(run, now, tracked=True, admitted=run.attempts > 1)
                if run.admitted:
                    return AdmissionResult.ADMITTED
            key_runs = self._key_runs(run.workflow_name, run.singleton_key)
            candidates = [Candidate(r.run_id, r.created_at, r.status, r.tags) for r in key_runs]
            if decide_admission(candidates, run_id, limit):
                self._replace(run, now, admitted=True, tracked=True)
                return AdmissionResult.ADMITTED
            waiters = self._waiters(run.workflow_name, run.singleton_key)
            front = any(w.run_id == run_id for w in waiters[:limit])
            seconds = self.admission_retry_seconds if front else self.backlog_retry_seconds
            delay = retry_delay(seconds, self.admission_retry_jitter)
            self._replace(
                run,
                now,
                status="suspended",
                wake_at=now + timedelta(seconds=delay),
                lease_owner=None,
                lease_expires_at=None,
                park_reason="singleton",
            )
            return AdmissionResult.PARKED

    def wake_singleton_waiters(self, workflow_name: str, key: str, limit: int, now: datetime) -> list[str]:
        with self._critical():
            woken = []
            for run in self._waiters(workflow_name, key)[:limit]:
                if run.status in ("pending", "suspended"):
                    self._replace(run, now, wake_at=now)
                woken.append(run.run_id)
            return woken

    def singleton_catch_up(self, now: datetime, limits: dict[str, int]) -> list[str]:
        with self._critical():
            keys = {
                (r.workflow_name, r.singleton_key)
                for r in self._runs.values()
                if r.singleton_key is not None and r.status in ACTIVE_STATUSES and r.workflow_name in limits
            }
            woken: list[str] = []
            for workflow_name, key in sorted(keys):
                assert key is not None
                limit = limits[workflow_name]
                runs = self._key_runs(workflow_name, key)
                free = limit - sum(1 for r in runs if is_holder(r.status, r.tags))
                if free <= 0:
                    continue
                for run in self._waiters(workflow_name, key)[:free]:
                    if run.status in ("pending", "suspended") and (run.wake_at is None or run.wake_at > now):
                        self._replace(run, now, wake_at=now)
                        woken.append(run.run_id)
            return woken

    def due_runs(self, now: datetime, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        with self._critical():
            due = sorted(
                (
                    r
                    for r in self._runs.values()
                    if (r.status in ("pending", "suspended", "blocked") and r.wake_at is not None and r.wake_at <= now)
                    or (
                        r.status == "running"
                        and r.lease_expires_at is not None
                        and r.lease_expires_at <= now
                        and (r.wake_at is None or r.wake_at <= now)
                    )
                ),
                key=lambda r: (r.wake_at or r.created_at, r.created_at, r.run_id),
            )[:batch]
            later = now + timedelta(seconds=redelivery_seconds)
            for run in due:
                self._replace(run, now, wake_at=later)
            return [(r.run_id, r.workflow_name) for r in due]

    def overdue_runs(self, now: datetime, batch: int) -> list[str]:
        """Return active runs whose execution deadline passed (D5)."""
        with self._critical():
            return [
                r.run_id
                for r in self._runs.values()
                if r.status in ACTIVE_STATUSES and r.deadline_at is not None and r.deadline_at <= now
            ][:batch]

    # -- reads -------------------------------------------------------------
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        with self._critical():
            return sorted(self._key_runs(workflow_name, key), key=lambda r: (r.created_at, r.run_id))

    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        """Count the key's active runs, in ``namespace`` if given (S15)."""
        with self._critical():
            return sum(1 for r in self._key_runs(workflow_name, key) if namespace is None or r.namespace == namespace)

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        with self._critical():
            runs = [
                r
                for r in self._runs.values()
                if (workflow_name is None or r.workflow_name == workflow_name)
                and (namespace is None or r.namespace == namespace)
            ]
            return sorted(runs, key=lambda r: (r.created_at, r.run_id))

    # -- steps and signals -------------------------------------------------
    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        with self._critical():
            return dict(self._steps.get(run_id, {}))

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        with self._critical():
            run = self._leased(run_id, owner, step.finished_at)
            if run is None or run.cancel_requested:
                return False
            steps = self._steps.setdefault(run_id, {})
            if step.position in steps:
                return False
            steps[step.position] = step
            return True

    def add_signal(self, run_id: str, name: str, payload: Any, now: datetime) -> RunRecord | None:
        """Buffer a signal for an active run and make the run due; None if not active (D2)."""
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal:
                return None
            self._signal_seq += 1
            self._signals.setdefault(run_id, []).append(SignalRecord(self._signal_seq, name, payload, now))
            if run.status in ("suspended", "blocked") and run.park_reason.startswith("signal:"):
                run = self._replace(run, now, wake_at=now)
            return run

    def load_signals(self, run_id: str) -> list[SignalRecord]:
        """Return the run's buffered signals in the order they were sent."""
        with self._critical():
            return list(self._signals.get(run_id, []))

    def run_critical(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` inside the store's critical section (for conformance tests)."""
        with self._critical():
            return fn()
