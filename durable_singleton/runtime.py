"""The composition root: builds the store, the dispatcher and the engine from
settings. Nothing below it imports it (STYLE: one composition root)."""

from __future__ import annotations

import threading

from django.utils.module_loading import import_string

from .conf import Settings, get_settings
from .dispatch import build_dispatcher
from .engine import Engine
from .exceptions import ConfigurationError
from .stores.base import BaseStore, RetryPolicy

__all__ = ["build_engine", "build_store", "get_engine"]

_STORES = {
    "django": "durable_singleton.stores.django.DjangoStore",
    "memory": "durable_singleton.stores.memory.MemoryStore",
}

_engines: dict[Settings, Engine] = {}
_engines_lock = threading.Lock()


def build_store(settings: Settings) -> BaseStore:
    """Return the store named by ``settings.STORE``: "django", "memory" or a dotted path
    to a :class:`~durable_singleton.stores.base.BaseStore` subclass.

    Raises :class:`~durable_singleton.exceptions.ConfigurationError`.
    """
    path = _STORES.get(settings.STORE, settings.STORE)
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(
            f"DURABLE_SINGLETON['STORE'] must be 'django', 'memory' or a dotted path to a store class, "
            f"got {settings.STORE!r}: {exc}"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, BaseStore)):
        raise ConfigurationError(f"DURABLE_SINGLETON['STORE'] = {settings.STORE!r} is not a BaseStore subclass")
    retry = RetryPolicy(
        settings.ADMISSION_RETRY_SECONDS, settings.ADMISSION_RETRY_JITTER_SECONDS, settings.BACKLOG_RETRY_SECONDS
    )
    # The two stores of this package take their options from settings (the
    # class is imported again by name so its constructor is typed); a store
    # named by another dotted path is built without arguments.
    if path == _STORES["django"]:
        from .stores.django import DjangoStore

        return DjangoStore(
            settings.DATABASE,
            claim_retries=settings.CLAIM_RETRIES,
            retry=retry,
            redelivery_seconds=settings.REDELIVERY_SECONDS,
        )
    if path == _STORES["memory"]:
        from .stores.memory import MemoryStore

        return MemoryStore(retry=retry, redelivery_seconds=settings.REDELIVERY_SECONDS)
    return cls()


def build_engine(settings: Settings) -> Engine:
    """Build an engine from ``settings``: its store and its dispatcher."""
    store = build_store(settings)
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
