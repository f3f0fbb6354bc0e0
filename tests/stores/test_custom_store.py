"""A custom store that implements only what BaseStore declares abstract (and
its claim): the contract holds on it, and every feature either works or
refuses with a typed error its capability flag announces (#16 defect 6; S13,
K2, K3, K4, S17).

Before #16 the key controls and explain read ``store.controls``,
``store._lock`` and ``store.db`` by ``getattr``: on such a store they raised
AttributeError.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.exceptions import UnsupportedByStoreError
from durable_singleton.schedule_specs import Schedule
from durable_singleton.stores.base import BaseStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from durable_singleton.testing.conformance import StoreConformance

pytestmark = pytest.mark.vendor_agnostic  # an in-memory store behind the seam


class MinimalStore(BaseStore):
    """Every abstract method of BaseStore, and the atomic claim (``begin_turn``),
    by delegation to a private MemoryStore: nothing else of the seam."""

    def __init__(self) -> None:
        self._inner = MemoryStore()


for _name in sorted({*BaseStore.__abstractmethods__, "begin_turn"}):

    def _delegate(self: MinimalStore, *args: Any, _name: str = _name, **kwargs: Any) -> Any:
        return getattr(self._inner, _name)(*args, **kwargs)

    _delegate.__name__ = _name
    setattr(MinimalStore, _name, _delegate)
MinimalStore.__abstractmethods__ = frozenset()


class TestMinimalStore(StoreConformance):
    """The conformance suite passes on a store that implements only the seam's abstract methods."""

    @pytest.fixture
    def store(self) -> BaseStore:
        return MinimalStore()


@pytest.fixture
def engine() -> Any:
    registry = Registry()
    registry.add(
        "sync",
        "1",
        lambda ctx, input: "done",
        singleton={"key": lambda i: i["k"]},
        schedules=[Schedule(name="every-minute", every=60, input={"k": "s"})],
    )
    return make_engine(MinimalStore(), registry=registry)


def test_the_minimal_store_declares_no_key_controls_and_keeps_schedules_in_memory() -> None:
    """The flags tell what the store offers before any call (STYLE: capability flags, not probes)."""
    store = MinimalStore()
    assert store.supports_key_controls is False
    assert store.supports_schedules is False
    assert store.database is None


def test_a_key_control_change_raises_a_typed_error_and_writes_nothing(engine: Any) -> None:
    """K2 on a store without key controls: UnsupportedByStoreError, not AttributeError;
    the key still admits (nothing was paused)."""
    with pytest.raises(UnsupportedByStoreError, match="supports_key_controls"):
        engine.pause_key("sync", "a", by="ops")
    with pytest.raises(UnsupportedByStoreError):
        engine.override_workflow_limit("sync", 3)
    run = engine.start("sync", {"k": "a"})
    engine.dispatcher.drain()
    assert engine.get(run.run_id).status == "completed"


def test_key_control_reads_say_no_key_is_paused_or_overridden(engine: Any) -> None:
    """K2 reads on a store without key controls: the declared limit is in force."""
    state = engine.key_controls("sync", "a")
    assert (state.paused, state.limit_override, state.limit) == (False, None, 1)
    assert engine.control_history("sync", "a") == []


def test_explain_works_on_the_minimal_store(engine: Any) -> None:
    """K3: a holder and its waiter are explained through the seam alone."""
    holder = engine.start("sync", {"k": "a"})
    waiter = engine.start("sync", {"k": "a"})
    turn = engine.store.begin_turn(
        holder.run_id, "t", lease_seconds=30, limits=engine.limits(), max_recoveries=3, retry=engine._retry_policy()
    )
    assert turn.run.admitted
    engine.execute(waiter.run_id)
    told = engine.explain(waiter.run_id)
    assert told.position == 1
    assert [h.run_id for h in told.holders] == [holder.run_id]
    assert told.paused is False


def test_audit_and_retention_report_on_the_minimal_store(engine: Any) -> None:
    """K4 and O2 on a store outside Django's databases: an empty report, no error."""
    from durable_singleton.retention import purge_finished

    assert engine.audit_slots().findings == []
    assert purge_finished(engine, before=engine.now()).runs == 0


def test_schedules_fire_on_the_minimal_store(engine: Any) -> None:
    """S17: the state is kept in the process's memory beside the store; the tick fires the window once."""
    engine.tick()  # declares the schedule: its first window is the next minute
    later = engine.now() + timedelta(seconds=61)
    engine.now = lambda: later
    engine.tick()
    engine.tick()
    started = [r for r in engine.store.list_runs() if r.run_id.startswith("schedule:every-minute:")]
    assert len(started) == 1
