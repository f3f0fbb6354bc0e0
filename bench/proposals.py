"""Prototypes of the core changes the benchmark's analysis proposes, for measuring them before they land.

Nothing imports this module unless ``BENCH_PATCH=bench.proposals`` is set
(``python -m bench --patch bench.proposals``): then every process of the run
(runner, burst producers, Celery workers) applies the patches below to
``durable_singleton`` at startup. They exist to measure what a change would
buy; the real change belongs in the core modules (see docs/benchmarks.rst),
where it must keep every SPEC rule and test green.

P1 ``claim_run`` claims and admits a waiter in one transaction: lock the run
   row, lock the key row, read the holders and the front of the queue in one
   index range scan (``singleton_slot >= 'holder'`` in ``ds_run_queue_idx``
   order), then one UPDATE that both claims and admits, or parks. 7 round trips
   instead of 10 (``claim_run`` 2 + ``try_admit_singleton`` 8).
P2, P3 and P4 (the releasing worker runs the woken waiter next, a start deep
in a busy queue is created parked, an uncapped start is one INSERT) are in the
core now: ``Engine.execute_chain``, ``Engine.start``, ``DjangoStore.create_run``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction

from durable_singleton.admission import ACTIVE_STATUSES, HOLDING_LEGACY_STATUSES, retry_delay
from durable_singleton.definitions import registry
from durable_singleton.exceptions import UnknownWorkflowError
from durable_singleton.stores import django as django_store
from durable_singleton.stores.base import ClaimResult


def _limit(workflow_name: str, stored: int | None) -> int:
    try:
        single = registry.get(workflow_name).singleton
    except UnknownWorkflowError:
        single = None
    return single.limit if single is not None else (stored or 1)


def _front(store: Any, workflow_name: str, key: str, limit: int) -> tuple[int, list[str]]:
    """Holders (tracked and legacy) and the oldest waiters of a key, in two index reads."""
    queue = store._runs().for_key(workflow_name, key)
    rows = list(
        queue.filter(singleton_slot__gte="holder")
        .order_by("singleton_slot", "created_at", "run_id")
        .values_list("run_id", "singleton_slot")[: 2 * limit]
    )
    holders = sum(1 for _, slot in rows if slot == "holder")
    holders += queue.filter(singleton_tracked=False, status__in=HOLDING_LEGACY_STATUSES).count()
    return holders, [run_id for run_id, slot in rows if slot == "waiter"]


def claim_run(self: Any, run_id: str, owner: str, lease_seconds: float, now: Any) -> ClaimResult:
    """P1: claim, and for a singleton waiter admit or park, in one transaction (run row, then key row)."""

    def claim() -> ClaimResult:
        with transaction.atomic(using=self.db):
            runs = self._runs()
            row = runs.select_for_update().filter(pk=run_id).first()
            if row is None or row.status not in ACTIVE_STATUSES:
                return ClaimResult(None)
            recovered = False
            if row.status == "running":
                if row.lease_expires_at is not None and row.lease_expires_at > now:
                    return ClaimResult(None)
                recovered = row.lease_owner is not None
            changes: dict[str, Any] = {
                "status": "running",
                "lease_owner": owner,
                "lease_expires_at": now + timedelta(seconds=lease_seconds),
                "wake_at": None,
                "attempts": row.attempts + 1,
                "recoveries": row.recoveries + (1 if recovered else 0),
                "updated_at": now,
            }
            if row.started_at is None:
                changes["started_at"] = now
            gated = row.singleton_key is not None and row.singleton_slot != "holder" and not row.cancel_requested
            if gated and row.singleton_tracked:
                limit = _limit(row.workflow_name, row.singleton_limit)
                self._lock_key(row.workflow_name, row.singleton_key, limit)
                holders, front = _front(self, row.workflow_name, row.singleton_key, limit)
                free = limit - holders
                if run_id in front[: max(free, 0)]:
                    changes.update(singleton_slot="holder", singleton_tracked=True)
                else:
                    seconds = self.admission_retry_seconds if run_id in front[:limit] else self.backlog_retry_seconds
                    runs.filter(pk=run_id).update(
                        status="suspended",
                        wake_at=now + timedelta(seconds=retry_delay(seconds, self.admission_retry_jitter)),
                        lease_owner=None,
                        lease_expires_at=None,
                        park_reason="singleton",
                        attempts=row.attempts + 1,
                        updated_at=now,
                    )
                    return ClaimResult(None)
            runs.filter(pk=run_id).update(**changes)
            for name, value in changes.items():
                setattr(row, name, value)
            return ClaimResult(django_store._record(row), recovered=recovered)

    return self._retrying(claim)


def apply(which: str = "P1") -> None:
    """Apply the named prototypes (comma-separated; only P1 remains) to durable_singleton, in this process."""
    chosen = {p.strip() for p in which.split(",") if p.strip()}
    unknown = chosen - {"P1"}
    if unknown:
        raise SystemExit(f"bench/proposals.py: {sorted(unknown)} are in the core now; only P1 remains")
    django_store.DjangoStore.claim_run = claim_run
