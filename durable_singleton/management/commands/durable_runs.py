"""``manage.py durable_runs``: list, cancel, retry or wake runs chosen by id or filters (O3)."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...admission import KEY_MAX_LENGTH
from ...exceptions import DurableSingletonError
from ...statuses import RunStatus
from ._options import count_option, duration, seconds_option, text_option

ACTIONS = ("list", "cancel", "retry", "wake")


class Command(BaseCommand):
    help = (
        "Act on runs chosen by id or by filters: list them, cancel them (D6), retry failed or dead ones through "
        "admission (D9), or wake parked ones. Acting on runs needs run ids or at least one filter."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("action", choices=ACTIONS, help="What to do with each run.")
        parser.add_argument("run_ids", nargs="*", help="Run ids (exact); with filters, both must match.")
        parser.add_argument("--workflow", help="Only this workflow (exact name).")
        parser.add_argument("--key", help="Only this singleton key (exact).")
        parser.add_argument(
            "--status", action="append", choices=list(RunStatus.values), help="Only this status (repeatable)."
        )
        parser.add_argument("--older-than", type=duration, help="Only runs created longer ago (90s, 15m, 12h, 7d).")
        parser.add_argument(
            "--limit", type=int, default=100, help="At most this many runs, newest first (default 100)."
        )
        parser.add_argument(
            "--oldest-first", action="store_true", help="Choose and print the oldest runs first instead."
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="List the runs the action would touch; change nothing."
        )
        parser.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ...runtime import get_engine

        action = options["action"]
        filters = [options[name] for name in ("workflow", "key", "status", "older_than")]
        if action != "list" and not options["run_ids"] and not any(f is not None for f in filters):
            raise CommandError(f"{action} needs run ids or a filter (--workflow, --key, --status, --older-than)")
        limit = count_option(options["limit"], "--limit")
        run_ids = [text_option(run_id, "a run id") or "" for run_id in options["run_ids"]]
        workflow = text_option(options["workflow"], "--workflow")
        key = text_option(options["key"], "--key", KEY_MAX_LENGTH)
        if options["older_than"] is not None:
            seconds_option(options["older_than"], "--older-than")
        engine = get_engine()
        older_than = options["older_than"]
        # Newest first, as git log, docker ps and Django's admin list them.
        chosen = engine.store.select_runs(
            limit=limit,
            run_ids=run_ids,
            workflow_name=workflow or None,
            key=key or None,
            statuses=options["status"] or (),
            created_before=engine.now() - timedelta(seconds=older_than) if older_than is not None else None,
            namespace=engine.namespace if engine.scope_reads else None,
            oldest_first=options["oldest_first"],
        )
        results = []
        for run in chosen:
            run_id = run.run_id
            entry: dict[str, Any] = {
                "run_id": run_id,
                "workflow": run.workflow_name,
                "key": run.singleton_key,
                "status": run.status,
            }
            if action != "list" and not options["dry_run"]:
                try:
                    after = getattr(engine, action)(run_id)
                    entry["outcome"] = after.status
                except DurableSingletonError as exc:
                    entry["error"] = str(exc)
            results.append(entry)
        if options["json"]:
            self.stdout.write(json.dumps({"action": action, "dry_run": options["dry_run"], "runs": results}, indent=2))
        else:
            for entry in results:
                tail = (
                    f" -> {entry['outcome']}"
                    if "outcome" in entry
                    else f" ! {entry['error']}"
                    if "error" in entry
                    else ""
                )
                self.stdout.write(
                    f"{entry['run_id']}  {entry['workflow']}  {entry['key'] or '-'}  {entry['status']}{tail}"
                )
            done = "would " + action if options["dry_run"] and action != "list" else action
            self.stdout.write(f"{done}: {len(results)} runs")
        if any("error" in entry for entry in results):
            raise CommandError(f"{action} failed for {sum('error' in e for e in results)} runs", returncode=1)
