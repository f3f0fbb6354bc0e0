"""The workers' wake timer (S8, X6d, X5): between two ticks the embedded
worker's tick thread sleeps until the earliest ``wake_at`` of a parked run and
sends the due runs then, so a run parked until a time (a throttle's window
opening, a delayed start) is sent at its time, not up to a tick later. A run
the worker's own claim parks over a throttle's rate has the timer read the next
wake again at once; any other wake is read at each tick.

The worker's tick period here is an hour: after its first tick, only the wake
timer can send a parked run within the tests' bounds. Every wait polls its
condition with a bound; nothing asserts on elapsed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from durable_singleton import Throttle
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import ThreadDispatcher
from durable_singleton.engine import Engine
from durable_singleton.statuses import RunStatus
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.django_db(transaction=True)

#: The worker's tick period: far beyond every bound below.
TICK_SECONDS = 3600.0


@pytest.fixture
def worker() -> Iterator[Engine]:
    """An engine whose embedded worker (two threads) ticks once an hour."""
    registry = Registry()
    registry.add(
        "wt-rate", "1", lambda ctx, i: None, throttles=[Throttle("wt-rate", key=lambda i: "k", limit=1, period=2)]
    )
    built = make_engine("django", registry=registry)
    dispatcher = ThreadDispatcher(built.store, threads=2, tick_seconds=TICK_SECONDS)
    engine = Engine(built.store, dispatcher, registry=registry, settings=built.settings)
    dispatcher.bind(engine)
    dispatcher.start()
    try:
        yield engine
    finally:
        dispatcher.stop(timeout=10)


def _wait_for(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def _admitted_apart(engine: Engine, first: str, second: str) -> float:
    """Seconds between two runs' admissions, on the database's clock (X6b)."""
    a, b = engine.get(first).admitted_at, engine.get(second).admitted_at
    assert a is not None and b is not None
    return (b - a).total_seconds()


def test_a_throttled_run_is_sent_at_its_window_opening_without_a_tick(worker: Engine) -> None:
    """X6d, S8: two runs of a throttle key of 1 per 2 s: the first is admitted,
    the second is parked until the window opens (its wake_at), and the worker's
    wake timer sends it then: it completes though the worker's next tick is an
    hour away. Before the timer, it waited for that tick."""
    first = worker.start("wt-rate", {}).run_id
    _wait_for(lambda: worker.get(first).status == RunStatus.COMPLETED)
    second = worker.start("wt-rate", {}).run_id
    _wait_for(lambda: worker.get(second).not_before is not None or worker.get(second).is_terminal)
    _wait_for(lambda: worker.get(second).status == RunStatus.COMPLETED)
    done = worker.get(second)
    assert done.admitted_at is not None and worker.get(first).admitted_at is not None
    assert (done.admitted_at - worker.get(first).admitted_at).total_seconds() >= 2.0  # the window held (X6b)


def test_a_stream_of_throttled_parks_postpones_no_due_send(worker: Engine) -> None:
    """X6d, S8: while runs are parked over a throttle's rate one after another (each
    park has the timer read the next wake again), a run whose window opens is still
    sent at its opening: the parks' signals here come every 2 ms from another
    thread, as a burst's claims park on busy worker threads. Before, each park cut
    the timer's sleep short and skipped the send it was sleeping for, so the run
    waited for a gap of 20 ms between two parks, or for the next tick (an hour here)."""
    import threading

    from durable_singleton import signals

    first = worker.start("wt-rate", {}).run_id
    _wait_for(lambda: worker.get(first).status == RunStatus.COMPLETED)
    second = worker.start("wt-rate", {}).run_id
    _wait_for(lambda: worker.get(second).not_before is not None or worker.get(second).is_terminal)
    done = threading.Event()

    def parks() -> None:
        while not done.is_set():
            signals.run_parked.send_robust(sender=Engine, run=None, reason="throttled:wt-other", throttle="wt-other")
            time.sleep(0.002)

    flood = threading.Thread(target=parks, daemon=True)
    flood.start()
    try:
        _wait_for(lambda: worker.get(second).status == RunStatus.COMPLETED)
    finally:
        done.set()
        flood.join(5)
    assert _admitted_apart(worker, first, second) >= 2.0  # the window held (X6b)


def test_the_celery_tick_thread_sends_a_throttled_run_at_its_opening_without_a_tick() -> None:
    """X6d, S8, O5: the tick thread of a Celery worker's main process
    (``celery_tick.WorkerTicker``), holding the tick's lease, sends a run parked over
    a throttle's rate at its window's opening, though its next tick is an hour
    away. The engine's dispatcher here is the manual one: a sent turn is queued
    there, and the test runs it. Before, the thread slept the whole period."""
    from django.db import connection

    from durable_singleton.celery_tick import WorkerTicker
    from durable_singleton.stores.turns import release_tick_lease

    registry = Registry()
    rate = Throttle("wt-celery-rate", key=lambda i: "k", limit=1, period=2)
    registry.add("wt-celery-rate", "1", lambda ctx, i: None, throttles=[rate])
    engine = make_engine("django", registry=registry)
    queue = engine.dispatcher.queue  # type: ignore[attr-defined]
    first = engine.start("wt-celery-rate", {}).run_id
    second = engine.start("wt-celery-rate", {}).run_id
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get(first).status == RunStatus.COMPLETED
    assert engine.get(second).not_before is not None and not engine.get(second).is_terminal
    ticks: list[int] = []
    tick = engine.tick

    def counted_tick(*args: Any, **kwargs: Any) -> Any:
        ticks.append(1)
        return tick(*args, **kwargs)

    engine.tick = counted_tick  # type: ignore[method-assign]
    ticker = WorkerTicker(engine, connection.alias, TICK_SECONDS)
    ticker.owner = f"{ticker.owner}:wake-timer-test"
    ticker.start()
    try:
        _wait_for(lambda: second in queue)
    finally:
        ticker.stop(timeout=10)
        release_tick_lease(connection.alias, ticker.owner)
    assert len(ticks) <= 1  # its first round's tick only: the send was the wake timer's
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get(second).status == RunStatus.COMPLETED
    assert _admitted_apart(engine, first, second) >= 2.0  # the window held (X6b)
