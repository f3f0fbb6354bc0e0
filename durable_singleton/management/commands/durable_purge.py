"""``manage.py durable_purge``: delete finished runs on demand (O2, O3)."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import ValidationError
from ...retention import purge_finished
from ...stores.base import TERMINAL_STATUSES
from ._options import count_option, duration, seconds_option


class Command(BaseCommand):
    help = (
        "Delete finished runs (completed, failed, cancelled, dead) with their steps and signals, oldest first, "
        "in small transactions. Active runs are never deleted."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--older-than",
            type=duration,
            default=None,
            help="Only runs finished longer ago than this (90s, 15m, 12h, 7d; default: RETENTION_SECONDS).",
        )
        parser.add_argument("--workflow", help="Only this workflow (exact name).")
        parser.add_argument("--key", help="Only this singleton key (exact).")
        parser.add_argument(
            "--status", action="append", choices=TERMINAL_STATUSES, help="Only this status (repeatable)."
        )
        parser.add_argument("--limit", type=int, default=None, help="Delete at most this many runs.")
        parser.add_argument("--dry-run", action="store_true", help="Count what would be deleted; delete nothing.")
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ...runtime import get_engine

        engine = get_engine()
        older_than = options["older_than"]
        if older_than is None:
            older_than = engine.settings.RETENTION_SECONDS
            if older_than is None:
                raise CommandError("RETENTION_SECONDS is None: give --older-than")
        older_than = seconds_option(older_than, "--older-than")
        limit = None if options["limit"] is None else count_option(options["limit"], "--limit")
        try:
            report = purge_finished(
                engine,
                before=engine.now() - timedelta(seconds=older_than),
                statuses=options["status"] or TERMINAL_STATUSES,
                workflow=options["workflow"],
                key=options["key"],
                limit=limit,
                dry_run=options["dry_run"],
            )
        except ValidationError as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps({"older_than_seconds": older_than, **report.as_dict()}, indent=2))
            return
        verb = "would delete" if report.dry_run else "deleted"
        self.stdout.write(
            f"{verb} {report.runs} runs ({report.steps} steps, {report.signals} signals) "
            f"finished more than {older_than:g} s ago"
        )
        for status, count in sorted(report.by_status.items()):
            self.stdout.write(f"  {status}: {count}")
