"""The tick keeps its period while bodies hold every worker slot (O5), one
tick at a time across every worker (O1b), on real Celery worker and beat
processes, Redis and PostgreSQL (or MariaDB); and the same rules in process
on every database.

Only the documented ``celery worker`` and ``celery beat`` run: each worker's
main process runs a tick thread (:mod:`durable_singleton.celery_tick`) that
ticks while it holds the tick's lease, and beat's tick task, on the default
queue, is a no-op while one does. The tick times are read from the workers'
logs (``bench.procs.tick_lines``: one ``durable tick by celery:<host>:<pid>``
line per tick of a thread, one ``Task durable_singleton.tick[...] succeeded``
line per tick task).
"""

from __future__ import annotations

import itertools
import statistics
import time
import uuid
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import override_settings

from bench.procs import tick_lines, tick_times
from durable_singleton import celery_tick, tasks
from durable_singleton.dispatch import CeleryDispatcher, ManualDispatcher
from durable_singleton.engine import Engine
from durable_singleton.health import check_health
from durable_singleton.heartbeat import HEARTBEAT_EVERY_SECONDS
from durable_singleton.models import Heartbeat, Run
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.turns import TICK_LEASE, hold_tick_lease, release_tick_lease
from testproject.inventory.models import BodyAudit
from tests.celery_workers import CeleryWorkers, celery_stack_missing, celery_workers, worker_env

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

#: The test project's TICK_SECONDS (the default).
TICK = 1.0
#: Broker delivery, process start and scheduling on a loaded 2-core machine.
SLACK = 60.0
#: How long the bodies hold both pool processes, in seconds: past every wait below.
HOLD = 45.0
#: How long the test watches the ticks while both bodies run, in seconds.
WINDOW = 15.0
#: Real workers on PostgreSQL or MariaDB (SQLite's file is not shared well by many processes).
VENDORS = ("postgresql", "mysql")


def _wait(what: str, predicate: Any, timeout: float, logs: Any) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:.0f} s\n{logs()}")
        time.sleep(0.2)


def _env(**overrides: str) -> dict[str, str]:
    """A worker's environment with the durable_singleton loggers at INFO (one line per tick)."""
    return worker_env(DURABLE_LOG_LEVEL="INFO", **overrides)


def _pid_of(owner: str) -> int:
    """The pid in a Celery worker's tick owner ``celery:<host>:<pid>:<token>``."""
    return int(owner.rsplit(":", 2)[1])


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_tick_keeps_its_period_while_bodies_hold_every_slot(celery_workers: CeleryWorkers) -> None:
    """O5, S8, X2: only the documented ``celery worker`` (concurrency 2) and
    ``celery beat`` run; with both pool processes held by long bodies the
    tick (the thread of the worker's main process) keeps its period: the
    gaps between ticks stay within 2 x TICK_SECONDS (90th percentile; the
    longest within a generous bound), ``check_health`` reports no stale tick,
    and a waiter's ``queue_ttl``, a timer only the tick fires, ends it
    ``queue_ttl_expired`` meanwhile. Before the tick thread, beat's tick
    waited behind the bodies (or, sent to ``durable_tick``, for a worker no
    one started) and no tick ran."""
    if reason := celery_stack_missing(VENDORS):
        pytest.skip(reason)
    (worker,) = celery_workers.start(1, concurrency=2, env=_env())
    celery_workers.start_beat()
    # Steady state first: a fresh worker's first tick (Django's start, the first queries) may take seconds.
    _wait("the first tick", lambda: tick_times(worker.log()), SLACK, celery_workers.logs)
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
    times = [t for t in tick_times(worker.log()) if began <= t <= ended]
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
def test_one_worker_ticks_at_a_time_and_another_takes_over_when_it_dies(celery_workers: CeleryWorkers) -> None:
    """O1b, O5, O6, S8: with two workers running, one tick thread at a time
    holds the tick's lease (every thread tick comes from one worker, and no
    two ticks overlap); after a SIGKILL of that worker's main process, the
    other worker's thread takes the lease once it ended and ticks, and a
    turn only a tick sends (a start whose own send was never made, S8's
    redelivery) goes through the broker to a body that finishes the run."""
    if reason := celery_stack_missing(VENDORS):
        pytest.skip(reason)
    first, second = celery_workers.start(2, concurrency=1, env=_env())
    logs = celery_workers.logs
    _wait("a few ticks", lambda: len(tick_times(first.log(), second.log())) >= 8, SLACK, logs)
    watch_until = time.time() + 5 * TICK
    _wait("the watch", lambda: time.time() >= watch_until, SLACK, logs)
    lines = sorted((t for w in (first, second) for t in tick_lines(w.log())), key=lambda t: t.ended)
    owners = {t.owner for t in lines}
    assert len(owners) == 1, (owners, logs())
    for a, b in itertools.pairwise(lines):
        assert b.ended - b.seconds >= a.ended - 0.01, (a, b)  # the next began after the previous ended
    (owner,) = owners
    # The thread's owner is celery:<host>:<pid>:<token> (identity.process_name).
    holder, other = (first, second) if _pid_of(owner) == first.pid else (second, first)
    assert _pid_of(owner) == holder.pid, (owner, holder.pid, other.pid)
    holder.kill()
    killed_at = time.time()
    _wait(
        "the other worker's thread ticking",
        lambda: [t for t in tick_lines(other.log()) if t.ended > killed_at],
        SLACK,
        logs,
    )
    assert _pid_of(Heartbeat.objects.get(name=TICK_LEASE).owner) == other.pid
    store = DjangoStore()
    engine = Engine(store, ManualDispatcher(store))  # the start sends nothing: the tick re-sends its turn
    engine.dispatcher.bind(engine)
    run_id = f"redeliver-{uuid.uuid4().hex[:8]}"
    engine.start("fault-hold", {"store_id": run_id, "seconds": 0}, run_id=run_id)
    _wait("the run sent by the tick finished", lambda: Run.objects.get(pk=run_id).status == "completed", SLACK, logs)


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_ticks_that_could_not_run_do_not_run_back_to_back(celery_workers: CeleryWorkers) -> None:
    """O5: beat sends ticks while no worker runs; when a worker starts (its
    tick thread off, so beat's ticks are the only ones), the backlog does not
    run back to back: the expired messages are discarded and those queued
    behind a tick find the tick's lease held (result -1), so every two ticks
    that ran are at least half a period apart (the lease, on the database's
    clock, so no timing luck is involved)."""
    if reason := celery_stack_missing(VENDORS):
        pytest.skip(reason)
    beat = celery_workers.start_beat()
    deadline = time.monotonic() + SLACK
    while beat.log().count("Scheduler: Sending due task") < 8:
        assert time.monotonic() < deadline, beat.log()
        time.sleep(0.2)
    (worker,) = celery_workers.start(1, concurrency=1, env=_env(DURABLE_CELERY_WORKER_TICK="0"))
    deadline = time.monotonic() + SLACK
    while len(tick_times(worker.log())) < 5:
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.2)
    times = tick_times(worker.log())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.5 * TICK, (gaps, worker.log())
    assert "succeeded in" in worker.log() and "s: -1" in worker.log(), worker.log()
    assert "durable tick by" not in worker.log()


@pytest.mark.django_db(transaction=True)  # the task closes the connection, as in a worker
def test_a_beat_tick_is_a_no_op_while_the_tick_lease_is_held() -> None:
    """O5, O1b: beat's tick task takes the tick's lease on the database's
    clock: a message that arrives less than half a period after the previous
    beat tick ended does nothing (-1), nor does one while another process (a
    worker's tick thread) holds the lease; once it is ended, the task ticks."""
    db = connection.alias
    with override_settings(DURABLE_SINGLETON={"DISPATCH": "manual", "TICK_SECONDS": 0.5}):
        assert tasks.tick() >= 0
        assert tasks.tick() == -1
        _wait("the gap after the previous tick", lambda: tasks.tick() >= 0, SLACK, lambda: "")
        _wait("the lease free", lambda: hold_tick_lease(db, "celery:elsewhere:1", 60.0), SLACK, lambda: "")
        for _ in range(3):
            assert tasks.tick() == -1
            time.sleep(0.3)
        release_tick_lease(db, "celery:elsewhere:1")
        assert tasks.tick() >= 0


@pytest.mark.django_db(transaction=True)  # the thread uses its own connections
def test_the_worker_tick_thread_holds_the_lease_and_ends_it_at_shutdown() -> None:
    """O5, O1b: Celery's ``worker_ready`` starts the tick thread (DISPATCH
    "celery", CELERY_WORKER_TICK on by default), which ticks while it holds
    the tick's lease; ``worker_shutdown`` stops it and ends its lease, so
    another process ticks at once. With CELERY_WORKER_TICK False no thread starts."""
    from celery.signals import worker_ready, worker_shutdown

    db = connection.alias
    with override_settings(DURABLE_SINGLETON={"DISPATCH": "celery", "CELERY_WORKER_TICK": False}):
        worker_ready.send(sender=None)
        assert celery_tick.running_ticker() is None
    with override_settings(DURABLE_SINGLETON={"DISPATCH": "celery", "TICK_SECONDS": 0.2}):
        worker_ready.send(sender=None)
        ticker = celery_tick.running_ticker()
        assert ticker is not None and ticker.alive
        try:
            _wait(
                "the thread holding the lease",
                # A live lease on the database's clock (O1b): a row of an ended lease with
                # this owner (this process's name, left by an earlier tick thread) is not it.
                lambda: Heartbeat.objects.filter(name=TICK_LEASE, owner=ticker.owner, at__gt=Now()).exists(),
                SLACK,
                lambda: "",
            )
            assert not hold_tick_lease(db, "celery:elsewhere:1", 60.0)
        finally:
            worker_shutdown.send(sender=None)
        assert not ticker.alive and celery_tick.running_ticker() is None
        assert hold_tick_lease(db, "celery:elsewhere:1", 60.0)  # ended at shutdown: taken at once
