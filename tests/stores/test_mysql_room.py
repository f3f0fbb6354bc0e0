"""Attacks on the MariaDB/MySQL room (durable_singleton.stores.mysql): its procedures
``ds_claim``, ``ds_settle_handoff``, ``ds_grant_waiters`` and ``ds_send_runs`` on a
real server, each test naming the SPEC rule it attacks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.statuses import RunStatus
from durable_singleton.stores import mysql
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import holds_when_asked

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB room's stored procedures"),
]


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.add("room-keyed", "1", holds_when_asked, singleton={"key": lambda i: i["k"]})
    return make_engine(DjangoStore(), registry=registry)


@pytest.fixture
def without_send_runs(engine: Engine) -> Iterator[None]:
    """``ds_send_runs`` dropped, after the store found the room, while the procedures that
    call it stay (``install`` drops each procedure before it creates it again: a later
    migration's window), restored after."""
    assert engine.store._mysql_room() is not None  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute("DROP PROCEDURE ds_send_runs")
    try:
        yield
    finally:
        mysql.install(connection, ["ds_send_runs"])


def _drain(engine: Engine) -> None:
    engine.dispatcher.drain()  # type: ignore[attr-defined]


def test_a_claim_whose_result_procedure_is_missing_runs_its_admitted_waiter_now(
    engine: Engine, without_send_runs: None
) -> None:
    """S4, S5, R5a, K4 (the fallback of docs/operations.rst): with ``ds_send_runs`` missing,
    a waiter's claim is either the room's, whole, or the ORM path's: the run is admitted
    and its body runs in this drain, not left running on a lease nobody holds until it
    expires and a recovery re-drives it (D4)."""
    first = engine.start("room-keyed", {"k": "send"}).run_id
    _drain(engine)
    run = engine.get(first)
    assert run is not None and run.status == RunStatus.COMPLETED, run
    assert run.recoveries == 0 and run.fencing_token == 1, run


def test_a_settle_whose_result_procedure_is_missing_hands_off_in_this_drain(
    engine: Engine, without_send_runs: None
) -> None:
    """S7, R5a, K1 (the fallback): with ``ds_send_runs`` missing, a holder's settle and its
    handoff are either the room's, whole, or the ORM path's: the holder completes and its
    waiter is granted and runs in this drain, with the next token."""
    holder = engine.start("room-keyed", {"k": "hand", "hold": True}).run_id
    _drain(engine)
    waiter = engine.start("room-keyed", {"k": "hand"}).run_id
    _drain(engine)
    engine.signal(holder, "go")
    _drain(engine)
    done = [engine.get(holder), engine.get(waiter)]
    assert [r.status if r else None for r in done] == [RunStatus.COMPLETED] * 2, done
    assert [r.fencing_token if r else None for r in done] == [1, 2], done
