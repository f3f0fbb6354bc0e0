"""Many keys one by one, ours and procrastinate's in turn in the same minutes (issue #31).

``bash bench/run`` measures the peers minutes after our deployments; on a
shared machine the load moves in between. This runs the two in alternating
rounds instead: ``durable_worker`` processes under ``DISPATCH = "worker"``,
then procrastinate's workers (the same slots), each round
``bench.scenarios.many_keys`` against ``bench.peers._many_keys``, and prints
each round's runs per second, the client's milliseconds per start and, from
the server (``pg_stat_wal``, with ``track_wal_io_timing`` turned on), the WAL
bytes, records and flushes per run and the milliseconds per flush, and the CPU
milliseconds per run of the client, the workers' process groups and the
PostgreSQL server (``/proc``: on a shared machine, CPU per run moves less with
the load than runs per second)::

    python tools/services.py run --pg --redis --durable -- python -m bench.many_keys_pair --scale 0.5

Prints one JSON object last: the rounds and the ratio of the sums.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _rounded(value: Any) -> Any:
    """``value`` with its floats to 3 decimals, inside dicts too."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


def main(argv: list[str]) -> int:
    """Measure; return 0."""
    parser = argparse.ArgumentParser(prog="bench.many_keys_pair", description=__doc__)
    parser.add_argument("--scale", type=float, default=0.5, help="of 2,000 runs over 1,000 keys (default 0.5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes of each (default 2)")
    parser.add_argument("--threads", type=int, default=2, help="threads (concurrency) of each process (default 2)")
    args = parser.parse_args(argv)
    pg, redis_url = os.environ["DS_PG_URL"], os.environ["DS_REDIS_URL"]
    os.environ.update(
        {
            "DATABASE_URL": pg,
            "CELERY_BROKER_URL": redis_url,
            "BENCH_REDIS_URL": redis_url,
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "DURABLE_DISPATCH": "worker",
        }
    )
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection

    from durable_singleton.conf import Settings
    from durable_singleton.runtime import build_engine

    from . import peers, scenarios
    from .procs import (
        Proc,
        Procs,
        children_cpu_seconds,
        django_admin_argv,
        durable_worker_argv,
        group_cpu_seconds,
        parent_of,
        wait_until,
    )

    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        cursor.execute("ALTER SYSTEM SET track_wal_io_timing = on")
        cursor.execute("SELECT pg_reload_conf()")
    runs, keys = max(10, int(2000 * args.scale)), max(10, int(1000 * args.scale))
    engine = build_engine(Settings.from_mapping({**settings.DURABLE_SINGLETON, "DISPATCH": "worker"}))
    log_dir = Path(__file__).resolve().parent / "results" / f"logs-pair-{time.strftime('%Y%m%d-%H%M%S')}"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = Procs(dict(os.environ), log_dir)

    def wal() -> tuple[float, ...]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT wal_records, wal_bytes, wal_sync, wal_sync_time FROM pg_stat_wal")
            row = cursor.fetchone()
            cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
            return (*(float(v) for v in row), float(cursor.fetchone()[0]))

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        server = parent_of(int(cursor.fetchone()[0]))

    def cpu(workers: Sequence[Proc]) -> tuple[float, float, float]:
        """CPU seconds so far: this client process, the workers' process groups, the server's."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return (
            usage.ru_utime + usage.ru_stime,
            sum(group_cpu_seconds(w.process.pid) for w in workers),
            children_cpu_seconds(server),
        )

    def measure(name: str, fn: Any, workers: Sequence[Proc]) -> dict[str, Any]:
        time.sleep(0.5)  # pg_stat_wal is flushed by the backends about once a second
        before, load, cpu_before = wal(), os.getloadavg()[0], cpu(workers)
        out = fn()
        cpu_after = cpu(workers)
        time.sleep(1.5)
        after = wal()
        d = [b - a for a, b in zip(before, after, strict=True)]
        c = [(b - a) / runs * 1000 for a, b in zip(cpu_before, cpu_after, strict=True)]
        figures = {
            "runs_per_s": out["runs_per_s"],
            "client_ms_per_start": out["start_seconds"] / runs * 1000,
            "wal_bytes_per_run": d[1] / runs,
            "wal_records_per_run": d[0] / runs,
            "flushes_per_run": d[2] / runs,
            "ms_per_flush": d[3] / d[2] if d[2] else None,
            "commits_per_run": d[4] / runs,
            "cpu_ms_per_run": {"client": c[0], "workers": c[1], "server": c[2]},
            "load_average": load,
        }
        print(name, json.dumps(_rounded(figures)))
        sys.stdout.flush()
        return figures

    def ours() -> dict[str, Any]:
        workers = [
            procs.start(f"durable-worker-{n}", durable_worker_argv(args.threads, 1.0), {"DURABLE_DISPATCH": "worker"})
            for n in range(args.processes)
        ]
        try:
            wait_until(lambda: all(b"ready." in w.log.read_bytes() for w in workers), 120, "durable_worker", every=0.2)
            scenarios.many_keys(engine, 40, 20)  # warm: connections and prepared statements
            return measure("ours", lambda: scenarios.many_keys(engine, runs, keys), workers)
        finally:
            procs.stop(workers)

    def theirs() -> dict[str, Any]:
        argv = ["procrastinate", "worker", "--concurrency", str(args.threads), "--fetch-job-polling-interval", "0.01"]
        workers = [procs.start(f"procrastinate-{n}", django_admin_argv(*argv)) for n in range(args.processes)]
        try:
            peers._warm(peers._pc_enqueue, "pc")
            return measure("procrastinate", lambda: peers._many_keys(peers._pc_enqueue, "pc-many", runs, keys), workers)
        finally:
            procs.stop(workers)

    rounds: dict[str, list[dict[str, Any]]] = {"ours": [], "procrastinate": []}
    with procs.running():
        for _ in range(args.rounds):
            rounds["ours"].append(ours())
            rounds["procrastinate"].append(theirs())
    total = {k: sum(r["runs_per_s"] for r in v) for k, v in rounds.items()}
    print(json.dumps({"runs": runs, "keys": keys, "rounds": rounds, "ratio": total["ours"] / total["procrastinate"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
