"""The tick keeps its period while bodies hold every worker slot (O5), on real
Celery worker and beat processes, Redis and PostgreSQL.

``beat_schedule()`` sends the tick to Celery queue ``durable_tick``, which a
worker of its own consumes (``-Q durable_tick -P solo``): the test starts one
body worker of concurrency 2 on the default queue, that tick worker and one
beat, fills both pool processes with long bodies, and reads the tick times
from the tick worker's log (one ``Task durable_singleton.tick[...] succeeded``
line per tick). Before the tick had its queue, it waited behind the bodies on
the default queue and the tick worker logged none.
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid
from typing import Any

import pytest
from django.test import override_settings

from bench.procs import tick_times
from durable_singleton import tasks
from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.health import check_health
from durable_singleton.heartbeat import HEARTBEAT_EVERY_SECONDS
from durable_singleton.models import Run
from durable_singleton.stores.django import DjangoStore
from testproject.inventory.models import BodyAudit

from .celery_workers import CeleryWorkers, celery_stack_missing, celery_workers

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

#: The test project's TICK_SECONDS (the default).
TICK = 1.0
#: Broker delivery, process start and scheduling on a loaded 2-core machine.
SLACK = 60.0
#: How long the bodies hold both pool processes, in seconds: past every wait below.
HOLD = 45.0
#: How long the test watches the ticks while both bodies run, in seconds.
WINDOW = 15.0


def _wait(what: str, predicate: Any, timeout: float, logs: Any) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:.0f} s\n{logs()}")
        time.sleep(0.2)


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_tick_keeps_its_period_while_bodies_hold_every_slot(celery_workers: CeleryWorkers) -> None:
    """O5, S8, X2: with both pool processes of the only body worker held by
    long bodies, the tick (its own queue and worker) keeps its period: the
    gaps between ticks stay within 2 x TICK_SECONDS (90th percentile; the
    longest within a generous bound), ``check_health`` reports no stale tick,
    and a waiter's ``queue_ttl``, a timer only the tick fires, ends it
    ``queue_ttl_expired`` meanwhile."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    celery_workers.start(1, concurrency=2)
    (ticker,) = celery_workers.start(1, pool="solo", queues=tasks.TICK_QUEUE)
    celery_workers.start_beat()
    # Steady state first: a fresh worker's first tick (Django's start, the first queries) may take seconds.
    _wait("the first tick", lambda: tick_times(ticker.log()), SLACK, celery_workers.logs)
    store = DjangoStore()
    engine = Engine(store, CeleryDispatcher(store))
    engine.dispatcher.bind(engine)
    tag = uuid.uuid4().hex[:8]
    holders = [f"hold-{n}-{tag}" for n in "ab"]
    for run_id in holders:
        engine.start("fault-hold-ttl", {"store_id": run_id, "seconds": HOLD}, run_id=run_id)
    _wait(
        "both bodies running",
        lambda: BodyAudit.objects.filter(run_id__in=[f"{r}#1" for r in holders]).count() == 2,
        SLACK,
        celery_workers.logs,
    )
    began = time.time()
    waiter = f"wait-{tag}"
    engine.start("fault-hold-ttl", {"store_id": holders[0], "seconds": 0}, run_id=waiter)
    problems: list[str] = []

    def expired_and_watched() -> bool:
        report = check_health(engine, stale_seconds=HEARTBEAT_EVERY_SECONDS + 2 * TICK + 3, backlog_seconds=60)
        problems.extend(f"{p.kind}: {p.detail}" for p in report.problems)
        run = Run.objects.get(pk=waiter)
        expired = run.status == "cancelled" and (run.error or {}).get("code") == "queue_ttl_expired"
        return expired and time.time() - began >= WINDOW

    _wait("the waiter's queue_ttl fired and the window passed", expired_and_watched, SLACK, celery_workers.logs)
    ended = time.time()
    assert BodyAudit.objects.filter(run_id__in=[f"{r}#1" for r in holders], exited_at=None).count() == 2, (
        "the waiter's queue_ttl fired only once the bodies had left: the tick waited behind them"
    )
    times = [t for t in tick_times(ticker.log()) if began <= t <= ended]
    assert len(times) >= 2, f"no ticks while the bodies ran:\n{celery_workers.logs()}"
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    p90 = gaps[int(0.9 * (len(gaps) - 1))]
    print(f"\ntick gaps over {ended - began:.1f} s: n={len(gaps)} median={statistics.median(gaps):.3f} "
          f"p90={p90:.3f} max={gaps[-1]:.3f} (TICK_SECONDS {TICK:g})")  # fmt: skip
    assert p90 <= 2 * TICK, gaps
    assert gaps[-1] <= 2 * TICK + 10, gaps
    assert not problems, problems


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_ticks_that_could_not_run_do_not_run_back_to_back(celery_workers: CeleryWorkers) -> None:
    """O5: beat sends ticks while no worker consumes ``durable_tick``; when
    the tick's worker starts, the backlog does not run back to back: the
    expired messages are discarded and those queued behind a tick are
    dropped (result -1), so every two ticks that ran are at least half a
    period apart (the worker's own guard, so no timing luck is involved)."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    beat = celery_workers.start_beat()
    deadline = time.monotonic() + SLACK
    while beat.log().count("Scheduler: Sending due task") < 8:
        assert time.monotonic() < deadline, beat.log()
        time.sleep(0.2)
    (ticker,) = celery_workers.start(1, pool="solo", queues=tasks.TICK_QUEUE)
    deadline = time.monotonic() + SLACK
    while len(tick_times(ticker.log())) < 5:
        assert time.monotonic() < deadline, ticker.log()
        time.sleep(0.2)
    times = tick_times(ticker.log())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.5 * TICK, (gaps, ticker.log())
    assert "succeeded in" in ticker.log() and "s: -1" in ticker.log(), ticker.log()


@pytest.mark.django_db(transaction=True)  # the task closes the connection, as in a worker
def test_a_tick_queued_behind_the_previous_one_is_dropped() -> None:
    """O5: a tick message that reaches the tick's worker less than half a
    period after that process's previous tick ended (it waited in the queue
    while the worker was down or a tick ran long) is dropped, not run back to
    back; the next one a period later runs."""
    with override_settings(DURABLE_SINGLETON={"DISPATCH": "manual", "TICK_SECONDS": 0.5}):
        assert tasks.tick() >= 0
        assert tasks.tick() == -1
        time.sleep(0.3)
        assert tasks.tick() >= 0
