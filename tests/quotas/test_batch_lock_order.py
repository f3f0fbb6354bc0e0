"""A ``start_many`` batch inside one transaction (a caller's ``atomic`` block, or the
worker dispatcher's start, O1a) locks the key rows of all its runs while the
transaction lasts: the fair quota keys whose sub-key has lower-priority waiters (X4b,
X8c), the capped quota keys (X3j) and the capped singleton keys (S15); a superseding
batch (X1: ``on_busy`` replace_queued, one start after another) every quota key and
singleton key its starts lock (``BaseStore.lock_superseding_batch``). Two batches
over the same keys in opposite input orders must take those locks in the one global
order (X3e), or each waits for the other's key row. On PostgreSQL and MariaDB, with
real row locks: SQLite takes one lock for the whole database.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, connections, transaction

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.statuses import TERMINAL_STATUSES
from durable_singleton.testing import make_engine
from tests.worker_processes import wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite locks the whole database, not key rows"),
]

KEYS = ("a", "b", "c")


def _lock_waits() -> int:
    """The sessions of the test database waiting for a row lock now."""
    with connections["default"].cursor() as cursor:
        if connection.vendor == "mysql":
            # A statement on a key row while the test holds every key row's lock: waiting for it.
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND INFO LIKE %s",
                ["%durable_singleton_singletonkey%"],
            )
        else:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # read inside the test's transaction: no cached view
            cursor.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        return int(cursor.fetchone()[0])


def _declare(registry: Registry, shape: str) -> tuple[str, list[tuple[str, str]], dict[str, Any]]:
    """The workflow of the batches, the key rows its batches lock ((workflow, key)
    pairs) and the extra start arguments of its batches."""
    if shape == "fair":
        fair = Quota("fair-batch", key=lambda i: i["k"], fair_key=lambda i: "tenant", limit=1)
        registry.add("w", "1", lambda ctx, i: None, quotas=[fair])
        return "w", [("quota:fair-batch", k) for k in KEYS], {"priority": 5}
    if shape == "capped-quota":
        capped = Quota("capped-batch", key=lambda i: i["k"], limit=1, max_queue_depth=50)
        registry.add("w", "1", lambda ctx, i: None, quotas=[capped])
        return "w", [("quota:capped-batch", k) for k in KEYS], {}
    if shape == "superseding-quota":  # the quota keys first, then the singleton keys (X3e)
        shared = Quota("superseding-batch", key=lambda i: i["k"], limit=1)
        on_busy = {"key": lambda i: i["k"], "on_busy": "replace_queued"}
        registry.add("w", "1", lambda ctx, i: None, singleton=on_busy, quotas=[shared])
        return "w", [("quota:superseding-batch", k) for k in KEYS] + [("w", k) for k in KEYS], {}
    if shape == "superseding":
        registry.add("w", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "on_busy": "replace_queued"})
        return "w", [("w", k) for k in KEYS], {}
    registry.add("w", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "max_queue_depth": 50})
    return "w", [("w", k) for k in KEYS], {}


@pytest.mark.parametrize(
    "shape",
    [
        "fair",
        "capped-quota",
        "capped-singleton",
        "superseding",
        "superseding-quota",
    ],
)
def test_batches_over_the_same_keys_in_opposite_orders_never_deadlock(registry: Registry, shape: str) -> None:
    """X3e, X4b, X8c, X3j, S15, X1, O1a: the key rows of the test's transaction hold two
    ``start_many`` batches, each in a transaction of its own, over the keys a, b, c
    (b, c, a and c, b, a: each batch's first key is another's later one) until both
    wait on a key; then they are let go. Each batch must take its keys in the one
    order, so both commit every run; before, each had locked its first run's key
    and waited for the other's (a deadlock: one batch was refused)."""
    name, lock_keys, extra = _declare(registry, shape)
    engine = make_engine("django", registry=registry)
    if shape == "fair":  # the lower-priority waiters a higher batch passes (X8c): the key's lock
        for k in KEYS:
            engine.start(name, {"k": k}, priority=0)
    orders = [["b", "c", "a"], ["c", "b", "a"]]
    results: list[Any] = [None, None]

    def batch(i: int) -> None:
        try:
            with transaction.atomic():
                results[i] = engines[i].start_many(name, [{"k": k} for k in orders[i]], **extra)
        except BaseException as exc:  # reported by the test
            results[i] = exc
        finally:
            connections.close_all()

    engines = [make_engine("django", registry=registry) for _ in range(2)]
    threads = [threading.Thread(target=batch, args=(i,), daemon=True) for i in range(2)]
    for workflow, key in lock_keys:  # the key rows exist: each wait is on a row's lock
        with transaction.atomic():
            engine.store.lock_key(workflow, key)  # type: ignore[attr-defined]
    with transaction.atomic():
        for workflow, key in sorted(lock_keys):
            engine.store.lock_key(workflow, key)  # type: ignore[attr-defined]
        for thread in threads:
            thread.start()
        wait_for(lambda: _lock_waits() >= 2, 60, "both batches waiting on a key row")
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a batch never returned"
    assert not [r for r in results if isinstance(r, BaseException)], results
    started = [r for result in results for r in result]
    assert len(started) == 6 and all(r.status not in TERMINAL_STATUSES for r in started), started
