"""The retention purge's deletes (O2): one transaction per chunk of finished
runs, which locks them and re-checks they are still finished, so a run
retried since the purge read it stays. :mod:`durable_singleton.retention`
chooses the runs.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction

from ..models import DebouncedStart, QuotaMembership, Run, Signal, Step
from ..records import PurgeReport
from ..statuses import TERMINAL_STATUSES

__all__ = ["delete_finished_chunk"]


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
