"""The codec store (S13): any store, with payloads encoded at rest.

``CodecStore(inner, codec)`` wraps a :class:`~durable_singleton.stores.base.BaseStore`
and encodes with ``codec`` (a :class:`~durable_singleton.codecs.Codec`) every
payload on its way in: a run's input, output and error, step results and
signal payloads (and, through :mod:`durable_singleton.schedules`, schedule
inputs). What comes back out is decoded. Run ids, keys, statuses, tags and
times stay clear, so the claim, the queue pages and the tick work on them as
before; the admin shows encoded payloads as envelopes.

Every method is forwarded to ``inner``, the claim included, so admission
stays the inner store's one atomic call; the capability flags are the inner
store's. A payload this process cannot decode (a wrong key, another codec)
raises :class:`~durable_singleton.codecs.PayloadDecodeError` from the read.

To use it, name a subclass that builds it in ``DURABLE_SINGLETON["STORE"]``::

    # myproject/stores.py
    class EncryptedStore(CodecStore):
        def __init__(self) -> None:
            # A rotation deploys the new key in decode_only first (docs/codec.rst).
            fernet = FernetCodec(settings.PAYLOAD_KEY, decode_only=settings.PAYLOAD_DECODE_KEYS)
            super().__init__(DjangoStore(), ChainCodec(ZlibCodec(), fernet))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, TypeVar

from ..codecs import Codec
from ..conf import Settings
from ..records import Beat, KeyCount, KeyQueue, PurgeReport, SlotCount, ThrottleWaitCount, WorkerRecord
from .base import (
    BaseStore,
    ControlChange,
    ControlChangeRecord,
    ControlResult,
    Debounced,
    Finish,
    Limits,
    QueueTtls,
    RetryPolicy,
    RunRecord,
    ScheduleStore,
    SignalRecord,
    StepRecord,
    Superseding,
    Turn,
)

__all__ = ["CodecStore"]

T = TypeVar("T")


class CodecStore(BaseStore):
    """Wrap ``inner`` (a BaseStore) so payloads are stored encoded by ``codec`` (S13)."""

    codec: Codec

    def __init__(self, inner: BaseStore, codec: Codec) -> None:
        self.inner = inner
        self.codec = codec
        # Every capability is the inner store's: each ``supports_*`` flag the seam declares
        # (tests/codecs/test_codec_store.py fails if one is missing here).
        self.supports_atomic_admission = inner.supports_atomic_admission
        self.supports_bulk_start = inner.supports_bulk_start
        self.supports_schedules = inner.supports_schedules
        self.supports_key_controls = inner.supports_key_controls
        self.supports_queue_ttl = inner.supports_queue_ttl
        self.supports_on_busy = inner.supports_on_busy
        self.supports_quotas = inner.supports_quotas
        self.supports_debounce = inner.supports_debounce
        self.supports_throttles = inner.supports_throttles
        self.supports_slot_repairs = inner.supports_slot_repairs
        self.writes_turn_notices = inner.writes_turn_notices

    # -- encoding ------------------------------------------------------------------
    def _in(self, run: RunRecord) -> RunRecord:
        enc = self.codec.encode
        return run.evolve(input=enc(run.input), output=enc(run.output), error=enc(run.error))

    def _out(self, value: Any) -> Any:
        dec = self.codec.decode
        if value is None:
            return None
        if isinstance(value, RunRecord):
            return value.evolve(input=dec(value.input), output=dec(value.output), error=dec(value.error))
        if isinstance(value, Superseding):
            return replace(
                value,
                run=self._out(value.run),
                replaced=self._out(value.replaced),
                cancelled=self._out(value.cancelled),
                stopping=self._out(value.stopping),
            )
        if isinstance(value, Turn | Finish):
            return replace(value, run=self._out(value.run), granted=tuple(self._out(r) for r in value.granted))
        if isinstance(value, StepRecord):
            return replace(value, result=dec(value.result))
        if isinstance(value, SignalRecord):
            return replace(value, payload=dec(value.payload))
        if isinstance(value, tuple):
            return tuple(self._out(v) for v in value)
        if isinstance(value, list):
            return [self._out(v) for v in value]
        return value

    # -- the store -------------------------------------------------------------------
    def now(self) -> datetime:
        return self.inner.now()

    @property
    def database(self) -> str | None:
        """Return the inner store's database alias."""
        return self.inner.database

    def transaction_depth(self) -> int:
        return self.inner.transaction_depth()

    def in_transaction(self, fn: Callable[[], T]) -> T:
        return self.inner.in_transaction(fn)

    def is_unreachable(self, exc: BaseException) -> bool:
        return self.inner.is_unreachable(exc)

    def discard_broken_connection(self) -> None:
        self.inner.discard_broken_connection()

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
        """The inner store's key controls (they hold no payload)."""
        return self.inner.apply_key_controls(workflow, keys, change, by=by, reason=reason, now=now)

    def key_control_state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        return self.inner.key_control_state(workflow, key)

    def key_control_history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        return self.inner.key_control_history(workflow, key, limit)

    def schedule_state(self, codec: Codec | None = None) -> ScheduleStore:
        """Return the inner store's schedule state, its inputs encoded by this store's codec (S13)."""
        return self.inner.schedule_state(codec or self.codec)

    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        stored, created = self.inner.create_run(self._in(run), cap=cap, cap_namespace=cap_namespace)
        return self._out(stored), created

    @property
    def stamps_starts(self) -> bool:  # type: ignore[override]
        """The inner store's: whether its :meth:`start_run` stamps ``created_at`` itself (R8)."""
        return self.inner.stamps_starts

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
        stored, created = self.inner.start_run(
            self._in(run),
            cap=cap,
            cap_namespace=cap_namespace,
            deep_limit=deep_limit,
            backlog_wake_at=backlog_wake_at,
            stamp=stamp,
        )
        return self._out(stored), created

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
        stored, created = self.inner.start_run_with_notice(
            self._in(run),
            queue=queue,
            cap=cap,
            cap_namespace=cap_namespace,
            deep_limit=deep_limit,
            backlog_wake_at=backlog_wake_at,
            stamp=stamp,
        )
        return self._out(stored), created

    def create_runs(
        self, runs: Sequence[RunRecord], *, caps: Mapping[str, int | None], cap_namespace: str | None = None
    ) -> list[tuple[RunRecord, bool] | BaseException]:
        results = self.inner.create_runs([self._in(r) for r in runs], caps=caps, cap_namespace=cap_namespace)
        return [r if isinstance(r, BaseException) else (self._out(r[0]), r[1]) for r in results]

    def lock_superseding_batch(self, runs: Sequence[RunRecord]) -> None:
        self.inner.lock_superseding_batch([self._in(r) for r in runs])

    def start_superseding(
        self, run: RunRecord, *, on_busy: str, limits: Limits, cap_namespace: str | None = None
    ) -> Superseding:
        started = self.inner.start_superseding(
            self._in(run), on_busy=on_busy, limits=limits, cap_namespace=cap_namespace
        )
        return self._out(started)  # type: ignore[no-any-return]

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
        """The inner store's debounced start, the input encoded (X7, S13)."""
        started = self.inner.start_debounced(
            self._in(run),
            seconds=seconds,
            max_seconds=max_seconds,
            timeout=timeout,
            cap=cap,
            cap_namespace=cap_namespace,
            explicit_id=explicit_id,
        )
        return replace(started, run=self._out(started.run))

    def get_run(self, run_id: str) -> RunRecord | None:
        return self._out(self.inner.get_run(run_id))  # type: ignore[no-any-return]

    def queue_is_deep(self, workflow_name: str, key: str, limit: int, *, priority: int = 0) -> bool:
        return self.inner.queue_is_deep(workflow_name, key, limit, priority=priority)

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
        turn = self.inner.begin_turn(
            run_id,
            owner,
            lease_seconds=lease_seconds,
            limits=limits,
            max_recoveries=max_recoveries,
            retry=retry,
            known=self._in(known) if known is not None else None,
            ttls=ttls,
        )
        return self._out(turn)  # type: ignore[no-any-return]

    def claim_run(self, run_id: str, owner: str, lease_seconds: float) -> Turn:
        return self._out(self.inner.claim_run(run_id, owner, lease_seconds))  # type: ignore[no-any-return]

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        return self.inner.renew_lease(run_id, owner, lease_seconds)

    def check_boundary(self, run_id: str, owner: str, lease_seconds: float) -> str:
        return self.inner.check_boundary(run_id, owner, lease_seconds)

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        return self.inner.save_step(run_id, owner, replace(step, result=self.codec.encode(step.result)))

    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        return {position: self._out(step) for position, step in self.inner.load_steps(run_id).items()}

    def park(self, run_id: str, owner: str, status: str, *, wake_at: datetime | None, reason: str = "") -> str:
        return self.inner.park(run_id, owner, status, wake_at=wake_at, reason=reason)

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
        done = self.inner.finish(
            self._in(run),
            owner,
            status,
            output=self.codec.encode(output),
            error=self.codec.encode(error),
            limits=limits,
            expect=expect,
            finished_at=finished_at,
            ttls=ttls,
        )
        return self._out(done)  # type: ignore[no-any-return]

    def request_cancel(
        self, run_id: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> Finish | RunRecord | None:
        return self._out(self.inner.request_cancel(run_id, limits=limits, ttls=ttls))  # type: ignore[no-any-return]

    def reset_for_retry(self, run_id: str, redelivery_seconds: float, deadline_at: datetime | None) -> RunRecord | None:
        return self._out(self.inner.reset_for_retry(run_id, redelivery_seconds, deadline_at))  # type: ignore[no-any-return]

    def release(
        self, workflow_name: str, key: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> tuple[RunRecord, ...]:
        return self._out(self.inner.release(workflow_name, key, limits=limits, ttls=ttls))  # type: ignore[no-any-return]

    @property
    def admits_quotas(self) -> bool:
        return self.inner.admits_quotas

    def quota_queue(self, name: str, key: str, run_id: str) -> tuple[int | None, int, list[str]]:
        return self.inner.quota_queue(name, key, run_id)

    def quota_tokens(self, run_id: str) -> dict[str, int]:
        return self.inner.quota_tokens(run_id)

    def delete_run(self, run_id: str) -> RunRecord | None:
        return self._out(self.inner.delete_run(run_id))  # type: ignore[no-any-return]

    def add_signal(self, run_id: str, name: str, payload: Any, *, signal_id: str | None = None) -> RunRecord | None:
        encoded = self.codec.encode(payload)
        return self._out(self.inner.add_signal(run_id, name, encoded, signal_id=signal_id))  # type: ignore[no-any-return]

    def load_signals(self, run_id: str) -> list[SignalRecord]:
        return self._out(self.inner.load_signals(run_id))  # type: ignore[no-any-return]

    def children(self, run_id: str) -> list[str]:
        return self.inner.children(run_id)

    def children_of_cancelled(self, batch: int) -> list[str]:
        return self.inner.children_of_cancelled(batch)

    def due_runs(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        return self.inner.due_runs(redelivery_seconds=redelivery_seconds, batch=batch)

    def expired_leases(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        return self.inner.expired_leases(redelivery_seconds=redelivery_seconds, batch=batch)

    def overdue_runs(self, batch: int) -> list[RunRecord]:
        return self._out(self.inner.overdue_runs(batch))  # type: ignore[no-any-return]

    def expired_waiters(self, ttls: QueueTtls, batch: int) -> list[RunRecord]:
        return self._out(self.inner.expired_waiters(ttls, batch))  # type: ignore[no-any-return]

    def expire_waiter(self, run: RunRecord, ttl: float, *, limits: Limits, ttls: QueueTtls | None = None) -> Finish:
        return self._out(self.inner.expire_waiter(self._in(run), ttl, limits=limits, ttls=ttls))  # type: ignore[no-any-return]

    def request_timeout_cancel(self, run_id: str) -> bool:
        return self.inner.request_timeout_cancel(run_id)

    def catch_up(self, *, limits: Limits, batch: int, ttls: QueueTtls | None = None) -> tuple[RunRecord, ...]:
        return self._out(self.inner.catch_up(limits=limits, batch=batch, ttls=ttls))  # type: ignore[no-any-return]

    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        return self._out(list(self.inner.active_runs_for_key(workflow_name, key)))  # type: ignore[no-any-return]

    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        return self.inner.count_active_for_key(workflow_name, key, namespace)

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        return self._out(self.inner.list_runs(workflow_name=workflow_name, namespace=namespace))  # type: ignore[no-any-return]

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
        chosen = self.inner.select_runs(
            limit=limit,
            run_ids=run_ids,
            workflow_name=workflow_name,
            key=key,
            statuses=statuses,
            created_before=created_before,
            namespace=namespace,
            oldest_first=oldest_first,
        )
        return self._out(chosen)  # type: ignore[no-any-return]

    def key_queue(self, run: RunRecord, named: int) -> KeyQueue:
        return self.inner.key_queue(run, named)

    def recent_completions(self, workflow_name: str, key: str, count: int) -> list[tuple[datetime | None, datetime]]:
        return self.inner.recent_completions(workflow_name, key, count)

    def throttle_state(self, name: str, key: str, period: float) -> tuple[int, datetime | None]:
        return self.inner.throttle_state(name, key, period)

    def prune_throttle_admissions(self, periods: Mapping[str, float], batch: int) -> int:
        return self.inner.prune_throttle_admissions(periods, batch)

    def wake_throttled(self, name: str, key: str, limit: int, *, retrying: bool = True) -> tuple[RunRecord, ...]:
        return tuple(self._out(run) for run in self.inner.wake_throttled(name, key, limit, retrying=retrying))

    def seconds_to_next_wake(self, horizon: float) -> float | None:
        return self.inner.seconds_to_next_wake(horizon)

    def hand_back_leases(self, run_ids: Sequence[str], owner_prefix: str) -> int:
        return self.inner.hand_back_leases(run_ids, owner_prefix)

    def worker_processes(self) -> list[WorkerRecord] | None:
        return self.inner.worker_processes()

    def record_beat(self, name: str, at: datetime, owner: str) -> bool:
        return self.inner.record_beat(name, at, owner)

    def beat(self, name: str) -> Beat | None:
        return self.inner.beat(name)

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
        return self.inner.purge_finished(
            before=before, statuses=statuses, workflow_name=workflow_name, key=key, limit=limit, dry_run=dry_run
        )

    def slot_counts(self) -> list[SlotCount]:
        return self.inner.slot_counts()

    def throttle_waiter_counts(self) -> list[ThrottleWaitCount]:
        return self.inner.throttle_waiter_counts()

    def count_backlog(self, created_by: datetime) -> int:
        return self.inner.count_backlog(created_by)

    def unrenewed_leases(
        self, *, settings: Settings, now: datetime, limit: int
    ) -> tuple[dict[str, int], list[RunRecord]]:
        counts, runs = self.inner.unrenewed_leases(settings=settings, now=now, limit=limit)
        return counts, self._out(runs)

    def controlled_keys(self) -> dict[tuple[str, str], tuple[bool, int | None]]:
        return self.inner.controlled_keys()

    def limit_changed_at(self, workflow: str, key: str) -> datetime | None:
        return self.inner.limit_changed_at(workflow, key)

    def key_holder_counts(self) -> list[KeyCount]:
        return self.inner.key_holder_counts()

    def throttle_window_counts(self, name: str, since: datetime) -> list[KeyCount]:
        return self.inner.throttle_window_counts(name, since)

    def inactive_holders(self, limit: int) -> list[RunRecord]:
        return self._out(self.inner.inactive_holders(limit))  # type: ignore[no-any-return]

    def overdue_waiter_keys(self, since: datetime) -> list[KeyCount]:
        return self.inner.overdue_waiter_keys(since)

    def overdue_quota_waiters(self, since: datetime, limit: int) -> list[RunRecord]:
        return self._out(self.inner.overdue_quota_waiters(since, limit))  # type: ignore[no-any-return]

    def overdue_throttle_keys(self, since: datetime) -> list[KeyCount]:
        return self.inner.overdue_throttle_keys(since)

    def due_throttle_waiters(self, name: str, key: str, limit: int) -> list[RunRecord]:
        return self._out(self.inner.due_throttle_waiters(name, key, limit))  # type: ignore[no-any-return]

    def key_freed_since(self, workflow_name: str, key: str, since: datetime) -> bool:
        return self.inner.key_freed_since(workflow_name, key, since)

    def due_waiters(self, workflow_name: str, key: str, limit: int) -> list[RunRecord]:
        return self._out(self.inner.due_waiters(workflow_name, key, limit))  # type: ignore[no-any-return]

    def unredriven_leases(self, since: datetime, limit: int) -> list[RunRecord]:
        return self._out(self.inner.unredriven_leases(since, limit))  # type: ignore[no-any-return]

    def drop_holder_marker(self, run_id: str) -> bool:
        return self.inner.drop_holder_marker(run_id)

    def wake_waiter(self, run_id: str) -> bool:
        return self.inner.wake_waiter(run_id)

    def wake_throttle_waiter(self, run_id: str, wake_at: datetime | None) -> bool:
        return self.inner.wake_throttle_waiter(run_id, wake_at)

    def redrive_lease(self, run_id: str, lease_expires_at: datetime) -> bool:
        return self.inner.redrive_lease(run_id, lease_expires_at)
