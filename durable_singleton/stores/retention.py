"""The retention purge on the Django store (O2): the finished runs read in
pages of :data:`READ_PAGE` on (``finished_at``, ``run_id``), deleted in one
transaction per chunk of :data:`CHUNK` runs, which locks them and re-checks
they are still finished, so a run retried since the purge read it stays.
:func:`durable_singleton.retention.purge_finished` checks the arguments and
calls the store's ``purge_finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.db import transaction

from ..models import DebouncedStart, QuotaMembership, Run, Signal, Step
from ..records import PurgeReport
from ..statuses import TERMINAL_STATUSES

__all__ = ["CHUNK", "READ_PAGE", "delete_finished_chunk", "purge_finished_runs"]

#: Runs deleted per transaction.
CHUNK = 100
#: Runs read per page.
READ_PAGE = 2000


def purge_finished_runs(
    db: str,
    *,
    before: datetime,
    statuses: Sequence[str],
    workflow_name: str | None,
    key: str | None,
    limit: int | None,
    dry_run: bool,
) -> PurgeReport:
    """Delete (or, ``dry_run``, count) the runs of database ``db`` in
    ``statuses`` (terminal ones) finished before ``before``, of
    ``workflow_name`` and ``key`` when given, at most ``limit`` (None: all),
    oldest first, with their steps and signals."""
    report = PurgeReport(dry_run=dry_run)
    runs = Run.objects.using(db).filter(status__in=list(statuses), finished_at__lt=before)
    if workflow_name is not None:
        runs = runs.filter(workflow_name=workflow_name)
    if key is not None:
        runs = runs.filter(singleton_key=key)
    runs = runs.order_by("finished_at", "run_id")
    last: tuple[datetime, str] | None = None
    while limit is None or report.runs < limit:
        size = READ_PAGE if limit is None else min(READ_PAGE, limit - report.runs)
        page = runs
        if last is not None:
            # Page on (finished_at, run_id): a dry run deletes nothing, and a
            # run kept by the re-check must not be read again.
            page = runs.filter(finished_at__gte=last[0]).exclude(finished_at=last[0], run_id__lte=last[1])
        rows = list(page.values_list("run_id", "workflow_name", "status", "finished_at")[:size])
        if not rows:
            break
        for start in range(0, len(rows), CHUNK):
            delete_finished_chunk(db, rows[start : start + CHUNK], report, dry_run)
        finished_at = rows[-1][3]
        if finished_at is None:  # excluded by finished_at__lt: the column is only nullable for active runs
            break
        last = (finished_at, rows[-1][0])
        if len(rows) < size:
            break
    return report


def delete_finished_chunk(
    db: str, rows: list[tuple[str, str, str, datetime | None]], report: PurgeReport, dry_run: bool
) -> None:
    """Delete (or count) one transaction's runs with their steps and signals."""
    ids = [row[0] for row in rows]
    with transaction.atomic(using=db):
        # Lock and re-check: a run retried since the read is active again and stays.
        kept = list(
            Run.objects.using(db)
            .select_for_update()
            .filter(pk__in=ids, status__in=TERMINAL_STATUSES)
            .order_by("run_id")
            .values_list("run_id", flat=True)
        )
        steps = Step.objects.using(db).filter(run_id__in=kept)
        signals = Signal.objects.using(db).filter(run_id__in=kept)
        if dry_run:
            report.steps += steps.count()
            report.signals += signals.count()
        else:
            report.steps += steps._raw_delete(db)
            report.signals += signals._raw_delete(db)
            # A finished run's quota memberships hold no slot (X3g); they go with it.
            QuotaMembership.objects.using(db).filter(run_id__in=kept)._raw_delete(db)
            # The starts folded into them (X7c) are forgotten with them.
            DebouncedStart.objects.using(db).filter(run_id__in=kept)._raw_delete(db)
            # A raw delete: the post_delete receiver concerns active runs only.
            Run.objects.using(db).filter(pk__in=kept)._raw_delete(db)
    kept_set = set(kept)
    for run_id, workflow_name, status, _ in rows:
        if run_id in kept_set:
            report.runs += 1
            report.by_status[status] = report.by_status.get(status, 0) + 1
            report.by_workflow[workflow_name] = report.by_workflow.get(workflow_name, 0) + 1
