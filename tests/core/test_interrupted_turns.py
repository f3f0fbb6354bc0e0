"""Interrupted turns at the points where a write landed and the next one did not.

The breaker of issue #12 aimed store failures between two writes of a turn:

* a child's row committed, then the parent's step record failed: the
  resumed parent finds the child by its deterministic id and starts no second
  one (R3, D7);
* a cancel landed while the body ran, then its step record failed: the
  hand-back sees the cancel and settles the run ``cancelled`` at once, so the
  slot goes to the next run now instead of after the lease (D6, S7). Before,
  the run was left ``running`` until its lease expired (30 s by default) and
  the tick's recovery settled it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection

from durable_singleton.definitions import Registry
from durable_singleton.models import Run
from durable_singleton.statuses import Outcome
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.helpers import backend_id, kill_backend


def _fail_next(base: type, method: str) -> Any:
    """A subclass of the store class ``base`` whose next call of ``method``
    raises ``ConnectionError`` once, when its ``armed`` is set."""

    def fail_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise ConnectionError("the store went away")
        return getattr(base, method)(self, *args, **kwargs)

    return type(f"FailNext_{method}_{base.__name__}", (base,), {"armed": False, method: fail_once})


#: The in-memory store whose next ``save_step`` raises ``ConnectionError`` once, when armed.
FailNextSaveMemoryStore = _fail_next(MemoryStore, "save_step")
#: The in-memory store whose next ``finish`` raises ``ConnectionError`` once, when armed.
FailNextFinishMemoryStore = _fail_next(MemoryStore, "finish")


def _kill_after_the_child_insert() -> None:
    """Kill this thread's connection from another one right after the next INSERT of a run."""
    backend = backend_id()

    def after_insert(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        head = sql.lstrip()
        # The INSERT as text, or the fast path's prepared start by name (PostgreSQL with prepare_threshold).
        if (head.upper().startswith("INSERT") and Run._meta.db_table in sql) or head.startswith("EXECUTE ds_start"):
            connection.execute_wrappers.remove(after_insert)
            kill_backend(backend)  # the child's row is committed (autocommit)
        return result

    connection.execute_wrappers.append(after_insert)


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_child_committed_before_its_parents_step_record_failed_is_started_once(store_kind: str) -> None:
    """R3, D7, R4: the child's row is written, then the store fails before the
    parent's record of it (on PostgreSQL/MariaDB: the parent's connection is
    killed by the server right after the child's INSERT). The parent is
    interrupted, resumes, finds its child by id and completes with it; one
    child exists and its body ran once."""
    if store_kind == "django" and connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to kill a connection; the memory variant runs the engine's path")
    store: Any = FailNextSaveMemoryStore() if store_kind == "memory" else "django"
    engine = make_engine(store, registry=Registry(), ADMISSION_RETRY_SECONDS=0.05)
    child_bodies: list[str] = []
    engine.registry.add("kid", "1", lambda ctx, input: child_bodies.append(ctx.run_id) or "kid-done")
    engine.registry.add_step("parent:arm", lambda _: True)

    def parent(ctx: Any, input: Any) -> Any:
        ctx.step("parent:arm")
        if ctx.run.attempts == 1:  # the first turn only
            if isinstance(engine.store, FailNextSaveMemoryStore):
                engine.store.armed = True
            else:
                _kill_after_the_child_insert()
        return ctx.call_child("kid", {"n": 1})

    engine.registry.add("parent", "1", parent, singleton={"key": lambda i: "p"})
    run = engine.start("parent", None, run_id="parent-1")
    assert engine.execute(run.run_id) == Outcome.INTERRUPTED
    connection.execute_wrappers.clear()
    assert engine.get(f"{run.run_id}:child:1").status == "pending", "the child's row was committed"
    for _ in range(20):
        if engine.get(run.run_id).is_terminal:
            break
        threading.Event().wait(0.06)
        engine.tick()
        engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.output) == ("completed", "kid-done")
    children = [r.run_id for r in engine.store.list_runs(workflow_name="kid")]
    assert children == [f"{run.run_id}:child:1"]
    assert child_bodies == children


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_cancel_that_landed_before_an_interruption_settles_at_once(store_kind: str) -> None:
    """D6, S7, F12: A is cancelled while its step runs, and the step's record
    fails (the store went away and came back). The turn ends interrupted, and
    the hand-back finds the cancel: A is cancelled now, its slot handed to B,
    which runs; A's step is never executed again."""
    store = FailNextSaveMemoryStore() if store_kind == "memory" else _FailNextSaveDjangoStore()
    engine = make_engine(store, registry=Registry(), LEASE_SECONDS=30.0)
    executions: list[str] = []

    def side_effect(run_id: str) -> str:
        executions.append(run_id)
        if run_id == "A":
            engine.cancel("A")
            store.armed = True
        return run_id

    engine.registry.add_step("cancel:side", side_effect)
    engine.registry.add(
        "cancelled", "1", lambda ctx, input: ctx.step("cancel:side", ctx.run_id), singleton={"key": lambda i: "k"}
    )
    engine.start("cancelled", None, run_id="A")
    engine.start("cancelled", None, run_id="B")
    assert engine.execute("A") == Outcome.INTERRUPTED
    a = engine.get("A")
    assert a.status == "cancelled", f"A is {a.status} until its lease expires at {a.lease_expires_at}"
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed"
    assert executions == ["A", "B"]


def _FailNextSaveDjangoStore() -> Any:  # noqa: N802 - a factory named as the class it builds
    from durable_singleton.stores.django import DjangoStore

    return _fail_next(DjangoStore, "save_step")()


def _kill_before_the_next_statement() -> None:
    """Kill this thread's connection from another one just before its next statement runs."""
    backend = backend_id()

    def before(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        connection.execute_wrappers.remove(before)
        kill_backend(backend)
        return execute(sql, params, many, context)

    connection.execute_wrappers.append(before)


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_settle_that_meets_an_unreachable_store_hands_the_run_back(store_kind: str) -> None:
    """R4, D4, S6: the body returned; its settle met a dead connection (on
    PostgreSQL/MariaDB the server killed it just before the settle's first
    statement). The turn ends interrupted like a failed store call inside the
    body: the run is handed back with its slot, not left running until its
    lease expires and counted as a recovery; resumed, it replays its stored
    step and completes. On PostgreSQL's fast path the connection is lost before
    any statement of the settle's message ran, so the store reopens it and sends
    the message again once (O1: a dropped connection is reopened, never fatal;
    72c7067): the turn then completes at once, its step run once, no recovery."""
    if store_kind == "django" and connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to kill a connection; the memory variant runs the engine's path")
    store: Any = FailNextFinishMemoryStore() if store_kind == "memory" else "django"
    engine = make_engine(store, registry=Registry(), ADMISSION_RETRY_SECONDS=0.05, LEASE_SECONDS=30.0)
    executions: list[int] = []
    engine.registry.add_step("settle:side", lambda n: executions.append(n) or n)

    def body(ctx: Any, input: Any) -> Any:
        result = ctx.step("settle:side", 5)
        if ctx.run.attempts == 1:
            if isinstance(engine.store, FailNextFinishMemoryStore):
                engine.store.armed = True
            else:
                _kill_before_the_next_statement()
        return result

    engine.registry.add("settle", "1", body, singleton={"key": lambda i: "k"})
    run = engine.start("settle", None, run_id="settle-1")
    outcome = engine.execute(run.run_id)
    connection.execute_wrappers.clear()
    if outcome == Outcome.COMPLETED and store_kind == "django" and connection.vendor == "postgresql":
        done = engine.get(run.run_id)
        assert (done.status, done.output, done.recoveries, done.attempts) == ("completed", 5, 0, 1)
        assert executions == [5]
        return
    assert outcome == Outcome.INTERRUPTED
    handed_back = engine.get(run.run_id)
    assert (handed_back.status, handed_back.admitted) == ("pending", True)
    threading.Event().wait(0.1)
    engine.tick()
    engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.output, done.recoveries) == ("completed", 5, 0)
    assert executions == [5]


class LostClaimReplyMemoryStore(MemoryStore):
    """The in-memory store whose next claim commits, then raises ``ConnectionError``
    (the reply lost on the way back), when armed."""

    armed = False

    def begin_turn(self, *args: Any, **kwargs: Any) -> Any:
        turn = super().begin_turn(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise ConnectionError("connection reset by peer")
        return turn


def test_a_claim_whose_reply_was_lost_hands_the_run_back() -> None:
    """R5a, D4, S6: the claim committed (the run is running, leased to this
    turn's owner, admitted) but its reply was lost. The turn ends
    ``interrupted`` and, the owner being this turn's, hands the run back with
    its slot, instead of leaving it leased to nobody alive until the lease
    expires and counting a recovery; it then completes with recoveries 0."""
    store = LostClaimReplyMemoryStore()
    engine = make_engine(store, registry=Registry(), ADMISSION_RETRY_SECONDS=0.05, LEASE_SECONDS=30.0)
    bodies: list[str] = []
    engine.registry.add(
        "claim", "1", lambda ctx, input: bodies.append(ctx.run_id) or "ok", singleton={"key": lambda i: "k"}
    )
    run = engine.start("claim", None, run_id="claim-1")
    store.armed = True
    assert engine.execute(run.run_id) == Outcome.INTERRUPTED
    handed_back = engine.get(run.run_id)
    assert (handed_back.status, handed_back.admitted, handed_back.lease_owner) == ("pending", True, None)
    threading.Event().wait(0.1)
    engine.tick()
    engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.recoveries, bodies) == ("completed", 0, ["claim-1"])


class LostChildrenReadMemoryStore(MemoryStore):
    """The in-memory store whose next ``children`` read raises ``ConnectionError``, when armed."""

    armed = False

    def children(self, run_id: str) -> Any:
        if self.armed:
            self.armed = False
            raise ConnectionError("connection reset by peer")
        return super().children(run_id)


def test_cancelling_a_cancelled_parent_again_cancels_the_children_its_first_cascade_missed() -> None:
    """D6: the parent's cancel settled it, then the read of its children failed
    (the store blinked), so the child ran on. The failure is logged, not
    raised (the tick's cascade job finishes it, tests/core/test_cancel_cascade.py,
    #18 item 14). The caller cancels the parent again: the parent stays as it
    is and the cascade is done now; before, a terminal parent was returned
    unchanged and the child was never cancelled."""
    store = LostChildrenReadMemoryStore()
    engine = make_engine(store, registry=Registry())
    engine.registry.add("kid", "1", lambda ctx, input: ctx.sleep(3600))
    engine.registry.add("parent", "1", lambda ctx, input: ctx.call_child("kid"))
    parent = engine.start("parent", None, run_id="parent-1")
    engine.dispatcher.drain()
    child_id = "parent-1:child:0"
    assert (engine.get(parent.run_id).status, engine.get(child_id).status) == ("suspended", "suspended")
    store.armed = True
    assert engine.cancel(parent.run_id).status == "cancelled"
    assert (engine.get(parent.run_id).status, engine.get(child_id).status) == ("cancelled", "suspended")
    assert engine.cancel(parent.run_id).status == "cancelled"
    assert engine.get(child_id).status == "cancelled"


class AlwaysRefusedMemoryStore(MemoryStore):
    """The in-memory store on which storing a step always loses the connection,
    as MariaDB answers a write past its packet limit."""

    def save_step(self, *args: Any, **kwargs: Any) -> bool:
        raise ConnectionError("Server has gone away")


def test_a_write_refused_every_time_ends_the_run_dead_not_in_an_endless_loop() -> None:
    """D4, R4: each turn's step write loses the connection. The run is handed
    back MAX_RECOVERIES times in a row, then left to its lease, whose
    recoveries are counted: it ends ``dead`` after a bounded number of turns,
    instead of executing its step every ADMISSION_RETRY_SECONDS without end."""
    engine = make_engine(
        AlwaysRefusedMemoryStore(),
        registry=Registry(),
        MAX_RECOVERIES=2,
        LEASE_SECONDS=0.3,
        LEASE_RENEW_SECONDS=0.1,
        ADMISSION_RETRY_SECONDS=0.02,
        REDELIVERY_SECONDS=0.05,
    )
    executions: list[int] = []
    engine.registry.add_step("refused:side", lambda n: executions.append(n) or n)
    engine.registry.add(
        "refused", "1", lambda ctx, input: ctx.step("refused:side", 1), singleton={"key": lambda i: "k"}
    )
    run = engine.start("refused", None, run_id="refused-1")
    engine.dispatcher.drain()
    assert engine.get(run.run_id).park_reason == "interrupted:1"
    deadline = time.monotonic() + 15
    while not engine.get(run.run_id).is_terminal and time.monotonic() < deadline:
        time.sleep(0.05)
        engine.tick()
        engine.dispatcher.drain()
    done = engine.get(run.run_id)
    assert (done.status, done.error["code"]) == ("dead", "max_recoveries"), (done.status, len(executions))
    assert len(executions) <= 2 * 2 + 2, f"the step ran {len(executions)} times"
