"""Server time and query counts of the admin's queue pages at scale (issue #5 point 5).

    .venv/bin/python tools/services.py run --pg -- .venv/bin/python bench/admin_bench.py

Migrates the database named by ``DATABASE_URL`` (else ``DS_PG_URL``; use a throwaway one: the
run tables are emptied), fills it with ``--keys`` keys and ``--runs`` runs in the shape the store
leaves them (holders, waiters in line, finished runs, one hot key with a long queue), then
requests each admin page in this process through Django's test client as a logged-in superuser
and reports, per page, the server time (median and slowest of ``--repeat`` requests, after two
warm-up requests), the number of queries and their database time. Results also go to
``bench/results/admin-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
#: (workflow, limit, holders, waiters) per key, in turn; the testproject's registered workflows.
#: The rest of a key's runs (``--runs`` / ``--keys`` in all) are completed.
SHAPES = (
    ("sync-inventory-wide", 2, 2, 4),
    ("sync-inventory", 1, 1, 2),
    ("demo-sync-inventory", 1, 1, 5),
)
HOT_KEY = "store:hot"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="admin_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=10_000, help="keys with active runs (default 10,000)")
    parser.add_argument("--runs", type=int, default=100_000, help="runs in all (default 100,000)")
    parser.add_argument("--hot", type=int, default=2_000, help="waiters on the hot key (default 2,000)")
    parser.add_argument("--repeat", type=int, default=10, help="measured requests per page (default 10)")
    parser.add_argument("--reuse", action="store_true", help="keep the rows already there (skip the fill)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    return parser.parse_args(argv)


def setup_django() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    if not os.environ.get("DATABASE_URL") and os.environ.get("DS_PG_URL"):
        os.environ["DATABASE_URL"] = os.environ["DS_PG_URL"]
    os.environ.setdefault("DURABLE_DISPATCH", "manual")
    import django

    django.setup()


def fill(keys: int, runs: int, hot: int) -> dict[str, Any]:
    """Insert ``runs`` runs over ``keys`` keys plus the hot key; return what a page request needs."""
    from django.db import connection, transaction

    from durable_singleton.models import Run, Signal, SingletonKey, Step

    with transaction.atomic():
        Step.objects.all().delete()
        Signal.objects.all().delete()
        Run.objects.all().delete()
        SingletonKey.objects.all().delete()
    per_key = runs // keys
    batch: list[Run] = []
    key_rows: list[SingletonKey] = []
    written = 0

    def flush() -> None:
        nonlocal written
        Run.objects.bulk_create(batch, batch_size=5_000)
        written += len(batch)
        batch.clear()

    def add(workflow: str, key: str, limit: int, index: int, status: str, slot: str | None, at: datetime) -> None:
        batch.append(
            Run(
                run_id=f"{workflow}:{key}:{index}",
                workflow_name=workflow,
                workflow_version="1",
                status=status,
                input={"store_id": key.removeprefix("store:"), "duration": 1},
                output={"reconciled": 3} if status == "completed" else None,
                singleton_key=key,
                singleton_limit=limit,
                singleton_slot=slot,
                singleton_tracked=slot is not None,
                created_at=at,
                updated_at=at,
                started_at=at if status in ("running", "completed") else None,
                finished_at=at + timedelta(seconds=1) if status == "completed" else None,
                wake_at=at + timedelta(hours=1) if status == "suspended" else None,
                lease_owner="bench:1" if status == "running" else None,
                lease_expires_at=at + timedelta(days=3650) if status == "running" else None,
                attempts=1 if status != "suspended" else 2,
            )
        )

    for n in range(keys):
        workflow, limit, holders, waiters = SHAPES[n % len(SHAPES)]
        key = f"store:{n:05d}"
        at = T0 + timedelta(seconds=n)
        finished = max(per_key - holders - waiters, 0)
        states = (
            [("completed", None)] * finished + [("running", "holder")] * holders + [("suspended", "waiter")] * waiters
        )
        for i, (status, slot) in enumerate(states):
            add(workflow, key, limit, i, status, slot, at + timedelta(milliseconds=i))
        key_rows.append(SingletonKey(workflow_name=workflow, key=key, limit=limit))
        if len(batch) >= 20_000:
            flush()
    hot_states = [("running", "holder")] * 2 + [("suspended", "waiter")] * hot
    for i, (status, slot) in enumerate(hot_states):
        add("sync-inventory-wide", HOT_KEY, 2, i, status, slot, T0 - timedelta(hours=1) + timedelta(milliseconds=i))
    key_rows.append(SingletonKey(workflow_name="sync-inventory-wide", key=HOT_KEY, limit=2))
    flush()
    SingletonKey.objects.bulk_create(key_rows, batch_size=5_000)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    return {"runs": written, "keys": keys + 1}


def database_label(connection: Any) -> str:
    if connection.vendor == "postgresql":
        version = connection.pg_version
        return f"PostgreSQL {version // 10000}.{version % 10000}"
    if connection.vendor == "mysql":
        name = "MariaDB" if connection.mysql_is_mariadb else "MySQL"
        return f"{name} {'.'.join(map(str, connection.mysql_version))}"
    import sqlite3

    return f"SQLite {sqlite3.sqlite_version}"


def measure(client: Any, url: str, repeat: int) -> dict[str, Any]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for _ in range(2):
        assert client.get(url).status_code == 200, url
    times, queries, sql = [], 0, []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            started = time.perf_counter()
            response = client.get(url)
            times.append(time.perf_counter() - started)
        assert response.status_code == 200, url
        queries = len(captured)
        sql.append(sum(float(q["time"]) for q in captured.captured_queries))
    return {
        "url": url,
        "queries": queries,
        "median_ms": round(statistics.median(times) * 1000, 1),
        "max_ms": round(max(times) * 1000, 1),
        "sql_median_ms": round(statistics.median(sql) * 1000, 1),
        "bytes": len(response.content),
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    setup_django()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from durable_singleton.models import Run

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    if args.reuse and Run.objects.exists():
        sizes = {"runs": Run.objects.count(), "keys": None}
    else:
        sizes = fill(args.keys, args.runs, args.hot)
    fill_seconds = time.perf_counter() - started
    active = Run.objects.filter(singleton_slot__isnull=False).count()
    user, _ = get_user_model().objects.get_or_create(
        username="bench-admin", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    queues = reverse("admin:durable_singleton_run_queues")
    key = reverse("admin:durable_singleton_run_queue_key")
    runs = reverse("admin:durable_singleton_run_changelist")
    middle = Run.objects.for_key("sync-inventory-wide", HOT_KEY).waiting().values_list("run_id", flat=True)
    waiter = middle[args.hot // 2]
    hot = {"workflow": "sync-inventory-wide", "key": HOT_KEY}
    pages = {
        "queues (default: most waiting first)": queues,
        "queues sorted by fullness, with waiters": f"{queues}?o=-fullness&only=waiting",
        "queues sorted by oldest waiter": f"{queues}?o=oldest",
        "queues filtered by key text": f"{queues}?q=store:0999",
        "queues, page 50": f"{queues}?p=50",
        f"key page: {HOT_KEY} ({args.hot} waiters)": f"{key}?{urlencode(hot)}",
        f"key page: {HOT_KEY}, waiters page 10": f"{key}?{urlencode({**hot, 'p': 10})}",
        "key page: an ordinary key": f"{key}?{urlencode({'workflow': 'sync-inventory-wide', 'key': 'store:00000'})}",
        "run list": runs,
        "run list filtered by key": f"{runs}?singleton_key={HOT_KEY}",
        f"run page: waiter at position {args.hot // 2 + 1} of {HOT_KEY}": reverse(
            "admin:durable_singleton_run_change", args=[waiter]
        ),
    }
    results = {name: measure(client, url, args.repeat) for name, url in pages.items()}
    report = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "database": database_label(connection),
        "runs": Run.objects.count(),
        "active_runs": active,
        "keys_with_active_runs": sizes["keys"],
        "fill_seconds": round(fill_seconds, 1),
        "repeat": args.repeat,
        "pages": results,
    }
    width = max(len(name) for name in results)
    print(
        f"{report['runs']:,} runs ({active:,} active) over {report['keys_with_active_runs'] or '?'} keys "
        f"on {report['database']}; {args.repeat} requests per page after 2 warm-ups"
    )
    print(f"{'page':<{width}}  queries  median ms  max ms  SQL ms")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['queries']:>7}  {r['median_ms']:>9}  {r['max_ms']:>6}  {r['sql_median_ms']:>6}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"admin-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
