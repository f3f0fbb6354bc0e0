"""Every grant is announced: ``run_admitted`` and the admissions metric (S5, S7, O4).

A claim that runs its own body and grants the other free slots of its key
sent the granted runs' turns without ``run_admitted``: the admissions metric
and the admission log missed each run admitted that way, while a settle's, a
release's and the tick's grants were announced (issue 32)."""

from __future__ import annotations

from typing import Any

from durable_singleton import metrics, signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine

from ..helpers import connected, two_waiters_behind_freed_slots


def _admissions(workflow: str) -> float:
    """The admissions counter of ``workflow``, read from the counter alone: the registry's
    collection would also run the queue gauges, which read the database (no database here
    for the memory store)."""
    for family in metrics.ADMISSIONS.collect():
        for sample in family.samples:
            if sample.name == "durable_singleton_admissions_total" and sample.labels == {"workflow": workflow}:
                return float(sample.value)
    return 0.0


def test_a_running_claim_announces_each_waiter_it_grants(engine: Engine, registry: Registry) -> None:
    """S5, S7, O4: limit 2, two holders end by a path that grants nothing, W1
    and W2 wait. W1's claim admits W1, runs its body and grants the second free
    slot to W2: ``run_admitted`` fires once for W1 and once for W2 (not again at
    W2's own turn), and the admissions metric counts both."""
    registry.add("grants", "1", lambda ctx, i: None, singleton={"key": lambda i: "K", "limit": 2})
    two_waiters_behind_freed_slots(engine, "grants")
    metrics.connect()
    before = _admissions("grants")
    admitted: list[str] = []

    def receiver(sender: Any, run: Any, **kwargs: Any) -> None:
        admitted.append(run.run_id)

    with connected(receiver, signals.run_admitted):
        assert engine.execute("W1") == "completed"
        assert sorted(admitted) == ["W1", "W2"], "the claim's grant of W2 is announced"
        assert engine.execute("W2") == "completed"
    assert sorted(admitted) == ["W1", "W2"], "each admission once"
    assert _admissions("grants") - before == 2
