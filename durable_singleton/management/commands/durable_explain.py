"""``manage.py durable_explain RUN_ID``: why a run is waiting, and behind whom (K3).

A run id may be given by an unambiguous prefix, as git takes a commit; an
ambiguous or unknown one is an error listing the candidates (exit status 1).
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import DurableSingletonError
from ...runtime import get_engine
from ._options import resolve_run_id


class Command(BaseCommand):
    help = (
        "Explain where runs stand: holding a slot (since when, fencing token), waiting at position N "
        "behind named holders (depth, pause and limit, estimated wait), or able to run but not running."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "run_ids",
            nargs="+",
            metavar="RUN_ID",
            help="Run ids to explain; an unambiguous prefix of one (as git takes a commit) will do.",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object per run instead of sentences.")

    def handle(self, *args: Any, **options: Any) -> None:
        engine = get_engine()
        failed = []
        for run_id in options["run_ids"]:
            try:
                explanation = engine.explain(resolve_run_id(engine, run_id))
            except DurableSingletonError as exc:
                failed.append(f"{run_id}: {exc}")
                continue
            if options["json"]:
                self.stdout.write(json.dumps(explanation.as_dict(), sort_keys=True))
            else:
                self.stdout.write(explanation.sentence)
        if failed:
            raise CommandError("; ".join(failed))
