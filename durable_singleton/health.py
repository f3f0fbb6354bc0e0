"""Health of a deployment (O3): what ``manage.py durable_health`` reports.

A deployment is unhealthy when any of these holds:

* ``stale_tick``: no tick completed for longer than ``stale_seconds`` (the
  heartbeat row, :mod:`durable_singleton.heartbeat`), or none ever did;
* a slot audit finding (K4, :mod:`durable_singleton.audit`): a lease expired
  and not re-driven, a key with a free slot and an overdue waiter, more
  holders than the limit, an inactive holder;
* ``backlog``: runs that are not key waiters and were still not started
  ``backlog_seconds`` after their creation (no worker takes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .audit import AuditReport, audit_slots
from .statuses import RunStatus, SlotState

__all__ = ["HealthReport", "Problem", "check_health"]


@dataclass(frozen=True)
class Problem:
    """One reason the deployment is unhealthy: a kind and a sentence."""

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
            "audit": self.audit.as_dict(),
        }


def check_health(
    engine: Any, *, stale_seconds: float, backlog_seconds: float, repair: bool = False, now: datetime | None = None
) -> HealthReport:
    """Check ``engine``'s deployment; return a :class:`HealthReport`.

    ``stale_seconds``: the longest accepted time since the last completed
    tick; ``backlog_seconds``: how long a run other than a key waiter may stay
    ``pending`` without a first turn; ``repair``: let the audit repair its
    safe findings (K4). Only the Django store is checked.
    """
    from .heartbeat import last_tick
    from .models import Run

    now = now or engine.now()
    audit = audit_slots(engine, repair=repair, now=now)
    db = engine.store.database
    beat = last_tick(db) if db is not None else None
    report = HealthReport(
        checked_at=now,
        last_tick_at=beat.at if beat is not None else None,
        last_tick_owner=beat.owner if beat is not None else "",
        backlog=0,
        waiting=0,
        audit=audit,
    )
    if db is None:
        return report
    if beat is None:
        report.problems.append(Problem("stale_tick", "no tick has ever completed on this database"))
    elif (now - beat.at).total_seconds() > stale_seconds:
        age = (now - beat.at).total_seconds()
        report.problems.append(
            Problem(
                "stale_tick", f"the last tick completed {age:.0f} s ago (limit {stale_seconds:g} s), by {beat.owner}"
            )
        )
    runs = Run.objects.using(db)
    report.waiting = runs.filter(singleton_slot=SlotState.WAITER).count()
    report.backlog = (
        runs.filter(status=RunStatus.PENDING, attempts=0, created_at__lte=now - timedelta(seconds=backlog_seconds))
        .exclude(singleton_slot=SlotState.WAITER)
        .count()
    )
    if report.backlog:
        report.problems.append(
            Problem("backlog", f"{report.backlog} runs not started {backlog_seconds:g} s after their creation")
        )
    for finding in audit.findings:
        if not finding.repaired:
            report.problems.append(Problem(str(finding.kind), finding.detail))
    return report
