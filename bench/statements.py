"""Round trips per run, start to settle, no steps (issues #8 and #17), on the DATABASE_URL database.

``python -m bench.statements`` (SQLite), or under ``tools/services.py run --pg --mysql``
with ``DATABASE_URL=$DS_PG_URL`` / ``$DS_MYSQL_URL``. Counts the round trips
the connection makes to its database (:mod:`bench.roundtrips`: on the
connection itself, so raw cursor statements and the driver's own BEGIN,
COMMIT and ``SET autocommit`` are counted, not only what Django's cursor
wrapper logs), for three kinds of run, each executed on this thread with
the manual dispatcher, each queued turn through ``Engine.execute_chain``
as ``durable_singleton.tasks.execute_run`` runs it in a Celery worker:

* ``plain``: a run without a key (median of ``runs``);
* ``idle key``: a singleton run on a key nobody holds: start, claim with
  admission, settle (median of ``runs``);
* ``handoff-admitted``: a singleton run that waits behind a holder and is
  admitted by its predecessor's handoff: its start deep in the queue, its
  share of the predecessor's settle and grant, its confirmation and its own
  settle. Measured as the difference between two chains on fresh keys, one of
  ``runs`` waiters and one of ``runs // 2``, each counted from the first
  waiter's start to the end of the drain after the parked holder is
  signalled: the holder's own turns and the first waiter's first turn cancel
  out, what is left is the marginal cost of one more waiter in a drain.

Prints one JSON object; docs/benchmarks.rst has the table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def server_settings(connection: Any) -> dict[str, str]:
    """Return the database server's durability settings and version, read from the server.

    PostgreSQL: ``fsync``, ``synchronous_commit``, ``full_page_writes``,
    ``wal_sync_method``, ``wal_level``, ``shared_buffers``,
    ``server_version``, and the client's ``prepare_threshold`` (the
    connection's OPTIONS: a number lets the store's fast path prepare its
    statements, docs/scaling.rst). MariaDB: ``innodb_flush_log_at_trx_commit``,
    ``sync_binlog``, ``innodb_doublewrite``, ``log_bin``, ``version``.
    SQLite: ``journal_mode``, ``synchronous``, ``sqlite_version``.
    """
    out: dict[str, str] = {"vendor": connection.vendor}
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            for name in (
                "server_version",
                "fsync",
                "synchronous_commit",
                "full_page_writes",
                "wal_sync_method",
                "wal_level",
                "shared_buffers",
            ):
                cursor.execute(f"SHOW {name}")
                out[name] = str(cursor.fetchone()[0])
            out["prepare_threshold"] = str(connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold"))
        elif connection.vendor == "mysql":
            cursor.execute(
                "SHOW GLOBAL VARIABLES WHERE Variable_name IN ('version', 'innodb_flush_log_at_trx_commit', "
                "'sync_binlog', 'innodb_doublewrite', 'log_bin', 'innodb_flush_method')"
            )
            out.update({str(k): str(v) for k, v in cursor.fetchall()})
        elif connection.vendor == "sqlite":
            for name in ("journal_mode", "synchronous"):
                cursor.execute(f"PRAGMA {name}")
                out[name] = str(cursor.fetchone()[0])
            cursor.execute("SELECT sqlite_version()")
            out["sqlite_version"] = str(cursor.fetchone()[0])
    return out


def measure(runs: int = 20) -> dict[str, Any]:
    """Return the round trips per run of each kind on the default database (see the module docstring).

    ``runs``: runs per median and waiters in the longer chain (at least 4).
    """
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from durable_singleton.definitions import Registry
    from durable_singleton.testing import make_engine

    from .roundtrips import RoundTrips

    runs = max(4, runs)
    call_command("migrate", verbosity=0)
    registry = Registry()
    registry.add("plain", "1", lambda ctx, i: None)

    def keyed(ctx: Any, i: dict[str, Any]) -> None:
        if i.get("park"):
            ctx.wait_for_signal("go")  # a holder parked with its slot, no worker (D2, S6)

    registry.add("keyed", "1", keyed, singleton={"key": lambda i: i["k"]})
    # The same singleton with one shared quota, one quota key per singleton key (X3, #20 item 3).
    from durable_singleton import Quota

    registry.add(
        "quota", "1", keyed, singleton={"key": lambda i: i["k"]}, quotas=[Quota("bench", key=lambda i: i["k"])]
    )
    # The same singleton with one throttle, one throttle key per singleton key, never full (X6).
    from durable_singleton import Throttle

    registry.add(
        "throttle",
        "1",
        keyed,
        singleton={"key": lambda i: i["k"]},
        throttles=[Throttle("bench", key=lambda i: i["k"], limit=1000, period=60)],
    )
    engine = make_engine("django", registry=registry)
    engine.now()  # the engine's clock reads the database's now and then: not per run
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]

    def drain() -> None:
        """Run every queued turn as a Celery worker's task does: ``execute_chain``, so the
        waiter a settle grants runs next on this thread (S7)."""
        while queued:
            engine.execute_chain(queued.popleft())

    tag = f"{os.getpid()}-{os.urandom(3).hex()}"

    def count(fn: Callable[[], Any]) -> tuple[int, int]:
        with RoundTrips(connection) as trips:
            fn()
        return trips.total, trips.control

    measured: list[str] = []

    def plain(n: int) -> None:
        measured.append(engine.start("plain", {}).run_id)  # a generated id: no existence check (R3)
        drain()

    def idle(n: int) -> None:
        measured.append(engine.start("keyed", {"k": f"idle-{tag}-{n}"}).run_id)
        drain()

    def idle_quota(n: int) -> None:
        measured.append(engine.start("quota", {"k": f"idleq-{tag}-{n}"}).run_id)
        drain()

    def idle_throttle(n: int) -> None:
        measured.append(engine.start("throttle", {"k": f"idlet-{tag}-{n}"}).run_id)
        drain()

    results: dict[str, Any] = {"database": connection.vendor, "server": server_settings(connection), "runs": runs}
    seconds: dict[str, float] = {}
    kinds = (("plain", plain), ("idle key", idle), ("idle key + quota", idle_quota))
    for name, fn in (*kinds, ("idle key + throttle", idle_throttle)):
        counted = sorted(count(lambda n=n, fn=fn: fn(n)) for n in range(runs))  # type: ignore[misc]
        total, control = counted[len(counted) // 2]
        results[name] = {"round_trips": total, "transaction_control": control}
    # Wall seconds per run, the two kinds interleaved in one loop so that the machine's noise hits
    # both alike (the ratio is the figure; the seconds alone are not comparable across runs).
    walls: dict[str, list[float]] = {"idle key": [], "idle key + quota": [], "idle key + throttle": []}
    for n in range(runs):
        for name, fn in (("idle key", idle), ("idle key + quota", idle_quota), ("idle key + throttle", idle_throttle)):
            started = time.perf_counter()
            fn(runs + n)
            walls[name].append(time.perf_counter() - started)
    for name, values in walls.items():
        seconds[name] = sorted(values)[len(values) // 2]
    for name in ("idle key + quota", "idle key + throttle"):
        results[name]["seconds_ratio_to_idle_key"] = round(seconds[name] / seconds["idle key"], 2)
    assert all(engine.get(run_id).status == "completed" for run_id in measured), "every measured run completed"

    def chain(waiters: int, workflow: str = "keyed") -> tuple[int, int, float]:
        """Round trips from the first waiter's start to the end of the drain, and the wall
        seconds of the drain after the holder is signalled (the handoffs and the waiters' runs).

        The deep starts are counted in a separate chain of their own (the counters do not nest).
        """
        key = f"hot-{tag}-{workflow}-{waiters}"
        holder = engine.start(workflow, {"k": key, "park": True}).run_id
        drain()
        assert engine.get(holder).status == "suspended", engine.get(holder).status
        with RoundTrips(connection) as trips:
            ids = [engine.start(workflow, {"k": key}).run_id]
            drain()  # the first waiter's turn: denied, it parks (S5)
            ids += [engine.start(workflow, {"k": key}).run_id for _ in range(waiters - 1)]
            started = time.perf_counter()
            engine.signal(holder, "go")
            drain()  # the holder settles; each settle hands the slot to the next waiter (S7)
            drained = time.perf_counter() - started
        statuses = {engine.get(r).status for r in [holder, *ids]}
        assert statuses == {"completed"}, statuses
        return trips.total, trips.control, drained

    def deep_starts(waiters: int) -> int:
        """Median round trips of a start behind a holder and a first waiter (created parked, S8a)."""
        key = f"deep-{tag}"
        holder = engine.start("keyed", {"k": key, "park": True}).run_id
        engine.start("keyed", {"k": key})
        drain()
        counted = sorted(count(lambda: engine.start("keyed", {"k": key}))[0] for _ in range(waiters))
        engine.signal(holder, "go")
        drain()
        return counted[len(counted) // 2]

    chain(2)  # a warm-up: each statement of a drain prepared on this connection once (one more round trip)
    chain(2, "quota")
    extra = runs - runs // 2
    # The two kinds' chains interleaved, as the idle runs above, so that the machine's noise hits
    # both alike; the wall figure is the median over rounds of the long chain's drain seconds per
    # waiter (a difference of two chains, as the round trips are counted, can come out negative
    # on a loaded machine).
    counts: dict[str, list[tuple[int, int]]] = {"keyed": [], "quota": []}
    drains: dict[str, list[float]] = {"keyed": [], "quota": []}
    for _ in range(3):
        for workflow in ("keyed", "quota"):
            long_total, long_control, long_seconds = chain(runs, workflow)
            short_total, short_control, _ = chain(runs // 2, workflow)
            counts[workflow].append((long_total - short_total, long_control - short_control))
            drains[workflow].append(long_seconds / runs)
    deep_start = deep_starts(runs)
    total, control = sorted(counts["keyed"])[1]
    results["handoff-admitted"] = {
        "round_trips": round(total / extra, 2),
        "transaction_control": round(control / extra, 2),
        "of which the start deep in the queue": deep_start,
    }
    total, control = sorted(counts["quota"])[1]
    per_run = total / extra
    keyed_seconds, quota_seconds = sorted(drains["keyed"])[1], sorted(drains["quota"])[1]
    results["tenant burst"] = burst(engine, registry, drain, runs * 5)
    results["handoff-admitted + quota"] = {
        "round_trips": round(per_run, 2),
        "transaction_control": round(control / extra, 2),
        "ratio_to_handoff_admitted": round(per_run / results["handoff-admitted"]["round_trips"], 2),
        "seconds_ratio_to_handoff_admitted": round(quota_seconds / keyed_seconds, 2),
    }
    return results


def burst(engine: Any, registry: Any, drain: Callable[[], None], size: int) -> dict[str, Any]:
    """The other tenant's wait during one tenant's burst (X4, #20 item 4): behind a
    parked holder of a quota of 1, tenant A starts ``size`` runs, then tenant B one;
    the holder is signalled and the queue drained. Reported per quota kind (oldest
    first, and ``fair_key`` by tenant): the runs admitted before B's, and the
    seconds from the signal to B's end."""
    from durable_singleton import Quota

    order: list[str] = []
    b_ran: list[float] = []

    def body(ctx: Any, i: dict[str, Any]) -> None:
        if i.get("park"):
            ctx.wait_for_signal("go")
        order.append(i["tenant"])
        if i["tenant"] == "B":
            b_ran.append(time.perf_counter())

    out: dict[str, Any] = {"burst": size}
    for kind, fair in (("oldest first", None), ("fair_key", lambda i: i["tenant"])):
        name = "burst-fair" if fair else "burst-fifo"
        registry.add(name, "1", body, quotas=[Quota(name, limit=1, fair_key=fair)])
        order.clear()
        b_ran.clear()
        holder = engine.start(name, {"tenant": "A", "park": True}).run_id
        drain()
        for _ in range(size):
            engine.start(name, {"tenant": "A"})
        engine.start(name, {"tenant": "B"})
        drain()
        started = time.perf_counter()
        engine.signal(holder, "go")
        drain()
        waited = b_ran[0] - started
        out[kind] = {"admitted_before_b": order.index("B") - 1, "b_wait_seconds": round(waited, 3)}
    fifo, fair_ = out["oldest first"]["b_wait_seconds"], out["fair_key"]["b_wait_seconds"]
    out["b_wait_ratio_fair_to_fifo"] = round(fair_ / fifo, 3) if fifo else None
    return out


def main() -> int:
    """Print the round trips per run of the DATABASE_URL database as JSON."""
    sys.path.insert(0, os.getcwd())
    print(json.dumps(measure(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
