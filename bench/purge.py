"""Retention benchmark (issue #9, O2): table size before and after purging
100k finished runs (two steps each), and the purge's throughput.

    .venv/bin/python tools/services.py run --pg -- bash -c \\
        'DATABASE_URL=$DS_PG_URL .venv/bin/python -m bench.purge --runs 100000'
    .venv/bin/python -m bench.purge --runs 100000          # SQLite (bench/purge.sqlite3)

Creates the runs with ``bulk_create`` (finished a day ago), measures the size
of the run, step and signal tables, deletes them with
:func:`durable_singleton.retention.purge_finished` (what the tick's batch and
``manage.py durable_purge`` call), and measures again. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def _setup(sqlite_path: Path) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    if not os.environ.get("DATABASE_URL"):
        os.environ["DATABASE_URL"] = f"sqlite:///{sqlite_path}"
    import django

    django.setup()


def _sizes() -> dict[str, Any]:
    """Bytes used by the three tables (PostgreSQL: with indexes and TOAST; SQLite: pages of the file)."""
    from django.db import connection

    from durable_singleton.models import Run, Signal, Step

    tables = [m._meta.db_table for m in (Run, Step, Signal)]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE")
            sizes = {}
            for table in tables:
                cursor.execute("SELECT pg_total_relation_size(%s)", [table])
                sizes[table] = cursor.fetchone()[0]
            measure = "pg_total_relation_size after VACUUM"
            return {"bytes": sizes, "total_bytes": sum(sizes.values()), "measure": measure}
        if connection.vendor == "sqlite":
            cursor.execute("PRAGMA page_size")
            page = cursor.fetchone()[0]
            cursor.execute("PRAGMA page_count")
            pages = cursor.fetchone()[0]
            cursor.execute("PRAGMA freelist_count")
            free = cursor.fetchone()[0]
            return {"total_bytes": (pages - free) * page, "measure": "SQLite pages in use (file minus free list)"}
    return {"measure": f"not measured on {connection.vendor}"}


def _fill(runs: int, chunk: int = 5000) -> None:
    from django.utils import timezone

    from durable_singleton.models import Run, Step

    finished = timezone.now() - timedelta(days=1)
    payload = {"store_id": "A", "items": [{"sku": f"A-{n}", "qty": n} for n in range(3)]}
    for start in range(0, runs, chunk):
        rows, steps = [], []
        for n in range(start, min(start + chunk, runs)):
            run_id = f"purge-{n:07d}"
            rows.append(
                Run(
                    run_id=run_id,
                    workflow_name="sync-inventory",
                    workflow_version="1",
                    status="completed",
                    input={"store_id": "A", "duration": 0},
                    output={"store_id": "A", "reconciled": 3},
                    singleton_key=f"store:{n % 50}",
                    singleton_limit=1,
                    created_at=finished,
                    updated_at=finished,
                    started_at=finished,
                    finished_at=finished,
                    admitted_at=finished,
                    attempts=1,
                )
            )
            for position, name in enumerate(("inventory:fetch", "inventory:reconcile")):
                steps.append(
                    Step(
                        run_id=run_id,
                        position=position,
                        name=name,
                        result=payload,
                        started_at=finished,
                        finished_at=finished,
                    )
                )
        Run.objects.bulk_create(rows)
        Step.objects.bulk_create(steps)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print its JSON report."""
    parser = argparse.ArgumentParser(prog="bench.purge", description=__doc__)
    parser.add_argument("--runs", type=int, default=100_000, help="finished runs to create (default 100000)")
    args = parser.parse_args(argv)
    sqlite_path = Path(__file__).resolve().parent / "purge.sqlite3"
    if not os.environ.get("DATABASE_URL"):
        sqlite_path.unlink(missing_ok=True)
    _setup(sqlite_path)
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from durable_singleton.models import Run, Signal, Step
    from durable_singleton.retention import CHUNK, purge_finished
    from durable_singleton.runtime import get_engine

    call_command("migrate", verbosity=0)
    Step.objects.all().delete()
    Signal.objects.all().delete()
    Run.objects.all()._raw_delete(Run.objects.db)
    started = time.perf_counter()
    _fill(args.runs)
    fill_seconds = time.perf_counter() - started
    before = _sizes()
    started = time.perf_counter()
    report = purge_finished(get_engine(), before=timezone.now())
    seconds = time.perf_counter() - started
    after = _sizes()
    document = {
        "database": connection.vendor,
        "runs": args.runs,
        "fill_seconds": round(fill_seconds, 2),
        "before": before,
        "bytes_per_run": round(before.get("total_bytes", 0) / max(args.runs, 1)),
        "purge": report.as_dict(),
        "purge_seconds": round(seconds, 2),
        "runs_per_second": round(report.runs / seconds) if seconds else None,
        "transactions_of": CHUNK,
        "after": after,
        "left": Run.objects.count(),
    }
    print(json.dumps(document, indent=2))
    sqlite_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
