"""Scale of ``DISPATCH = "worker"`` (issue 31, O1): 1, 2 and 4 ``durable_worker`` processes on one database.

Run it with the throwaway servers (Redis holds the bodies' audit)::

    python tools/services.py run --pg --mysql --redis --durable -- python -m bench.scale --scale 0.5

For each database given (``--databases``, default ``pg,mysql,sqlite``; SQLite is
a file in the logs folder) and each process count (``--processes``, default
``1,2,4``), in one run: start that many ``manage.py durable_worker --threads T``
processes with ``DISPATCH = "worker"``, measure the delay from a start's commit
in this process to its body's entry on an idle key, the tick's period while
bodies hold every worker thread (O5), the hot-key drain (one key, limit 1:
serial by rule, so it shows the fetch adds no wait, not a speed-up), many keys
(runs started with ``start_many`` before the workers could take them all, so the
workers' throughput is measured, not the client's start rate), audit every body
(no key ever above its limit 1) and, at the first count of two or more, the
delay from a kill -9 of the worker holding a run to its body entered again in
another (O6, at the default ``WORKER_DEAD_SECONDS``), then stop them. Prints,
per database, runs/s and the ratios 2/1 and 4/1 of each scenario; a ratio near 1
or below on many keys would mean the workers wait on one another. Writes
``bench/results/scale-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="bench.scale", description=__doc__)
    parser.add_argument(
        "--databases", default="pg,mysql,sqlite", help="comma-separated: pg, mysql, sqlite (default all three)"
    )
    parser.add_argument("--processes", default="1,2,4", help="durable_worker process counts (default 1,2,4)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each durable_worker (default 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size by this (default 1)")
    parser.add_argument("--tick", type=float, default=1.0, help="tick period in seconds (default 1)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, counts: list[int], log_dir: Path) -> dict[str, Any]:
    """Run drain and many keys on this process's database for each process count."""
    from django.core.management import call_command

    from durable_singleton.conf import Settings
    from durable_singleton.runtime import build_engine

    from . import scenarios
    from .procs import Procs, durable_worker_argv, wait_until

    call_command("migrate", verbosity=0, interactive=False)
    from django.conf import settings as django_settings

    engine = build_engine(Settings.from_mapping({**django_settings.DURABLE_SINGLETON, "DISPATCH": "worker"}))
    sizes = scenarios.Sizes().scaled(args.scale) if args.scale != 1.0 else scenarios.Sizes()
    out: dict[str, Any] = {}
    with Procs(dict(os.environ), log_dir).running() as procs:
        for count in counts:
            workers = [
                procs.start(
                    f"{os.environ['BENCH_DB']}-{count}-worker-{n}",
                    durable_worker_argv(args.threads, args.tick),
                    {"DURABLE_DISPATCH": "worker"},
                )
                for n in range(count)
            ]
            try:
                wait_until(
                    lambda ws=workers: (
                        all(w.alive() and b"ready." in w.log.read_bytes() for w in ws)  # type: ignore[misc]
                        or any(not w.alive() for w in ws)
                    ),
                    120,
                    "durable_worker processes",
                    every=0.2,
                )
                if any(not w.alive() for w in workers):
                    raise RuntimeError("a durable_worker exited at start (see its log)")
                out[str(count)] = {
                    # The commit-to-body delay of a run started in this process on an idle key (O1, O7):
                    # LISTEN/NOTIFY on PostgreSQL, the workers' short poll elsewhere.
                    "commit_to_body": scenarios.lane_idle(engine, sizes)["idle"],
                    "tick_busy": scenarios.tick_under_load_pull(engine, count * args.threads, 10.0, args.tick),
                    "drain": scenarios.hot_key(engine, f"s{count}-drain", sizes.hot_runs),
                    "many_keys": scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys, bulk=True),
                }
                if count >= 2 and not any("killed" in found for found in out.values()):
                    # Once, last for this count: it kills one of the workers (O6 at the default settings).
                    out[str(count)]["killed"] = scenarios.killed_worker_reentry(engine, workers)
            finally:
                procs.stop(workers)
    return out


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Return runs/s, the ratio to one process and the concurrency audit, per scenario and count."""
    table: dict[str, Any] = {}
    for scenario in ("drain", "many_keys"):
        one = results.get("1", {}).get(scenario, {}).get("runs_per_s")
        rows = {}
        for count, found in results.items():
            rate = found[scenario]["runs_per_s"]
            rows[count] = {
                "runs_per_s": round(rate, 1),
                "ratio_to_1": round(rate / one, 2) if one else None,
                "max_per_key": found[scenario]["concurrency"]["max_seen"],
                "keys_over_limit": found[scenario]["concurrency"]["keys_over_limit"],
            }
        table[scenario] = rows
    return table


def main(argv: list[str]) -> int:
    """Measure each database in a child process of its own (Django's settings are per process)."""
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    counts = [int(n) for n in args.processes.split(",") if n.strip()]
    if os.environ.get("BENCH_DB"):  # the child: one database
        log_dir = Path(os.environ["BENCH_LOG_DIR"])
        import django

        django.setup()
        results = measure(args, counts, log_dir)
        Path(os.environ["BENCH_RESULT"]).write_text(json.dumps(results))
        return 0
    import subprocess

    redis_url = os.environ.get("DS_REDIS_URL")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out)
    log_dir = out_dir / f"logs-scale-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    urls = {
        "pg": os.environ.get("DS_PG_URL"),
        "mysql": os.environ.get("DS_MYSQL_URL"),
        "sqlite": f"sqlite:///{log_dir.resolve() / 'scale.sqlite3'}",  # a file the worker processes share
    }
    report: dict[str, Any] = {"command": "python -m bench.scale " + " ".join(argv), "threads": args.threads}
    for db in [d.strip() for d in args.databases.split(",") if d.strip()]:
        if not urls.get(db) or not redis_url:
            print(f"bench.scale: {db} needs DS_{db.upper()}_URL and DS_REDIS_URL (tools/services.py)", file=sys.stderr)
            return 2
        result = log_dir / f"{db}.json"
        env = {
            **os.environ,
            "BENCH_DB": db,
            "BENCH_LOG_DIR": str(log_dir),
            "BENCH_RESULT": str(result),
            "BENCH_PEERS": "0",
            "DATABASE_URL": urls[db] or "",
            "CELERY_BROKER_URL": redis_url,
            "BENCH_REDIS_URL": redis_url,
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "DURABLE_DISPATCH": "worker",
            "BENCH_TICK_SECONDS": str(args.tick),
            "BENCH_TRACE": "0",
        }
        code = subprocess.call([sys.executable, "-m", "bench.scale", *argv], env=env)
        if code:
            print(f"bench.scale: {db} failed ({code}); logs in {log_dir}", file=sys.stderr)
            return code
        report[db] = ratios(json.loads(result.read_text()))
        report[f"{db}_raw"] = json.loads(result.read_text())
    path = out_dir / f"scale-{stamp}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    for db in urls:
        if db not in report:
            continue
        for count, found in report[f"{db}_raw"].items():
            delay, tick = found["commit_to_body"], found["tick_busy"]
            print(f"{db:6} commit to body, idle key, {count} process(es): {json.dumps(delay)}")
            print(f"{db:6} tick period, every thread busy, {count} process(es): {json.dumps(tick)}")
            if "killed" in found:
                print(f"{db:6} kill -9 of one of {count} workers, body entered again: {json.dumps(found['killed'])}")
        for scenario, rows in report[db].items():
            for count, row in rows.items():
                print(
                    f"{db:6} {scenario:10} {count} x {args.threads} threads: {row['runs_per_s']:8.1f} runs/s"
                    f"  x{row['ratio_to_1']} of 1 process  max per key {row['max_per_key']}"
                    f"  over limit {row['keys_over_limit'] or 'none'}"
                )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
