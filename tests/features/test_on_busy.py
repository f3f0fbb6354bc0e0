"""What a start does on a busy key: ``Singleton(on_busy=...)`` (X1; issue #20 item 1).

"skip" is the queue cap at depth 0 (S15), named; "replace_queued" keeps at
most one waiter per key, cancelling the waiters queued behind the holders
(code ``replaced``); "cancel_in_progress" also asks the holders to stop at
their next step boundary (D6) and is admitted when they settle. Each decision
is made under the key's lock with the start's insert (S5), so every race
here (two starts at once, a start racing a release, a start racing a cancel)
ends in one of the serial orders. Real commits on the Django store (SQLite,
PostgreSQL or MariaDB by DATABASE_URL), one connection per thread, racers
lined up on a barrier (tests/conftest.py ``run_threads``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from durable_singleton import OnBusy, Singleton, SingletonBusyError, SingletonQueueFullError, signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import ChildWorkflowError, DurableSingletonError, InvalidWorkflowError
from durable_singleton.statuses import ParkReason, RunStatus
from durable_singleton.stores.base import RunRecord
from tests.conftest import Monitor, run_threads, spawn
from tests.helpers import audited, claim, counted_per_run, settle

ROUNDS = 4
KEY = "key:K"


@pytest.fixture
def finished() -> Iterator[Counter[str]]:
    """Count ``run_finished`` per run id, whichever thread sent it."""
    with counted_per_run(signals.run_finished) as counts:
        yield counts


def _active(engine: Engine) -> list[RunRecord]:
    return list(engine.store.active_runs_for_key("wf", KEY))


def _waiters(engine: Engine) -> list[str]:
    return [r.run_id for r in _active(engine) if not r.admitted]


def _code(engine: Engine, run_id: str) -> str | None:
    error = engine.get(run_id).error
    return error.get("code") if isinstance(error, dict) else None


def _drain(*engines: Engine, timeout: float = 30.0) -> None:
    """Run every engine's queued turns until the key has no active run (the
    first engine's tick as the fallback, S8)."""
    deadline = time.monotonic() + timeout
    while _active(engines[0]):
        assert time.monotonic() < deadline, f"runs did not finish: {_active(engines[0])}"
        for engine in engines:
            engine.dispatcher.drain()  # type: ignore[attr-defined]
        engines[0].tick()
        time.sleep(0.01)


def _holder(engine: Engine, run_id: str) -> None:
    """Start ``run_id`` and claim it without its body: a running holder (S5)."""
    engine.start("wf", {"k": "K"}, run_id=run_id)
    assert claim(engine, run_id).run.admitted


def _holder_and_waiter(engine: Engine, round_no: int) -> tuple[str, str, str]:
    """Round ``round_no`` on key K: the holder ``h<n>`` (:func:`_holder`) and the
    waiter ``w<n>`` behind it; returns their ids and ``s<n>``, the new start's."""
    holder, waiter = f"h{round_no}", f"w{round_no}"
    _holder(engine, holder)
    engine.start("wf", {"k": "K"}, run_id=waiter)
    return holder, waiter, f"s{round_no}"


def _race_a_start(engines: list[Engine], run_id: str, other: Callable[[], Any]) -> tuple[Any, Any]:
    """Run ``other()`` and a start of ``run_id`` (key K, on ``engines[1]``) in two
    threads at once; return what ``other`` returned and the started run."""

    def racer(i: int) -> Any:
        return other() if i == 0 else engines[1].start("wf", {"k": "K"}, run_id=run_id)

    first, started = run_threads(2, racer)
    return first, started


def _hold_in_body(engine: Engine, monitor: Monitor, run_id: str) -> threading.Thread:
    """Start ``run_id`` and run its turn on a thread until its body waits on the hold."""
    engine.start("wf", {"k": "K"}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    thread = spawn(engine.execute, run_id)
    deadline = time.monotonic() + 30
    while run_id not in monitor.entered:
        assert time.monotonic() < deadline, "the holder's body never started"
        time.sleep(0.01)
    return thread


# -- the declaration ----------------------------------------------------------------
@pytest.mark.vendor_agnostic
@pytest.mark.parametrize("value", ["drop", "Skip", "", None, 1])
def test_an_unknown_strategy_is_refused_at_declaration(value: Any) -> None:
    """X1, section 7: an on_busy that is not a strategy raises a typed error naming
    the workflow and the field; nothing is registered."""
    registry = Registry()
    with pytest.raises(InvalidWorkflowError, match=r"'wf': singleton\.on_busy: must be one of") as caught:
        registry.add("wf", "1", lambda ctx, i: i, singleton={"key": lambda i: "K", "on_busy": value})
    assert isinstance(caught.value, DurableSingletonError) and registry.workflows == {}


@pytest.mark.vendor_agnostic
@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"on_busy": "skip", "max_queue_depth": 0}, "max_queue_depth"),
        ({"on_busy": "replace_queued", "max_queue_depth": 1}, "max_queue_depth"),
        ({"on_busy": "cancel_in_progress", "max_queue_depth": 5}, "max_queue_depth"),
        ({"on_busy": "cancel_in_progress", "limit": 2}, "limit"),
    ],
)
def test_combinations_that_make_no_sense_are_refused(fields: dict[str, Any], field: str) -> None:
    """X1, section 7: a strategy that fixes the queue's depth takes no
    max_queue_depth; cancel_in_progress takes only limit 1 (docs/on_busy.rst)."""
    registry = Registry()
    with pytest.raises(InvalidWorkflowError, match=rf"singleton\.{field}: must be"):
        registry.add("wf", "1", lambda ctx, i: i, singleton={"key": lambda i: "K", **fields})
    assert registry.workflows == {}


@pytest.mark.vendor_agnostic
def test_the_default_is_queue_and_a_value_becomes_the_enum() -> None:
    """X1: without on_busy a key queues (S3); a strategy given as its string is stored as OnBusy."""
    registry = Registry()
    plain = registry.add("a", "1", lambda ctx, i: i, singleton=Singleton(key=lambda i: "K"))
    named = registry.add("b", "1", lambda ctx, i: i, singleton={"key": lambda i: "K", "on_busy": "replace_queued"})
    assert plain.singleton is not None and plain.singleton.on_busy is OnBusy.QUEUE
    assert named.singleton is not None and named.singleton.on_busy is OnBusy.REPLACE_QUEUED


# -- skip ------------------------------------------------------------------------------
def test_skip_refuses_a_busy_key_and_writes_nothing(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """X1, S15, S16, R3: with a run active on the key, a start raises
    SingletonBusyError (a SingletonQueueFullError at depth 0) and writes nothing;
    an existing id is returned, not refused; another key starts; once the run
    settled the key accepts a start again."""
    audited(registry, monitor, on_busy="skip")
    engine.start("wf", {"k": "K"}, run_id="A")
    with pytest.raises(SingletonBusyError, match="'wf', key 'key:K': on_busy='skip'") as caught:
        engine.start("wf", {"k": "K"}, run_id="B")
    error = caught.value
    assert isinstance(error, SingletonQueueFullError) and isinstance(error, DurableSingletonError)
    assert (error.workflow, error.key, error.max_queue_depth) == ("wf", KEY, 0)
    assert engine.store.get_run("B") is None
    assert engine.start("wf", {"k": "K"}, run_id="A").run_id == "A"
    assert engine.start("wf", {"k": "other"}, run_id="O").singleton_key == "key:other"
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("A").status == RunStatus.COMPLETED
    assert engine.start("wf", {"k": "K"}, run_id="B").status == RunStatus.PENDING


def test_skip_in_start_many_returns_the_busy_error_in_place(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1, S15: start_many of two runs on one free key creates the first and
    returns the second's SingletonBusyError in its place."""
    audited(registry, monitor, on_busy="skip")
    out = engine.start_many("wf", [{"k": "K"}, {"k": "K"}], run_ids=["A", "B"])
    assert isinstance(out[0], RunRecord) and isinstance(out[1], SingletonBusyError)
    assert engine.store.get_run("B") is None


def test_skip_refuses_a_child_start_and_the_parent_sees_it_failed(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1, S16, D7: a child start that "skip" refuses reaches its parent as a
    rejected child (ChildWorkflowError naming the busy key), not swallowed."""
    audited(registry, monitor, on_busy="skip")

    def parent(ctx: Any, input: Any) -> str:
        try:
            ctx.start_child("wf", {"k": "K"})
        except ChildWorkflowError as exc:
            return str(exc)
        return "started"

    registry.add("parent", "1", parent)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("parent", {}, run_id="P")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert engine.execute("P") == RunStatus.COMPLETED
    assert "on_busy='skip'" in engine.get("P").output and engine.store.get_run("P:child:0") is None


def test_skip_two_starts_at_once_create_one(make: Callable[..., Engine], registry: Registry, monitor: Monitor) -> None:
    """X1, S5, S13: four starts on one free key at once, one engine each: one
    run is created, three raise SingletonBusyError; the key has one active run."""
    audited(registry, monitor, on_busy="skip")
    engines = [make() for _ in range(4)]
    for round_no in range(ROUNDS):
        results = run_threads(4, lambda i, r=round_no: engines[i].start("wf", {"k": "K"}, run_id=f"s{r}-{i}"))
        created = [r for r in results if isinstance(r, RunRecord)]
        assert len(created) == 1, results
        assert all(isinstance(r, SingletonBusyError) for r in results if r not in created), results
        assert [r.run_id for r in _active(engines[0])] == [created[0].run_id]
        _drain(*engines)


def test_skip_start_racing_a_release(make: Callable[..., Engine], registry: Registry, monitor: Monitor) -> None:
    """X1, S7, S9: a holder settling while a start arrives: the start either
    came first (refused, nothing written) or after (created); never two active runs."""
    audited(registry, monitor, on_busy="skip")
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        _holder(engines[0], f"h{round_no}")

        def racer(i: int, r: int = round_no) -> Any:
            if i == 0:
                return settle(engines[0], f"h{r}", RunStatus.COMPLETED)
            return engines[1].start("wf", {"k": "K"}, run_id=f"s{r}")

        settled, started = run_threads(2, racer)
        assert settled is True
        assert isinstance(started, RunRecord | SingletonBusyError), started
        active = [r.run_id for r in _active(engines[0])]
        assert active == ([f"s{round_no}"] if isinstance(started, RunRecord) else [])
        _drain(*engines)
    assert monitor.highest["K"] <= 1


def test_skip_start_racing_a_cancel(make: Callable[..., Engine], registry: Registry, monitor: Monitor) -> None:
    """X1, D6, S9: a sleeping holder cancelled while a start arrives: the cancel
    settles it at once; the start is refused or created by the order the key's
    lock gave them; never two active runs."""
    audited(registry, monitor, on_busy="skip")
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        holder = f"h{round_no}"
        _holder(engines[0], holder)
        run = engines[0].get(holder)
        parked = engines[0].store.park(
            holder,
            run.lease_owner or "",
            RunStatus.SUSPENDED,
            wake_at=run.created_at + timedelta(hours=1),
            reason=ParkReason.SLEEP,
        )
        assert parked == "parked"

        def racer(i: int, r: int = round_no) -> Any:
            if i == 0:
                return engines[0].cancel(f"h{r}")
            return engines[1].start("wf", {"k": "K"}, run_id=f"s{r}")

        cancelled, started = run_threads(2, racer)
        assert cancelled.status == RunStatus.CANCELLED
        assert isinstance(started, RunRecord | SingletonBusyError), started
        assert len(_active(engines[0])) == (1 if isinstance(started, RunRecord) else 0)
        _drain(*engines)


# -- replace_queued ---------------------------------------------------------------------
def test_replace_queued_keeps_only_the_newest_waiter(
    engine: Engine, registry: Registry, monitor: Monitor, finished: Counter[str]
) -> None:
    """X1, S7, D6: behind a holder, each start cancels the waiter before it (code
    ``replaced``, run_finished sent once); the holder is untouched; its release
    admits the newest start, which runs."""
    audited(registry, monitor, on_busy="replace_queued")
    _holder(engine, "H")
    for name in ("W1", "W2", "W3"):
        engine.start("wf", {"k": "K"}, run_id=name)
    assert _waiters(engine) == ["W3"]
    for name in ("W1", "W2"):
        assert engine.get(name).status == RunStatus.CANCELLED and _code(engine, name) == "replaced"
        assert finished[name] == 1
    h = engine.get("H")
    assert h.status == RunStatus.RUNNING and h.admitted and not h.cancel_requested
    assert settle(engine, "H", RunStatus.COMPLETED)
    assert engine.get("W3").admitted
    _drain(engine)
    assert engine.get("W3").status == RunStatus.COMPLETED and monitor.entered == ["W3"]


def test_replace_queued_start_many_keeps_the_last_of_the_batch(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1: start_many under "replace_queued" starts its runs in order, each
    replacing the one before it behind the holder: the batch's last is the one waiter."""
    audited(registry, monitor, on_busy="replace_queued")
    _holder(engine, "H")
    out = engine.start_many("wf", [{"k": "K"}] * 3, run_ids=["B1", "B2", "B3"])
    assert [r.run_id for r in out if isinstance(r, RunRecord)] == ["B1", "B2", "B3"]
    assert _waiters(engine) == ["B3"] and [_code(engine, b) for b in ("B1", "B2")] == ["replaced"] * 2


def test_replace_queued_leaves_the_waiters_within_the_free_slots(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1, S5 step 3: limit 2 with one holder: the oldest waiter is being
    admitted to the free slot and is kept; only the run queued behind it is replaced."""
    audited(registry, monitor, limit=2, on_busy="replace_queued")
    _holder(engine, "H")
    for name in ("W1", "W2", "W3"):
        engine.start("wf", {"k": "K"}, run_id=name)
    assert _waiters(engine) == ["W1", "W3"] and _code(engine, "W2") == "replaced"
    assert settle(engine, "H", RunStatus.COMPLETED)
    _drain(engine)
    assert sorted(monitor.entered) == ["W1", "W3"] and monitor.highest["K"] <= 2


def test_replace_queued_two_starts_at_once_leave_one_waiter(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """X1, S5, S13: four starts at once behind a holder: each is created; one is
    left waiting, the three others are replaced; the holder runs on."""
    audited(registry, monitor, on_busy="replace_queued")
    engines = [make() for _ in range(4)]
    for round_no in range(ROUNDS):
        _holder(engines[0], f"h{round_no}")
        results = run_threads(4, lambda i, r=round_no: engines[i].start("wf", {"k": "K"}, run_id=f"s{r}-{i}"))
        assert all(isinstance(r, RunRecord) for r in results), results
        ids = [f"s{round_no}-{i}" for i in range(4)]
        left = _waiters(engines[0])
        assert len(left) == 1 and left[0] in ids
        assert sorted(_code(engines[0], i) for i in ids if i not in left) == ["replaced"] * 3
        assert engines[0].get(f"h{round_no}").status == RunStatus.RUNNING
        assert settle(engines[0], f"h{round_no}", RunStatus.COMPLETED)
        _drain(*engines)
        assert engines[0].get(left[0]).status == RunStatus.COMPLETED


def test_replace_queued_start_racing_a_release(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """X1, S6, S7: a holder settling (its slot granted to the waiter W) while a
    start arrives: either W was granted first and is kept as a holder, or W was
    replaced first and never runs, and the slot goes to the new start; at most
    one waiter either way, and an admitted run is never replaced."""
    audited(registry, monitor, on_busy="replace_queued")
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        holder, waiter, new = _holder_and_waiter(engines[0], round_no)
        settled, started = _race_a_start(engines, new, partial(settle, engines[0], holder, RunStatus.COMPLETED))
        assert settled is True and isinstance(started, RunRecord), started
        w = engines[0].get(waiter)
        if w.is_terminal:
            assert _code(engines[0], waiter) == "replaced" and engines[0].get(new).admitted
        else:
            assert w.admitted and _waiters(engines[0]) == [new]
        _drain(*engines)
        assert engines[0].get(new).status == RunStatus.COMPLETED
        if _code(engines[0], waiter) == "replaced":
            assert waiter not in monitor.entered
    assert monitor.highest["K"] <= 1


def test_replace_queued_start_racing_a_cancel(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor, finished: Counter[str]
) -> None:
    """X1, D6, R2, R5a: cancelling the waiter while a start replaces it: one
    compare-and-set settles it (code ``cancelled`` or ``replaced``), run_finished
    is sent once, and the new start is the one waiter."""
    audited(registry, monitor, on_busy="replace_queued")
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        holder, waiter, new = _holder_and_waiter(engines[0], round_no)
        cancelled, started = _race_a_start(engines, new, partial(engines[0].cancel, waiter))
        assert isinstance(started, RunRecord) and cancelled.status == RunStatus.CANCELLED
        assert _code(engines[0], waiter) in ("cancelled", "replaced")
        assert finished[waiter] == 1 and _waiters(engines[0]) == [new]
        assert settle(engines[0], holder, RunStatus.COMPLETED)
        _drain(*engines)
    assert monitor.highest["K"] <= 1


# -- cancel_in_progress -----------------------------------------------------------------------
def test_cancel_in_progress_stops_the_holder_at_its_next_step_and_admits_the_start(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1, D6, S7: a start on a key whose holder's body is running asks it to
    stop; the body stops at its next step boundary (its step never runs), the
    run ends cancelled, and its release admits the new start, which runs."""
    hold = threading.Event()
    audited(registry, monitor, on_busy="cancel_in_progress", hold=hold)
    thread = _hold_in_body(engine, monitor, "H")
    engine.start("wf", {"k": "K"}, run_id="S")
    assert engine.get("H").cancel_requested and engine.get("H").status == RunStatus.RUNNING
    hold.set()
    thread.join(30)
    assert engine.get("H").status == RunStatus.CANCELLED and _code(engine, "H") == "cancelled"
    assert engine.get("S").admitted
    _drain(engine)
    assert engine.get("S").status == RunStatus.COMPLETED and monitor.entered == ["H", "S"]
    assert monitor.highest["K"] == 1


def test_cancel_in_progress_cancels_a_parked_holder_at_once(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """X1, D6, D1: a sleeping holder is cancelled by the start at once; the new
    start is admitted by its own first turn."""
    audited(registry, monitor, on_busy="cancel_in_progress")
    _holder(engine, "H")
    run = engine.get("H")
    engine.store.park("H", run.lease_owner or "", RunStatus.SUSPENDED, wake_at=run.created_at + timedelta(hours=1))
    engine.start("wf", {"k": "K"}, run_id="S")
    assert engine.get("H").status == RunStatus.CANCELLED
    _drain(engine)
    assert engine.get("S").status == RunStatus.COMPLETED and monitor.entered == ["S"]


def test_cancel_in_progress_two_starts_at_once(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """X1, S5, D6: four starts at once while a holder's body runs: the holder is
    asked to stop; one start is left waiting, the others are replaced; when the
    holder stops, the one left is admitted next and runs."""
    hold = threading.Event()
    audited(registry, monitor, on_busy="cancel_in_progress", hold=hold)
    engines = [make() for _ in range(4)]
    thread = _hold_in_body(engines[0], monitor, "H")
    results = run_threads(4, lambda i: engines[i].start("wf", {"k": "K"}, run_id=f"s{i}"))
    assert all(isinstance(r, RunRecord) for r in results), results
    left = _waiters(engines[0])
    assert len(left) == 1
    assert sorted(_code(engines[0], f"s{i}") for i in range(4) if f"s{i}" not in left) == ["replaced"] * 3
    assert engines[0].get("H").cancel_requested
    hold.set()
    thread.join(30)
    _drain(*engines)
    assert engines[0].get("H").status == RunStatus.CANCELLED
    assert engines[0].get(left[0]).status == RunStatus.COMPLETED and monitor.entered == ["H", left[0]]


def test_cancel_in_progress_start_racing_a_release(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """X1, D6, S7: a holder settling completed while a start asks it to stop:
    the settle by its lease owner wins either way (a stop lands at a step
    boundary, D6), and the new start is admitted next and runs; never two at once."""
    audited(registry, monitor, on_busy="cancel_in_progress")
    engines = [make(), make()]
    for round_no in range(ROUNDS):
        holder, new = f"h{round_no}", f"s{round_no}"
        _holder(engines[0], holder)

        settled, started = _race_a_start(engines, new, partial(settle, engines[0], holder, RunStatus.COMPLETED))
        assert settled is True and isinstance(started, RunRecord), started
        assert engines[0].get(holder).status == RunStatus.COMPLETED
        _drain(*engines)
        assert engines[0].get(new).status == RunStatus.COMPLETED
    assert monitor.highest["K"] <= 1


def test_cancel_in_progress_start_racing_a_cancel(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor, finished: Counter[str]
) -> None:
    """X1, D6, R2: an operator's cancel and a start's stop request on one running
    holder at once: the holder ends cancelled once (one run_finished), and the
    new start is admitted next and runs."""
    audited(registry, monitor, on_busy="cancel_in_progress", hold=(hold := threading.Event()))
    engines = [make(), make()]
    thread = _hold_in_body(engines[0], monitor, "H")

    def racer(i: int) -> Any:
        if i == 0:
            return engines[0].cancel("H")
        return engines[1].start("wf", {"k": "K"}, run_id="S")

    requested, started = run_threads(2, racer)
    assert isinstance(started, RunRecord) and requested.cancel_requested
    hold.set()
    thread.join(30)
    _drain(*engines)
    assert engines[0].get("H").status == RunStatus.CANCELLED and finished["H"] == 1
    assert engines[0].get("S").status == RunStatus.COMPLETED and monitor.entered == ["H", "S"]
