"""Helpers for users' tests: an engine on the in-memory (or Django) store
whose turns a test executes on its own thread.

Example::

    from durable_singleton.testing import make_engine

    engine = make_engine()              # in-memory store, manual dispatcher
    run = engine.start("sync-inventory", {"store_id": "A"})
    engine.dispatcher.drain()           # execute every queued turn
    assert engine.get(run.run_id).status == "completed"
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..conf import Settings
from ..definitions import Registry, registry
from ..dispatch import ManualDispatcher
from ..engine import Engine
from ..runtime import build_store
from ..stores.memory import MemoryStore

__all__ = ["ManualDispatcher", "make_engine"]


def make_engine(
    store: str | Any = "memory",
    *,
    registry: Registry = registry,
    namespace: str = "default",
    scope_reads: bool = False,
    clock: Callable[[], datetime] | None = None,
    **settings: Any,
) -> Engine:
    """Return an engine with a :class:`ManualDispatcher`.

    ``store``: ``"memory"``, ``"django"`` or a store object. ``settings``
    override :data:`durable_singleton.conf.DEFAULTS` (e.g. ``LEASE_SECONDS=5``).
    """
    conf = Settings.from_mapping({"DISPATCH": "manual", **settings})
    if isinstance(store, str):
        store = build_store(Settings.from_mapping({"DISPATCH": "manual", "STORE": store, **settings}))
        if clock is not None and isinstance(store, MemoryStore):
            store.clock = clock  # the in-memory store's clock is the one clock of its leases (R5)
    dispatcher = ManualDispatcher(store)
    engine = Engine(
        store, dispatcher, registry=registry, namespace=namespace, scope_reads=scope_reads, settings=conf, clock=clock
    )
    dispatcher.bind(engine)
    return engine
