"""Fixtures: engines on the in-memory store and on the Django store (the
database named by DATABASE_URL), a fresh registry per test, and a body audit
that records the highest number of concurrent bodies per key.

Vendor-agnostic tests run in the SQLite passes only (see tools/suites.sh):
those marked ``vendor_agnostic`` and the ``memory`` case of every test on
``store_kind``. On PostgreSQL and MariaDB they are deselected, and the
terminal summary says how many and where they run. ``DS_ALL_VENDORS=1``
runs them on any database.
"""

from __future__ import annotations

import os
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

#: Fixtures that give a test the database: a vendor-agnostic test must use none of them.
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "live_server",
        "admin_client",
        "admin_user",
        "django_user_model",
        "django_username_field",
        "durable_store",
    }
)
AGNOSTIC_WHERE = "the SQLite passes of tools/suites.sh (.venv, .venv-alt and .venv-dj60)"


def is_vendor_agnostic(item: pytest.Item) -> bool:
    """Tell whether ``item`` cannot depend on the database vendor: it is marked
    ``vendor_agnostic``, or it is the ``memory`` case of a ``store_kind`` test
    (no ``django_db`` mark, so pytest-django refuses it any database access)."""
    if item.get_closest_marker("vendor_agnostic"):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("store_kind") == "memory"


#: The test users' password hasher: the default PBKDF2 spends about 0.35 s of CPU
#: on each password it makes or checks, and the admin and browser tests make
#: one per test (admin_user, create_user), in every pass. No test checks the
#: hasher; a worker or server process started by a test keeps its own settings.
FAST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _empty_tables_with_delete() -> None:
    """Empty the tables after a transactional test with ``DELETE``, not ``TRUNCATE``, on
    PostgreSQL. Django's flush (run by pytest-django after every ``transaction=True``
    test) truncates every table in one statement; PostgreSQL gives each truncated table
    and index a new file, about 50 ms for the app's 24 tables when they hold a few rows,
    where a ``DELETE`` of each takes 2 ms: a fifth of a PostgreSQL pass's time went to
    teardowns. Django makes its foreign keys ``DEFERRABLE INITIALLY DEFERRED`` and runs
    the flush in one transaction, so the order of the deletes does not matter; MariaDB
    and SQLite already delete (Django's own choice there). A flush that resets
    sequences keeps Django's ``TRUNCATE``."""
    if connection.vendor != "postgresql":
        return
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(
        self: DatabaseOperations, style: Any, tables: Any, *, reset_sequences: bool = False, allow_cascade: bool = False
    ) -> list[str]:
        if reset_sequences or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return [f"DELETE FROM {self.quote_name(table)};" for table in tables]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    """Use a fast password hasher for the whole run (pytest-django has set Django up),
    and empty tables with ``DELETE`` after transactional tests on PostgreSQL."""
    from django.test.utils import override_settings

    override_settings(PASSWORD_HASHERS=FAST_PASSWORD_HASHERS).enable()
    _empty_tables_with_delete()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a vendor-agnostic test that asks for the database; on PostgreSQL and
    MariaDB, deselect the vendor-agnostic tests (they run in the SQLite passes)."""
    agnostic = [item for item in items if is_vendor_agnostic(item)]
    for item in agnostic:
        uses = DATABASE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("django_db") or uses:
            raise pytest.UsageError(
                f"{item.nodeid} is vendor-agnostic but uses the database ({', '.join(sorted(uses)) or 'django_db'}):"
                " drop the vendor_agnostic mark or the database"
            )
    if connections["default"].vendor == "sqlite" or os.environ.get("DS_ALL_VENDORS") == "1" or not agnostic:
        return
    chosen = set(map(id, agnostic))
    items[:] = [item for item in items if id(item) not in chosen]
    config.hook.pytest_deselected(items=agnostic)
    config.stash[_DESELECTED] = len(agnostic)


_DESELECTED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if count := config.stash.get(_DESELECTED, 0):
        terminalreporter.write_line(
            f"{count} vendor-agnostic tests deselected on {connections['default'].vendor}:"
            f" they run in {AGNOSTIC_WHERE} (DS_ALL_VENDORS=1 runs them here)"
        )


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


def spawn_result(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start ``target()`` on a daemon thread (:func:`spawn`); the list gets what it
    returned, or the exception it raised, for the test to report."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(target())
        except BaseException as exc:  # reported by the test
            result.append(exc)

    return spawn(run), result
