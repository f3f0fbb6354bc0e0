"""Singleton admission: S2, S4-S7, S11, S12, S14 and the public helpers."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from durable_singleton import (
    ADMITTED_TAG,
    TRACKED_TAG,
    singleton_admission_denial_patch,
    singleton_admission_tags,
    without_singleton_markers,
)
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import SingletonFallbackWarning
from durable_singleton.stores.base import BaseStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.conftest import Monitor, spawn
from tests.factories import RunRecordFactory
from tests.helpers import audited, body_held, holding_body, settle


def test_gate_runs_before_the_body_and_parks_a_younger_run(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S4, S5 step 3: a pending older run is a waiter ahead: the younger run is
    marked running, checked and parked; nothing of its body ran."""
    audited(registry, monitor)
    engine.start("wf", {"k": "A"}, run_id="old")
    engine.start("wf", {"k": "A"}, run_id="young")
    assert engine.execute("young") == "parked"
    young = engine.get("young")
    assert young.status == "suspended" and young.lease_owner is None and young.attempts == 1
    assert monitor.entered == []
    assert engine.execute("old") == "completed"
    assert engine.execute("young") == "completed"
    assert monitor.entered == ["old", "young"]


def test_front_waiter_retries_in_about_a_second_and_backlog_waits_for_push(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S5 step 5: the first waiter parks with wake_at = now + 1 s +/- 250 ms;
    S8a: waiters behind the first `limit` positions get the long backlog retry."""
    hold = threading.Event()
    audited(registry, monitor, hold=hold)
    for run_id in ("holder", "front", "back"):
        engine.start("wf", {"k": "A"}, run_id=run_id)
    with body_held(engine.execute, "holder", monitor, hold):
        before = engine.now()
        assert engine.execute("back") == "parked"
        assert engine.execute("front") == "parked"
        after = engine.now()
        front, back = engine.get("front"), engine.get("back")
        assert front.wake_at is not None and back.wake_at is not None
        # 1 s +/- 250 ms from the claim, which ran between `before` and `after`
        assert before + timedelta(milliseconds=740) <= front.wake_at <= after + timedelta(milliseconds=1260)
        assert back.wake_at - before > timedelta(minutes=30)
    assert list(engine.dispatcher.queue)[-1] == "front", "the release pushed the front waiter"


def test_holder_keeps_its_slot_against_a_run_with_same_timestamp_and_smaller_id(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """S6: a later start never takes a slot from a holder, even with equal created_at and an id sorting first."""
    frozen = datetime.now(UTC)  # frozen near real time: leases are judged by the database clock
    engine = make(clock=lambda: frozen)
    hold = threading.Event()
    audited(registry, monitor, hold=hold)
    engine.start("wf", {"k": "A"}, run_id="b-holder")
    with body_held(engine.execute, "b-holder", monitor, hold):
        engine.start("wf", {"k": "A"}, run_id="a-late")
        assert engine.execute("a-late") == "parked"
    assert engine.get("b-holder").status == "completed"


def test_release_pushes_the_oldest_waiter(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S7, S7a, K1: when a holder ends, its slot is granted to the oldest waiter in the
    same transaction (holder, token) and that waiter is dispatched once: its
    wake_at is a redelivery window ahead, so no tick sends it again meanwhile."""
    audited(registry, monitor)
    for n in range(4):
        engine.start("wf", {"k": "A"}, run_id=f"r{n}")
    engine.dispatcher.queue.clear()
    for n in (3, 2, 1):
        assert engine.execute(f"r{n}") == "parked"
    assert list(engine.dispatcher.queue) == ["r0"], "the first claim granted the free slot to the oldest (S5)"
    engine.dispatcher.queue.clear()
    assert engine.execute("r0") == "completed"
    assert list(engine.dispatcher.queue) == ["r1"], "only the oldest waiter is pushed (limit 1)"
    r1 = engine.get("r1")
    assert r1.admitted and r1.fencing_token == engine.get("r0").fencing_token + 1  # type: ignore[operator]
    assert r1.wake_at is not None and r1.wake_at > engine.now()
    assert engine.tick().dispatched == [], "the granted waiter is not sent twice (S7a)"
    engine.dispatcher.drain()
    assert monitor.entered == ["r0", "r1", "r2", "r3"]
    assert monitor.highest["A"] == 1


def test_sleeping_holder_is_not_woken_by_a_release(engine: Engine, registry: Registry) -> None:
    """S7, D1: a release wakes gated waiters, not holders that merely sleep."""

    def sleeper(ctx, input):  # type: ignore[no-untyped-def]
        ctx.sleep(3600)

    registry.add("sleepy", "1", sleeper, singleton={"key": lambda i: i["k"], "limit": 2})
    registry.add("quick", "1", lambda c, i: None, singleton={"key": lambda i: i["k"], "limit": 2})
    engine.start("sleepy", {"k": "A"}, run_id="s1")
    assert engine.execute("s1") == "suspended"
    wake = engine.get("s1").wake_at
    assert engine.get("s1").tags[-1] == ADMITTED_TAG, "a sleeping holder keeps its slot (S6)"
    assert engine.release(engine.get("s1").evolve(status="completed")) == []
    assert engine.get("s1").wake_at == wake


def test_limit_two_admits_two_oldest(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S5: free slots = limit - holders go to the oldest waiters."""
    hold = threading.Event()
    audited(registry, monitor, limit=2, hold=hold)
    for n in range(4):
        engine.start("wf", {"k": "A"}, run_id=f"r{n}")
    threads = [spawn(engine.execute, f"r{n}") for n in (0, 1)]
    try:
        _wait_for(lambda: len(monitor.entered) == 2)
        assert engine.execute("r3") == "parked"
        assert engine.execute("r2") == "parked"
    finally:
        hold.set()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a thread of the test is still running"
    engine.dispatcher.drain()
    assert sorted(monitor.entered[:2]) == ["r0", "r1"] and monitor.entered[2:] == ["r2", "r3"]
    assert monitor.highest["A"] == 2


def test_key_never_reaches_across_workflows(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S2: admission looks only at runs of the same workflow with the same key."""
    hold = threading.Event()
    audited(registry, monitor, name="one", hold=hold)
    audited(registry, monitor, name="two")
    engine.start("one", {"k": "A"}, run_id="one-a")
    with body_held(engine.execute, "one-a", monitor, hold):
        engine.start("two", {"k": "A"}, run_id="two-a")
        assert engine.execute("two-a") == "completed"


def test_versions_share_the_key(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S2: all versions of a workflow share admission."""
    hold = threading.Event()
    audited(registry, monitor, hold=hold)
    registry.add("wf", "2", lambda c, i: None, singleton={"key": lambda i: f"key:{i['k']}"})
    engine.start("wf", {"k": "A"}, run_id="v1", version="1")
    with body_held(engine.execute, "v1", monitor, hold):
        engine.start("wf", {"k": "A"}, run_id="v2", version="2")
        assert engine.execute("v2") == "parked"


def test_admission_is_global_across_namespaces(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """S11: engines scoped to different namespaces still share one slot per key."""
    hold = threading.Event()
    audited(registry, monitor, hold=hold)
    acme, globex = make(), make()
    acme.namespace, acme.scope_reads = "acme", True
    globex.namespace, globex.scope_reads = "globex", True
    acme.start("wf", {"k": "A"}, run_id="acme-1")
    with body_held(acme.execute, "acme-1", monitor, hold):
        globex.start("wf", {"k": "A"}, run_id="globex-1")
        assert globex.execute("globex-1") == "parked"


def test_untracked_active_run_counts_as_holder(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S12: a running run with the key tag but no tracked marker (older release) holds a slot."""
    audited(registry, monitor)
    # The row an older release left: running with the key, not tracked (S12).
    engine.store.create_run(
        RunRecordFactory(run_id="legacy", input={"k": "A"}, singleton_key="key:A", legacy_holder=True), cap=None
    )
    assert TRACKED_TAG not in engine.get("legacy").tags
    engine.start("wf", {"k": "A"}, run_id="new")
    assert engine.execute("new") == "parked"
    settle(engine, "legacy", "completed")
    assert engine.execute("new") == "completed"


def test_an_older_release_holder_takes_one_slot_of_a_wider_key(engine: Engine, registry: Registry) -> None:
    """S12, S5: an older release's untracked holder takes one slot of a key of limit 3, so a
    claim grants at most 2 of the 4 waiters in front. The free slots are the limit less the
    tracked holders and the untracked ones together: the PostgreSQL statements once spliced
    the holders' sum into ``limit - holders`` unbracketed (``3 - 0 + 1``) and admitted all 4."""
    registry.add("wide", "1", holding_body([]), singleton={"key": lambda i: "key:W", "limit": 3})
    engine.store.create_run(
        RunRecordFactory(run_id="legacy", workflow_name="wide", singleton_key="key:W", legacy_holder=True), cap=None
    )
    for n in range(4):
        engine.start("wide", {"hold": True}, run_id=f"w{n}")
    engine.execute("w0")
    admitted = [r for r in (engine.get(f"w{n}") for n in range(4)) if r.admitted]
    assert len(admitted) == 2, [r.run_id for r in admitted]


def test_terminal_write_drops_markers_and_frees_slot(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S12, R2: the terminal write removes the markers; a terminal run never changes again."""
    audited(registry, monitor)
    engine.start("wf", {"k": "A"}, run_id="r")
    engine.execute("r")
    run = engine.get("r")
    assert run.status == "completed" and ADMITTED_TAG not in run.tags and TRACKED_TAG not in run.tags
    assert not settle(engine, "r", "failed")
    assert engine.execute("r") == "skipped"
    assert engine.get("r").status == "completed"


class ScanOnlyStore(MemoryStore):
    """A custom store without an atomic claim (S14): it only takes leases, and
    the base class's scan decides admission."""

    supports_atomic_admission = False
    begin_turn = BaseStore.begin_turn


def test_store_without_claim_falls_back_with_one_warning(registry: Registry, monitor: Monitor) -> None:
    """S14: the engine scans and decides, warning once per engine with a dedicated category."""
    engine = make_engine(ScanOnlyStore(), registry=registry)
    audited(registry, monitor)
    engine.start("wf", {"k": "A"}, run_id="a")
    engine.start("wf", {"k": "A"}, run_id="b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.execute("a") == "completed"
        assert engine.execute("b") == "completed"
    fallback = [w for w in caught if issubclass(w.category, SingletonFallbackWarning)]
    assert len(fallback) == 1 and "no atomic admission in begin_turn" in str(fallback[0].message)


def test_public_helpers() -> None:
    """S14: helpers a custom store uses inside its own transaction."""
    assert singleton_admission_tags(["x", "singleton:k"]) == ["x", "singleton:k", ADMITTED_TAG]
    assert singleton_admission_tags(["x", ADMITTED_TAG]) == ["x", ADMITTED_TAG]
    assert without_singleton_markers(["x", ADMITTED_TAG, TRACKED_TAG, "y"]) == ["x", "y"]
    now = datetime(2026, 1, 1, tzinfo=UTC)
    waits = []
    for _ in range(200):
        patch = singleton_admission_denial_patch(now)
        assert patch["status"] == "suspended" and patch["lease_owner"] is None
        waits.append((patch["wake_at"] - now).total_seconds())
    assert 0.75 <= min(waits) < 0.85 and 1.15 < max(waits) <= 1.25, "1 s jittered uniformly by +/- 250 ms"


def _wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = datetime.now() + timedelta(seconds=timeout)
    while not condition():
        if datetime.now() > deadline:
            pytest.fail("condition not reached in time")
        threading.Event().wait(0.01)


def test_start_deep_in_a_busy_queue_parks_without_a_turn(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S8a, S3: a start behind `limit` holders and `limit` waiters is created
    (never refused) but parked, with no turn sent; the pushes admit it in order."""
    hold = threading.Event()
    audited(registry, monitor, hold=hold)
    engine.start("wf", {"k": "A"}, run_id="h")
    t = spawn(engine.execute, "h")
    try:
        _wait_for(lambda: monitor.entered == ["h"])
        engine.start("wf", {"k": "A"}, run_id="w1")
        engine.dispatcher.queue.clear()
        deep = engine.start("wf", {"k": "A"}, run_id="w2")
        assert deep.status == "pending" and list(engine.dispatcher.queue) == []
        assert deep.wake_at is not None and deep.wake_at - engine.now() > timedelta(minutes=30)
    finally:
        hold.set()
        t.join(10)
    engine.dispatcher.drain()
    assert monitor.entered == ["h", "w1", "w2"]
    assert engine.get("w2").status == "completed"


@pytest.mark.parametrize(
    ("fields", "expired", "due", "rung"),
    [
        ({"status": "completed"}, True, True, "skip"),  # R6: terminal
        ({"status": "running", "attempts": 1}, False, True, "skip"),  # R6: a live lease
        ({"status": "pending", "cancel_requested": True}, False, False, "cancel"),  # S9 before X5
        ({"status": "running", "recoveries": 3, "attempts": 4}, True, True, "dead"),  # D4
        ({"status": "running", "recoveries": 3, "cancel_requested": True}, True, True, "cancel"),  # S9 before D4
        ({"status": "pending", "singleton_key": "k"}, False, False, "not_due"),  # X5
        ({"status": "suspended", "singleton_key": "k", "admitted": True}, False, False, "take"),  # S6: a holder
        ({"status": "pending", "quota_slot": "waiter"}, False, True, "limits"),  # X3
        ({"status": "pending"}, False, True, "take"),  # no key
        ({"status": "running", "singleton_key": "k", "admitted": True, "attempts": 1}, True, True, "take_over"),
        ({"status": "running", "singleton_key": "k", "tracked": False}, True, True, "take_over"),  # S12 legacy
        ({"status": "running", "attempts": 1}, True, True, "take"),  # a keyless recovery
        ({"status": "pending", "singleton_key": "k"}, False, True, "admit"),  # S4, S5
    ],
)
def test_the_turn_ladder_decides_each_rung_once(fields: dict[str, object], expired: bool, due: bool, rung: str) -> None:
    """The turn ladder (:func:`~durable_singleton.admission.turn_rung`): one
    decision of what a claim does, which the Django store's ORM path and rooms,
    the memory store and the S14 fallback all stand on (S4, S5, S6, S9, R6,
    D4, X3, X5). The order of the rungs is part of the rule: a requested
    cancel is settled before a recovery is counted dead and before a delayed
    start waits for its time."""
    from durable_singleton.admission import turn_rung

    run = RunRecordFactory(**fields)
    assert turn_rung(run, expired=expired, due=due, max_recoveries=3) == rung
    assert turn_rung(None, expired=expired, due=due, max_recoveries=3) == "skip"


def test_the_fallback_settles_a_requested_cancel_as_every_store_does() -> None:
    """S9, S14: a run without a key whose cancel was requested before its turn
    is settled ``cancelled`` by the claim on the S14 fallback too (the turn
    ladder's cancel rung), as the memory and Django stores do; before the one
    ladder the fallback claimed it and ran its body."""
    from durable_singleton.stores.base import RetryPolicy
    from tests.stores.test_conformance import ScanOnlyStore

    store = ScanOnlyStore()
    run = RunRecordFactory(run_id="plain", status="pending", cancel_requested=True)
    store.create_run(run, cap=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SingletonFallbackWarning)
        turn = store.begin_turn("plain", "me", lease_seconds=30, limits={}, max_recoveries=3, retry=RetryPolicy())
    assert turn.state.name == "SETTLED" and turn.run is not None and turn.run.status == "cancelled"
    assert store.get_run("plain").status == "cancelled"
