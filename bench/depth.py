"""Claim, handoff and start latency at 10, 10,000 and 100,000 waiters on one key, on
PostgreSQL, MariaDB and SQLite in one run, as ratios to the same database's time at the
smallest size (issue #32: "claim and handoff at 100,000 waiters <= 1.2x their time at 10,
on every database").

``python -m bench.depth`` under ``tools/services.py run --pg --mysql``
(``DS_PG_URL`` and ``DS_MYSQL_URL`` in the environment; SQLite is a file in a
temporary folder). For each database, in a fresh process, on the manual dispatcher:

* a key per size (``--sizes``, default 10, 10,000 and 100,000) with a parked holder
  (limit 1, waiting for its signal) and that many parked waiters, copied by one
  ``INSERT ... SELECT`` (:func:`copy_runs`), beside ``--other-keys`` keys of one
  finished run each (the statistics a many-keys workload leaves), then ANALYZE;
* ``claim``: ``begin_turn`` of the key's last waiter, parked again behind the holder
  (S5, the denial path), ``--reps`` times per size;
* ``handoff``: the holder's last turn (signalled: its claim, its body ends, its settle
  and the handoff that admits the oldest waiter, S7), ``--handoffs`` times per size;
  ``confirmation``: the admitted waiter's first turn (it parks holding the slot, the
  next holder); ``start``: a new waiter's start at the back of the queue (S8a), which
  keeps the depth constant.

Sizes are interleaved so they share the machine's noise. Reported per database: the
median milliseconds of each step at each size, and each step's ratio of its median at
the largest size to its median at the smallest. Prints one JSON object; ``--out FILE``
also writes it.
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

#: The steps measured at each size, in the order they are reported.
STEPS = ("claim", "handoff", "confirmation", "start")


def copy_runs(connection: Any, source: str, count: int, run_id: str, key: str | None = None) -> None:
    """Insert ``count`` copies of the run ``source`` on ``connection`` (a Django connection of
    PostgreSQL, MariaDB/MySQL or SQLite) in one statement: copy n (0 .. count - 1) has the id
    ``run_id`` || n, ``key`` || n as its key when ``key`` is given, and a ``created_at`` n + 1
    microseconds (SQLite: milliseconds) after the source's (behind it in its queue, S5)."""
    from durable_singleton.models import Run

    vendor = connection.vendor
    quote = connection.ops.quote_name
    count = int(count)
    if count <= 0:
        return
    if vendor == "postgresql":
        numbers = f"(SELECT generate_series(0, {count - 1}) AS i)"
        concat = "%s || n.i::text"
        later = "r.created_at + (n.i + 1) * interval '1 microsecond'"
    elif vendor == "mysql":
        digit = " UNION ALL ".join(f"SELECT {d}" + (" AS d" if d == 0 else "") for d in range(10))
        digits = max(1, len(str(count - 1)))
        terms = " + ".join(f"{10**p} * d{p}.d" for p in range(digits))
        tables = ", ".join(f"({digit}) d{p}" for p in range(digits))
        numbers = f"(SELECT {terms} AS i FROM {tables})"  # no recursive CTE: MySQL 8 stops one at 1,000
        concat = "CONCAT(%s, n.i)"
        later = "r.created_at + INTERVAL (n.i + 1) MICROSECOND"
    elif vendor == "sqlite":
        recursive = f"WITH RECURSIVE c(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM c WHERE i < {count - 1})"
        numbers = f"({recursive} SELECT i FROM c)"
        concat = "%s || n.i"
        later = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', r.created_at, '+' || ((n.i + 1) / 1000.0) || ' seconds') || '000'"
    else:
        raise ValueError(f"copy_runs: no copy for the {vendor!r} database")
    table = quote(Run._meta.db_table)
    columns = [f.column for f in Run._meta.concrete_fields]
    values = []
    params: list[Any] = []
    for c in columns:
        if c == "run_id":
            values.append(concat)
            params.append(run_id)
        elif c == "singleton_key" and key is not None:
            values.append(concat)
            params.append(key)
        elif c == "created_at":
            values.append(later)
        else:
            values.append(f"r.{quote(c)}")
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(quote(c) for c in columns)})"
            f" SELECT {', '.join(values)} FROM {table} r, {numbers} n WHERE r.run_id = %s AND n.i < {count}",
            [*params, source],
        )


def analyze(connection: Any) -> None:
    """Refresh the planner's statistics of the run table (ANALYZE on each database)."""
    from durable_singleton.models import Run

    table = connection.ops.quote_name(Run._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()
        elif connection.vendor == "sqlite":
            cursor.execute("ANALYZE")
        else:
            cursor.execute(f"ANALYZE {table}")


def one(sizes: list[int], reps: int, handoffs: int, other_keys: int) -> dict[str, Any]:
    """Measure one database (DATABASE_URL) and return its figures (see the module docstring)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from durable_singleton.definitions import Registry
    from durable_singleton.models import Run
    from durable_singleton.testing import make_engine

    from .statements import server_settings

    call_command("migrate", verbosity=0)
    registry = Registry()
    registry.add("deep", "1", lambda ctx, i: ctx.wait_for_signal("go"), singleton={"key": lambda i: i["k"]})
    engine = make_engine("django", registry=registry)
    engine.now()
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    store = engine.store
    tag = f"{os.getpid()}-{os.urandom(3).hex()}"
    set_up = time.perf_counter()

    # The many keys of one finished run each.
    many = f"many-{tag}"
    engine.start("deep", {"k": many}, run_id=many)
    engine.execute(many)
    engine.signal(many, "go", 1)
    engine.execute(many)
    copy_runs(connection, many, other_keys, run_id=f"{many}-", key=f"{many}-")
    keys: dict[int, dict[str, str]] = {}
    for size in sizes:
        key = f"deep-{tag}-{size}"
        holder, first = f"{key}-holder", f"{key}-first"
        engine.start("deep", {"k": key}, run_id=holder)
        engine.execute(holder)
        engine.start("deep", {"k": key}, run_id=first)
        engine.execute(first)
        copy_runs(connection, first, size - 2, run_id=f"{key}-w-")
        tail = engine.start("deep", {"k": key}).run_id
        keys[size] = {"key": key, "holder": holder, "tail": tail}
    queued.clear()
    analyze(connection)
    for size, info in keys.items():
        waiting = Run.objects.filter(singleton_key=info["key"], singleton_slot="waiter").count()
        assert waiting == size, (size, waiting)
    set_up = time.perf_counter() - set_up

    settings = engine.settings
    limits, retry = engine.limits(), engine._retry_policy()
    times: dict[int, dict[str, list[float]]] = {size: {step: [] for step in STEPS} for size in sizes}

    def claim(size: int, n: int) -> None:
        """The key's last waiter claims and is parked again behind the holder (S5)."""
        began = time.perf_counter()
        turn = store.begin_turn(
            keys[size]["tail"],
            f"bench-depth:{n}",
            lease_seconds=settings.LEASE_SECONDS,
            limits=limits,
            max_recoveries=settings.MAX_RECOVERIES,
            retry=retry,
        )
        if n:  # the first round warms up, not counted
            times[size]["claim"].append((time.perf_counter() - began) * 1000)
        assert turn.state.name == "PARKED", turn.state

    def handoff(size: int, n: int) -> None:
        """The holder's last turn hands the slot to the oldest waiter (S7), whose first turn
        parks it holding the slot; a new waiter's start keeps the depth (S8a)."""
        info = keys[size]
        engine.signal(info["holder"], "go", n)
        queued.clear()
        began = time.perf_counter()
        engine.execute(info["holder"])
        confirmed = time.perf_counter()
        (info["holder"],) = Run.objects.filter(singleton_key=info["key"], singleton_slot="holder").values_list(
            "run_id", flat=True
        )
        queued.clear()
        admitted = time.perf_counter()
        engine.execute(info["holder"])
        started = time.perf_counter()
        engine.start("deep", {"k": info["key"]})
        ended = time.perf_counter()
        queued.clear()
        times[size]["handoff"].append((confirmed - began) * 1000)
        times[size]["confirmation"].append((started - admitted) * 1000)
        times[size]["start"].append((ended - started) * 1000)

    for n in range(reps + 1):
        for size in sizes:
            claim(size, n)
    for n in range(handoffs):
        for size in sizes:
            handoff(size, n)
    for size, info in keys.items():
        waiting = Run.objects.filter(singleton_key=info["key"], singleton_slot="waiter").count()
        assert waiting == size, (size, waiting)
    return {
        "vendor": connection.vendor,
        "server": server_settings(connection),
        "set_up_seconds": round(set_up, 1),
        "ms": {str(size): {step: statistics.median(times[size][step]) for step in STEPS} for size in sizes},
    }


def measure(
    sizes: tuple[int, ...] = (10, 10_000, 100_000), reps: int = 40, handoffs: int = 20, other_keys: int = 20_000
) -> dict[str, Any]:
    """Measure every database present (``DS_PG_URL``, ``DS_MYSQL_URL``, SQLite always), each in a
    fresh process; return the medians (ms) and each step's ratio of its largest size to its smallest.

    ``sizes``: waiters on each key; ``reps``: claims per size; ``handoffs``: handoffs (and
    confirmations and starts) per size; ``other_keys``: keys of one finished run each.
    A database whose process fails has its error's last lines under ``errors``; raises
    ``RuntimeError`` when every database's process failed.
    """
    urls = {"postgresql": os.environ.get("DS_PG_URL"), "mysql": os.environ.get("DS_MYSQL_URL")}
    out: dict[str, Any] = {
        "sizes": list(sizes),
        "reps": reps,
        "handoffs": handoffs,
        "other_keys": other_keys,
        "databases": {},
    }
    with tempfile.TemporaryDirectory(prefix="ds-depth-") as folder, contextlib.ExitStack() as scratch:
        # A database of its own on each server: the runs it leaves are no later scenario's.
        urls = {v: scratch.enter_context(scratch_database(u, "ds_bench_depth")) if u else u for v, u in urls.items()}
        urls["sqlite"] = f"sqlite:///{folder}/depth.sqlite3"
        for vendor, url in urls.items():
            if not url:
                continue
            argv = [sys.executable, "-m", "bench.depth", "--one", "--sizes", ",".join(map(str, sizes))]
            argv += ["--reps", str(reps), "--handoffs", str(handoffs), "--other-keys", str(other_keys)]
            done = subprocess.run(
                argv,
                # The peers' apps (bench.settings under python -m bench) migrate on PostgreSQL only.
                env={**os.environ, "DATABASE_URL": url, "BENCH_PEERS": "0"},
                capture_output=True,
                text=True,
                cwd=os.getcwd(),
                check=False,
            )
            if done.returncode:
                out.setdefault("errors", {})[vendor] = done.stderr[-3000:]
                continue
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            small, big = figures["ms"][str(min(sizes))], figures["ms"][str(max(sizes))]
            figures["ratio_largest_to_smallest"] = {step: round(big[step] / small[step], 2) for step in STEPS}
            figures["ms"] = {s: {k: round(v, 3) for k, v in m.items()} for s, m in figures["ms"].items()}
            out["databases"][vendor] = figures
    if not out["databases"]:
        raise RuntimeError(f"every depth run failed: {out.get('errors')}")
    return out


def main(argv: list[str]) -> int:
    """``python -m bench.depth [--sizes 10,10000,100000] [--reps N] [--handoffs N] [--other-keys N] [--out FILE]``."""
    sys.path.insert(0, os.getcwd())
    parser = argparse.ArgumentParser(prog="python -m bench.depth", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,10000,100000", help="waiters per key, comma-separated")
    parser.add_argument("--reps", type=int, default=40, help="claims per size (default 40)")
    parser.add_argument("--handoffs", type=int, default=20, help="handoffs per size (default 20)")
    parser.add_argument("--other-keys", type=int, default=20_000, help="keys of one finished run (default 20000)")
    parser.add_argument("--out", help="also write the JSON to this file")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if min(sizes) < 2:
        parser.error("--sizes: each key needs at least 2 waiters")
    if args.one:
        print(json.dumps(one(sizes, args.reps, args.handoffs, args.other_keys)))
        return 0
    result = measure(tuple(sizes), args.reps, args.handoffs, args.other_keys)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
