"""The ORM path's short cuts on every database (#32 item 1 and 2): a start reads the
database's clock, the key's override and its queue's depth in one statement; a run
claimed with no stored step reads no steps; a settle locks its key's row with one
statement on MySQL/MariaDB and SQLite (R4, R8, S8a, S13, K2).

On PostgreSQL the store is built with ``raw_sql=False`` so that the ORM path is the
one measured; the rules the statements follow are checked by the conformance suite
(tests/test_conformance.py) and the model-based tests on every database.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import SingletonKey
from durable_singleton.statuses import ParkReason, RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.django_db(transaction=True)

_STEP_TABLE = "durable_singleton_step"
_KEY_TABLE = "durable_singleton_singletonkey"


def _statements(fn: Callable[[], Any]) -> list[str]:
    """The statements ``fn`` sent on this thread's connection, transaction control left out."""
    with CaptureQueriesContext(connection) as queries:
        fn()
    sent = [q["sql"] for q in queries.captured_queries]
    return [s for s in sent if s.strip().upper().split(" ")[0] not in ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT")]


@pytest.fixture
def engine() -> Engine:
    registry = Registry()

    def keyed(ctx: Any, i: dict[str, Any]) -> None:
        if i.get("park"):
            ctx.wait_for_signal("go")

    registry.add("short-keyed", "1", keyed, singleton={"key": lambda i: i["k"]})
    return make_engine(DjangoStore(raw_sql=False), registry=registry)


def _drain(engine: Engine) -> None:
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    while queued:
        engine.execute_chain(queued.popleft())


def test_a_start_reads_the_clock_the_override_and_the_depth_in_one_statement(engine: Engine) -> None:
    """A keyed start on the ORM path is one read (the database's clock, R8; the key's
    override, K2; the depth of its queue, S8a) and its INSERT: no separate clock read."""
    engine.now()  # the engine's clock reads the database's now every few minutes, not per start
    sent = _statements(lambda: engine.start("short-keyed", {"k": "one-read"}))
    assert len(sent) == 2, sent
    assert sent[-1].lstrip().upper().startswith("INSERT"), sent


def test_a_start_on_a_deep_queue_counts_with_the_keys_override(engine: Engine) -> None:
    """S8a, K2: the depth is judged against the limit in force. With an override of 2 on a
    key declared with limit 1, one holder and one waiter are not a deep queue (the start
    is sent a turn); two holders and two waiters are (the start is created parked)."""
    holder = engine.start("short-keyed", {"k": "deep", "park": True}).run_id
    _drain(engine)
    assert engine.get(holder).status == RunStatus.SUSPENDED
    SingletonKey.objects.filter(workflow_name="short-keyed", key="deep").update(limit_override=2)
    second = engine.start("short-keyed", {"k": "deep", "park": True}).run_id
    _drain(engine)  # admitted under the override: two holders
    assert engine.get(second).admitted
    waiter = engine.start("short-keyed", {"k": "deep"})
    assert not ParkReason.SINGLETON.matches(waiter.park_reason), "two holders, no waiter: not deep"
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.start("short-keyed", {"k": "deep"})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    # Its turns were dropped: pending waiters, two holders and two waiters in the queue.
    deep = engine.start("short-keyed", {"k": "deep"})
    assert ParkReason.SINGLETON.matches(deep.park_reason), deep
    assert deep.wake_at is not None and deep.wake_at > deep.created_at


def test_a_run_admitted_by_a_handoff_without_steps_reads_no_steps(engine: Engine) -> None:
    """R4: a waiter a handoff admits has stored no step; its claim, a compare-and-set on
    the run as granted, knows it, and its body starts without reading the steps."""
    holder = engine.start("short-keyed", {"k": "handoff", "park": True}).run_id
    _drain(engine)
    waiter = engine.start("short-keyed", {"k": "handoff"}).run_id
    _drain(engine)  # denied: parked behind the holder (S5)
    engine.signal(holder, "go")
    sent = _statements(lambda: _drain(engine))
    assert engine.get(waiter).status == RunStatus.COMPLETED
    # The holder, resumed, reads its steps (it stored one: the signal's); the waiter reads none.
    assert sum(_STEP_TABLE in s and s.lstrip().upper().startswith("SELECT") for s in sent) == 1, sent


@pytest.mark.skipif(connection.vendor == "postgresql", reason="PostgreSQL locks the key row with one SELECT already")
def test_a_settle_locks_its_key_with_one_statement(engine: Engine) -> None:
    """S13: the settle of a holder locks its key's row (the lock order: the key first) with
    one statement on MySQL/MariaDB (``SELECT ... FOR UPDATE`` of the row its claim created)
    and SQLite (an upsert that returns the row)."""
    engine.start("short-keyed", {"k": "settle"})
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    store = engine.store
    turn = store.begin_turn(
        queued.popleft(),
        "tester",
        lease_seconds=30,
        limits={"short-keyed": 1},
        max_recoveries=3,
        retry=store.retry,  # type: ignore[attr-defined]
    )
    taken = turn.run
    assert taken is not None and turn.state == TurnState.RUN
    sent = _statements(lambda: store.finish(taken, "tester", RunStatus.COMPLETED, limits={"short-keyed": 1}))
    assert sum(_KEY_TABLE in s for s in sent) == 1, sent
