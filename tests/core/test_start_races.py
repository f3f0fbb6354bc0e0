"""Racing starts of the same run ids: R3, S16 (issue #18 item 1).

Two callers that start the same run ids at once, by ``start_many`` and
``start`` in any mix, create each run once: ``run_created`` fires once per
run, a turn is sent once per run, and every caller gets back the run the
store holds (the winner's input), never a record built from its own input.
Real commits, one connection per thread, racers lined up on a barrier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from durable_singleton import signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.stores.base import RunRecord
from tests.conftest import Monitor, run_threads
from tests.helpers import audited, counted_per_run

IDS = 40
ROUNDS = 4


@pytest.fixture
def created() -> Iterator[Counter[str]]:
    """Count ``run_created`` per run id, whichever thread sent it."""
    with counted_per_run(signals.run_created) as counts:
        yield counts


def _plain(registry: Registry) -> None:
    registry.add("plain", "1", lambda ctx, input: input)


def _returned(result: Any) -> list[RunRecord]:
    if isinstance(result, BaseException):
        raise result
    return result if isinstance(result, list) else [result]


def _check_round(engine: Engine, results: list[Any], ids: list[str], created: Counter[str], sent: list[str]) -> None:
    stored = {r.run_id: r for r in engine.store.list_runs() if r.run_id in ids}
    assert sorted(stored) == sorted(ids)
    for result in results:
        for record in _returned(result):
            assert not isinstance(record, BaseException), record
            held = stored[record.run_id]
            # The run the store holds: the winner's input and creation time (R3).
            assert (record.input, record.created_at, record.namespace) == (held.input, held.created_at, held.namespace)
    duplicates = {run_id: n for run_id, n in created.items() if run_id in ids and n != 1}
    assert not duplicates, f"run_created fired more than once (or never) for {len(duplicates)} runs: {duplicates}"
    assert Counter(r for r in sent if r in ids) == Counter(ids), "one first turn per run (R3)"


@pytest.mark.parametrize("workflow", ["plain", "capped"])
@pytest.mark.parametrize("mix", ["many+many", "many+start"])
def test_racing_starts_of_the_same_ids_create_each_run_once(
    make: Callable[..., Engine],
    registry: Registry,
    monitor: Monitor,
    created: Counter[str],
    workflow: str,
    mix: str,
) -> None:
    """R3, S16: start_many racing start_many, or start_many racing start, with the
    same run ids: each run is created once (one run_created, one first turn) and
    every caller gets the stored run back, not a record built from its own input.
    On e035ec7 the uncapped batch read the ids back after an INSERT that ignored
    conflicts and reported both callers' rows as created (81-243 duplicates in 8
    races of 40 ids)."""
    _plain(registry)
    audited(registry, monitor, name="capped", max_queue_depth=10_000)
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        ids = [f"{workflow}-{mix}-{round_no}-{n}" for n in range(IDS)]
        sent_before = [len(e.dispatcher.sent) for e in engines]

        def racer(i: int, ids: list[str] = ids) -> Any:
            engine = engines[i]
            inputs = [{"k": "K", "by": i, "n": n} for n in range(IDS)]
            if i == 1 and mix == "many+start":
                return [engine.start(workflow, inp, run_id=run_id) for inp, run_id in zip(inputs, ids, strict=True)]
            return engine.start_many(workflow, inputs, run_ids=ids)

        results = run_threads(2, racer)
        sent = [run_id for e, before in zip(engines, sent_before, strict=True) for run_id in e.dispatcher.sent[before:]]
        _check_round(engines[0], results, ids, created, sent)


@pytest.mark.parametrize("workflow", ["plain", "capped"])
def test_a_batch_repeating_an_id_creates_it_once_and_returns_the_first(
    engine: Engine, registry: Registry, monitor: Monitor, created: Counter[str], workflow: str
) -> None:
    """R3: an id twice in one start_many batch is one run, created from its first
    entry; both places of the batch return that run."""
    _plain(registry)
    audited(registry, monitor, name="capped", max_queue_depth=10)
    out = engine.start_many(workflow, [{"k": "K", "n": 1}, {"k": "K", "n": 2}], run_ids=["dup", "dup"])
    assert [r.input for r in out if isinstance(r, RunRecord)] == [{"k": "K", "n": 1}] * 2
    assert created["dup"] == 1 and engine.dispatcher.sent.count("dup") == 1
    assert engine.get("dup").input == {"k": "K", "n": 1}


@pytest.mark.parametrize("path", ["emit", "signal_with_start"])
def test_racing_emits_and_signal_with_starts_create_each_run_once(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor, created: Counter[str], path: str
) -> None:
    """R3, S16, S18, D8: four callers racing emit with the same event id, or
    signal_with_start with the same run id: one run each, one run_created, and
    every caller gets the stored run (the winner's input); signal_with_start
    buffers each caller's signal on that one run."""
    registry.add("on-a", "1", lambda ctx, i: i, events=["evt"])
    registry.add("on-b", "1", lambda ctx, i: i, events=["evt"], singleton={"key": lambda i: "K", "max_queue_depth": 50})
    engines = [make() for _ in range(4)]

    def racer(i: int) -> Any:
        if path == "emit":
            return engines[i].emit("evt", {"by": i}, event_id="e1")
        return engines[i].signal_with_start("on-b", {"by": i}, run_id="sws", signal="go", payload=i)

    results = run_threads(4, racer)
    ids = ["sws"] if path == "signal_with_start" else [r.run_id for r in _returned(results[0])]
    assert len(ids) == (1 if path == "signal_with_start" else 2)
    sent = [run_id for e in engines for run_id in e.dispatcher.sent]
    _check_round(engines[0], results, ids, created, sent)
    if path == "signal_with_start":
        assert sorted(s.payload for s in engines[0].store.load_signals("sws")) == [0, 1, 2, 3]
