"""The model-based tests of the flow controls find a store that breaks them
(issue #33: X6, X7, X8).

Each test replays a short sequence of the machine's rules, step by step, on an
in-memory store broken in one rule (a throttle window too short, a debounce
that never folds, that folds into a run due already or keeps the older input,
a claim that ignores ``not_before``, a fair quota that ignores priority), and
asserts that the machine's check names the rule broken; the same sequence on
the sound store passes. The random machines run the same checks on every store
(tests/model/test_flow_control_model.py, tests/model/test_quota_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from durable_singleton import admission
from durable_singleton.stores import memory
from durable_singleton.stores.base import Debounced
from durable_singleton.stores.memory import MemoryStore
from tests.model.test_flow_control_model import FlowControl
from tests.model.test_quota_model import QuotaProtocol

pytestmark = pytest.mark.vendor_agnostic


class _Pick:
    """A rule's ``data`` that draws the value given."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def draw(self, strategy: Any) -> Any:
        return self.value


@contextmanager
def _machine(protocol: type, store: type[MemoryStore] = MemoryStore) -> Iterator[Any]:
    machine = type("Machine", (protocol,), {"make_store": staticmethod(lambda clock: store(clock=clock))})()
    yield machine


class _KeepsTheOlderInput(MemoryStore):
    """Folds a debounced start but keeps the run's older input (breaks X7: the newest wins)."""

    def start_debounced(self, run: Any, **kwargs: Any) -> Debounced:
        inputs = {r.run_id: r.input for r in self._runs.values()}
        result = super().start_debounced(run, **kwargs)
        if result.run.run_id in inputs:
            with self._critical():
                kept = self._runs[result.run.run_id].evolve(input=inputs[result.run.run_id])
                self._runs[kept.run_id] = kept
        return result


def _open_past_its_start(run: Any, now: Any) -> bool:
    """A debounced run open an hour past its start time (breaks X7a)."""
    return _debounce_open(run, now - timedelta(hours=1))


_debounce_open = admission.debounce_open


def _short_window(limit: int, admissions: Any, period: float, now: Any, *, paused: bool) -> Any:
    return admission.throttle_room(limit, admissions, period / 2, now, paused=paused)


def _over_the_rate(m: Any) -> None:
    """Three starts of throttle key A: two admitted, the third parked; 40 s pass; its turn."""
    m.start_throttled(key="A", count=3, priority=0)
    m.turn_each()
    m.time_passes(seconds=40.0)
    m.turn_each()
    m.admissions_per_window_within_the_limit()


def _a_burst(m: Any) -> None:
    """Two starts of debounce key X, 7 s apart: the second folds into the first's run."""
    m.start_debounced(key="X")
    m.time_passes(seconds=7.0)
    m.start_debounced(key="X")
    m.one_open_run_per_debounce_key()


def _after_the_quiet_period(m: Any) -> None:
    """A start of debounce key X, 40 s (past its quiet period) and a second start."""
    m.start_debounced(key="X")
    m.time_passes(seconds=40.0)
    m.start_debounced(key="X")


def _an_early_claim(m: Any) -> None:
    """A start of debounce key X and its turn at once, 30 s before its start time."""
    m.start_debounced(key="X")
    m.turn_each()


@pytest.mark.parametrize(
    ("sequence", "patch", "store", "says"),
    [
        (_over_the_rate, (memory, "throttle_room", _short_window), MemoryStore, r"X6[bc]"),
        (_a_burst, (memory, "debounce_open", lambda run, now: False), MemoryStore, "made a second run"),
        (_a_burst, None, _KeepsTheOlderInput, "not the newest start's"),
        (_after_the_quiet_period, (memory, "debounce_open", _open_past_its_start), MemoryStore, "X7a"),
        (_an_early_claim, (memory, "is_due", lambda not_before, now: True), MemoryStore, "before its not_before"),
    ],
    ids=["throttle-window", "debounce-no-fold", "debounce-old-input", "debounce-late-fold", "early-claim"],
)
def test_the_flow_control_machine_finds_a_broken_store(
    monkeypatch: pytest.MonkeyPatch,
    sequence: Callable[[Any], None],
    patch: tuple[Any, str, Any] | None,
    store: type[MemoryStore],
    says: str,
) -> None:
    """X6b, X6c, X7, X7a, X5: each sequence passes on the sound store and fails, naming the
    rule, on a store broken in that rule."""
    with _machine(FlowControl) as sound:
        sequence(sound)
    if patch is not None:
        monkeypatch.setattr(*patch)
    with _machine(FlowControl, store) as broken, pytest.raises(AssertionError, match=says):
        sequence(broken)


def _fair_priority(m: Any) -> None:
    """Tenants a and b each hold a slot of pool-fair P (limit 2, tags 0); a then b start one
    more (tags 1000, b's of priority 1); a's holder settles: its handoff admits b's (X8c)."""
    m.start(workflow="fair", key="P", tenant="a", priority=0)
    m.start(workflow="fair", key="P", tenant="b", priority=0)
    first, second = m.created
    m.turn(_Pick(first))
    m.turn(_Pick(second))
    m.start(workflow="fair", key="P", tenant="a", priority=0)
    m.start(workflow="fair", key="P", tenant="b", priority=1)
    m.settle(_Pick(first))
    m.turn(_Pick(m.created[2]))
    m.turn(_Pick(m.created[3]))


def test_the_quota_machine_finds_a_fair_quota_that_ignores_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """X8a, X8c: two waiters of one tag, the younger of priority 1: the handoff admits it
    first; a store whose fair order ignores priority admits the older one, and the
    machine's order check names it."""
    with _machine(QuotaProtocol) as sound:
        _fair_priority(sound)
        sound.teardown()

    def fifo_order(self: MemoryStore, name: str, members: Any, now: Any, ttls: Any = None) -> list[str]:
        waiters = [r for r in members if r.quota_slot == "waiter"]
        ordered = sorted(waiters, key=lambda r: (self._quota_tags.get((r.run_id, name), 0), r.created_at, r.run_id))
        return [r.run_id for r in ordered]

    monkeypatch.setattr(MemoryStore, "_quota_order", fifo_order)
    with _machine(QuotaProtocol) as broken:
        try:
            with pytest.raises(AssertionError, match="X8c"):
                _fair_priority(broken)
        finally:
            from durable_singleton import signals

            signals.run_admitted.disconnect(broken._admitted)
