"""A pytest plugin for projects that use durable_singleton (entry point ``pytest11``).

Installed with the package, so every project's pytest has its fixtures:

``durable_engine``
    An :class:`~durable_singleton.engine.Engine` on a fresh in-memory store
    with the manual dispatcher, and for the test's duration the default
    engine too: ``get_engine()``, ``Wf.dispatch(...)``, the django.tasks
    backend and views all start runs on it. No database is touched. The
    workflows are the process's registered ones.

``durable_drain``
    A callable ``durable_drain(max_turns=10000, tick=True) -> int`` that runs
    the queued turns to completion on the test's thread, then ticks and
    drains again while a tick dispatches due runs (released waiters, due
    retries); returns the number of turns executed. A run sleeping until a
    later time stays parked: give the engine a clock
    (``durable_singleton.testing.make_engine(clock=...)``) to move it on.

``durable_store``
    A fresh store of the kind named by ``--durable-store`` (or the ini option
    ``durable_store``): ``memory`` (the default), ``django`` (the test
    database, with real commits: the tests that use the fixture are marked
    ``django_db(transaction=True)``) or the dotted path of a
    :class:`~durable_singleton.stores.base.BaseStore` subclass, as the
    ``STORE`` setting takes.

The store conformance suite (:mod:`durable_singleton.testing.conformance`)
runs on that store with no code::

    pytest --pyargs durable_singleton.testing.test_store_conformance --durable-store=myapp.stores.MyStore

Every fixture imports Django lazily, so the plugin loads in any project.

Before pytest-django drops the test database at the end of the session, the
plugin stops the threads the package started in the process (the embedded
worker's workers and tick, the lease renewer), each closing its connections
(:func:`~durable_singleton.runtime.stop_threads`): on PostgreSQL a connection
left open makes the drop fail ("being accessed by other users").
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..engine import Engine
    from ..stores.base import BaseStore

__all__ = [
    "durable_drain",
    "durable_engine",
    "durable_store",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_fixture_setup",
]

#: Ticks ``durable_drain`` runs at most after its first drain.
MAX_TICK_ROUNDS = 100


@pytest.fixture
def durable_engine() -> Iterator[Engine]:
    """Return the default engine on a fresh in-memory store with the manual dispatcher."""
    from django.conf import settings
    from django.test import override_settings

    from ..runtime import get_engine
    from . import make_engine

    overrides = {**(getattr(settings, "DURABLE_SINGLETON", None) or {}), "STORE": "memory", "DISPATCH": "manual"}
    with override_settings(DURABLE_SINGLETON=overrides):
        engine = get_engine()
        # The default engine is built once per settings: give it a fresh store
        # and queue, so no run of an earlier test is seen.
        fresh = make_engine(
            "memory",
            registry=engine.registry,
            namespace=engine.namespace,
            scope_reads=engine.scope_reads,
            **{k: v for k, v in overrides.items() if k not in ("STORE", "DISPATCH")},
        )
        dispatcher: Any = fresh.dispatcher  # a ManualDispatcher
        engine.store = fresh.store
        engine.dispatcher = dispatcher
        dispatcher.bind(engine)
        yield engine


@pytest.fixture
def durable_drain(durable_engine: Engine) -> Callable[..., int]:
    """Return ``drain(max_turns=10000, tick=True)``: run queued turns (and due ones) to completion."""

    def drain(max_turns: int = 10_000, tick: bool = True) -> int:
        dispatcher: Any = durable_engine.dispatcher
        turns = int(dispatcher.drain(max_turns))
        for _ in range(MAX_TICK_ROUNDS if tick else 0):
            if not durable_engine.tick().dispatched:
                break
            turns += int(dispatcher.drain(max_turns - turns))
        return turns

    return drain


def _stop_threads() -> None:
    from ..runtime import stop_threads

    stop_threads()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(
    fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest
) -> Generator[None, object, object]:
    """Once pytest-django's ``django_db_setup`` is set up, add a finalizer to it that
    stops the package's threads: finalizers run last added first, so before the
    fixture's own teardown drops the test database (O1)."""
    result = yield
    if fixturedef.argname == "django_db_setup":
        fixturedef.addfinalizer(_stop_threads)
    return result


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--durable-store`` and the ini option ``durable_store``."""
    help_text = (
        "store of the durable_store fixture and the store conformance suite: 'memory', 'django' "
        "or the dotted path of a BaseStore subclass"
    )
    parser.getgroup("durable_singleton").addoption("--durable-store", dest="durable_store", help=help_text)
    parser.addini("durable_store", help_text, default="memory")


def _store_name(config: pytest.Config) -> str:
    return str(config.getoption("durable_store") or config.getini("durable_store") or "memory")


def _on_the_database(name: str) -> bool:
    """Tell whether store ``name`` is the Django store (or a subclass): it needs the test database."""
    from django.utils.module_loading import import_string

    from ..stores.django import DjangoStore

    try:
        store_class = import_string("durable_singleton.stores.django.DjangoStore" if name == "django" else name)
    except ImportError:
        return False  # "memory", or a bad path that the fixture reports
    return isinstance(store_class, type) and issubclass(store_class, DjangoStore)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the tests that use ``durable_store`` the test database with real commits when the
    store is the Django store (turns are sent after commit)."""
    if not any("durable_store" in getattr(item, "fixturenames", ()) for item in items):
        return
    if not _on_the_database(_store_name(config)):
        return
    for item in items:
        if "durable_store" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.django_db(transaction=True))


@pytest.fixture
def durable_store(request: pytest.FixtureRequest) -> BaseStore:
    """Return a fresh store named by ``--durable-store`` (default ``memory``).

    Raises :class:`~durable_singleton.exceptions.ConfigurationError` for a
    name that is neither ``memory``, ``django`` nor a store class's dotted path.
    """
    from ..conf import Settings
    from ..runtime import build_store

    return build_store(Settings.from_mapping({"STORE": _store_name(request.config)}))
