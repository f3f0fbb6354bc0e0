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

Every fixture imports Django lazily, so the plugin loads in any project.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ..engine import Engine

__all__ = ["durable_drain", "durable_engine"]

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
