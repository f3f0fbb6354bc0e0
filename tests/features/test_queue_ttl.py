"""The queue TTL (X2, #20 item 2): ``Singleton(..., queue_ttl=seconds)``.

A waiter not admitted within ``queue_ttl`` seconds of its creation is ended
``cancelled`` with error code ``queue_ttl_expired`` by the tick, through a
compare-and-set that refuses a run admitted meanwhile (R5a); the slots its
key has free go to the waiters behind it (S7); the age is judged on the
store's clock (the database's, R5), never a process's own (R8). On the
in-memory store and on the DATABASE_URL database (SQLite, PostgreSQL,
MariaDB).

Time passes for a waiter by moving its ``created_at`` back (:func:`backdate`),
as if it had been started that much earlier; the store's clock is not moved.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F
from django.test import Client
from django.urls import reverse

from durable_singleton import signals
from durable_singleton.definitions import Registry, Singleton
from durable_singleton.definitions import registry as global_registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidWorkflowError
from durable_singleton.explain import ExplainState
from durable_singleton.records import RunRecord
from durable_singleton.stores.memory import MemoryStore
from tests.core.test_database_clock import step_clock
from tests.helpers import connected, store_method_replaced

TTL = 60.0
HOUR = 3600.0


def _declare(registry: Registry, log: list[str], *, limit: int = 1, ttl: float = TTL) -> None:
    def body(ctx: Any, input: dict[str, Any]) -> str:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        log.append(ctx.run_id)
        return str(ctx.run_id)

    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "limit": limit, "queue_ttl": ttl})


def backdate(engine: Engine, run_id: str, seconds: float) -> None:
    """Move run ``run_id``'s ``created_at`` back by ``seconds``: as if it had been
    waiting that much longer, by the store's clock, which is not moved."""
    shift = timedelta(seconds=seconds)
    store = engine.store
    if isinstance(store, MemoryStore):
        with store._lock:
            run = store._runs[run_id]
            store._runs[run_id] = run.evolve(created_at=run.created_at - shift)
        return
    from durable_singleton.models import Run

    assert Run.objects.filter(pk=run_id).update(created_at=F("created_at") - shift) == 1


def _holder_and_waiters(engine: Engine, *waiters: str) -> None:
    """H holds key K (parked on its signal, its slot held); ``waiters`` queue behind it."""
    engine.start("wf", {"k": "K", "hold": True}, run_id="H")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    for run_id in waiters:
        engine.start("wf", {"k": "K"}, run_id=run_id)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get("H").admitted
    assert all(not engine.get(w).admitted for w in waiters)


# -- declaration ------------------------------------------------------------------------


@pytest.mark.vendor_agnostic
@pytest.mark.parametrize("bad", [0, -1, -0.5, "30", True, False, math.nan, math.inf, -math.inf, 10**15, [30]], ids=repr)
def test_a_bad_queue_ttl_is_refused_at_declaration_and_nothing_is_registered(bad: Any) -> None:
    """X2, section 7: a queue_ttl that is not a finite number of seconds > 0
    (zero, negative, a string, a bool, NaN, infinite, too large for a
    duration, a list) raises InvalidWorkflowError naming the workflow and the
    field, as a mapping or a Singleton; no workflow is registered."""
    registry = Registry()
    for singleton in ({"key": lambda i: "K", "queue_ttl": bad}, Singleton(key=lambda i: "K", queue_ttl=bad)):
        with pytest.raises(InvalidWorkflowError, match=r"singleton\.queue_ttl") as raised:
            registry.add("ttl-wf", "1", lambda ctx, i: None, singleton=singleton)
        assert "ttl-wf" in str(raised.value)
    assert registry.workflows == {} and registry.latest == {}


@pytest.mark.vendor_agnostic
def test_a_good_queue_ttl_is_accepted_as_seconds() -> None:
    """X2: an int or float > 0 is a TTL in seconds; None (the default) is none."""
    registry = Registry()
    registry.add("a", "1", lambda ctx, i: None, singleton={"key": lambda i: "K", "queue_ttl": 30})
    registry.add("b", "1", lambda ctx, i: None, singleton=Singleton(key=lambda i: "K", queue_ttl=0.25))
    registry.add("c", "1", lambda ctx, i: None, singleton={"key": lambda i: "K"})
    assert registry.queue_ttls() == {"a": 30.0, "b": 0.25}


# -- expiry -----------------------------------------------------------------------------


def test_a_waiter_past_its_queue_ttl_ends_cancelled_with_the_code(engine: Engine, registry: Registry) -> None:
    """X2, S7, D6: behind the holder H, W1 outlives the TTL and W2 does not;
    the tick ends W1 ``cancelled`` with code ``queue_ttl_expired`` (the
    run_finished signal fires for it), leaves W2 and H alone, and H's
    release admits W2, never W1."""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, "W1", "W2")
    finished: list[RunRecord] = []

    def receiver(sender: Any, run: RunRecord, **kwargs: Any) -> None:
        finished.append(run)

    with connected(receiver, signals.run_finished):
        backdate(engine, "W1", TTL + 1)
        report = engine.tick()
    assert report.expired == ["W1"] and report.errors == []
    w1 = engine.get("W1")
    assert w1.status == "cancelled" and not w1.admitted and w1.error["code"] == "queue_ttl_expired"
    assert [r.run_id for r in finished] == ["W1"] and finished[0].status == "cancelled"
    assert engine.get("H").admitted and not engine.get("W2").admitted and engine.get("W2").status != "cancelled"
    assert engine.tick().expired == []  # ended once
    engine.signal("H", "go")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["H", "W2"] and engine.get("W2").status == "completed"


def test_a_waiter_admitted_between_the_sweeps_read_and_write_is_left_alone(engine: Engine, registry: Registry) -> None:
    """X2, R5a, S7: the tick reads W as past its TTL; before it writes, H
    settles and a grant admits W, whose turn is not yet taken (W is parked,
    holding the slot); the sweep's compare-and-set on a parked waiter then
    writes nothing: W keeps its slot, is not cancelled, and runs. (With the
    waiter condition left out of the compare-and-set, W ends cancelled while
    it holds the slot.) The engine's grants skip a waiter past its TTL (see
    the tests below), so the grant here is the store's, called with no TTLs,
    as a caller that passes none (or a database clock stepped back) leaves it."""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, "W")
    backdate(engine, "W", TTL + 1)
    real = engine.store.expired_waiters

    def read_then_admit(ttls: Any, batch: int) -> list[RunRecord]:
        stale = real(ttls, batch)
        assert [r.run_id for r in stale] == ["W"]
        done = engine.store.finish(engine.get("H"), None, "completed", limits=engine.limits())  # no ttls
        assert [g.run_id for g in done.granted] == ["W"]  # its handoff admits W (S7)
        assert engine.get("W").admitted and engine.get("W").is_parked
        engine.dispatcher.dispatch("W")
        return stale

    with store_method_replaced(engine, "expired_waiters", read_then_admit):
        report = engine.tick()
    assert report.expired == [] and report.errors == []
    assert engine.get("W").admitted and engine.get("W").status != "cancelled"
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    w = engine.get("W")
    assert w.status == "completed" and w.error is None and log == ["W"]  # H was settled by the store


def test_a_waiter_admitted_but_not_yet_run_is_never_expired(engine: Engine, registry: Registry) -> None:
    """X2, R5a: W was admitted (granted H's slot, its turn not taken yet) and is
    older than the TTL: it holds a slot, so the tick neither reads nor ends it."""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, "W")
    engine.signal("H", "go")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert engine.execute("H") == "completed"  # its handoff admits W
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # W's turn is lost
    assert engine.get("W").admitted and engine.get("W").is_parked  # a parked holder: its slot is held
    backdate(engine, "W", TTL + 1)
    assert engine.store.expired_waiters(engine.queue_ttls(), 10) == []
    assert engine.tick().expired == []
    assert engine.get("W").admitted and engine.get("W").status != "cancelled"


def _end_without_handoff(engine: Engine, run_id: str) -> None:
    """End holder ``run_id`` with no handoff of its slot, as a lost one leaves
    the key (a free slot and waiters; the catch-up's case, S8a)."""
    store = engine.store
    if isinstance(store, MemoryStore):
        with store._lock:
            run = store._runs[run_id]
            store._runs[run_id] = run.evolve(status="completed", admitted=False, tracked=False)
        return
    from durable_singleton.models import Run

    Run.objects.filter(pk=run_id).update(status="completed", singleton_slot=None, singleton_tracked=False)


def test_the_next_waiter_behind_an_expired_one_takes_a_free_slot(engine: Engine, registry: Registry) -> None:
    """X2, S7, S8a: the key has a free slot (its holder ended and the handoff
    was lost) and the waiters W1 (past its TTL) and W2; the tick ends W1 and,
    in the same write, grants the slot to W2, which runs: the expired W1 takes
    no slot and blocks no one (the TTL job runs before the catch-up)."""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, "W1", "W2")
    _end_without_handoff(engine, "H")
    backdate(engine, "W1", TTL + 1)
    report = engine.tick()
    assert report.expired == ["W1"]
    assert "W1" not in report.caught_up and engine.get("W1").error["code"] == "queue_ttl_expired"
    assert engine.get("W2").admitted
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["W2"] and engine.get("W2").status == "completed"


# -- no grant reaches a waiter past its TTL ------------------------------------------------


@pytest.mark.parametrize("behind", [True, False], ids=["next-waiter", "no-next-waiter"])
def test_a_handoff_never_admits_a_waiter_past_its_ttl_even_before_a_tick(
    engine: Engine, registry: Registry, behind: bool
) -> None:
    """X2, S7, R5a: W1's TTL passes while H holds the slot and no tick runs;
    H's handoff does not admit W1 (it stays a waiter, not cancelled) but the
    next unexpired waiter W2, which runs; with no W2 the slot stays free and
    W1's body never runs. The next tick ends W1 ``queue_ttl_expired``. (With
    the handoff reading no TTL, it admits W1 and W1's body runs.)"""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, *(["W1", "W2"] if behind else ["W1"]))
    backdate(engine, "W1", TTL + 1)
    engine.signal("H", "go")
    engine.dispatcher.drain()  # type: ignore[attr-defined]  # H completes and hands off; no tick
    w1 = engine.get("W1")
    assert engine.get("H").status == "completed"
    assert not w1.admitted and w1.is_parked and w1.status != "cancelled"
    if behind:
        assert log == ["H", "W2"] and engine.get("W2").status == "completed"
    else:
        assert log == ["H"]
        assert [r.run_id for r in engine.store.active_runs_for_key("wf", "K") if r.admitted] == []
    assert engine.tick().expired == ["W1"]
    w1 = engine.get("W1")
    assert w1.status == "cancelled" and not w1.admitted and w1.error["code"] == "queue_ttl_expired"
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert "W1" not in log


@pytest.mark.parametrize("behind", [True, False], ids=["next-waiter", "no-next-waiter"])
def test_a_waiter_past_its_ttl_is_not_admitted_by_its_own_claim(
    engine: Engine, registry: Registry, behind: bool
) -> None:
    """X2, S5, R5a: the key has a free slot (its holder ended, the handoff
    lost) and W1 is past its TTL; W1's own turn claims before any tick: it is
    parked, not admitted, and its body does not run; the claim grants the
    free slot to the unexpired W2 behind it, which runs; with no W2 the slot
    stays free. The next tick ends W1 ``queue_ttl_expired``. (With the claim
    reading no TTL, W1 is admitted and runs.)"""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, *(["W1", "W2"] if behind else ["W1"]))
    _end_without_handoff(engine, "H")
    backdate(engine, "W1", TTL + 1)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert engine.execute("W1") == "parked"
    w1 = engine.get("W1")
    assert not w1.admitted and w1.is_parked and w1.status != "cancelled"
    if behind:
        assert engine.get("W2").admitted
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == (["W2"] if behind else [])
    if not behind:
        assert [r.run_id for r in engine.store.active_runs_for_key("wf", "K") if r.admitted] == []
    assert engine.tick().expired == ["W1"]
    assert engine.get("W1").error["code"] == "queue_ttl_expired" and "W1" not in log


def test_the_sweep_ends_many_waiters_in_batches_oldest_first(engine: Engine, registry: Registry) -> None:
    """X2, S8b: with TICK_BATCH 2, five expired waiters end two per tick, oldest first."""
    log: list[str] = []
    _declare(registry, log)
    waiters = [f"W{n}" for n in range(5)]
    _holder_and_waiters(engine, *waiters)
    for run_id in waiters:
        backdate(engine, run_id, TTL + 1)
    engine.settings = dataclasses.replace(engine.settings, TICK_BATCH=2)
    ended = [engine.tick().expired for _ in range(3)]
    assert ended == [["W0", "W1"], ["W2", "W3"], ["W4"]]


def test_a_delayed_start_counts_its_ttl_from_its_creation(engine: Engine, registry: Registry) -> None:
    """X2, X5: a run started with not_before an hour ahead and a TTL of a minute
    ends ``queue_ttl_expired`` once a minute has passed since its creation,
    though it was never due: the TTL counts from creation, not from not_before.
    Before that, explain says when it expires."""
    log: list[str] = []
    _declare(registry, log)
    engine.start("wf", {"k": "K"}, run_id="D", not_before=HOUR)
    explained = engine.explain("D")
    assert explained.state is ExplainState.NOT_DUE and explained.queue_ttl == TTL
    assert explained.expires_in_seconds is not None and 0 < explained.expires_in_seconds <= TTL
    assert "expires in" in explained.sentence
    assert engine.tick().expired == []
    backdate(engine, "D", TTL + 1)
    assert engine.tick().expired == ["D"]
    d = engine.get("D")
    assert d.status == "cancelled" and d.error["code"] == "queue_ttl_expired" and log == []


# -- the clock (R5, R8) --------------------------------------------------------------------


def test_a_stepped_process_clock_does_not_move_expiry(make: Callable[..., Engine], registry: Registry) -> None:
    """X2, R5, R8: the ticking process's clock steps an hour ahead (past the
    TTL): the waiter W, a second old by the store's clock, is not ended and
    explain gives it nearly the whole TTL; a waiter started by a process
    whose clock stepped an hour back is created on the store's clock, so no
    tick ends it early; once W is past its TTL by the store's clock, it ends."""
    log: list[str] = []
    _declare(registry, log)
    ahead, behind = make(), make()
    _holder_and_waiters(ahead, "W")
    step_clock(ahead, timedelta(hours=1))
    step_clock(behind, timedelta(hours=-1))
    behind.start("wf", {"k": "K"}, run_id="B")
    assert ahead.tick().expired == [] and behind.tick().expired == []
    for engine in (ahead, behind):
        left = engine.explain("W").expires_in_seconds
        assert left is not None and TTL - 30 < left <= TTL, left
    backdate(ahead, "W", TTL + 1)
    assert ahead.tick().expired == ["W"]
    assert ahead.get("B").status == "pending" and not ahead.get("B").admitted


# -- explain and the admin -------------------------------------------------------------------


def test_explain_gives_a_waiters_remaining_time_and_none_for_a_holder(engine: Engine, registry: Registry) -> None:
    """X2, K3: a waiter's explanation carries its TTL, when it expires and the
    seconds left by the store's clock, in words too; past its TTL it says the
    tick ends it; a holder has none."""
    log: list[str] = []
    _declare(registry, log)
    _holder_and_waiters(engine, "W")
    waiter = engine.explain("W")
    assert waiter.state is ExplainState.WAITER and waiter.queue_ttl == TTL
    assert waiter.expires_in_seconds is not None and TTL - 30 < waiter.expires_in_seconds <= TTL
    assert waiter.expires_at == engine.get("W").created_at + timedelta(seconds=TTL)
    assert re.search(r"expires in \d+ s unless admitted first", waiter.sentence), waiter.sentence
    assert waiter.as_dict()["expires_at"] == waiter.expires_at.isoformat()
    holder = engine.explain("H")
    assert holder.queue_ttl is None and holder.expires_in_seconds is None and "expires" not in holder.sentence
    backdate(engine, "W", TTL + 1)
    late = engine.explain("W")
    assert late.expires_in_seconds is not None and late.expires_in_seconds < 0
    assert "the tick ends it cancelled (queue_ttl_expired)" in late.sentence


def test_explain_never_calls_a_waiter_past_its_ttl_runnable(engine: Engine, registry: Registry) -> None:
    """X2, K3: a waiter past its queue_ttl whose key has a free slot is first in line, but
    no claim or grant admits it (the tick ends it): explain says it will not run, with
    the state of a waiter, not that it could run now. Before, it said both (found by a
    tester: state ``runnable`` and "could run now ... no grant admits it meanwhile")."""
    _declare(registry, [])
    engine.start("wf", {"k": "free"}, run_id="T")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # its turn never came
    backdate(engine, "T", TTL + 1)
    late = engine.explain("T")
    assert late.state is ExplainState.WAITER, (late.state, late.sentence)
    assert "will not run" in late.sentence and "could run now" not in late.sentence, late.sentence
    assert "the tick ends it cancelled (queue_ttl_expired)" in late.sentence


ADMIN_WF = "test-queue-ttl-admin"


@pytest.fixture
def admin_workflow() -> Iterator[Engine]:
    """A workflow with a queue_ttl in the process registry the admin reads, removed after."""
    from durable_singleton.testing import make_engine

    def body(ctx: Any, input: Any) -> None:
        ctx.wait_for_signal("go")

    global_registry.add(ADMIN_WF, "1", body, singleton={"key": lambda i: "K", "queue_ttl": TTL})
    try:
        yield make_engine("django")
    finally:
        global_registry.workflows.pop((ADMIN_WF, "1"), None)
        global_registry.latest.pop(ADMIN_WF, None)


@pytest.mark.django_db(transaction=True)
def test_the_admin_key_and_run_pages_show_a_waiters_remaining_time(
    admin_client: Client, admin_workflow: Engine
) -> None:
    """X2, K3: the key page's waiter row and the waiter's run page say
    "expires in ..." by the database's clock; the holder's do not."""
    engine = admin_workflow
    engine.start(ADMIN_WF, {}, run_id="H")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.start(ADMIN_WF, {}, run_id="W")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    key_page = admin_client.get(reverse("admin:durable_singleton_run_queue_key"), {"workflow": ADMIN_WF, "key": "K"})
    waiters = key_page.context["waiters"]
    assert [w["run"].run_id for w in waiters] == ["W"] and waiters[0]["expiry"].startswith("expires in ")
    assert [h["expiry"] for h in key_page.context["holders"]] == [""]
    assert "ds-expiry" in key_page.content.decode()

    def page_text(run_id: str) -> str:
        html = admin_client.get(reverse("admin:durable_singleton_run_change", args=[run_id])).content.decode()
        return re.sub(r"<[^>]+>", "", html)

    assert re.search(r"\(expires in \d+(\.\d)? s\)", page_text("W")), "no remaining time on the waiter's page"
    assert "expires in" not in page_text("H")
