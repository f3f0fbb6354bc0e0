"""The throttle's bench (issue #33, SPEC X6), on the DATABASE_URL database, in one run.

``python -m bench.throttle`` (SQLite), or under ``tools/services.py run --pg --mysql``
with ``DATABASE_URL=$DS_PG_URL`` / ``$DS_MYSQL_URL``. Prints one JSON object.

* ``claim``: the cost of a claim (``begin_turn`` of a run's first turn on an idle
  key, admitted) with one throttle that is never full against the same workflow
  without it, the two interleaved in one loop so that the machine's noise hits
  both alike: median seconds, their ratio (#33's target: at most 1.5), and the
  round trips of each claim (:mod:`bench.roundtrips`), counted in two claims of
  each before the timed ones: the counter's tracing (on SQLite a callback with
  each statement's text, on PostgreSQL libpq's protocol trace) is not timed.
* ``wake``: ``keys`` throttle keys of ``limit`` admissions per ``period``
  seconds, ``per_key`` runs started on each, then sent at once to an embedded
  worker (``ThreadDispatcher``, ``threads`` threads, the tick every
  ``tick_seconds``). From each key's admissions (the runs' ``admitted_at``, the
  times their throttle key recorded), in order: the k-th
  (k >= ``limit``) could come no sooner than the (k - ``limit``)-th plus the
  period (X6b), the opening its run waited for; its delay after it, in ms,
  p50/p99/max; ``max_in_window``: the most admissions of one key in any
  half-open interval of ``period`` (never above ``limit``). ``sent_after_opening_ms``:
  the wake itself (#33's target: within 100 ms p99): for each claim that parks
  its run until a time (``begin_turn``'s parked turn with its ``wake_at``: the
  opening, on the database's clock), the delay from that time to the run's next
  turn sent (a dispatch to the worker's queue, by whichever path), p50/p99/max in
  ms. The
  send's time is the process's clock moved onto the database's by one read of
  both at the start (its error is half that read's round trip, ``clock_read_ms``).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _summary(values: list[float]) -> dict[str, Any]:
    return {"count": len(values), "p50": _pct(values, 0.5), "p99": _pct(values, 0.99), "max": _pct(values, 1.0)}


def claim_cost(runs: int = 40) -> dict[str, Any]:
    """The claim of a run's first turn with and without a throttle, interleaved (see the module docstring)."""
    from django.db import connection

    from durable_singleton import Throttle
    from durable_singleton.definitions import Registry
    from durable_singleton.statuses import RunStatus
    from durable_singleton.stores.base import TurnState
    from durable_singleton.testing import make_engine

    from .roundtrips import RoundTrips

    registry = Registry()
    registry.add("bt-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    rate = Throttle("bt-rate", key=lambda i: i["k"], limit=1_000_000, period=60)
    registry.add("bt-throttled", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]}, throttles=[rate])
    engine = make_engine("django", registry=registry)
    limits, retry = engine.limits(), engine._retry_policy()
    tag = f"{os.getpid()}-{os.urandom(3).hex()}"
    seconds: dict[str, list[float]] = {"bt-keyed": [], "bt-throttled": []}
    trips: dict[str, list[int]] = {"bt-keyed": [], "bt-throttled": []}
    warm_up, counting = 2, 2
    for n in range(warm_up + counting + runs):
        for workflow in ("bt-keyed", "bt-throttled"):
            run_id = engine.start(workflow, {"k": f"{tag}-{workflow}-{n}"}).run_id
            engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the claim below is the turn
            claim = functools.partial(
                engine.store.begin_turn, run_id, "bench", lease_seconds=30, limits=limits, max_recoveries=3, retry=retry
            )
            if n < warm_up + counting:  # the warm-up (each statement compiled once per connection), then counted
                with RoundTrips(connection) as counted:
                    turn = claim()
                if n >= warm_up:
                    trips[workflow].append(counted.total)
            else:  # timed without the counter: its tracing (a callback per statement) is no part of a claim
                began = time.perf_counter()
                turn = claim()
                seconds[workflow].append(time.perf_counter() - began)
            assert turn.state is TurnState.RUN and turn.run is not None, turn
            engine.store.finish(turn.run, "bench", RunStatus.COMPLETED, limits=limits)
    median = {w: sorted(v)[len(v) // 2] for w, v in seconds.items()}
    return {
        "runs": runs,
        "without_throttle": {"claim_ms": round(median["bt-keyed"] * 1000, 3), "round_trips": max(trips["bt-keyed"])},
        "with_throttle": {
            "claim_ms": round(median["bt-throttled"] * 1000, 3),
            "round_trips": max(trips["bt-throttled"]),
        },
        "ratio": round(median["bt-throttled"] / median["bt-keyed"], 2),
    }


def wake_at_opening(
    keys: int = 4, per_key: int = 20, limit: int = 5, period: float = 1.0, threads: int = 4, tick_seconds: float = 1.0
) -> dict[str, Any]:
    """Throttled runs executed by an embedded worker; their admission after each opening (see the module docstring)."""
    from durable_singleton import Throttle
    from durable_singleton.definitions import Registry
    from durable_singleton.dispatch import ThreadDispatcher
    from durable_singleton.engine import Engine
    from durable_singleton.models import Run
    from durable_singleton.querysets import database_now
    from durable_singleton.statuses import RunStatus
    from durable_singleton.stores.base import TurnState
    from durable_singleton.testing import make_engine

    registry = Registry()
    name = f"bw-{os.urandom(3).hex()}"
    rate = Throttle(name, key=lambda i: i["k"], limit=limit, period=period)
    registry.add("bw-throttled", "1", lambda ctx, i: None, throttles=[rate])
    built = make_engine("django", registry=registry)
    dispatcher = ThreadDispatcher(built.store, threads=threads, tick_seconds=tick_seconds)
    engine = Engine(built.store, dispatcher, registry=registry, settings=built.settings)
    dispatcher.bind(engine)
    # The database's clock minus the process's (seconds), for the sends' times only.
    before = time.time()
    db_now = database_now(built.store.db).timestamp()  # type: ignore[attr-defined]
    after = time.time()
    offset = db_now - (before + after) / 2
    opening: dict[str, float] = {}  # run id -> the opening it is parked until (database's clock)
    sent_late: list[float] = []
    lock = threading.Lock()

    claim = built.store.begin_turn

    def begin_turn(run_id: str, *args: Any, **kwargs: Any) -> Any:
        turn = claim(run_id, *args, **kwargs)
        if turn.state is TurnState.PARKED and turn.run is not None and turn.run.wake_at is not None:
            with lock:
                opening[run_id] = turn.run.wake_at.timestamp()
        return turn

    send = dispatcher.dispatch

    def dispatch(run_id: str, queue: str | None = None) -> None:
        at = time.time() + offset
        with lock:
            opens = opening.pop(run_id, None)
        if opens is not None:
            sent_late.append((at - opens) * 1000)
        send(run_id, queue)

    dispatcher.dispatch = dispatch  # type: ignore[method-assign]
    built.store.begin_turn = begin_turn  # type: ignore[method-assign]
    # Every run written first (the worker not started: a start sends nothing), then all sent at
    # once: each key's runs arrive together, as a burst does, whatever a start costs.
    ids = [engine.start("bw-throttled", {"k": f"{name}-{k}"}).run_id for _ in range(per_key) for k in range(keys)]
    dispatcher.start()
    try:
        for run_id in ids:
            dispatcher.dispatch(run_id)
        deadline = time.monotonic() + 60 + keys * per_key * period / limit * 3
        while Run.objects.filter(run_id__in=ids, status=RunStatus.COMPLETED).count() < len(ids):
            if time.monotonic() > deadline:
                raise RuntimeError("the throttled runs did not all complete in time")
            time.sleep(0.1)
    finally:
        dispatcher.stop(timeout=10)
    # Each key's admissions in order (each run admitted once: its admitted_at, the time its
    # throttle key recorded; the tick prunes the records older than the period): the k-th
    # (k >= limit) could come no sooner than the (k - limit)-th plus the period (X6b); its
    # delay after that opening is the wake's.
    admitted: dict[str, list[datetime]] = {}
    for given, at in Run.objects.filter(run_id__in=ids).values_list("input", "admitted_at"):
        admitted.setdefault(str(given["k"]), []).append(at)
    late: list[float] = []
    most = 0
    for times in (sorted(t) for t in admitted.values()):
        for i, first in enumerate(times):
            most = max(most, sum(1 for t in times[i:] if (t - first).total_seconds() < period))
        late += [(times[i] - times[i - limit]).total_seconds() * 1000 - period * 1000 for i in range(limit, len(times))]
    return {
        "keys": keys,
        "runs_per_key": per_key,
        "limit": limit,
        "period_s": period,
        "threads": threads,
        "tick_s": tick_seconds,
        "admission_after_opening_ms": _summary(late),
        "sent_after_opening_ms": _summary(sent_late),
        "clock_read_ms": round((after - before) * 1000, 1),
        "max_in_window": most,
    }


def measure(runs: int = 40) -> dict[str, Any]:
    """Both figures on the default database (see the module docstring)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from .statements import server_settings

    call_command("migrate", verbosity=0)
    # The wake first: a burst of claims on fresh keys, before the claim loop's runs.
    parts: dict[str, Callable[[], Any]] = {"wake": wake_at_opening, "claim": lambda: claim_cost(runs)}
    results: dict[str, Any] = {"database": connection.vendor, "server": server_settings(connection)}
    for part, fn in parts.items():
        results[part] = fn()
    return results


def main() -> int:
    """Print the throttle's figures on the DATABASE_URL database as JSON."""
    sys.path.insert(0, os.getcwd())
    print(json.dumps(measure(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
