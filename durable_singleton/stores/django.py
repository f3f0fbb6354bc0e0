"""The Django ORM store.

Only this module takes locks. Each claim locks one small row per key
(:class:`~durable_singleton.models.SingletonKey`) and reads the key's holders
and the front of its queue through the ``ds_run_queue_idx`` index, so a claim
costs the same with 10 or 10,000 waiters (S5, S13). On PostgreSQL and
MySQL/MariaDB the lock is ``select_for_update``; on SQLite, which has no row
locks, a no-op UPDATE of the key row takes the database write lock first.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import IntegrityError, OperationalError, connections, router, transaction
from django.db.models import Count, Exists, F, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce, Now

from ..admission import ACTIVE_STATUSES, HOLDING_LEGACY_STATUSES, retry_delay
from ..exceptions import SingletonQueueFullError
from ..models import Run, Signal, SingletonKey, Step
from .base import AdmissionResult, ClaimResult, RunRecord, SignalRecord, StepRecord

__all__ = ["DjangoStore", "is_transient_error"]

T = TypeVar("T")

_TRANSIENT_SQLSTATES = {"40001", "40P01", "55P03"}  # serialization, deadlock, lock not available
_TRANSIENT_MYSQL_CODES = {1205, 1213}  # lock wait timeout, deadlock


def is_transient_error(exc: BaseException) -> bool:
    """Tell whether ``exc`` is a transient database error worth retrying (SPEC section 7).

    Named errors only: serialization failure, deadlock, lock timeout, and
    SQLite's "database is locked".
    """
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate in _TRANSIENT_SQLSTATES:
        return True
    args = getattr(cause, "args", None) or exc.args
    if args and isinstance(args[0], int) and args[0] in _TRANSIENT_MYSQL_CODES:
        return True
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def _record(row: Run) -> RunRecord:
    return RunRecord(
        run_id=row.run_id,
        workflow_name=row.workflow_name,
        workflow_version=row.workflow_version,
        namespace=row.namespace,
        status=row.status,
        input=row.input,
        created_at=row.created_at,
        updated_at=row.updated_at,
        output=row.output,
        error=row.error,
        user_tags=tuple(row.tags or ()),
        singleton_key=row.singleton_key,
        singleton_limit=row.singleton_limit,
        admitted=row.singleton_slot == "holder",
        tracked=row.singleton_tracked,
        wake_at=row.wake_at,
        lease_owner=row.lease_owner,
        lease_expires_at=row.lease_expires_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        attempts=row.attempts,
        recoveries=row.recoveries,
        parent_run_id=row.parent_run_id,
        park_reason=row.park_reason,
        cancel_requested=row.cancel_requested,
        deadline_at=row.deadline_at,
    )


def _terminal_fields(status: str, now: datetime, output: Any, error: Any) -> dict[str, Any]:
    # One write sets the terminal status and drops the markers (S12).
    return {
        "status": status,
        "output": output,
        "error": error,
        "singleton_slot": None,
        "singleton_tracked": False,
        "lease_owner": None,
        "lease_expires_at": None,
        "wake_at": None,
        "finished_at": now,
        "updated_at": now,
    }


class DjangoStore:
    """Runs in the database through the Django ORM.

    ``using`` is the database alias; None asks the router (``db_for_write``).
    """

    def __init__(
        self,
        using: str | None = None,
        *,
        claim_retries: int = 5,
        admission_retry_seconds: float = 1.0,
        admission_retry_jitter: float = 0.25,
        backlog_retry_seconds: float = 3600.0,
    ) -> None:
        self.using = using
        self.claim_retries = claim_retries
        self.admission_retry_seconds = admission_retry_seconds
        self.admission_retry_jitter = admission_retry_jitter
        self.backlog_retry_seconds = backlog_retry_seconds

    @property
    def db(self) -> str:
        """Return the database alias writes go to."""
        return self.using or router.db_for_write(Run)

    def _runs(self) -> Any:
        return Run.objects.using(self.db)

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one transaction), retrying named transient errors a bounded number of times."""
        for attempt in range(self.claim_retries + 1):
            try:
                return fn()
            except OperationalError as exc:
                if attempt >= self.claim_retries or not is_transient_error(exc):
                    raise
                time.sleep(min(0.2, 0.005 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _ensure_key(self, workflow_name: str, key: str, limit: int | None) -> None:
        """Create the key's lock row if it does not exist, without locking an existing one."""
        db = self.db
        if not SingletonKey.objects.using(db).filter(workflow_name=workflow_name, key=key).exists():
            SingletonKey.objects.using(db).bulk_create(
                [SingletonKey(workflow_name=workflow_name, key=key, limit=limit or 1)], ignore_conflicts=True
            )

    def _lock_key(self, workflow_name: str, key: str, limit: int | None) -> SingletonKey | None:
        """Lock the key's row (creating it if missing); return it.

        Must run inside a transaction. SQLite has no row locks: a no-op UPDATE
        takes the database write lock before anything is read.
        """
        db = self.db
        keys = SingletonKey.objects.using(db).filter(workflow_name=workflow_name, key=key)
        for _ in range(2):
            if connections[db].vendor == "sqlite":
                if keys.update(limit=F("limit")):
                    return keys.get()
            else:
                row = keys.select_for_update().first()
                if row is not None:
                    return row
            self._ensure_key(workflow_name, key, limit)
        return None

    # -- runs --------------------------------------------------------------
    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        """Insert ``run``; a duplicate ``run_id`` returns the existing run (R3).

        Without a cap this is one INSERT (in a savepoint inside a caller's
        transaction), and the key's lock row is left to the first claim, so a
        start inside a long user transaction never blocks other starts of a new
        key on its unique index (F3). With a cap, the count and the insert are
        serialized on the key's lock (S15, F5).
        """
        db = self.db
        capped = run.singleton_key is not None and cap is not None

        def create() -> tuple[RunRecord, bool]:
            if not capped and not connections[db].in_atomic_block:
                self._insert(run)
                return run, True
            with transaction.atomic(using=db):
                if capped:
                    assert run.singleton_key is not None and cap is not None
                    existing = self._runs().filter(pk=run.run_id).first()
                    if existing is not None:
                        return _record(existing), False
                    self._lock_key(run.workflow_name, run.singleton_key, run.singleton_limit)
                    count = self.count_active_for_key(run.workflow_name, run.singleton_key, cap_namespace)
                    if count >= cap:
                        limit = run.singleton_limit or 1
                        raise SingletonQueueFullError(run.workflow_name, run.singleton_key, cap - limit)
                self._insert(run)
                return run, True

        try:
            return self._retrying(create)
        except IntegrityError:
            # A racing start with the same run_id committed first (R3).
            existing = self._runs().filter(pk=run.run_id).first()
            if existing is None:
                raise
            return _record(existing), False

    def _insert(self, run: RunRecord) -> None:
        self._runs().create(
            run_id=run.run_id,
            workflow_name=run.workflow_name,
            workflow_version=run.workflow_version,
            namespace=run.namespace,
            status=run.status,
            input=run.input,
            tags=list(run.user_tags),
            singleton_key=run.singleton_key,
            singleton_limit=run.singleton_limit,
            singleton_slot="waiter" if run.singleton_key is not None and run.tracked else None,
            singleton_tracked=run.tracked,
            created_at=run.created_at,
            updated_at=run.updated_at,
            wake_at=run.wake_at,
            deadline_at=run.deadline_at,
            parent_run_id=run.parent_run_id,
            park_reason=run.park_reason,
        )

    def queue_is_deep(self, workflow_name: str, key: str, limit: int) -> bool:
        """Tell whether the key already has ``limit`` holders and ``limit`` waiters (S8a).

        One index read of at most ``2 * limit`` rows, whatever the queue's length.
        """
        slots = list(
            self._runs()
            .for_key(workflow_name, key)
            .filter(singleton_slot__isnull=False)
            .order_by("singleton_slot", "created_at", "run_id")
            .values_list("singleton_slot", flat=True)[: 2 * limit]
        )
        return slots.count("holder") >= limit and slots.count("waiter") >= limit

    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._runs().filter(pk=run_id).first()
        return _record(row) if row is not None else None

    def delete_run(self, run_id: str) -> RunRecord | None:
        """Delete a run with its steps and signals; return what was deleted."""
        with transaction.atomic(using=self.db):
            row = self._runs().select_for_update().filter(pk=run_id).first()
            if row is None:
                return None
            row.delete()
            return _record(row)

    def claim_run(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> ClaimResult:
        row = self._runs().filter(pk=run_id).first()
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
        if not self._write_claim(run_id, row.status, row.attempts, row.lease_expires_at, changes):
            return ClaimResult(None)
        for name, value in changes.items():
            setattr(row, name, value)
        return ClaimResult(_record(row), recovered=recovered)

    def _write_claim(
        self, run_id: str, status: str, attempts: int, lease_expires_at: datetime | None, changes: dict[str, Any]
    ) -> bool:
        """Compare-and-set on (status, attempts, lease expiry): attempts grows
        with every claim, so exactly one of two racing callers wins (R6), and a
        renewal that lands between the read and the write voids a takeover (R5).
        A takeover also needs the lease expired by the database's clock."""
        runs = self._runs().filter(pk=run_id, status=status, attempts=attempts, lease_expires_at=lease_expires_at)
        if status == "running":
            runs = runs.filter(lease_expires_at__lte=Now())
        return bool(runs.update(**changes))

    def _leased(self, run_id: str, owner: str) -> Any:
        """The run, if ``owner`` holds an unexpired lease on it by the database's clock (R5)."""
        return self._runs().filter(pk=run_id, status="running", lease_owner=owner, lease_expires_at__gt=Now())

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> bool:
        """Extend the lease if ``owner`` still holds it, unexpired, on a running run (R5).

        An expired lease is never renewed: its holder is fenced from then on,
        whether or not another worker took the run over yet.
        """
        return bool(
            self._leased(run_id, owner).update(lease_expires_at=now + timedelta(seconds=lease_seconds), updated_at=now)
        )

    def check_boundary(self, run_id: str, owner: str, lease_seconds: float, now: datetime) -> str:
        """Renew the lease at a step boundary; return "ok", "cancelled" or "fenced" (R5, D6)."""
        expires = now + timedelta(seconds=lease_seconds)
        if self._leased(run_id, owner).filter(cancel_requested=False).update(lease_expires_at=expires, updated_at=now):
            return "ok"
        if self._leased(run_id, owner).filter(cancel_requested=True).exists():
            return "cancelled"
        return "fenced"

    def update_fields(self, run_id: str, owner: str, now: datetime, **changes: Any) -> bool:
        """Apply ``changes`` to a running run leased by ``owner``; False if fenced."""
        return bool(
            self._runs().filter(pk=run_id, status="running", lease_owner=owner).update(updated_at=now, **changes)
        )

    def settle(
        self, run_id: str, owner: str | None, status: str, now: datetime, *, output: Any = None, error: Any = None
    ) -> bool:
        runs = self._runs().filter(pk=run_id, status__in=ACTIVE_STATUSES)
        if owner is not None:
            runs = runs.filter(status="running", lease_owner=owner)
        return bool(runs.update(**_terminal_fields(status, now, output, error)))

    def park(
        self, run_id: str, owner: str, status: str, now: datetime, *, wake_at: datetime | None, reason: str = ""
    ) -> bool:
        return bool(
            self._runs()
            .filter(pk=run_id, status="running", lease_owner=owner)
            .update(
                status=status,
                wake_at=wake_at,
                park_reason=reason[:191],
                lease_owner=None,
                lease_expires_at=None,
                updated_at=now,
            )
        )

    def request_cancel(self, run_id: str, now: datetime) -> RunRecord | None:
        def cancel() -> RunRecord | None:
            with transaction.atomic(using=self.db):
                row = self._runs().select_for_update().filter(pk=run_id).first()
                if row is None or row.status not in ACTIVE_STATUSES:
                    return _record(row) if row is not None else None
                if row.status == "running":
                    changes: dict[str, Any] = {"cancel_requested": True, "updated_at": now}
                else:
                    changes = _terminal_fields("cancelled", now, None, {"code": "cancelled", "message": "cancelled"})
                    changes["cancel_requested"] = True
                self._runs().filter(pk=run_id).update(**changes)
                for name, value in changes.items():
                    setattr(row, name, value)
                return _record(row)

        return self._retrying(cancel)

    def reset_for_retry(
        self, run_id: str, now: datetime, redelivery_seconds: float = 5.0, deadline_at: datetime | None = None
    ) -> RunRecord | None:
        """Put a failed or dead run back to ``pending``, through admission again,
        with its stored key and no marker (D9)."""
        row = self._runs().filter(pk=run_id, status__in=("failed", "dead")).first()
        if row is None:
            return None
        changes = {
            "status": "pending",
            "error": None,
            "output": None,
            "singleton_slot": "waiter" if row.singleton_key is not None else None,
            "singleton_tracked": row.singleton_key is not None,
            "wake_at": now + timedelta(seconds=redelivery_seconds),
            "recoveries": 0,
            "finished_at": None,
            "cancel_requested": False,
            "deadline_at": deadline_at,
            "admitted_at": None,
            "updated_at": now,
        }
        if not self._runs().filter(pk=run_id, status=row.status).update(**changes):
            return None
        for name, value in changes.items():
            setattr(row, name, value)
        return _record(row)

    # -- admission ---------------------------------------------------------
    def try_admit_singleton(
        self, run_id: str, owner: str, limit: int, now: datetime, *, workflow_name: str, key: str
    ) -> AdmissionResult:
        """Claim a slot for ``run_id`` or park it, atomically (S5, S9, S13).

        In one transaction: lock the key row, then the run row; give up if the
        run is no longer ours and running (a cancel is never undone); count the
        holders; admit the run if it is among the oldest ``limit - holders``
        waiters by (``created_at``, ``run_id``); otherwise park it
        ``suspended`` with a retry ``wake_at`` and release the lease. The
        first ``limit`` waiters retry after about 1 s; waiters further back
        wait for the push and the tick's catch-up (S8a).
        """

        def claim() -> AdmissionResult:
            with transaction.atomic(using=self.db):
                key_row = self._lock_key(workflow_name, key, limit)
                if key_row is not None and key_row.limit != limit:
                    SingletonKey.objects.using(self.db).filter(pk=key_row.pk).update(limit=limit)
                runs = self._runs()
                row = (
                    runs.select_for_update()
                    .filter(pk=run_id)
                    .values(
                        "status", "lease_owner", "singleton_slot", "singleton_tracked", "cancel_requested", "attempts"
                    )
                    .first()
                )
                if row is None or row["status"] != "running" or row["lease_owner"] != owner:
                    return AdmissionResult.GONE
                if row["cancel_requested"]:
                    return AdmissionResult.GONE  # a cancel landed during the claim: never undone (S9)
                if row["singleton_slot"] == "holder":
                    return AdmissionResult.ADMITTED  # a holder's later checks are confirmations (S6)
                if not row["singleton_tracked"]:
                    # A run of an older release (S12): one that had run before this
                    # claim holds a slot already; one that never ran joins the queue.
                    slot = "holder" if row["attempts"] > 1 else "waiter"
                    runs.filter(pk=run_id).update(
                        singleton_slot=slot,
                        singleton_tracked=True,
                        admitted_at=now if slot == "holder" else None,
                        updated_at=now,
                    )
                    if slot == "holder":
                        return AdmissionResult.ADMITTED
                queue = runs.for_key(workflow_name, key)
                holders = queue.filter(singleton_slot="holder").count()
                holders += (
                    queue.filter(singleton_tracked=False, status__in=HOLDING_LEGACY_STATUSES).exclude(pk=run_id).count()
                )
                free = limit - holders
                front = list(queue.waiting().values_list("run_id", flat=True)[: max(free, limit)])
                if run_id in front[: max(free, 0)]:
                    runs.filter(pk=run_id).update(
                        singleton_slot="holder", singleton_tracked=True, admitted_at=now, updated_at=now
                    )
                    return AdmissionResult.ADMITTED
                seconds = self.admission_retry_seconds if run_id in front[:limit] else self.backlog_retry_seconds
                self._park_denied(
                    run_id, now + timedelta(seconds=retry_delay(seconds, self.admission_retry_jitter)), now
                )
                return AdmissionResult.PARKED

        return self._retrying(claim)

    def _park_denied(self, run_id: str, wake_at: datetime, now: datetime) -> None:
        """Park a denied run, inside the claim's transaction (S5 step 5)."""
        self._runs().filter(pk=run_id).update(
            status="suspended",
            wake_at=wake_at,
            lease_owner=None,
            lease_expires_at=None,
            park_reason="singleton",
            updated_at=now,
        )

    def wake_singleton_waiters(self, workflow_name: str, key: str, limit: int, now: datetime) -> list[str]:
        """Make the key's oldest ``limit`` waiters due now (S7).

        Takes the key's lock first, so a release is serialized with a claim
        that is parking a waiter: the waiter's park is committed before the
        release reads the queue, and no wake-up is lost (F6).
        """

        def wake() -> list[str]:
            with transaction.atomic(using=self.db):
                self._lock_key(workflow_name, key, None)
                runs = self._runs()
                front = list(runs.for_key(workflow_name, key).waiting().values_list("run_id", flat=True)[:limit])
                if front:
                    runs.filter(pk__in=front, status__in=("pending", "suspended")).update(wake_at=now)
                return front

        return self._retrying(wake)

    def singleton_catch_up(self, now: datetime, limits: dict[str, int]) -> list[str]:
        runs = self._runs()
        key_runs = runs.filter(workflow_name=OuterRef("workflow_name"), singleton_key=OuterRef("key"))
        holders = (
            key_runs.filter(singleton_slot="holder")
            .order_by()
            .values("singleton_key")
            .annotate(n=Count("pk"))
            .values("n")
        )
        keys = (
            SingletonKey.objects.using(self.db)
            .filter(workflow_name__in=list(limits))
            .annotate(
                holders=Coalesce(Subquery(holders), 0),
                has_waiter=Exists(key_runs.filter(singleton_slot="waiter")),
            )
            .filter(has_waiter=True, holders__lt=F("limit"))
            .values_list("workflow_name", "key", "limit", "holders")
        )
        woken: list[str] = []
        for workflow_name, key, key_limit, holder_count in keys:
            limit = limits.get(workflow_name, key_limit)
            free = limit - holder_count
            front = list(runs.for_key(workflow_name, key).waiting().values_list("run_id", flat=True)[:free])
            if front and runs.filter(pk__in=front, status__in=("pending", "suspended")).filter(
                Q(wake_at__isnull=True) | Q(wake_at__gt=now)
            ).update(wake_at=now):
                woken.extend(front)
        return woken

    def due_runs(self, now: datetime, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        later = now + timedelta(seconds=redelivery_seconds)
        db = self.db
        skip_locked = connections[db].features.has_select_for_update_skip_locked

        def take() -> list[str]:
            with transaction.atomic(using=db):
                runs = self._runs()
                parked = runs.due(now).order_by("wake_at")
                expired = runs.lease_expired(now).order_by("lease_expires_at")
                if skip_locked:
                    parked = parked.select_for_update(skip_locked=True)
                    expired = expired.select_for_update(skip_locked=True)
                due = list(parked.values_list("run_id", "workflow_name")[:batch])
                due += list(expired.values_list("run_id", "workflow_name")[: max(batch - len(due), 0)])
                if due:
                    runs.filter(pk__in=[run_id for run_id, _ in due]).update(wake_at=later)
                return due

        return self._retrying(take)

    def overdue_runs(self, now: datetime, batch: int) -> list[str]:
        """Return active runs whose execution deadline passed (D5)."""
        return list(
            self._runs()
            .filter(status__in=ACTIVE_STATUSES, deadline_at__lte=now)
            .values_list("run_id", flat=True)[:batch]
        )

    # -- reads -------------------------------------------------------------
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        rows = (
            self._runs().for_key(workflow_name, key).filter(status__in=ACTIVE_STATUSES).order_by("created_at", "run_id")
        )
        return [_record(r) for r in rows]

    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        """Count the key's active runs, in ``namespace`` if given (S15)."""
        runs = self._runs().for_key(workflow_name, key).filter(status__in=ACTIVE_STATUSES)
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return runs.count()

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        runs = self._runs().order_by("created_at", "run_id")
        if workflow_name is not None:
            runs = runs.filter(workflow_name=workflow_name)
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return [_record(r) for r in runs]

    # -- steps and signals -------------------------------------------------
    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        return {
            s.position: StepRecord(s.position, s.name, s.result, s.started_at, s.finished_at)
            for s in Step.objects.using(self.db).filter(run_id=run_id)
        }

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        try:
            with transaction.atomic(using=self.db):
                if not self._leased(run_id, owner).filter(cancel_requested=False).update(updated_at=step.finished_at):
                    return False
                Step.objects.using(self.db).create(
                    run_id=run_id,
                    position=step.position,
                    name=step.name,
                    result=step.result,
                    started_at=step.started_at,
                    finished_at=step.finished_at,
                )
                return True
        except IntegrityError:
            return False

    def add_signal(self, run_id: str, name: str, payload: Any, now: datetime) -> RunRecord | None:
        """Buffer a signal for an active run and make a run waiting on it due (D2)."""
        with transaction.atomic(using=self.db):
            row = self._runs().select_for_update().filter(pk=run_id).first()
            if row is None or row.status not in ACTIVE_STATUSES:
                return None
            Signal.objects.using(self.db).create(run_id=run_id, name=name, payload=payload, created_at=now)
            if row.status in ("suspended", "blocked") and row.park_reason.startswith("signal:"):
                self._runs().filter(pk=run_id).update(wake_at=now, updated_at=now)
                row.wake_at = now
            return _record(row)

    def load_signals(self, run_id: str) -> list[SignalRecord]:
        """Return the run's buffered signals in the order they were sent."""
        return [
            SignalRecord(s.pk, s.name, s.payload, s.created_at)
            for s in Signal.objects.using(self.db).filter(run_id=run_id).order_by("pk")
        ]
