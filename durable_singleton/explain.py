"""Why is it waiting (K3): a run's place as plain data and one sentence.

:func:`explain` reads the run, the active runs of its key and the key's
recent durations through the engine's store (its seam: ``database``,
``active_runs_for_key``, ``key_control_state``), and says what the run is doing
or waiting for: holding a slot (since when, with its fencing token), waiting
at position N behind named holders (how long each has held, the queue's
depth, the key's pause and limit state, an estimated wait), or able to run
but not running (no worker has taken its turn since when; its wake time).
A running run whose lease was not renewed for longer than the renewal
interval (:func:`~durable_singleton.renewals.lease_state`, judged on the
database's clock) is said to be so, with when it is recovered, and a
waiter's estimate waits for that recovery. The admin's run and key pages and
``manage.py durable_explain`` show it.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Any

from .admission import (
    declared_limit,
    free_slots,
    is_due,
    limit_in_force,
    queue_ttl_expires_at,
    quota_lock_name,
    throttle_lock_name,
)
from .core import Core
from .exceptions import UnknownWorkflowError
from .records import since_admitted
from .renewals import LeaseState, lease_state
from .statuses import ParkReason, RunStatus, SlotState
from .stores.base import BaseStore, RunRecord

__all__ = [
    "ExplainState",
    "Explanation",
    "HolderInfo",
    "KeyControls",
    "QuotaPlace",
    "ThrottlePlace",
    "explain",
    "lease_words",
]

#: Completed runs of a key whose durations feed the estimated wait.
RECENT_RUNS = 20
#: Holders named in an explanation (a key with a large limit lists the oldest).
NAMED_HOLDERS = 20
#: The holders of a quota key a store names at most (``BaseStore.quota_queue``).
QUOTA_HOLDERS_NAMED = 20


class ExplainState(enum.StrEnum):
    """What a run is doing, as :func:`explain` sees it."""

    HOLDER = "holder"  # holds a slot of its key (running, sleeping, waiting for a signal, blocked)
    WAITER = "waiter"  # waits in its key's line behind the holders
    NOT_DUE = "not_due"  # a delayed start before its not_before: claimed by no one, blocks no one (X5)
    THROTTLED = "throttled"  # over a throttle's rate: not due until the window opens (X6)
    RUNNABLE = "runnable"  # could run now; no worker has taken its turn yet
    RUNNING = "running"  # a run without a key, executing
    PARKED = "parked"  # a run without a key, sleeping, waiting for a signal or blocked
    TERMINAL = "terminal"  # finished


@dataclass(frozen=True)
class HolderInfo:
    """A holder of the key: its run id, status, since when it holds (None if
    unknown) and for how many seconds. For a holder whose lease was not
    renewed for longer than the renewal interval (:mod:`~durable_singleton.renewals`):
    the seconds since its last renewal and when it is recovered (its lease's
    expiry); None otherwise."""

    run_id: str
    status: str
    since: datetime | None
    held_seconds: float | None
    not_renewed_seconds: float | None = None
    recovery_at: datetime | None = None


@dataclass(frozen=True)
class KeyControls:
    """The key's runtime controls (K2) as stored, when the store keeps them:
    ``paused`` and the limit ``override`` (None when not set)."""

    paused: bool = False
    override: int | None = None


@dataclass(frozen=True)
class QuotaPlace:
    """A waiter's place in one of its quota keys' queues (X3, K3): its 1-based
    ``position`` among the key's due waiters oldest first (None if not among
    them: not due), their number ``depth``, and the holders' run ids."""

    quota: str
    key: str
    position: int | None
    depth: int
    holders: list[str]


@dataclass(frozen=True)
class ThrottlePlace:
    """A waiter's standing in one of its throttle keys (X6, K2, K3): the limit in
    force per ``period`` seconds, the admissions recorded in the window that ends
    now (the store's clock), and whether the key is paused."""

    throttle: str
    key: str
    limit: int
    period: float
    admitted: int
    paused: bool

    def words(self) -> str:
        """Say it: ``throttle 'erp-rate' (key 't1') is paused: ...`` or its use of the window."""
        named = f"throttle {self.throttle!r} (key {self.key!r})"
        if self.paused:
            return f"{named}, which is paused: it admits no run until it is resumed"
        return f"{named}, {self.admitted} of {self.limit} admission(s) used in the last {format_seconds(self.period)}"


@dataclass(frozen=True)
class Explanation:
    """A run's place (K3), as plain data. ``sentence`` says it in words.

    Times are aware datetimes; durations are seconds. Fields that do not apply
    to the run's state are None (or empty).
    """

    run_id: str
    workflow: str
    status: str
    state: ExplainState
    sentence: str
    key: str | None = None
    limit: int | None = None
    paused: bool = False
    limit_override: int | None = None
    holder_since: datetime | None = None
    fencing_token: int | None = None
    position: int | None = None
    depth: int = 0
    holders: list[HolderInfo] = field(default_factory=list)
    holder_count: int = 0
    estimated_wait_seconds: float | None = None
    #: The estimate is a lower bound: the time until an unrenewed holder's recovery,
    #: with no recent run to estimate the rest.
    estimate_is_lower_bound: bool = False
    recent_durations: int = 0
    idle_since: datetime | None = None
    wake_at: datetime | None = None
    park_reason: str = ""
    not_before: datetime | None = None
    not_due_ahead: int = 0
    #: The run's priority inside its key (X8), and a waiter's 1-based position among the key's
    #: due waiters of that priority (None for a run not waiting in line).
    priority: int = 0
    priority_position: int | None = None
    #: The run is running and its lease was not renewed for this many seconds, longer
    #: than the renewal interval (:func:`~durable_singleton.renewals.lease_state`); None otherwise.
    not_renewed_seconds: float | None = None
    #: When such a run is recovered: its lease's expiry (D4); None otherwise.
    recovery_at: datetime | None = None
    #: A waiter of a key with a ``queue_ttl`` (X2): the TTL in seconds, when it ends
    #: if not admitted by then, and the seconds left by the store's clock (negative:
    #: past, the tick ends it); None otherwise.
    queue_ttl: float | None = None
    expires_at: datetime | None = None
    expires_in_seconds: float | None = None
    #: A run that waits for shared quotas (X3): its place in each quota key's queue.
    quotas: list[QuotaPlace] = field(default_factory=list)
    #: A waiter that carries throttles (X6) and is not parked over a rate: its standing in
    #: each throttle key (its pause, K2, and its window's use).
    throttles: list[ThrottlePlace] = field(default_factory=list)
    #: A debounced run (X7): its debounce key, and the latest start time a later start of
    #: its burst may give it (the burst's first start, its ``created_at``, plus ``max_seconds``).
    debounce_key: str | None = None
    debounce_until: datetime | None = None
    #: A run over a throttle's rate (X6): the throttle's name and key, and when the
    #: window next admits it (its ``not_before``, on the store's clock); None otherwise.
    throttled_by: str | None = None
    throttle_key: str | None = None
    next_admission_at: datetime | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the explanation as JSON-ready values (datetimes as ISO 8601 strings)."""

        def plain(value: Any) -> Any:
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, list):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, enum.Enum):
                return value.value
            return value

        return {k: plain(v) for k, v in asdict(self).items()}


def format_seconds(seconds: float) -> str:
    """Return ``seconds`` in words a user reads at a glance: ``4 s``, ``3 min 12 s``, ``2 h 5 min``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def _at(moment: datetime | None) -> str:
    return "an unknown time" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def lease_words(lease: LeaseState, at: Callable[[datetime], str] = _at, *, brief: bool = False) -> str:
    """Say an unrenewed lease (:func:`~durable_singleton.renewals.lease_state`) in the
    words every page and command uses (K3): ``not renewed for 14 s (renewed every
    10 s); recovered at T``, or, once it expired, that the tick recovers it.
    ``at`` formats a time (default: UTC to the second); ``brief`` leaves out the
    renewal interval (a table cell, whose title carries the whole words)."""
    silent = f"not renewed for {format_seconds(lease.not_renewed_seconds)}"
    if not brief:
        silent += f" (renewed every {format_seconds(lease.renew_seconds)})"
    if lease.expired:
        return f"{silent}; its lease expired at {at(lease.expires_at)}: recovered as soon as the tick re-drives it"
    return f"{silent}; recovered at {at(lease.recovery_at)}"


def _key_limit(engine: Core, run: RunRecord) -> int:
    """The key's configured limit: the latest registered version's (S2), else the stored one."""
    try:
        single = engine.registry.get(run.workflow_name).singleton
    except UnknownWorkflowError:
        single = None
    return single.limit if single is not None else (run.singleton_limit or 1)


def _key_controls(store: BaseStore, workflow: str, key: str) -> KeyControls:
    """Read the key's pause and limit override (K2) through the store's key-control seam."""
    paused, override = store.key_control_state(workflow, key)
    return KeyControls(paused=paused, override=override)


@dataclass(frozen=True)
class _QueueFacts:
    # (run id, status, since, namespace, lease owner, lease expiry), the oldest first
    holders: list[tuple[str, str, datetime | None, str, str | None, datetime | None]]
    holder_count: int
    depth: int
    position: int | None
    not_due_ahead: int = 0
    # the run's 1-based position among the due waiters of its own priority (X8)
    priority_position: int | None = None


def _priority_words(run: RunRecord, facts: _QueueFacts) -> str:
    """ ", position 2 among priority 10" for a waiter whose priority orders its place (X8):
    its priority is not 0, or a waiter of another priority is ahead of it; else nothing."""
    peers = facts.priority_position
    if peers is None or (run.priority == 0 and peers == facts.position):
        return ""
    return f" (position {peers} among priority {run.priority})"


def _queue_facts(store: BaseStore, run: RunRecord) -> _QueueFacts:
    """Read the key's holders (the oldest few), its depth and ``run``'s position
    through the store (:meth:`~durable_singleton.stores.base.BaseStore.key_queue`).

    The position counts the due waiters ahead (X5: one not due yet blocks no
    one), ``not_due_ahead`` the others; the depth counts every waiter. On the
    Django store: two bounded queries, whatever the backlog (the queue index
    serves both), on the database's clock. Elsewhere: the key's active runs,
    on the store's clock.
    """
    queue = store.key_queue(run, NAMED_HOLDERS)
    holders = [(h.run_id, h.status, h.since, h.namespace, h.lease_owner, h.lease_expires_at) for h in queue.holders]
    position = queue.due_ahead + 1 if queue.waiting else None
    peers = queue.peers_ahead + 1 if queue.waiting else None
    return _QueueFacts(holders, queue.holder_count, queue.depth, position, queue.not_due_ahead, peers)


def _recent_durations(store: BaseStore, workflow: str, key: str) -> list[float]:
    """Seconds from admission (or start) to finish of the key's last completed runs."""
    rows = store.recent_completions(workflow, key, RECENT_RUNS)
    return [(end - begin).total_seconds() for begin, end in rows if begin is not None]


def estimate_wait(
    position: int,
    slots: int,
    held: list[float | None],
    typical: float,
    recovery: Sequence[float | None] = (),
) -> float:
    """Estimate seconds until the waiter at ``position`` (1-based) is admitted.

    ``slots`` is the key's effective limit, ``held`` how long each holder has
    held (None: unknown), ``typical`` a typical run's duration in seconds,
    ``recovery`` (in the order of ``held``; missing or None: a live holder)
    the seconds until an unrenewed holder's recovery
    (:meth:`~durable_singleton.renewals.LeaseState.seconds_to_recovery`). Each
    live holder frees its slot after ``typical - held`` seconds (at least 0),
    an unrenewed one after its recovery and then a whole ``typical`` (its body
    runs again from its stored steps), a free slot at once; every waiter ahead
    then holds a slot for ``typical`` seconds.
    """
    until = list(recovery) + [None] * (len(held) - len(recovery))
    free_at = [max(0.0, typical - (h or 0.0)) if r is None else r + typical for h, r in zip(held, until, strict=False)][
        :slots
    ]
    free_at += [0.0] * (slots - len(free_at))
    if not free_at:
        return 0.0
    heapq.heapify(free_at)
    for _ in range(position - 1):
        heapq.heappush(free_at, heapq.heappop(free_at) + typical)
    return free_at[0]


def explain(engine: Core, run_id: str) -> Explanation:
    """Return why run ``run_id`` is where it is (K3).

    Reads through ``engine``'s store: the run, its key's active runs, its
    key's last completed runs and the store's clock, on which leases are
    judged (:func:`~durable_singleton.renewals.lease_state`, R5). Raises
    :class:`~durable_singleton.exceptions.RunNotFoundError` as
    :meth:`Engine.get` does.
    """
    run = engine.get(run_id)
    explained = _explain(engine, run)
    throttled = _throttled(engine, run)
    if throttled is not None:
        return replace(explained, **throttled)
    if run.holds_quota_slots:
        held = ", ".join(f"quota {name!r} (key {key!r})" for name, key in run.quota_keys)
        return replace(explained, sentence=f"{explained.sentence} It holds a slot of {held} (X3c).")
    if run.quota_slot != SlotState.WAITER or run.is_terminal or run.status == RunStatus.RUNNING:
        return explained
    places = [QuotaPlace(name, key, *engine.store.quota_queue(name, key, run.run_id)) for name, key in run.quota_keys]
    gates = _throttle_places(engine, run)
    words = "; ".join(
        [
            *(
                f"quota {p.quota!r} (key {p.key!r}) position {p.position or '?'} of {p.depth}"
                + (f", behind {', '.join(p.holders)}" if p.holders else "")
                for p in places
            ),
            *(g.words() for g in gates),
        ]
    )
    if explained.state not in (ExplainState.PARKED, ExplainState.RUNNABLE):
        # Its singleton key holds it back too (a waiter there, or paused): both are said.
        return replace(
            explained,
            quotas=places,
            throttles=gates,
            sentence=f"{explained.sentence} It also waits for {words} (X3d).",
        )
    if not gates and all(_within_quota_room(engine, p) for p in places):
        # Within the free slots of every limit it carries (X3d): a worker failed to take its turn.
        now = engine.store.now()
        idle_since = run.created_at if run.status == RunStatus.PENDING else run.updated_at
        when = "now" if run.wake_at is None or run.wake_at <= now else f"at {_at(run.wake_at)}"
        sentence = (
            f"Run {run.run_id} could run now: it is within the free slots of {words} (X3d), but no worker "
            f"has taken its turn since {_at(idle_since)}; its turn is due {when}."
        )
        return replace(explained, state=ExplainState.RUNNABLE, quotas=places, throttles=gates, sentence=sentence)
    # Nothing but its quotas and throttles holds it back: it is their waiter, not a run a worker failed to take.
    keyed = f"its singleton key {run.singleton_key!r} has room, but " if run.singleton_key is not None else ""
    freed = "A slot freed" if places else "A resume or a raised limit of the throttle key (K2)"
    wake = (
        f" {freed} sends it a turn; else it retries at {_at(run.wake_at)}."
        if run.wake_at is not None and run.is_parked
        else ""
    )
    sentence = f"Run {run.run_id} is a waiter ({run.status}): {keyed}it waits for {words} (X3d).{wake}"
    return replace(explained, state=ExplainState.WAITER, quotas=places, throttles=gates, sentence=sentence)


def _within_quota_room(engine: Core, place: QuotaPlace) -> bool:
    """Whether a waiter's place in a quota key is within the key's free slots (X3c, X3d,
    K2): its position at most the limit in force (the key's override, else the declared
    limit) less the holders, none while paused. False when the holders were not all
    named (the store names 20 at most) or the waiter is not among the due ones."""
    if place.position is None or len(place.holders) >= QUOTA_HOLDERS_NAMED:
        return False
    lock = quota_lock_name(place.quota)
    paused, override = engine.store.key_control_state(lock, place.key)
    limit = limit_in_force(declared_limit(engine.limits(), lock, ()) or 1, override)
    return place.position <= free_slots(limit, len(place.holders), paused=paused)


def _throttle_places(engine: Core, run: RunRecord) -> list[ThrottlePlace]:
    """The standing of a waiter in each of its throttle keys (X6): the limit in force
    (the key's override, K2, else the declared limit, else the one its start recorded),
    its window's use on the store's clock, its pause. A count and a control read each."""
    store = engine.store
    limits = engine.limits()
    places = []
    for name, key, recorded, period in run.throttle_keys:
        paused, override = store.key_control_state(throttle_lock_name(name), key)
        admitted, _opens = store.throttle_state(name, key, period)
        limit = limit_in_force(declared_limit(limits, throttle_lock_name(name), [recorded]) or 1, override)
        places.append(ThrottlePlace(name, key, limit, period, admitted, paused))
    return places


def _throttled(engine: Core, run: RunRecord) -> dict[str, Any] | None:
    """The facts of a run parked over a throttle's rate (X6), or None: a waiter whose
    ``not_before`` (the window's opening its claim set) has not come on the store's
    clock; the throttle named is the first whose window is full, by the store's count."""
    if not run.throttle_keys or run.quota_slot != SlotState.WAITER or not run.is_parked or run.not_before is None:
        return None
    store = engine.store
    if is_due(run.not_before, store.now()):
        return None
    limits = engine.limits()
    name, key, limit, period = run.throttle_keys[0]
    for throttle in run.throttle_keys:
        count, _opens = store.throttle_state(throttle[0], throttle[1], throttle[3])
        if count >= (declared_limit(limits, throttle_lock_name(throttle[0]), [throttle[2]]) or 1):
            name, key, limit, period = throttle
            break
    sentence = (
        f"Run {run.run_id} is throttled by {name!r} (key {key!r}, {limit} per {format_seconds(period)}):"
        f" next admission at {_at(run.not_before)}; the tick sends its turn then, and until then it holds"
        " back no waiter of its other limits (X6)."
    )
    return {
        "state": ExplainState.THROTTLED,
        "sentence": sentence,
        "throttled_by": name,
        "throttle_key": key,
        "next_admission_at": run.not_before,
    }


def _explain(engine: Core, run: RunRecord) -> Explanation:
    """:func:`explain` of the run as read, its quotas aside."""
    now = engine.now()
    store = engine.store
    token = run.fencing_token
    base: dict[str, Any] = {
        "run_id": run.run_id,
        "workflow": run.workflow_name,
        "status": run.status,
        "wake_at": run.wake_at,
        "park_reason": run.park_reason,
        "key": run.singleton_key,
        "not_before": run.not_before,
        "debounce_key": run.debounce_key,
        "debounce_until": run.debounce_until,
        "priority": run.priority,
    }
    if run.is_terminal:
        sentence = f"Run {run.run_id} is {run.status} (finished at {_at(run.finished_at)}): it waits for nothing."
        return Explanation(state=ExplainState.TERMINAL, sentence=sentence, **base)
    # Leases are judged on the database's clock (R5): one read of it.
    db_now = store.now()

    def lease_of(status: str, owner: str | None, expires_at: datetime | None) -> LeaseState | None:
        """The lease of a running run, when it was not renewed for longer than the interval."""
        lease = lease_state(status, owner, expires_at, settings=engine.settings, now=db_now)
        return lease if lease is not None and lease.unrenewed else None

    own_lease = lease_of(run.status, run.lease_owner, run.lease_expires_at)
    if own_lease is not None:
        base["not_renewed_seconds"] = own_lease.not_renewed_seconds
        base["recovery_at"] = own_lease.recovery_at
    ttl_words = ""
    ttl_passed = False  # a waiter past its queue_ttl: no grant admits it, the tick ends it (X2)
    ttl = engine.queue_ttls().get(run.workflow_name) if run.singleton_key is not None else None
    if ttl is not None and run.tracked and run.is_parked and not run.holds_slot:
        # Judged on the store's clock, as the tick's sweep judges it (X2, R5).
        ttl_ends = queue_ttl_expires_at(run.created_at, ttl)
        left = (ttl_ends - db_now).total_seconds()
        ttl_passed = left <= 0
        base.update(queue_ttl=ttl, expires_at=ttl_ends, expires_in_seconds=left)
        ttl_words = (
            f"; it expires in {format_seconds(left)} unless admitted first (queue_ttl {format_seconds(ttl)} "
            "from its creation)"
            if left > 0
            else f"; its queue_ttl of {format_seconds(ttl)} passed at {_at(ttl_ends)}: the tick ends it "
            "cancelled (queue_ttl_expired); no grant admits it meanwhile"
        )
    if run.not_before is not None and run.is_parked and not run.holds_slot and not is_due(run.not_before, db_now):
        # A delayed start (X5), judged on the store's clock as the claim judges it (R5).
        then = (
            f"it then takes its place in line for key {run.singleton_key!r} of {run.workflow_name}, the place "
            f"it has held since its creation at {_at(run.created_at)}, and blocks no due waiter until then"
            if run.singleton_key is not None
            else "the tick sends its turn then"
        )
        if run.debounce_key is not None:
            # An open debounced run (X7a): a start of its key moves its start, never past debounce_until.
            sentence = (
                f"Run {run.run_id} is debounced: starts at {_at(run.not_before)} (burst since "
                f"{_at(run.created_at)}, at most until {_at(run.debounce_until)}); a start of debounce key "
                f"{run.debounce_key!r} before then gives it its input and moves its start: {then}{ttl_words}."
            )
        else:
            sentence = f"Run {run.run_id} is not due until {_at(run.not_before)} (a delayed start): {then}{ttl_words}."
        return Explanation(state=ExplainState.NOT_DUE, sentence=sentence, **base)
    if run.singleton_key is None:
        return _explain_unkeyed(run, now, base, own_lease)

    key = run.singleton_key
    facts = _queue_facts(store, run)
    controls = _key_controls(store, run.workflow_name, key)
    configured = _key_limit(engine, run)
    limit = limit_in_force(configured, controls.override)
    # Admission is global (S11): a scoped engine counts other namespaces'
    # holders but never names them (D10).
    holder_infos: list[HolderInfo] = []
    holder_leases: list[LeaseState | None] = []
    for holder_id, status, since, namespace, owner, expires_at in facts.holders:
        if engine.scope_reads and namespace != engine.namespace:
            continue
        lease = lease_of(status, owner, expires_at)
        holder_leases.append(lease)
        holder_infos.append(
            HolderInfo(
                holder_id,
                status,
                since,
                (now - since).total_seconds() if since is not None else None,
                lease.not_renewed_seconds if lease is not None else None,
                lease.recovery_at if lease is not None else None,
            )
        )
    keyed = {
        **base,
        "limit": limit,
        "paused": controls.paused,
        "limit_override": controls.override,
        "depth": facts.depth,
        "holders": holder_infos,
        "holder_count": facts.holder_count,
        "fencing_token": token,
        "not_due_ahead": facts.not_due_ahead,
    }
    key_words = f"key {key!r} of {run.workflow_name}"
    limit_words = f"limit {limit}" + (f" (overridden from {configured})" if controls.override is not None else "")

    if run.holds_slot:
        held_since = next((h.since for h in holder_infos if h.run_id == run.run_id), None)
        if held_since is None:
            held_since = run.admitted_at or since_admitted(None, run.started_at, run.attempts)
        running = f"running (lease held by {run.lease_owner})" if run.lease_owner else run.status
        if own_lease is not None:
            # Its worker stopped renewing: killed, frozen or cut off (K3).
            running = f"not known to be running: its lease (held by {run.lease_owner}) was {lease_words(own_lease)}"
        doings: dict[str, str] = {
            RunStatus.RUNNING: running,
            RunStatus.SUSPENDED: (
                f"parked ({run.park_reason or 'sleeping'}) until {_at(run.wake_at)}; the slot stays held"
            ),
            RunStatus.BLOCKED: f"blocked ({run.park_reason or 'no reason given'}); the slot stays held",
            RunStatus.PENDING: "about to run",
        }
        doing = doings[run.status]
        token_words = f", fencing token {token}" if token is not None else ""
        held = f" (for {format_seconds((now - held_since).total_seconds())})" if held_since else ""
        reason = run.park_reason
        granted = not reason or ParkReason.SINGLETON.matches(reason) or ParkReason.INTERRUPTED.matches(reason)
        if run.is_parked and granted:
            # Granted a slot by a handoff or the catch-up (S7, S8a); its turn has not been taken yet.
            due = run.wake_at is None or run.wake_at <= now
            sentence = (
                f"Run {run.run_id} could run now: it was granted a slot of {key_words} at {_at(held_since)}"
                f"{token_words}, but no worker has taken its turn since; the tick sends it again "
                f"{'now' if due else 'at ' + _at(run.wake_at)}."
            )
            return Explanation(
                state=ExplainState.RUNNABLE, sentence=sentence, holder_since=held_since, idle_since=held_since, **keyed
            )
        sentence = (
            f"Run {run.run_id} holds a slot of {key_words} since {_at(held_since)}{held}{token_words}; it is {doing}."
        )
        return Explanation(state=ExplainState.HOLDER, sentence=sentence, holder_since=held_since, **keyed)

    position = facts.position
    if position is None:
        # An active run of an older release without a slot (S12): it joins the line at its next turn.
        position = facts.depth + 1
    free = free_slots(limit, facts.holder_count, paused=controls.paused)
    idle_since = run.created_at if run.status == RunStatus.PENDING else run.updated_at
    if position <= free and ttl_passed:
        # Within the free slots, but no grant or claim admits a waiter past its queue_ttl (X2).
        sentence = (
            f"Run {run.run_id} will not run: {key_words} has {free} free slot(s) ({limit_words}) and it is "
            f"first in line{ttl_words}."
        )
        return Explanation(state=ExplainState.WAITER, sentence=sentence, position=position, **keyed)
    if position <= free:
        due = run.wake_at is None or run.wake_at <= now
        when = "now" if due else f"at {_at(run.wake_at)}"
        sentence = (
            f"Run {run.run_id} could run now: {key_words} has {free} free slot(s) ({limit_words}) and it is "
            f"first in line, but no worker has taken its turn since {_at(idle_since)}; its turn is due {when}"
            f"{ttl_words}."
        )
        return Explanation(
            state=ExplainState.RUNNABLE, sentence=sentence, position=position, idle_since=idle_since, **keyed
        )

    durations = _recent_durations(store, run.workflow_name, key)
    estimate = None
    at_least = False
    held_list = [h.held_seconds for h in holder_infos]
    # An unrenewed holder frees its slot no sooner than its recovery (K3).
    recovery = [lease.seconds_to_recovery(db_now) if lease is not None else None for lease in holder_leases]
    unrenewed = [h.run_id for h in holder_infos if h.recovery_at is not None]
    if durations and not controls.paused:
        typical = sorted(durations)[len(durations) // 2]
        estimate = estimate_wait(position, max(limit, 1), held_list, typical, recovery)
    elif unrenewed and not controls.paused:
        estimate, at_least = estimate_wait(position, max(limit, 1), held_list, 0.0, recovery), True

    def holder_words(h: HolderInfo, lease: LeaseState | None) -> str:
        parts = [h.status]
        if h.held_seconds is not None:
            parts.append(f"holding for {format_seconds(h.held_seconds)}")
        if lease is not None:
            parts.append(f"lease {lease_words(lease)}")
        return f"{h.run_id} ({', '.join(parts)})"

    if holder_infos:
        named = ", ".join(holder_words(h, lease) for h, lease in zip(holder_infos, holder_leases, strict=True))
        more = f" and {facts.holder_count - len(holder_infos)} more" if facts.holder_count > len(holder_infos) else ""
        behind = f"behind {named}{more}"
    elif facts.holder_count:
        behind = f"behind {facts.holder_count} holder(s) of another namespace"
    else:
        behind = "behind no holder"
    reasons = [limit_words]
    if controls.paused:
        reasons.insert(0, "the key is paused: no run is admitted until it is resumed")
    after = f", after the recovery of {', '.join(unrenewed)}" if unrenewed else ""
    if estimate is None:
        wait_words = ""
    elif at_least and estimate == 0:
        wait_words = (
            f"; it waits for the recovery of {', '.join(unrenewed)}, due now "
            "(no completed run of the key to estimate the rest)"
        )
    elif at_least:
        wait_words = (
            f"; estimated wait at least {format_seconds(estimate)} (until the recovery of {', '.join(unrenewed)}; "
            "no completed run of the key to estimate the rest)"
        )
    else:
        wait_words = (
            f"; estimated wait about {format_seconds(estimate)} (median of the last {len(durations)} runs{after})"
        )
    skipped = (
        f"; {facts.not_due_ahead} waiter(s) ahead of it not due yet (delayed starts) do not count"
        if facts.not_due_ahead
        else ""
    )
    sentence = (
        f"Run {run.run_id} is waiting: position {position} of {facts.depth} in line for {key_words}"
        f"{_priority_words(run, facts)}, {behind} ({', '.join(reasons)}){wait_words}{skipped}{ttl_words}."
    )
    return Explanation(
        state=ExplainState.WAITER,
        sentence=sentence,
        position=position,
        priority_position=facts.priority_position,
        estimated_wait_seconds=estimate,
        estimate_is_lower_bound=at_least,
        recent_durations=len(durations),
        idle_since=idle_since,
        **keyed,
    )


def _explain_unkeyed(run: RunRecord, now: datetime, base: dict[str, Any], unrenewed: LeaseState | None) -> Explanation:
    if run.status == RunStatus.RUNNING:
        owner = f" on {run.lease_owner}" if run.lease_owner else ""
        expiry = f" (lease until {_at(run.lease_expires_at)})" if run.lease_expires_at else ""
        doing = f"is running{owner}{expiry}"
        if unrenewed is not None:
            doing = f"is not known to be running: its lease (held by {run.lease_owner}) was {lease_words(unrenewed)}"
        sentence = f"Run {run.run_id} {doing}; it has no singleton key and waits for no one."
        return Explanation(state=ExplainState.RUNNING, sentence=sentence, **base)
    if run.status == RunStatus.PENDING or (run.wake_at is not None and run.wake_at <= now):
        since = run.created_at if run.status == RunStatus.PENDING else run.wake_at
        sentence = (
            f"Run {run.run_id} could run now: it has no singleton key, but no worker has taken its turn "
            f"since {_at(since)}; the tick sends it again from {_at(run.wake_at)}."
        )
        return Explanation(state=ExplainState.RUNNABLE, sentence=sentence, idle_since=since, **base)
    what = run.park_reason or ("sleeping" if run.status == RunStatus.SUSPENDED else run.status)
    sentence = f"Run {run.run_id} is {run.status} ({what}) until {_at(run.wake_at)}; it has no singleton key."
    return Explanation(state=ExplainState.PARKED, sentence=sentence, **base)
