"""A body that raises a ``BaseException`` that is no ``Exception`` (SPEC R7, #18 item 5).

Before: ``sys.exit()`` or ``KeyboardInterrupt`` in a body left the turn
without a settle: the run stayed ``running`` with its slot, no signal, no log,
and the exception killed the worker thread (threading ignores ``SystemExit``
silently); after the lease the retry killed the next thread. Now the run
settles ``failed`` with the exception's class and message, its slot is handed
off, and the thread goes on; only the worker's own shutdown flag
(:meth:`Dispatcher.shutting_down`) hands the run back with its slot instead.
The real worker processes are in tests/core/test_body_base_exceptions_processes.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton import signals
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import CeleryDispatcher, ManualDispatcher, ThreadDispatcher
from durable_singleton.engine import Engine
from durable_singleton.stores.base import RunRecord
from durable_singleton.testing import make_engine


def _exit_with_message() -> None:
    sys.exit("the body exits")


def _exit_with_code() -> None:
    sys.exit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt("the body interrupts")


def _generator_exit() -> None:
    raise GeneratorExit("the body closes")


#: How a body raises, and the class its failed run names.
RAISERS: dict[str, tuple[Callable[[], None], str]] = {
    "sys.exit": (_exit_with_message, "SystemExit"),
    "SystemExit(3)": (_exit_with_code, "SystemExit"),
    "KeyboardInterrupt": (_interrupt, "KeyboardInterrupt"),
    "GeneratorExit": (_generator_exit, "GeneratorExit"),
}


def _declare(engine: Engine, raiser: Callable[[], Any]) -> None:
    engine.registry.add_step("r7:ok", lambda value: value)

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("r7:ok", 1)
        if input == "raise":
            raiser()
        return input

    engine.registry.add("r7", "1", body, singleton={"key": lambda i: "k", "limit": 1})


@pytest.mark.parametrize("how", sorted(RAISERS))
def test_a_body_raising_a_base_exception_settles_failed_with_its_class_and_hands_its_slot_off(
    engine: Engine, how: str
) -> None:
    """R7, S7: the turn ends ``failed`` with the exception's class, message and
    traceback; ``run_finished`` is sent; the waiter behind it is admitted and
    completes. Before: the exception left ``execute`` and the run stayed
    ``running`` holding the slot."""
    raiser, type_name = RAISERS[how]
    _declare(engine, raiser)
    finished: list[str] = []

    def on_finished(sender: Any, run: RunRecord, **kwargs: Any) -> None:
        finished.append(run.run_id)

    signals.run_finished.connect(on_finished)
    try:
        engine.start("r7", "raise", run_id="r7-raiser")
        engine.start("r7", "after", run_id="r7-waiter")
        assert engine.execute("r7-raiser") == "failed"
        engine.dispatcher.drain()
    finally:
        signals.run_finished.disconnect(on_finished)
    failed = engine.get("r7-raiser")
    assert failed.status == "failed"
    assert failed.error["code"] == "exception"
    assert failed.error["type"] == type_name
    assert failed.error["traceback"].rstrip().splitlines()[-1].startswith(failed.error["type"])
    if how == "sys.exit":
        assert failed.error["message"] == "the body exits"
    assert not failed.admitted
    after = engine.get("r7-waiter")
    assert (after.status, after.output) == ("completed", "after")
    assert finished == ["r7-raiser", "r7-waiter"]


class _StoppingDispatcher(ManualDispatcher):
    """A manual dispatcher whose worker says it is shutting down."""

    def shutting_down(self) -> bool:
        return True


def test_a_base_exception_during_the_worker_s_own_shutdown_hands_the_run_back_with_its_slot(
    make: Callable[..., Engine],
) -> None:
    """R7, S6: when the worker's own flag says it is shutting down, the
    exception is the shutdown's: the run is parked ``pending`` (due now) with
    its slot, the exception goes on to stop the process, and another worker
    resumes the run from its stored steps; the waiter is not admitted meanwhile."""
    engine = make()
    executions: list[str] = []
    engine.registry.add_step("r7:count", lambda value: executions.append(value) or value)
    state = {"stop": True}

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("r7:count", ctx.run_id)
        if state["stop"]:
            raise SystemExit(-241)  # what billiard's SIGTERM handler raises in a pool process
        return "done"

    engine.registry.add("r7-stop", "1", body, singleton={"key": lambda i: "k", "limit": 1})
    stopping = Engine(
        engine.store, _StoppingDispatcher(engine.store), registry=engine.registry, settings=engine.settings
    )
    stopping.dispatcher.bind(stopping)
    engine.start("r7-stop", None, run_id="r7-held")
    engine.start("r7-stop", None, run_id="r7-behind")
    with pytest.raises(SystemExit):
        stopping.execute("r7-held")
    held = engine.get("r7-held")
    assert (held.status, held.park_reason, held.admitted) == ("pending", "shutdown:1", True)
    # Due now by the store's clock, which stamped wake_at (R5); the engine's corrected clock
    # may be behind it by up to half a correction's round trip (R8).
    assert held.wake_at is not None and held.wake_at <= engine.store.now()
    assert engine.execute("r7-behind") == "parked"
    state["stop"] = False
    engine.tick()
    engine.dispatcher.drain()
    assert engine.get("r7-held").status == "completed"
    assert engine.get("r7-behind").status == "completed"
    assert executions == ["r7-held", "r7-behind"]  # r7-held's stored step replayed (R4)


@pytest.mark.django_db(transaction=True)
def test_the_embedded_worker_s_threads_live_on_after_bodies_raise_system_exit() -> None:
    """R7, O1: the worker threads of ``DISPATCH = "thread"`` keep running turns
    after bodies raise ``SystemExit`` and ``KeyboardInterrupt``: four of them
    on four threads, then ordinary runs. Before: each killed its thread, and
    the worker ran nothing more."""
    engine = make_engine("django", registry=Registry())
    engine.registry.add_step("r7:ok", lambda value: value)

    def body(ctx: Any, input: Any) -> Any:
        ctx.step("r7:ok", 1)
        if input == "exit":
            sys.exit(1)
        if input == "interrupt":
            raise KeyboardInterrupt
        return input

    engine.registry.add("r7-threads", "1", body)
    dispatcher = ThreadDispatcher(engine.store, threads=4, tick_seconds=0.2)
    worker = Engine(engine.store, dispatcher, registry=engine.registry, settings=engine.settings)
    dispatcher.bind(worker)
    dispatcher.start()
    try:
        raisers = [worker.start("r7-threads", "exit" if n % 2 else "interrupt").run_id for n in range(4)]
        deadline = time.monotonic() + 60
        while {engine.get(r).status for r in raisers} != {"failed"}:
            assert time.monotonic() < deadline, [engine.get(r).status for r in raisers]
            time.sleep(0.05)
        later = [worker.start("r7-threads", n).run_id for n in range(8)]
        while {engine.get(r).status for r in later} != {"completed"}:
            assert time.monotonic() < deadline, [engine.get(r).status for r in later]
            time.sleep(0.05)
        assert all(t.is_alive() for t in dispatcher._workers)
    finally:
        dispatcher.stop(timeout=10)


def test_dispatchers_read_the_worker_s_own_shutdown_flag_not_the_exception() -> None:
    """R7: the manual and thread dispatchers never interrupt a body to stop
    (False); Celery's says True only once its worker's shutdown flags are set
    (celery.worker.state), whatever a body raised."""
    from celery.worker import state

    store: Any = object()
    assert ManualDispatcher(store).shutting_down() is False
    assert ThreadDispatcher(store, 1, 1.0).shutting_down() is False
    celery = CeleryDispatcher(store)
    assert celery.shutting_down() is False
    saved = state.should_stop, state.should_terminate
    try:
        state.should_stop = 0  # a warm shutdown's exit code (EX_OK): set, though falsy
        assert celery.shutting_down() is True
        state.should_stop, state.should_terminate = None, 1
        assert celery.shutting_down() is True
    finally:
        state.should_stop, state.should_terminate = saved


def test_hand_backs_in_a_row_are_bounded_by_max_recoveries(make: Callable[..., Engine]) -> None:
    """R7, D4: a pool child terminated every time (Celery's hard time limit
    sends the SIGTERM a shutdown sends) is handed back at most
    ``MAX_RECOVERIES`` times in a row (``shutdown:N``); the next one is left to
    its lease, whose recoveries count towards ``dead``, so the run cannot loop
    (found by CI: test_hard_time_limit_kills_the_holder_and_the_key_moves_on)."""
    engine = make()

    def body(ctx: Any, input: Any) -> Any:
        raise SystemExit(-15)

    engine.registry.add("r7-loop", "1", body, singleton={"key": lambda i: "k", "limit": 1})
    stopping = Engine(
        engine.store, _StoppingDispatcher(engine.store), registry=engine.registry, settings=engine.settings
    )
    stopping.dispatcher.bind(stopping)
    engine.start("r7-loop", None, run_id="r7-loop")
    limit = engine.settings.MAX_RECOVERIES
    for count in range(1, limit + 1):
        with pytest.raises(SystemExit):
            stopping.execute("r7-loop")
        assert engine.get("r7-loop").park_reason == f"shutdown:{count}"
    with pytest.raises(SystemExit):
        stopping.execute("r7-loop")
    left = engine.get("r7-loop")
    assert (left.status, left.park_reason) == ("running", f"shutdown:{limit}"), (left.status, left.park_reason)
