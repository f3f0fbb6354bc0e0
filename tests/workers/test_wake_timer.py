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
