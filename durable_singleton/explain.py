"""Why is it waiting (K3): a run's place as plain data and one sentence.

:func:`explain` reads the run, the active runs of its key and the key's
recent durations through the engine's store (its seam: ``database``,
``active_runs_for_key``, ``key_control_state``), and says what the run is doing
or waiting for: holding a slot (since when, with its fencing token), waiting
at position N behind named holders (how long each has held, the queue's
depth, the key's pause and limit state, an estimated wait), or able to run
but not running (no worker has taken its turn since when; its wake time).
The admin's run and key pages and ``manage.py durable_explain`` show it.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from .admission import free_slots, is_due, is_due_q, limit_in_force
from .core import Core
from .exceptions import UnknownWorkflowError
from .statuses import ParkReason, RunStatus, SlotState
from .stores.base import BaseStore, RunRecord

__all__ = ["ExplainState", "Explanation", "HolderInfo", "KeyControls", "explain"]

#: Completed runs of a key whose durations feed the estimated wait.
RECENT_RUNS = 20
#: Holders named in an explanation (a key with a large limit lists the oldest).
NAMED_HOLDERS = 20


class ExplainState(enum.StrEnum):
    """What a run is doing, as :func:`explain` sees it."""

    HOLDER = "holder"  # holds a slot of its key (running, sleeping, waiting for a signal, blocked)
    WAITER = "waiter"  # waits in its key's line behind the holders
    NOT_DUE = "not_due"  # a delayed start before its not_before: claimed by no one, blocks no one (X5)
    RUNNABLE = "runnable"  # could run now; no worker has taken its turn yet
    RUNNING = "running"  # a run without a key, executing
    PARKED = "parked"  # a run without a key, sleeping, waiting for a signal or blocked
    TERMINAL = "terminal"  # finished


@dataclass(frozen=True)
class HolderInfo:
    """A holder of the key: its run id, status, since when it holds (None if
    unknown) and for how many seconds."""

    run_id: str
    status: str
    since: datetime | None
    held_seconds: float | None


@dataclass(frozen=True)
class KeyControls:
    """The key's runtime controls (K2) as stored, when the store keeps them:
    ``paused`` and the limit ``override`` (None when not set)."""

    paused: bool = False
    override: int | None = None


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
    recent_durations: int = 0
    idle_since: datetime | None = None
    wake_at: datetime | None = None
    park_reason: str = ""
    not_before: datetime | None = None
    not_due_ahead: int = 0

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
    holders: list[tuple[str, str, datetime | None, str]]  # (run id, status, since, namespace), the oldest first
    holder_count: int
    depth: int
    position: int | None
    not_due_ahead: int = 0


def _since(admitted_at: datetime | None, started_at: datetime | None, attempts: int) -> datetime | None:
    """When a holder took its slot: the claim's stamp, else the start of a run admitted on its first turn."""
    if admitted_at is not None:
        return admitted_at
    return started_at if attempts <= 1 else None


def _queue_facts(store: BaseStore, run: RunRecord) -> _QueueFacts:
    """Read the key's holders (the oldest few), its depth and ``run``'s position.

    The position counts the due waiters ahead (X5: one not due yet blocks no
    one), ``not_due_ahead`` the others; the depth counts every waiter. On the
    Django store: two bounded queries, whatever the backlog (the queue index
    serves both), on the database's clock. Elsewhere: the key's active runs,
    on the store's clock.
    """
    assert run.singleton_key is not None
    if store.database is not None:
        from django.db.models import Count, Q

        from .models import Run

        runs = Run.objects.using(store.database).for_key(run.workflow_name, run.singleton_key)
        rows = list(
            runs.holders()
            .order_by("created_at", "run_id")
            .values_list("run_id", "status", "admitted_at", "started_at", "attempts", "namespace")[: NAMED_HOLDERS + 1]
        )
        count = len(rows) if len(rows) <= NAMED_HOLDERS else runs.holders().count()
        from .querysets import DbNow

        ahead = Q(created_at__lt=run.created_at) | Q(created_at=run.created_at, run_id__lt=run.run_id)
        waiting = runs.filter(singleton_slot=SlotState.WAITER)
        due = is_due_q(DbNow())
        totals = waiting.aggregate(
            depth=Count("pk"), ahead=Count("pk", filter=ahead & due), not_due=Count("pk", filter=ahead & ~due)
        )
        holders = [(r[0], r[1], _since(r[2], r[3], r[4]), r[5]) for r in rows[:NAMED_HOLDERS]]
        is_waiter = run.tracked and not run.admitted
        position = totals["ahead"] + 1 if is_waiter else None
        return _QueueFacts(holders, count, totals["depth"], position, totals["not_due"])
    active = list(store.active_runs_for_key(run.workflow_name, run.singleton_key))
    held = sorted(
        (r for r in active if r.holds_slot),
        key=lambda r: (r.created_at, r.run_id),
    )
    waiters = sorted((r for r in active if r.tracked and not r.admitted), key=lambda r: (r.created_at, r.run_id))
    now = store.now()
    earlier = [w for w in waiters if (w.created_at, w.run_id) < (run.created_at, run.run_id)]
    due_ahead = sum(1 for w in earlier if is_due(w.not_before, now))
    position = due_ahead + 1 if any(w.run_id == run.run_id for w in waiters) else None
    holders = [
        (r.run_id, r.status, _since(r.admitted_at, r.started_at, r.attempts), r.namespace)
        for r in held[:NAMED_HOLDERS]
    ]
    return _QueueFacts(holders, len(held), len(waiters), position, len(earlier) - due_ahead)


def _recent_durations(store: BaseStore, workflow: str, key: str) -> list[float]:
    """Seconds from admission (or start) to finish of the key's last completed runs."""
    rows: Iterable[tuple[datetime | None, datetime | None]]
    if store.database is not None:
        from django.db.models.functions import Coalesce

        from .models import Run

        rows = (
            Run.objects.using(store.database)
            .for_key(workflow, key)
            .filter(status=RunStatus.COMPLETED, finished_at__isnull=False)
            .annotate(began=Coalesce("admitted_at", "started_at"))
            .order_by("-finished_at")
            .values_list("began", "finished_at")[:RECENT_RUNS]
        )
    else:
        done = [
            r
            for r in store.list_runs(workflow_name=workflow)
            if r.singleton_key == key and r.status == RunStatus.COMPLETED and r.finished_at is not None
        ]
        done.sort(key=lambda r: r.finished_at or r.created_at, reverse=True)
        rows = [(r.admitted_at or r.started_at, r.finished_at) for r in done[:RECENT_RUNS]]
    return [(end - begin).total_seconds() for begin, end in rows if begin is not None and end is not None]


def estimate_wait(position: int, slots: int, held: list[float | None], typical: float) -> float:
    """Estimate seconds until the waiter at ``position`` (1-based) is admitted.

    ``slots`` is the key's effective limit, ``held`` how long each holder has
    held (None: unknown), ``typical`` a typical run's duration in seconds. Each
    holder frees its slot after ``typical - held`` seconds (at least 0), a free
    slot at once; every waiter ahead then holds a slot for ``typical`` seconds.
    """
    free_at = [max(0.0, typical - (h or 0.0)) for h in held][:slots]
    free_at += [0.0] * (slots - len(free_at))
    if not free_at:
        return 0.0
    heapq.heapify(free_at)
    for _ in range(position - 1):
        heapq.heappush(free_at, heapq.heappop(free_at) + typical)
    return free_at[0]


def explain(engine: Core, run_id: str) -> Explanation:
    """Return why run ``run_id`` is where it is (K3).

    Reads through ``engine``'s store: the run, its key's active runs and its
    key's last completed runs. Raises
    :class:`~durable_singleton.exceptions.RunNotFoundError` as
    :meth:`Engine.get` does.
    """
    run = engine.get(run_id)
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
    }
    if run.is_terminal:
        sentence = f"Run {run.run_id} is {run.status} (finished at {_at(run.finished_at)}): it waits for nothing."
        return Explanation(state=ExplainState.TERMINAL, sentence=sentence, **base)
    if run.not_before is not None and run.is_parked and not run.holds_slot and not is_due(run.not_before, store.now()):
        # A delayed start (X5), judged on the store's clock as the claim judges it (R5).
        then = (
            f"it then takes its place in line for key {run.singleton_key!r} of {run.workflow_name}, the place "
            f"it has held since its creation at {_at(run.created_at)}, and blocks no due waiter until then"
            if run.singleton_key is not None
            else "the tick sends its turn then"
        )
        sentence = f"Run {run.run_id} is not due until {_at(run.not_before)} (a delayed start): {then}."
        return Explanation(state=ExplainState.NOT_DUE, sentence=sentence, **base)
    if run.singleton_key is None:
        return _explain_unkeyed(run, now, base)

    key = run.singleton_key
    facts = _queue_facts(store, run)
    controls = _key_controls(store, run.workflow_name, key)
    configured = _key_limit(engine, run)
    limit = limit_in_force(configured, controls.override)
    # Admission is global (S11): a scoped engine counts other namespaces'
    # holders but never names them (D10).
    holder_infos = [
        HolderInfo(run_id, status, since, (now - since).total_seconds() if since is not None else None)
        for run_id, status, since, namespace in facts.holders
        if not engine.scope_reads or namespace == engine.namespace
    ]
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
            held_since = run.admitted_at or _since(None, run.started_at, run.attempts)
        doings: dict[str, str] = {
            RunStatus.RUNNING: f"running (lease held by {run.lease_owner})" if run.lease_owner else run.status,
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
    if position <= free:
        due = run.wake_at is None or run.wake_at <= now
        when = "now" if due else f"at {_at(run.wake_at)}"
        sentence = (
            f"Run {run.run_id} could run now: {key_words} has {free} free slot(s) ({limit_words}) and it is "
            f"first in line, but no worker has taken its turn since {_at(idle_since)}; its turn is due {when}."
        )
        return Explanation(
            state=ExplainState.RUNNABLE, sentence=sentence, position=position, idle_since=idle_since, **keyed
        )

    durations = _recent_durations(store, run.workflow_name, key)
    estimate = None
    if durations and not controls.paused:
        typical = sorted(durations)[len(durations) // 2]
        estimate = estimate_wait(position, max(limit, 1), [h.held_seconds for h in holder_infos], typical)
    if holder_infos:
        named = ", ".join(
            f"{h.run_id} ({h.status}, holding for {format_seconds(h.held_seconds)})"
            if h.held_seconds is not None
            else f"{h.run_id} ({h.status})"
            for h in holder_infos
        )
        more = f" and {facts.holder_count - len(holder_infos)} more" if facts.holder_count > len(holder_infos) else ""
        behind = f"behind {named}{more}"
    elif facts.holder_count:
        behind = f"behind {facts.holder_count} holder(s) of another namespace"
    else:
        behind = "behind no holder"
    reasons = [limit_words]
    if controls.paused:
        reasons.insert(0, "the key is paused: no run is admitted until it is resumed")
    wait_words = (
        f"; estimated wait about {format_seconds(estimate)} (median of the last {len(durations)} runs)"
        if estimate is not None
        else ""
    )
    skipped = (
        f"; {facts.not_due_ahead} waiter(s) ahead of it not due yet (delayed starts) do not count"
        if facts.not_due_ahead
        else ""
    )
    sentence = (
        f"Run {run.run_id} is waiting: position {position} of {facts.depth} in line for {key_words}, "
        f"{behind} ({', '.join(reasons)}){wait_words}{skipped}."
    )
    return Explanation(
        state=ExplainState.WAITER,
        sentence=sentence,
        position=position,
        estimated_wait_seconds=estimate,
        recent_durations=len(durations),
        idle_since=idle_since,
        **keyed,
    )


def _explain_unkeyed(run: RunRecord, now: datetime, base: dict[str, Any]) -> Explanation:
    if run.status == RunStatus.RUNNING:
        owner = f" on {run.lease_owner}" if run.lease_owner else ""
        expiry = f" (lease until {_at(run.lease_expires_at)})" if run.lease_expires_at else ""
        sentence = f"Run {run.run_id} is running{owner}{expiry}; it has no singleton key and waits for no one."
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
