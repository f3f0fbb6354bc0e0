"""Statements per run, start to settle, no steps (issue #8), on the DATABASE_URL database.

``python -m bench.statements`` (SQLite), or under ``tools/services.py run --pg --mysql``
with ``DATABASE_URL=$DS_PG_URL`` / ``$DS_MYSQL_URL``. Counts the SQL statements
Django sends (``CaptureQueriesContext``; BEGIN, COMMIT and savepoints, which
Django 6 logs too, are counted apart) for three kinds of run, each run executed on this
thread with the manual dispatcher:

* ``plain``: a run without a key;
* ``idle key``: a singleton run on a key nobody holds (start, claim with
  admission, settle);
* ``hot key``: a singleton run that waits behind a holder and is admitted by
  the holder's handoff (start deep in the queue, the predecessor's settle and
  grant counted for the run it admits, the granted turn's confirmation).

Prints one JSON object; docs/benchmarks.rst has the table.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def measure(runs: int = 20) -> dict[str, Any]:
    """Return the statements per run of each kind, as the median over ``runs`` runs."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from durable_singleton.definitions import Registry
    from durable_singleton.testing import make_engine

    call_command("migrate", verbosity=0)
    registry = Registry()
    registry.add("plain", "1", lambda ctx, i: None)
    registry.add("keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    engine = make_engine("django", registry=registry)
    engine.now()  # the engine's clock reads the database's once per 5 minutes: not per run

    def control(sql: str) -> bool:
        """Transaction control (BEGIN, COMMIT, savepoints): logged by Django 6, not a statement of ours."""
        head = sql.strip().upper()
        return head in ("BEGIN", "COMMIT", "ROLLBACK") or "SAVEPOINT" in head

    def count(fn: Any) -> tuple[int, int]:
        with CaptureQueriesContext(connection) as queries:
            fn()
        sql = [q["sql"] for q in queries.captured_queries]
        controls = sum(1 for s in sql if control(s))
        return len(sql) - controls, controls

    measured: list[str] = []

    def plain(n: int) -> None:
        measured.append(engine.start("plain", {}).run_id)  # a generated id: no existence check (R3)
        engine.dispatcher.drain()  # type: ignore[attr-defined]

    def idle(n: int) -> None:
        measured.append(engine.start("keyed", {"k": f"idle-{os.getpid()}-{n}"}).run_id)
        engine.dispatcher.drain()  # type: ignore[attr-defined]

    results: dict[str, Any] = {"database": connection.vendor, "runs": runs}
    for name, fn in (("plain", plain), ("idle key", idle)):
        counted = sorted(count(lambda n=n, fn=fn: fn(n)) for n in range(runs))
        results[name] = counted[len(counted) // 2][0]
        results[f"{name}: transaction control"] = counted[len(counted) // 2][1]
    assert all(engine.get(run_id).status == "completed" for run_id in measured), "every measured run completed"

    # Hot key: a holder admitted, a first waiter, then `runs` waiters started deep
    # in the queue (parked at creation, S8a). The holder settles; each settle
    # grants the next waiter, whose turn this thread runs next (execute_chain's
    # handoff, S7). Every run of the chain: a confirmation claim, its settle and
    # the grant of the next.
    key = f"hot-{os.getpid()}"
    holder = engine.start("keyed", {"k": key}).run_id
    options = {"limits": engine.limits(), "max_recoveries": 5, "retry": engine._retry_policy()}
    turn = engine.store.begin_turn(holder, "bench", lease_seconds=60, **options)
    assert turn.state.name == "RUN"
    engine.start("keyed", {"k": key})
    starts = sorted(count(lambda: engine.start("keyed", {"k": key}))[0] for _ in range(runs))
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    follow_ups: list[Any] = []
    engine._local.follow_ups = follow_ups
    executed = 0
    with CaptureQueriesContext(connection) as queries:
        done = engine.store.finish(turn.run, "bench", "completed", limits=engine.limits())
        engine._settled(done)
        while follow_ups:
            granted = follow_ups.pop(0)
            engine.execute(granted.run_id, known=granted)
            executed += 1
    engine._local.follow_ups = None
    assert executed == runs + 1, executed
    chain = sum(1 for q in queries.captured_queries if not control(q["sql"]))
    per_run = chain / executed
    results["hot key"] = round(starts[len(starts) // 2] + per_run, 1)
    results["hot key detail"] = {
        "start deep in the queue": starts[len(starts) // 2],
        "confirmation, settle and grant of the next, per run": round(per_run, 2),
    }
    return results


def main() -> int:
    """Print the statements per run of the DATABASE_URL database as JSON."""
    sys.path.insert(0, os.getcwd())
    print(json.dumps(measure(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
