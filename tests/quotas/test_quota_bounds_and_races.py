"""Round 2 of an independent tester's breaks: the quota TTL grants (X2, X3d),
workflow-wide K2 controls of a quota (X3j), the upper bounds of limits and
durations (section 7), races with real threads and separate engines, a
stepped process clock (R8) and BaseException in a quota body (R7). On the
in-memory store and the DATABASE_URL database (SQLite, PostgreSQL, MariaDB).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.statuses import SlotState
from durable_singleton.testing import make_engine
from durable_singleton.values import MAX_LIMIT, MAX_SECONDS
from tests.conftest import run_threads
from tests.core.test_database_clock import step_clock
from tests.features.test_queue_ttl import backdate
from tests.helpers import counted_per_run
from tests.helpers import drain as _drain
from tests.helpers import holding_body as _body

TTL = 60.0
STEP = timedelta(hours=1)


# -- section 7: the largest limit the declaration accepts -------------------------------------


@pytest.mark.parametrize("how", ["declared", "override"])
def test_the_largest_accepted_singleton_limit_works_on_every_start_path(
    engine: Engine, registry: Registry, how: str
) -> None:
    """Section 7, K2: a singleton ``limit`` of MAX_LIMIT (2**31 - 1) is
    accepted by the declaration (values.MAX_LIMIT), and K2's override takes
    the same range; a start and a claim on such a key must work (two runs
    admitted side by side), never a database error. Failing on PostgreSQL:
    the fast path's start (start.sql's ``queue_is_deep``: ``LIMIT 2 * %(deep_limit)s::integer``,
    or ``2 *`` the integer override) overflows int4 and every start raises
    DataError "integer out of range"."""
    log: list[str] = []
    limit = MAX_LIMIT if how == "declared" else 1
    registry.add("big", "1", _body(log), singleton={"key": lambda i: "K", "limit": limit})
    if how == "override":
        engine.override_limit("big", "K", MAX_LIMIT, by="t")
    engine.start("big", {"hold": True}, run_id="A")
    engine.start("big", {}, run_id="B")
    _drain(engine)
    assert engine.get("A").admitted and engine.get("B").status == "completed"


def test_the_largest_accepted_quota_limit_works(engine: Engine, registry: Registry) -> None:
    """X3a, section 7: a quota ``limit`` of MAX_LIMIT: two runs hold it at once."""
    log: list[str] = []
    registry.add("bq", "1", _body(log), quotas=[Quota("bq", limit=MAX_LIMIT)])
    engine.start("bq", {"hold": True}, run_id="A")
    engine.start("bq", {}, run_id="B")
    _drain(engine)
    assert engine.get("A").quota_slot == "holder" and engine.get("B").status == "completed"


def test_the_largest_accepted_queue_ttl_works_with_a_quota(engine: Engine, registry: Registry) -> None:
    """X2, X3d, section 7: a ``queue_ttl`` of MAX_SECONDS on a workflow that
    names a quota: its waiter is admitted at the handoff, the tick ends
    nothing and raises nothing."""
    log: list[str] = []
    qt = Quota("qt", limit=1)
    registry.add("wf", "1", _body(log), singleton={"key": lambda i: i["k"], "queue_ttl": MAX_SECONDS}, quotas=[qt])
    engine.start("wf", {"k": "A", "hold": True}, run_id="H")
    _drain(engine)
    engine.start("wf", {"k": "B"}, run_id="W")
    _drain(engine)
    report = engine.tick()
    assert report.errors == [] and report.expired == []
    engine.signal("H", "go")
    _drain(engine)
    assert log == ["H", "W"]


# -- R8, D5: a stepped process clock -----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_retry_on_a_process_stepped_back_keeps_its_whole_timeout() -> None:
    """R8, R5, D5, D9: "a retry gets a fresh timeout". A process whose clock
    stepped an hour back (after its last correction) retries a failed run of
    a workflow with a ten-minute timeout: the new deadline must be ten
    minutes from now on the database's clock, so the next tick (on a correct
    process) leaves the retried holder alone. Today Engine.retry computes
    the deadline from the uncorrected process clock (core.py retry:
    ``self.now() + timeout``), an hour in the past, and the tick ends the run
    ``execution_timeout`` at once."""
    calls: list[str] = []

    def body(ctx: Any, input: Any) -> None:
        calls.append(ctx.run_id)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        ctx.sleep(30)

    registry = Registry()
    registry.add("rt", "1", body, singleton={"key": lambda i: "K"}, quotas=[Quota("rtq")], timeout=600)
    honest = make_engine("django", registry=registry)
    stepped = make_engine("django", registry=registry)
    honest.start("rt", {}, run_id="R")
    _drain(honest)
    assert honest.get("R").status == "failed"
    step_clock(stepped, -STEP)
    stepped.retry("R")
    _drain(stepped)
    run: Any = honest.get("R")
    assert run.status == "suspended" and run.admitted, run
    assert run.deadline_at - honest.store.now() > timedelta(minutes=9), run.deadline_at - honest.store.now()
    honest.tick()
    assert honest.get("R").status == "suspended", honest.get("R").error


@pytest.mark.django_db(transaction=True)
def test_a_cancel_seen_by_a_process_stepped_ahead_is_not_called_a_timeout() -> None:
    """R5, D5, D6: a quota holder with a ten-minute timeout runs its body on
    a process whose clock stepped an hour ahead; an operator cancels it
    within a second. The body stops at its next step boundary and the run
    ends ``cancelled`` with code ``cancelled``: its deadline has not passed
    on the database's clock, the one clock of every deadline decision.
    Today core._cancel_error compares the deadline with the process clock
    (``self.now() >= run.deadline_at``) and records ``execution_timeout``."""
    entered, release = threading.Event(), threading.Event()

    def body(ctx: Any, input: Any) -> None:
        entered.set()
        release.wait(10)
        ctx.step("r2:ok", 1)
        ctx.step("r2:ok", 2)

    registry = Registry()
    registry.add_step("r2:ok", lambda v: v)
    registry.add("cx", "1", body, quotas=[Quota("cxq")], timeout=600)
    honest = make_engine("django", registry=registry)
    stepped = make_engine("django", registry=registry)
    stepped.start("cx", {}, run_id="C")
    step_clock(stepped, STEP)  # after the start's correction: the turn runs on the stepped clock
    from tests.conftest import spawn

    worker = spawn(lambda: stepped.dispatcher.drain())
    assert entered.wait(10)
    honest.cancel("C")
    release.set()
    worker.join(20)
    assert not worker.is_alive()
    c: Any = honest.get("C")
    assert c.status == "cancelled" and c.error["code"] == "cancelled", c.error


# -- R7: BaseException in the body of a quota run ---------------------------------------------


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_base_exception_in_a_quota_body_fails_the_run_and_frees_its_slot(
    engine: Engine, registry: Registry, exc: type[BaseException]
) -> None:
    """R7, X3g: a quota holder whose body raises SystemExit, KeyboardInterrupt
    or GeneratorExit settles ``failed`` with the exception's class, frees its
    quota slot in the same write, and the waiter behind it (another workflow
    on the same quota) is admitted with a higher token and completes; the
    caller (the worker) lives on."""
    seen: list[tuple[str, dict[str, int]]] = []

    def bad(ctx: Any, input: Any) -> None:
        seen.append((ctx.run_id, dict(ctx.quota_tokens)))
        raise exc("stop")

    def good(ctx: Any, input: Any) -> str:
        seen.append((ctx.run_id, dict(ctx.quota_tokens)))
        return "ok"

    q = Quota("bx", limit=1)
    registry.add("bad", "1", bad, quotas=[q])
    registry.add("good", "1", good, quotas=[q])
    engine.start("bad", {}, run_id="B")
    engine.start("good", {}, run_id="G")
    for _ in range(3):
        _drain(engine)
    b, g = engine.get("B"), engine.get("G")
    assert b.status == "failed" and exc.__name__ in str(b.error), b.error
    assert b.quota_slot is None and engine.store.quota_tokens("B") == {}
    assert g.status == "completed", g.status
    assert [r for r, _ in seen] == ["B", "G"] and seen[1][1]["bx"] > seen[0][1]["bx"], seen


# -- D6, X3g: a cancel of a quota holder mid-body ---------------------------------------------


def test_a_cancel_of_a_quota_holder_mid_body_hands_its_slot_on(make: Callable[..., Engine], registry: Registry) -> None:
    """D6, X3g, X3f: C (quota ``cq``, limit 1, with a singleton key) is in its
    body when another engine cancels it. Its next step boundary stops it: it
    ends ``cancelled``, its later steps never run, its slots are freed in that
    write, and W (waiting on the quota) is admitted with a larger token and
    runs; W never ran while C's body did. Three rounds."""
    from tests.conftest import spawn

    log: list[str] = []
    inside: dict[str, int] = {"now": 0, "most": 0}
    lock = threading.Lock()
    entered, release = threading.Event(), threading.Event()
    tokens: dict[str, int] = {}

    def body(ctx: Any, input: Any) -> None:
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        try:
            tokens[ctx.run_id] = ctx.quota_tokens["cq"]
            if input.get("wait"):
                entered.set()
                release.wait(10)
            ctx.step("r2:ok", 1)
            log.append(ctx.run_id)
        finally:
            with lock:
                inside["now"] -= 1

    registry.add_step("r2:ok", lambda v: v)
    registry.add("cq", "1", body, singleton={"key": lambda i: i["k"]}, quotas=[Quota("cq", limit=1)])
    first, second = make(), make()
    for n in range(3):
        entered.clear()
        release.clear()
        first.start("cq", {"k": f"C{n}", "wait": True}, run_id=f"C{n}")
        worker = spawn(lambda: first.dispatcher.drain())
        assert entered.wait(10)
        second.start("cq", {"k": f"W{n}"}, run_id=f"W{n}")
        _drain(second)
        assert second.get(f"W{n}").quota_slot == "waiter"
        second.cancel(f"C{n}")
        release.set()
        worker.join(15)
        assert not worker.is_alive()
        for _ in range(3):
            _drain(first)
            _drain(second)
        c, w = second.get(f"C{n}"), second.get(f"W{n}")
        assert c.status == "cancelled" and c.quota_slot is None, (c.status, c.error)
        assert w.status == "completed", w.status
        assert tokens[f"W{n}"] > tokens[f"C{n}"], tokens
    assert inside["most"] == 1 and log == ["W0", "W1", "W2"], (inside, log)


# -- X2, X3h: a quota handoff racing the tick's queue-TTL sweep --------------------------------


def test_a_quota_handoff_racing_the_ttl_sweep_never_admits_the_expired_waiter(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """X2, X3d, X3h, R5a: H (quota-only workflow ``hq``) holds quota ``qt``;
    W1 (``wf``: a singleton key with a TTL, and quota ``qt``) is past its TTL
    at the front of ``qt``; W2 (``hq``) waits behind it. On separate engines
    and threads, one engine's tick sweeps the TTL while another settles H.
    Whatever the order: W1 never runs and ends ``queue_ttl_expired``, W2 is
    admitted (before or right after the sweep) and completes, run_finished
    is sent once for W1, and ``qt`` never has two holders. Four rounds."""

    from durable_singleton import signals

    log: list[str] = []
    inside = {"now": 0, "most": 0}
    lock = threading.Lock()

    def body(ctx: Any, input: dict[str, Any]) -> None:
        with lock:
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        try:
            if input.get("hold"):
                ctx.wait_for_signal("go")
            log.append(ctx.run_id)
            time.sleep(0.01)
        finally:
            with lock:
                inside["now"] -= 1

    qt = Quota("qt", limit=1)
    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "queue_ttl": TTL}, quotas=[qt])
    registry.add("hq", "1", body, quotas=[qt])
    engines = [make(), make()]
    with counted_per_run(signals.run_finished) as finished:
        for n in range(4):
            h, w1, w2 = f"H{n}", f"X{n}", f"Y{n}"
            engines[0].start("hq", {"hold": True}, run_id=h)
            _drain(engines[0])
            engines[0].start("wf", {"k": f"A{n}"}, run_id=w1)
            engines[0].start("hq", {}, run_id=w2)
            _drain(engines[0])
            assert engines[0].get(h).quota_slot == "holder"
            backdate(engines[0], w1, TTL + 1)

            def racer(i: int, h: str = h) -> Any:
                if i == 0:
                    return engines[0].tick()
                engines[1].signal(h, "go")
                _drain(engines[1])
                return None

            report, settled = run_threads(2, racer)
            assert not isinstance(report, BaseException), report
            assert not isinstance(settled, BaseException), settled
            assert report.errors == [], report.errors
            for _ in range(3):
                engines[0].tick()
                _drain(engines[0])
                _drain(engines[1])
            a, b = engines[0].get(w1), engines[0].get(w2)
            assert a.status == "cancelled" and a.error["code"] == "queue_ttl_expired", (a.status, a.error)
            assert b.status == "completed", (n, b.status, b.quota_slot)
            assert finished[w1] == 1, finished
        assert inside["most"] == 1, inside
        assert not [r for r in log if r.startswith("X")], log


# -- K2 on a quota, workflow-wide, racing claims ----------------------------------------------


def test_a_workflow_wide_pause_of_a_quota_racing_claims_stops_every_admission(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """K2, X3j: three engines claim runs of quota ``qp`` (limit 2) on keys A,
    B and C while a fourth pauses the workflow ``quota:qp``. Once the pause
    returned, no run that did not already hold a slot is admitted: draining
    every engine and ticking runs no body but those of the holders as the
    pause left them; resuming admits the rest, at most two at a time per key.
    Three rounds."""
    log: list[str] = []
    inside: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()

    def body(ctx: Any, input: dict[str, Any]) -> None:
        k = input["acct"]
        with lock:
            inside[k] = inside.get(k, 0) + 1
            most[k] = max(most.get(k, 0), inside[k])
        try:
            time.sleep(0.005)
            log.append(ctx.run_id)
        finally:
            with lock:
                inside[k] -= 1

    registry.add("qp", "1", body, quotas=[Quota("qp", key=lambda i: i["acct"], limit=2)])
    engines = [make() for _ in range(4)]
    for n in range(3):
        ids = []
        for i, e in enumerate(engines[:3]):
            for j in range(4):
                run_id = f"r{n}-{i}-{j}"
                e.start("qp", {"acct": "ABC"[j % 3] + str(n)}, run_id=run_id)
                ids.append(run_id)
        holders_at_pause: set[str] = set()

        def racer(i: int, holders_at_pause: set[str] = holders_at_pause) -> Any:
            if i == 3:
                time.sleep(0.01)
                done = engines[3].pause_workflow("quota:qp", by="ops")
                holders_at_pause.update(
                    r.run_id for r in engines[3].store.list_runs() if r.quota_slot == SlotState.HOLDER
                )
                return done
            _drain(engines[i])
            return None

        results = run_threads(4, racer)
        assert not [r for r in results if isinstance(r, BaseException)], results
        ran = set(log)
        for _ in range(2):
            for e in engines:
                e.tick()
                _drain(e)
        late = set(log) - ran - holders_at_pause
        assert not late, f"admitted after the pause returned: {sorted(late)}"
        engines[3].resume_workflow("quota:qp", by="ops")
        for _ in range(8):
            for e in engines:
                e.tick()
                _drain(e)
            if all(engines[3].get(r).status == "completed" for r in ids):
                break
        assert all(engines[3].get(r).status == "completed" for r in ids), [
            (r, engines[3].get(r).status) for r in ids if engines[3].get(r).status != "completed"
        ]
    assert max(most.values()) <= 2, most


# -- X1 with a quota: starts racing on a busy key ------------------------------------------------


def test_replace_queued_starts_racing_on_a_quota_workflow_leave_one_waiter(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """X1, X3g: H holds key K of ``rq`` (``on_busy="replace_queued"``, also
    naming quota ``rqq``); four engines start a run of K at once, three
    rounds. Each round ends with exactly one active waiter of K (the others
    ``cancelled`` with code ``replaced``), no replaced run holds a quota slot,
    and when H settles only the last waiter runs."""
    log: list[str] = []
    registry.add(
        "rq",
        "1",
        _body(log),
        singleton={"key": lambda i: "K", "on_busy": "replace_queued"},
        quotas=[Quota("rqq", limit=1)],
    )
    engines = [make() for _ in range(4)]
    engines[0].start("rq", {"hold": True}, run_id="H")
    _drain(engines[0])
    assert engines[0].get("H").admitted
    started: list[str] = []
    for n in range(3):
        results = run_threads(4, lambda i, n=n: engines[i].start("rq", {}, run_id=f"s{n}-{i}"))
        assert not [r for r in results if isinstance(r, BaseException)], results
        started += [f"s{n}-{i}" for i in range(4)]
        for e in engines:
            _drain(e)
        active = [r for r in engines[0].store.list_runs() if not r.is_terminal and r.run_id != "H"]
        assert len(active) == 1, [(r.run_id, r.status) for r in active]
        for run_id in started:
            r = engines[0].get(run_id)
            if r.run_id != active[0].run_id:
                assert r.status == "cancelled" and r.error["code"] == "replaced", (run_id, r.status, r.error)
                assert r.quota_slot is None and engines[0].store.quota_tokens(run_id) == {}
    last = active[0].run_id
    engines[0].signal("H", "go")
    for _ in range(3):
        for e in engines:
            _drain(e)
    assert log == ["H", last], log
