"""Regressions from the adversarial review: S2, S9, S12, D5, R1, section 7."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError, InvalidRunIdError, RunNotFoundError, ValidationError
from durable_singleton.stores.memory import MemoryStore
from tests.conftest import Monitor, spawn
from tests.helpers import audited, sleep_past, store_method_replaced
from tests.worker_processes import wait_for


def _legacy(engine: Engine, run_id: str, status: str, attempts: int) -> None:
    if isinstance(engine.store, MemoryStore):
        run = engine.store.get_run(run_id)
        assert run is not None
        engine.store._runs[run_id] = run.evolve(status=status, tracked=False, admitted=False, attempts=attempts)
    else:
        from durable_singleton.models import Run

        Run.objects.filter(pk=run_id).update(
            status=status, singleton_tracked=False, singleton_slot=None, attempts=attempts
        )


def test_legacy_holder_is_admitted_and_finishes_before_new_runs(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S12: a suspended run of an older release (no tracked marker) is a holder:
    re-driven, it runs; a new run waits for it, then runs."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="L")
    _legacy(engine, "L", "suspended", attempts=1)
    engine.start("wf", {"k": "K"}, run_id="N")
    assert engine.execute("N") == "parked"
    assert engine.execute("L") == "completed"
    engine.dispatcher.drain()
    assert monitor.entered == ["L", "N"]


def test_cancel_landing_between_claim_and_gate_is_never_undone(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S9, D6, F11: a cancel that lands after the turn's claim but before the
    gate's claim cancels the run; its body never runs."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="B")
    real = engine.store.begin_turn

    def cancel_first(run_id: str, *args: Any, **kwargs: Any) -> Any:
        t = spawn(engine.cancel, run_id)
        t.join(60)
        assert not t.is_alive(), "a thread of the test is still running"
        return real(run_id, *args, **kwargs)

    with store_method_replaced(engine, "begin_turn", cancel_first):
        assert engine.execute("B") == "skipped"
    assert engine.get("B").status == "cancelled" and monitor.entered == []


def test_timeout_of_a_running_holder_never_overlaps_the_next(make: Callable[..., Engine], registry: Registry) -> None:
    """D5, S9: the timeout of a body still running under a live lease stops it at
    its next step boundary; the next run starts only after it settled."""
    engine = make()
    monitor = Monitor()
    registry.add_step("slow", lambda s: time.sleep(s) or s)

    def body(ctx: Any, input: Any) -> None:
        monitor.enter("K", ctx.run_id)
        try:
            ctx.step("slow", input["s"])
            ctx.step("slow", input["s"])
        finally:
            monitor.exit("K")

    registry.add("timed", "1", body, singleton={"key": lambda i: "K"}, timeout=0.3)
    engine.start("timed", {"s": 0.6}, run_id="A")
    worker = spawn(engine.execute, "A")
    time.sleep(0.1)
    engine.start("timed", {"s": 0.0}, run_id="B")
    sleep_past(engine, "deadline_at", "A")
    engine.dispatcher.queue.clear()
    report = engine.tick()
    assert "A" in report.timed_out
    engine.dispatcher.drain()
    worker.join(60)
    assert not worker.is_alive(), "a thread of the test is still running"
    engine.dispatcher.drain()
    a = engine.get("A")
    assert a.status == "cancelled" and a.error["code"] == "execution_timeout"
    assert monitor.highest["K"] == 1


@pytest.mark.parametrize(
    "bad",
    [{"t": "nul\x00"}, "lone \ud800 surrogate", ["ok", {"nested": "\x00"}]],
    ids=["nul-in-dict", "surrogate", "nested-nul"],
)
def test_text_no_database_can_store_is_refused_everywhere(engine: Engine, registry: Registry, bad: Any) -> None:
    """Section 7: input every store cannot hold raises a typed error and writes nothing."""
    registry.add("plain", "1", lambda c, i: None)
    with pytest.raises(InvalidInputError):
        engine.start("plain", bad)
    assert engine.store.list_runs() == []


def test_identifiers_with_nul_or_surrogates_are_refused(engine: Engine, registry: Registry) -> None:
    registry.add("plain", "1", lambda c, i: None)
    for run_id in ("a\x00b", "bad \udc80"):
        with pytest.raises(InvalidRunIdError):
            engine.start("plain", {}, run_id=run_id)
    with pytest.raises(ValidationError):
        engine.start("plain", {}, tags=["t\x00"])
    with pytest.raises(ValidationError):
        engine.start("plain", {}, tags=None)  # type: ignore[arg-type]
    with pytest.raises(RunNotFoundError):
        engine.cancel("x\x00")
    run = engine.start("plain", {})
    with pytest.raises(ValidationError):
        engine.signal(run.run_id, "go\x00")
    with pytest.raises(ValidationError):
        engine.signal_with_start("plain", {}, run_id="sws", signal="")
    assert engine.store.get_run("sws") is None, "a bad signal name writes nothing"
    assert [r.run_id for r in engine.store.list_runs()] == [run.run_id]


def test_error_with_nul_is_stored_as_failed(engine: Engine, registry: Registry) -> None:
    """R2: a body raising a message with NUL fails once, with the error stored."""
    calls = []

    def body(ctx: Any, input: Any) -> None:
        calls.append(1)
        raise ValueError("could not parse \x00\x01")

    registry.add("nul-error", "1", body)
    run = engine.start("nul-error")
    assert engine.execute(run.run_id) == "failed"
    assert "\\x00" in engine.get(run.run_id).error["message"] and calls == [1]


def test_limit_of_the_latest_version_applies_to_every_version(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S2: one key, one limit: runs of an older version obey the latest version's limit."""
    hold = threading.Event()

    def body(ctx: Any, input: Any) -> None:
        monitor.enter("K", ctx.run_id)
        try:
            hold.wait(60)
        finally:
            monitor.exit("K")

    registry.add("multi", "1", body, singleton={"key": lambda i: "K", "limit": 3})
    for n in range(3):
        engine.start("multi", {}, run_id=f"v1-{n}", version="1")
    registry.add("multi", "2", body, singleton={"key": lambda i: "K", "limit": 1})
    threads = [spawn(engine.execute, f"v1-{n}") for n in range(3)]
    # Every executor either entered its body (held there) or returned (parked).
    wait_for(lambda: len(monitor.entered) + sum(not t.is_alive() for t in threads) >= 3, 60, "every turn was decided")
    assert monitor.highest["K"] == 1
    hold.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a thread of the test is still running"
    engine.dispatcher.drain()
    connections.close_all()
    assert monitor.highest["K"] == 1


def test_the_timeout_of_a_crashed_holder_is_settled_as_a_timeout(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """D5, R6: a holder whose process crashed in its body (its lease expires) passes its
    deadline: the tick asks it to stop (the request a cancel makes), and the claim that
    recovers its turn settles it ``cancelled`` with code ``execution_timeout``, as the body
    itself would at its next step. Before, that claim named it ``cancelled`` by an operator
    (found by a tester, on every store): a timeout looked like a cancel in its error, the
    admin, the metrics and a django.tasks result."""
    gate, entered = threading.Event(), threading.Event()
    registry.add_step("hold", lambda x: (entered.set(), gate.wait(30), x)[2])
    registry.add("crash-timed", "1", lambda ctx, i: ctx.step("hold", 1), singleton={"key": lambda i: "CT"}, timeout=0.3)
    engine = make()
    engine.start("crash-timed", {}, run_id="CT1")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    worker = spawn(engine.execute, "CT1")
    try:
        assert entered.wait(30), "the body did not start"
        # Its process is gone: the lease ends (R5), as the store's clock would see it.
        if isinstance(engine.store, MemoryStore):
            run = engine.store.get_run("CT1")
            assert run is not None
            engine.store._runs["CT1"] = run.evolve(lease_expires_at=engine.store.clock() - timedelta(seconds=60))
        else:
            from durable_singleton.models import Run

            Run.objects.filter(pk="CT1").update(lease_expires_at=engine.store.now() - timedelta(seconds=60))
        sleep_past(engine, "deadline_at", "CT1")
        engine.tick()  # the timeout's stop request, then the recovery's turn
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        settled = engine.get("CT1")
        assert settled.status == "cancelled", settled
        assert (settled.error or {}).get("code") == "execution_timeout", settled.error
    finally:
        gate.set()
        worker.join(60)
    assert engine.get("CT1").error["code"] == "execution_timeout"
