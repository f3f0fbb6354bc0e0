"""The PostgreSQL fast path of runs that carry quotas (#20, X3i): a start with
its memberships, a quota waiter's admission (in its claim message) and its
handoff, one message each.

On PostgreSQL these tests count the round trips, compare the fast path's
decisions with the ORM path's (``DjangoStore(raw_sql=False)``) step by step on
random schedules, and race fast and ORM claims over crossing quota keys with
the server's deadlock counter watched. The differential and racing tests run
on every database of the suite (the two stores are the ORM path there, the
test still checks the invariants); the round-trip counts are PostgreSQL's.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from django.db import connection

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import KeysInside, execute_racing, room_engine, seeds
from tests.helpers import round_trips as _round_trips

pytestmark = pytest.mark.django_db(transaction=True)

postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path")


def _holding(ctx: Any, input: dict[str, Any]) -> dict[str, int]:
    """Wait for the signal ``go`` when the input says ``hold``; return the run's quota tokens."""
    if input.get("hold"):
        ctx.wait_for_signal("go")
    return ctx.quota_tokens


def _registry() -> Registry:
    registry = Registry()
    pool = Quota("fpq-pool", key=lambda i: i.get("p", "p"), limit=2)
    other = Quota("fpq-other", key=lambda i: i.get("o", "o"), limit=1)
    registry.add("fpq-keyed", "1", _holding, singleton={"key": lambda i: i["k"]}, quotas=[pool])
    registry.add("fpq-only", "1", _holding, quotas=[pool])
    registry.add("fpq-two", "1", _holding, quotas=[other, pool])
    return registry


@pytest.fixture
def engine() -> Engine:
    return room_engine(_registry())  # its clock read once here, not counted below


@postgresql_only
def test_a_run_with_a_singleton_and_a_quota_costs_three_round_trips_on_postgresql(engine: Engine) -> None:
    """X3i, S5, S7, R5a: on an idle key a run that carries a singleton key and a
    quota costs its start (the run and its membership in one INSERT), its claim
    message (its quota keys, its singleton key and its row locked in the lock
    order, then its admission decided, X3e) and its handoff: three round trips,
    as a run without quotas; no BEGIN or COMMIT, no read of its (absent) steps.
    The ORM path took 35."""
    started: list[str] = []

    def one() -> None:
        started.append(engine.start("fpq-keyed", {"k": "K"}).run_id)  # a generated id: no existence check (R3)
        engine.dispatcher.drain()  # type: ignore[attr-defined]

    sql = _round_trips(one)
    run = engine.get(started[0])
    assert run.status == RunStatus.COMPLETED and run.output == {"fpq-pool": 1}
    assert len(sql) == 3, sql
    assert "start_keyed_quotas" in sql[0] and "claim_quota_admit" in sql[1] and "quota_finish" in sql[2], sql
    assert not any(s.strip().upper() in ("BEGIN", "COMMIT") for s in sql), sql
    assert not any("durable_singleton_step" in s for s in sql), "the steps were read"


@postgresql_only
def test_a_quota_handoff_costs_three_round_trips_a_waiter_on_postgresql(engine: Engine) -> None:
    """X3g, X3h, S7: a waiter behind a quota holder costs its start, its share of
    the holder's handoff (one message that settles, frees every slot and admits
    it: the handoff holds the lock of its only limit), its confirmation (one
    compare-and-set that returns its quota tokens) and its own handoff: as a run
    without quotas, whose handoff grants the next waiter (S7). Run as a Celery
    worker runs a turn (``execute_chain``: the waiter admitted runs next on the
    same thread)."""
    engine.start("fpq-only", {"hold": True}, run_id="h")
    engine.start("fpq-only", {"hold": True}, run_id="h2")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.start("fpq-only", {}, run_id="w")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("w").quota_slot == "waiter" and engine.get("w").status == RunStatus.SUSPENDED
    engine.signal("h", "go")  # the holder's own turns are not counted below
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    holder_turn = queued.popleft()
    sql = _round_trips(lambda: engine.execute_chain(holder_turn))  # h resumes and settles, then w runs
    assert engine.get("h").status == RunStatus.COMPLETED
    assert engine.get("w").status == RunStatus.COMPLETED and engine.get("w").output == {"fpq-pool": 3}
    assert not queued, list(queued)
    names = [next((n for n in ("claim_quota_admit", "take_quota", "quota_finish") if n in q), q[:40]) for q in sql]
    assert names[-3:] == ["quota_finish", "take_quota", "quota_finish"], names  # h's handoff admits w
    assert names.count("claim_quota_admit") == 1, names  # h's own claim message; w needs none


def _snapshot(engine: Engine, ids: list[str]) -> list[tuple[Any, ...]]:
    out = []
    for run_id in ids:
        run = engine.get(run_id)
        out.append((run.status, run.admitted, run.quota_slot, run.fencing_token, run.quota_tokens, run.attempts))
    return out


@pytest.mark.parametrize("seed", seeds(6))
def test_the_fast_path_decides_as_the_orm_path_on_random_schedules(seed: int) -> None:
    """X3c, X3d, X3f, X3g, X3h, S5, S7, K1: the same random schedule of starts
    (three workflows over a quota of 2, one also on a singleton key, one also on
    a second quota of 1), turns taken in a random order, and signals that let
    holders settle, run once on the fast path and once on the ORM path (on
    fresh keys): after every step both have the same runs in the same states,
    slots and tokens, and the same turns queued. Elsewhere than PostgreSQL both
    engines take the ORM path and the test checks the ORM against itself."""
    registry = _registry()
    engines = {
        "fast": make_engine(DjangoStore(), registry=registry),
        "orm": make_engine(DjangoStore(raw_sql=False), registry=registry),
    }
    rng = random.Random(seed)
    ids: list[str] = []
    for step in range(60):
        op = rng.random()
        if op < 0.35 or not ids:
            workflow = rng.choice(["fpq-keyed", "fpq-only", "fpq-two"])
            input = {"k": rng.choice("ab"), "p": rng.choice("xy"), "hold": rng.random() < 0.4}
            ids.append(f"{seed}-{len(ids):02d}")
            for name, e in engines.items():
                e.start(
                    workflow,
                    {**input, "k": f"{name}{input['k']}", "p": f"{name}{input['p']}", "o": f"{name}o"},
                    run_id=f"{name}-{ids[-1]}",
                )
        elif op < 0.8:
            queues = {name: e.dispatcher.queue for name, e in engines.items()}  # type: ignore[attr-defined]
            if not queues["fast"]:
                continue
            index = rng.randrange(len(queues["fast"]))
            for name, e in engines.items():
                turn = queues[name][index]
                del queues[name][index]
                e.execute(turn)
        else:
            runs = [(i, engines["fast"].get(f"fast-{i}")) for i in ids]
            holding = [i for i, r in runs if r.status == RunStatus.SUSPENDED and r.quota_slot == "holder"]
            if not holding:
                continue
            chosen = rng.choice(holding)
            for name, e in engines.items():
                e.signal(f"{name}-{chosen}", "go")
        fast = _snapshot(engines["fast"], [f"fast-{i}" for i in ids])
        orm = _snapshot(engines["orm"], [f"orm-{i}" for i in ids])
        assert fast == orm, f"step {step}"
        queued = {name: [t.split("-", 1)[1] for t in e.dispatcher.queue] for name, e in engines.items()}  # type: ignore[attr-defined]
        assert queued["fast"] == queued["orm"], f"step {step}"
    assert any(s[0] == RunStatus.COMPLETED for s in _snapshot(engines["fast"], [f"fast-{i}" for i in ids]))


def test_fast_and_orm_claims_over_crossing_quota_keys_never_deadlock_or_over_admit() -> None:
    """X3d, X3e, S13: four threads, two on the fast path and two on the ORM
    path, claim 24 runs of workflows carrying two quotas each (a pool of 2 and a
    second quota of 1 on two keys) at once: the quota keys are locked in one
    global order on both paths, so the server's deadlock counter does not move,
    no more than the limit run inside a quota key, and every run completes once."""
    seen = KeysInside()
    done = seen.done

    def body(ctx: Any, input: dict[str, Any]) -> None:
        keys = [f"pool:{input['p']}", f"other:{input['o']}"]
        seen.enter(keys)
        threading.Event().wait(0.01)
        seen.leave(keys, ctx.run_id)

    registry = Registry()
    pool = Quota("fpq-pool", key=lambda i: i["p"], limit=2)
    other = Quota("fpq-other", key=lambda i: i["o"], limit=1)
    registry.add("x", "1", body, quotas=[pool, other])
    registry.add("y", "1", body, quotas=[other, pool], singleton={"key": lambda i: i["p"], "limit": 2})
    stores = [DjangoStore(), DjangoStore(raw_sql=False), DjangoStore(), DjangoStore(raw_sql=False)]
    engines = [make_engine(s, registry=registry) for s in stores]
    ids = []
    for n in range(24):
        run = engines[n % 4].start("xy"[n % 2], {"p": "ab"[n % 2], "o": "cd"[(n // 2) % 2]}, run_id=f"X{n}")
        ids.append(run.run_id)
    for e in engines:
        e.dispatcher.queue.clear()  # type: ignore[attr-defined]

    def deadlocks() -> int:
        if connection.vendor != "postgresql":
            return 0
        time.sleep(1.0)  # the threads' backends have exited: their counts are flushed
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            return int(cursor.fetchone()[0])

    before = deadlocks()

    execute_racing(engines, ids, done)
    assert sorted(done) == sorted(ids)
    assert seen.most("pool:") <= 2
    assert seen.most("other:") <= 1
    assert all(engines[0].get(r).status == RunStatus.COMPLETED for r in ids)
    assert deadlocks() == before


def test_a_handoff_without_quotas_sends_a_turn_to_a_waiter_that_carries_them() -> None:
    """X3h, S7: a release that added a quota to a singleton workflow; the older
    release's holder (no quota) settles while a newer run that carries the quota
    waits on the same singleton key. The handoff grants it no slot (its own claim
    decides under the locks of all its limits) but sends it its turn at once: on
    PostgreSQL's fast path as on the ORM path. Before, the fast path passed over
    it, and it waited for its retry delay."""
    old, new = Registry(), Registry()
    old.add("fpq-mv", "1", _holding, singleton={"key": lambda i: i["k"]})
    new.add("fpq-mv", "1", _holding, singleton={"key": lambda i: i["k"]}, quotas=[Quota("fpq-mv", limit=1)])
    before, after = make_engine(DjangoStore(), registry=old), make_engine(DjangoStore(), registry=new)
    before.start("fpq-mv", {"k": "K", "hold": True}, run_id="old")
    before.dispatcher.drain()  # type: ignore[attr-defined]
    after.start("fpq-mv", {"k": "K"}, run_id="new")
    after.dispatcher.drain()  # type: ignore[attr-defined]
    assert after.get("new").status == RunStatus.SUSPENDED and after.get("new").quota_slot == "waiter"
    before.signal("old", "go")
    queued = before.dispatcher.queue  # type: ignore[attr-defined]
    before.execute(queued.popleft())
    assert before.get("old").status == RunStatus.COMPLETED
    assert list(queued) == ["new"], "the waiter that carries quotas was sent no turn"
    assert not after.get("new").admitted, "a grant admitted a run that carries quotas on its own (X3h)"
    after.execute(queued.popleft())
    assert after.get("new").status == RunStatus.COMPLETED and after.get("new").output == {"fpq-mv": 1}


@postgresql_only
def test_the_claim_message_admits_a_quota_waiter_only_under_its_quota_keys_locks() -> None:
    """X3e, S13, R5a (as tests/stores/test_pg_claim_message.py for the singleton key):
    each statement of the claim message takes its own snapshot, so a run that
    became a quota waiter between the statement that locks its quota keys and
    the one that admits it (a retry's reset committing in between) must not be
    admitted or parked: the admission writes only when the lock statement
    recorded every quota key of the claimant as locked by this transaction
    (``pg.CLAIM_QUOTA_LOCKED``). Another connection resets a failed quota run
    and fails it again, over and over, while this one sends its claim message."""
    import json

    from django.db import connections

    from durable_singleton.models import QuotaMembership, Run
    from durable_singleton.stores import pg

    registry = Registry()
    registry.add("fpq-flip", "1", lambda ctx, i: None, quotas=[Quota("fpq-flip", limit=1)])
    engine = make_engine(DjangoStore(), registry=registry)
    engine.start("fpq-flip", {}, run_id="X")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

    def fail() -> None:
        Run.objects.filter(pk="X").update(status="failed", quota_slot=None, lease_owner=None)
        QuotaMembership.objects.filter(run_id="X").update(slot=None)

    fail()
    stop = threading.Event()

    def flip() -> None:
        try:
            while not stop.is_set():
                engine.store.reset_for_retry("X", 5.0, None)
                fail()
        finally:
            connections.close_all()

    params = {
        "run_id": "X",
        "limits": json.dumps({n: int(v) for n, v in engine.limits().items() if v is not None}),
        "ttls": "{}",
        "owner": "probe",
        "lease": 30.0,
        "recovered": 0,
        "redelivery": 5.0,
        "front": 1.0,
        "backlog": 5.0,
    }
    fast = engine.store._fast()  # type: ignore[attr-defined]
    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    unlocked, locked_writes, claims = 0, 0, 0
    deadline = time.monotonic() + 6.0
    try:
        while time.monotonic() < deadline and not unlocked:
            claims += 1
            if claims % 2:
                engine.store.reset_for_retry("X", 5.0, None)  # a candidate: a locked admission is expected
            results: dict[str, list[Any]] = {}
            with connection.cursor() as cursor:
                fast._send(cursor, pg.CLAIM_MESSAGE, params)
                for n, statement in enumerate(pg.CLAIM_MESSAGE.statements):
                    if n:
                        cursor.nextset()
                    label = statement.name.rsplit("_", 1)[0]
                    results[label] = list(cursor.fetchall()) if cursor.description is not None else []
            if results["ds_claim_quota_admit"] and not results["ds_claim_lock_quota_keys"]:
                unlocked += 1
            elif results["ds_claim_quota_admit"]:
                locked_writes += 1
            fail()
    finally:
        stop.set()
        flipper.join(10)
    assert not unlocked, f"the claim message wrote without its quota keys' locks ({locked_writes} locked writes)"
    assert locked_writes, "no claim message admitted the run: the test proved nothing"


@postgresql_only
def test_the_claim_message_locks_quota_keys_in_the_orm_paths_order() -> None:
    """X3e: the claim message takes a run's quota keys from its memberships and
    locks them in ``COLLATE "C"`` order, the ORM path in Python's sorted order:
    the two must be one order, or a fast claim and an ORM claim could each hold
    a key the other waits for. Quota names in mixed case and outside ASCII."""
    from durable_singleton.admission import quota_lock_name
    from durable_singleton.stores import pg

    names = ["zeta", "Zeta", "émile", "Ωmega", "a-b", "a_b", "😀", "ẞ", "10", "9"]
    registry = Registry()
    registry.add("fpq-order", "1", lambda ctx, i: None, quotas=[Quota(n, limit=1) for n in names])
    engine = make_engine(DjangoStore(), registry=registry)
    engine.start("fpq-order", {}, run_id="O")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT qu.wf FROM {pg._MEMBER_KEYS} ORDER BY qu.n", {"run_id": "O"})
        locked = [row[0] for row in cursor.fetchall()]
    assert locked == [quota_lock_name(n) for n, _ in sorted((n, "*") for n in names)]
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("O").status == RunStatus.COMPLETED


@postgresql_only
def test_a_quota_holder_resumes_with_one_compare_and_set_on_postgresql(engine: Engine) -> None:
    """X3f, S6, R5a: a quota holder parked on a signal resumes with its claim
    message and one compare-and-set that returns its quota tokens (no key's
    lock): its body sees the tokens it was admitted with. The ORM path took a
    transaction that locked every quota key."""
    engine.start("fpq-two", {"hold": True, "p": "P", "o": "O"}, run_id="t")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("t").status == RunStatus.SUSPENDED and engine.get("t").quota_slot == "holder"
    engine.signal("t", "go")
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    sql = _round_trips(lambda: engine.execute(queued.popleft()))
    assert engine.get("t").status == RunStatus.COMPLETED
    assert engine.get("t").output == {"fpq-other": 1, "fpq-pool": 1}
    # The claim: its message (no candidate: the run holds its slots), then the compare-and-set.
    assert "claim_lock_quota_keys" in sql[0] and "take_quota" in sql[1], sql
    assert "durable_singleton_singletonkey" not in sql[1], "the confirmation locked a key"
