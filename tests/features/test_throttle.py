"""Throttles (SPEC X6, issue #33 items 1 and 4): ``Throttle(name, key=fn,
limit=N, period=seconds)`` named by workflows in ``throttles=[...]``.

At most N runs of a throttle key are admitted within any interval of
``period`` seconds on the store's clock (the database's, R5); an over-rate run
is parked with its ``wake_at`` (and ``not_before``) at the window's opening and
admitted then by the tick, without a poll; a throttle is one more limit of X3
beside the singleton key and the quotas. On the in-memory store and on the
DATABASE_URL database (SQLite, PostgreSQL, MariaDB) with real commits; every
window is checked on the admission times the store recorded, never on this
process's clock, and every wait polls its condition with a generous bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from durable_singleton import Quota, Throttle
from durable_singleton.admission import throttle_room
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidWorkflowError, SingletonKeyError
from durable_singleton.values import MAX_SECONDS
from tests.conftest import run_threads
from tests.helpers import connected, drain
from tests.helpers import holding_body as _holding


def _admissions(engine: Engine, ids: Sequence[str]) -> list[datetime]:
    """The admission times of the runs ``ids``, oldest first: each is the time its
    throttle keys recorded (the store's clock, X6); the recorded rows themselves are
    pruned by the tick once no window counts them."""
    times = [engine.get(r).admitted_at for r in ids]
    assert all(t is not None for t in times)
    return sorted(t for t in times if t is not None)


def _most_in_any_window(times: Sequence[datetime], period: float) -> int:
    """The largest number of ``times`` in one half-open interval ``[t, t + period)``:
    the worst interval starts at one of them."""
    span = timedelta(seconds=period)
    return max((sum(1 for u in times if t <= u < t + span) for t in times), default=0)


def _until(engine: Engine, done: Callable[[], bool], bound: float = 60.0) -> None:
    """Run the tick and the turns it sends until ``done()``, at most ``bound`` seconds."""
    give_up = time.monotonic() + bound
    while not done():
        assert time.monotonic() < give_up, "the condition did not hold within the bound"
        engine.tick()
        drain(engine)
        threading.Event().wait(0.05)


def test_admissions_per_window_never_exceed_the_limit(engine: Engine, registry: Registry) -> None:
    """X6: 6 runs of one throttle key (2 per 3 s): 2 are admitted at once, the
    others are parked until their window opens and admitted by the tick; in the
    admission times the store recorded, no interval of 3 s holds more than 2."""
    rate = Throttle("erp-rate", key=lambda i: i["tenant"], limit=2, period=3.0)
    registry.add("sync", "1", lambda ctx, i: ctx.run_id, throttles=[rate])
    ids = [engine.start("sync", {"tenant": "t1"}, run_id=f"R{n}").run_id for n in range(6)]
    drain(engine)
    statuses = [engine.get(r).status for r in ids]
    assert statuses.count("completed") == 2 and statuses.count("suspended") == 4
    _until(engine, lambda: all(engine.get(r).status == "completed" for r in ids))
    times = _admissions(engine, ids)
    assert len(times) == 6
    assert _most_in_any_window(times, 3.0) <= 2
    # Oldest first (X3d, X6c): each window admits the front of the queue, the runs in their
    # start order two by two. Within one window the two claims race (each of the front two
    # is within the window's free admissions), so their own order is the claims' timing.
    admitted = sorted(ids, key=lambda r: engine.get(r).admitted_at)  # type: ignore[arg-type, return-value]
    assert [set(admitted[i : i + 2]) for i in (0, 2, 4)] == [set(ids[i : i + 2]) for i in (0, 2, 4)], admitted


def test_an_over_rate_run_is_woken_at_the_window_opening_by_the_tick(engine: Engine, registry: Registry) -> None:
    """X6, S8: B, over the rate, is parked with wake_at and not_before at A's
    admission plus the period (the times the store recorded); the tick admits it
    then, at or after that time, and it was claimed twice in all (parked once,
    admitted once): no poll meanwhile."""
    rate = Throttle("slow", limit=1, period=1.5)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.start("w", {}, run_id="A")
    engine.start("w", {}, run_id="B")
    drain(engine)
    [first] = _admissions(engine, ["A"])
    parked = engine.get("B")
    assert parked.status == "suspended" and parked.quota_slot == "waiter"
    assert parked.wake_at == first + timedelta(seconds=1.5) == parked.not_before
    for _ in range(3):  # turns sent early find it not due and leave it parked (X5)
        engine.tick()
        drain(engine)
    assert engine.get("B").attempts == 1
    _until(engine, lambda: engine.get("B").status == "completed")
    times = _admissions(engine, ["A", "B"])
    assert times[1] >= first + timedelta(seconds=1.5)
    assert engine.get("B").attempts == 2


def test_a_throttled_key_holds_back_no_other_key(engine: Engine, registry: Registry) -> None:
    """X6 (issue #33: no head-of-line blocking): tenant t1 is over its rate; a
    run of tenant t2, started after t1's waiters, is admitted at once."""
    rate = Throttle("tenant-rate", key=lambda i: i["tenant"], limit=1, period=30.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    for n in range(3):
        engine.start("w", {"tenant": "t1"}, run_id=f"T1-{n}")
    engine.start("w", {"tenant": "t2"}, run_id="T2")
    drain(engine)
    assert engine.get("T1-0").status == "completed" and engine.get("T2").status == "completed"
    assert [engine.get(f"T1-{n}").status for n in (1, 2)] == ["suspended", "suspended"]


def test_throttle_composes_with_singleton_and_quota(engine: Engine, registry: Registry) -> None:
    """X6, X3d: W carries a singleton key, a quota and a throttle (1 per 1.5 s).
    W2 waits for the key while W1 holds it; when W1 settles, W2 is over the rate
    and parked until the window opens, not due meanwhile, so V (another workflow
    on the same quota, no throttle) is admitted in the quota's one slot without
    waiting behind it; W2 is then admitted once V has settled and the window
    opened. The quota never has two holders."""
    log: list[str] = []
    pool = Quota("pool", limit=1)
    rate = Throttle("rate", limit=1, period=1.5)
    registry.add("w", "1", _holding(log), singleton={"key": lambda i: "k"}, quotas=[pool], throttles=[rate])
    registry.add("v", "1", _holding(log), quotas=[pool])
    engine.start("w", {"hold": True}, run_id="W1")
    engine.start("w", {}, run_id="W2")
    drain(engine)
    assert engine.get("W1").quota_slot == "holder" and engine.get("W2").quota_slot == "waiter"
    engine.signal("W1", "go")
    drain(engine)
    [first] = _admissions(engine, ["W1"])
    w2 = engine.get("W2")
    if w2.status != "completed":  # a slow machine may have let the window open already
        assert w2.not_before == first + timedelta(seconds=1.5)
        engine.start("v", {"hold": True}, run_id="V")
        drain(engine)
        assert engine.get("V").quota_slot == "holder" and engine.get("W2").quota_slot == "waiter"
        engine.signal("V", "go")
        drain(engine)
    _until(engine, lambda: engine.get("W2").status == "completed")
    assert log[0] == "W1" and "W2" in log
    times = _admissions(engine, ["W1", "W2"])
    assert len(times) == 2 and times[1] >= times[0] + timedelta(seconds=1.5)


def test_two_workflows_share_a_throttle(engine: Engine, registry: Registry) -> None:
    """X6: one throttle named by two workflows counts the admissions of both:
    4 runs (2 of each) on 2 per 1 s never put 3 in one window."""
    shared = Throttle("api", limit=2, period=1.0)
    registry.add("a", "1", lambda ctx, i: None, throttles=[shared])
    registry.add("b", "1", lambda ctx, i: None, throttles=[shared])
    ids = [engine.start("ab"[n % 2], {}, run_id=f"R{n}").run_id for n in range(4)]
    drain(engine)
    assert sum(engine.get(r).status == "completed" for r in ids) == 2
    _until(engine, lambda: all(engine.get(r).status == "completed" for r in ids))
    assert _most_in_any_window(_admissions(engine, ids), 1.0) <= 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("limit", 0),
        ("limit", -1),
        ("limit", True),
        ("limit", "2"),
        ("limit", 1.5),
        ("period", 0),
        ("period", -1.0),
        ("period", float("inf")),
        ("period", float("nan")),
        ("period", MAX_SECONDS + 1),
        ("period", 1e-9),  # under a millisecond: a window no store counts in (it was accepted and limited nothing)
        ("period", 0.0009),
        ("period", "60"),
        ("period", None),
        ("name", "a:b"),
        ("name", ""),
        ("key", "not callable"),
    ],
)
def test_bad_throttle_declarations_are_refused_at_registration(registry: Registry, field: str, value: Any) -> None:
    """X6, X6a: a limit that is not an int >= 1, a period that is not a number of at
    least a millisecond and at most MAX_SECONDS, a name with ':' and a key that is not callable raise
    InvalidWorkflowError naming the field, and register nothing."""
    fields: dict[str, Any] = {"name": "t", "limit": 1, "period": 1.0, field: value}
    with pytest.raises(InvalidWorkflowError, match=f"throttles.{field}"):
        registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle(**fields)])
    assert "w" not in registry.latest and registry.throttles == {}


def test_a_throttle_declared_twice_differently_or_named_twice_is_refused(registry: Registry) -> None:
    """X6: one name with another period or limit, a throttle named twice by a
    workflow, a workflow named ``throttle:...`` and a throttles that is not a
    sequence of Throttle raise InvalidWorkflowError."""
    registry.add("a", "1", lambda ctx, i: None, throttles=[Throttle("t", limit=1, period=1.0)])
    with pytest.raises(InvalidWorkflowError, match="another limit, period"):
        registry.add("b", "1", lambda ctx, i: None, throttles=[Throttle("t", limit=1, period=2.0)])
    same = Throttle("u", period=1.0)
    with pytest.raises(InvalidWorkflowError, match="twice"):
        registry.add("c", "1", lambda ctx, i: None, throttles=[same, same])
    with pytest.raises(InvalidWorkflowError, match="prefix of throttle keys"):
        registry.add("throttle:x", "1", lambda ctx, i: None, throttles=[])
    with pytest.raises(InvalidWorkflowError, match="sequence of Throttle"):
        registry.add("d", "1", lambda ctx, i: None, throttles=same)  # type: ignore[arg-type]
    assert set(registry.latest) == {"a"}


def test_a_throttle_key_function_that_raises_writes_nothing(engine: Engine, registry: Registry) -> None:
    """X6, S1: a key function that raises, or returns anything but a non-empty
    str, raises SingletonKeyError naming the throttle, and no run is written."""
    registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle("t", key=lambda i: i["missing"])])
    registry.add("v", "1", lambda ctx, i: None, throttles=[Throttle("t2", key=lambda i: 7)])  # type: ignore[arg-type, return-value]
    with pytest.raises(SingletonKeyError, match="throttle 't'"):
        engine.start("w", {}, run_id="X")
    with pytest.raises(SingletonKeyError, match="throttle 't2'"):
        engine.start("v", {}, run_id="Y")
    assert engine.store.get_run("X") is None and engine.store.get_run("Y") is None


def test_the_window_rule() -> None:
    """X6: the one rule (admission.throttle_room): fewer than N admissions in
    (now - period, now] leave room; when full, the window opens when the oldest
    admission that keeps it full leaves it; with room, a waiter behind the free
    admissions waits for the oldest admission (or now) plus the period; a paused
    key has no room and no opening."""
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    at = [t0, t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)]
    assert throttle_room(3, at, 10.0, t0 + timedelta(seconds=3), paused=False) == (0, t0 + timedelta(seconds=10))
    assert throttle_room(2, at, 10.0, t0 + timedelta(seconds=3), paused=False) == (0, t0 + timedelta(seconds=11))
    # With room, a waiter the free admissions do not reach waits for the oldest to leave.
    later = t0 + timedelta(seconds=11)
    assert throttle_room(3, at, 10.0, t0 + timedelta(seconds=10), paused=False) == (1, later)
    assert throttle_room(4, at, 10.0, t0 + timedelta(seconds=3), paused=False) == (1, t0 + timedelta(seconds=10))
    assert throttle_room(4, [], 10.0, t0, paused=False) == (4, t0 + timedelta(seconds=10))
    assert throttle_room(4, at, 10.0, t0 + timedelta(seconds=3), paused=True) == (0, None)


@pytest.mark.slow
def test_racing_claims_never_admit_more_than_the_limit_in_a_window(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """X6, X3e, S13: 4 threads, each with its own engine and connection, claim
    the same 16 runs of one throttle key (3 per 2 s) at once, again and again:
    the admissions the store recorded never put more than 3 in any 2 s, and
    every run completes without a deadlock."""
    rate = Throttle("race", limit=3, period=2.0)
    done: list[str] = []
    lock = threading.Lock()

    def body(ctx: Any, input: Any) -> None:
        with lock:
            done.append(ctx.run_id)

    registry.add("w", "1", body, throttles=[rate])
    engines = [make() for _ in range(4)]
    ids = [engines[0].start("w", {}, run_id=f"R{n:02d}").run_id for n in range(16)]
    for e in engines:
        e.dispatcher.queue.clear()  # type: ignore[attr-defined]

    def worker(i: int) -> None:
        give_up = time.monotonic() + 120
        while len(set(done)) < len(ids) and time.monotonic() < give_up:
            for run_id in ids[i::4] + ids:
                engines[i].execute(run_id)
            engines[i].tick()
            engines[i].dispatcher.queue.clear()  # type: ignore[attr-defined]
            threading.Event().wait(0.05)

    results = run_threads(4, worker, timeout=240)
    assert all(r is None for r in results), results
    assert sorted(set(done)) == ids
    times = _admissions(engines[0], ids)
    assert len(times) == 16
    assert _most_in_any_window(times, 2.0) <= 3


def test_explain_and_the_metrics_name_the_throttle_that_parked_a_run(engine: Engine, registry: Registry) -> None:
    """X6, K3, O4: a run over the rate is explained as throttled by its throttle,
    with its next admission (its not_before, the window's opening), and the park
    is counted under the throttle's name."""
    from durable_singleton import metrics, signals

    metrics.connect()
    parks: list[str | None] = []

    def receiver(sender: Any, run: Any, throttle: str | None = None, **kwargs: Any) -> None:
        parks.append(throttle)

    before = metrics.THROTTLED.labels(throttle="erp-rate")._value.get()
    rate = Throttle("erp-rate", key=lambda i: i["tenant"], limit=1, period=60.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.start("w", {"tenant": "t1"}, run_id="A")
    engine.start("w", {"tenant": "t1"}, run_id="B")
    with connected(receiver, signals.run_parked):
        drain(engine)
    explained = engine.explain("B")
    assert explained.state == "throttled" and explained.throttled_by == "erp-rate"
    assert explained.throttle_key == "t1" and explained.next_admission_at == engine.get("B").not_before
    assert "throttled by 'erp-rate'" in explained.sentence and "next admission at" in explained.sentence
    assert parks == ["erp-rate"]
    assert metrics.THROTTLED.labels(throttle="erp-rate")._value.get() == before + 1


def test_the_key_controls_pause_and_override_a_throttle_key(engine: Engine, registry: Registry) -> None:
    """X6, K2: a throttle key is addressed as the workflow ``throttle:<name>``; a
    paused key admits no one, and an override of its limit admits that many in
    the window."""
    rate = Throttle("ctl", limit=1, period=60.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.controls.pause_key("throttle:ctl", "*", by="ops")
    engine.start("w", {}, run_id="A")
    drain(engine)
    assert engine.get("A").status == "suspended" and engine.get("A").not_before is None
    engine.controls.resume_key("throttle:ctl", "*", by="ops")
    engine.controls.override_limit("throttle:ctl", "*", 2, by="ops")
    engine.start("w", {}, run_id="B")
    engine.start("w", {}, run_id="C")
    for run_id in ("A", "B", "C"):
        engine.execute(run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["completed", "completed", "suspended"]


@pytest.mark.django_db(transaction=True)
def test_the_slot_audit_reports_a_throttle_key_over_its_rate(registry: Registry) -> None:
    """X6, K4: a throttle key with more recorded admissions in its current window
    than its limit (rows written behind the claim's back) is an ``over_admitted``
    finding under the workflow ``throttle:<name>``; one within its limit is not."""
    from durable_singleton.audit import FindingKind, audit_slots
    from durable_singleton.models import ThrottleAdmission
    from durable_singleton.testing import make_engine

    registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle("audited", key=lambda i: i["k"], period=600.0)])
    engine = make_engine("django", registry=registry)
    now = engine.store.now()
    ThrottleAdmission.objects.bulk_create(
        [ThrottleAdmission(throttle="audited", key="over", run_id=f"R{n}", admitted_at=now) for n in range(2)]
        + [ThrottleAdmission(throttle="audited", key="fine", run_id="F", admitted_at=now)]
    )
    report = audit_slots(engine)
    found = [(f.workflow, f.key) for f in report.findings if f.kind == FindingKind.OVER_ADMITTED]
    assert found == [("throttle:audited", "over")]


def test_a_waiter_behind_the_free_admissions_waits_for_the_next_opening(registry: Registry) -> None:
    """X6d: at a window's opening R4's turn comes first, but the free admissions
    go to the older R2 and R3: R4 is parked until the next opening (the oldest
    admission then, plus the period), not for the backlog's hour, and the tick
    admits it then. On the in-memory store, whose clock the test moves."""
    from durable_singleton.testing import make_engine

    now = [datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)]
    engine = make_engine("memory", registry=registry, clock=lambda: now[0])
    registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle("t", limit=2, period=10.0)])
    for n in range(5):
        engine.start("w", {}, run_id=f"R{n}")
    drain(engine)
    assert [engine.get(f"R{n}").status for n in range(5)] == ["completed"] * 2 + ["suspended"] * 3
    now[0] += timedelta(seconds=10)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.execute("R4")  # its turn first: R2 and R3, older, are within the two free admissions
    assert engine.get("R4").not_before == now[0] + timedelta(seconds=10) == engine.get("R4").wake_at
    engine.execute("R2")
    engine.execute("R3")
    assert engine.get("R2").status == engine.get("R3").status == "completed"
    now[0] += timedelta(seconds=10)
    engine.tick()
    drain(engine)
    assert engine.get("R4").status == "completed"


@pytest.mark.parametrize("leaves", ["cancel", "queue_ttl"])
def test_a_waiter_that_leaves_the_queue_unadmitted_wakes_the_one_parked_behind_it(
    make: Callable[..., Engine], store_kind: str, registry: Registry, leaves: str
) -> None:
    """X6d, X2, R6: W3's turn comes first, and the key's two free admissions go to the
    older W1 and W2: W3 is parked until the window's opening, half an hour away. W1 is
    admitted; W2 then leaves the queue without its admission (cancelled, or ended by the
    tick past its ``queue_ttl``). The key has a free admission and W3 is its only waiter:
    W3 is woken and admitted at once, not at the opening. Before, nothing woke it (found
    by a tester: stranded for the whole period, on every store)."""
    from tests.helpers import HandClock

    clock = HandClock() if store_kind == "memory" else None
    engine = make(clock) if clock is not None else make()
    # A queue_ttl is a singleton key's (X2): one key per run, none holds another back.
    single = {"key": lambda i: i["k"], "queue_ttl": 5.0} if leaves == "queue_ttl" else None
    registry.add("w", "1", lambda ctx, i: None, singleton=single, throttles=[Throttle("t", limit=2, period=1800.0)])
    for run_id in ("W1", "W2"):
        engine.start("w", {"k": run_id}, run_id=run_id)
    if clock is not None:
        clock.now += timedelta(seconds=4)  # W3 starts 4 s after W1 and W2
    engine.start("w", {"k": "W3"}, run_id="W3")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the turns below, in this order
    engine.execute("W3")
    parked = engine.get("W3")
    assert parked.status == "suspended" and parked.not_before is not None
    engine.execute("W1")
    assert engine.get("W1").status == "completed"
    if leaves == "cancel":
        engine.cancel("W2")
    else:  # W2 is 6 s old, past its queue_ttl of 5 s; W3 is 2 s old
        if clock is not None:
            clock.now += timedelta(seconds=2)
        else:
            from django.db.models import F

            from durable_singleton.models import Run

            Run.objects.filter(pk="W2").update(created_at=F("created_at") - timedelta(seconds=6))
        engine.tick()
    assert engine.get("W2").status == "cancelled"
    drain(engine)
    woken = engine.get("W3")
    assert woken.status == "completed", (woken.status, woken.not_before, woken.park_reason)


def test_a_throttled_run_is_parked_with_its_throttle_as_its_reason(engine: Engine, registry: Registry) -> None:
    """X6d, K3: a run over the rate is parked with the park reason ``throttled:<name>``
    (it read ``singleton``, a waiter's, though no holder keeps it back), and the
    ``run_parked`` signal carries that reason."""
    from durable_singleton import signals
    from durable_singleton.statuses import ParkReason

    reasons: list[str] = []

    def receiver(sender: Any, run: Any, reason: str = "", **kwargs: Any) -> None:
        reasons.append(reason)

    rate = Throttle("erp-rate", key=lambda i: i["tenant"], limit=1, period=60.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.start("w", {"tenant": "t1"}, run_id="A")
    drain(engine)
    engine.start("w", {"tenant": "t1"}, run_id="B")
    with connected(receiver, signals.run_parked):
        drain(engine)
    parked = engine.get("B")
    assert parked.park_reason == ParkReason.THROTTLED.of("erp-rate") == "throttled:erp-rate"
    assert parked.not_before is not None and reasons == ["throttled:erp-rate"]


def test_raising_or_resuming_a_throttle_key_wakes_its_waiters_at_once(engine: Engine, registry: Registry) -> None:
    """K2, X6d: B and C, parked over the rate until the window opens in 10 min, are
    admitted at once when the key's limit is raised to 3 (their turns are sent, no tick);
    D, started while the key is paused and parked on its retry delay, is admitted
    at once when the key is resumed. Before, a raised throttle key woke no one: its
    waiters kept their not_before at the old opening."""
    rate = Throttle("ctl", limit=1, period=600.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    for run_id in ("A", "B", "C"):
        engine.start("w", {}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["completed", "suspended", "suspended"]
    engine.controls.override_limit("throttle:ctl", "*", 4, by="ops")
    drain(engine)
    assert [engine.get(r).status for r in ("B", "C")] == ["completed", "completed"]
    engine.controls.pause_key("throttle:ctl", "*", by="ops")
    engine.start("w", {}, run_id="D")
    drain(engine)
    assert engine.get("D").status == "suspended"
    engine.controls.resume_key("throttle:ctl", "*", by="ops")
    drain(engine)
    assert engine.get("D").status == "completed"


def test_every_waiter_parked_while_a_throttle_key_was_paused_is_admitted_after_its_resume(
    engine: Engine, registry: Registry
) -> None:
    """K2, X6d, S8: A, B and C start while their throttle key (1 per 0.5 s) is paused:
    each is parked on its retry delay, B and C behind the limit on the backlog's
    (BACKLOG_RETRY_SECONDS, an hour), with no window's opening to wake them. The resume
    makes every such waiter due: A is admitted, B and C are parked over the rate until
    their windows open and the tick admits them then. Before, the resume woke only the
    oldest (as many as the limit): B and C, at the front of the key after A, waited an
    hour for their retry, and every later run of the key waited behind them."""
    rate = Throttle("paused-rate", limit=1, period=0.5)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.controls.pause_key("throttle:paused-rate", "*", by="ops")
    for run_id in ("A", "B", "C"):
        engine.start("w", {}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["suspended"] * 3
    engine.controls.resume_key("throttle:paused-rate", "*", by="ops")
    drain(engine)
    _until(engine, lambda: all(engine.get(r).status == "completed" for r in ("A", "B", "C")))
    assert _most_in_any_window(_admissions(engine, ["A", "B", "C"]), 0.5) == 1


def test_explain_names_a_paused_throttle_key_a_run_waits_for(engine: Engine, registry: Registry) -> None:
    """K3, K2, X6: A, started while its throttle key is paused, waits for nothing else;
    explain names the throttle key and its pause, with its standing as data (it read
    "it waits for  (X3d)", naming nothing); after a resume and an admission, B (over the
    rate) is explained as throttled."""
    rate = Throttle("ctl", limit=1, period=600.0)
    registry.add("w", "1", lambda ctx, i: None, throttles=[rate])
    engine.controls.pause_key("throttle:ctl", "*", by="ops")
    engine.start("w", {}, run_id="A")
    drain(engine)
    explained = engine.explain("A")
    assert explained.state == "waiter", explained
    assert "throttle 'ctl' (key '*'), which is paused" in explained.sentence, explained.sentence
    assert "A resume or a raised limit of the throttle key" in explained.sentence
    [place] = explained.throttles
    assert (place.throttle, place.key, place.limit, place.paused, place.admitted) == ("ctl", "*", 1, True, 0)
    engine.controls.resume_key("throttle:ctl", "*", by="ops")
    drain(engine)
    engine.start("w", {}, run_id="B")
    drain(engine)
    assert engine.get("A").status == "completed" and engine.explain("B").state == "throttled"


@pytest.mark.django_db(transaction=True)
def test_the_slot_audit_finds_and_wakes_a_throttled_waiter_no_tick_sent(registry: Registry) -> None:
    """X6d, K4: B was parked over the rate until its window's opening; the opening passed a
    minute ago, the window has room, and no tick sent B's turn (its wake time, written
    behind the tick's back, is a minute old). The audit reports a ``stalled_waiter``
    under ``throttle:<name>``; with repair it makes B due now and sends its turn, which
    admits it. A throttled waiter whose window is still full is no finding."""
    from durable_singleton.audit import FindingKind, audit_slots
    from durable_singleton.models import Run, ThrottleAdmission
    from durable_singleton.testing import make_engine

    registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle("slow", key=lambda i: i["k"], period=600.0)])
    engine = make_engine("django", registry=registry)
    for run_id, k in (("A", "late"), ("B", "late"), ("F", "full"), ("G", "full")):
        engine.start("w", {"k": k}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("B", "G")] == ["suspended", "suspended"]
    now = engine.store.now()
    ThrottleAdmission.objects.filter(key="late").update(admitted_at=now - timedelta(seconds=700))
    Run.objects.filter(pk="B").update(not_before=now - timedelta(seconds=60), wake_at=now - timedelta(seconds=60))
    report = audit_slots(engine)
    found = [(f.workflow, f.key, f.run_id) for f in report.findings if f.kind == FindingKind.STALLED_WAITER]
    assert found == [("throttle:slow", "late", "B")]
    repaired = audit_slots(engine, repair=True)
    assert [f.repaired for f in repaired.findings if f.kind == FindingKind.STALLED_WAITER] == [True]
    drain(engine)
    assert engine.get("B").status == "completed" and engine.get("G").status == "suspended"
