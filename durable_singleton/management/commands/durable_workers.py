"""``manage.py durable_workers``: the registry of ``durable_worker`` processes (O6)."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = (
        "List the durable_worker processes registered in the database (DISPATCH 'worker'): host, pid, mode, "
        "threads, queues, when each started and how long ago it was last seen, on the database's clock; a "
        "process silent for longer than WORKER_DEAD_SECONDS is marked dead (its runs are taken back by the tick)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the registry as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ...runtime import get_engine

        engine = get_engine()
        workers = engine.store.worker_processes()
        if workers is None:
            self.stdout.write("no worker registry: the store keeps no rows in a database")
            return
        now = engine.store.now()
        dead = engine.settings.WORKER_DEAD_SECONDS
        rows = []
        for worker in workers:
            silent = max(0.0, (now - worker.last_seen_at).total_seconds())
            rows.append(
                {
                    "name": worker.name,
                    "host": worker.host,
                    "pid": worker.pid,
                    "mode": worker.mode,
                    "threads": worker.threads,
                    "queues": worker.queues or "all",
                    "started_at": worker.started_at.isoformat(),
                    "last_seen_seconds": round(silent, 1),
                    "alive": silent <= dead,
                }
            )
        if options["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        if not rows:
            self.stdout.write("no durable_worker process is registered; start one: python manage.py durable_worker")
            return
        for row in rows:
            state = "alive" if row["alive"] else f"dead (silent over {dead:g} s)"
            self.stdout.write(
                f"{row['name']}  mode {row['mode']}, {row['threads']} threads, queues {row['queues']}, "
                f"started {row['started_at']}, last seen {row['last_seen_seconds']:.1f} s ago: {state}"
            )
