"""Fixtures: engines on the in-memory store and on the Django store (the
database named by DATABASE_URL), a fresh registry per test, and a body audit
that records the highest number of concurrent bodies per key."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest
from django.db import connection, connections

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.testing import make_engine


def vendor() -> str:
    """Return the database vendor of the test run: sqlite, postgresql or mysql."""
    return connection.vendor


class Monitor:
    """Counts bodies running at once per key; records entry order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = defaultdict(int)
        self.highest: dict[str, int] = defaultdict(int)
        self.entered: list[str] = []
        self.calls: dict[str, int] = defaultdict(int)

    def enter(self, key: str, run_id: str) -> None:
        with self._lock:
            self.current[key] += 1
            self.highest[key] = max(self.highest[key], self.current[key])
            self.entered.append(run_id)
            self.calls[run_id] += 1

    def exit(self, key: str) -> None:
        with self._lock:
            self.current[key] -= 1


@pytest.fixture
def monitor() -> Monitor:
    return Monitor()


@pytest.fixture
def registry() -> Registry:
    return Registry()


@pytest.fixture(params=["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))])
def store_kind(request: pytest.FixtureRequest) -> str:
    """The store under test: the in-memory store, or the Django store on the
    DATABASE_URL database with real commits."""
    return str(request.param)


@pytest.fixture
def make(store_kind: str, registry: Registry) -> Iterator[Callable[..., Engine]]:
    """Return a factory of engines sharing one store of ``store_kind``."""
    engines: list[Engine] = []
    shared: dict[str, Any] = {}

    def factory(clock: Callable[[], datetime] | None = None, **settings: Any) -> Engine:
        if "store" not in shared:
            engine = make_engine(store_kind, registry=registry, clock=clock, **settings)
            shared["store"] = engine.store
        else:
            engine = make_engine(shared["store"], registry=registry, clock=clock, **settings)
        engines.append(engine)
        return engine

    yield factory


@pytest.fixture
def engine(make: Callable[..., Engine]) -> Engine:
    return make()


def run_threads(n: int, target: Callable[[int], Any], timeout: float = 60.0) -> list[Any]:
    """Run ``target(i)`` on ``n`` threads lined up on a barrier; return results
    (or raised exceptions), closing each thread's connections."""
    barrier = threading.Barrier(n, timeout=timeout)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as exc:  # collected and re-raised by the test
            results[i] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a racing thread did not finish in time"
    return results


def spawn(target: Callable[..., Any], *args: Any) -> threading.Thread:
    """Start a daemon thread running ``target(*args)`` that closes its database connections."""

    def run() -> None:
        try:
            target(*args)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
