"""Racing callers on real commits: F1, F2, F3, F15, F16 (S5, S9, S13, R6).

Each racer is a thread with its own database connection, lined up on a
barrier; a monitor records the highest number of bodies running per key.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connections, transaction

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.conftest import Monitor, run_threads, vendor

pytestmark = pytest.mark.races


def _holders(engine: Engine, key: str, workflow: str = "wf") -> list[str]:
    return [r.run_id for r in engine.store.active_runs_for_key(workflow, key) if r.admitted]


def _gated_workflow(registry: Registry, monitor: Monitor, permits: threading.Semaphore, limit: int = 1) -> None:
    """A singleton workflow whose body holds its slot until the test releases a permit."""

    def body(ctx: Any, input: dict[str, Any]) -> None:
        monitor.enter(input["k"], ctx.run_id)
        try:
            assert permits.acquire(timeout=60), "the test never released the holder"
        finally:
            monitor.exit(input["k"])

    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "limit": limit})


def _wait(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@contextlib.contextmanager
def _draining(engine: Engine, threads: int = 6) -> Iterator[None]:
    """Execute dispatched turns on background threads, as workers would: a claim
    grants a free slot to the oldest waiter, whose turn is dispatched (S5, S7)."""
    stop = threading.Event()

    def loop() -> None:
        try:
            dispatcher = engine.dispatcher
            while not stop.is_set():
                with dispatcher._lock:
                    run_id = dispatcher.queue.popleft() if dispatcher.queue else None
                if run_id is None:
                    time.sleep(0.002)
                else:
                    engine.execute(run_id)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join(60)


def _racers(n: int, fn: Callable[[int], Any]) -> list[threading.Thread]:
    """Start ``n`` threads running ``fn(i)`` released together by a barrier."""
    barrier = threading.Barrier(n, timeout=30)

    def run(i: int) -> None:
        try:
            barrier.wait()
            fn(i)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _finish_all(engine: Engine, timeout: float = 60.0) -> None:
    """Drive ticks and turns until every run is terminal."""
    deadline = time.monotonic() + timeout
    while any(not r.is_terminal for r in engine.store.list_runs()):
        assert time.monotonic() < deadline, "runs did not finish"
        engine.tick()
        engine.dispatcher.drain()
        time.sleep(0.02)


def _repeats(store_kind: str) -> int:
    return 50 if store_kind == "memory" or vendor() == "postgresql" else 15


@pytest.mark.slow  # repeated races: CI's database passes, not the quick tier
def test_f1_racing_claims_admit_exactly_one(
    engine: Engine, registry: Registry, monitor: Monitor, store_kind: str
) -> None:
    """F1, S5, S9: 20 threads start key K and execute at once: one holder and 19
    waiters, the monitor never sees 2; then the holder is settled while 3 ticks
    race: exactly one new holder, the oldest waiter. Repeated (50x on PostgreSQL
    and in memory)."""
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits)
    for rep in range(_repeats(store_kind)):
        key = f"K{rep}"
        entered_before = len(monitor.entered)
        outcomes: list[str] = []

        def racer(i: int, key: str = key, outcomes: list[str] = outcomes) -> None:
            run = engine.start("wf", {"k": key}, run_id=f"{key}-r{i:02d}")
            outcomes.append(engine.execute(run.run_id))

        drainer = _draining(engine, threads=1)
        drainer.__enter__()
        threads = _racers(20, racer)
        _wait(lambda outcomes=outcomes: len(outcomes) >= 19)
        _wait(lambda eb=entered_before: len(monitor.entered) > eb)
        time.sleep(0.01)
        # A racer whose run another claim granted may find it running already (skipped).
        assert set(outcomes) <= {"parked", "skipped"}, "no racer ran a body beside the holder"
        assert len(monitor.entered) == entered_before + 1 and monitor.highest[key] == 1
        assert _holders(engine, key) == [monitor.entered[-1]]
        waiters = [r for r in engine.store.active_runs_for_key("wf", key) if not r.admitted]
        oldest = min(waiters, key=lambda r: (r.created_at, r.run_id)).run_id

        permits.release()  # the holder completes and pushes the oldest waiter

        def ticker(i: int, eb: int = entered_before) -> None:
            while len(monitor.entered) < eb + 2:
                engine.tick()
                engine.dispatcher.drain(max_turns=100)
                time.sleep(0.001)

        tickers = _racers(3, ticker)
        try:
            _wait(lambda eb=entered_before: len(monitor.entered) == eb + 2)
        except AssertionError:
            for r in engine.store.list_runs():
                if r.singleton_key == key:
                    print("STATE", r.run_id, r.status, r.admitted, r.wake_at, r.lease_owner, r.attempts, r.park_reason)
            print("QUEUE", list(engine.dispatcher.queue), "NOW", engine.now())
            raise
        time.sleep(0.05)
        assert monitor.highest[key] == 1
        assert _holders(engine, key) == [oldest] == [monitor.entered[-1]]
        permits.release(100)
        for t in threads + tickers:
            t.join(60)
            assert not t.is_alive()
        drainer.__exit__(None, None, None)
        _finish_all(engine)
        assert monitor.highest[key] == 1
        # drain leftover permits so the next repetition's holder blocks again
        while permits.acquire(blocking=False):
            pass
    assert all(v == 1 for v in monitor.calls.values()), "no body ran twice"


def test_f2_release_races_push_and_ticks_in_fifo_order(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """F2, S5, S7: A holds; B, C, D wait with C's retry timer earlier than B's.
    Releasing A while the push and two ticks race admits B, C, D in order."""
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits)
    for name in "ABCD":
        engine.start("wf", {"k": "K"}, run_id=name)
        time.sleep(0.002)
    engine.dispatcher.queue.clear()
    holder = threading.Thread(target=_closing(engine.execute), args=("A",))
    holder.start()
    _wait(lambda: monitor.entered == ["A"])
    for name in "DCB":
        assert engine.execute(name) == "parked"
    _set_wake(engine, "C", engine.now() - timedelta(seconds=5))
    _set_wake(engine, "B", engine.now() + timedelta(seconds=5))
    permits.release(4)
    threads = _racers(3, lambda i: (engine.tick(), engine.dispatcher.drain()))
    holder.join(60)
    assert not holder.is_alive(), "a thread of the test is still running"
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a thread of the test is still running"
    _finish_all(engine)
    assert monitor.entered == ["A", "B", "C", "D"]
    assert monitor.highest["K"] == 1


def _set_wake(engine: Engine, run_id: str, when: datetime) -> None:
    if isinstance(engine.store, MemoryStore):
        run = engine.store.get_run(run_id)
        assert run is not None
        engine.store._runs[run_id] = run.evolve(wake_at=when)
    else:
        from durable_singleton.models import Run

        Run.objects.filter(pk=run_id).update(wake_at=when)


def _closing(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            connections.close_all()

    return wrapped


def test_f2_equal_created_at_ties_break_by_run_id(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """F2, S5 step 3: 30 runs created with a frozen clock (equal created_at) are
    admitted in (created_at, run_id) order, whatever order their turns run in."""
    frozen = datetime.now(UTC)  # frozen near real time: leases are judged by the database clock
    engine = make(clock=lambda: frozen)
    registry.add(
        "wf",
        "1",
        lambda ctx, i: monitor.enter(i["k"], ctx.run_id) or monitor.exit(i["k"]),
        singleton={"key": lambda i: i["k"]},
    )
    ids = [f"run-{n:02d}" for n in range(30)]
    for rep in range(3):
        key = f"tie{rep}"
        shuffled = [f"{key}-{i}" for i in ids]
        random.shuffle(shuffled)
        for run_id in shuffled:
            engine.start("wf", {"k": key}, run_id=run_id)
        engine.dispatcher.queue.clear()
        for _ in range(40):
            pending = [r.run_id for r in engine.store.active_runs_for_key("wf", key)]
            if not pending:
                break
            random.shuffle(pending)
            for run_id in pending:
                engine.execute(run_id)
        order = [r for r in monitor.entered if r.startswith(f"{key}-")]
        assert order == sorted(order) and len(order) == 30


def test_f2_busy_key_never_exceeds_its_limit_beside_a_quiet_key(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """F2: K1 (limit 2, 1 waiter) beside K2 (limit 2, 6 waiters): K2 never has more than 2 holders."""
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits, limit=2)
    for i in range(3):
        engine.start("wf", {"k": "K1"}, run_id=f"k1-{i}")
    for i in range(8):
        engine.start("wf", {"k": "K2"}, run_id=f"k2-{i}")
    ids = [r.run_id for r in engine.store.list_runs()]
    with _draining(engine):
        threads = _racers(len(ids), lambda i: engine.execute(ids[i]))
        _wait(lambda: len(monitor.entered) == 4)
        time.sleep(0.1)
        assert monitor.highest["K2"] == 2 and monitor.highest["K1"] == 2
        permits.release(100)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a thread of the test is still running"
    _finish_all(engine)
    assert monitor.highest["K2"] == 2


@pytest.mark.django_db(transaction=True)
def test_f3_late_committing_older_run_is_counted_not_ranked(registry: Registry, monitor: Monitor) -> None:
    """F3, S5: limit 2; R1 is created in a transaction that commits late while
    R2 and R3 are admitted and R4, R5 queue. After R1 commits and one holder
    is settled: never more than 2 holders, and R1 (the oldest) goes next."""
    if vendor() == "sqlite":
        pytest.skip("SQLite has one writer: a transaction left open blocks every other start")
    engine = make_engine("django", registry=registry)
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits, limit=2)
    for rep in range(5):
        key = f"F3-{rep}"
        created, commit = threading.Event(), threading.Event()

        def late(key: str = key, created: threading.Event = created, commit: threading.Event = commit) -> None:
            with transaction.atomic():
                engine.start("wf", {"k": key}, run_id=f"{key}-R1")
                created.set()
                assert commit.wait(30)

        late_thread = threading.Thread(target=_closing(late))
        late_thread.start()
        assert created.wait(10)
        for n in (2, 3, 4, 5):
            engine.start("wf", {"k": key}, run_id=f"{key}-R{n}")
        engine.dispatcher.queue.clear()
        order = [2, 3]
        random.shuffle(order)
        admitted = _racers(2, lambda i, key=key, order=order: engine.execute(f"{key}-R{order[i]}"))

        def entered(key: str = key) -> list[str]:
            return [e for e in monitor.entered if e.startswith(f"{key}-")]

        _wait(lambda: len(entered()) == 2)
        assert engine.execute(f"{key}-R5") == "parked"
        assert engine.execute(f"{key}-R4") == "parked"
        commit.set()
        late_thread.join(60)
        assert not late_thread.is_alive(), "R1's transaction did not commit"
        assert engine.execute(f"{key}-R1") == "parked", "R1 is a waiter now; both slots are held"
        permits.release()  # one holder completes; its release pushes R1
        # The drain runs what the release queued: wait for the release (its holder's turn
        # ended), or a drain started before it finds nothing and R1 is never run.
        _wait(lambda admitted=admitted: sum(not t.is_alive() for t in admitted) == 1, timeout=60)
        runner = _racers(1, lambda i: engine.dispatcher.drain())
        _wait(lambda: len(entered()) == 3)
        assert entered()[-1] == f"{key}-R1"
        assert monitor.highest[key] == 2
        permits.release(100)
        for t in admitted + runner:
            t.join(60)
            assert not t.is_alive(), "a thread of the test is still running"
        _finish_all(engine)
        assert monitor.highest[key] == 2
        while permits.acquire(blocking=False):
            pass


class SlowClaimStore(DjangoStore):
    """Widens the window between the claim's read and its write (F15)."""

    def _write_claim(
        self, run_id: str, status: str, attempts: int, lease_expires_at: datetime | None, changes: dict[str, Any]
    ) -> bool:
        time.sleep(0.02)
        return super()._write_claim(run_id, status, attempts, lease_expires_at, changes)


@pytest.mark.slow  # repeated races: CI's database passes, not the quick tier
@pytest.mark.parametrize("slow", [False, True], ids=["plain", "delayed-claim"])
def test_f15_two_executors_one_side_effect(store_kind: str, registry: Registry, slow: bool) -> None:
    """F15, R6: two threads execute the same turn at once: one wins the
    conditional claim; the body's side effect happens once. 100 repetitions,
    and again with a delay between the claim's check and its write."""
    if slow and store_kind == "memory":
        pytest.skip("the in-memory claim is one critical section: there is no window to widen")
    store: Any = SlowClaimStore() if slow else store_kind
    engine = make_engine(store, registry=registry)
    effects: list[str] = []
    lock = threading.Lock()

    def body(ctx: Any, input: Any) -> None:
        with lock:
            effects.append(ctx.run_id)

    registry.add("effect", "1", body, singleton={"key": lambda i: "one"})
    reps = 100 if not slow else 30
    for rep in range(reps):
        run = engine.start("effect", {}, run_id=f"e{rep}")
        outcomes = run_threads(2, lambda i, run_id=run.run_id: engine.execute(run_id))
        assert sorted(outcomes) == ["completed", "skipped"], outcomes
    assert len(effects) == reps and len(set(effects)) == reps


@pytest.mark.django_db(transaction=True)
def test_f16_sqlite_file_eight_threads_one_holder(registry: Registry, monitor: Monitor) -> None:
    """F16, S13: file-based SQLite, 8 threads start and execute limit-1 runs of
    one key at once: exactly one holder, no 'database is locked' reaching a caller."""
    if vendor() != "sqlite":
        pytest.skip("SQLite-specific: this run's database is " + vendor())
    assert connections["default"].settings_dict["NAME"] not in ("", ":memory:")
    engine = make_engine("django", registry=registry)
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits)
    for rep in range(5):
        key = f"F16-{rep}"
        outcomes = []
        errors: list[BaseException] = []

        def racer(i: int, key: str = key, outcomes: list[str] = outcomes, errors: list[BaseException] = errors) -> None:
            try:
                run = engine.start("wf", {"k": key}, run_id=f"{key}-{i}")
                outcomes.append(engine.execute(run.run_id))
            except BaseException as exc:
                errors.append(exc)
                raise

        with _draining(engine, threads=1):
            threads = _racers(8, racer)
            _wait(lambda outcomes=outcomes, errors=errors: len(outcomes) + len(errors) >= 7)
            _wait(lambda key=key: monitor.highest[key] >= 1)
            assert errors == []
            assert set(outcomes) <= {"parked", "skipped"}, "no racer ran a body beside the holder"
            assert monitor.highest[key] == 1 and len(_holders(engine, key)) == 1
            permits.release(100)
            for t in threads:
                t.join(60)
                assert not t.is_alive(), "a thread of the test is still running"
        _finish_all(engine)
        while permits.acquire(blocking=False):
            pass


class PausedParkStore(DjangoStore):
    """Pauses a denied claim after it decided to park, before its transaction commits (F6).

    The pause is a hook of the ORM path, so this store keeps it on every
    database: PostgreSQL's fast path parks in the same message that takes the
    key's lock, so a release waits for the park's commit by construction (#17).
    """

    def __init__(self) -> None:
        super().__init__(raw_sql=False)
        self.decided = threading.Event()
        self.resume = threading.Event()

    def _park_waiter(self, row: Any, seconds: float, retry: Any, **waits: Any) -> bool:
        parked = super()._park_waiter(row, seconds, retry, **waits)
        if row.run_id == "B":
            self.decided.set()
            assert self.resume.wait(30)
        return parked


@pytest.mark.django_db(transaction=True)
def test_f6_release_during_a_parking_claim_is_not_lost(registry: Registry, monitor: Monitor) -> None:
    """F6, S7, S9: B's claim decided to park but has not committed; meanwhile A
    completes and releases; then B commits. With the tick off, B runs at once:
    the release is serialized with parking on the key's lock."""
    store = PausedParkStore()
    engine = make_engine(store, registry=registry)
    permits = threading.Semaphore(0)
    _gated_workflow(registry, monitor, permits)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    engine.dispatcher.queue.clear()
    holder = threading.Thread(target=_closing(engine.execute), args=("A",))
    holder.start()
    _wait(lambda: monitor.entered == ["A"])
    parking = threading.Thread(target=_closing(engine.execute), args=("B",))
    parking.start()
    assert store.decided.wait(10)
    permits.release(2)  # A completes and releases while B's park is uncommitted
    time.sleep(0.3)
    store.resume.set()
    holder.join(30)
    parking.join(30)
    assert not holder.is_alive() and not parking.is_alive()
    assert engine.get("A").status == "completed"
    assert list(engine.dispatcher.queue) == ["B"], "the release pushed B after B's park committed"
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed" and monitor.entered == ["A", "B"]


@pytest.mark.slow  # 50 racing starts, then 206 starts on 200 keys: CI's database passes
def test_f5_cap_under_racing_starts(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """F5, S15: limit 1, max_queue_depth 5, 50 simultaneous starts: 6 runs
    exist, 44 callers get SingletonQueueFullError, no other row; another key
    still accepts; after the holder completes exactly one new start is
    accepted; with 200 keys the cap is per key (a run on each of 200 keys,
    then one key filled to its cap refuses the next start)."""
    from durable_singleton.exceptions import SingletonQueueFullError

    registry.add("capped", "1", lambda c, i: None, singleton={"key": lambda i: i["k"], "max_queue_depth": 5})

    def race_starts(n: int, prefix: str) -> list[str]:
        outcomes: list[str] = []

        def racer(i: int) -> None:
            try:
                engine.start("capped", {"k": "K"}, run_id=f"{prefix}{i:02d}")
                outcomes.append("started")
            except SingletonQueueFullError:
                outcomes.append("full")

        for t in _racers(n, racer):
            t.join(60)
            assert not t.is_alive(), "a thread of the test is still running"
        return sorted(outcomes)

    assert race_starts(50, "c") == ["full"] * 44 + ["started"] * 6
    assert len(engine.store.list_runs()) == 6
    assert engine.start("capped", {"k": "other"}).singleton_key == "other"
    engine.dispatcher.queue.clear()
    first = min(engine.store.active_runs_for_key("capped", "K"), key=lambda r: (r.created_at, r.run_id)).run_id
    assert engine.execute(first) == "completed"
    assert race_starts(10, "late") == ["full"] * 9 + ["started"]
    # 200 keys of one run each hold 200 runs, far past a global cap of 5; the last key
    # then fills to its own cap (1 holder and 5 waiters) and refuses the next start.
    for k in range(200):
        engine.start("capped", {"k": f"key{k}"}, run_id=f"k{k}-0")
    for n in range(1, 6):
        engine.start("capped", {"k": "key199"}, run_id=f"k199-{n}")
    with pytest.raises(SingletonQueueFullError):
        engine.start("capped", {"k": "key199"})
    assert len(engine.store.active_runs_for_key("capped", "key199")) == 6
