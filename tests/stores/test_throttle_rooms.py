"""Throttles in the rooms (#33, X6): a run that carries a throttle is started,
claimed and settled by its database's room, not the ORM path, so a throttle
costs about what a run without one costs.

On PostgreSQL the start writes the throttle memberships in the run's INSERT, the
claim message locks the throttle keys first (X6c), counts each key's window,
records the admission or parks the run until the window's opening (X6d), and the
settle is the fast path's. On MariaDB the claim is one CALL of ``ds_claim``
(``ds_admit_quota`` with ``sql/mysql/throttle.sql``), with the same locks, window
and park. On SQLite the room's claim of a run that carries one throttle and no
quota is one transaction (claim_throttled, the admission's record, the key's
bump), the same decisions. The conformance suite
(``tests/stores/test_conformance.py``) holds each path to the same decisions.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from bench.roundtrips import RoundTrips
from durable_singleton import Quota, Throttle
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run, SingletonKey, ThrottleAdmission, ThrottleMembership
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import room_engine
from tests.helpers import round_trips as _round_trips

pytestmark = pytest.mark.django_db(transaction=True)

postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path")


def _registry() -> Registry:
    registry = Registry()
    rate = Throttle("tr-rate", key=lambda i: i["t"], limit=2, period=3600)
    registry.add("tr-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]}, throttles=[rate])
    registry.add("tr-only", "1", lambda ctx, i: None, throttles=[rate])
    return registry


@pytest.fixture
def engine() -> Engine:
    return room_engine(_registry())  # its clock read once here, not counted below


@postgresql_only
@pytest.mark.parametrize("workflow", ["tr-keyed", "tr-only"])
def test_a_run_with_a_throttle_costs_three_round_trips_on_postgresql(engine: Engine, workflow: str) -> None:
    """X6b, X6c, X3i, R5a: on an idle key a run that carries a throttle (with or
    without a singleton key) costs its start (the run and its throttle membership
    in one INSERT), its claim message (its throttle key, then its singleton key
    and its row locked in the lock order, its window counted and its admission
    recorded, X3e) and its settle: three round trips, as a run without one. The
    ORM path took 27 and 20."""
    started: list[str] = []

    def one() -> None:
        started.append(engine.start(workflow, {"k": "K", "t": "T"}).run_id)
        engine.dispatcher.drain()  # type: ignore[attr-defined]

    sql = _round_trips(one)
    run = engine.get(started[0])
    assert run.status == RunStatus.COMPLETED
    assert len(sql) == 3, sql
    assert "start" in sql[0] and "claim_lock_throttle_keys" in sql[1] and "claim_quota_admit" in sql[1], sql
    assert not any(s.strip().upper() in ("BEGIN", "COMMIT") for s in sql), sql
    assert ThrottleMembership.objects.filter(run_id=run.run_id, throttle="tr-rate", key="T").count() == 1
    [admission] = ThrottleAdmission.objects.filter(run_id=run.run_id)
    assert (admission.throttle, admission.key, admission.admitted_at) == ("tr-rate", "T", run.admitted_at)


@postgresql_only
def test_the_claim_message_parks_an_over_rate_run_until_the_window_opens(engine: Engine) -> None:
    """X6d, X5, R5: the third run of a throttle key of 2 an hour is parked by the
    claim message itself (one round trip, the turn names the throttle), with its
    wake_at and not_before at the window's opening: the older admission's time
    plus the period, on the database's clock; no admission is recorded for it."""
    for run_id in ("A", "B", "C"):
        engine.start("tr-only", {"t": "T"}, run_id=run_id)
    limits = engine.limits()

    def turn(run_id: str) -> Any:
        return engine.store.begin_turn(
            run_id, "w", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
        )

    assert turn("A").state is TurnState.RUN and turn("B").state is TurnState.RUN
    parked: list[Any] = []
    sql = _round_trips(lambda: parked.append(turn("C")))
    assert len(sql) == 1 and "claim_quota_admit" in sql[0], sql
    assert parked[0].state is TurnState.PARKED and parked[0].throttled == "tr-rate", parked[0]
    c, a = engine.get("C"), engine.get("A")
    assert c.wake_at == c.not_before and a.admitted_at is not None
    assert (c.not_before - a.admitted_at).total_seconds() == 3600, (c.not_before, a.admitted_at)
    assert not ThrottleAdmission.objects.filter(run_id="C").exists()


mysql_only = pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB room's stored procedures")


def _mysql_round_trips(fn: Any) -> int:
    """The round trips ``fn`` made on this thread's connection, the driver's own
    ``SET autocommit`` and ``COMMIT`` included (``bench.roundtrips``)."""
    from bench.roundtrips import RoundTrips

    with RoundTrips(connection) as trips:
        fn()
    return trips.total


@mysql_only
@pytest.mark.parametrize("workflow", ["tr-keyed", "tr-only"])
def test_a_throttle_waiters_claim_is_one_call_on_mariadb(engine: Engine, workflow: str) -> None:
    """X6b, X6c, X3e, R5, #33: on MariaDB the claim of a run that carries a throttle (with
    or without a singleton key) on an idle key is one CALL of ``ds_claim``
    (``ds_admit_quota`` with ``sql/mysql/throttle.sql``): its throttle key, then its
    singleton key and its row locked in the lock order, its window counted and its
    admission recorded at the database's clock after the locks, the time its run's
    ``admitted_at`` holds too. The ORM path took 16 round trips."""
    assert engine.store._mysql_room() is not None  # type: ignore[attr-defined]  # migration 0024 ran
    run_id = engine.start(workflow, {"k": "K", "t": "T"}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the claim below is the turn
    limits = engine.limits()
    turns: list[Any] = []
    trips = _mysql_round_trips(
        lambda: turns.append(
            engine.store.begin_turn(
                run_id, "w", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
            )
        )
    )
    turn = turns[0]
    assert turn.state is TurnState.RUN and turn.admitted and turn.throttled is None, turn
    assert turn.run.quota_slot == "holder" and turn.run.admitted == (workflow == "tr-keyed"), turn.run
    assert trips == 1, trips
    run = engine.get(run_id)
    [admission] = ThrottleAdmission.objects.filter(run_id=run_id)
    assert (admission.throttle, admission.key, admission.admitted_at) == ("tr-rate", "T", run.admitted_at)
    assert run.fencing_token == (1 if workflow == "tr-keyed" else None), run


@mysql_only
def test_the_procedure_parks_an_over_rate_run_until_the_window_opens_on_mariadb(engine: Engine) -> None:
    """X6d, X5, R5, K2: on MariaDB the third run of a throttle key of 2 an hour is parked
    by ``ds_claim`` itself (one CALL; the turn names the throttle), its wake_at and
    not_before at the window's opening (the older admission's time plus the period, on
    the database's clock), its park reason ``throttled:tr-rate``, no admission recorded
    for it; once the key's limit is overridden to 3 (K2) its next claim, one CALL, admits
    it; a fourth, while the key is paused, is parked on its retry delay with no opening."""
    for run_id in ("A", "B", "C", "D"):
        engine.start("tr-only", {"t": "T"}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    limits = engine.limits()

    def turn(run_id: str) -> Any:
        return engine.store.begin_turn(
            run_id, "w", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
        )

    assert turn("A").state is TurnState.RUN and turn("B").state is TurnState.RUN
    parked: list[Any] = []
    assert _mysql_round_trips(lambda: parked.append(turn("C"))) == 1
    assert parked[0].state is TurnState.PARKED and parked[0].throttled == "tr-rate", parked[0]
    c, a = engine.get("C"), engine.get("A")
    assert c.park_reason == "throttled:tr-rate" and c.wake_at == c.not_before and a.admitted_at is not None
    assert (c.not_before - a.admitted_at).total_seconds() == 3600, (c.not_before, a.admitted_at)
    assert not ThrottleAdmission.objects.filter(run_id="C").exists()
    engine.controls.override_limit("throttle:tr-rate", "T", 3, by="ops")
    Run.objects.filter(pk="C").update(not_before=None)  # its opening, come (X5): due now
    admitted: list[Any] = []
    assert _mysql_round_trips(lambda: admitted.append(turn("C"))) == 1
    assert admitted[0].state is TurnState.RUN, admitted[0]
    assert ThrottleAdmission.objects.filter(throttle="tr-rate", key="T").count() == 3
    engine.controls.pause_key("throttle:tr-rate", "T", by="ops")
    held = turn("D")
    d = engine.get("D")
    assert held.state is TurnState.PARKED and held.throttled is None, held
    assert d.park_reason == "singleton" and d.not_before is None and d.wake_at is not None, d


sqlite_only = pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite room")


def _turn(engine: Engine, run_id: str) -> Any:
    return engine.store.begin_turn(
        run_id, "w", lease_seconds=30, limits=engine.limits(), max_recoveries=3, retry=engine._retry_policy()
    )


@sqlite_only
@pytest.mark.parametrize("workflow", ["tr-keyed", "tr-only"])
def test_a_throttled_claim_is_the_sqlite_rooms_one_transaction(engine: Engine, workflow: str) -> None:
    """X6b, X6c, X3e, S13, R5, R5a: on SQLite the claim of a run that carries a throttle
    (with or without a singleton key) is the room's: one BEGIN IMMEDIATE transaction that
    counts its throttle key's window, admits it and records its admission at its admitted_at,
    the singleton key's counter moved past its token (K1): five statements (BEGIN,
    claim_throttled, the admission's record, the key's bump, COMMIT); the room's plain claim,
    which writes nothing for a throttle carrier, is not tried for a run this store started
    (``Room.expect_throttled``; before, it was, six statements). The ORM path's claim took
    12. The connection's first throttled claim is the ORM path's (compiling the room's
    statement costs more), so one run is claimed first."""
    first = engine.start(workflow, {"k": "K0", "t": "T0"}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert _turn(engine, first).state is TurnState.RUN
    run_id = engine.start(workflow, {"k": "K", "t": "T"}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the claim below is the turn
    turns: list[Any] = []
    with RoundTrips(connection) as trips:
        turns.append(_turn(engine, run_id))
    [turn] = turns
    assert turn.state is TurnState.RUN and turn.admitted, turn
    assert trips.total <= 5, trips.statements
    assert any("durable_singleton:claim_throttled" in s for s in trips.statements), trips.statements
    assert not any("durable_singleton:claim */" in s for s in trips.statements), trips.statements
    run = engine.get(run_id)
    assert run.status == RunStatus.RUNNING and run.quota_slot == "holder"
    assert turn.run.admitted_at == run.admitted_at
    [admission] = ThrottleAdmission.objects.filter(run_id=run_id)
    assert (admission.throttle, admission.key, admission.admitted_at) == ("tr-rate", "T", run.admitted_at)
    if workflow == "tr-keyed":
        assert run.fencing_token == 1 and run.admitted
        assert SingletonKey.objects.get(workflow_name="tr-keyed", key="K").last_token == 1


@sqlite_only
def test_the_sqlite_rooms_throttle_hint_is_only_a_hint(engine: Engine) -> None:
    """X6, S5, K1: the room's hint that a run carries a throttle changes which statement is
    tried first, never a decision. A carrier started by another store (no hint) is claimed
    by the plain claim, which writes nothing for it, then claim_throttled; a run without a
    throttle wrongly hinted is claimed by the plain claim after claim_throttled wrote
    nothing, and the wrong hint is forgotten."""
    other = room_engine(_registry())
    warm = engine.start("tr-only", {"t": "T0"}).run_id
    assert _turn(engine, warm).state is TurnState.RUN  # the connection's first throttled claim
    unhinted = other.start("tr-only", {"t": "T"}).run_id
    room = engine.store._sqlite_room()  # type: ignore[attr-defined]
    assert not room.expects_throttled(unhinted)
    with RoundTrips(connection) as trips:
        turn = _turn(engine, unhinted)
    assert turn.state is TurnState.RUN and turn.admitted, turn
    named = [s for s in trips.statements if "durable_singleton:" in s]
    assert [n.split("*/")[0].split(":")[1].strip() for n in named][:2] == ["claim", "claim_throttled"], named
    registry = _registry()
    registry.add("plain", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    mixed = room_engine(registry)
    plain_id = mixed.start("plain", {"k": "P"}).run_id
    mixed_room = mixed.store._sqlite_room()  # type: ignore[attr-defined]
    mixed_room.expect_throttled(plain_id)
    turn = _turn(mixed, plain_id)
    assert turn.state is TurnState.RUN and turn.admitted and turn.run.fencing_token == 1, turn
    assert not mixed_room.expects_throttled(plain_id)
    assert SingletonKey.objects.get(workflow_name="plain", key="P").last_token == 1


@sqlite_only
def test_the_sqlite_room_parks_an_over_rate_run_until_the_window_opens(engine: Engine) -> None:
    """X6d, X5, R5, R5a: the third run of a throttle key of 2 an hour is parked by the SQLite
    room's claim_throttled (the turn names the throttle), its wake_at and not_before at the
    window's opening (the older admission's time plus the period, on the store's clock), its
    park reason throttled:tr-rate; no admission is recorded for it and nothing else is written."""
    for run_id in ("A", "B", "C"):
        engine.start("tr-only", {"t": "T"}, run_id=run_id)
    assert _turn(engine, "A").state is TurnState.RUN and _turn(engine, "B").state is TurnState.RUN
    parked: list[Any] = []
    with RoundTrips(connection) as trips:
        parked.append(_turn(engine, "C"))
    assert any("durable_singleton:claim_throttled" in s for s in trips.statements), trips.statements
    assert not any("durable_singleton:record_throttle_admission" in s for s in trips.statements), trips.statements
    assert parked[0].state is TurnState.PARKED and parked[0].throttled == "tr-rate", parked[0]
    c, a = engine.get("C"), engine.get("A")
    assert c.wake_at == c.not_before and a.admitted_at is not None and c.park_reason == "throttled:tr-rate"
    assert (c.not_before - a.admitted_at).total_seconds() == 3600, (c.not_before, a.admitted_at)
    assert not ThrottleAdmission.objects.filter(run_id="C").exists()
    assert ThrottleAdmission.objects.filter(throttle="tr-rate", key="T").count() == 2


def _decisions(store: DjangoStore, tag: str) -> list[tuple[Any, ...]]:
    """A keyed workflow (limit 2) with a throttle of 3 an hour: four waiters A..D of one
    singleton key and throttle key, claimed in the order C, A, D, B, C; then the throttle
    key paused, and E's claim; then its limit lowered to 1 and resumed, and F's claim. Each
    claim's decision as (run, state, status, park reason, throttled, the waiters it granted
    or sent a turn, whether it holds a slot, its fencing token), run ids without ``tag``."""
    registry = Registry()
    rate = Throttle("diff-rate", key=lambda i: i["t"], limit=3, period=3600)
    registry.add("diff", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "limit": 2}, throttles=[rate])
    engine = make_engine(store, registry=registry)
    key, throttle = {"k": f"K{tag}", "t": f"T{tag}"}, f"T{tag}"
    for name in "ABCDEF":
        engine.start("diff", key, run_id=f"{tag}{name}")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    seen: list[tuple[Any, ...]] = []

    def claim(name: str) -> None:
        turn = _turn(engine, f"{tag}{name}")
        run = engine.get(f"{tag}{name}")
        granted = sorted(g.run_id.removeprefix(tag) for g in turn.granted)
        reason = run.park_reason.replace(tag, "") if run.park_reason else run.park_reason
        seen.append((name, turn.state, run.status, reason, turn.throttled, granted, run.admitted, run.fencing_token))

    for name in "CADBC":
        claim(name)
    engine.controls.pause_key("throttle:diff-rate", throttle, by="test")
    claim("E")
    engine.controls.override_limit("throttle:diff-rate", throttle, 1, by="test")
    engine.controls.resume_key("throttle:diff-rate", throttle, by="test")
    claim("F")
    admitted = ThrottleAdmission.objects.filter(throttle="diff-rate", key=throttle)
    seen.append(("admissions", sorted(a.run_id.removeprefix(tag) for a in admitted)))
    return seen


@sqlite_only
def test_the_sqlite_rooms_throttled_claims_decide_as_the_orm_path() -> None:
    """X6b, X6c, X6d, X3d, X3h, S5, K1, K2: the same claims of throttled keyed waiters on the
    ORM path (``raw_sql=False``) and in the SQLite room decide alike: who is admitted with
    which token, who is parked with which reason, which waiters each claim grants or sends
    a turn, a paused throttle key (a retry delay, not an opening) and a lowered limit."""
    orm = _decisions(DjangoStore(raw_sql=False), "orm-")
    room = _decisions(DjangoStore(), "room-")
    assert room == orm
    # The claims the room carried out, for the record of what was compared.
    assert [d[1] for d in room[:5]] == [
        TurnState.PARKED,
        TurnState.RUN,
        TurnState.PARKED,
        TurnState.RUN,
        TurnState.PARKED,
    ], room


@mysql_only
def test_throttle_waiters_parked_across_a_rollback_to_0023_and_forward_again_on_mariadb() -> None:
    """X6b, X6d, R5a, S13: with throttled runs parked by the procedure, migrating back to
    0023_throttle_priority drops the throttle procedures (the room is then not installed):
    a store whose room was on turns it off at its next throttled claim and the ORM path
    decides with nothing half-written, a new store takes the ORM path at once; migrated
    forward again, a new store claims through ``ds_claim`` again, and every run is admitted
    once, the admissions never more than the limit in force in the window."""
    from durable_singleton.stores import mysql
    from tests.helpers import apps_at, migrate_to_latest

    store = DjangoStore()
    engine = make_engine(store, registry=_registry())
    for run_id in ("MA", "MB", "MC", "MD"):
        engine.start("tr-only", {"t": "TM"}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert _turn(engine, "MA").state is TurnState.RUN and _turn(engine, "MB").state is TurnState.RUN
    assert _turn(engine, "MC").throttled == "tr-rate"  # the procedure parked it over the rate
    try:
        apps_at([("durable_singleton", "0023_throttle_priority")])
        assert not mysql.installed("default")
        # The store whose room was on: the CALL is refused, the room turns off, the ORM path decides.
        engine.controls.override_limit("throttle:tr-rate", "TM", 3, by="test")  # wakes MC (K2)
        c = _turn(engine, "MC")
        assert c.state is TurnState.RUN, c
        assert store._mysql_room() is None
        d = _turn(make_engine(DjangoStore(), registry=_registry()), "MD")
        assert d.state is TurnState.PARKED and d.throttled == "tr-rate", d  # 3 in the hour: full
    finally:
        migrate_to_latest()
    assert mysql.installed("default")
    fresh = make_engine(DjangoStore(), registry=_registry())
    fresh.controls.override_limit("throttle:tr-rate", "TM", 4, by="test")
    Run.objects.filter(run_id="MD").update(not_before=None, wake_at=None)
    assert fresh.store._mysql_room() is not None  # type: ignore[attr-defined]  # installed again
    turns: list[Any] = []
    trips = _mysql_round_trips(lambda: turns.append(_turn(fresh, "MD")))
    assert turns[0].state is TurnState.RUN and trips == 1, (turns, trips)  # one CALL of ds_claim
    admitted = sorted(ThrottleAdmission.objects.filter(throttle="tr-rate", key="TM").values_list("run_id", flat=True))
    assert admitted == ["MA", "MB", "MC", "MD"]


@pytest.mark.parametrize("opened_by", ["atomic", "set_autocommit"])
def test_a_throttled_claim_inside_the_callers_transaction_is_rolled_back_with_it(opened_by: str) -> None:
    """X6b, R5a, S13 (issue #33): a throttle waiter's claim made inside a transaction the
    caller opened (``transaction.atomic``, as ATOMIC_REQUESTS does, or
    ``set_autocommit(False)``) joins it: rolled back, neither the caller's own write nor
    the claim's admission and its ThrottleAdmission row remain. On MariaDB the room's
    ``ds_claim`` starts and commits its own transaction (START TRANSACTION commits the one
    open), so with autocommit off it committed the caller's write and the claim before the
    caller's rollback; a room's CALL now never runs inside the caller's transaction."""
    engine = make_engine(DjangoStore(), registry=_registry())
    for run_id in ("XA", "XB", "XC"):
        engine.start("tr-only", {"t": "TX"}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert _turn(engine, "XA").state is TurnState.RUN  # the connection's first throttled claim

    def inside() -> None:
        Run.objects.filter(run_id="XC").update(priority=5)  # the caller's own write
        assert _turn(engine, "XB").state is TurnState.RUN

    if opened_by == "atomic":
        with pytest.raises(RuntimeError), transaction.atomic():
            inside()
            raise RuntimeError("the caller's rollback")
    else:
        transaction.set_autocommit(False)
        try:
            inside()
            transaction.rollback()
        finally:
            transaction.set_autocommit(True)
    assert Run.objects.get(run_id="XC").priority == 0
    b = engine.get("XB")
    assert b.status == RunStatus.PENDING and b.quota_slot == "waiter", b
    assert not ThrottleAdmission.objects.filter(run_id="XB").exists()


def _composite_decisions(store: DjangoStore, tag: str, scenario: str) -> list[tuple[Any, ...]]:
    """The claims of one sequence on ``store``, each as (run, state, status, park reason,
    throttled, the waiters it granted or sent a turn, admitted, fencing token, quota slot,
    due), then every throttle admission recorded; run ids and keys without ``tag``.
    ``"composite"``: a keyed workflow (limit 2) with two throttles (2 an hour, 3 in two
    hours) and a quota (2), beside a workflow with one of those throttles, three
    priorities; then one throttle key's limit raised and the other paused (K2).
    ``"versions"``: a keyed workflow (limit 3) whose version 2 adds a throttle (2 an
    hour), its waiters of both versions in one singleton queue, three priorities."""
    registry = Registry()
    t, u, k = f"T{tag}", f"U{tag}", f"K{tag}"
    fast = Throttle("cx-fast", key=lambda i: i["t"], limit=2, period=3600)
    engine = make_engine(store, registry=registry)
    if scenario == "composite":
        slow = Throttle("cx-slow", key=lambda i: i["u"], limit=3, period=7200)
        pool = Quota("cx-pool", key=lambda i: i["q"], limit=2)
        keyed = {"key": lambda i: i["k"], "limit": 2}
        registry.add("cx", "1", lambda ctx, i: None, singleton=keyed, throttles=[slow, fast], quotas=[pool])
        registry.add("cy", "1", lambda ctx, i: None, throttles=[fast])
        for n, name in enumerate("ABCDEFGH"):
            workflow = "cy" if n % 3 == 2 else "cx"
            engine.start(workflow, {"k": k, "t": t, "u": u, "q": f"Q{tag}"}, run_id=f"{tag}{name}", priority=n * 7 % 3)
        order = ["HGCAFBEDH", "DEFGH", "CB"]
    else:
        registry.add("cv", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "limit": 3})
        registry.add("cv", "2", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "limit": 3}, throttles=[fast])
        for n, name in enumerate("ABCDEFGH"):
            version = "1" if n % 3 == 0 else "2"
            engine.start("cv", {"k": k, "t": t}, run_id=f"{tag}{name}", version=version, priority=n * 5 % 3)
        order = ["BCEHFGBD"]
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    seen: list[tuple[Any, ...]] = []
    for step, names in enumerate(order):
        if step == 1:
            engine.controls.override_limit("throttle:cx-fast", t, 5, by="test")
        if step == 2:
            engine.controls.pause_key("throttle:cx-slow", u, by="test")
        for name in names:
            turn = _turn(engine, f"{tag}{name}")
            run = engine.get(f"{tag}{name}")
            granted = sorted(g.run_id.removeprefix(tag) for g in turn.granted)
            reason = run.park_reason.replace(tag, "") if run.park_reason else run.park_reason
            slots = (run.admitted, run.fencing_token, run.quota_slot, run.not_before is None)
            seen.append((name, turn.state, run.status, reason, turn.throttled, granted, *slots))
    admitted = ThrottleAdmission.objects.filter(key__in=[t, u])
    seen.append(("admissions", *sorted((a.throttle, a.run_id.removeprefix(tag)) for a in admitted)))
    return seen


@pytest.mark.parametrize("scenario", ["composite", "versions"])
def test_the_rooms_throttled_claims_decide_as_the_orm_path_with_other_limits(scenario: str) -> None:
    """X6b, X6c, X6d, X3d, X3e, X3h, X8a, S5, K1, K2: the same claims on the ORM path
    (``raw_sql=False``) and through this database's room (MariaDB's ``ds_admit_quota``,
    PostgreSQL's claim message, the SQLite room's ``claim_throttled`` where it applies)
    decide alike: two throttles of different periods beside a quota and a singleton key
    (the opening of the latest throttle that denies a run, a raised limit, a paused key),
    and a singleton queue whose older version's waiters carry no throttle (they are
    granted their slots, X3h), with three priorities."""
    orm = _composite_decisions(DjangoStore(raw_sql=False), "orm-", scenario)
    room = _composite_decisions(DjangoStore(), "room-", scenario)
    assert room == orm
    states = {(d[1], d[4]) for d in room[:-1]}
    assert (TurnState.RUN, None) in states and any(s is TurnState.PARKED and th for s, th in states), room


def _ttl_decisions(store: DjangoStore, tag: str) -> list[tuple[Any, ...]]:
    """Four waiters A..D of one singleton key (limit 3, queue_ttl 30 s) and one throttle key
    (3 an hour), B past its TTL (created 60 s back), claimed in order with the engine's TTLs,
    then a tick: each claim as (run, state, status, park reason, throttled, the waiters it
    granted or sent a turn, quota slot), then each run's status; run ids without ``tag``."""
    from tests.features.test_queue_ttl import backdate

    registry = Registry()
    rate = Throttle("ttl-rate", key=lambda i: i["t"], limit=3, period=3600)
    keyed = {"key": lambda i: i["k"], "limit": 3, "queue_ttl": 30}
    registry.add("tw", "1", lambda ctx, i: None, singleton=keyed, throttles=[rate])
    engine = make_engine(store, registry=registry)
    for name in "ABCD":
        engine.start("tw", {"k": f"K{tag}", "t": f"T{tag}"}, run_id=f"{tag}{name}")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    backdate(engine, f"{tag}B", 60)
    seen: list[tuple[Any, ...]] = []
    for name in "ABCD":
        turn = engine.store.begin_turn(
            f"{tag}{name}",
            "w",
            lease_seconds=30,
            limits=engine.limits(),
            max_recoveries=3,
            retry=engine._retry_policy(),
            ttls=engine.queue_ttls(),
        )
        run = engine.get(f"{tag}{name}")
        granted = sorted(g.run_id.removeprefix(tag) for g in turn.granted)
        reason = (run.park_reason or "").replace(tag, "")
        seen.append((name, turn.state, run.status, reason, turn.throttled, granted, run.quota_slot))
    engine.tick()
    seen.append(("after the tick", *(engine.get(f"{tag}{name}").status for name in "ABCD")))
    return seen


def test_a_throttle_waiter_past_its_queue_ttl_is_not_admitted_by_the_rooms() -> None:
    """X2, X6c, X3d: a waiter past its queue_ttl is no longer in its throttle key's queue:
    its own claim through this database's room does not admit it (parked, as on the ORM
    path, ``raw_sql=False``), the claims of the others skip it (the grants and turns name
    only the waiters within their TTL), and the next tick ends it cancelled."""
    orm = _ttl_decisions(DjangoStore(raw_sql=False), "orm-")
    room = _ttl_decisions(DjangoStore(), "room-")
    assert room == orm
    assert room[1][:2] == ("B", TurnState.PARKED) and room[-1][2] == RunStatus.CANCELLED, room
    assert all("B" not in d[5] for d in room[:-1]), room
