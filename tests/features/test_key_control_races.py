"""A key control (K2: pause, resume, limit override) racing a claim on MariaDB/MySQL.

InnoDB's duplicate-key check takes a gap lock, at READ COMMITTED as at REPEATABLE READ:
a claim that holds a quota key's row and creates its singleton key's row (its first
claim) inserts into the gap before the quota key's row, which a control waiting for
that row has asked for. The server ends the cycle by refusing one transaction
(a deadlock, 1213); the store's transactions are retried on it (section 7), the
control's too.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.db.models import F

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.models import SingletonKey
from durable_singleton.testing import make_engine
from tests.conftest import spawn_result
from tests.worker_processes import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="InnoDB's gap locks of a duplicate-key check"),
]


def _waiting_on_key_rows() -> int:
    """The other sessions running a statement on the key table: waiting for a row lock,
    while the test holds the key row they lock."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND INFO LIKE %s",
            ["%durable_singleton_singletonkey%"],
        )
        return int(cursor.fetchone()[0])


@pytest.mark.parametrize("control", ["pause", "resume", "override"])
def test_a_key_control_refused_by_a_deadlock_with_a_claim_is_retried(control: str) -> None:
    """K2, S13a, X3e, section 7: the test's transaction holds the row of quota key
    (quota:gap, x), as a claim of a run that carries it does (the lock order: its quota
    keys first); a key control of (quota:gap, x) waits for that row; the claim then
    creates its singleton key's row, whose place in the key table's unique index is the
    gap just before (quota:gap, x): the server refuses the control's transaction as a
    deadlock. The control is retried as every store transaction is on a named transient
    error, and applied once the claim commits; before, the deadlock reached the caller."""
    registry = Registry()
    registry.add("w", "1", lambda ctx, i: None, quotas=[Quota("gap", key=lambda i: "x")])
    engine = make_engine("django", registry=registry)
    store: Any = engine.store
    with transaction.atomic():
        store.lock_key("quota:gap", "x")  # the key row exists: the control waits for its lock

    def apply() -> Any:
        if control == "pause":
            return engine.pause_key("quota:gap", "x", by="ops")
        if control == "resume":
            return engine.resume_key("quota:gap", "x", by="ops")
        return engine.override_limit("quota:gap", "x", 3, by="ops")

    with transaction.atomic():
        store.lock_key("quota:gap", "x")  # a claim's first lock (X3e)
        # A claim's writes under it: the server ends a deadlock by refusing the transaction that
        # wrote least, the control's (a claim that wrote nothing yet could be chosen instead).
        SingletonKey.objects.filter(workflow_name="quota:gap", key="x").update(last_token=F("last_token") + 1)
        thread, result = spawn_result(apply)
        wait_for(lambda: _waiting_on_key_rows() >= 1, 60, "the control waiting for the quota key's row")
        # "quota:gap" sorts just after "q": the new row's place is the gap before (quota:gap, x).
        store.lock_key("q", "new")  # the claim creates its singleton key's row
    thread.join(120)
    assert not thread.is_alive(), "the control never returned"
    assert not isinstance(result[0], BaseException), result
    row = SingletonKey.objects.get(workflow_name="quota:gap", key="x")
    assert (row.paused, row.limit_override) == {
        "pause": (True, None),
        "resume": (False, None),
        "override": (False, 3),
    }[control]


def _deadlocks() -> int:
    with connections["default"].cursor() as cursor:
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        return int(cursor.fetchone()[1])


def test_a_key_row_created_next_to_a_key_others_wait_for_deadlocks_with_no_one() -> None:
    """S13a, X3e, section 7: a transaction holds quota key (quota:gap, x), as a claim or a
    capped start of a run that carries it does; another store's transaction waits for the
    same row (a racing start of the same quota). The first then creates a new key row
    whose place in the key table's unique index is the gap just before (quota:gap, x) (its
    singleton key's first claim or start). The waiting lock is the row's alone, so the
    insert does not wait for it and the server refuses no one. Before, the waiting
    upsert's next-key lock covered that gap: a deadlock, and each retry of the creator met
    the next waiter the same way (six racing capped starts exhausted their retries)."""
    registry = Registry()
    registry.add("w", "1", lambda ctx, i: None, quotas=[Quota("gap", key=lambda i: "x")])
    first: Any = make_engine("django", registry=registry).store
    other: Any = make_engine("django", registry=registry).store
    with transaction.atomic():
        first.lock_key("quota:gap", "x")  # the key row exists
    before = _deadlocks()

    def wait_for_the_row() -> Any:
        with transaction.atomic():
            return other.lock_key("quota:gap", "x")

    with transaction.atomic():
        first.lock_key("quota:gap", "x")
        thread, result = spawn_result(wait_for_the_row)
        wait_for(lambda: _waiting_on_key_rows() >= 1, 60, "the other transaction waiting for the quota key's row")
        # "quota:gap" sorts just after "q": the new row's place is the gap before (quota:gap, x).
        first.lock_key("q", "new")
    thread.join(120)
    assert not thread.is_alive(), "the waiting transaction never returned"
    assert not isinstance(result[0], BaseException), result
    assert _deadlocks() == before, "the server refused a transaction as a deadlock"
    assert SingletonKey.objects.filter(workflow_name="q", key="new").exists()


def _sessions(result: list[Any]) -> str:
    """What every session is doing, and what the claim returned, for a wait that failed."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT ID, COMMAND, STATE, INFO FROM information_schema.PROCESSLIST")
        return f"claim: {result!r}\nsessions: {cursor.fetchall()!r}"


@pytest.mark.parametrize("shape", ["singleton", "quota", "throttle"])
def test_a_rooms_claim_waiting_for_a_key_row_created_next_to_deadlocks_with_no_one(shape: str) -> None:
    """S13a, X3e, X6c, section 7: the same cycle as above through the MariaDB room's
    procedures. The test's transaction holds the key row (``gap``'s, key x) that a waiter's
    claim locks first: ``ds_claim``'s own lock of its singleton key, or ``ds_admit_quota``'s
    of its quota or throttle key. The claim, one CALL on another connection, waits for it;
    the test's transaction then creates the key row whose place in the unique index is the
    gap just before. ``ds_lock_known_key`` locks a row its caller read before the transaction
    (``ds_key_ids``) by its primary key, the record alone, so the insert does not wait and
    the server refuses no one; the claim admits its run once the test commits. Before
    (migration 0025), each procedure locked with an upsert first, whose waiting next-key
    lock covered that gap: InnoDB's deadlock counter moved and one side was refused."""
    from durable_singleton import Throttle
    from durable_singleton.stores.base import TurnState

    registry = Registry()
    if shape == "singleton":
        registry.add("gap", "1", lambda ctx, i: None, singleton={"key": lambda i: "x"})
        locked, created = ("gap", "x"), ("gap", "w")  # ("gap", "w") sorts just before ("gap", "x")
    elif shape == "quota":
        registry.add("w", "1", lambda ctx, i: None, quotas=[Quota("gap", key=lambda i: "x")])
        locked, created = ("quota:gap", "x"), ("quota:gap", "w")
    else:
        registry.add("w", "1", lambda ctx, i: None, throttles=[Throttle("gap", key=lambda i: "x", limit=5, period=60)])
        locked, created = ("throttle:gap", "x"), ("throttle:gap", "w")
    holder = make_engine("django", registry=registry)
    claimer = make_engine("django", registry=registry)
    assert claimer.store._mysql_room() is not None  # type: ignore[attr-defined]  # the procedures are installed
    store: Any = holder.store
    run_id = holder.start("gap" if shape == "singleton" else "w", {}).run_id
    with transaction.atomic():
        store.lock_key(*locked)  # the key row exists
    before = _deadlocks()

    def claim() -> Any:
        return claimer.store.begin_turn(
            run_id,
            "claimer",
            lease_seconds=30,
            limits=claimer.limits(),
            max_recoveries=3,
            retry=claimer._retry_policy(),
        )

    with transaction.atomic():
        store.lock_key(*locked)
        thread, result = spawn_result(claim)
        # A procedure's statement shows as itself in the process list (MariaDB), not as the CALL.
        waiting = "the claim waiting for the key's row"
        wait_for(lambda: _waiting_on_key_rows() >= 1, 60, waiting, lambda: _sessions(result))
        store.lock_key(*created)  # the new row's place: the gap just before the locked one
    thread.join(120)
    assert not thread.is_alive(), "the claim never returned"
    assert not isinstance(result[0], BaseException), result
    assert _deadlocks() == before, "the server refused a transaction as a deadlock"
    assert result[0].state is TurnState.RUN, result[0]
    assert SingletonKey.objects.filter(workflow_name=created[0], key=created[1]).exists()
