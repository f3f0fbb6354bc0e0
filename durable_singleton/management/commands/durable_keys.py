"""``manage.py durable_keys``: pause, resume and override the limit of a key or a
whole workflow at runtime, and show a key's controls and their history (K2)."""

from __future__ import annotations

import getpass
import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...exceptions import DurableSingletonError
from ...runtime import get_engine


class Command(BaseCommand):
    help = (
        "Runtime key controls: pause, resume, limit N (override) or clear-limit a key (--key) or every key "
        "of a workflow; show prints a key's controls and recorded changes. Every change is recorded."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("action", choices=["pause", "resume", "limit", "clear-limit", "show"])
        parser.add_argument("workflow", help="Workflow name.")
        parser.add_argument("--key", help="One key (default: every key of the workflow; required by show).")
        parser.add_argument("--limit", type=int, help="The override, for the limit action (an int >= 1).")
        parser.add_argument("--reason", default="", help="Why (recorded with the change).")
        parser.add_argument("--by", default=None, help="Who (recorded; default: the OS user).")
        parser.add_argument("--json", action="store_true", help="Print JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        engine = get_engine()
        action, workflow, key = options["action"], options["workflow"], options["key"]
        by = options["by"] if options["by"] is not None else f"cli:{getpass.getuser()}"
        reason = options["reason"]
        if action == "limit" and options["limit"] is None:
            raise CommandError("the limit action needs --limit N")
        try:
            if action == "show":
                if key is None:
                    raise CommandError("show needs --key")
                self._show(engine, workflow, key, options["json"])
                return
            limit = options["limit"] if action == "limit" else None
            if key is not None:
                states = [
                    {
                        "pause": lambda: engine.pause_key(workflow, key, by=by, reason=reason),
                        "resume": lambda: engine.resume_key(workflow, key, by=by, reason=reason),
                    }.get(action, lambda: engine.override_limit(workflow, key, limit, by=by, reason=reason))()
                ]
            elif action == "pause":
                states = engine.pause_workflow(workflow, by=by, reason=reason)
            elif action == "resume":
                states = engine.resume_workflow(workflow, by=by, reason=reason)
            else:
                states = engine.override_workflow_limit(workflow, limit, by=by, reason=reason)
        except DurableSingletonError as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps([s.__dict__ for s in states], sort_keys=True))
            return
        for state in states:
            self.stdout.write(self._describe(state))
        if not states:
            self.stdout.write(f"{workflow}: no key has a lock row yet; nothing changed")

    @staticmethod
    def _describe(state: Any) -> str:
        override = f"override {state.limit_override}" if state.limit_override is not None else "no override"
        return (
            f"{state.workflow} {state.key}: {'paused' if state.paused else 'admitting'}, "
            f"limit {state.limit} (declared {state.declared_limit}, {override})"
        )

    def _show(self, engine: Any, workflow: str, key: str, as_json: bool) -> None:
        state = engine.key_controls(workflow, key)
        history = engine.control_history(workflow, key)
        if as_json:
            document = {
                "controls": state.__dict__,
                "history": [{**h.__dict__, "at": h.at.isoformat()} for h in history],
            }
            self.stdout.write(json.dumps(document, sort_keys=True, default=str))
            return
        self.stdout.write(self._describe(state))
        for h in history:
            scope = h.key or f"every key ({h.keys})"
            why = f" - {h.reason}" if h.reason else ""
            self.stdout.write(f"  {h.at:%Y-%m-%d %H:%M:%S} {h.by or '?'}: {scope} {h.field} {h.old} -> {h.new}{why}")
