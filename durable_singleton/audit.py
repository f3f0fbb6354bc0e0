"""Slot audit (K4): check the invariants that queues of this kind leak, report
each finding, and repair the safe ones when asked.

Kinds of finding (:class:`FindingKind`):

* ``inactive_holder``: a run marked as a holder that is not active. The
  database refuses it (check constraint ``ds_run_slot_only_active``); the
  audit still looks, for stores or schemas without the constraint. Repair:
  drop the marker (the run is finished, its slot must be free).
* ``over_admitted``: a key (a singleton key, or a quota key as the workflow
  ``quota:<name>``, X3j) with more holders than its limit in force (S9,
  K2: :func:`~durable_singleton.admission.limit_in_force`, the runtime
  override included). Holders left over a lowered override are not a
  finding while none was admitted after the change (a lowered limit never
  evicts, K2). Never repaired: a holder cannot be evicted safely; reported
  for a human. A throttle key (the workflow ``throttle:<name>``, X6) with
  more recorded admissions within its current window (its ``period`` back
  from now) than its limit in force is one too.
* ``stalled_waiter``: a key with a free slot (none freed in the last two
  ticks; a paused key has none, :func:`~durable_singleton.admission.free_slots`)
  whose front waiter has been due for longer than two ticks, or has
  no wake time: no worker took its turn. Repair: wake it (``wake_at`` = the store's now, R8,
  then dispatch). A throttle key (the workflow ``throttle:<name>``, X6d) with
  room in its current window (none while paused) whose front waiter, due by
  its ``not_before`` (a run parked over the rate: the window's opening), has
  had its wake time pass more than two ticks ago is one too; its repair is a
  compare-and-set on the wake time read (R5a). So is a run waiting in its
  quotas (X3d, reported under ``quota:<name>`` of its first quota), due for
  longer than two ticks or with no wake time, that
  :func:`~durable_singleton.explain.explain` finds within the free slots of
  every limit it carries (``runnable``); its repair is the same wake.
* ``expired_lease``: a ``running`` run whose lease expired more than two
  ticks ago, so no tick has re-driven it. Repair: make it due now (the store's clock) and
  dispatch it (recovery then counts it, D4).

The audit reads and repairs through the store's methods, so every store is
audited (the in-memory store of :mod:`durable_singleton.testing` too).
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .admission import declared_limit, free_slots, limit_in_force, quota_lock_name, throttle_lock_name
from .core import Core
from .explain import ExplainState, explain
from .records import KeyCount
from .statuses import WAKEABLE_STATUSES

__all__ = ["AuditReport", "Finding", "FindingKind", "audit_slots"]

#: Findings of one kind listed in a report (the count is always complete).
MAX_LISTED = 100


class FindingKind(enum.StrEnum):
    """What the audit found wrong (K4)."""

    INACTIVE_HOLDER = "inactive_holder"
    OVER_ADMITTED = "over_admitted"
    STALLED_WAITER = "stalled_waiter"
    EXPIRED_LEASE = "expired_lease"


@dataclass(frozen=True)
class Finding:
    """One broken invariant: its kind, the run (or a key's front waiter), the
    workflow and key, a sentence, and whether the audit repaired it."""

    kind: FindingKind
    workflow: str
    key: str | None
    run_id: str | None
    detail: str
    repaired: bool = False

    def as_dict(self) -> dict[str, Any]:
        """Return the finding as JSON-ready data."""
        return {
            "kind": str(self.kind),
            "workflow": self.workflow,
            "key": self.key,
            "run_id": self.run_id,
            "detail": self.detail,
            "repaired": self.repaired,
        }


@dataclass
class AuditReport:
    """Every finding of one audit, as of ``checked_at``."""

    checked_at: datetime
    findings: list[Finding] = field(default_factory=list)

    def count(self, kind: FindingKind | None = None) -> int:
        """Return the number of findings (of ``kind`` if given)."""
        return sum(1 for f in self.findings if kind is None or f.kind == kind)

    def by_workflow(self) -> dict[tuple[str, str], int]:
        """Return the number of findings per (workflow, kind), for metrics."""
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for finding in self.findings:
            counts[(finding.workflow, str(finding.kind))] += 1
        return dict(counts)

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {
            "checked_at": self.checked_at.isoformat(),
            "counts": {str(kind): self.count(kind) for kind in FindingKind},
            "findings": [f.as_dict() for f in self.findings],
        }


def _stalled(
    ident: tuple[str, str], run_id: str, room: str, due_since: datetime | None, now: datetime, repaired: bool
) -> Finding:
    """The finding of a front waiter left waiting beside free room (``room``: the free
    slots or admissions, in words), due since ``due_since`` or with no wake time (K4)."""
    waited = (
        f"has been due for {(now - due_since).total_seconds():.0f} s" if due_since is not None else "has no wake time"
    )
    return Finding(
        FindingKind.STALLED_WAITER,
        ident[0],
        ident[1],
        run_id,
        f"{room} but the front waiter {run_id} {waited}",
        repaired,
    )


def audit_slots(engine: Core, *, repair: bool = False, now: datetime | None = None) -> AuditReport:
    """Check the slot invariants of SPEC K4 on ``engine``'s store; repair the
    safe findings when ``repair`` is true.

    "Longer than two ticks" is ``2 * TICK_SECONDS`` before ``now`` (default:
    the engine's clock). A key's limit is the limit in force
    (:func:`~durable_singleton.admission.limit_in_force`): its runtime
    override (K2), else its workflow's latest registered limit, else the one
    stored on its runs. Every read and repair is the store's
    (:class:`~durable_singleton.stores.base.BaseStore`, "reads and writes for
    the metrics, health and the slot audit"). Returns an :class:`AuditReport`.
    """
    store = engine.store
    now = now or engine.now()
    report = AuditReport(checked_at=now)
    grace = now - timedelta(seconds=2 * engine.settings.TICK_SECONDS)
    limits = engine.limits()
    # The runtime controls (K2) of the keys that have any: (paused, override).
    controls = store.controlled_keys()

    def limit_of(ident: tuple[str, str], stored: int | None) -> int:
        return limit_in_force(declared_limit(limits, ident[0], (stored,)), controls.get(ident, (False, None))[1])

    def over_admitted(count: KeyCount, limit: int, what: str = "holders") -> None:
        """Report a key (a singleton key, a quota key as ``quota:<name>``, a throttle key
        as ``throttle:<name>``) with more holders (or admissions) than its limit, unless
        they are left over a lowered limit and none was admitted since (K2: never evicted)."""
        if count.count <= limit:
            return
        changed_at = store.limit_changed_at(count.name, count.key)
        if changed_at is not None and (count.last_admitted_at is None or count.last_admitted_at <= changed_at):
            return
        report.findings.append(
            Finding(
                FindingKind.OVER_ADMITTED, count.name, count.key, None, f"{count.count} {what} for a limit of {limit}"
            )
        )

    for run in store.inactive_holders(MAX_LISTED):
        repaired = repair and store.drop_holder_marker(run.run_id)
        report.findings.append(
            Finding(
                FindingKind.INACTIVE_HOLDER,
                run.workflow_name,
                run.singleton_key,
                run.run_id,
                f"run {run.run_id} is {run.status} but marked as holding a slot",
                repaired,
            )
        )

    # Singleton keys and quota keys (X3c, X3j): holders over the limit in force.
    held: dict[tuple[str, str], int] = {}
    for count in store.key_holder_counts():
        ident = (count.name, count.key)
        held[ident] = count.count
        over_admitted(count, limit_of(ident, count.stored_limit))

    # Throttle keys (X6): more admissions in the window that ends now than the limit in force.
    admitted: dict[tuple[str, str], int] = {}
    declared_throttles: dict[str, tuple[str, int]] = {}
    for name, period in sorted(engine.registry.throttle_periods().items()):
        declared = engine.registry.throttles[name].limit
        declared_throttles[throttle_lock_name(name)] = (name, declared)
        for window in store.throttle_window_counts(name, now - timedelta(seconds=period)):
            admitted[(window.name, window.key)] = window.count
            what = f"admissions within {period:g} s"
            over_admitted(window, limit_of((window.name, window.key), declared), what)

    # Throttle keys (X6d) with room in their window (none while paused) whose front waiters,
    # due by their not_before (a run parked over the rate: the window's opening), have had
    # their wake time pass more than two ticks ago, or have none: no tick sent their turn.
    for queue in store.overdue_throttle_keys(grace)[:MAX_LISTED]:
        if queue.name not in declared_throttles:
            continue  # a throttle this process does not declare: its period is not known here
        name, declared = declared_throttles[queue.name]
        ident = (queue.name, queue.key)
        paused = controls.get(ident, (False, None))[0]
        free = free_slots(limit_of(ident, declared), admitted.get(ident, 0), paused=paused)
        if free <= 0:
            continue  # the window is full (its waiters are parked until it opens) or the key is paused
        for waiter in store.due_throttle_waiters(name, queue.key, free):
            due_since = waiter.wake_at
            if waiter.status not in WAKEABLE_STATUSES or (due_since is not None and due_since > grace):
                continue
            if len(report.findings) >= 4 * MAX_LISTED:
                break
            repaired = repair and store.wake_throttle_waiter(waiter.run_id, due_since)
            if repaired:
                engine.dispatcher.dispatch(waiter.run_id, engine.queue_of(waiter))
            report.findings.append(
                _stalled(ident, waiter.run_id, f"{free} free admission(s) in the window", due_since, now, repaired)
            )

    # Keys with a waiter due for longer than two ticks (or with no wake time at all); a
    # waiter whose not_before has not come is not due, so never stalled (X5). A waiter
    # that carries quotas may wait for one of them: its singleton key's free slot is
    # not its only limit (X3d), so it is not judged here.
    for queue in store.overdue_waiter_keys(grace):
        ident = (queue.name, queue.key)
        paused = controls.get(ident, (False, None))[0]
        free = free_slots(limit_of(ident, queue.stored_limit), held.get(ident, 0), paused=paused)
        if free <= 0 or store.key_freed_since(*ident, grace):
            continue  # no free slot, or one freed less than two ticks ago (its push may be in flight)
        for waiter in store.due_waiters(*ident, free):
            due_since = waiter.wake_at
            if waiter.quota_slot is not None:
                continue  # it may wait for a quota (X3d): not judged on this key alone
            if (due_since is not None and due_since > grace) or len(report.findings) >= 4 * MAX_LISTED:
                continue
            repaired = repair and store.wake_waiter(waiter.run_id)
            if repaired:
                engine.dispatcher.dispatch(waiter.run_id, engine.queue_of(waiter))
            report.findings.append(_stalled(ident, waiter.run_id, f"{free} free slot(s)", due_since, now, repaired))

    # Quota waiters (X3d): a run waiting in its quotas, due for longer than two ticks (or with no
    # wake time), that explain (K3) finds within the free slots of every limit it carries
    # (``runnable``, the one judgement of that): no worker took its turn. A quota key's room is
    # not enough alone: its waiter may wait for its singleton key or another quota.
    for run in store.overdue_quota_waiters(grace, MAX_LISTED):
        if len(report.findings) >= 4 * MAX_LISTED:
            break
        if not run.quota_keys or explain(engine, run.run_id).state is not ExplainState.RUNNABLE:
            continue
        repaired = repair and store.wake_waiter(run.run_id)
        if repaired:
            engine.dispatcher.dispatch(run.run_id, engine.queue_of(run))
        name, key = run.quota_keys[0]
        room = "free slots in every quota it carries"
        report.findings.append(_stalled((quota_lock_name(name), key), run.run_id, room, run.wake_at, now, repaired))

    for run in store.unredriven_leases(grace, MAX_LISTED):
        assert run.lease_expires_at is not None
        repaired = repair and store.redrive_lease(run.run_id, run.lease_expires_at)
        if repaired:
            engine.dispatcher.dispatch(run.run_id, engine.queue_of(run))
        report.findings.append(
            Finding(
                FindingKind.EXPIRED_LEASE,
                run.workflow_name,
                run.singleton_key,
                run.run_id,
                f"lease of {run.lease_owner} expired {(now - run.lease_expires_at).total_seconds():.0f} s ago "
                "and no tick re-drove it",
                repaired,
            )
        )
    return report
