"""Dispatchers: the embedded worker starts by itself (section 6)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import ThreadDispatcher
from durable_singleton.engine import Engine, build_engine


@pytest.mark.django_db(transaction=True)
def test_thread_dispatch_starts_its_workers_on_first_dispatch(registry: Registry) -> None:
    """With DISPATCH "thread", a start is executed with nothing else to run."""
    registry.add("plain", "1", lambda ctx, i: i * 2, singleton={"key": lambda i: "k"})
    settings = Settings.from_mapping({"DISPATCH": "thread", "TICK_SECONDS": 0.2})
    engine: Engine = build_engine(settings)
    engine.registry = registry
    dispatcher: Any = engine.dispatcher
    assert isinstance(dispatcher, ThreadDispatcher) and not dispatcher._workers
    try:
        runs = [engine.start("plain", n) for n in range(3)]
        deadline = time.monotonic() + 20
        while any(engine.get(r.run_id).status != "completed" for r in runs):
            assert time.monotonic() < deadline, "the embedded worker never ran the runs"
            time.sleep(0.05)
        assert [engine.get(r.run_id).output for r in runs] == [0, 2, 4]
    finally:
        dispatcher.stop()
