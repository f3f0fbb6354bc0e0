"""The SQLite room (durable_singleton.stores.sqlite, #32 item 2): a run's start, claim and
settle with its handoff are a few raw statements, no more than six per run, on an idle key
and for a waiter a handoff admits; a key's token counter left behind a holder's token is
moved past it before any token is handed out (K1, R5a, S5, S7, S8a, S13).

Statements are counted as the bench counts them (:class:`bench.roundtrips.RoundTrips`: every
statement the SQLite library runs on the connection, ``BEGIN`` and ``COMMIT`` included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, transaction

from bench.roundtrips import RoundTrips
from durable_singleton.engine import Engine
from durable_singleton.models import Run, SingletonKey
from durable_singleton.statuses import RunStatus
from durable_singleton.testing import make_engine
from tests.helpers import drain_chains, keyed_registry

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="the SQLite room"),
]


@pytest.fixture
def engine() -> Engine:
    built = make_engine("django", registry=keyed_registry("room-keyed"))
    built.now()  # the engine's clock reads the database's now every few minutes, not per run
    return built


def _count(fn: Callable[[], Any]) -> int:
    with RoundTrips(connection) as trips:
        fn()
    return trips.total


def test_a_run_on_an_idle_key_is_at_most_six_statements(engine: Engine) -> None:
    """S5, S7, S8a, K1: a keyed run on a key nobody holds (its start, its claim with
    admission, its settle) is at most six statements on SQLite, and completes."""
    engine.start("room-keyed", {"k": "warm"})
    drain_chains(engine)
    ids: list[str] = []

    def run(n: int) -> None:
        ids.append(engine.start("room-keyed", {"k": f"idle-{n}"}).run_id)
        drain_chains(engine)

    counts = [_count(lambda n=n: run(n)) for n in range(3)]  # type: ignore[misc]
    assert max(counts) <= 6, counts
    assert {r.status for r in map(engine.get, ids) if r is not None} == {RunStatus.COMPLETED}


def test_a_run_admitted_by_a_handoff_is_at_most_six_statements(engine: Engine) -> None:
    """S7, S6, R5a, K1: one more waiter in a drain (its start deep in the queue, its grant by
    its predecessor's settle, its confirmation and its own settle) costs at most six
    statements on SQLite; every run completes with increasing tokens."""

    def chain(waiters: int) -> tuple[int, list[str]]:
        key = f"hot-{waiters}"
        holder = engine.start("room-keyed", {"k": key, "park": True}).run_id
        drain_chains(engine)

        def work() -> None:
            ids.extend(engine.start("room-keyed", {"k": key}).run_id for _ in range(waiters))
            engine.signal(holder, "go")
            drain_chains(engine)

        ids = [holder]
        return _count(work), ids

    long, long_ids = chain(8)
    short, short_ids = chain(4)
    assert (long - short) / 4 <= 6, (long, short)
    for ids in (long_ids, short_ids):
        runs = [r for r in map(engine.get, ids) if r is not None]
        assert len(runs) == len(ids) and {r.status for r in runs} == {RunStatus.COMPLETED}
        tokens = [r.fencing_token or 0 for r in runs]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_a_key_counter_behind_a_holders_token_is_moved_before_a_grant(engine: Engine) -> None:
    """K1: the room writes a grant's token before the statement that moves its key's counter
    (a crash between the two leaves the counter behind a holder's token). The next grant on
    that key is still past every token handed out: the room writes nothing on a key whose
    counter is behind, and the ORM path's key lock moves the counter first."""
    holder = engine.start("room-keyed", {"k": "behind", "park": True}).run_id
    drain_chains(engine)
    held = engine.get(holder)
    assert held is not None and held.fencing_token is not None
    # As a crash between a claim and its bump_token leaves it.
    SingletonKey.objects.filter(workflow_name="room-keyed", key="behind").update(last_token=0)
    waiter = engine.start("room-keyed", {"k": "behind"}).run_id
    drain_chains(engine)  # denied: parked behind the holder (S5)
    engine.signal(holder, "go")
    drain_chains(engine)
    granted = Run.objects.get(pk=waiter)
    assert granted.status == RunStatus.COMPLETED
    assert granted.fencing_token is not None and granted.fencing_token > held.fencing_token
    assert SingletonKey.objects.get(workflow_name="room-keyed", key="behind").last_token >= granted.fencing_token


def _temp_store() -> int:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA temp_store")
        return int(cursor.fetchone()[0])


def test_the_room_keeps_its_connections_temporary_store_in_memory_unless_the_project_chose(engine: Engine) -> None:
    """#33, #32 item 2 (``stores.sqlite.keep_temp_in_memory``): each room statement
    materializes a dozen small ephemeral tables; the room sets ``temp_store`` to MEMORY
    (2) on a connection before its first statement there, and leaves a store the project
    chose (``init_command``: here FILE, 1) as it is. Before, every connection kept
    SQLite's default (0: files), and the throttled claim took 2.6 times as long."""
    connection.close()
    with transaction.atomic():  # a start inside the caller's transaction: left for later
        engine.start("room-keyed", {"k": "in-a-transaction"})
    assert _temp_store() == 0
    engine.start("room-keyed", {"k": "fresh-connection"})
    drain_chains(engine)
    assert _temp_store() == 2
    connection.close()
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA temp_store = FILE")  # as an init_command would
    run_id = engine.start("room-keyed", {"k": "chosen-store"}).run_id
    drain_chains(engine)
    assert _temp_store() == 1
    run = engine.get(run_id)
    assert run is not None and run.status == RunStatus.COMPLETED
