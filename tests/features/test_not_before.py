"""A delayed start (X5, #18 item 9, #20 item 5): ``engine.start(..., not_before=...)``.

A waiter whose ``not_before`` has not come by the store's clock (the
database's, R5) is neither claimed nor admitted; it keeps its creation place
in its key's line (S5 step 3), blocks none of the due waiters behind it (the
claim, the release handoff, the tick's catch-up and the slot audit all skip
it), and the tick sends its turn once it is due, a lost wake-up included.
On the in-memory store and on the DATABASE_URL database (SQLite, PostgreSQL,
MariaDB).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db.models import F

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidNotBeforeError
from durable_singleton.explain import ExplainState
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.helpers import HandClock as Clock

HOUR = 3600.0


def _declare(registry: Registry, log: list[str], limit: int = 1, **options: Any) -> None:
    def body(ctx: Any, input: dict[str, Any]) -> str:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        log.append(ctx.run_id)
        return str(ctx.run_id)

    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "limit": limit}, **options)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def delayed(make: Callable[..., Engine], store_kind: str, clock: Clock) -> Engine:
    """An engine whose time ``pass_time`` moves: the memory store's clock, or the
    stored delayed starts of the database (moved back, as if an hour passed)."""
    return make(clock) if store_kind == "memory" else make()


def pass_time(engine: Engine, seconds: float = 2 * HOUR) -> None:
    """Let ``seconds`` pass for the delayed starts: on the memory store its clock
    moves; on the database every stored ``not_before`` and ``wake_at`` moves back."""
    if isinstance(engine.store, MemoryStore):
        engine.store.clock.now += timedelta(seconds=seconds)  # type: ignore[attr-defined]
        return
    from durable_singleton.models import Run

    shift = timedelta(seconds=seconds)
    Run.objects.filter(not_before__isnull=False).update(not_before=F("not_before") - shift)
    Run.objects.filter(wake_at__isnull=False).update(wake_at=F("wake_at") - shift)


def _held_with_d_and_w(engine: Engine, registry: Registry) -> list[str]:
    """Key K of ``wf`` (limit 1): the holder H in its body, waiting for ``go``;
    behind it D (not before an hour from now) and W (due), started in that
    order and parked. Returns the log of the bodies that finished."""
    log: list[str] = []
    _declare(registry, log)
    engine.start("wf", {"k": "K", "hold": True}, run_id="H")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    engine.start("wf", {"k": "K"}, run_id="W")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    return log


def test_a_waiter_not_due_is_skipped_while_a_due_one_behind_it_is_admitted(delayed: Engine, registry: Registry) -> None:
    """X5, S5 step 3 (the procrastinate #1599 trap): D, older and not due, is not
    admitted; W, created after it and due, is admitted on the free slot and runs;
    D's first turn is not sent before it is due, and a turn that arrives early
    claims nothing and sets its wake time to its not_before."""
    log: list[str] = []
    _declare(registry, log)
    d = delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    assert d.not_before is not None and d.wake_at == d.not_before and d.status == "pending"
    delayed.start("wf", {"k": "K"}, run_id="W")
    assert list(delayed.dispatcher.queue) == ["W"]  # type: ignore[attr-defined]
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["W"]
    assert delayed.execute("D") == "skipped"  # an early turn (a wake, a redelivery)
    stored = delayed.get("D")
    assert stored.status == "pending" and not stored.admitted and stored.attempts == 0
    assert stored.wake_at == stored.not_before == d.not_before


def test_a_due_waiter_is_admitted_past_an_older_one_not_due_on_a_busy_key(delayed: Engine, registry: Registry) -> None:
    """X5: behind a holder H, the not-due D and the due W queue; W's own claim
    parks it (no free slot), and when a second slot opens W, not D, takes it."""
    log: list[str] = []
    _declare(registry, log, limit=2)
    delayed.start("wf", {"k": "K", "hold": True}, run_id="H1")
    delayed.start("wf", {"k": "K", "hold": True}, run_id="H2")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    delayed.start("wf", {"k": "K"}, run_id="W")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert delayed.get("W").status == "suspended" and not delayed.get("W").admitted
    delayed.signal("H1", "go")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["H1", "W"]
    assert delayed.get("D").status == "pending" and not delayed.get("D").admitted


def test_the_release_handoff_skips_a_waiter_not_due(delayed: Engine, registry: Registry) -> None:
    """X5, S7: the holder's settle grants its slot to W, the oldest due waiter,
    past the older D that is not due; D is not granted and no turn is sent for it."""
    log = _held_with_d_and_w(delayed, registry)
    sent = len(delayed.dispatcher.sent)  # type: ignore[attr-defined]
    delayed.signal("H", "go")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["H", "W"]
    assert "D" not in delayed.dispatcher.sent[sent:]  # type: ignore[attr-defined]
    assert not delayed.get("D").admitted


def test_a_delayed_run_is_admitted_when_due_in_its_creation_place(delayed: Engine, registry: Registry) -> None:
    """X5, S5 step 3: once due, D keeps the place it has had since its creation:
    the holder's release grants D before W, who was created after it."""
    log = _held_with_d_and_w(delayed, registry)
    pass_time(delayed)
    delayed.signal("H", "go")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["H", "D", "W"]


def test_a_delayed_run_is_sent_by_the_tick_when_due(delayed: Engine, registry: Registry) -> None:
    """X5, S8: no turn is sent at start; the tick sends none while it is not due,
    and sends it once due; it then runs."""
    log: list[str] = []
    _declare(registry, log)
    delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    assert list(delayed.dispatcher.queue) == []  # type: ignore[attr-defined]
    report = delayed.tick()
    assert "D" not in report.dispatched and "D" not in report.caught_up
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == []
    pass_time(delayed)
    delayed.tick()
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["D"] and delayed.get("D").status == "completed"


def test_a_lost_wake_up_is_caught_up_by_another_process_tick(
    delayed: Engine, make: Callable[..., Engine], store_kind: str, clock: Clock, registry: Registry
) -> None:
    """X5, S8, S8a: the holder settled while D was not due (its handoff granted
    nothing); once due, D's wake-up is lost (the process that would send it is
    gone, its queued turns with it); another process's tick catches it up."""
    log: list[str] = []
    _declare(registry, log)
    delayed.start("wf", {"k": "K", "hold": True}, run_id="H")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    delayed.signal("H", "go")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["H"] and not delayed.get("D").admitted
    pass_time(delayed)
    delayed.tick()
    delayed.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the process dies: its sends are lost
    other = make(clock) if store_kind == "memory" else make()
    caught: list[str] = []
    for _ in range(3):
        pass_time(other, 10)  # past the redelivery window of the lost send (S7a)
        report = other.tick()
        caught.extend(report.caught_up + report.dispatched)
        other.dispatcher.drain()  # type: ignore[attr-defined]
        if log == ["H", "D"]:
            break
    assert log == ["H", "D"] and "D" in caught


@pytest.mark.django_db(transaction=True)
def test_the_catch_up_does_not_pick_keys_whose_waiters_are_not_due() -> None:
    """X5, S8a, S8b: more than TICK_BATCH free keys whose only waiter is not due are
    not picked by the catch-up (it would grant nothing, tick after tick); a later
    key whose due waiter lost its push is granted at the first tick."""
    registry = Registry()
    registry.add("wf", "1", lambda c, i: None, singleton={"key": lambda i: i["k"]})
    engine = make_engine("django", registry=registry, TICK_BATCH=3)
    from durable_singleton.models import Run, SingletonKey

    for n in range(6):
        engine.start("wf", {"k": f"A{n}"}, run_id=f"D{n}", not_before=HOUR)
        SingletonKey.objects.get_or_create(workflow_name="wf", key=f"A{n}")  # older keys: picked first
    engine.start("wf", {"k": "Z"}, run_id="Z")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # Z's push is lost
    SingletonKey.objects.get_or_create(workflow_name="wf", key="Z")
    # Every wake time has passed: Z's lost push is overdue (S7a), and the delayed
    # waiters' turns are not on their way either (an operator's wake, say: S7a).
    Run.objects.update(wake_at=F("created_at") - timedelta(minutes=1))
    assert engine.tick().caught_up == ["Z"]


@pytest.mark.django_db(transaction=True)
def test_not_before_is_judged_on_the_database_clock() -> None:
    """X5, R5, R8: an engine whose clock runs two hours ahead starts D due in one
    hour by the database's clock; its turn is sent (the process thinks it due),
    but the claim, on the database's clock, does not admit it."""
    registry = Registry()
    log: list[str] = []
    _declare(registry, log)
    probe = make_engine("django", registry=registry)
    db_now = probe.store.now()
    ahead = make_engine("django", registry=registry, clock=lambda: datetime.now(UTC) + timedelta(hours=2))
    ahead.start("wf", {"k": "K"}, run_id="D", not_before=db_now + timedelta(hours=1))
    ahead.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == [] and ahead.get("D").status == "pending" and not ahead.get("D").admitted
    assert ahead.get("D").wake_at == db_now + timedelta(hours=1)


@pytest.mark.parametrize(
    "value",
    [datetime(2030, 1, 1), -1, -0.5, math.nan, math.inf, -math.inf, "60", True, [1], timedelta(seconds=5), 1e300],
    ids=["naive", "negative", "negative-float", "nan", "inf", "-inf", "str", "bool", "list", "timedelta", "huge"],
)
def test_a_bad_not_before_is_a_typed_error_and_writes_nothing(engine: Engine, registry: Registry, value: Any) -> None:
    """X5, section 7: a naive datetime, a negative, NaN or infinite number of
    seconds, a number past the largest datetime, or any other type raises
    InvalidNotBeforeError; no run is written, by start or start_many."""
    _declare(registry, [])
    with pytest.raises(InvalidNotBeforeError):
        engine.start("wf", {"k": "K"}, run_id="X", not_before=value)
    with pytest.raises(InvalidNotBeforeError):
        engine.start_many("wf", [{"k": "K"}], run_ids=["Y"], not_before=value)
    assert engine.store.list_runs() == []
    assert list(engine.dispatcher.queue) == []  # type: ignore[attr-defined]


def test_an_aware_datetime_in_any_zone_or_the_past_is_accepted(engine: Engine, registry: Registry) -> None:
    """X5: an aware datetime of any zone is the same moment; one in the past is
    due at once (its first turn is sent now); 0 seconds is due at once."""
    from zoneinfo import ZoneInfo

    log: list[str] = []
    _declare(registry, log, limit=3)
    later = (datetime.now(UTC) + timedelta(hours=1)).astimezone(ZoneInfo("Asia/Kolkata"))
    assert engine.start("wf", {"k": "K"}, run_id="L", not_before=later).not_before == later
    engine.start("wf", {"k": "K"}, run_id="P", not_before=datetime(2000, 1, 1, tzinfo=UTC))
    engine.start("wf", {"k": "K"}, run_id="Z", not_before=0)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["P", "Z"]


def test_start_many_and_astart_take_not_before(delayed: Engine, registry: Registry) -> None:
    """X5: start_many delays each run of its batch and sends none of their turns;
    the async twin astart takes not_before too."""
    log: list[str] = []
    _declare(registry, log, limit=5)
    runs = delayed.start_many("wf", [{"k": "K"}, {"k": "K"}], run_ids=["M1", "M2"], not_before=HOUR)
    assert [getattr(r, "not_before", None) is not None for r in runs] == [True, True]
    assert list(delayed.dispatcher.queue) == []  # type: ignore[attr-defined]
    if isinstance(delayed.store, MemoryStore):
        run = asyncio.run(delayed.astart("wf", {"k": "K"}, run_id="A", not_before=HOUR))
        assert run.not_before is not None and list(delayed.dispatcher.queue) == []  # type: ignore[attr-defined]
    pass_time(delayed)
    delayed.tick()
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    assert set(log) >= {"M1", "M2"}


def test_the_execution_timeout_counts_from_not_before(delayed: Engine, registry: Registry) -> None:
    """X5, D5: a delayed run's execution deadline is its not_before plus the
    workflow's timeout, so the delay never times it out before it could run."""
    _declare(registry, [], timeout=60)
    run = delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    assert run.deadline_at is not None and run.not_before is not None
    assert run.deadline_at == run.not_before + timedelta(seconds=60)
    report = delayed.tick()
    assert "D" not in report.timed_out and delayed.get("D").status == "pending"


def test_a_delayed_waiter_is_explained_as_not_due(delayed: Engine, registry: Registry) -> None:
    """X5, K3: explain says "not due until T" for a run whose not_before has not
    come, and a due waiter's position counts only the due waiters ahead of it."""
    log: list[str] = []
    _declare(registry, log)
    delayed.start("wf", {"k": "K", "hold": True}, run_id="H")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    d = delayed.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    delayed.start("wf", {"k": "K"}, run_id="W")
    delayed.dispatcher.drain()  # type: ignore[attr-defined]
    found = delayed.explain("D")
    assert found.state is ExplainState.NOT_DUE and found.not_before == d.not_before
    assert "not due until" in found.sentence and "behind" not in found.sentence
    waiter = delayed.explain("W")
    assert waiter.state is ExplainState.WAITER and waiter.position == 1, waiter.sentence
    assert "1 waiter(s) ahead of it not due yet" in waiter.sentence
    plain = Registry()
    plain.add("free", "1", lambda c, i: None)
    delayed.registry = plain
    free = delayed.start("free", None, run_id="F", not_before=HOUR)
    assert delayed.explain("F").state is ExplainState.NOT_DUE and free.not_before is not None


@pytest.mark.django_db(transaction=True)
def test_a_waiter_not_due_is_not_a_stalled_waiter() -> None:
    """X5, K4: on a free key, a waiter whose not_before has not come is not
    reported stalled by the slot audit, whatever its wake time; a due waiter
    behind it with a free slot and a wake time long past is."""
    from durable_singleton.models import Run

    registry = Registry()
    _declare(registry, [])
    engine = make_engine("django", registry=registry)
    engine.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    engine.start("wf", {"k": "K"}, run_id="W")
    Run.objects.update(wake_at=F("created_at") - timedelta(minutes=5))  # wake times long past
    found = {f.run_id: f.kind for f in engine.audit_slots().findings}
    assert "D" not in found and found.get("W") == "stalled_waiter", found


@pytest.mark.django_db(transaction=True)
def test_the_admin_shows_a_delayed_waiter_as_not_due_and_counts_due_waiters_only() -> None:
    """X5, K3: the admin's place of a run says what explain says: a delayed
    waiter is "not due until T"; a due waiter behind it is at position 1."""
    from django.contrib import admin

    from durable_singleton import queues
    from durable_singleton.models import Run

    registry = Registry()
    _declare(registry, [])
    engine = make_engine("django", registry=registry)
    engine.start("wf", {"k": "K", "hold": True}, run_id="H")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    engine.start("wf", {"k": "K"}, run_id="W")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    d, w = Run.objects.get(pk="D"), Run.objects.get(pk="W")
    assert queues.run_place(d).kind == "not-due" and queues.run_place(d).not_before == d.not_before
    assert queues.run_place(w).position == 1 == engine.explain("W").position
    shown = str(admin.site._registry[Run].place_display(d))  # type: ignore[attr-defined]
    assert "not due until" in shown
