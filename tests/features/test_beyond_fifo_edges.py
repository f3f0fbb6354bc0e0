"""Edges of the issue-#20 features (SPEC 5c, X1..X5), found by an independent
tester: bad input that must raise a typed error and write nothing (section 7),
the queue TTL composed with quotas, delayed starts and retries (X2, X3, X5,
D9), K2's workflow-wide controls on a quota, and the in-memory store behaving
as the Django store does. On the in-memory store and the DATABASE_URL database
(SQLite, PostgreSQL, MariaDB).

Failing when written: a queue_ttl the declaration accepts (1e11 s and up)
breaks every claim (OverflowError, DataError); a not_before at the end of the
datetime range, or whose deadline passes it, raises OverflowError; a quota's
(and a singleton's) max_queue_depth or limit past the columns' range raises
the database's error at the start; an expired waiter at a quota's front holds
the quota's free slot until the tick; a workflow-wide pause of a quota misses
keys without a lock row (and, on the in-memory store, every key); a retried
run older than its TTL is expired on an idle key; one quota name with two key
functions differing only in constants registers.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import DurableSingletonError, InvalidWorkflowError
from tests.features.test_queue_ttl import backdate
from tests.helpers import counted_per_run
from tests.helpers import drain as _drain
from tests.helpers import holding_body as _body

TTL = 60.0


def _count(engine: Engine) -> int:
    return len(engine.store.list_runs())


# -- X2 with huge but accepted TTLs ------------------------------------------------------


@pytest.mark.parametrize("ttl", [1e11, 3e11, 1e12, 8e13], ids=["3170y", "9500y", "31700y", "max-timedelta"])
def test_a_queue_ttl_accepted_at_declaration_never_breaks_a_claim(
    engine: Engine, registry: Registry, ttl: float
) -> None:
    """X2, section 7: docs/queue_ttl.rst refuses only a TTL "too large for a
    timedelta"; a TTL the declaration accepts is a valid one, so a holder and
    a waiter of the workflow must run as any other (the waiter admitted at
    the handoff, nothing expired, explain answering). Either the declaration
    refuses it with InvalidWorkflowError, or the workflow works."""
    log: list[str] = []
    try:
        registry.add("wf", "1", _body(log), singleton={"key": lambda i: "K", "queue_ttl": ttl})
    except InvalidWorkflowError:
        return  # refused at declaration: fine (section 7)
    engine.start("wf", {"hold": True}, run_id="H")
    _drain(engine)
    engine.start("wf", {}, run_id="W")
    _drain(engine)
    assert engine.get("H").admitted and not engine.get("W").admitted
    assert engine.tick().errors == []
    assert engine.explain("W").state.value == "waiter"
    engine.signal("H", "go")
    _drain(engine)
    assert log == ["H", "W"] and engine.get("W").status == "completed"


# -- X5: not_before at the ends of the datetime range ----------------------------------------

NEG5 = timezone(timedelta(hours=-5))
POS5 = timezone(timedelta(hours=5))


@pytest.mark.parametrize(
    "not_before,timeout",
    [
        (datetime(9999, 12, 31, 23, 0, tzinfo=NEG5), None),
        (datetime(1, 1, 1, 1, 0, tzinfo=POS5), None),
        (datetime(9999, 12, 31, 23, 0, tzinfo=UTC), 7200),
    ],
    ids=["past-max-in-utc", "before-min-in-utc", "deadline-past-max"],
)
def test_a_not_before_at_the_end_of_time_is_typed_or_works_and_stores_agree(
    engine: Engine, registry: Registry, not_before: datetime, timeout: float | None
) -> None:
    """X5, D5, section 7: docs/delayed_start.rst accepts "an aware datetime,
    in any time zone" and refuses "a number of seconds past the largest
    datetime" with InvalidNotBeforeError, writing nothing. An aware datetime
    whose UTC instant is past datetime.max (9999-12-31 23:00 at UTC-5) or
    before datetime.min, or a delay whose execution deadline (not_before +
    timeout, D5) is past datetime.max, must therefore either start the run
    or raise a typed error (a DurableSingletonError) and write nothing;
    never a bare OverflowError, and the in-memory store and the Django store
    must answer alike."""
    registry.add("wf", "1", _body([]), singleton={"key": lambda i: "K"}, timeout=timeout)
    try:
        run = engine.start("wf", {}, run_id="D", not_before=not_before)
    except DurableSingletonError:
        assert _count(engine) == 0
        return
    assert run.not_before is not None
    assert engine.get("D").status == "pending"
    assert engine.tick().errors == []
    if not_before.year > 2000:
        assert engine.explain("D").state.value == "not_due"
    else:  # a time in the past is due at once
        _drain(engine)
        assert engine.get("D").status == "completed"


# -- X3j, S15: caps and limits no column holds ------------------------------------------------


@pytest.mark.parametrize(
    "singleton,quota",
    [
        (None, lambda: Quota("qd", max_queue_depth=2**63)),
        (None, lambda: Quota("qd", limit=2**31 - 1, max_queue_depth=2**31)),
        ({"key": lambda i: "K", "max_queue_depth": 2**63}, None),
        ({"key": lambda i: "K", "limit": 2**63}, None),
        ({"key": lambda i: "K", "limit": 2**31}, None),
    ],
    ids=[
        "quota-depth-2**63",
        "quota-cap-past-int32",
        "singleton-depth-2**63",
        "singleton-limit-2**63",
        "singleton-limit-2**31",
    ],
)
def test_a_cap_or_limit_accepted_at_declaration_never_breaks_a_start(
    engine: Engine, registry: Registry, singleton: Any, quota: Any
) -> None:
    """X3a, X3j, S15, section 7: a quota's ``max_queue_depth`` is checked as
    "an int >= 0" with no upper bound (a quota's ``limit`` stops at
    MAX_LIMIT, 2**31 - 1; a singleton's ``limit`` and ``max_queue_depth``
    have no bound at all). A value the declaration accepts must work: the
    holder and its waiter run. Else the declaration must refuse it with
    InvalidWorkflowError naming the field. Today a start raises the
    database's IntegrityError/DataError/OverflowError (untyped)."""
    log: list[str] = []
    try:
        registry.add("wf", "1", _body(log), singleton=singleton, quotas=[quota()] if quota else [])
    except InvalidWorkflowError:
        return
    engine.start("wf", {"hold": True}, run_id="H")
    engine.start("wf", {}, run_id="W")
    _drain(engine)
    engine.signal("H", "go")
    _drain(engine)
    assert set(log) == {"H", "W"} and engine.get("W").status == "completed"


# -- X2 composed with quotas (X3) --------------------------------------------------------------


def _ttl_with_quota(registry: Registry, log: list[str], *, key: Callable[[Any], str] = lambda i: i["k"]) -> None:
    """``wf``: a singleton (key from input, TTL) that also names quota ``qt``
    (limit 1); ``hq``: a quota-only workflow on the same quota."""
    qt = Quota("qt", limit=1)
    registry.add("wf", "1", _body(log), singleton={"key": key, "queue_ttl": TTL}, quotas=[qt])
    registry.add("hq", "1", _body(log), quotas=[qt])


def test_a_waiter_held_back_only_by_its_quota_expires_by_its_ttl(engine: Engine, registry: Registry) -> None:
    """X2, X3d: W's singleton key is free but its quota is held by H (a run of
    another workflow); W is a waiter (admitted in none of its limits) and is
    not admitted within its TTL, so the tick ends it ``cancelled`` with code
    ``queue_ttl_expired``; H's release then admits nothing and W never runs."""
    log: list[str] = []
    _ttl_with_quota(registry, log)
    engine.start("hq", {"hold": True}, run_id="H")
    _drain(engine)
    engine.start("wf", {"k": "A"}, run_id="W")
    _drain(engine)
    assert not engine.get("W").admitted and engine.get("W").is_parked
    backdate(engine, "W", TTL + 1)
    report = engine.tick()
    assert report.expired == ["W"] and report.errors == []
    w = engine.get("W")
    assert w.status == "cancelled" and w.error["code"] == "queue_ttl_expired" and w.quota_slot is None
    engine.signal("H", "go")
    _drain(engine)
    assert log == ["H"]


@pytest.mark.parametrize("holder", ["wf", "hq"])
def test_a_quota_handoff_never_admits_a_waiter_past_its_ttl(engine: Engine, registry: Registry, holder: str) -> None:
    """X2, X3h: W (wf, key K, quota qt) is past its TTL and no tick ran. H
    settles: when H is a run of wf with the same key and quota, its handoff
    holds all of W's limits and would admit W itself (X3h); when H is a
    quota-only run, W is sent a turn and its own claim decides. Either way
    "every grant skips a waiter whose TTL passed" (docs/queue_ttl.rst): W is
    not admitted, its body never runs, and the next tick ends it."""
    log: list[str] = []
    _ttl_with_quota(registry, log, key=lambda i: "K")
    engine.start(holder, {"hold": True}, run_id="H")
    _drain(engine)
    engine.start("wf", {}, run_id="W")
    _drain(engine)
    assert engine.get("H").quota_slot == "holder" and not engine.get("W").admitted
    backdate(engine, "W", TTL + 1)
    engine.signal("H", "go")
    _drain(engine)
    assert engine.get("H").status == "completed"
    w = engine.get("W")
    assert not w.admitted and w.quota_slot != "holder" and log == ["H"]
    assert engine.tick().expired == ["W"]
    _drain(engine)
    assert log == ["H"] and engine.get("W").error["code"] == "queue_ttl_expired"


def test_an_expired_quota_waiter_does_not_hold_back_the_quota(engine: Engine, registry: Registry) -> None:
    """X2, X3d, X3g: W1 (wf, past its TTL) is at the front of quota qt, W2 (hq)
    behind it. When H releases qt, W1 is skipped (never admitted) and W2 gets
    the slot and runs, before any tick; the tick then ends W1."""
    log: list[str] = []
    _ttl_with_quota(registry, log)
    engine.start("hq", {"hold": True}, run_id="H")
    _drain(engine)
    engine.start("wf", {"k": "A"}, run_id="W1")
    engine.start("hq", {}, run_id="W2")
    _drain(engine)
    backdate(engine, "W1", TTL + 1)
    engine.signal("H", "go")
    for _ in range(3):
        _drain(engine)
    assert "W1" not in log
    before_tick = list(log)
    assert engine.tick().expired == ["W1"]
    for _ in range(3):
        _drain(engine)
    assert log == ["H", "W2"], log  # W2 runs once the tick ended W1, at the latest
    assert before_tick == ["H", "W2"], before_tick  # ... but it was due at H's release, before any tick


# -- K2 on a quota, workflow-wide (X3j) -------------------------------------------------------


def test_workflow_wide_controls_reach_every_key_of_a_quota(engine: Engine, registry: Registry) -> None:
    """K2, X3b, X3j: "The same controls exist per workflow (all keys)", and
    K2 covers quota keys "as it covers singleton keys". With quota ``qw``
    (limit 1) held on keys A and B, each with a waiter: pausing the
    workflow ``quota:qw`` pauses both keys (a waiter is not admitted when
    its holder settles); resuming and raising the limit to 2 workflow-wide
    admits the waiters at once, on both keys, on every store alike."""
    log: list[str] = []
    qw = Quota("qw", key=lambda i: i["acct"], limit=1)
    registry.add("a", "1", _body(log), quotas=[qw])
    for acct in ("A", "B"):
        engine.start("a", {"acct": acct, "hold": True}, run_id=f"H{acct}")
        engine.start("a", {"acct": acct}, run_id=f"W{acct}")
    _drain(engine)
    assert [engine.get(r).quota_slot for r in ("HA", "HB", "WA", "WB")] == ["holder", "holder", "waiter", "waiter"]
    paused = engine.pause_workflow("quota:qw", by="ops")
    assert sorted(s.key for s in paused) == ["A", "B"] and all(s.paused for s in paused)
    engine.signal("HA", "go")
    _drain(engine)
    assert log == ["HA"] and engine.get("WA").quota_slot == "waiter"  # paused: WA not admitted
    engine.resume_workflow("quota:qw", by="ops")
    _drain(engine)
    assert log == ["HA", "WA"]
    raised = engine.override_workflow_limit("quota:qw", 2, by="ops")
    assert {s.key: s.limit for s in raised}["B"] == 2
    _drain(engine)
    assert log == ["HA", "WA", "WB"]


def test_a_workflow_wide_pause_of_a_quota_holds_a_run_not_yet_claimed(engine: Engine, registry: Registry) -> None:
    """K2, X3j: a run of quota ``qw`` on a key no claim has touched yet (started,
    its turn not yet taken) is an active run of that quota key. Pausing the
    workflow ``quota:qw`` must pause its key too ("every key of the workflow
    that has a lock row or an active run", controls.py), so its first claim
    admits nothing: the body does not run until the resume. (The singleton
    side reads the keys of active runs for this very case, key_controls.py.)"""
    log: list[str] = []
    qw = Quota("qw", key=lambda i: i["acct"], limit=1)
    registry.add("a", "1", _body(log), quotas=[qw])
    engine.start("a", {"acct": "C"}, run_id="R")  # its turn is queued, not taken
    paused = engine.pause_workflow("quota:qw", by="ops")
    _drain(engine)
    assert log == [] and engine.get("R").quota_slot == "waiter", "R ran while its quota was paused"
    assert [s.key for s in paused] == ["C"]
    engine.resume_workflow("quota:qw", by="ops")
    _drain(engine)
    assert log == ["R"]


# -- X1 skip and the limit in force (K2) ---------------------------------------------------------


def test_skip_uses_the_limit_in_force_of_its_key(engine: Engine, registry: Registry) -> None:
    """X1, K2, docs/on_busy.rst ("The cap uses the limit in force, so a
    runtime limit override moves it"): with ``on_busy="skip"`` and limit 1,
    H holds K; a second start is refused with SingletonBusyError and writes
    nothing. After override_limit(K, 2) a start is accepted and runs beside
    H; a third is refused; after the override is lowered back to 1 a start
    is refused again; the other key keeps the declared limit."""
    from durable_singleton.exceptions import SingletonBusyError

    log: list[str] = []
    registry.add("sk", "1", _body(log), singleton={"key": lambda i: i["k"], "on_busy": "skip"})
    engine.start("sk", {"k": "K", "hold": True}, run_id="H")
    _drain(engine)
    with pytest.raises(SingletonBusyError):
        engine.start("sk", {"k": "K", "hold": True}, run_id="X1")
    assert _count(engine) == 1
    engine.override_limit("sk", "K", 2, by="t")
    engine.start("sk", {"k": "K", "hold": True}, run_id="A")
    _drain(engine)
    assert engine.get("A").admitted
    with pytest.raises(SingletonBusyError):
        engine.start("sk", {"k": "K"}, run_id="X2")
    engine.signal("A", "go")
    _drain(engine)
    engine.override_limit("sk", "K", 1, by="t")
    with pytest.raises(SingletonBusyError):
        engine.start("sk", {"k": "K"}, run_id="X3")
    engine.start("sk", {"k": "OTHER", "hold": True}, run_id="O")
    with pytest.raises(SingletonBusyError):
        engine.start("sk", {"k": "OTHER"}, run_id="X4")
    assert all(engine.store.get_run(r) is None for r in ("X1", "X2", "X3", "X4"))
    assert log == ["A"]


# -- races: the TTL sweep against a replacing start (X1, X2) -------------------------------------


def test_the_ttl_sweep_racing_a_replacing_start_settles_the_waiter_once(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """X1, X2, R5a: W is past its TTL; one engine's tick ends it
    (``queue_ttl_expired``) while another engine's ``replace_queued`` start
    replaces it (``replaced``). One compare-and-set settles W: its code is one
    of the two, run_finished is sent once, the new start is the key's only
    waiter, and neither call raises; the holder keeps its slot."""

    from durable_singleton import signals
    from durable_singleton.records import RunRecord
    from tests.conftest import run_threads

    log: list[str] = []
    registry.add("rq", "1", _body(log), singleton={"key": lambda i: "K", "queue_ttl": TTL, "on_busy": "replace_queued"})
    engines = [make(), make()]
    with counted_per_run(signals.run_finished) as finished:
        engines[0].start("rq", {"hold": True}, run_id="H")
        _drain(engines[0])
        for n in range(6):
            waiter, new = f"w{n}", f"s{n}"
            if n == 0:
                engines[0].start("rq", {}, run_id=waiter)
            backdate(engines[0], waiter, TTL + 1)

            def racer(i: int, s: str = new) -> Any:
                return engines[0].tick() if i == 0 else engines[1].start("rq", {}, run_id=s)

            report, started = run_threads(2, racer)
            assert not isinstance(report, BaseException), report
            assert isinstance(started, RunRecord), started
            assert report.errors == [], report.errors
            w = engines[0].get(waiter)
            assert w.status == "cancelled" and w.error["code"] in ("queue_ttl_expired", "replaced"), w.error
            assert finished[waiter] == 1, (waiter, finished)
            active = [r.run_id for r in engines[0].store.list_runs() if not r.is_terminal]
            assert sorted(active) == sorted(["H", new]), active
            # the next round races on a fresh waiter, which replaces this round's start
            engines[0].start("rq", {}, run_id=f"w{n + 1}")
            assert engines[0].get(new).error["code"] == "replaced"
        assert engines[0].get("H").admitted and log == []


# -- X3a, X4a: what a key or fair_key function returns ----------------------------------------


def _raises(_input: Any) -> str:
    raise LookupError("no account in the input")


BAD_KEYS: list[Any] = [
    lambda i: None,
    lambda i: 7,
    lambda i: b"acct",
    lambda i: "",
    lambda i: "   ",
    lambda i: "a\x00b",
    lambda i: "a\nb",
    lambda i: "\ud800",
    lambda i: "x" * 128,
    _raises,
]
BAD_IDS = ["None", "int", "bytes", "empty", "blank", "NUL", "newline", "surrogate", "128-chars", "raises"]


@pytest.mark.parametrize("what", ["key", "fair_key"])
@pytest.mark.parametrize("fn", BAD_KEYS, ids=BAD_IDS)
def test_a_bad_quota_key_or_fair_key_is_a_typed_error_on_every_start_path(
    engine: Engine, registry: Registry, what: str, fn: Callable[[Any], Any]
) -> None:
    """X3a, X4a, S1, section 7: a quota's key or fair_key function that raises
    or returns anything but a non-empty str of at most 127 characters a
    database stores as it is raises SingletonKeyError (a DurableSingletonError)
    naming the quota, from start, start_many (a good input before the bad one
    included) and signal_with_start; nothing is written, no turn is queued."""
    from durable_singleton.exceptions import SingletonKeyError

    fields: dict[str, Any] = {"key": fn} if what == "key" else {"key": lambda i: "A", "fair_key": fn}
    registry.add("qk", "1", _body([]), quotas=[Quota("qk-quota", **fields)])
    good = {"ok": True}
    with pytest.raises(SingletonKeyError, match="qk-quota"):
        engine.start("qk", good, run_id="R1")
    with pytest.raises(SingletonKeyError):
        engine.start_many("qk", [good, good], run_ids=["R2", "R3"])
    with pytest.raises(SingletonKeyError):
        engine.signal_with_start("qk", good, run_id="R4", signal="go", payload=None)
    assert _count(engine) == 0
    assert list(engine.dispatcher.queue) == []  # type: ignore[attr-defined]


@pytest.mark.vendor_agnostic
@pytest.mark.parametrize(
    "weights",
    [
        [("gold", 2)],
        {"gold": 0},
        {"gold": 1001},
        {"gold": 2.0},
        {"gold": True},
        {"": 2},
        {5: 2},
        {"gold": None},
        "gold",
    ],
    ids=["pairs", "zero", "1001", "float", "bool", "empty-sub-key", "int-sub-key", "None", "str"],
)
def test_weights_of_a_wrong_shape_are_refused_at_registration(registry: Registry, weights: Any) -> None:
    """X4a: ``weights`` must be a mapping from a non-empty str sub-key to an
    int from 1 to 1000; anything else raises InvalidWorkflowError naming
    ``quotas.weights`` and registers nothing (no workflow, no quota)."""
    with pytest.raises(InvalidWorkflowError, match=r"quotas\.weights"):
        registry.add("fw", "1", _body([]), quotas=[Quota("fw-q", fair_key=lambda i: "t", weights=weights)])
    assert registry.latest == {} and registry.quotas == {}


# -- X2 and a retry (D9) -------------------------------------------------------------------------


def test_a_retried_run_older_than_its_ttl_is_ended_by_the_next_tick(engine: Engine, registry: Registry) -> None:
    """X2, D9 (docs/queue_ttl.rst, "A retry"): R ran and failed; an operator
    retries it later than ``queue_ttl`` after its creation. The retry keeps
    its ``created_at`` and its TTL counts from it (SPEC X2: "within that time
    of its creation"), so even on an idle key no grant admits it and the next
    tick ends it ``queue_ttl_expired``; its body never runs again. A retry
    within its TTL runs as any waiter."""
    calls: list[str] = []

    def body(ctx: Any, input: dict[str, Any]) -> str:
        calls.append(ctx.run_id)
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        return "ok"

    registry.add("rt", "1", body, singleton={"key": lambda i: "K", "queue_ttl": TTL})
    engine.start("rt", {}, run_id="R")
    _drain(engine)
    assert engine.get("R").status == "failed"
    backdate(engine, "R", TTL + 1)  # the retry comes after R's TTL passed
    engine.retry("R")
    _drain(engine)
    assert not engine.get("R").admitted and calls == ["R"]
    assert engine.tick().expired == ["R"]
    _drain(engine)
    r = engine.get("R")
    assert r.status == "cancelled" and r.error["code"] == "queue_ttl_expired" and calls == ["R"]

    calls.clear()  # V's first body fails; its retry within its TTL runs as any waiter
    engine.start("rt", {}, run_id="V")
    _drain(engine)
    assert engine.get("V").status == "failed"
    engine.retry("V")
    _drain(engine)
    assert engine.get("V").status == "completed" and calls == ["V", "V"]


# -- X3a: one quota name, two key functions ------------------------------------------------------


@pytest.mark.vendor_agnostic
@pytest.mark.parametrize("field", ["key", "fair_key"])
def test_one_quota_name_with_two_different_key_functions_is_refused(registry: Registry, field: str) -> None:
    """X3a, X4a: "Two declarations of one name with another limit or key
    function ... raise InvalidWorkflowError at registration". Two workflows
    declare quota ``acct`` with key functions that read different fields of
    the input (``i["account"]`` and ``i["tenant"]``): they are two key
    functions, so the second registration must be refused and register
    nothing. (Functions that differ only in their constants have the same
    bytecode: a comparison of ``co_code`` alone takes them for one.)"""
    first = Quota("acct", **{field: lambda i: i["account"]})  # type: ignore[arg-type]
    second = Quota("acct", **{field: lambda i: i["tenant"]})  # type: ignore[arg-type]
    registry.add("pay", "1", _body([]), quotas=[first])
    with pytest.raises(InvalidWorkflowError, match="acct"):
        registry.add("refund", "1", _body([]), quotas=[second])
    assert "refund" not in registry.latest
    assert registry.quotas["acct"] is first
