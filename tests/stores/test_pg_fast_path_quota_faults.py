"""Breaks tried on the PostgreSQL fast path of runs that carry quotas (X3i, commit
e3cb1c5): the fast path (``DjangoStore()``) must decide as the ORM path
(``DjangoStore(raw_sql=False)``) does, on the same scenario with other keys.

Scenarios: random schedules with K2 key controls on the quota keys (pause,
resume, a limit override up and down), cancels, retries, delayed starts,
``replace_queued``, a singleton of limit 2 and two quotas; a lowered quota
limit under two holders; a holder's lease expiring and its recovery by the
tick; ``queue_ttl`` on a keyed quota workflow; a delayed start at a quota's
front; a start inside a caller's ``transaction.atomic()``; a start with the
same ``run_id`` twice (R3); deleting a quota waiter; a cancel requested while
a waiter's admission waits on the locks; fast and ORM engines racing on the
same quota keys; a settle whose lease expires while its handoff waits on
a key's lock (it fails on the fast path: FINISH_OWNED compares the lease with
STATEMENT_TIMESTAMP(), the message's arrival, not the time after the locks).
Elsewhere than PostgreSQL both engines take the ORM path and
the tests check the ORM against itself.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models import F

from durable_singleton import Quota, runtime
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import QuotaMembership, Run, SingletonKey
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.conftest import run_threads, spawn
from tests.helpers import (
    KeysInside,
    act_on_one,
    control_key,
    control_one_quota_key,
    execute_one_turn,
    random_input,
    seeds,
)
from tests.helpers import drain as _drain
from tests.helpers import queued as _queue
from tests.helpers import quota_body as _body

pytestmark = pytest.mark.django_db(transaction=True)

STORES: dict[str, Callable[[], DjangoStore]] = {"fast": DjangoStore, "orm": lambda: DjangoStore(raw_sql=False)}


def _members(run_ids: list[str]) -> dict[str, list[tuple[str, str, Any, Any]]]:
    """The runs' memberships, their own prefix cut from the keys: (quota, key, slot, token)
    by run id, read in one query."""
    members: dict[str, list[tuple[str, str, Any, Any]]] = {run_id: [] for run_id in run_ids}
    for m in QuotaMembership.objects.filter(run_id__in=run_ids).order_by("run_id", "quota"):
        members[m.run_id].append((m.quota, m.key.split("-", 1)[1], m.slot, m.fencing_token))
    return members


def _snapshot(engine: Engine, ids: list[str]) -> list[tuple[Any, ...]]:
    """The runs ``ids`` of ``engine``'s store as compared between the paths, read at
    once: one ``list_runs`` and one query of the memberships."""
    runs = {r.run_id: r for r in engine.store.list_runs()}
    members = _members(ids)
    out = []
    for run_id in ids:
        run = runs[run_id]
        error = (run.error or {}).get("code") if isinstance(run.error, dict) else None
        out.append(
            (
                run.status,
                run.admitted,
                run.quota_slot,
                run.fencing_token,
                run.quota_tokens,
                run.attempts,
                error,
                tuple(members[run_id]),
            )
        )
    return out


def _check_invariants(engine: Engine, prefix: str, limits: dict[str, int], controls: dict[str, Any]) -> None:
    """Never more holders than the limit in force in a quota key (a pause aside, K2)."""
    counts: dict[tuple[str, str], int] = {}
    for m in QuotaMembership.objects.filter(
        key__startswith=prefix, slot="holder", run__status__in=["pending", "running", "suspended", "sleeping"]
    ):
        counts[(m.quota, m.key)] = counts.get((m.quota, m.key), 0) + 1
    for (quota, key), n in counts.items():
        override = controls.get((quota, key))
        # A lowered limit never evicts a holder: the most ever admitted is the largest in force.
        ceiling = max(limits[quota], override or 0)
        assert n <= ceiling, (quota, key, n, ceiling)


# -- the differential test ------------------------------------------------------------------------


def _diff_registry() -> Registry:
    registry = Registry()
    pool = Quota("bq-pool", key=lambda i: i["p"], limit=2)
    other = Quota("bq-other", key=lambda i: i["o"], limit=3)
    registry.add("bq-k2", "1", _body, singleton={"key": lambda i: i["k"], "limit": 2}, quotas=[pool, other])
    registry.add("bq-two", "1", _body, quotas=[other, pool])
    registry.add("bq-one", "1", _body, quotas=[pool])
    registry.add("bq-rq", "1", _body, singleton={"key": lambda i: i["k"], "on_busy": "replace_queued"}, quotas=[pool])
    registry.add("bq-plain", "1", _body, singleton={"key": lambda i: i["k"], "limit": 2})
    # One workflow in two versions on the same singleton keys: the first carries a quota, the
    # second none, so a key's line holds runs with and without quotas.
    registry.add("bq-mix", "1", _body, singleton={"key": lambda i: i["k"], "limit": 2}, quotas=[pool])
    registry.add("bq-mix", "2", _body, singleton={"key": lambda i: i["k"], "limit": 2})
    registry.add(
        "bq-cip", "1", _body, singleton={"key": lambda i: i["k"], "on_busy": "cancel_in_progress"}, quotas=[other]
    )
    return registry


@pytest.mark.parametrize("mixed", [False, True], ids=["quota-controls", "mixed-versions"])
@pytest.mark.parametrize("seed", seeds(8))
def test_fast_path_decides_as_the_orm_path_with_key_controls_cancels_and_retries(seed: int, mixed: bool) -> None:
    """X3c, X3d, X3g, X3h, K2, X1, X5, D6, D9: a random schedule of starts (a
    singleton of limit 2 with two quotas, two quotas alone, one quota, a
    replace_queued singleton with a quota, a plain singleton; some failing,
    some held, some delayed an hour), turns in random order, signals, cancels,
    retries, and pause / resume / limit overrides of the quota keys, run once on
    the fast path and once on the ORM path (other keys): after each step the
    same states, slots, tokens and memberships, and the same turns queued."""
    registry = _diff_registry()
    engines = {name: make_engine(make(), registry=registry) for name, make in STORES.items()}
    rng = random.Random(seed)
    ids: list[str] = []
    controls: dict[str, dict[tuple[str, str], Any]] = {"fast": {}, "orm": {}}
    limits = {"bq-pool": 2, "bq-other": 3}
    for step in range(70):
        op = rng.random()
        what: str | None = ""
        if op < 0.33 or not ids:
            workflow = rng.choice(["bq-k2", "bq-k2", "bq-two", "bq-one", "bq-rq", "bq-plain", "bq-mix", "bq-mix"])
            if mixed and workflow == "bq-rq":
                workflow = "bq-cip"
            version = rng.choice(["1", "2"]) if workflow == "bq-mix" else None
            input = random_input(rng, hold=0.45, fail=0.1)
            delayed = rng.random() < 0.08
            ids.append(f"{seed}-{len(ids):02d}")
            what = f"start {workflow} {input} delayed={delayed}"
            for name, e in engines.items():
                e.start(
                    workflow,
                    {**input, "k": f"{name}-{input['k']}", "p": f"{name}-{input['p']}", "o": f"{name}-{input['o']}"},
                    run_id=f"{name}-{ids[-1]}",
                    not_before=3600 if delayed else None,
                    version=version,
                )
        elif op < 0.7:
            what = execute_one_turn(rng, engines, "fast")
        elif op < 0.8:
            holding = lambda r: r.status == RunStatus.SUSPENDED and r.quota_slot == "holder"  # noqa: E731
            what = act_on_one(rng, engines, "fast", ids, holding, "signal", "go")
        elif op < 0.85:
            what = act_on_one(rng, engines, "fast", ids, lambda r: not r.is_terminal, "cancel")
        elif op < 0.88:
            what = act_on_one(rng, engines, "fast", ids, lambda r: r.status == RunStatus.FAILED, "retry")
        elif op < 0.92 and mixed:
            workflow = rng.choice(["bq-k2", "bq-mix"])
            key = rng.choice("ab")
            action = rng.choice(["pause", "resume", "up", "down", "clear"])
            what = f"{action} {workflow} {key}"
            for name, e in engines.items():
                control_key(e, workflow, f"{name}-{key}", action, {"up": 3, "down": 1, "clear": None}.get(action))
        else:
            quota, key, action, limit = control_one_quota_key(rng, engines, {"bq-pool": "xy", "bq-other": "uv"}, limits)
            what = f"{action} {quota} {key}"
            if action not in ("pause", "resume"):
                for name in engines:
                    controls[name][(quota, f"{name}-{key}")] = limit
        if what is None:  # nothing to act on
            continue
        fast = _snapshot(engines["fast"], [f"fast-{i}" for i in ids])
        orm = _snapshot(engines["orm"], [f"orm-{i}" for i in ids])
        for i, (a, b) in enumerate(zip(fast, orm, strict=True)):
            assert a == b, f"step {step} ({what}): run {ids[i]}: fast {a} orm {b}"
        queued = {name: [t.split("-", 1)[1] for t in _queue(e)] for name, e in engines.items()}
        assert queued["fast"] == queued["orm"], f"step {step} ({what})"
        for name, e in engines.items():
            _check_invariants(e, f"{name}-", limits, controls[name])
    assert any(s[0] == RunStatus.COMPLETED for s in _snapshot(engines["fast"], [f"fast-{i}" for i in ids]))


# -- targeted scenarios, each on both paths -------------------------------------------------------


@pytest.fixture(params=["fast", "orm"])
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _engine(path: str, registry: Registry, **settings: Any) -> Engine:
    return make_engine(STORES[path](), registry=registry, **settings)


def test_a_lowered_quota_limit_under_two_holders_admits_no_one_when_one_settles(path: str) -> None:
    """K2, X3c: a quota of 2 with two holders and a waiter is lowered to 1: when
    one holder settles the other still fills the one slot, so the waiter is not
    admitted (sent no turn, or parked by its own); when the second settles it is."""
    registry = Registry()
    registry.add("lq", "1", _body, quotas=[Quota("lq-pool", limit=2)])
    engine = _engine(path, registry)
    engine.start("lq", {"hold": True}, run_id="H1")
    engine.start("lq", {"hold": True}, run_id="H2")
    engine.start("lq", {}, run_id="W")
    _drain(engine)
    assert [engine.get(r).quota_slot for r in ("H1", "H2", "W")] == ["holder", "holder", "waiter"]
    engine.override_limit("quota:lq-pool", "*", 1, by="t")
    _drain(engine)
    engine.signal("H1", "go")
    _drain(engine)
    assert engine.get("H1").status == RunStatus.COMPLETED
    assert engine.get("W").quota_slot == "waiter" and engine.get("W").status == RunStatus.SUSPENDED
    engine.execute("W")  # a stray turn is parked, not admitted
    assert engine.get("W").quota_slot == "waiter"
    engine.signal("H2", "go")
    _drain(engine)
    assert engine.get("W").status == RunStatus.COMPLETED


def test_a_paused_quota_key_admits_no_waiter_of_a_keyed_workflow_and_resuming_does(path: str) -> None:
    """K2, X3c, S5: a keyed workflow (limit 2) on a quota of 2; the quota key is
    paused while one run holds it: a settle frees the slot but a paused key has
    none free, so its waiters (one behind the singleton as well) stay waiters,
    and the singleton's own free slot is not given to a quota-carrying waiter;
    resuming admits two, oldest first, with increasing quota tokens."""
    registry = Registry()
    registry.add(
        "pk",
        "1",
        _body,
        singleton={"key": lambda i: "k", "limit": 2},
        quotas=[Quota("pk-pool", limit=2)],
    )
    engine = _engine(path, registry)
    engine.start("pk", {"hold": True}, run_id="H")
    _drain(engine)
    engine.pause_key("quota:pk-pool", "*", by="t")
    for r in ("W1", "W2", "W3"):
        engine.start("pk", {"hold": True}, run_id=r)
    _drain(engine)
    engine.signal("H", "go")
    _drain(engine)
    assert engine.get("H").status == RunStatus.COMPLETED
    for r in ("W1", "W2", "W3"):
        engine.execute(r)  # stray turns change nothing while paused
        assert engine.get(r).quota_slot == "waiter" and not engine.get(r).admitted, r
    engine.resume_key("quota:pk-pool", "*", by="t")
    _drain(engine)
    runs = {r: engine.get(r) for r in ("W1", "W2", "W3")}
    assert [runs[r].quota_slot for r in ("W1", "W2", "W3")] == ["holder", "holder", "waiter"]
    assert runs["W1"].admitted and runs["W2"].admitted and not runs["W3"].admitted
    tokens = {r: engine.store.quota_tokens(r) for r in ("W1", "W2")}
    assert tokens["W1"]["pk-pool"] < tokens["W2"]["pk-pool"], tokens
    assert runs["W1"].fencing_token < runs["W2"].fencing_token


def _expire_lease(run_id: str) -> None:
    Run.objects.filter(pk=run_id).update(lease_expires_at=F("lease_expires_at") - timedelta(hours=1))


def test_a_quota_holder_recovered_by_the_tick_takes_new_tokens_and_its_waiter_follows(path: str) -> None:
    """R5, K1, X3f, X3g: a running quota holder (with a singleton key) stalls and
    its lease expires; the tick recovers it with a larger token in every limit;
    the stalled executor's late settle is refused; the recovered run settles and
    hands the quota and the key to the waiter, whose tokens are larger still."""
    stall, inside = threading.Event(), threading.Event()
    seen: dict[str, list[dict[str, int]]] = {}

    def body(ctx: Any, input: dict[str, Any]) -> dict[str, int]:
        seen.setdefault(ctx.run_id, []).append(dict(ctx.quota_tokens))
        if input.get("stall") and len(seen[ctx.run_id]) == 1:
            inside.set()
            stall.wait(20)
        return dict(ctx.quota_tokens)

    registry = Registry()
    registry.add(
        "rc", "1", body, singleton={"key": lambda i: "k"}, quotas=[Quota("rc-a", limit=1), Quota("rc-b", limit=1)]
    )
    engine = _engine(path, registry)
    engine.start("rc", {"stall": True}, run_id="S")
    engine.start("rc", {}, run_id="W")
    _queue(engine).clear()
    engine.execute("W")  # S is older: W parks
    assert engine.get("W").quota_slot == "waiter"
    thread = spawn(engine.execute, "S")
    assert inside.wait(10)
    first_token = Run.objects.get(pk="S").fencing_token
    _expire_lease("S")
    engine.tick()
    assert "S" in _queue(engine)
    _queue(engine).remove("S")
    engine.execute("S")  # the recovery: a new lease and tokens, runs to its end
    stall.set()
    thread.join(20)
    assert not thread.is_alive()
    assert len(seen["S"]) == 2, seen
    assert seen["S"][1]["rc-a"] > seen["S"][0]["rc-a"] and seen["S"][1]["rc-b"] > seen["S"][0]["rc-b"]
    s = engine.get("S")
    assert s.status == RunStatus.COMPLETED and s.output == seen["S"][1]
    assert s.fencing_token is None or s.fencing_token > first_token
    _drain(engine)
    engine.tick()
    _drain(engine)
    w = engine.get("W")
    assert w.status == RunStatus.COMPLETED, w
    assert w.output["rc-a"] > seen["S"][1]["rc-a"] and w.output["rc-b"] > seen["S"][1]["rc-b"]
    assert QuotaMembership.objects.filter(slot="holder").count() == 0


def test_queue_ttl_on_a_keyed_quota_workflow_expires_the_waiter_and_serves_the_next(path: str) -> None:
    """X2, X3g, X3h: a keyed workflow with queue_ttl on a quota of 1 shared with a
    quota-only workflow. W (keyed) waits behind the holder past its TTL, V
    (quota only) behind it. When the holder settles W is never admitted; the
    tick ends it ``queue_ttl_expired`` and V runs; no slot is left held."""
    registry = Registry()
    quota = Quota("tq-pool", limit=1)
    registry.add("tq", "1", _body, singleton={"key": lambda i: "k", "queue_ttl": 30}, quotas=[quota])
    registry.add("tv", "1", _body, quotas=[quota])
    engine = _engine(path, registry)
    engine.start("tv", {"hold": True}, run_id="H")
    engine.start("tq", {}, run_id="W")
    engine.start("tv", {}, run_id="V")
    _drain(engine)
    Run.objects.filter(pk="W").update(created_at=F("created_at") - timedelta(seconds=120))
    QuotaMembership.objects.filter(run_id="W").update(created_at=F("created_at") - timedelta(seconds=120))
    engine.signal("H", "go")
    _drain(engine)
    assert engine.get("W").status != RunStatus.COMPLETED and not engine.get("W").admitted
    for _ in range(3):
        engine.tick()
        _drain(engine)
    w, v = engine.get("W"), engine.get("V")
    assert w.status == RunStatus.CANCELLED and w.error["code"] == "queue_ttl_expired", w
    assert v.status == RunStatus.COMPLETED, v
    assert QuotaMembership.objects.filter(slot="holder").count() == 0


def test_a_delayed_start_at_a_quotas_front_does_not_block_the_due_waiter_behind_it(path: str) -> None:
    """X5, X3d: D (delayed an hour) is older than V in the quota's line; when the
    holder settles V is admitted, and D stays a waiter holding no slot."""
    registry = Registry()
    quota = Quota("dq-pool", limit=1)
    registry.add("dq", "1", _body, quotas=[quota], singleton={"key": lambda i: i["k"]})
    engine = _engine(path, registry)
    engine.start("dq", {"hold": True, "k": "a"}, run_id="H")
    engine.start("dq", {"k": "b"}, run_id="D", not_before=3600)
    engine.start("dq", {"k": "c"}, run_id="V")
    _drain(engine)
    engine.execute("D")  # a turn before its time: nothing
    assert engine.get("D").quota_slot == "waiter"
    engine.signal("H", "go")
    _drain(engine)
    assert engine.get("V").status == RunStatus.COMPLETED
    assert engine.get("D").quota_slot == "waiter" and not engine.get("D").admitted
    engine.execute("D")
    assert engine.get("D").quota_slot == "waiter" and engine.get("D").status == RunStatus.PENDING


def test_a_quota_start_inside_a_callers_transaction_rolls_back_with_it_and_commits_with_it(path: str) -> None:
    """X3b, S3: a start inside ``transaction.atomic()`` writes the run and its
    memberships in the caller's transaction: a rollback leaves neither (and no
    turn), a commit leaves both and the run completes."""
    registry = Registry()
    registry.add("aq", "1", _body, quotas=[Quota("aq-pool", limit=1)], singleton={"key": lambda i: "k"})
    engine = _engine(path, registry)

    class BoomError(Exception):
        pass

    with pytest.raises(BoomError), transaction.atomic():
        engine.start("aq", {}, run_id="R1")
        assert QuotaMembership.objects.filter(run_id="R1").count() == 1
        raise BoomError
    assert not Run.objects.filter(pk="R1").exists()
    assert not QuotaMembership.objects.filter(run_id="R1").exists()
    _drain(engine)
    with transaction.atomic():
        engine.start("aq", {}, run_id="R2")
        engine.start("aq", {}, run_id="R2")  # R3 inside the same transaction
    assert QuotaMembership.objects.filter(run_id="R2").count() == 1
    _drain(engine)
    assert engine.get("R2").status == RunStatus.COMPLETED
    assert engine.get("R2").output == {"aq-pool": 1}


def test_a_second_start_of_the_same_run_id_writes_no_second_membership(path: str) -> None:
    """R3, X3b: the second start of a quota run's id (other input, so other quota
    keys) returns the stored run and writes nothing: one membership per quota,
    at the first start's keys; the run takes one slot and completes once."""
    registry = Registry()
    registry.add("rq3", "1", _body, quotas=[Quota("r3-a", key=lambda i: i["a"], limit=1), Quota("r3-b", limit=1)])
    engine = _engine(path, registry)
    first = engine.start("rq3", {"a": "x", "hold": True}, run_id="R")
    again = engine.start("rq3", {"a": "y"}, run_id="R")
    assert again.run_id == "R" and again.quota_keys == first.quota_keys
    assert sorted((m.quota, m.key) for m in QuotaMembership.objects.filter(run_id="R")) == [
        ("r3-a", "x"),
        ("r3-b", "*"),
    ]
    engine.start("rq3", {"a": "y"}, run_id="Y")
    _drain(engine)
    assert engine.get("R").quota_slot == "holder" and engine.get("Y").quota_slot == "waiter"  # r3-b is taken
    engine.signal("R", "go")
    _drain(engine)
    assert engine.get("R").status == engine.get("Y").status == RunStatus.COMPLETED


def test_deleting_a_quota_waiter_at_the_front_sends_the_next_its_turn_on_the_fast_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X3g, F12: W1 (quotas A and B) is at A's front blocked by B's holder; W2
    (A only) waits behind it. Deleting W1 lets W2 run at once."""
    registry = Registry()
    a, b = Quota("da", limit=1), Quota("db", limit=1)
    registry.add("wb", "1", _body, quotas=[b])
    registry.add("wab", "1", _body, quotas=[a, b])
    registry.add("wa", "1", _body, quotas=[a])
    engine = _engine(path, registry)
    monkeypatch.setattr(runtime, "get_engine", lambda: engine)
    engine.start("wb", {"hold": True}, run_id="HB")
    engine.start("wab", {}, run_id="W1")
    engine.start("wa", {}, run_id="W2")
    _drain(engine)
    assert engine.get("W2").quota_slot == "waiter"
    Run.objects.filter(pk="W1").delete()
    for _ in range(3):
        _drain(engine)
        engine.tick()
    _drain(engine)
    assert engine.get("W2").status == RunStatus.COMPLETED
    engine.signal("HB", "go")
    _drain(engine)
    assert engine.get("HB").status == RunStatus.COMPLETED


def _lock_rows(ready: threading.Event, release: threading.Event, rows: Callable[[], Any]) -> None:
    with transaction.atomic():
        list(rows())
        ready.set()
        release.wait(20)


def test_a_cancel_requested_while_a_waiters_admission_waits_on_the_locks(path: str) -> None:
    """D6, R5a, X3c: a waiter's turn waits on its quota key's lock (held by another
    transaction) while a cancel of the waiter waits behind it. Whatever order
    they go in, the run ends cancelled, holds no slot, and the next waiter is
    admitted afterwards; no quota slot is leaked."""
    registry = Registry()
    quota = Quota("cq-pool", limit=1)
    registry.add("cq", "1", _body, quotas=[quota], singleton={"key": lambda i: i["k"]})
    engine = _engine(path, registry)
    engine.start("cq", {"k": "a", "hold": True}, run_id="H")
    engine.start("cq", {"k": "b", "hold": True}, run_id="W")
    engine.start("cq", {"k": "c"}, run_id="N")
    _drain(engine)
    # H settles: W is sent its turn; hold the quota key's lock before W claims it.
    engine.signal("H", "go")
    queued = _queue(engine)
    engine.execute(queued.popleft())
    assert list(queued) == ["W"], list(queued)
    queued.clear()
    ready, release = threading.Event(), threading.Event()
    locker = spawn(
        _lock_rows,
        ready,
        release,
        lambda: SingletonKey.objects.select_for_update().filter(workflow_name="quota:cq-pool"),
    )
    assert ready.wait(10)
    results: dict[str, Any] = {}

    def admit() -> None:
        results["admit"] = engine.execute("W")

    def cancel() -> None:
        time.sleep(0.3)
        results["cancel"] = engine.cancel("W").status

    t1 = spawn(admit)
    time.sleep(0.3)
    t2 = spawn(cancel)
    time.sleep(0.8)
    release.set()
    for t in (locker, t1, t2):
        t.join(20)
        assert not t.is_alive()
    for _ in range(4):
        _drain(engine)
        engine.tick()
    _drain(engine)
    w = engine.get("W")
    assert w.status == RunStatus.CANCELLED, (w, results)
    assert w.quota_slot is None
    assert not QuotaMembership.objects.filter(run_id="W", slot="holder").exists()
    assert engine.get("N").status == RunStatus.COMPLETED, results


def test_fast_and_orm_engines_on_the_same_quota_keys_never_over_admit_and_tokens_increase() -> None:
    """X3c, X3e, X3f, K1, S13: three fast and three ORM threads claim the same 30
    runs (a singleton of limit 2 and two quotas of 2 and 1 keys deep, plus a
    quota-only workflow), on the same keys: at no time more than the limit run
    in a quota key or a singleton key, each admission's token in each quota key
    is larger than every earlier one, and every run completes once."""
    seen = KeysInside()
    done = seen.done
    tokens: dict[str, list[int]] = {}

    def body(ctx: Any, input: dict[str, Any]) -> None:
        keys = [f"p:{input['p']}", f"o:{input['o']}"] + ([f"k:{input['k']}"] if "k" in input else [])
        seen.enter(keys)
        with seen.lock:
            for name, token in ctx.quota_tokens.items():
                key = input["p"] if name == "mx-pool" else input["o"]
                tokens.setdefault(f"{name}:{key}", []).append(token)
        threading.Event().wait(0.005)
        seen.leave(keys, ctx.run_id)

    registry = Registry()
    pool = Quota("mx-pool", key=lambda i: i["p"], limit=2)
    one = Quota("mx-one", key=lambda i: i["o"], limit=1)
    registry.add("mk", "1", body, singleton={"key": lambda i: i["k"], "limit": 2}, quotas=[pool, one])
    registry.add("mq", "1", body, quotas=[one, pool])
    stores = [DjangoStore(), DjangoStore(raw_sql=False)] * 3
    engines = [make_engine(s, registry=registry) for s in stores]
    ids = []
    for n in range(30):
        input = {"p": "ab"[n % 2], "o": "cd"[(n // 3) % 2]}
        if n % 3:
            input["k"] = "k"
        run = engines[n % 6].start("mk" if "k" in input else "mq", input, run_id=f"M{n:02d}")
        ids.append(run.run_id)
    for e in engines:
        _queue(e).clear()

    def worker(i: int) -> None:
        for _ in range(60):
            for run_id in ids[i::6] + ids:
                engines[i].execute(run_id)
                while _queue(engines[i]):
                    engines[i].execute(_queue(engines[i]).popleft())
            if len(done) >= len(ids):
                return
            engines[i].tick()

    results = run_threads(6, worker, timeout=120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert sorted(done) == sorted(ids)
    assert seen.most("p:") <= 2 and seen.most("o:") <= 1 and seen.most("k:") <= 2, seen.peak
    for key, seq in tokens.items():
        assert len(set(seq)) == len(seq), (key, seq)
    assert QuotaMembership.objects.filter(slot="holder").count() == 0
    connections.close_all()


@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path")
def test_the_fast_path_is_the_one_deciding_a_quota_admission() -> None:
    """X3i: the targeted tests above run the fast path on PostgreSQL (the
    quota_admit and quota_finish statements are sent), not an ORM fallback."""
    from django.test.utils import CaptureQueriesContext

    registry = Registry()
    registry.add("fp", "1", _body, quotas=[Quota("fp-pool", limit=1)], singleton={"key": lambda i: "k"})
    engine = _engine("fast", registry)
    with CaptureQueriesContext(connection) as queries:
        engine.start("fp", {}, run_id="F")
        _drain(engine)
    sql = " ".join(q["sql"] for q in queries.captured_queries)
    assert "quota_admit" in sql and "quota_finish" in sql
    assert engine.get("F").status == RunStatus.COMPLETED


@pytest.mark.parametrize("limit", ["quota", "singleton"])
def test_a_settle_whose_lease_expires_while_it_waits_on_the_quota_keys_lock_is_refused(path: str, limit: str) -> None:
    """R5, R5a, X3g: a holder's settle is a compare-and-set on its unexpired lease
    by the database's clock. Its handoff waits on its quota key's row (locked by
    another transaction once the body runs) past the end of its lease: when the
    lock is released the lease has expired, so the settle must be refused (a
    recovery may own the run by then), on the fast path as on the ORM path.
    ``singleton``: the same with a singleton key instead of a quota (the
    handoff of a run without quotas)."""
    registry = Registry()
    entered, ready = threading.Event(), threading.Event()

    def body(ctx: Any, input: dict[str, Any]) -> str:
        entered.set()
        assert ready.wait(10)  # the lock is taken: the settle will wait on it
        return "done"

    if limit == "quota":
        registry.add("ls", "1", body, quotas=[Quota("ls-pool", limit=1)])
        locked = "quota:ls-pool"
    else:
        registry.add("ls", "1", body, singleton={"key": lambda i: "k"})
        locked = "ls"
    engine = _engine(path, registry, LEASE_SECONDS=1.5, LEASE_RENEW_SECONDS=60)
    engine.start("ls", {}, run_id="L")
    _queue(engine).clear()

    def locker() -> None:
        assert entered.wait(10)
        with transaction.atomic():
            list(SingletonKey.objects.select_for_update().filter(workflow_name=locked))
            ready.set()
            time.sleep(2.5)  # past the lease's end

    thread = spawn(locker)
    outcome = engine.execute("L")
    thread.join(20)
    run = engine.get("L")
    assert run.status != RunStatus.COMPLETED, (outcome, run.status)
