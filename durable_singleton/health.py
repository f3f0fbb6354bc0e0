"""Health of a deployment (O3): what ``manage.py durable_health`` reports.

A deployment is unhealthy when any of these holds:

* ``stale_tick``: no tick completed for longer than ``stale_seconds`` (the
  heartbeat row, :mod:`durable_singleton.heartbeat`), or none ever did;
* a slot audit finding (K4, :mod:`durable_singleton.audit`): a lease expired
  and not re-driven, a key with a free slot and an overdue waiter, more
  holders than the limit, an inactive holder;
* ``no_worker`` (``DISPATCH = "worker"``): no ``durable_worker`` process
  refreshed its registry row within ``WORKER_DEAD_SECONDS`` (O6), or none
  is registered;
* ``backlog``: runs that are not key waiters and were still not started
  ``backlog_seconds`` after their creation (no worker takes them).

It warns, and stays healthy, about ``unrenewed_lease``: a running run whose
lease was not renewed for longer than the renewal interval
(:func:`~durable_singleton.renewals.lease_state`, on the database's clock, K3),
so its worker was killed, is frozen or is cut off. Nothing is broken yet: the
tick recovers the run when the lease expires (D4), and a lease still not
re-driven two ticks after its expiry is the ``expired_lease`` finding, a
problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .admission import QUOTA_PREFIX
from .audit import AuditReport, audit_slots
from .explain import lease_words
from .renewals import lease_state
from .stores.base import BaseStore

__all__ = ["HealthReport", "Problem", "check_health"]

#: Unrenewed leases named in a report (the count is always complete).
MAX_WARNINGS = 100


@dataclass(frozen=True)
class Problem:
    """One reason the deployment is unhealthy, or a warning: a kind and a sentence."""

    kind: str
    detail: str


@dataclass
class HealthReport:
    """The outcome of :func:`check_health`; ``healthy`` is True when there is no problem."""

    checked_at: datetime
    last_tick_at: datetime | None
    last_tick_owner: str
    backlog: int
    waiting: int
    audit: AuditReport
    problems: list[Problem] = field(default_factory=list)
    #: Warnings that leave the deployment healthy: unrenewed leases (at most :data:`MAX_WARNINGS`).
    warnings: list[Problem] = field(default_factory=list)
    #: Running runs whose lease was not renewed for longer than the renewal interval.
    unrenewed_leases: int = 0

    @property
    def healthy(self) -> bool:
        """Tell whether no problem was found."""
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return {
            "healthy": self.healthy,
            "checked_at": self.checked_at.isoformat(),
            "last_tick_at": self.last_tick_at.isoformat() if self.last_tick_at else None,
            "last_tick_owner": self.last_tick_owner,
            "backlog": self.backlog,
            "waiting": self.waiting,
            "problems": [{"kind": p.kind, "detail": p.detail} for p in self.problems],
            "unrenewed_leases": self.unrenewed_leases,
            "warnings": [{"kind": p.kind, "detail": p.detail} for p in self.warnings],
            "audit": self.audit.as_dict(),
        }


def check_health(
    engine: Any, *, stale_seconds: float, backlog_seconds: float, repair: bool = False, now: datetime | None = None
) -> HealthReport:
    """Check ``engine``'s deployment; return a :class:`HealthReport`.

    ``stale_seconds``: the longest accepted time since the last completed
    tick; ``backlog_seconds``: how long a run other than a key waiter may stay
    ``pending`` without a first turn; ``repair``: let the audit repair its
    safe findings (K4). Leases are judged on the store's clock, read once
    (R5), whatever ``now`` says. Every count is the store's (its methods
    for the services), so every store is checked; one that keeps no
    heartbeat reports ``stale_tick``.
    """
    from .heartbeat import last_tick

    store = engine.store
    now = now or engine.now()
    audit = audit_slots(engine, repair=repair, now=now)
    beat = last_tick(store)
    report = HealthReport(
        checked_at=now,
        last_tick_at=beat.at if beat is not None else None,
        last_tick_owner=beat.owner if beat is not None else "",
        backlog=0,
        waiting=0,
        audit=audit,
    )
    if beat is None:
        report.problems.append(Problem("stale_tick", "no tick: none has ever completed on this database"))
    elif (now - beat.at).total_seconds() > stale_seconds:
        age = (now - beat.at).total_seconds()
        report.problems.append(
            Problem(
                "stale_tick",
                f"no tick for {age:.0f} s: the last tick completed {age:.0f} s ago (limit {stale_seconds:g} s), "
                f"by {beat.owner}",
            )
        )
    if engine.settings.DISPATCH == "worker":
        _check_workers(report, store, engine.settings.WORKER_DEAD_SECONDS)
    report.waiting = sum(c.waiters for c in store.slot_counts() if not c.name.startswith(QUOTA_PREFIX))
    report.backlog = store.count_backlog(now - timedelta(seconds=backlog_seconds))
    if report.backlog:
        report.problems.append(
            Problem("backlog", f"{report.backlog} runs not started {backlog_seconds:g} s after their creation")
        )
    for finding in audit.findings:
        if not finding.repaired:
            report.problems.append(Problem(str(finding.kind), finding.detail))
    db_now = store.now()
    counts, unrenewed = store.unrenewed_leases(settings=engine.settings, now=db_now, limit=MAX_WARNINGS)
    report.unrenewed_leases = sum(counts.values())
    for run in unrenewed:
        lease = lease_state(run.status, run.lease_owner, run.lease_expires_at, settings=engine.settings, now=db_now)
        if lease is None:
            continue
        where = f" (key {run.singleton_key!r})" if run.singleton_key is not None else ""
        report.warnings.append(
            Problem(
                "unrenewed_lease",
                f"run {run.run_id} of {run.workflow_name}{where}: lease of {run.lease_owner} {lease_words(lease)}",
            )
        )
    return report


def _check_workers(report: HealthReport, store: BaseStore, dead_seconds: float) -> None:
    """Add ``no_worker`` when no registered ``durable_worker`` was seen within
    ``dead_seconds`` on the store's clock (O6)."""
    db_now = store.now()
    workers = store.worker_processes() or []
    latest = max(workers, key=lambda w: w.last_seen_at, default=None)
    if latest is None:
        report.problems.append(
            Problem(
                "no_worker",
                "no worker seen: no durable_worker process is registered on this database; "
                "start one: python manage.py durable_worker",
            )
        )
        return
    silent = (db_now - latest.last_seen_at).total_seconds()
    if silent > dead_seconds:
        report.problems.append(
            Problem(
                "no_worker",
                f"no worker seen for {silent:.0f} s (limit WORKER_DEAD_SECONDS {dead_seconds:g} s); "
                f"the last was {latest.name}; start one: python manage.py durable_worker",
            )
        )
