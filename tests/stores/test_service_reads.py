"""The store's reads and writes for the services (issue 32, item 5): explain,
``durable_runs``, ``durable_workers``, the worker's hand-back and the tick's
heartbeat call these BaseStore methods instead of querying the models behind
``store.database``; each store answers them the same way (S5, X5, R5, O3, O6)."""

from __future__ import annotations

from datetime import timedelta

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.records import Beat

from ..helpers import claim, settle


def _queue(engine: Engine, registry: Registry) -> None:
    registry.add("q", "1", lambda ctx, i: None, singleton={"key": lambda i: "K", "limit": 1})
    for run_id in ("H", "W1", "W2", "W3"):
        engine.start("q", {}, run_id=run_id)
    assert claim(engine, "H", owner="host:1:tok:1").state.value == "run"
    for run_id in ("W1", "W2", "W3"):
        assert claim(engine, run_id).state.value == "parked"


def test_key_queue_names_the_holders_and_counts_the_waiters_ahead(engine: Engine, registry: Registry) -> None:
    """S5, X5: H holds the key's one slot, W1..W3 wait in creation order; W3
    sees one holder, three waiters and two due waiters ahead; the holder is
    named with its lease owner; the holder itself does not wait."""
    _queue(engine, registry)
    store = engine.store
    w3 = store.key_queue(engine.get("W3"), 5)
    assert [(h.run_id, h.lease_owner) for h in w3.holders] == [("H", "host:1:tok:1")]
    assert (w3.holder_count, w3.depth, w3.due_ahead, w3.not_due_ahead, w3.waiting) == (1, 3, 2, 0, True)
    assert store.key_queue(engine.get("W3"), 0).holders == () and store.key_queue(engine.get("W3"), 0).holder_count == 1
    h = store.key_queue(engine.get("H"), 5)
    assert h.waiting is False and h.depth == 3


def test_hand_back_leases_expires_only_this_process_runs(engine: Engine, registry: Registry) -> None:
    """R5, D4: a hand-back expires the lease of a running run whose owner has
    the process's prefix, on the store's clock, and makes it due; a run of
    another process (same host and pid, another token) or not running is left."""
    _queue(engine, registry)
    store = engine.store
    assert store.hand_back_leases(["H", "W1"], "host:1:other:") == 0
    assert store.hand_back_leases([], "host:1:tok:") == 0
    assert store.hand_back_leases(["H", "W1", "missing"], "host:1:tok:") == 1
    held = engine.get("H")
    now = store.now()
    assert held.lease_expires_at is not None and held.lease_expires_at <= now
    assert held.wake_at is not None and held.wake_at <= now


def test_select_runs_filters_orders_and_limits(engine: Engine, registry: Registry) -> None:
    """O3 (``durable_runs``): newest first unless oldest first, each filter
    applied, at most ``limit`` runs."""
    _queue(engine, registry)
    store = engine.store
    assert [r.run_id for r in store.select_runs(limit=10)] == ["W3", "W2", "W1", "H"]
    assert [r.run_id for r in store.select_runs(limit=2, oldest_first=True)] == ["H", "W1"]
    assert [r.run_id for r in store.select_runs(limit=10, run_ids=["W1", "H"], statuses=["running"])] == ["H"]
    assert [r.run_id for r in store.select_runs(limit=10, workflow_name="q", key="K", oldest_first=True)] == [
        "H",
        "W1",
        "W2",
        "W3",
    ]
    assert store.select_runs(limit=10, key="other") == []
    assert store.select_runs(limit=10, created_before=engine.get("H").created_at) == []
    later = store.now() + timedelta(seconds=60)
    assert len(store.select_runs(limit=10, created_before=later, namespace=engine.get("H").namespace)) == 4


def test_recent_completions_give_the_latest_finish_first(engine: Engine, registry: Registry) -> None:
    """S5: (admitted or started, finished) of the key's completed runs, latest first, at most ``count``."""
    _queue(engine, registry)
    assert engine.store.recent_completions("q", "K", 5) == []
    assert settle(engine, "H", "completed")
    rows = engine.store.recent_completions("q", "K", 5)
    assert len(rows) == 1 and rows[0][0] is not None and rows[0][1] >= rows[0][0]
    assert engine.store.recent_completions("q", "K", 0) == []


def test_the_worker_registry_and_the_heartbeat(engine: Engine, store_kind: str) -> None:
    """O3, O6: the Django store keeps the worker registry and the heartbeat
    rows; the memory store keeps the heartbeat in its memory (so health sees
    its ticks) and no worker registry (None)."""
    store = engine.store
    at = store.now()
    if store_kind == "memory":
        assert store.worker_processes() is None
        assert store.beat("tick") is None
        assert store.record_beat("tick", at, "me") is True
        assert store.record_beat("tick", at + timedelta(seconds=1), "you") is True
        assert store.beat("tick") == Beat("tick", at + timedelta(seconds=1), "you")
        return
    from durable_singleton.models import WorkerProcess

    assert store.worker_processes() == [] and store.beat("tick") is None
    WorkerProcess.objects.create(
        name="h:2:t", host="h", pid=2, mode="worker", threads=1, started_at=at, last_seen_at=at
    )
    assert [(w.name, w.pid, w.queues) for w in store.worker_processes() or []] == [("h:2:t", 2, "")]
    assert store.record_beat("tick", at, "me") is True
    assert store.record_beat("tick", at + timedelta(seconds=1), "you") is True
    assert store.beat("tick") == Beat("tick", at + timedelta(seconds=1), "you")
