"""Executing turns: R2, R4, R5, R6 and cancel (D6, S7, S9, F10-F13)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import RunNotFoundError
from tests.conftest import Monitor, spawn
from tests.helpers import audited, claim, sleep_past_lease
from tests.worker_processes import wait_for


def test_steps_run_once_and_replay_their_stored_result(make: Callable[..., Engine], registry: Registry) -> None:
    """R4: completed steps are not executed again when the body is re-run from the top.

    The engine's clock is one the test moves (frozen near real time: leases are
    judged by the database's clock, R5), so the sleep suspends the first turn
    and is over at the second however slow the machine is; with the real
    clock, a turn slower than the sleep ran past it without suspending."""
    now = [datetime.now(UTC)]
    engine = make(clock=lambda: now[0])
    calls: list[int] = []
    registry.add_step("count", lambda x: calls.append(x) or len(calls))

    def body(ctx: Any, input: Any) -> Any:
        first = ctx.step("count", 1)
        second = ctx.step("count", 2)
        ctx.sleep(0.05)
        third = ctx.step("count", 3)
        return [first, second, third]

    registry.add("steps", "1", body)
    run = engine.start("steps", None)
    assert engine.execute(run.run_id) == "suspended"
    assert calls == [1, 2]
    now[0] += timedelta(seconds=1)  # the sleep is over
    assert engine.execute(run.run_id) == "completed"
    assert calls == [1, 2, 3]
    assert engine.get(run.run_id).output == [1, 2, 3]
    assert [s.name for s in engine.store.load_steps(run.run_id).values()] == [
        "count",
        "count",
        "durable:sleep",
        "count",
    ]


def test_failed_body_records_the_error_and_releases(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """R2, S7: an exception fails the run, stores the error, and frees the slot."""

    def boom(ctx: Any, input: Any) -> None:
        raise ValueError("no stock")

    registry.add("boom", "1", boom, singleton={"key": lambda i: "k"})
    a = engine.start("boom", {}, run_id="a")
    b = engine.start("boom", {}, run_id="b")
    assert engine.execute("b") == "parked"
    assert engine.execute(a.run_id) == "failed"
    err = engine.get("a").error
    assert err["type"] == "ValueError" and err["message"] == "no stock" and "Traceback" in err["traceback"]
    assert list(engine.dispatcher.queue)[-1] == b.run_id


def test_non_json_output_fails_the_run(engine: Engine, registry: Registry) -> None:
    registry.add("bad-out", "1", lambda ctx, i: object())
    run = engine.start("bad-out")
    assert engine.execute(run.run_id) == "failed"
    assert "JSON" in engine.get(run.run_id).error["message"]


def test_duplicate_delivery_runs_the_body_once(engine: Engine, registry: Registry) -> None:
    """R6: a second delivery of a finished or running turn exits without effect."""
    calls: list[str] = []
    registry.add("once", "1", lambda ctx, i: calls.append(ctx.run_id))
    run = engine.start("once")
    assert engine.execute(run.run_id) == "completed"
    assert engine.execute(run.run_id) == "skipped"
    assert calls == [run.run_id]


def test_fenced_worker_cannot_write_after_takeover(make: Callable[..., Engine], registry: Registry) -> None:
    """R5: a process whose lease was taken over is fenced; its later writes are refused.

    The first worker's lease (2 s, never renewed) outlasts its claim and first
    step however loaded the machine; the test waits for the store's clock past
    it, and the worker that takes over has a lease that outlasts its turn."""
    engine = make(LEASE_SECONDS=2.0, LEASE_RENEW_SECONDS=60)
    other = make()
    release = threading.Event()
    calls: list[str] = []
    registry.add_step("side", lambda x: calls.append(x) or x)

    def body(ctx: Any, input: Any) -> str:
        if ctx.step("side", "first") and not release.is_set():
            release.wait(60)
        ctx.step("side", "second")
        return ctx.owner

    registry.add("fence", "1", body)
    run = engine.start("fence")
    first = spawn(engine.execute, run.run_id)
    wait_for(lambda: [s.name for s in engine.store.load_steps(run.run_id).values()] == ["side"], 60, "step 1 stored")
    sleep_past_lease(engine, run.run_id, timeout=60)  # the lease expires; nothing renews it
    release.set()
    assert other.execute(run.run_id) == "completed", "another worker takes the expired lease over"
    first.join(60)
    assert not first.is_alive()
    final = engine.get(run.run_id)
    assert final.status == "completed" and final.recoveries == 1
    assert calls == ["first", "second"], "the fenced worker's step was refused"


def test_cancel_pending_suspended_and_running(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """D6, F10, F11: pending and parked runs are cancelled at once; a running
    body stops at its next step boundary; each cancel releases the slot."""
    hold = threading.Event()
    audited(registry, monitor, hold=hold, steps=2)
    for name in ("A", "B", "C"):
        engine.start("wf", {"k": "K"}, run_id=name)
    holder = spawn(engine.execute, "A")
    while monitor.entered != ["A"]:
        time.sleep(0.01)
    assert engine.execute("B") == "parked"
    cancelled_b = engine.cancel("B")
    assert cancelled_b.status == "cancelled"
    assert engine.execute("B") == "skipped", "a cancelled waiter is never resurrected (F13)"
    assert engine.cancel("A").status == "running"
    hold.set()
    holder.join(60)
    assert not holder.is_alive(), "a thread of the test is still running"
    a = engine.get("A")
    assert a.status == "cancelled" and a.error["code"] == "cancelled"
    assert engine.store.load_steps("A") == {}, "the body stopped at its first step boundary"
    engine.dispatcher.drain()
    assert engine.get("C").status == "completed", "C took the slot; B's body never ran"
    assert "B" not in monitor.entered
    with pytest.raises(RunNotFoundError):
        engine.cancel("nope")
    assert engine.cancel("A").status == "cancelled", "cancelling a terminal run returns it unchanged"


def test_cancel_lands_while_claim_in_flight_is_never_undone(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S9: the store parks or admits only a run still active and still ours."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.cancel("A")
    assert claim(engine, "A", "me").state.value == "skipped"
    assert engine.get("A").status == "cancelled" and monitor.entered == []


def test_start_with_a_cancelled_run_id_returns_it(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """F10: start with a cancelled run's id returns it and does not restart it;
    a start with no id makes a new run that runs."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.cancel("A")
    again = engine.start("wf", {"k": "K"}, run_id="A")
    assert again.status == "cancelled"
    fresh = engine.start("wf", {"k": "K"})
    engine.dispatcher.drain()
    assert engine.get(fresh.run_id).status == "completed"
    assert engine.get("A").status == "cancelled"


def test_retry_goes_back_through_admission_with_stored_key(engine: Engine, registry: Registry) -> None:
    """D9, F14: a failed run retried waits behind the current holder, with its original key and no stale marker."""
    hold = threading.Event()
    fail = {"B": True}

    def body(ctx: Any, input: Any) -> None:
        if ctx.run_id == "A":
            hold.wait(10)
        if fail.get(ctx.run_id):
            raise RuntimeError("first attempt fails")

    registry.add("retry", "1", body, singleton={"key": lambda i: f"k:{i['k']}"})
    engine.start("retry", {"k": "1"}, run_id="B")
    assert engine.execute("B") == "failed"
    engine.start("retry", {"k": "1"}, run_id="A")
    holder = spawn(engine.execute, "A")
    while not engine.get("A").admitted:
        time.sleep(0.01)
    fail["B"] = False
    retried = engine.retry("B")
    assert retried.status == "pending" and retried.singleton_key == "k:1" and not retried.admitted
    assert engine.execute("B") == "parked", "B queues behind A"
    hold.set()
    holder.join(60)
    assert not holder.is_alive(), "a thread of the test is still running"
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed"


def test_lease_is_renewed_while_a_long_body_runs(make: Callable[..., Engine], registry: Registry) -> None:
    """R5, F8: a body longer than the lease keeps its lease by renewal: no takeover.

    The body holds its step until the test has seen the store's clock pass the
    lease its claim took (only renewals kept it) and another executor skip it."""
    engine = make(LEASE_SECONDS=1.0, LEASE_RENEW_SECONDS=0.1)
    done = threading.Event()
    registry.add_step("slow", lambda x: done.wait(60) and x)
    registry.add("long", "1", lambda ctx, i: ctx.step("slow", 1.5), singleton={"key": lambda i: "k"})
    run = engine.start("long")
    worker = spawn(engine.execute, run.run_id)
    claimed = wait_for(lambda: engine.get(run.run_id).lease_expires_at, 60, "the worker claimed the run")
    wait_for(lambda: engine.store.now() > claimed, 60, "the store's clock passed the first lease")
    assert engine.execute(run.run_id) == "skipped", "the lease is still held"
    assert engine.get(run.run_id).lease_expires_at > engine.store.now()  # type: ignore[operator]
    done.set()
    worker.join(60)
    assert not worker.is_alive(), "a thread of the test is still running"
    assert engine.get(run.run_id).status == "completed"
    assert engine.get(run.run_id).recoveries == 0
    assert engine.get(run.run_id).lease_expires_at is None


def test_deadline_is_set_from_the_workflow_timeout(engine: Engine, registry: Registry) -> None:
    registry.add("timed", "1", lambda ctx, i: None, timeout=60)
    run = engine.start("timed")
    assert run.deadline_at is not None and run.deadline_at - run.created_at == timedelta(seconds=60)


def test_execute_chain_runs_the_woken_waiter_next_without_the_broker(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S7: the Celery task runs a turn with execute_chain: the oldest waiter its
    release woke runs next on the same worker, in FIFO order, never beside a holder."""
    audited(registry, monitor)
    for name in ("A", "B", "C"):
        engine.start("wf", {"k": "K"}, run_id=name)
    assert engine.execute("C") == "parked"
    assert engine.execute("B") == "parked"
    engine.dispatcher.queue.clear()
    assert engine.execute_chain("A") == "completed"
    assert monitor.entered == ["A", "B", "C"] and monitor.highest["K"] == 1
    assert list(engine.dispatcher.queue) == [], "no turn went through the dispatcher"
    assert [engine.get(n).status for n in "ABC"] == ["completed"] * 3


def test_execute_chain_stops_at_its_bound_and_sends_the_rest(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    audited(registry, monitor)
    for name in ("A", "B", "C"):
        engine.start("wf", {"k": "K"}, run_id=name)
    engine.execute("C")
    engine.execute("B")
    engine.dispatcher.queue.clear()
    engine.execute_chain("A", max_turns=2)
    assert monitor.entered == ["A", "B"]
    assert list(engine.dispatcher.queue) == ["C"]
