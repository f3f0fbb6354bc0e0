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
P2 The push runs the successor inline: when a turn in a worker releases a
   slot, the oldest woken waiter's turn runs next in the same worker (bounded
   by ``INLINE_BUDGET`` turns and ``INLINE_SECONDS``), with no broker hop;
   the other woken waiters are dispatched as before. Its ``wake_at`` is still
   stamped, so a crash leaves it to the tick (S7, S8).
P4 ``create_run`` without a cap is one INSERT: no transaction (a savepoint
   inside a caller's transaction) and no SELECT of the new ``run_id`` first; a
   racing duplicate's ``IntegrityError`` returns the existing run (R3).
P3 ``start`` does not dispatch a run that lands behind ``limit`` holders and
   ``limit`` waiters: it is created parked (``suspended``, the backlog retry)
   and waits for the push or the tick's catch-up, like any waiter far back
   (S8a); no turn per run of a burst.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from django.db import transaction

from durable_singleton import engine as engine_module
from durable_singleton.admission import ACTIVE_STATUSES, HOLDING_LEGACY_STATUSES, retry_delay
from durable_singleton.definitions import registry
from durable_singleton.exceptions import UnknownWorkflowError
from durable_singleton.stores import django as django_store
from durable_singleton.stores.base import ClaimResult

INLINE_BUDGET = 200
INLINE_SECONDS = 2.0

_local = threading.local()


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


_original_execute = engine_module.Engine.execute
_original_release = engine_module.Engine.release


def execute(self: Any, run_id: str) -> str:
    """P2: after the turn, run the successors it released inline (bounded), then dispatch the rest."""
    if getattr(_local, "active", False):
        return _original_execute(self, run_id)
    _local.active = True
    _local.next = []
    try:
        outcome = _original_execute(self, run_id)
        budget = INLINE_BUDGET
        deadline = time.monotonic() + INLINE_SECONDS
        while _local.next and budget > 0 and time.monotonic() < deadline:
            budget -= 1
            _original_execute(self, _local.next.pop(0)[0])
        for leftover, queue in _local.next:
            self.dispatcher.dispatch(leftover, queue)
        return outcome
    finally:
        _local.active = False
        _local.next = []


def release(self: Any, run: Any) -> list[str]:
    """P2: like Engine.release, but hand the oldest woken waiter to the running turn's loop."""
    if run.singleton_key is None or not getattr(_local, "active", False):
        return _original_release(self, run)
    key = run.singleton_key
    limit = _limit(run.workflow_name, run.singleton_limit)
    queue = self._queue_of(run)
    woken: list[str] = []

    def push() -> None:
        woken.extend(self.store.wake_singleton_waiters(run.workflow_name, key, limit, self.now()))
        for n, run_id in enumerate(woken):
            if n == 0:
                _local.next.append((run_id, queue))
            else:
                self.dispatcher.dispatch(run_id, queue)

    self.dispatcher.on_commit(push)
    return woken


_deep: set[str] = set()
_original_create = django_store.DjangoStore.create_run
_inner_create = _original_create


def create_run_single_insert(
    self: Any, record: Any, *, cap: int | None, cap_namespace: str | None = None
) -> tuple[Any, bool]:
    """P4: without a cap, insert at once; a duplicate ``run_id`` returns the existing run (R3)."""
    if cap is not None:
        return _original_create(self, record, cap=cap, cap_namespace=cap_namespace)
    from django.db import IntegrityError, connections

    def insert() -> None:
        self._runs().create(
            run_id=record.run_id,
            workflow_name=record.workflow_name,
            workflow_version=record.workflow_version,
            namespace=record.namespace,
            status=record.status,
            input=record.input,
            tags=list(record.user_tags),
            singleton_key=record.singleton_key,
            singleton_limit=record.singleton_limit,
            singleton_slot="waiter" if record.singleton_key is not None and record.tracked else None,
            singleton_tracked=record.tracked,
            created_at=record.created_at,
            updated_at=record.updated_at,
            wake_at=record.wake_at,
            deadline_at=record.deadline_at,
            parent_run_id=record.parent_run_id,
            park_reason=record.park_reason,
        )

    try:
        if connections[self.db].in_atomic_block:
            with transaction.atomic(using=self.db):
                insert()
        else:
            insert()
    except IntegrityError:
        existing = self._runs().filter(pk=record.run_id).first()
        if existing is None:
            raise
        return django_store._record(existing), False
    return record, True


_original_dispatch: dict[type, Any] = {}


def create_run(self: Any, record: Any, *, cap: int | None, cap_namespace: str | None = None) -> Any:
    """P3: a run landing behind ``limit`` holders and ``limit`` waiters is created with the backlog retry."""
    if record.singleton_key is not None and record.status == "pending":
        limit = _limit(record.workflow_name, record.singleton_limit)
        rows = list(
            self._runs()
            .for_key(record.workflow_name, record.singleton_key)
            .filter(singleton_slot__gte="holder")
            .order_by("singleton_slot", "created_at", "run_id")
            .values_list("singleton_slot", flat=True)[: 2 * limit]
        )
        if rows.count("holder") >= limit and rows.count("waiter") >= limit:
            wake_at = record.created_at + timedelta(seconds=self.backlog_retry_seconds)
            record = record.evolve(status="suspended", wake_at=wake_at, park_reason="singleton")
            run, created = _inner_create(self, record, cap=cap, cap_namespace=cap_namespace)
            if created:
                _deep.add(run.run_id)
            return run, created
    return _inner_create(self, record, cap=cap, cap_namespace=cap_namespace)


def _skip_deep(original: Any) -> Any:
    def dispatch(self: Any, run_id: str, queue: str | None = None) -> None:
        if run_id in _deep:
            _deep.discard(run_id)
            return
        original(self, run_id, queue)

    return dispatch


def apply(which: str = "P1,P2,P3,P4") -> None:
    """Apply the named prototypes (comma-separated) to durable_singleton, in this process."""
    global _inner_create
    from durable_singleton import dispatch as dispatch_module

    chosen = {p.strip() for p in which.split(",")}
    if "P4" in chosen:
        _inner_create = create_run_single_insert
        django_store.DjangoStore.create_run = create_run_single_insert
    if "P1" in chosen:
        django_store.DjangoStore.claim_run = claim_run
    if "P2" in chosen:
        engine_module.Engine.execute = execute
        engine_module.Engine.release = release
    if "P3" in chosen:
        django_store.DjangoStore.create_run = create_run
        for cls in (dispatch_module.CeleryDispatcher, dispatch_module.ThreadDispatcher):
            cls.dispatch = _skip_deep(cls.dispatch)
