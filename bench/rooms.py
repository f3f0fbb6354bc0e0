"""The same work on PostgreSQL, MariaDB and SQLite in one run, as ratios to PostgreSQL (issue #32).

``python -m bench.rooms`` under ``tools/services.py run --pg --mysql --durable``
(``DS_PG_URL`` and ``DS_MYSQL_URL`` in the environment; SQLite is a file in a
temporary folder). For each database, in one process each, on the manual
dispatcher with every queued turn run through ``Engine.execute_chain`` as a
Celery worker's task runs it (as :mod:`bench.statements` does):

* ``drain``: a hot key (limit 1) whose holder is parked behind ``waiters``
  waiters; the holder is signalled and the queue drained on this thread; the
  figure is waiters admitted and completed per second (each settle hands the
  slot to the next waiter, S7), and per drained run the wall milliseconds, this
  process's CPU milliseconds and the server's (a PostgreSQL connection's
  backend; MariaDB's whole server process, background threads included);
* ``idle``: runs started and completed one after another, each on a key
  nobody holds (start, claim with admission, settle), per second.

The rounds go round the databases in turn (PostgreSQL, MariaDB, SQLite,
PostgreSQL, ...) so the machine's noise falls on each alike, and each round is
a fresh process (its first chain is a warm-up, not counted). Reported: the
median per database, and each database's ratio to PostgreSQL's median of the
same run. The servers' durability settings are recorded (the issue's figures
want PostgreSQL with fsync on and MariaDB flushing at every commit: start
the services with ``--durable``).

Prints one JSON object; ``--out FILE`` also writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from .scratch import scratch_database


def one(waiters: int, idle: int) -> dict[str, Any]:
    """Measure one round on the DATABASE_URL database and return its figures (see the module docstring)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from durable_singleton.definitions import Registry
    from durable_singleton.testing import make_engine

    from .statements import server_settings

    call_command("migrate", verbosity=0)
    registry = Registry()

    def keyed(ctx: Any, i: dict[str, Any]) -> None:
        if i.get("park"):
            ctx.wait_for_signal("go")  # a holder parked with its slot (D2, S6)

    registry.add("keyed", "1", keyed, singleton={"key": lambda i: i["k"]})
    engine = make_engine("django", registry=registry)
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]

    def drain() -> None:
        while queued:
            engine.execute_chain(queued.popleft())

    tag = f"{os.getpid()}-{os.urandom(3).hex()}"

    server_pid = _server_pid(connection)
    cpu: dict[str, float] = {}

    def hot(n: int, name: str) -> float:
        key = f"hot-{tag}-{name}"
        holder = engine.start("keyed", {"k": key, "park": True}).run_id
        drain()
        ids = [engine.start("keyed", {"k": key}).run_id for _ in range(n)]
        drain()
        client, server = time.process_time(), _cpu_seconds(server_pid)
        started = time.perf_counter()
        engine.signal(holder, "go")
        drain()
        seconds = time.perf_counter() - started
        cpu.update(
            wall=seconds * 1000 / n,
            client=(time.process_time() - client) * 1000 / n,
            server=(_cpu_seconds(server_pid) - server) * 1000 / n if server_pid else 0.0,
        )
        statuses = {engine.get(r).status for r in [holder, *ids]}
        assert statuses == {"completed"}, statuses
        return n / seconds

    hot(max(2, waiters // 10), "warm-up")
    drain_rate = hot(waiters, "measured")
    drain_ms = {part: round(ms, 3) for part, ms in cpu.items()}
    started = time.perf_counter()
    for n in range(idle):
        engine.start("keyed", {"k": f"idle-{tag}-{n}"})
        drain()
    idle_rate = idle / (time.perf_counter() - started)
    return {
        "vendor": connection.vendor,
        "server": server_settings(connection),
        "drain_runs_per_second": round(drain_rate, 1),
        "drain_ms_per_run": drain_ms,
        "idle_runs_per_second": round(idle_rate, 1),
    }


def _server_pid(connection: Any) -> int | None:
    """The process whose CPU is the server's work for this connection, on this machine: a
    PostgreSQL connection's backend, MariaDB's server process (every thread of it, its
    background threads too); None on SQLite (in this process) or a server elsewhere."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_backend_pid()")
            pid = int(cursor.fetchone()[0])
        elif connection.vendor == "mysql":
            cursor.execute("SELECT @@pid_file")
            try:
                with open(cursor.fetchone()[0]) as handle:
                    pid = int(handle.read().strip())
            except (OSError, ValueError):
                return None
        else:
            return None
    return pid if os.path.exists(f"/proc/{pid}/stat") else None


def _cpu_seconds(pid: int | None) -> float:
    """The CPU seconds of process ``pid`` so far (:func:`bench.procs.process_cpu_seconds`); 0 for None."""
    from .procs import process_cpu_seconds

    return 0.0 if pid is None else process_cpu_seconds(pid)


def measure(rounds: int = 3, waiters: int = 200, idle: int = 100) -> dict[str, Any]:
    """Run ``rounds`` rounds on each database in turn, a fresh process each; return medians and ratios.

    ``waiters``: waiters drained per round; ``idle``: idle-key runs per round.
    Raises ``RuntimeError`` when a round's process fails.
    """
    urls = {"postgresql": os.environ.get("DS_PG_URL"), "mysql": os.environ.get("DS_MYSQL_URL")}
    with tempfile.TemporaryDirectory(prefix="ds-rooms-") as folder, contextlib.ExitStack() as scratch:
        # A database of its own on each server: the runs it leaves are no later scenario's.
        urls = {v: scratch.enter_context(scratch_database(u, "ds_bench_rooms")) if u else u for v, u in urls.items()}
        urls["sqlite"] = f"sqlite:///{folder}/rooms.sqlite3"
        present = {vendor: url for vendor, url in urls.items() if url}
        per: dict[str, list[dict[str, Any]]] = {vendor: [] for vendor in present}
        for _ in range(rounds):
            for vendor, url in present.items():
                # The peers' apps (bench.settings under python -m bench) migrate on PostgreSQL only.
                env = {**os.environ, "DATABASE_URL": url, "BENCH_PEERS": "0"}
                done = subprocess.run(
                    [sys.executable, "-m", "bench.rooms", "--one", "--waiters", str(waiters), "--idle", str(idle)],
                    env=env,
                    capture_output=True,
                    text=True,
                    cwd=os.getcwd(),
                    check=False,
                )
                if done.returncode:
                    raise RuntimeError(f"the {vendor} round failed:\n{done.stderr[-3000:]}")
                per[vendor].append(json.loads(done.stdout.strip().splitlines()[-1]))
    out: dict[str, Any] = {"rounds": rounds, "waiters": waiters, "idle": idle, "databases": {}}
    for vendor, figures in per.items():
        out["databases"][vendor] = {
            "server": figures[0]["server"],
            "drain_runs_per_second": statistics.median(f["drain_runs_per_second"] for f in figures),
            # Milliseconds per drained run: wall, this process's CPU, the server's CPU (the median
            # of each over the rounds; what is left of the wall is waiting, for a flush mostly).
            "drain_ms_per_run": {
                part: round(statistics.median(f["drain_ms_per_run"][part] for f in figures), 3)
                for part in ("wall", "client", "server")
            },
            "idle_runs_per_second": statistics.median(f["idle_runs_per_second"] for f in figures),
        }
    base = out["databases"].get("postgresql")
    if base:
        for figures in out["databases"].values():
            figures["drain_ratio_to_postgresql"] = round(
                figures["drain_runs_per_second"] / base["drain_runs_per_second"], 2
            )
            figures["idle_ratio_to_postgresql"] = round(
                figures["idle_runs_per_second"] / base["idle_runs_per_second"], 2
            )
    return out


def main(argv: list[str]) -> int:
    """``python -m bench.rooms [--rounds N] [--waiters N] [--idle N] [--out FILE]``; prints JSON."""
    sys.path.insert(0, os.getcwd())
    parser = argparse.ArgumentParser(prog="python -m bench.rooms", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per database (default 3)")
    parser.add_argument("--waiters", type=int, default=200, help="waiters drained per round (default 200)")
    parser.add_argument("--idle", type=int, default=100, help="idle-key runs per round (default 100)")
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.waiters, args.idle)))
        return 0
    result = measure(args.rounds, args.waiters, args.idle)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
