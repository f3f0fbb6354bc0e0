"""Signals with a caller's id: D2, S18 (issue #18 item 13).

A client that retries ``engine.signal`` after a lost reply passes the same
``signal_id``: the signal is stored once, across threads and processes (the
``ds_signal_once`` constraint on the Django store, the store's lock in memory);
the first signal sent with an id wins.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import ValidationError
from tests.conftest import Monitor, run_threads
from tests.helpers import audited


def test_a_retried_signal_with_its_id_is_stored_once_first_wins(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """D2: the same signal_id twice stores one signal (the first payload); no id
    stores every call; a retry after the run finished still returns the run."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="r")
    engine.signal("r", "go", 1, signal_id="s-1")
    engine.signal("r", "go", 2, signal_id="s-1")
    engine.signal("r", "go", 3)
    engine.signal("r", "go", 3)
    assert [s.payload for s in engine.store.load_signals("r")] == [1, 3, 3]
    engine.signal("r", "other", 4, signal_id="s-1")  # another name or payload: first wins
    assert len(engine.store.load_signals("r")) == 3
    engine.dispatcher.drain()
    assert engine.signal("r", "go", 1, signal_id="s-1").run_id == "r"
    with pytest.raises(ValidationError):
        engine.signal("r", "go", 1, signal_id="x" * 192)


def test_signal_with_start_retried_with_its_signal_id_starts_once_and_signals_once(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S18, D2: a retried signal_with_start with the same signal_id starts one
    run and buffers one signal."""
    audited(registry, monitor)
    for _ in range(3):
        engine.signal_with_start("wf", {"k": "K"}, run_id="sws", signal="go", payload=1, signal_id="once")
    assert len(engine.store.load_signals("sws")) == 1


def test_racing_senders_of_one_signal_id_store_it_once(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D2: eight threads (separate connections, real commits) sending the same
    signal_id at once store one signal per id, for each of 10 ids."""
    audited(registry, monitor)
    engines = [make() for _ in range(8)]
    engines[0].start("wf", {"k": "K"}, run_id="r")

    def sender(i: int) -> None:
        for n in range(10):
            engines[i].signal("r", "go", {"by": i, "n": n}, signal_id=f"s-{n}")

    results = run_threads(8, sender)
    assert not [r for r in results if isinstance(r, BaseException)], results
    stored = engines[0].store.load_signals("r")
    assert sorted(s.payload["n"] for s in stored) == list(range(10))
