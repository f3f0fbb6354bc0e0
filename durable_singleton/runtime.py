"""The composition root: builds the store, the dispatcher and the engine from
settings. Nothing below it imports it (STYLE: one composition root)."""

from __future__ import annotations

import threading

from .conf import Settings, get_settings
from .dispatch import build_dispatcher
from .dispatcher import Dispatcher
from .engine import Engine
from .exceptions import ConfigurationError
from .pull import PullDispatcher
from .stores.base import BaseStore
from .stores.loading import STORE_ALIASES, store_class

__all__ = ["build_engine", "build_store", "get_engine", "stop_threads"]

_engines: dict[Settings, Engine] = {}
_engines_lock = threading.Lock()


def build_store(settings: Settings) -> BaseStore:
    """Return the store named by ``settings.STORE``: "django", "memory" or a dotted path
    to a :class:`~durable_singleton.stores.base.BaseStore` subclass, resolved by
    :func:`~durable_singleton.stores.loading.store_class` (as system check E002 does).

    Raises :class:`~durable_singleton.exceptions.ConfigurationError`.
    """
    cls = store_class(settings.STORE)
    path = STORE_ALIASES.get(settings.STORE, settings.STORE)
    # The two stores of this package take their options from settings (the
    # class is imported again by name so its constructor is typed); a store
    # named by another dotted path is built without arguments.
    if path == STORE_ALIASES["django"]:
        from .stores.django import DjangoStore

        return DjangoStore(
            settings.DATABASE,
            claim_retries=settings.CLAIM_RETRIES,
            redelivery_seconds=settings.REDELIVERY_SECONDS,
        )
    if path == STORE_ALIASES["memory"]:
        from .stores.memory import MemoryStore

        return MemoryStore(redelivery_seconds=settings.REDELIVERY_SECONDS)
    return cls()


def build_engine(settings: Settings) -> Engine:
    """Build an engine from ``settings``: its store and its dispatcher."""
    store = build_store(settings)
    dispatcher: Dispatcher
    if settings.DISPATCH == "worker":  # turn notices in the database, taken by durable_worker (O1)
        if store.database is None:
            raise ConfigurationError(f"DISPATCH 'worker' needs the Django store, not STORE {settings.STORE!r} (E007)")
        dispatcher = PullDispatcher(
            store,
            settings.WORKER_THREADS,
            settings.TICK_SECONDS,
            poll_seconds=settings.WORKER_POLL_SECONDS,
            heartbeat_seconds=settings.WORKER_HEARTBEAT_SECONDS,
            dead_seconds=settings.WORKER_DEAD_SECONDS,
        )
    else:
        dispatcher = build_dispatcher(settings, store)
    engine = Engine(store, dispatcher, settings=settings)
    dispatcher.bind(engine)
    return engine


def get_engine() -> Engine:
    """Return the default engine for the current Django settings (built once per settings)."""
    settings = get_settings()
    with _engines_lock:
        engine = _engines.get(settings)
        if engine is None:
            engine = _engines[settings] = build_engine(settings)
        return engine


def stop_threads(timeout: float = 10.0) -> None:
    """Stop the threads this package started in this process, each closing its
    Django connections as it ends (O1): the embedded worker (worker and tick
    threads, :meth:`ThreadDispatcher.stop <durable_singleton.dispatch.ThreadDispatcher.stop>`)
    of every engine :func:`get_engine` built, then the lease renewer
    (:func:`~durable_singleton.leases.stop_renewer`). Waits at most about
    ``timeout`` seconds for each; a turn still in hand keeps its lease, which
    expires (R5). The package's pytest plugin calls it before pytest-django
    drops the test database, which fails on PostgreSQL while a connection is open.
    """
    from .dispatch import ThreadDispatcher
    from .leases import stop_renewer

    with _engines_lock:
        engines = list(_engines.values())
    for engine in engines:
        dispatcher = engine.dispatcher
        if isinstance(dispatcher, ThreadDispatcher) and (dispatcher.running or dispatcher.threads_alive):
            dispatcher.stop(timeout)
    stop_renewer(timeout)
