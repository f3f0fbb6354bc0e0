"""R8: the times a start and a settle write come from the database's clock.

A process's own clock can step (NTP, a resumed VM) between two corrections of
its offset to the database's clock. The tests step the clock the engine's
default :class:`~durable_singleton.engine.StoreClock` reads (its process
clock) after a correction, forward by an hour or back by a minute, and check
that the run's ``created_at`` and ``finished_at`` are still on the database's
clock: a run is never created after it started nor finished before it
started, a waiter started by a stepped-back process does not jump the
queue, and a tick fires each schedule window on time (the tick decides and
records windows on the store's clock).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone as django_timezone

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine, StoreClock
from durable_singleton.schedules import Schedule, schedule_store_for


def step_clock(engine: Engine, delta: timedelta) -> None:
    """Correct ``engine``'s clock now, then step its process clock by ``delta``."""
    clock = engine.now
    assert isinstance(clock, StoreClock)
    clock()  # measured against the store's clock before the step
    local: Callable[[], datetime] = clock._local
    clock._local = lambda: local() + delta


@pytest.mark.parametrize("delta", [timedelta(hours=1), timedelta(seconds=-60)], ids=["forward", "back"])
def test_a_run_of_a_stepped_process_is_created_started_and_finished_in_order(
    make: Callable[..., Engine], registry: Registry, delta: timedelta
) -> None:
    """R8: with its process clock stepped after the last correction, a start
    writes ``created_at`` on the store's clock and the settle ``finished_at``:
    created_at <= started_at <= finished_at <= the store's now."""
    registry.add("plain", "1", lambda ctx, i: {"ok": True})
    engine = make()
    step_clock(engine, delta)
    engine.start("plain", {}, run_id="R")
    engine.dispatcher.drain()
    run = engine.get("R")
    assert run.status == "completed"
    assert run.started_at is not None and run.finished_at is not None
    assert run.created_at <= run.started_at <= run.finished_at <= engine.store.now(), (
        run.created_at,
        run.started_at,
        run.finished_at,
    )


def test_the_memory_store_stamps_a_start_with_its_own_clock(registry: Registry) -> None:
    """R8: on the default clock the in-memory store writes a start's ``created_at``
    from its own clock, as the database stores do, so it is never after the
    ``started_at`` its claim reads from that clock. Its clock stands still here:
    a creation time from the engine's corrected process clock (the time measured
    at the last correction plus the time elapsed since) came out after it."""
    from durable_singleton.stores.memory import MemoryStore
    from durable_singleton.testing import make_engine

    frozen = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    store = MemoryStore(clock=lambda: frozen)
    registry.add("plain", "1", lambda ctx, i: {"ok": True})
    engine = make_engine(store, registry=registry)
    assert isinstance(engine.now, StoreClock)
    engine.now()  # the engine's clock corrected against the store's
    time.sleep(0.002)
    engine.start("plain", {}, run_id="R")
    engine.dispatcher.drain()
    run = engine.get("R")
    assert run.status == "completed"
    assert run.created_at == frozen == run.started_at, (run.created_at, run.started_at)


def test_a_waiter_started_by_a_process_stepped_back_does_not_jump_the_queue(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """R8, S5: W1 is started by a process with a correct clock, then W2 by one
    whose clock stepped a minute back after its last correction; W2 is
    created after W1 and waits behind it, and W1 is admitted first."""
    registry.add("wf", "1", lambda ctx, i: ctx.wait_for_signal("go"), singleton={"key": lambda i: "K"})
    honest, stepped = make(), make()
    step_clock(stepped, timedelta(seconds=-60))
    honest.start("wf", {}, run_id="H")
    honest.dispatcher.drain()
    honest.start("wf", {}, run_id="W1")
    stepped.start("wf", {}, run_id="W2")
    created: dict[str, Any] = {r: honest.get(r).created_at for r in ("H", "W1", "W2")}
    assert created["H"] <= created["W1"] <= created["W2"], created
    assert [r.run_id for r in honest.store.active_runs_for_key("wf", "K")] == ["H", "W1", "W2"]
    honest.signal("H", "go", None)
    honest.dispatcher.drain()
    stepped.dispatcher.drain()
    assert honest.get("W1").admitted and not honest.get("W2").admitted


@pytest.mark.django_db(transaction=True)
def test_the_database_clock_has_microseconds_on_every_vendor(registry: Registry) -> None:
    """R8, S5: the Django store's clock, read by ``now()`` and written by its
    statements (a claim's ``started_at``), has microseconds on SQLite too,
    whose own ``'now'`` has milliseconds only: two starts of one millisecond
    would tie in the queue order, and a run claimed within the millisecond of
    its creation would read as started before it was created."""
    from durable_singleton.testing import make_engine

    registry.add("plain", "1", lambda ctx, i: None)
    engine = make_engine("django", registry=registry)
    assert any(engine.store.now().microsecond % 1000 for _ in range(50))
    for n in range(20):
        engine.start("plain", {}, run_id=f"R{n}")
    engine.dispatcher.drain()
    started = [engine.get(f"R{n}").started_at for n in range(20)]
    assert any(at is not None and at.microsecond % 1000 for at in started), started


def test_a_time_read_before_a_correction_does_not_hold_later_starts(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """R8: the process clock steps an hour ahead and something (a tick) reads
    the engine's clock before the next correction: that read is an hour
    ahead. The next start corrects the clock first and writes ``created_at``
    on the store's clock: the floor that keeps one process's times in order
    (against the correction's jitter) is dropped when a correction finds a
    step, so it does not hold the stepped time (found by the soak's clock
    feature: with e428228's floor every later start of the process wrote
    ``created_at`` an hour ahead)."""
    registry.add("plain", "1", lambda ctx, i: {"ok": True})
    engine = make()
    step_clock(engine, timedelta(hours=1))
    assert engine.now() - engine.store.now() > timedelta(minutes=59)  # the stale offset
    engine.start("plain", {}, run_id="R")
    created = engine.get("R").created_at
    assert abs(created - engine.store.now()) < timedelta(seconds=5), (created, engine.store.now())
    engine.start("plain", {}, run_id="S")
    assert created <= engine.get("S").created_at, "still in order after the reset"


@pytest.mark.slow
@pytest.mark.parametrize("delta", [timedelta(hours=1), timedelta(seconds=-60)], ids=["forward", "back"])
def test_a_stepped_process_fires_every_schedule_window_on_time(
    make: Callable[..., Engine], registry: Registry, monkeypatch: pytest.MonkeyPatch, delta: timedelta
) -> None:
    """R8, S17: a process whose clock stepped an hour forward, or a minute back,
    since its last correction ticks a one-second schedule for 3 s: every window
    fires once, none before its start on the store's clock, none recorded as
    missed, none skipped, and the last one within a second and a half of the
    end (nothing is left for after the next correction). The step is renewed
    before each tick (a correction, then the step again) and covers Django's
    ``timezone.now`` too (the process clock of the app's auto-timed fields);
    the store's clock (the database's, or the in-memory store's own) does not step."""
    registry.add("beat", "1", lambda ctx, i: None, schedules=[Schedule("beat", every=1, catch_up="all")])
    engine = make()
    clock = engine.now
    assert isinstance(clock, StoreClock)
    local: Callable[[], datetime] = clock._local
    monkeypatch.setattr(django_timezone, "now", lambda: local() + delta)

    def stepped_tick() -> None:
        clock._local = local
        clock.correct()
        clock._local = lambda: local() + delta
        engine.tick()

    stop = time.monotonic() + 3.0
    while time.monotonic() < stop:
        stepped_tick()
        time.sleep(0.1)
    end = engine.store.now()
    firings = schedule_store_for(engine.store).firings("beat")
    assert [(f.window_at, f.outcome) for f in firings if f.outcome != "started"] == []
    windows = [f.window_at for f in firings]
    assert len(windows) >= 2, windows
    assert {b - a for a, b in itertools.pairwise(windows)} <= {timedelta(seconds=1)}, windows
    assert timedelta(0) <= end - windows[-1] < timedelta(seconds=1.5), (windows[-1], end)
    for firing in firings:
        run = engine.get(firing.run_id)
        assert firing.window_at <= run.created_at <= end, (firing.window_at, run.created_at)
        assert firing.recorded_at is not None and firing.window_at <= firing.recorded_at <= end, firing
    state = schedule_store_for(engine.store).get("beat")
    assert state is not None and state.next_fire_at == windows[-1] + timedelta(seconds=1)


def test_a_step_ahead_and_back_between_corrections_does_not_hold_the_clock(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """R8: the process clock steps an hour ahead and back again before any
    correction (the stepped times were read: a tick, a deadline); once it is
    back, the engine's clock is the store's again, not held an hour ahead
    by the floor until the next correction (found in CI: a test that
    stepped the default engine's clock and restored it left every later
    test of the process an hour ahead, on PostgreSQL, whose starts do not
    correct the clock)."""
    engine = make()
    clock = engine.now
    assert isinstance(clock, StoreClock)
    clock()
    local = clock._local
    clock._local = lambda: local() + timedelta(hours=1)
    assert clock() - engine.store.now() > timedelta(minutes=59)
    clock._local = local
    assert abs(clock() - engine.store.now()) < timedelta(seconds=5)


def test_two_starts_keep_their_order_when_one_correction_took_long() -> None:
    """R8, S5: each start corrects the clock (one read of the store's) and stamps
    ``created_at``. A correction's offset is off by up to half its round trip: here the
    first read's thread was paused 10 ms before the store answered (offset 5 ms ahead),
    the second was quick. The second start's time came out 4 ms before the first's, and
    the floor that holds a time up to the current correction's round trip (10 µs) behind
    did not hold it: r1 was created before r0 and admitted first (CI, the conformance
    suite's oldest-first test on a minimal store, under load). Held now: a time up to both
    corrections' round trips behind the last is held at it."""
    base = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    ms = timedelta(milliseconds=1)
    # The process clock's readings, in order: correction 1 (before, after), start 1,
    # correction 2 (before, after), start 2. The store answers as the process clock reads.
    local = iter([base, base + 10 * ms, base + 10 * ms, base + 11 * ms, base + 11.01 * ms, base + 11.02 * ms])
    remote = iter([base + 10 * ms, base + 11.005 * ms])  # the first read answered at the end of its wait

    class Store:
        def now(self) -> datetime:
            return next(remote)

    clock = StoreClock(Store())  # type: ignore[arg-type]
    clock._local = lambda: next(local)
    clock.correct()
    first = clock()
    clock.correct()
    second = clock()
    assert second >= first, (first, second)
    assert second - first < 10 * ms  # held at the first, not ahead of it
