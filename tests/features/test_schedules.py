"""Schedules: S17 (a window fires once, deterministic run ids, overlap, catch-up),
S16 (the queue cap applies to scheduled starts), R3, S8b; frozen clocks and
racing ticks on the in-memory store and on the DATABASE_URL database."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import pytest

from durable_singleton import Singleton
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidWorkflowError, ValidationError
from durable_singleton.schedules import (
    Schedule,
    fire_due_schedules,
    pause_schedule,
    resume_schedule,
    schedule_run_id,
    schedule_store_for,
)
from tests.conftest import Monitor, run_threads
from tests.helpers import HandClock as Clock
from tests.helpers import audited


class CatchUp(NamedTuple):
    """A case of a catch-up policy (S17): the policy, its limit, the windows
    that fire (``HH:MM``) and how the missed ones are described (None: none)."""

    policy: str
    limit: int
    started: list[str]
    missed_detail: str | None

    def __str__(self) -> str:
        return f"{self.policy}-{self.limit}"


# In the future of the database clock, so leases stamped from it are live.
T0 = datetime(2030, 1, 15, 10, 0, 30, tzinfo=UTC)


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


def _plain(registry: Registry, *schedules: Schedule, name: str = "report", singleton: Any = None) -> None:
    registry.add(name, "1", lambda ctx, i: {"got": i}, schedules=schedules, singleton=singleton)


def _outcomes(engine: Engine, name: str) -> list[tuple[str, str]]:
    return [(f.run_id, str(f.outcome)) for f in schedule_store_for(engine.store).firings(name)]


def test_interval_window_fires_once_with_a_deterministic_run_id(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S17, R3: each window of an interval schedule starts one run whose id is
    derived from the schedule and the window; later ticks start nothing new."""
    _plain(registry, Schedule("hourly-report", every=60, input={"n": 1}))
    engine = make(clock=clock)
    assert engine.tick().dispatched == []  # 10:00:30: the first window is 10:01:00
    clock.advance(29.9)
    engine.tick()
    assert engine.store.list_runs() == []
    clock.advance(0.1)
    engine.tick()
    clock.advance(20)
    engine.tick()
    run_id = "schedule:hourly-report:2030-01-15T10:01:00Z"
    assert [r.run_id for r in engine.store.list_runs()] == [run_id]
    assert schedule_run_id("hourly-report", datetime(2030, 1, 15, 10, 1, tzinfo=UTC)) == run_id
    engine.dispatcher.drain()
    run = engine.get(run_id)
    assert (run.status, run.input, run.output) == ("completed", {"n": 1}, {"got": {"n": 1}})
    assert _outcomes(engine, "hourly-report") == [(run_id, "started")]
    state = schedule_store_for(engine.store).get("hourly-report")
    assert state is not None and state.next_fire_at == datetime(2030, 1, 15, 10, 2, tzinfo=UTC)


def test_cron_windows_are_computed_in_the_schedules_time_zone(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S17: a cron schedule's windows follow its time zone: 03:00 in Paris is
    02:00 UTC in January and 01:00 UTC in July (daylight saving time)."""
    _plain(registry, Schedule("nightly", cron="0 3 * * *", timezone="Europe/Paris"))
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    state = schedule_store_for(engine.store).get("nightly")
    assert state is not None and state.next_fire_at == datetime(2030, 1, 16, 2, 0, tzinfo=UTC)
    clock.now = datetime(2030, 1, 16, 2, 0, 0, 500, tzinfo=UTC)
    fire_due_schedules(engine, clock(), 10)
    assert [r.run_id for r in engine.store.list_runs()] == ["schedule:nightly:2030-01-16T02:00:00Z"]
    spec = state.spec
    assert spec.next_window(datetime(2030, 7, 1, tzinfo=UTC)) == datetime(2030, 7, 1, 1, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "case",
    [
        CatchUp("none", 10, [], "6 window(s)"),
        CatchUp("latest", 10, ["10:06"], "5 window(s)"),
        CatchUp("all", 3, ["10:04", "10:05", "10:06"], "3 window(s)"),
        CatchUp("all", 10, ["10:01", "10:02", "10:03", "10:04", "10:05", "10:06"], None),
    ],
    ids=str,
)
def test_catch_up_policy_chooses_the_missed_windows_that_fire(
    make: Callable[..., Engine], registry: Registry, clock: Clock, case: CatchUp
) -> None:
    """S17: after six windows passed with no tick, "none" fires nothing older
    than its grace, "latest" fires the newest, "all" fires up to N newest,
    oldest first; the windows left out are recorded as missed, not lost silently."""
    policy, limit, started, missed_detail = case
    _plain(registry, Schedule("s", every=60, catch_up=policy, catch_up_limit=limit, grace=30))
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    clock.now = datetime(2030, 1, 15, 10, 6, 45, tzinfo=UTC)  # windows 10:01 .. 10:06 are due
    fire_due_schedules(engine, clock(), 10)
    runs = [r.run_id for r in engine.store.list_runs()]
    assert runs == [f"schedule:s:2030-01-15T{hm}:00Z" for hm in started]
    firings = schedule_store_for(engine.store).firings("s")
    missed = [f for f in firings if f.outcome == "missed"]
    if missed_detail is None:
        assert missed == []
    else:
        assert len(missed) == 1 and missed[0].detail.startswith(missed_detail)
        assert missed[0].window_at == datetime(2030, 1, 15, 10, 1, tzinfo=UTC)
    state = schedule_store_for(engine.store).get("s")
    assert state is not None and state.next_fire_at == datetime(2030, 1, 15, 10, 7, tzinfo=UTC)


def test_catch_up_none_fires_a_window_within_its_grace(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S17: catch_up="none" still fires a window the tick reaches late within ``grace`` seconds."""
    _plain(registry, Schedule("s", every=60, catch_up="none", grace=30))
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    clock.now = datetime(2030, 1, 15, 10, 1, 29, tzinfo=UTC)
    fire_due_schedules(engine, clock(), 10)
    assert [r.run_id for r in engine.store.list_runs()] == ["schedule:s:2030-01-15T10:01:00Z"]


def test_overlap_skip_records_a_skipped_window_while_the_previous_run_is_active(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S17: with overlap="skip" a window whose previous run is still active starts
    nothing and is recorded as skipped; once that run finished, the next window fires."""
    _plain(registry, Schedule("s", every=60, overlap="skip"))
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    clock.advance(30)  # 10:01:00
    fire_due_schedules(engine, clock(), 10)
    clock.advance(60)  # 10:02:00: the 10:01 run was never executed, it is still pending
    fire_due_schedules(engine, clock(), 10)
    engine.dispatcher.drain()
    clock.advance(60)  # 10:03:00
    fire_due_schedules(engine, clock(), 10)
    assert _outcomes(engine, "s") == [
        ("schedule:s:2030-01-15T10:01:00Z", "started"),
        ("schedule:s:2030-01-15T10:02:00Z", "skipped"),
        ("schedule:s:2030-01-15T10:03:00Z", "started"),
    ]
    skipped = schedule_store_for(engine.store).firings("s")[1]
    assert "schedule:s:2030-01-15T10:01:00Z is still pending" in skipped.detail
    assert engine.store.get_run("schedule:s:2030-01-15T10:02:00Z") is None


def test_window_rejected_by_the_queue_cap_is_recorded(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S16, S15: a scheduled start refused by the key's queue cap writes no run and
    is recorded as rejected with the cap's message; the cursor moves on."""
    _plain(
        registry,
        Schedule("s", every=60, catch_up="all"),
        singleton=Singleton(key=lambda i: "only", limit=1, max_queue_depth=1),
    )
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    clock.now = datetime(2030, 1, 15, 10, 3, 0, tzinfo=UTC)  # three windows, room for two runs
    fire_due_schedules(engine, clock(), 10)
    outcomes = _outcomes(engine, "s")
    assert [o for _, o in outcomes] == ["started", "started", "rejected"]
    assert engine.store.get_run(outcomes[2][0]) is None
    detail = schedule_store_for(engine.store).firings("s")[2].detail
    assert "max_queue_depth=1" in detail and "'only'" in detail


def test_singleton_schedule_serializes_its_windows(
    make: Callable[..., Engine], registry: Registry, clock: Clock, monitor: Monitor
) -> None:
    """S17, S5: a scheduled singleton with a constant key runs its windows one
    at a time, in window order: the later window waits behind the earlier one."""
    definition = audited(registry, monitor, name="sync")
    registry.add(
        "sync",
        "2",
        definition.body,
        singleton=definition.singleton,
        schedules=[Schedule("sync-k", every=60, catch_up="all", input={"k": "K"})],
    )
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    clock.now = datetime(2030, 1, 15, 10, 2, 0, tzinfo=UTC)
    fire_due_schedules(engine, clock(), 10)
    first, second = "schedule:sync-k:2030-01-15T10:01:00Z", "schedule:sync-k:2030-01-15T10:02:00Z"
    engine.dispatcher.queue.clear()
    assert engine.execute(second) == "parked"  # picked up first, admitted second (S9)
    assert engine.execute(first) == "completed"
    engine.dispatcher.drain()
    assert engine.get(second).status == "completed"
    assert monitor.entered == [first, second] and monitor.highest["K"] == 1


@pytest.mark.parametrize(
    "case",
    [
        CatchUp("none", 10, [], "5 window(s) from 2030-01-15 10:01:00 UTC to 2030-01-15 10:05:59 UTC"),
        CatchUp("latest", 10, ["10:05"], "4 window(s) from 2030-01-15 10:01:00 UTC to 2030-01-15 10:04:59 UTC"),
        CatchUp("all", 2, ["10:04", "10:05"], "3 window(s) from 2030-01-15 10:01:00 UTC to 2030-01-15 10:03:59 UTC"),
        CatchUp("all", 10, ["10:01", "10:02", "10:03", "10:04", "10:05"], None),
    ],
    ids=str,
)
def test_pause_stops_firing_and_resume_fires_the_paused_windows_by_the_catch_up_policy(
    make: Callable[..., Engine], registry: Registry, clock: Clock, case: CatchUp
) -> None:
    """S17: a paused schedule fires nothing; once resumed, the windows that passed
    while it was paused fire as its catch-up policy says, the others are recorded
    as missed (never silently), and the next window fires on time. An unknown
    name is a typed error."""
    policy, limit, started, missed_detail = case
    _plain(registry, Schedule("s", every=60, catch_up=policy, catch_up_limit=limit, grace=20))
    engine = make(clock=clock)
    pause_schedule(engine, "s")
    clock.advance(300)  # 10:05:30: windows 10:01 .. 10:05 passed while paused
    engine.tick()
    assert engine.store.list_runs() == []
    resume_schedule(engine, "s")
    assert engine.store.list_runs() == []  # the tick fires, not the resume
    engine.tick()
    assert [r.run_id for r in engine.store.list_runs()] == [f"schedule:s:2030-01-15T{hm}:00Z" for hm in started]
    missed = [f.detail for f in schedule_store_for(engine.store).firings("s") if f.outcome == "missed"]
    assert missed == ([] if missed_detail is None else [f"{missed_detail} not fired (catch_up={policy})"])
    clock.advance(30)  # 10:06:00
    engine.tick()
    assert engine.store.get_run("schedule:s:2030-01-15T10:06:00Z") is not None
    with pytest.raises(ValidationError, match="no schedule named 'nope'"):
        pause_schedule(engine, "nope")


def test_invalid_schedule_is_refused_at_registration(registry: Registry) -> None:
    """Section 7: an invalid schedule is refused when the workflow is registered,
    naming the workflow and the field; nothing is registered."""
    cases: list[tuple[Schedule, str]] = [
        (Schedule("s"), "exactly one of every"),
        (Schedule("s", every=60, cron="* * * * *"), "exactly one of every"),
        (Schedule("s", every=0), "schedules\\['s'\\].every"),
        (Schedule("s", cron="61 * * * *"), "cron"),
        (Schedule("s", every=60, timezone="Mars/Olympus"), "timezone"),
        (Schedule("s", every=60, overlap="queue"), "overlap"),
        (Schedule("s", every=60, catch_up="some"), "catch_up"),
        (Schedule("s", every=60, catch_up_limit=0), "catch_up_limit"),
        (Schedule("s", every=60, input={1, 2}), "input"),
        (Schedule("bad name", every=60), "name"),
    ]
    for spec, field in cases:
        with pytest.raises(InvalidWorkflowError, match=f"'wf'.*{field}"):
            registry.add("wf", "1", lambda c, i: None, schedules=[spec])
    with pytest.raises(InvalidWorkflowError, match="duplicate schedule name"):
        registry.add("wf", "1", lambda c, i: None, schedules=[Schedule("s", every=1), Schedule("s", every=2)])
    assert registry.workflows == {}


def test_one_bad_schedule_does_not_stop_the_others(
    make: Callable[..., Engine], registry: Registry, clock: Clock
) -> None:
    """S8b: a schedule whose workflow is unknown records a failed window and the
    other schedules still fire."""
    _plain(registry, Schedule("good", every=60))
    registry.add("gone", "1", lambda c, i: None, schedules=[Schedule("orphan", every=60)])
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 10)
    del registry.latest["gone"], registry.workflows[("gone", "1")]  # its code was removed
    clock.advance(30)
    report = fire_due_schedules(engine, clock(), 10)
    assert report.outcomes == {
        "schedule:good:2030-01-15T10:01:00Z": "started",
        "schedule:orphan:2030-01-15T10:01:00Z": "failed",
    }
    assert "UnknownWorkflowError" in schedule_store_for(engine.store).firings("orphan")[0].detail


@pytest.mark.races
def test_racing_ticks_fire_each_window_once(make: Callable[..., Engine], registry: Registry, clock: Clock) -> None:
    """S17, R3, section 6: four ticks racing on the same due schedules (own
    connections) start one run per window and record each window once."""
    schedules = [Schedule(f"s{n}", every=60, catch_up="all", input={"n": n}) for n in range(12)]
    _plain(registry, *schedules)
    engine = make(clock=clock)
    fire_due_schedules(engine, clock(), 100)
    clock.now = datetime(2030, 1, 15, 10, 3, 0, tzinfo=UTC)  # three windows each
    reports = run_threads(4, lambda i: fire_due_schedules(engine, clock(), 100))
    started = Counter(run_id for r in reports for run_id, o in r.outcomes.items() if o == "started")
    assert all(not r.errors for r in reports), [r.errors for r in reports]
    assert len(started) == 36 and set(started.values()) == {1}
    assert len(engine.store.list_runs()) == 36
    for spec in schedules:
        assert [o for _, o in _outcomes(engine, spec.name)] == ["started"] * 3


@pytest.mark.races
@pytest.mark.slow
def test_racing_ticks_on_a_real_clock_fire_every_window_once_with_bounded_jitter(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """S17, S8b: three tick loops (every 100 ms, own connections) over 3 s on the
    real clock fire every one-second window once, none missed, each run created
    within a second of its window (the firing jitter)."""
    _plain(registry, Schedule("every-second", every=1, catch_up="all"))
    engine = make()
    fire_due_schedules(engine, engine.caller_now(), 10)
    stop = time.monotonic() + 3.0

    def loop(i: int) -> int:
        time.sleep(i * 0.033)
        turns = 0
        while time.monotonic() < stop:
            fire_due_schedules(engine, engine.caller_now(), 10)  # the tick's: the store's clock (R8)
            turns += 1
            time.sleep(0.1)
        return turns

    run_threads(3, loop)
    runs = sorted(engine.store.list_runs(), key=lambda r: r.run_id)
    assert len(runs) >= 2
    jitter = [
        (
            r.created_at - datetime.strptime(r.run_id.split(":", 2)[2], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        ).total_seconds()
        for r in runs
    ]
    assert all(0 <= j < 1.0 for j in jitter), jitter
    firings = schedule_store_for(engine.store).firings("every-second")
    steps = {(b.window_at - a.window_at).total_seconds() for a, b in itertools.pairwise(firings)}
    assert steps <= {1.0} and all(f.outcome == "started" for f in firings)
    mean = sum(jitter) / len(jitter)
    print(f"jitter over {len(jitter)} windows: max {max(jitter) * 1000:.0f} ms, mean {mean * 1000:.0f} ms")


@pytest.mark.django_db(transaction=True)
def test_operator_schedule_row_fires_and_shows_its_next_window(registry: Registry, clock: Clock) -> None:
    """S17: a schedule kept as a row an operator manages (source "admin") fires
    like a declared one."""
    from durable_singleton.models import ScheduleState
    from durable_singleton.testing import make_engine

    _plain(registry)
    engine = make_engine("django", registry=registry, clock=clock)
    ScheduleState.objects.create(name="ops", workflow_name="report", every_seconds=60, input={"by": "ops"})
    engine.tick()
    assert ScheduleState.objects.get(name="ops").next_fire_at == datetime(2030, 1, 15, 10, 1, tzinfo=UTC)
    clock.advance(30)
    engine.tick()
    runs = [(r.run_id, r.input) for r in engine.store.list_runs()]
    assert runs == [("schedule:ops:2030-01-15T10:01:00Z", {"by": "ops"})]
    assert ScheduleState.objects.get(name="ops").next_fire_at == datetime(2030, 1, 15, 10, 2, tzinfo=UTC)


@pytest.mark.django_db(transaction=True)
def test_admin_lists_schedules_with_their_next_window_and_pauses_them(admin_client: Any, settings: Any) -> None:
    """S17, section 6: the admin lists the testproject's declared schedules with their
    next window; the pause action (change permission) stops one; an operator's
    schedule with a bad cron expression is refused with the field named."""
    from django.urls import reverse

    from durable_singleton.models import ScheduleState
    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    fire_due_schedules(engine, engine.now(), 10)  # writes the declared schedules' rows
    url = reverse("admin:durable_singleton_schedulestate_changelist")
    page = admin_client.get(url).content.decode()
    assert "sync-store-north" in page and "sync-store-south" in page
    assert "every 900 s" in page and "(in " in page
    north_pk = ScheduleState.objects.get(name="sync-store-north").pk
    response = admin_client.post(url, {"action": "pause_selected", "_selected_action": [north_pk]})
    assert response.status_code == 302
    north = ScheduleState.objects.get(name="sync-store-north")
    assert north.paused
    assert "paused" in admin_client.get(url + "?paused__exact=1").content.decode()
    change = admin_client.get(reverse("admin:durable_singleton_schedulestate_change", args=[north_pk]))
    assert change.status_code == 200 and "Recent windows" in change.content.decode()
    add = reverse("admin:durable_singleton_schedulestate_add")
    refused = admin_client.post(
        add,
        {
            "name": "ops",
            "workflow_name": "sync-inventory",
            "cron": "99 * * * *",
            "timezone": "UTC",
            "input": "{}",
            "overlap": "allow",
            "catch_up": "latest",
            "catch_up_limit": 10,
            "grace_seconds": 60,
        },
    )
    assert refused.status_code == 200 and "cron" in refused.content.decode()
    assert not ScheduleState.objects.filter(name="ops").exists()


def _schedule_form(**fields: Any) -> dict[str, Any]:
    """The POST of the admin's schedule form: an interval schedule of the test project's
    sync-inventory-wide (no queue cap), overridden by ``fields`` (a checkbox is sent only when checked)."""
    form: dict[str, Any] = {
        "workflow_name": "sync-inventory-wide",
        "every_seconds": 60,
        "cron": "",
        "timezone": "UTC",
        "input": '{"store_id": "ops"}',
        "overlap": "allow",
        "catch_up": "latest",
        "catch_up_limit": 10,
        "grace_seconds": 60,
    }
    form.update(fields)
    return {k: v for k, v in form.items() if v is not False}


def _errors(response: Any) -> Any:
    context = response.context or {}
    return context.get("adminform") and context["adminform"].form.errors


@pytest.mark.django_db(transaction=True)
def test_an_operator_schedule_is_edited_in_the_admin_and_keeps_its_name(admin_client: Any, settings: Any) -> None:
    """S17, section 6: a schedule made in the admin opens in its change form with
    its name read-only (part of every run id) and saves an edit of its other
    fields; a tampered name in the POST renames nothing; an edit that makes it
    invalid is refused with the field named and writes nothing; a change of
    timing moves its cursor to the first new window on the database's clock."""
    from django.urls import reverse

    from durable_singleton.models import ScheduleState
    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    made = admin_client.post(reverse("admin:durable_singleton_schedulestate_add"), _schedule_form(name="ops"))
    assert made.status_code == 302, _errors(made)
    row = ScheduleState.objects.get(name="ops")
    assert row.source == "admin" and row.next_fire_at is not None
    change = reverse("admin:durable_singleton_schedulestate_change", args=[row.pk])
    page = admin_client.get(change)
    assert page.status_code == 200 and 'name="name"' not in page.content.decode()
    edited = admin_client.post(
        change, _schedule_form(name="renamed", input='{"store_id": "ops-2"}', catch_up="all", catch_up_limit=3)
    )
    assert edited.status_code == 302, _errors(edited)
    row.refresh_from_db()
    assert (row.name, row.input, row.catch_up, row.catch_up_limit) == ("ops", {"store_id": "ops-2"}, "all", 3)
    cursor = row.next_fire_at
    refused = admin_client.post(change, _schedule_form(every_seconds="", cron="99 * * * *"))
    assert refused.status_code == 200 and "cron" in str(_errors(refused))
    row.refresh_from_db()
    assert (row.every_seconds, row.cron, row.next_fire_at) == (60, "", cursor)
    before = engine.store.now()
    retimed = admin_client.post(change, _schedule_form(every_seconds=3600, input='{"store_id": "ops-2"}'))
    assert retimed.status_code == 302, _errors(retimed)
    row.refresh_from_db()
    hour = before.replace(minute=0, second=0, microsecond=0)
    assert row.every_seconds == 3600 and row.next_fire_at in (hour + timedelta(hours=1), hour + timedelta(hours=2))


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("policy", "limit", "fired"), [("none", 10, 0), ("latest", 10, 1), ("all", 3, 3), ("all", 10, None)]
)
def test_resuming_a_schedule_through_its_admin_form_fires_as_its_catch_up_policy_says(
    admin_client: Any, settings: Any, policy: str, limit: int, fired: int | None
) -> None:
    """S17: a schedule paused for six windows and resumed by unticking "paused"
    in its change form fires, at the next tick, the windows its catch-up policy
    picks ("none" with no grace: none; "latest": the newest; "all": at most the
    limit, the newest, oldest first; fired=None: every one) and records the
    others in one missed record; its next window is the first after the tick."""
    from django.urls import reverse

    from durable_singleton.models import ScheduleState
    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    form = _schedule_form(name="ops", catch_up=policy, catch_up_limit=limit, grace_seconds=0)
    made = admin_client.post(reverse("admin:durable_singleton_schedulestate_add"), {**form, "paused": "on"})
    assert made.status_code == 302, _errors(made)
    # Paused since six windows ago: its cursor is still the first of them.
    paused_at = engine.store.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    ScheduleState.objects.filter(name="ops").update(next_fire_at=paused_at)
    engine.tick()
    assert engine.store.list_runs() == []  # paused: nothing fires
    row = ScheduleState.objects.get(name="ops")
    resumed = admin_client.post(reverse("admin:durable_singleton_schedulestate_change", args=[row.pk]), form)
    assert resumed.status_code == 302, _errors(resumed)
    row.refresh_from_db()
    assert not row.paused and row.next_fire_at == paused_at  # the tick fires, not the form
    engine.tick()
    row.refresh_from_db()
    assert row.next_fire_at is not None and row.next_fire_at > engine.store.now() - timedelta(seconds=60)
    due = [paused_at + timedelta(minutes=n) for n in range(int((row.next_fire_at - paused_at) / timedelta(minutes=1)))]
    assert len(due) >= 6
    expected = due if fired is None else due[len(due) - fired :] if fired else []
    firings = schedule_store_for(engine.store).firings("ops")
    assert [(f.window_at, f.outcome) for f in firings if f.outcome != "missed"] == [(w, "started") for w in expected]
    assert sorted(r.run_id for r in engine.store.list_runs()) == [schedule_run_id("ops", w) for w in expected]
    missed = [f for f in firings if f.outcome == "missed"]
    if len(expected) == len(due):
        assert missed == []
    else:
        assert [(f.window_at, f.detail.split(" from ")[0]) for f in missed] == [
            (paused_at, f"{len(due) - len(expected)} window(s)")
        ]
