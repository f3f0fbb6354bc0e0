"""``manage.py durable_health``: exit 0 when healthy, 1 with the problems otherwise (O3, K4);
warnings (a lease not renewed for longer than the renewal interval, K3) are printed and keep exit 0."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...health import check_health
from ._options import duration


class Command(BaseCommand):
    help = (
        "Report a stale tick, leases expired and not re-driven, keys with a free slot and an overdue waiter, "
        "more holders than a limit, and runs nobody starts; warn about leases not renewed for longer than "
        "LEASE_RENEW_SECONDS. Exit status 0 when healthy (warnings included), 1 otherwise."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--stale-seconds",
            type=duration,
            default=None,
            help="Longest accepted time since the last tick (default: 10 ticks, at least 30 s).",
        )
        parser.add_argument(
            "--backlog-seconds",
            type=duration,
            default=60.0,
            help="How long a run (other than a key waiter) may wait for its first turn (default 60 s).",
        )
        parser.add_argument("--repair", action="store_true", help="Repair the audit's safe findings (K4).")
        parser.add_argument("--json", action="store_true", help="Print the report as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ...runtime import get_engine

        engine = get_engine()
        stale = options["stale_seconds"]
        if stale is None:
            stale = max(10 * engine.settings.TICK_SECONDS, 30.0)
        report = check_health(
            engine, stale_seconds=stale, backlog_seconds=options["backlog_seconds"], repair=options["repair"]
        )
        if options["json"]:
            self.stdout.write(json.dumps(report.as_dict(), indent=2))
        else:
            tick = report.last_tick_at.isoformat() if report.last_tick_at else "never"
            self.stdout.write(f"last tick: {tick} {report.last_tick_owner}".rstrip())
            self.stdout.write(f"waiting for a key: {report.waiting}; not started: {report.backlog}")
            repaired = [f for f in report.audit.findings if f.repaired]
            for finding in repaired:
                self.stdout.write(f"repaired {finding.kind}: {finding.detail}")
            for problem in report.problems:
                self.stdout.write(f"{problem.kind}: {problem.detail}")
            for warning in report.warnings:
                self.stdout.write(f"warning {warning.kind}: {warning.detail}")
            if report.unrenewed_leases > len(report.warnings):
                self.stdout.write(f"warning unrenewed_lease: {report.unrenewed_leases - len(report.warnings)} more")
            verdict = "healthy" if report.healthy else f"unhealthy: {len(report.problems)} problems"
            if report.unrenewed_leases:
                joint = " with warnings:" if report.healthy else ";"
                verdict += f"{joint} {report.unrenewed_leases} unrenewed lease(s)"
            self.stdout.write(verdict)
        if not report.healthy:
            raise CommandError(f"unhealthy: {', '.join(sorted({p.kind for p in report.problems}))}", returncode=1)
