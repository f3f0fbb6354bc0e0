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
  no wake time: no worker took its turn. Repair: wake it (``wake_at`` = now,
  then dispatch).
* ``expired_lease``: a ``running`` run whose lease expired more than two
  ticks ago, so no tick has re-driven it. Repair: make it due now and
  dispatch it (recovery then counts it, D4).

Only the Django store is audited; with another store the report is empty.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .admission import (
    ACTIVE_STATUSES,
    declared_limit,
    free_slots,
    holds_quota_slot_q,
    holds_slot_q,
    key_only_waiter_q,
    limit_in_force,
    quota_lock_name,
    throttle_lock_name,
)
from .core import Core
from .statuses import RunStatus, SlotState

__all__ = ["AuditReport", "Finding", "FindingKind", "audit_slots"]

#: Findings of one kind listed in a report (the count is always complete).
MAX_LISTED = 100
#: A waiter the audit may wake: parked waiting for its slot, not blocked.
_WAKEABLE = (RunStatus.PENDING, RunStatus.SUSPENDED)


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


def audit_slots(engine: Core, *, repair: bool = False, now: datetime | None = None) -> AuditReport:
    """Check the slot invariants of SPEC K4 on ``engine``'s store; repair the
    safe findings when ``repair`` is true.

    "Longer than two ticks" is ``2 * TICK_SECONDS`` before ``now`` (default:
    the engine's clock). A key's limit is the limit in force
    (:func:`~durable_singleton.admission.limit_in_force`): its runtime
    override (K2), else its workflow's latest registered limit, else the one
    stored on its runs. Returns an :class:`AuditReport`.
    """
    now = now or engine.now()
    report = AuditReport(checked_at=now)
    db = engine.store.database
    if db is None:
        return report
    from django.db.models import Count, Max, Q

    from .models import KeyControlChange, QuotaMembership, Run, SingletonKey, ThrottleAdmission

    runs = Run.objects.using(db)
    grace = now - timedelta(seconds=2 * engine.settings.TICK_SECONDS)
    limits = engine.limits()
    # The runtime controls (K2) of the keys that have any: (paused, override).
    controls: dict[tuple[str, str], tuple[bool, int | None]] = {
        (w, k): (bool(paused), override)
        for w, k, paused, override in SingletonKey.objects.using(db)
        .filter(Q(paused=True) | Q(limit_override__isnull=False))
        .values_list("workflow_name", "key", "paused", "limit_override")
    }

    def limit_of(ident: tuple[str, str], stored: int | None) -> int:
        return limit_in_force(declared_limit(limits, ident[0], (stored,)), controls.get(ident, (False, None))[1])

    def over_admitted(
        ident: tuple[str, str], holders: int, limit: int, last_admitted: datetime | None, what: str = "holders"
    ) -> None:
        """Report a key (a singleton key, or a quota key as ``quota:<name>``) with more
        holders than its limit, unless they are left over a lowered limit and none
        was admitted since (K2: never evicted)."""
        if holders <= limit:
            return
        changed_at = limit_changed_at(ident)
        if changed_at is not None and (last_admitted is None or last_admitted <= changed_at):
            return
        report.findings.append(
            Finding(FindingKind.OVER_ADMITTED, ident[0], ident[1], None, f"{holders} {what} for a limit of {limit}")
        )

    def limit_changed_at(ident: tuple[str, str]) -> datetime | None:
        """When the key's limit override last changed (its own or its workflow's), if ever (K2)."""
        changes = KeyControlChange.objects.using(db).filter(
            workflow_name=ident[0], key__in=(ident[1], ""), field="limit_override"
        )
        at: datetime | None = changes.aggregate(at=Max("changed_at"))["at"]
        return at

    for row in runs.filter(singleton_slot=SlotState.HOLDER).exclude(status__in=ACTIVE_STATUSES)[:MAX_LISTED]:
        repaired = False
        if repair:
            repaired = bool(
                runs.filter(pk=row.pk, singleton_slot=SlotState.HOLDER)
                .exclude(status__in=ACTIVE_STATUSES)
                .update(singleton_slot=None)
            )
        report.findings.append(
            Finding(
                FindingKind.INACTIVE_HOLDER,
                row.workflow_name,
                row.singleton_key,
                row.run_id,
                f"run {row.run_id} is {row.status} but marked as holding a slot",
                repaired,
            )
        )

    holders = (
        runs.filter(holds_slot_q())
        .values("workflow_name", "singleton_key")
        .annotate(n=Count("pk"), stored_limit=Max("singleton_limit"), last_admitted=Max("admitted_at"))
        .order_by()
    )
    held: dict[tuple[str, str], int] = {}
    for group in holders:
        if group["singleton_key"] is None:
            continue  # never stored: a slot needs a key (constraint ds_run_slot_only_active)
        ident = (group["workflow_name"], group["singleton_key"])
        held[ident] = group["n"]
        over_admitted(ident, group["n"], limit_of(ident, group["stored_limit"]), group["last_admitted"])

    # Quota keys (X3c, X3j): holders over the limit in force, as for a singleton key.
    quota_holders = (
        QuotaMembership.objects.using(db)
        .filter(holds_quota_slot_q())
        .values("quota", "key")
        .annotate(n=Count("pk"), last_admitted=Max("run__admitted_at"))
        .order_by()
    )
    for quota_group in quota_holders:
        ident = (quota_lock_name(quota_group["quota"]), quota_group["key"])
        over_admitted(ident, quota_group["n"], limit_of(ident, 1), quota_group["last_admitted"])

    # Throttle keys (X6): more admissions in the window that ends now than the limit in force.
    for name, period in sorted(engine.registry.throttle_periods().items()):
        windows = (
            ThrottleAdmission.objects.using(db)
            .filter(throttle=name, admitted_at__gt=now - timedelta(seconds=period))
            .values("key")
            .annotate(n=Count("pk"), last_admitted=Max("admitted_at"))
            .order_by()
        )
        declared = engine.registry.throttles[name].limit
        for window in windows:
            ident = (throttle_lock_name(name), window["key"])
            what = f"admissions within {period:g} s"
            over_admitted(ident, window["n"], limit_of(ident, declared), window["last_admitted"], what)

    # Keys with a waiter due for longer than two ticks (or with no wake time at all); a
    # waiter whose not_before has not come is not due, so never stalled (X5). A waiter
    # that carries quotas may wait for one of them: its singleton key's free slot is
    # not its only limit (X3d), so it is not judged here.
    overdue = Q(wake_at__isnull=True) | Q(wake_at__lte=grace)
    stale = (
        runs.admissible()
        .filter(overdue, key_only_waiter_q(), status__in=_WAKEABLE)
        .values("workflow_name", "singleton_key")
        .annotate(stored_limit=Max("singleton_limit"))
        .order_by()
    )
    for queue in stale:
        if queue["singleton_key"] is None:
            continue
        ident = (queue["workflow_name"], queue["singleton_key"])
        paused = controls.get(ident, (False, None))[0]
        free = free_slots(limit_of(ident, queue["stored_limit"]), held.get(ident, 0), paused=paused)
        if free <= 0 or runs.for_key(*ident).filter(finished_at__gt=grace).exists():
            continue  # no free slot, or one freed less than two ticks ago (its push may be in flight)
        front = list(runs.for_key(*ident).due_waiting().values("run_id", "wake_at", "quota_slot")[:free])
        for waiter in front:
            due_since = waiter["wake_at"]
            if waiter["quota_slot"] is not None:
                continue  # it may wait for a quota (X3d): not judged on this key alone
            if (due_since is not None and due_since > grace) or len(report.findings) >= 4 * MAX_LISTED:
                continue
            repaired = False
            if repair:
                repaired = bool(
                    runs.filter(pk=waiter["run_id"], status__in=_WAKEABLE).update(wake_at=now, updated_at=now)
                )
                if repaired:
                    engine.dispatcher.dispatch(waiter["run_id"], engine.queue_of(engine.get(waiter["run_id"])))
            report.findings.append(
                Finding(
                    FindingKind.STALLED_WAITER,
                    ident[0],
                    ident[1],
                    waiter["run_id"],
                    f"{free} free slot(s) but the front waiter {waiter['run_id']} "
                    + (
                        f"has been due for {(now - due_since).total_seconds():.0f} s"
                        if due_since is not None
                        else "has no wake time"
                    ),
                    repaired,
                )
            )

    expired = runs.filter(status=RunStatus.RUNNING, lease_expires_at__lte=grace).filter(
        Q(wake_at__isnull=True) | Q(wake_at__lte=grace)
    )
    for row in expired.order_by("lease_expires_at")[:MAX_LISTED]:
        repaired = False
        if repair:
            repaired = bool(
                runs.filter(pk=row.pk, status=RunStatus.RUNNING, lease_expires_at=row.lease_expires_at).update(
                    wake_at=now
                )
            )
            if repaired:
                engine.dispatcher.dispatch(row.run_id, engine.queue_of(engine.get(row.run_id)))
        assert row.lease_expires_at is not None
        report.findings.append(
            Finding(
                FindingKind.EXPIRED_LEASE,
                row.workflow_name,
                row.singleton_key,
                row.run_id,
                f"lease of {row.lease_owner} expired {(now - row.lease_expires_at).total_seconds():.0f} s ago "
                "and no tick re-drove it",
                repaired,
            )
        )
    return report
