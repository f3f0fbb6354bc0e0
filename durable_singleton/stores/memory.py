"""The in-memory store: a product feature for users' tests, not a stand-in
for the database tests. Every method runs inside one critical section, so
its claim and its handoff are atomic (S13); its clock (``clock``) is the one
clock of its leases (R5)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.utils import timezone

from ..admission import (
    QUOTA_PREFIX,
    cap_in_force,
    debounce_fair_shares,
    debounce_open,
    debounce_throttle_keys,
    declared_limit,
    fair_place,
    free_slots,
    handoff_admits,
    is_due,
    limit_in_force,
    queue_ttl_expired,
    quota_front_reaches,
    quota_lock_name,
    retry_delay,
    superseded,
    throttle_lock_name,
    throttle_room,
    turn_on_its_way,
    turn_rung,
    waiter_expired,
)
from ..exceptions import QuotaQueueFullError, SingletonQueueFullError
from ..records import Beat, KeyCount
from ..statuses import (
    ACTIVE_STATUSES,
    PARKED_STATUSES,
    WAKEABLE_STATUSES,
    ParkReason,
    Rung,
    RunStatus,
    SlotState,
    Verdict,
)
from .base import (
    CANCELLED_ERROR,
    QUEUE_TTL_ERROR,
    REPLACED_ERROR,
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
    SignalRecord,
    StepRecord,
    Superseding,
    Turn,
    TurnState,
    cancel_error,
    control_records,
    handed_off,
)

__all__ = ["MemoryStore"]

T = TypeVar("T")


class MemoryStore(BaseStore):
    """Runs, steps and signals in dictionaries guarded by one lock.

    ``clock`` returns the store's current aware time (default: Django's
    ``timezone.now``); a test may pass a fake one to move leases and wake times.
    """

    supports_atomic_admission = True
    supports_key_controls = True
    supports_queue_ttl = True
    supports_on_busy = True
    supports_quotas = True
    supports_debounce = True
    supports_throttles = True
    supports_slot_repairs = True
    supports_schedules = True  # the default in-memory state lives as long as the store
    #: A start's ``created_at`` is this store's clock, read as the start is stored (R8): the claim's
    #: ``started_at`` is read from the same clock after it, never before.
    stamps_starts = True

    def __init__(
        self,
        *,
        redelivery_seconds: float = 5.0,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._runs: dict[str, RunRecord] = {}
        self._steps: dict[str, dict[int, StepRecord]] = {}
        self._signals: dict[str, list[SignalRecord]] = {}
        self._signal_ids: set[tuple[str, str]] = set()
        self._signal_seq = 0
        self._tokens: dict[tuple[str, str], int] = {}
        self._quota_tokens: dict[str, dict[str, int]] = {}  # run id -> quota name -> token (X3f)
        self._quota_tags: dict[tuple[str, str], int] = {}  # (run id, quota name) -> fair tag (X4)
        self._folded: dict[str, str] = {}  # a folded start's explicit run id -> the run it went into (X7c)
        self._throttle_admissions: dict[tuple[str, str], list[datetime]] = {}  # (throttle, key) -> admissions (X6)
        self.controls: dict[tuple[str, str], dict[str, Any]] = {}
        self._control_records: list[ControlChangeRecord] = []
        self._beats: dict[str, Beat] = {}  # heartbeats by name (O3)
        self.redelivery_seconds = redelivery_seconds
        self.clock = clock or timezone.now

    @contextmanager
    def _critical(self) -> Iterator[None]:
        with self._lock:
            yield

    def now(self) -> datetime:
        return self.clock()

    def _replace(self, run: RunRecord, **changes: Any) -> RunRecord:
        new = run.evolve(updated_at=self.clock(), **changes)
        self._runs[run.run_id] = new
        return new

    def _key_runs(self, workflow_name: str, key: str) -> list[RunRecord]:
        return [
            r
            for r in self._runs.values()
            if r.workflow_name == workflow_name and r.singleton_key == key and not r.is_terminal
        ]

    def _waiters(self, workflow_name: str, key: str) -> list[RunRecord]:
        """The key's due waiters in admission order (S5 step 3, X5)."""
        now = self.clock()
        runs = [r for r in self._key_runs(workflow_name, key) if not r.holds_slot and is_due(r.not_before, now)]
        return sorted(runs, key=lambda r: r.queue_place)

    def _expired(self, run: RunRecord) -> bool:
        return run.lease_expires_at is None or run.lease_expires_at <= self.clock()

    # -- starting ------------------------------------------------------------------
    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        with self._critical():
            existing = self._runs.get(run.run_id)
            if existing is not None:
                return existing, False
            if cap is not None and run.singleton_key is not None:
                override = self.controls.get((run.workflow_name, run.singleton_key), {}).get("limit_override")
                in_force = cap_in_force(cap, run.singleton_limit, override)  # S15, K2
                full = self.count_active_for_key(run.workflow_name, run.singleton_key, cap_namespace) >= in_force
            else:
                full = False
            self._check_quota_caps(run, cap_namespace)
            if full:
                assert run.singleton_key is not None and cap is not None
                raise SingletonQueueFullError(run.workflow_name, run.singleton_key, cap - (run.singleton_limit or 1))
            self._insert(run)
            return run, True

    def _check_quota_caps(self, run: RunRecord, namespace: str | None, leaving: Collection[str] = ()) -> None:
        """Raise :class:`QuotaQueueFullError` if a capped quota key of ``run`` already
        has its cap in force of active members (in ``namespace`` if given), not
        counting the runs ``leaving``; see DjangoStore._check_quota_caps (S15, X3j)."""
        for name, limit, depth in run.quota_caps:
            key = dict(run.quota_keys)[name]
            override = self.controls.get((quota_lock_name(name), key), {}).get("limit_override")
            members = [
                r
                for r in self._quota_members(name, key)
                if r.run_id not in leaving and (namespace is None or r.namespace == namespace)
            ]
            if len(members) >= cap_in_force(limit + depth, limit, override):
                raise QuotaQueueFullError(run.workflow_name, name, key, depth)

    def start_superseding(
        self, run: RunRecord, *, on_busy: str, limits: Limits, cap_namespace: str | None = None
    ) -> Superseding:
        """:meth:`BaseStore.start_superseding` inside the critical section (X1, S13),
        the quota caps counted without the runs it ends (X3j)."""
        assert run.singleton_key is not None
        workflow_name, key = run.workflow_name, run.singleton_key
        with self._critical():
            existing = self._runs.get(run.run_id)
            if existing is not None:
                return Superseding(existing, False)
            active = sorted(self._key_runs(workflow_name, key), key=lambda r: r.queue_place)
            # A running run holds its slot (S4), marked or not: a subclass on the
            # S14 fallback claim marks none, and a running run is never replaced.
            holders = [r for r in active if r.holds_slot or r.status == RunStatus.RUNNING]
            waiters = [r for r in active if r not in holders]
            paused = bool(self.controls.get((workflow_name, key), {}).get("paused", False))
            free = free_slots(self._limit(workflow_name, key, limits), len(holders), paused=paused)
            to_replace, stop = superseded(on_busy, free, holders, waiters, lambda r: r.quota_slot is not None)
            running = [r for r in stop if r.status == RunStatus.RUNNING]
            leaving = {r.run_id for r in to_replace} | {r.run_id for r in stop if r not in running}
            self._check_quota_caps(run, cap_namespace, leaving)
            replaced = tuple(self._cancelled(r, REPLACED_ERROR) for r in to_replace)
            cancelled = tuple(self._cancelled(r, CANCELLED_ERROR) for r in stop if r not in running)
            stopping = tuple(self._replace(r, cancel_requested=True, wake_at=self.clock()) for r in running)
            self._insert(run)
            return Superseding(run, True, replaced, cancelled, stopping)

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
        """:meth:`BaseStore.start_debounced` inside the critical section (X7, X7a-c)."""
        with self._critical():
            existing = self._runs.get(run.run_id)
            if existing is None and run.run_id in self._folded:
                existing = self._runs.get(self._folded[run.run_id])
            if existing is not None:
                return Debounced(existing, False)
            now = self.clock()
            candidates = sorted(
                (
                    r
                    for r in self._runs.values()
                    if r.workflow_name == run.workflow_name
                    and r.workflow_version == run.workflow_version
                    and r.debounce_key == run.debounce_key
                    and r.namespace == run.namespace
                    and r.singleton_key == run.singleton_key
                    and r.quota_keys == run.quota_keys
                    and debounce_fair_shares(r.quota_shares) == debounce_fair_shares(run.quota_shares)
                    and debounce_throttle_keys(r.throttle_keys) == debounce_throttle_keys(run.throttle_keys)
                    and debounce_open(r, now)
                ),
                key=lambda r: (r.created_at, r.run_id),
            )
            if candidates:
                open_run = candidates[-1]
                assert open_run.debounce_until is not None
                starts = min(now + timedelta(seconds=seconds), open_run.debounce_until)
                folded = self._replace(
                    open_run,
                    input=run.input,
                    not_before=starts,
                    wake_at=starts,
                    deadline_at=starts + timedelta(seconds=timeout) if timeout is not None else None,
                )
                if explicit_id:
                    self._folded[run.run_id] = folded.run_id
                return Debounced(folded, False, True)
            starts = now + timedelta(seconds=seconds)
            new = run.evolve(
                created_at=now,
                updated_at=now,
                not_before=starts,
                wake_at=starts,
                debounce_until=now + timedelta(seconds=max_seconds),
                deadline_at=starts + timedelta(seconds=timeout) if timeout is not None else None,
            )
            stored, created = self.create_run(new, cap=cap, cap_namespace=cap_namespace)
            return Debounced(stored, created)

    def _cancelled(self, run: RunRecord, error: dict[str, str]) -> RunRecord:
        """Settle a parked run ``cancelled`` with ``error``, granting nothing (X1)."""
        return self._replace(
            run,
            status=RunStatus.CANCELLED,
            error=dict(error),
            admitted=False,
            tracked=False,
            quota_slot=None,
            quota_tokens=(),
            wake_at=None,
            finished_at=self.clock(),
        )

    def _insert(self, run: RunRecord) -> None:
        """Store a new run; each fair quota key it carries gets its tag (X4), under the lock."""
        shares = {name: (sub_key, weight) for name, sub_key, weight in run.quota_shares}
        for name, key in run.quota_keys:
            if name not in shares:
                continue
            sub_key, weight = shares[name]
            members = self._quota_members(name, key)
            holding = [self._quota_tags.get((r.run_id, name), 0) for r in members if r.holds_quota_slots]
            peers = [r for r in members if any(q == name and s == sub_key for q, s, _ in r.quota_shares)]
            mine = [self._quota_tags.get((r.run_id, name), 0) for r in peers]
            # Its sub-key's waiters of a lower priority: it passes them (X8c).
            lower = [r.run_id for r in peers if r.quota_slot == SlotState.WAITER and r.priority < run.priority]
            tag, shift = fair_place(
                max(holding, default=0),
                max(mine, default=None),
                weight,
                [self._quota_tags.get((r, name), 0) for r in lower],
            )
            for run_id in lower:
                self._quota_tags[(run_id, name)] = self._quota_tags.get((run_id, name), 0) + shift
            self._quota_tags[(run.run_id, name)] = tag
        self._runs[run.run_id] = run

    def queue_is_deep(self, workflow_name: str, key: str, limit: int, *, priority: int = 0) -> bool:
        with self._critical():
            holders = sum(1 for r in self._key_runs(workflow_name, key) if r.holds_slot)
            before = sum(1 for r in self._waiters(workflow_name, key) if r.priority >= priority)
            return holders >= limit and before >= limit

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._critical():
            return self._runs.get(run_id)

    def delete_run(self, run_id: str) -> RunRecord | None:
        with self._critical():
            self._steps.pop(run_id, None)
            self._signals.pop(run_id, None)
            self._signal_ids = {k for k in self._signal_ids if k[0] != run_id}
            self._folded = {k: v for k, v in self._folded.items() if v != run_id}
            return self._runs.pop(run_id, None)

    # -- admission -------------------------------------------------------------------
    def _limit(self, workflow_name: str, key: str, limits: Limits) -> int:
        control = self.controls.get((workflow_name, key), {})
        stored = (r.singleton_limit for r in self._key_runs(workflow_name, key))
        return limit_in_force(declared_limit(limits, workflow_name, stored), control.get("limit_override"))

    def _grant(
        self,
        workflow_name: str,
        key: str,
        limits: Limits,
        claimant: str | None = None,
        ttls: QueueTtls | None = None,
        carriers: Collection[str] = (),
    ) -> tuple[list[RunRecord], bool, int]:
        """Give the key's free slots to its oldest waiters not past their TTL in
        ``ttls`` on this store's clock (S5, S7, K1, X2); see DjangoStore._grant.
        ``carriers``: the waiters that carry quotas a handoff admits (X3h)."""
        limit = self._limit(workflow_name, key, limits)
        runs = self._key_runs(workflow_name, key)
        holders = sum(1 for r in runs if r.holds_slot)
        ttl, now = (ttls or {}).get(workflow_name), self.clock()
        waiters = [
            w
            for w in self._waiters(workflow_name, key)
            # A parked waiter past its TTL gets no slot; a running run without the
            # marker (the S14 fallback's claim) keeps its place (X2).
            if w.status == RunStatus.RUNNING or not waiter_expired(w.created_at, ttl, now)
        ]
        paused = bool(self.controls.get((workflow_name, key), {}).get("paused", False))
        free = free_slots(limit, holders, paused=paused)
        granted: list[RunRecord] = []
        claimant_token = 0
        for run in waiters[:free]:
            if run.quota_slot is not None and run.run_id != claimant and run.run_id not in carriers:
                # It carries quotas: it keeps its place and is sent a turn; its own
                # claim decides under all its limits (X3h).
                granted.append(run)
                continue
            token = self._tokens.get((workflow_name, key), 0) + 1
            self._tokens[(workflow_name, key)] = token
            if run.run_id == claimant:
                claimant_token = token
                continue
            granted.append(
                self._replace(
                    run,
                    admitted=True,
                    tracked=True,
                    fencing_token=token,
                    admitted_at=now,
                    wake_at=now + timedelta(seconds=self.redelivery_seconds),
                    quota_slot=SlotState.HOLDER if run.quota_slot is not None else None,
                )
            )
        in_front = any(w.run_id == claimant for w in waiters[:limit])
        return granted, in_front, claimant_token

    # -- a turn ------------------------------------------------------------------------
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
        with self._critical():
            run = self._runs.get(run_id)
            if run is None:
                return Turn(TurnState.SKIPPED)
            now = self.clock()
            due = is_due(run.not_before, now)
            rung = turn_rung(run, expired=self._expired(run), due=due, max_recoveries=max_recoveries)
            if rung is Rung.SKIP:
                return Turn(TurnState.SKIPPED, run)
            recovered = run.status == RunStatus.RUNNING
            if rung is Rung.CANCEL:
                done = self._settle(run, RunStatus.CANCELLED, None, cancel_error(run.deadline_at, now), limits, ttls)
                return Turn(TurnState.SETTLED, done.run, granted=done.granted)
            if rung is Rung.DEAD:
                error = {"code": "max_recoveries", "message": f"lease expired {run.recoveries + 1} times"}
                # The expired lease counts as one more recovery, then the run is dead (D4).
                run = self._replace(run, recoveries=run.recoveries + 1)
                done = self._settle(run, RunStatus.DEAD, None, error, limits, ttls)
                return Turn(TurnState.SETTLED, done.run, granted=done.granted)
            if rung is Rung.NOT_DUE:
                # A delayed start before its time (X5): no claim; the tick sends it at not_before.
                return Turn(TurnState.SKIPPED, self._replace(run, wake_at=run.not_before))
            take: dict[str, Any] = {
                "status": RunStatus.RUNNING,
                "lease_owner": owner,
                "lease_expires_at": now + timedelta(seconds=lease_seconds),
                "wake_at": None,
                "attempts": run.attempts + 1,
                "recoveries": run.recoveries + (1 if recovered else 0),
                "started_at": run.started_at or now,
            }
            if rung is Rung.LIMITS:
                return self._quota_turn(run, take, recovered, limits, retry, ttls)
            key = run.singleton_key
            if rung is not Rung.ADMIT:  # Rung.TAKE or TAKE_OVER: a plain run or a holder (S6)
                if key is not None:
                    take.update(admitted=True, tracked=True)
                if rung is Rung.TAKE_OVER:
                    assert key is not None  # a holder has a key
                    # A takeover gets a new token: the stalled executor's is smaller (K1, R5).
                    token = self._tokens.get((run.workflow_name, key), 0) + 1
                    self._tokens[(run.workflow_name, key)] = token
                    take.update(fencing_token=token)
                return Turn(TurnState.RUN, self._replace(run, **take), recovered=recovered)
            assert key is not None  # a waiter has a key
            if not run.tracked:
                run = self._replace(run, tracked=True)  # an older release's run joins the queue (S12)
            granted, in_front, token = self._grant(run.workflow_name, key, limits, claimant=run_id, ttls=ttls)
            if token:
                taken = self._replace(run, admitted=True, fencing_token=token, admitted_at=now, **take)
                return Turn(TurnState.RUN, taken, recovered=recovered, granted=tuple(granted), admitted=True)
            seconds = retry.seconds if in_front else retry.backlog_seconds
            parked = self._replace(
                run,
                status=RunStatus.SUSPENDED,
                attempts=run.attempts + 1,
                wake_at=now + timedelta(seconds=retry_delay(seconds, retry.jitter)),
                lease_owner=None,
                lease_expires_at=None,
                park_reason=ParkReason.SINGLETON,
            )
            return Turn(TurnState.PARKED, parked, granted=tuple(granted))

    # -- shared quotas (X3) --------------------------------------------------------------
    def _quota_members(self, name: str, key: str) -> list[RunRecord]:
        """The active runs that carry the quota key ``(name, key)`` (X3b)."""
        return [r for r in self._runs.values() if (name, key) in r.quota_keys and not r.is_terminal]

    def _quota_front(self, name: str, key: str, limits: Limits, ttls: QueueTtls | None = None) -> tuple[int, list[str]]:
        """A quota key's free slots and its oldest due waiters' ids, as many as its
        limit, by (``created_at``, ``run_id``), none past its workflow's TTL in
        ``ttls`` (X3c, X3d, X2); see DjangoStore._quota_front."""
        control = self.controls.get((quota_lock_name(name), key), {})
        limit = limit_in_force(declared_limit(limits, quota_lock_name(name), (1,)), control.get("limit_override"))
        now = self.clock()
        members = self._quota_members(name, key)
        holders = sum(1 for r in members if r.holds_quota_slots)
        free = free_slots(limit, holders, paused=bool(control.get("paused", False)))
        return free, self._quota_order(name, members, now, ttls)[:limit]

    def _quota_order(
        self, name: str, members: Sequence[RunRecord], now: datetime, ttls: QueueTtls | None = None
    ) -> list[str]:
        """The due waiters among ``members`` of the quota ``name`` in admission order,
        by (tag, priority descending, ``created_at``, ``run_id``) (X3d, X4, X8,
        :func:`~durable_singleton.admission.fair_tag`);
        with ``ttls``, none past its workflow's TTL (X2: every grant skips them)."""
        waiters = (
            r
            for r in members
            if r.quota_slot == SlotState.WAITER
            and is_due(r.not_before, now)
            and not waiter_expired(r.created_at, (ttls or {}).get(r.workflow_name), now)
        )
        ordered = sorted(waiters, key=lambda r: (self._quota_tags.get((r.run_id, name), 0), *r.queue_place))
        return [r.run_id for r in ordered]

    def _quota_turns(
        self, quota_keys: Sequence[tuple[str, str]], limits: Limits, exclude: set[str], ttls: QueueTtls | None = None
    ) -> list[RunRecord]:
        """The waiters within the free slots of ``quota_keys``, as they are: each
        is sent a turn (X3g, X3h)."""
        ids: list[str] = []
        for name, key in sorted(set(quota_keys)):
            free, waiters = self._quota_front(name, key, limits, ttls)
            ids.extend(i for i in waiters[:free] if i not in exclude and i not in ids)
        return [self._runs[i] for i in ids]

    def _take_quota_tokens(self, run: RunRecord) -> tuple[tuple[str, int], ...]:
        tokens: dict[str, int] = {}
        for name, key in run.quota_keys:
            token = self._tokens.get((quota_lock_name(name), key), 0) + 1
            self._tokens[(quota_lock_name(name), key)] = token
            tokens[name] = token
        self._quota_tokens[run.run_id] = tokens
        return tuple(sorted(tokens.items()))

    def _quota_turn(
        self,
        run: RunRecord,
        take: dict[str, Any],
        recovered: bool,
        limits: Limits,
        retry: RetryPolicy,
        ttls: QueueTtls | None,
    ) -> Turn:
        """Admit, confirm, recover or park a run that carries quotas; see
        DjangoStore._quota_turn (X3c, X3d, X3f, S5)."""
        key = run.singleton_key
        keyed = key is not None
        now = self.clock()
        if keyed:
            take.update(admitted=True, tracked=True)
        if run.quota_slot == SlotState.HOLDER:
            if recovered:
                # A takeover: a new token in every limit the run holds (K1, X3f).
                if key is not None:
                    token = self._tokens.get((run.workflow_name, key), 0) + 1
                    self._tokens[(run.workflow_name, key)] = token
                    take.update(fencing_token=token)
                take.update(quota_tokens=self._take_quota_tokens(run))
            else:
                take.update(quota_tokens=tuple(sorted(self._quota_tokens.get(run.run_id, {}).items())))
            return Turn(TurnState.RUN, self._replace(run, **take), recovered=recovered)
        fronts = [self._quota_front(name, qkey, limits, ttls) for name, qkey in run.quota_keys]
        reaches = all(quota_front_reaches(run.run_id, waiters, free) for free, waiters in fronts)
        in_front = all(run.run_id in waiters for _, waiters in fronts)
        carried = sorted(set(run.throttle_keys))
        throttled = [self._throttle_front(t, limits, ttls) for t in carried]
        # Every throttle key must have room and reach it, oldest first (X6, X3d).
        reaches = reaches and all(quota_front_reaches(run.run_id, waiters, free) for free, waiters, _ in throttled)
        in_front = in_front and all(run.run_id in waiters for _, waiters, _ in throttled)
        # The throttle keys that do not reach it: it waits for their openings (X6d).
        opens = [
            (opening, t[0])
            for t, (free, waiters, opening) in zip(carried, throttled, strict=True)
            if opening is not None and not quota_front_reaches(run.run_id, waiters, free)
        ]
        granted: list[RunRecord] = []
        token = 0
        if reaches and key is not None:
            granted, in_front, token = self._grant(run.workflow_name, key, limits, claimant=run.run_id, ttls=ttls)
            reaches = bool(token)
        if reaches:
            take.update(quota_tokens=self._take_quota_tokens(run))
            taken = self._replace(
                run, quota_slot=SlotState.HOLDER, fencing_token=token or None, admitted_at=now, **take
            )
            for name, tkey, _limit, _period in run.throttle_keys:
                self._throttle_admissions.setdefault((name, tkey), []).append(now)  # counted from now on (X6)
            # Waiters it no longer blocks, within its quota keys' free slots, get their turn (X3d).
            granted += self._quota_turns(run.quota_keys, limits, {run.run_id, *(g.run_id for g in granted)}, ttls)
            exclude = {run.run_id, *(g.run_id for g in granted)}
            for free, waiters, _ in throttled:
                behind = [i for i in waiters if i not in exclude][: max(free - 1, 0)]
                granted += [self._runs[i] for i in behind]
                exclude.update(behind)
            return Turn(TurnState.RUN, taken, recovered=recovered, granted=tuple(granted), admitted=True)
        if opens:
            # Over the rate: not due until the window lets it in, so it blocks no waiter of its
            # other limits meanwhile (X5), and the tick sends it then (X6, S8).
            opening, name = max(opens)
            parked = self._replace(
                run,
                status=RunStatus.SUSPENDED,
                attempts=run.attempts + 1,
                wake_at=opening,
                not_before=opening,
                lease_owner=None,
                lease_expires_at=None,
                park_reason=ParkReason.THROTTLED.of(name),
            )
            return Turn(TurnState.PARKED, parked, granted=tuple(granted), throttled=name)
        parked = self._replace(
            run,
            status=RunStatus.SUSPENDED,
            attempts=run.attempts + 1,
            wake_at=now
            + timedelta(seconds=retry_delay(retry.seconds if in_front else retry.backlog_seconds, retry.jitter)),
            lease_owner=None,
            lease_expires_at=None,
            park_reason=ParkReason.SINGLETON,
        )
        return Turn(TurnState.PARKED, parked, granted=tuple(granted))

    # -- throttles (X6) ------------------------------------------------------------------
    def _throttle_front(
        self, throttle: tuple[str, str, int, float], limits: Limits, ttls: QueueTtls | None
    ) -> tuple[int, list[str], datetime | None]:
        """A throttle key's free admissions now, its due waiters in admission order (as
        many as its limit) and, when full, its window's opening; see DjangoStore._throttle_front."""
        name, key, declared, period = throttle
        control = self.controls.get((throttle_lock_name(name), key), {})
        declared_now = declared_limit(limits, throttle_lock_name(name), [declared])
        limit = limit_in_force(declared_now, control.get("limit_override"))
        now = self.clock()
        admissions = self._throttle_admissions.get((name, key), [])
        free, opening = throttle_room(limit, admissions, period, now, paused=bool(control.get("paused", False)))
        waiters = sorted(
            (
                r
                for r in self._runs.values()
                if r.quota_slot == SlotState.WAITER
                and not r.is_terminal
                and any(t[0] == name and t[1] == key for t in r.throttle_keys)
                and is_due(r.not_before, now)
                and not waiter_expired(r.created_at, (ttls or {}).get(r.workflow_name), now)
            ),
            key=lambda r: r.queue_place,  # X6c, X8a: the one queue order
        )
        return free, [r.run_id for r in waiters][:limit], opening

    def wake_throttled(self, name: str, key: str, limit: int, *, retrying: bool = True) -> tuple[RunRecord, ...]:
        with self._critical():
            now = self.clock()

            def over_rate(r: RunRecord) -> bool:
                return ParkReason.THROTTLED.matches(r.park_reason)

            def on_delay(r: RunRecord) -> bool:  # parked on its retry delay, due: woken with ``retrying``
                return retrying and ParkReason.SINGLETON.matches(r.park_reason) and is_due(r.not_before, now)

            parked = sorted(
                (
                    r
                    for r in self._runs.values()
                    if r.quota_slot == SlotState.WAITER
                    and r.status in PARKED_STATUSES
                    and not r.cancel_requested
                    and (over_rate(r) or on_delay(r))
                    and any(t[0] == name and t[1] == key for t in r.throttle_keys)
                ),
                key=lambda r: r.queue_place,
            )
            woken = {r.run_id for r in [r for r in parked if over_rate(r)][:limit]}
            parked = [
                r for r in parked if r.run_id in woken or not over_rate(r)
            ]  # every retrying one: no opening wakes it
            return tuple(
                self._replace(r, not_before=now, wake_at=now) if over_rate(r) else self._replace(r, wake_at=now)
                for r in parked
            )

    def throttle_state(self, name: str, key: str, period: float) -> tuple[int, datetime | None]:
        with self._critical():
            cutoff = self.clock() - timedelta(seconds=period)
            counted = sorted(a for a in self._throttle_admissions.get((name, key), []) if a > cutoff)
            return len(counted), (counted[0] + timedelta(seconds=period)) if counted else None

    def throttle_admissions(self, name: str, key: str) -> list[datetime]:
        """Return the recorded admission times of a throttle key, oldest first (X6; tests)."""
        with self._critical():
            return sorted(self._throttle_admissions.get((name, key), []))

    def prune_throttle_admissions(self, periods: Mapping[str, float], batch: int) -> int:
        with self._critical():
            now, deleted = self.clock(), 0
            for (name, key), times in self._throttle_admissions.items():
                if name in periods:
                    kept = [a for a in times if a > now - timedelta(seconds=periods[name])]
                    deleted += len(times) - len(kept)
                    self._throttle_admissions[(name, key)] = kept
            return deleted

    def quota_queue(self, name: str, key: str, run_id: str) -> tuple[int | None, int, list[str]]:
        with self._critical():
            now = self.clock()
            members = self._quota_members(name, key)
            holders = [r.run_id for r in members if r.holds_quota_slots]
            waiters = self._quota_order(name, members, now)
            return (waiters.index(run_id) + 1 if run_id in waiters else None), len(waiters), holders

    def quota_tokens(self, run_id: str) -> dict[str, int]:
        with self._critical():
            run = self._runs.get(run_id)
            return dict(self._quota_tokens.get(run_id, {})) if run is not None and run.holds_quota_slots else {}

    def claim_run(self, run_id: str, owner: str, lease_seconds: float) -> Turn:
        """Take the lease without admission (what a store without an atomic claim offers, S14)."""
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal or (run.status == RunStatus.RUNNING and not self._expired(run)):
                return Turn(TurnState.SKIPPED, run)
            now = self.clock()
            taken = self._replace(
                run,
                status=RunStatus.RUNNING,
                lease_owner=owner,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                wake_at=None,
                attempts=run.attempts + 1,
                started_at=run.started_at or now,
            )
            return Turn(TurnState.RUN, taken, recovered=run.status == RunStatus.RUNNING)

    def _leased(self, run_id: str, owner: str) -> RunRecord | None:
        run = self._runs.get(run_id)
        if run is None or run.status != RunStatus.RUNNING or run.lease_owner != owner or self._expired(run):
            return None  # an expired lease is never renewed (R5)
        return run

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        with self._critical():
            run = self._leased(run_id, owner)
            if run is None:
                return False
            self._replace(run, lease_expires_at=self.clock() + timedelta(seconds=lease_seconds))
            return True

    def check_boundary(self, run_id: str, owner: str, lease_seconds: float) -> str:
        with self._critical():
            run = self._leased(run_id, owner)
            if run is None:
                return Verdict.FENCED
            if run.cancel_requested:
                return Verdict.CANCELLED
            self._replace(run, lease_expires_at=self.clock() + timedelta(seconds=lease_seconds))
            return Verdict.OK

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        with self._critical():
            run = self._leased(run_id, owner)
            if run is None or run.cancel_requested:
                return False
            steps = self._steps.setdefault(run_id, {})
            if step.position in steps:
                return False
            steps[step.position] = step
            self._replace(run, step_count=run.step_count + 1)
            return True

    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        with self._critical():
            return dict(self._steps.get(run_id, {}))

    def park(self, run_id: str, owner: str, status: str, *, wake_at: datetime | None, reason: str = "") -> str:
        with self._critical():
            run = self._leased(run_id, owner)
            if run is None:
                return Verdict.FENCED
            if run.cancel_requested:
                return Verdict.CANCELLED
            self._replace(
                run, status=status, wake_at=wake_at, park_reason=reason, lease_owner=None, lease_expires_at=None
            )
            return Verdict.PARKED

    def _settle(
        self, run: RunRecord, status: str, output: Any, error: Any, limits: Limits, ttls: QueueTtls | None = None
    ) -> Finish:
        settled = self._replace(
            run,
            status=status,
            output=output,
            error=error,
            admitted=False,
            tracked=False,
            quota_slot=None,
            quota_tokens=(),
            lease_owner=None,
            lease_expires_at=None,
            wake_at=None,
            finished_at=self.clock(),
        )
        self._quota_tokens.pop(run.run_id, None)
        # Every quota slot freed at once (X3g); the waiters whose every limit the handoff holds
        # are admitted as their own claims would be (X3h), the other first waiters sent a turn.
        fronts = {(name, key): self._quota_front(name, key, limits, ttls) for name, key in sorted(set(run.quota_keys))}
        carriers = self._handoff_carriers(run, fronts)
        granted: list[RunRecord] = []
        if run.singleton_key is not None:
            granted = self._grant(run.workflow_name, run.singleton_key, limits, ttls=ttls, carriers=carriers)[0]
        now = self.clock()
        for run_id in carriers:
            carrier = self._runs[run_id]
            if carrier.singleton_key is None:
                granted.append(
                    self._replace(
                        carrier,
                        quota_slot=SlotState.HOLDER,
                        admitted_at=now,
                        wake_at=now + timedelta(seconds=self.redelivery_seconds),
                    )
                )
        admitted = [g.run_id for g in granted if g.run_id in carriers and g.quota_slot == SlotState.HOLDER]
        for name, key in fronts:
            # A token in each quota key for each run admitted there, in its place's order (X3f).
            here = sorted((r for r in admitted if (name, key) in carriers[r]), key=lambda r: carriers[r][(name, key)])
            for run_id in here:
                token = self._tokens.get((quota_lock_name(name), key), 0) + 1
                self._tokens[(quota_lock_name(name), key)] = token
                self._quota_tokens.setdefault(run_id, {})[name] = token
        granted = [
            self._replace(self._runs[g.run_id], quota_tokens=tuple(sorted(self._quota_tokens[g.run_id].items())))
            if g.run_id in admitted
            else g
            for g in granted
        ]
        turns = [g for g in granted if g.quota_slot == SlotState.WAITER]
        turns += [self._runs[i] for free, waiters in fronts.values() for i in waiters[:free]]
        return Finish(settled, handed_off([g for g in granted if g.quota_slot != SlotState.WAITER], turns))

    def _handoff_carriers(
        self, run: RunRecord, fronts: dict[tuple[str, str], tuple[int, list[str]]]
    ) -> dict[str, dict[tuple[str, str], int]]:
        """The waiters that carry quotas a handoff of ``run`` admits (X3h,
        :func:`~durable_singleton.admission.handoff_admits`): parked, not cancelled, and
        without a singleton key or with ``run``'s own (its grant then decides)."""
        places = handoff_admits(fronts, lambda run_id: self._runs[run_id].quota_keys)
        return {
            run_id: where
            for run_id, where in places.items()
            if (carrier := self._runs[run_id]).is_parked
            and not carrier.cancel_requested
            and carrier.quota_slot == SlotState.WAITER
            and not carrier.throttle_keys  # its own claim admits it and records the admission (X6)
            and (
                carrier.singleton_key is None
                or (carrier.workflow_name, carrier.singleton_key) == (run.workflow_name, run.singleton_key)
            )
        }

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
        with self._critical():
            current = self._leased(run.run_id, owner) if owner is not None else self._runs.get(run.run_id)
            if current is None:
                return Finish(None)
            # Never a running run (its owner settles it, R5a), never a terminal one (R2).
            if owner is None and (
                current.status not in PARKED_STATUSES or current.status not in (expect or PARKED_STATUSES)
            ):
                return Finish(None)
            return self._settle(current, status, output, error, limits, ttls)

    # -- operator actions --------------------------------------------------------------
    def request_cancel(
        self, run_id: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> Finish | RunRecord | None:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.is_terminal:
                return run
            if run.status == RunStatus.RUNNING:
                return self._replace(run, cancel_requested=True, wake_at=self.clock())
            return self._settle(run, RunStatus.CANCELLED, None, CANCELLED_ERROR, limits, ttls)

    def reset_for_retry(self, run_id: str, redelivery_seconds: float, deadline_at: datetime | None) -> RunRecord | None:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status not in (RunStatus.FAILED, RunStatus.DEAD):
                return None
            return self._replace(
                run,
                status=RunStatus.PENDING,
                error=None,
                output=None,
                admitted=False,
                tracked=run.singleton_key is not None,
                # Back in line in every quota and throttle (X3g, X6).
                quota_slot=SlotState.WAITER if run.quota_keys or run.throttle_keys else None,
                wake_at=self.clock() + timedelta(seconds=redelivery_seconds),
                recoveries=0,
                finished_at=None,
                cancel_requested=False,
                deadline_at=deadline_at,
                admitted_at=None,
                fencing_token=None,
            )

    def release(
        self, workflow_name: str, key: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> tuple[RunRecord, ...]:
        with self._critical():
            if workflow_name.startswith(QUOTA_PREFIX):
                # A quota key: its first waiters within its free slots get a turn (X3h, K2).
                return tuple(self._quota_turns([(workflow_name[len(QUOTA_PREFIX) :], key)], limits, set(), ttls))
            return tuple(self._grant(workflow_name, key, limits, ttls=ttls)[0])

    def add_signal(self, run_id: str, name: str, payload: Any, *, signal_id: str | None = None) -> RunRecord | None:
        with self._critical():
            run = self._runs.get(run_id)
            if run is not None and signal_id is not None and (run_id, signal_id) in self._signal_ids:
                return run  # a retry of a stored signal: first wins (D2)
            if run is None or run.is_terminal:
                return None
            if signal_id is not None:
                self._signal_ids.add((run_id, signal_id))
            self._signal_seq += 1
            self._signals.setdefault(run_id, []).append(SignalRecord(self._signal_seq, name, payload, self.clock()))
            if run.status in PARKED_STATUSES and ParkReason.SIGNAL.matches(run.park_reason):
                run = self._replace(run, wake_at=self.clock())
            return run

    def load_signals(self, run_id: str) -> list[SignalRecord]:
        with self._critical():
            return list(self._signals.get(run_id, []))

    def children(self, run_id: str) -> list[str]:
        with self._critical():
            return [r.run_id for r in self._runs.values() if r.parent_run_id == run_id and not r.is_terminal]

    # -- the tick ------------------------------------------------------------------------
    def _take(
        self, runs: list[RunRecord], order: Callable[[RunRecord], Any], redelivery_seconds: float, batch: int
    ) -> list[tuple[str, str]]:
        later = self.clock() + timedelta(seconds=redelivery_seconds)
        taken = sorted(runs, key=order)[:batch]
        for run in taken:
            self._replace(run, wake_at=later)
        return [(r.run_id, r.workflow_name) for r in taken]

    def due_runs(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        with self._critical():
            now = self.clock()
            due = [r for r in self._runs.values() if r.is_parked and r.wake_at is not None and r.wake_at <= now]
            return self._take(due, lambda r: (r.wake_at, r.created_at, r.run_id), redelivery_seconds, batch)

    def expired_leases(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        with self._critical():
            now = self.clock()
            expired = [
                r
                for r in self._runs.values()
                if r.status == RunStatus.RUNNING and self._expired(r) and (r.wake_at is None or r.wake_at <= now)
            ]
            return self._take(expired, lambda r: (r.lease_expires_at, r.run_id), redelivery_seconds, batch)

    def overdue_runs(self, batch: int) -> list[RunRecord]:
        with self._critical():
            now = self.clock()
            overdue = [
                r
                for r in self._runs.values()
                if not r.is_terminal and r.deadline_at is not None and r.deadline_at <= now
            ]
            return sorted(overdue, key=lambda r: (r.deadline_at, r.run_id))[:batch]

    def expired_waiters(self, ttls: QueueTtls, batch: int) -> list[RunRecord]:
        with self._critical():
            return super().expired_waiters(ttls, batch)

    def expire_waiter(self, run: RunRecord, ttl: float, *, limits: Limits, ttls: QueueTtls | None = None) -> Finish:
        with self._critical():
            current = self._runs.get(run.run_id)
            # Still a parked waiter that outlived ttl on this store's clock: a run
            # admitted since it was read keeps its slot (X2, R5a).
            if (
                current is None
                or current.singleton_key is None
                or not current.tracked
                or not current.is_parked
                or current.holds_slot
                or not queue_ttl_expired(current.created_at, ttl, self.clock())
            ):
                return Finish(None)
            return self._settle(current, RunStatus.CANCELLED, None, dict(QUEUE_TTL_ERROR), limits, ttls)

    def request_timeout_cancel(self, run_id: str) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status != RunStatus.RUNNING or run.cancel_requested:
                return False
            self._replace(run, cancel_requested=True)
            return True

    def catch_up(self, *, limits: Limits, batch: int, ttls: QueueTtls | None = None) -> tuple[RunRecord, ...]:
        with self._critical():
            now = self.clock()
            keys = sorted(
                {
                    (r.workflow_name, r.singleton_key)
                    for r in self._runs.values()
                    if r.singleton_key is not None
                    and r.tracked
                    and not r.admitted
                    and not r.is_terminal
                    and is_due(r.not_before, now)
                    and r.workflow_name in limits
                    and not turn_on_its_way(r.status, r.park_reason, r.wake_at, now)
                }
            )
            granted: list[RunRecord] = []
            for workflow_name, key in keys[:batch]:
                assert key is not None
                if self._catch_up_worth(workflow_name, key, limits, ttls):
                    granted.extend(self._grant(workflow_name, key, limits, ttls=ttls)[0])
            return tuple(granted)

    def _catch_up_worth(self, workflow_name: str, key: str, limits: Limits, ttls: QueueTtls | None) -> bool:
        """Tell whether the catch-up's grant of the key can admit one of its first
        ``limit`` due waiters: one without quotas, or one within the free slots of
        each of its quota keys; see DjangoStore._catch_up_worth (S8b, X3h, X3d)."""
        ttl, now = (ttls or {}).get(workflow_name), self.clock()
        waiters = [w for w in self._waiters(workflow_name, key) if not waiter_expired(w.created_at, ttl, now)]
        for run in waiters[: self._limit(workflow_name, key, limits)]:
            if run.quota_slot is None or all(
                quota_front_reaches(run.run_id, first, free)
                for free, first in (self._quota_front(name, qkey, limits, ttls) for name, qkey in run.quota_keys)
            ):
                return True
        return False

    # -- reads ---------------------------------------------------------------------------
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        with self._critical():
            return sorted(self._key_runs(workflow_name, key), key=lambda r: r.queue_place)

    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        with self._critical():
            return sum(1 for r in self._key_runs(workflow_name, key) if namespace is None or r.namespace == namespace)

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
        """Apply ``change`` under the store's lock, which every claim takes (S5); record it."""
        with self._lock:
            if keys is None:
                known = {k for (w, k) in self.controls if w == workflow}
                runs = self._runs.values()
                known |= {r.singleton_key for r in runs if r.workflow_name == workflow and r.singleton_key}
                if workflow.startswith(QUOTA_PREFIX):  # a quota's lock name: its active runs' keys (X3b, K2)
                    name = workflow[len(QUOTA_PREFIX) :]
                    known |= {k for r in runs if not r.is_terminal for q, k in r.quota_keys if q == name}
                keys_now = sorted(known)
            else:
                keys_now = list(keys)
            results = []
            for key in keys_now:
                control = self.controls.setdefault((workflow, key), {})
                old_paused, old_override = bool(control.get("paused", False)), control.get("limit_override")
                paused = old_paused if change.paused is None else change.paused
                override = old_override if change.keep_override else change.override
                control["paused"], control["limit_override"] = paused, override
                results.append(ControlResult(key, old_paused, old_override, paused, override))
            label = keys[0] if keys is not None and len(keys) == 1 else ""
            self._control_records.extend(control_records(workflow, label, results, by, reason, now))
            return results

    def key_control_state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        with self._lock:
            control = self.controls.get((workflow, key), {})
            return bool(control.get("paused", False)), control.get("limit_override")

    def key_control_history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        with self._lock:
            found = [r for r in self._control_records if r.workflow == workflow and (key is None or r.key in (key, ""))]
            return sorted(found, key=lambda r: r.at, reverse=True)[:limit]

    def hand_back_leases(self, run_ids: Sequence[str], owner_prefix: str) -> int:
        """Expire the matching leases now, on the store's clock (R5), under its lock."""
        with self._critical():
            now = self.clock()
            held = [
                r
                for r in (self._runs.get(run_id) for run_id in set(run_ids))
                if r is not None
                and r.status == RunStatus.RUNNING
                and r.lease_owner is not None
                and r.lease_owner.startswith(owner_prefix)
            ]
            for run in held:
                self._replace(run, lease_expires_at=now, wake_at=now)
            return len(held)

    def record_beat(self, name: str, at: datetime, owner: str) -> bool:
        """Keep heartbeat ``name`` in this store's memory, as long as the store lives (O3)."""
        with self._critical():
            self._beats[name] = Beat(name, at, owner)
            return True

    def beat(self, name: str) -> Beat | None:
        with self._critical():
            return self._beats.get(name)

    def controlled_keys(self) -> dict[tuple[str, str], tuple[bool, int | None]]:
        with self._critical():
            states = {
                ident: (bool(c.get("paused", False)), c.get("limit_override")) for ident, c in self.controls.items()
            }
            return {ident: state for ident, state in states.items() if state[0] or state[1] is not None}

    def limit_changed_at(self, workflow: str, key: str) -> datetime | None:
        with self._critical():
            changes = [
                r.at
                for r in self._control_records
                if r.workflow == workflow and r.key in (key, "") and r.field == "limit_override"
            ]
            return max(changes, default=None)

    def throttle_window_counts(self, name: str, since: datetime) -> list[KeyCount]:
        with self._critical():
            counts = []
            for (throttle, key), times in sorted(self._throttle_admissions.items()):
                counted = [a for a in times if a > since]
                if throttle == name and counted:
                    counts.append(KeyCount(throttle_lock_name(name), key, len(counted), max(counted)))
            return counts

    def drop_holder_marker(self, run_id: str) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or not run.admitted or run.status in ACTIVE_STATUSES:
                return False
            self._replace(run, admitted=False)
            return True

    def wake_waiter(self, run_id: str) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status not in WAKEABLE_STATUSES:
                return False
            self._replace(run, wake_at=self.clock())
            return True

    def wake_throttle_waiter(self, run_id: str, wake_at: datetime | None) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if (
                run is None
                or run.status not in WAKEABLE_STATUSES
                or run.quota_slot != SlotState.WAITER
                or run.wake_at != wake_at
            ):
                return False
            self._replace(run, wake_at=self.clock())
            return True

    def redrive_lease(self, run_id: str, lease_expires_at: datetime) -> bool:
        with self._critical():
            run = self._runs.get(run_id)
            if run is None or run.status != RunStatus.RUNNING or run.lease_expires_at != lease_expires_at:
                return False
            self._runs[run_id] = run.evolve(wake_at=self.clock())
            return True

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        with self._critical():
            runs = [
                r
                for r in self._runs.values()
                if (workflow_name is None or r.workflow_name == workflow_name)
                and (namespace is None or r.namespace == namespace)
            ]
            return sorted(runs, key=lambda r: (r.created_at, r.run_id))

    def run_critical(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` inside the store's critical section (for conformance tests)."""
        with self._critical():
            return fn()
