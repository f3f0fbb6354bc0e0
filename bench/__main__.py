"""Run every scenario of issue #4 in one run: ``python -m bench`` (``bash bench/run`` starts the services).

Needs ``DS_PG_URL`` (PostgreSQL with pg_stat_statements preloaded) and
``DS_REDIS_URL`` in the environment, as ``tools/services.py run --pg --redis``
exports them. Prints the tables and writes ``bench/results/bench-<stamp>.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCENARIOS = (
    "statements",
    "baseline",
    "handoff",
    "drain",
    "many",
    "lane",
    "backlog",
    "claims",
    "tick",
    "worker",
    "pull",
    "embedded",
    "peers",
    "rooms",
    "depth",
    "debounce",
    "throttle",
)


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(prog="bench", description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size by this (default 1: the issue's)")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument(
        "--workers", type=int, default=2, help="Celery worker processes, and durable_worker processes (default 2)"
    )
    parser.add_argument("--producers", type=int, default=2, help="processes landing the burst on key A (default 2)")
    parser.add_argument(
        "--concurrency", type=int, default=2, help="pool size of each Celery worker, threads of each durable_worker"
    )
    parser.add_argument("--pool", default="prefork", help="Celery pool: prefork, threads or solo (default prefork)")
    parser.add_argument("--tick", type=float, default=1.0, help="tick period in seconds (default 1)")
    parser.add_argument("--djq-poll", type=float, default=0.1, help="dj-queue worker polling interval (default 0.1 s)")
    parser.add_argument("--pc-poll", type=float, default=0.01, help="procrastinate fetch polling interval (0.01 s)")
    parser.add_argument("--trace", action="store_true", help="trace each turn's stages (adds Redis writes)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="results folder")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Run the benchmark; return 0 when every scenario ran (targets missed do not fail the command)."""
    args = parse(argv)
    # tools/services.py forwards SIGTERM: exit through the finally blocks that stop the workers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(SCENARIOS)
    if unknown:
        print(f"bench: unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    pg, redis_url = os.environ.get("DS_PG_URL"), os.environ.get("DS_REDIS_URL")
    if not pg or not redis_url:
        print("bench: DS_PG_URL and DS_REDIS_URL must be set; run: bash bench/run", file=sys.stderr)
        return 2
    os.environ.update(
        {
            "DATABASE_URL": pg,
            "CELERY_BROKER_URL": redis_url,
            "BENCH_REDIS_URL": redis_url,
            "DJANGO_SETTINGS_MODULE": "bench.settings",
            "DURABLE_DISPATCH": "celery",
            "BENCH_TICK_SECONDS": str(args.tick),
            "BENCH_TRACE": "1" if args.trace else "0",
        }
    )
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from rich.console import Console

    from durable_singleton.runtime import get_engine

    from . import audit, peers, report, scenarios, statements
    from .celery_app import app
    from .procs import Procs, celery_beat_argv, celery_worker_argv, wait_until

    console = Console(width=160)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(args.out)
    log_dir = out_dir / f"logs-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()

    def say(message: str) -> None:
        console.print(f"[dim]{time.monotonic() - began:6.1f}s[/dim] {message}")

    say("migrating the benchmark database")
    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        pg_version = cursor.fetchone()[0]
    # Read from the servers, not assumed: what a commit costs depends on them.
    redis_config = audit.client().config_get("appendonly")
    redis_config.update(audit.client().config_get("save"))
    servers = {"postgresql": statements.server_settings(connection), "redis": redis_config}
    say(
        "PostgreSQL "
        + ", ".join(f"{k}={servers['postgresql'][k]}" for k in ("fsync", "synchronous_commit", "full_page_writes"))
    )
    sizes = scenarios.Sizes().scaled(args.scale) if args.scale != 1.0 else scenarios.Sizes()
    sizes.burst_producers = args.producers
    raw: dict[str, Any] = {
        "command": "bash bench/run " + " ".join(argv),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine(),
        "versions": report.versions(pg_version, audit.client().info("server")["redis_version"]),
        "servers": servers,
        "config": {
            "celery": {"workers": args.workers, "concurrency": args.concurrency, "pool": args.pool, "prefetch": 1},
            "tick_seconds": args.tick,
            "conn_max_age": None,
            "db_reuse_max": "CELERY_DB_REUSE_MAX=100000",
        },
        "sizes": vars(sizes),
        "errors": {},
    }
    engine = get_engine()

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        say(f"[bold]{name}[/bold]")
        try:
            result = fn()
        except Exception as exc:
            raw["errors"][name] = f"{type(exc).__name__}: {exc}"
            (log_dir / f"error-{name}.txt").write_text(traceback.format_exc())
            say(f"[red]{name} failed: {exc}[/red]")
            return None
        return result

    if "statements" in only:
        # Before any worker runs: their ticks must not take these runs (another registry's workflows).
        raw["statements"] = attempt("0 round trips per run (python -m bench.statements)", statements.measure)
    if "rooms" in only:
        # The same in-process drain on each database the services give (PostgreSQL, MariaDB with
        # --mysql, SQLite), as ratios to PostgreSQL of this run (issue #32; python -m bench.rooms).
        from . import rooms

        raw["rooms"] = attempt("0 the rooms: PostgreSQL, MariaDB and SQLite in one run", rooms.measure)
    if "depth" in only:
        # Claim and handoff latency at 10 and 100,000 waiters on each database, each database's
        # largest size against its smallest (issue #32; python -m bench.depth).
        from . import depth

        raw["depth"] = attempt(
            "0 depth: claim and handoff at 10 to 100,000 waiters on each database",
            lambda: depth.measure(sizes.depth_sizes),
        )

    if "debounce" in only:
        # No worker needed: the run's quiet period outlasts the scenario (X7).
        raw["debounce"] = attempt("13 debounce: 1,000 starts on one key", lambda: scenarios.debounce_burst(engine))
        if raw["debounce"]:
            say(f"debounce: {raw['debounce']}")

    if "throttle" in only:
        # Before the Celery workers: the scenario runs its own embedded worker, whose registry
        # theirs does not know (X6, #33; python -m bench.throttle).
        from . import throttle

        raw["throttle"] = {
            "claim": attempt("14 throttle: a claim with a throttle against one without", throttle.claim_cost),
            "wake": attempt("14 throttle: the wake at each window's opening", throttle.wake_at_opening),
        }
        say(f"throttle: {raw['throttle']}")

    if "embedded" in only:
        # Before the Celery workers: their ticks would take the runs this process's worker runs.
        raw["embedded"] = attempt(
            "11 DISPATCH thread: one process starts the runs and its embedded worker runs them",
            lambda: embedded_thread(args, sizes),
        )

    env = dict(os.environ)
    with Procs(env, log_dir).running() as procs:
        ours = [
            procs.start(f"celery-{n}", celery_worker_argv(f"bench{n}", args.concurrency, args.pool))
            for n in range(args.workers)
        ]
        workers = list(ours)
        ours.append(procs.start("celery-beat", celery_beat_argv(log_dir / "beat-schedule")))
        wait_until(lambda: len(app.control.ping(timeout=0.5)) >= args.workers, 120, "Celery workers", every=0.5)
        say(f"{args.workers} Celery workers x {args.concurrency} ({args.pool}) and beat are up")

        if "baseline" in only:
            raw["baseline"] = attempt("1 baseline: plain Celery", lambda: scenarios.baseline(sizes))
        if "handoff" in only:
            raw["handoff"] = attempt("2 handoff", lambda: scenarios.hot_key(engine, "handoff", sizes.handoff_runs))
        if "drain" in only:
            raw["drain"] = attempt("3 hot-key drain", lambda: scenarios.hot_key(engine, "drain", sizes.hot_runs))
        if "many" in only:
            raw["many_keys"] = attempt(
                "4 many keys", lambda: scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys)
            )
            raw["many_keys_bulk"] = attempt(
                "4 many keys, bulk start",
                lambda: scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys, bulk=True),
            )
        burst = None
        if "lane" in only or "backlog" in only:
            lane = attempt("6 lane isolation: key B idle", lambda: scenarios.lane_idle(engine, sizes)) or {}
            burst = attempt(
                f"6 lane isolation: key B during a burst of {sizes.backlog} on key A",
                lambda: scenarios.burst(engine, sizes, env),
            )
            if burst is not None:
                lane.update({k: v for k, v in burst.items() if not k.startswith("_")})
            raw["lane"] = lane
        if "backlog" in only and burst is not None:
            time.sleep(3)
            result = attempt(
                f"5 parked backlog: statements over {sizes.backlog_window:.0f} s",
                lambda: scenarios.statement_rate(sizes.backlog_window),
            )
            if result is not None:
                raw["backlog"] = {"waiters": sizes.backlog, **result}
        if "claims" in only:

            def claims() -> dict[str, Any]:
                keys = {}
                for size in sizes.claim_sizes:
                    if burst is not None and size == sizes.backlog:
                        keys[size] = {"key": burst["_key"], "tag": burst["_tag"], "holder": burst["_holder"]}
                    else:
                        say(f"  setting up a key with {size} parked waiters")
                        keys[size] = scenarios.setup_claim_key(engine, size)
                return scenarios.claim_costs(engine, keys, sizes.claim_reps)

            raw["claims"] = attempt("5 claim latency and statements per claim", claims)
        if "tick" in only:
            raw["tick_under_load"] = attempt(
                "9 the tick's period with every worker slot busy (O5)",
                lambda: scenarios.tick_under_load(
                    engine, args.workers * args.concurrency, 20.0, [w.log for w in workers], args.tick
                ),
            )
        if "baseline" in only:
            raw["baseline_end"] = attempt("1 baseline again (noise check)", lambda: scenarios.baseline(sizes))
        procs.stop(ours)

        if "worker" in only:
            raw["worker"] = attempt(
                "8 the embedded worker: manage.py durable_worker, no Celery",
                lambda: embedded_worker(procs, args, sizes, raw),
            )

        if "pull" in only:
            raw["pull"] = attempt(
                "9 durable_worker with DISPATCH worker: turns taken from the database, no Celery",
                lambda: embedded_worker(procs, args, sizes, raw, dispatch="worker"),
            )

        if "peers" in only:
            slots = args.workers * args.concurrency
            raw["peers"] = {}
            djq = attempt(
                "7 dj-queue",
                lambda: peers.dj_queue(
                    procs,
                    args.workers,
                    args.concurrency,
                    args.djq_poll,
                    sizes.peer_hot_runs,
                    sizes.peer_many_runs,
                    sizes.peer_many_keys,
                ),
            )
            if djq is not None:
                raw["peers"]["dj_queue"] = djq
            pc = attempt(
                "7 procrastinate",
                lambda: peers.procrastinate(
                    procs,
                    args.workers,
                    args.concurrency,
                    args.pc_poll,
                    sizes.peer_hot_runs,
                    sizes.peer_many_runs,
                    sizes.peer_many_keys,
                ),
            )
            if pc is not None:
                raw["peers"]["procrastinate"] = pc
            raw["config"]["peer_slots"] = slots

    raw["machine"]["load_average_end"] = os.getloadavg()
    raw["seconds"] = time.monotonic() - began
    found = report.targets(raw)
    report.render(raw, found, console)
    path = report.write(raw, found, out_dir, stamp)
    say(f"wrote {path} (logs in {log_dir})")
    return 1 if raw["errors"] else 0


def embedded_worker(
    procs: Any, args: argparse.Namespace, sizes: Any, raw: dict[str, Any], *, dispatch: str = "thread"
) -> dict[str, Any]:
    """Scenarios 2 to 4 (and 6's idle key, the commit-to-body delay of a run
    started in this process) on ``manage.py durable_worker`` processes,
    Celery stopped; ``dispatch`` is their ``DISPATCH`` and this process's.

    ``args.workers`` processes of ``args.concurrency`` threads: the same slots
    as the Celery workers. ``"thread"``: this process starts the runs with an
    engine whose embedded worker is not started (as a script or a web process
    without workers): a start sends nothing, and the workers' tick picks the
    run up once its ``wake_at`` passes (REDELIVERY_SECONDS after the start,
    S8, O1). ``"worker"``: a start writes a turn notice in its transaction,
    and the workers take it at once (LISTEN/NOTIFY on PostgreSQL, O7).
    Handoffs happen inside the workers.
    """
    from django.conf import settings as django_settings

    from durable_singleton.conf import Settings
    from durable_singleton.runtime import build_engine

    from . import scenarios
    from .procs import durable_worker_argv, wait_until

    conf = Settings.from_mapping({**django_settings.DURABLE_SINGLETON, "DISPATCH": dispatch})
    engine = build_engine(conf)
    extra = {"DURABLE_DISPATCH": dispatch}
    workers = [
        procs.start(f"durable-worker-{n}", durable_worker_argv(args.concurrency, args.tick), extra)
        for n in range(args.workers)
    ]
    try:
        wait_until(
            lambda: (
                all(w.alive() and b"ready." in w.log.read_bytes() for w in workers)
                or any(not w.alive() for w in workers)
            ),
            120,
            "durable_worker processes",
            every=0.2,
        )
        dead = [w.name for w in workers if not w.alive()]
        if dead:
            raise RuntimeError(f"durable_worker exited at start: {', '.join(dead)} (see its log)")
        out: dict[str, Any] = {
            "config": {
                "processes": args.workers,
                "threads": args.concurrency,
                "tick_seconds": args.tick,
                "redelivery_seconds": conf.REDELIVERY_SECONDS,
                "client": (
                    "DISPATCH thread, embedded worker not started"
                    if dispatch == "thread"
                    else "DISPATCH worker, writes turn notices"
                ),
            }
        }
        out["lane"] = scenarios.lane_idle(engine, sizes)
        out["handoff"] = scenarios.hot_key(engine, "w-handoff", sizes.handoff_runs)
        out["drain"] = scenarios.hot_key(engine, "w-drain", sizes.hot_runs)
        out["many_keys"] = scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys)
        out["many_keys_bulk"] = scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys, bulk=True)
        if dispatch == "worker" and len(workers) >= 2:
            # Last: it kills one of the workers (O6 at the default settings).
            out["killed"] = scenarios.killed_worker_reentry(engine, workers)
        return out
    finally:
        procs.stop(workers)


def embedded_thread(args: argparse.Namespace, sizes: Any) -> dict[str, Any]:
    """``DISPATCH = "thread"`` as a single-process deployment runs it: this process
    starts the runs and its own embedded worker (``ThreadDispatcher``, ``args.workers x
    args.concurrency`` threads: the Celery workers' slots, and the peers') runs them,
    each start's turn sent to a thread of this process (no broker, no notice row). The
    idle key's start to body (scenario 6's probe) and many keys one by one (scenario 4);
    every body audited. Celery workers must not run meanwhile (their ticks would take
    the runs)."""
    from django.conf import settings as django_settings

    from durable_singleton.conf import Settings
    from durable_singleton.runtime import build_engine

    from . import scenarios

    slots = args.workers * args.concurrency
    conf = Settings.from_mapping({**django_settings.DURABLE_SINGLETON, "DISPATCH": "thread", "WORKER_THREADS": slots})
    engine = build_engine(conf)
    engine.dispatcher.start()  # type: ignore[attr-defined]  # a ThreadDispatcher
    try:
        return {
            "config": {"threads": slots, "tick_seconds": conf.TICK_SECONDS, "processes": 1},
            "lane": scenarios.lane_idle(engine, sizes),
            "many_keys": scenarios.many_keys(engine, sizes.many_runs, sizes.many_keys),
        }
    finally:
        engine.dispatcher.stop(timeout=30)  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
