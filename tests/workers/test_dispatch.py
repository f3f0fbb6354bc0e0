"""Dispatchers: the embedded worker starts when the process starts serving,
not at a dispatch, and resumes due work by itself (O1, section 6)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import ThreadDispatcher
from durable_singleton.engine import Engine
from durable_singleton.runtime import build_engine, get_engine
from durable_singleton.worker import start_embedded_worker


def _wait_completed(engine: Engine, run_ids: list[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(engine.get(r).status != "completed" for r in run_ids):
        assert time.monotonic() < deadline, "the embedded worker never ran the runs"
        time.sleep(0.05)


@pytest.mark.django_db(transaction=True)
def test_thread_dispatch_runs_work_started_before_the_worker(registry: Registry) -> None:
    """O1: a dispatch in a process whose worker is not started queues nothing
    (the run keeps its wake time); starting the worker runs it within about a
    tick, with no new dispatch, and later starts run at once."""
    registry.add("plain", "1", lambda ctx, i: i * 2, singleton={"key": lambda i: "k"})
    settings = Settings.from_mapping({"DISPATCH": "thread", "TICK_SECONDS": 0.2, "REDELIVERY_SECONDS": 0.0})
    engine: Engine = build_engine(settings)
    engine.registry = registry
    dispatcher: Any = engine.dispatcher
    assert isinstance(dispatcher, ThreadDispatcher) and not dispatcher.running
    early = [engine.start("plain", n).run_id for n in range(3)]
    time.sleep(0.3)
    assert dispatcher._queue.empty() and {engine.get(r).status for r in early} == {"pending"}
    try:
        assert dispatcher.start() is True
        assert dispatcher.start() is False
        _wait_completed(engine, early)
        late = [engine.start("plain", n).run_id for n in range(3, 5)]
        _wait_completed(engine, late)
        assert [engine.get(r).output for r in early + late] == [0, 2, 4, 6, 8]
    finally:
        assert dispatcher.stop() == []


@pytest.mark.django_db(transaction=True)
def test_first_request_does_not_start_the_worker_in_tests_unless_asked(settings: Any) -> None:
    """O1: the request_started receiver and start_embedded_worker() leave the
    worker stopped under Django's test environment; force=True starts it."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "thread"}
    dispatcher: Any = get_engine().dispatcher
    assert isinstance(dispatcher, ThreadDispatcher)
    Client().get("/runs/nothing-here")
    assert not dispatcher.running
    assert start_embedded_worker() is False
    try:
        assert start_embedded_worker(force=True) is True
        assert dispatcher.running
    finally:
        dispatcher.stop()


def test_start_embedded_worker_ignores_other_dispatch_modes(settings: Any) -> None:
    """O1: with DISPATCH "celery" the embedded worker is never started."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "celery"}
    assert start_embedded_worker(force=True) is False


def test_lease_renewal_survives_a_dropped_connection(registry: Registry) -> None:
    """O1, R5: a renewal that fails with a database error (a dropped
    connection) is retried at the next interval instead of ending the lease
    keeper, so the body keeps its lease and completes."""
    from django.db import OperationalError

    from durable_singleton.stores.memory import MemoryStore
    from durable_singleton.testing import make_engine

    class Flaky(MemoryStore):
        calls = 0

        def renew_lease(self, *args: Any, **kwargs: Any) -> bool:
            type(self).calls += 1
            if type(self).calls == 1:
                raise OperationalError("server closed the connection unexpectedly")
            return bool(super().renew_lease(*args, **kwargs))

    registry.add("slow", "1", lambda ctx, i: time.sleep(0.6) or "done")
    engine = make_engine(Flaky(), registry=registry, LEASE_SECONDS=5.0, LEASE_RENEW_SECONDS=0.1)
    run = engine.start("slow", None)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get(run.run_id).status == "completed"
    assert Flaky.calls >= 3


def test_announce_writes_to_stderr_when_no_handler_would_show_the_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """O1, issue #19 point 7: under runserver Django's default LOGGING shows
    no INFO line of this app, so the worker's start and stop lines also go to
    stderr when no handler would show them; with a handler they are only logged."""
    from durable_singleton import dispatch

    monkeypatch.setattr(dispatch.lifecycle_logger, "propagate", False)
    dispatch.announce("embedded worker started in pid %d: %s", 42, "4 threads")
    assert capsys.readouterr().err == "durable_singleton: embedded worker started in pid 42: 4 threads\n"
    monkeypatch.setattr(dispatch.lifecycle_logger, "propagate", True)  # pytest's handlers are on the root
    dispatch.announce("embedded worker stopped in pid %d", 42)
    assert capsys.readouterr().err == ""


def _ticking_worker(registry: Registry, tick: Any) -> Any:
    """A started one-thread embedded worker (ticks every 0.05 s) whose tick is ``tick``;
    return its dispatcher."""
    engine: Engine = build_engine(
        Settings.from_mapping({"DISPATCH": "thread", "TICK_SECONDS": 0.05, "WORKER_THREADS": 1})
    )
    engine.registry = registry
    engine.tick = tick  # type: ignore[method-assign]
    dispatcher: Any = engine.dispatcher
    dispatcher.start()
    return dispatcher


@pytest.mark.django_db(transaction=True)
def test_stop_leaves_a_tick_in_a_database_call_after_a_second(registry: Registry) -> None:
    """O1, issue #19 point 7: a tick holds no lease, so stop() waits at most
    TICK_JOIN_SECONDS for one that is in progress instead of the whole
    timeout; the stop is bounded whatever the tick does."""
    import threading

    from durable_singleton import dispatch

    in_tick, release = threading.Event(), threading.Event()

    def stuck_tick() -> None:
        in_tick.set()
        release.wait(60)

    dispatcher = _ticking_worker(registry, stuck_tick)
    try:
        assert in_tick.wait(60)
        ticker = next(t for t in dispatcher._workers if t.name == dispatch.TICK_THREAD)
        dispatcher.stop(timeout=60)
        assert ticker.is_alive() and not release.is_set(), "stop() waited for the tick to end"
    finally:
        release.set()


def test_a_stop_that_leaves_a_tick_behind_has_stopped_the_worker(registry: Registry) -> None:
    """O1: a stop that leaves the tick thread in a database call (a loaded
    machine, a slow server) has still stopped the worker: it is not running,
    the next start starts new threads (before, the tick left behind kept it
    "running" for good: start() refused and the request_started receiver's
    test of get_engine's worker failed under load on MariaDB), and the tick
    left behind ends after its call without ticking again beside the new
    start's tick (before, the new start cleared the shared stop event and the
    old tick went on). A later stop waits for it too (the plugin's stop_threads)."""
    import threading

    from durable_singleton import dispatch
    from tests.worker_processes import wait_for

    in_tick, release = threading.Event(), threading.Event()
    ticks: list[threading.Thread] = []

    def tick() -> None:
        ticks.append(threading.current_thread())
        if len(ticks) == 1:
            in_tick.set()
            release.wait(60)

    dispatcher = _ticking_worker(registry, tick)
    try:
        assert in_tick.wait(60)
        old = ticks[0]
        assert old.name == dispatch.TICK_THREAD
        dispatcher.stop(timeout=60)
        assert old.is_alive(), "the tick is still in its call"
        assert not dispatcher.running and dispatcher.threads_alive
        assert dispatcher.start() is True, "a stopped worker starts again"
        wait_for(lambda: any(t is not old for t in ticks), 60, "the new start's tick ran")
        release.set()
        old.join(60)
        assert not old.is_alive()
        assert ticks.count(old) == 1, "the tick left behind ticked again after its stop"
    finally:
        release.set()
        dispatcher.stop(timeout=60)
    assert not dispatcher.running and not dispatcher.threads_alive


def test_a_send_the_broker_refuses_is_one_warning_line_per_run_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """F4, S8: a broker that is down is an expected event. The turns a refused
    send carried are logged as one warning line each, naming the error (a new
    user read the full traceback of a ``celery`` dispatch with no broker as a
    failure of the start); the traceback is kept at DEBUG; nothing is raised."""
    import logging

    from durable_singleton import dispatch

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    # A handler of its own on the package's logger: the suite's LOGGING may stop propagation to caplog's.
    log = logging.getLogger("durable_singleton")
    level = log.level
    log.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears the loggers' level cache
    log.addHandler(handler)
    try:
        # The refusal as _send_turns meets it (a real refused send, through a real broker URL,
        # is tests/workers/test_celery_faults.py's broken-broker case, which reads the same line).
        dispatch._send_refused(["run-a", "run-b"], ConnectionRefusedError(111, "Connection refused"))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    mine = records
    warnings = [r for r in mine if r.levelno == logging.WARNING]
    assert [r.getMessage().split(" (")[0] for r in warnings] == [
        "could not send turn of run run-a; the tick will re-send it",
        "could not send turn of run run-b; the tick will re-send it",
    ]
    assert all(r.exc_info is None and "Error" in r.getMessage() for r in warnings), [r.getMessage() for r in warnings]
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in mine)


@pytest.mark.django_db(transaction=True)
def test_a_run_already_queued_gets_no_second_turn_until_a_thread_takes_it(registry: Registry) -> None:
    """S8, R6, X6d: the embedded worker queues one turn per run not yet taken by a
    thread: a run sent again meanwhile (the wake timer's send at a throttle's
    opening, then a claim's grant of the same waiter) adds none, since the queued
    turn's claim comes after both and decides alike; once a thread has taken it,
    a dispatch queues another. Before, each dispatch queued one more turn, and the
    duplicates' claims (each skipped) held the threads up at the opening."""
    import threading

    from durable_singleton.testing import make_engine

    gate = threading.Event()
    registry.add("held", "1", lambda ctx, i: gate.wait(30), singleton={"key": lambda i: i})
    built = make_engine("django", registry=registry)
    dispatcher = ThreadDispatcher(built.store, threads=1, tick_seconds=3600)
    engine = Engine(built.store, dispatcher, registry=registry, settings=built.settings)
    dispatcher.bind(engine)
    dispatcher.start()
    try:
        holder = engine.start("held", "a").run_id  # the one thread runs it, held by the gate
        deadline = time.monotonic() + 30
        while not dispatcher.in_hand:
            assert time.monotonic() < deadline, "the thread never took the first run"
            time.sleep(0.02)
        waiting = engine.start("held", "b").run_id
        for _ in range(3):
            dispatcher.dispatch(waiting)
        assert dispatcher._queue.qsize() == 1
        dispatcher.dispatch(holder)  # taken by the thread: a new turn is queued
        assert dispatcher._queue.qsize() == 2
        gate.set()
        _wait_completed(engine, [holder, waiting])
    finally:
        gate.set()
        assert dispatcher.stop(timeout=10) == []
