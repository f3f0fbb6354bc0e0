"""A store failure in the re-check after a park never strands the run until its fallback.

Found by the breaker of issue #12. A body that waits for a signal reads the
buffered signals, finds none and parks. A signal sent in between (after the
read, before the park commits) finds the run still ``running``, so
``engine.signal`` sends no turn; the engine's re-check after the park is what
sees it and sends the turn (no lost wake-up, D2). When that re-check's store
call failed (a connection killed, a database restarting), the exception left
the turn and the run stayed parked until its fallback ``wake_at``
(``SIGNAL_FALLBACK_SECONDS``, 300 s by default) although its signal had
arrived. The same holds for ``call_child``'s re-check of its child (D7).
"""

from __future__ import annotations

from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine


class _SignalInTheWindow:
    """A store on which a signal arrives right after the body's read of the
    signals, and the engine's re-check after the park fails."""

    engine: Engine
    reads = 0

    def load_signals(self, run_id: str) -> Any:
        self.reads += 1
        if self.reads == 2:  # the engine's re-check, after the park committed
            raise ConnectionError("server closed the connection unexpectedly")
        signals = super().load_signals(run_id)  # type: ignore[misc]
        if self.reads == 1:  # the body found nothing; the signal arrives before the park
            self.engine.signal(run_id, "go", {"n": 1})
        return signals


class WindowMemoryStore(_SignalInTheWindow, MemoryStore):
    pass


class WindowDjangoStore(_SignalInTheWindow, DjangoStore):
    pass


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_failed_recheck_after_a_park_sends_the_turn_anyway(store_kind: str) -> None:
    """D2, R6: the re-check could not tell whether the signal arrived, so the
    engine sends the turn (a spare turn is harmless, R6): the run consumes
    its signal and completes at once, not after SIGNAL_FALLBACK_SECONDS."""
    store: Any = WindowMemoryStore() if store_kind == "memory" else WindowDjangoStore()
    engine = make_engine(store, registry=Registry())
    store.engine = engine
    engine.registry.add("recheck", "1", lambda ctx, input: ctx.wait_for_signal("go"))
    run = engine.start("recheck", None, run_id="recheck-1")
    assert engine.execute(run.run_id) == "suspended"
    assert store.reads == 2, "the engine re-checked after the park"
    engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.output) == ("completed", {"n": 1}), f"stranded until {done.wake_at}"


class LostParentReadMemoryStore(MemoryStore):
    """The in-memory store whose next ``get_run`` of ``victim`` raises ``ConnectionError``, when armed."""

    victim = ""
    armed = False

    def get_run(self, run_id: str) -> Any:
        if self.armed and run_id == self.victim:
            self.armed = False
            raise ConnectionError("connection reset by peer")
        return super().get_run(run_id)


def test_a_childs_end_wakes_its_parent_even_when_the_parents_read_fails() -> None:
    """D7, R6: the child completes while its parent waits on it; the read of
    the parent that decides whether to wake it fails (the store blinked). The
    parent is sent its turn anyway (a spare turn is harmless) and completes
    at once, not after SIGNAL_FALLBACK_SECONDS."""
    store = LostParentReadMemoryStore()
    engine = make_engine(store, registry=Registry())

    def child(ctx: Any, input: Any) -> str:
        store.victim, store.armed = "parent-1", True  # the parent's read after this child settles fails
        return "kid"

    engine.registry.add("kid", "1", child)
    engine.registry.add("parent", "1", lambda ctx, input: ctx.call_child("kid"))
    run = engine.start("parent", None, run_id="parent-1")
    engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.output) == ("completed", "kid"), f"the parent waits until {done.wake_at}"
