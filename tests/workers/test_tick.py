"""The tick: S8, S8a, D4, D5, F4, F12."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from durable_singleton import signals
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from tests.conftest import Monitor, run_threads
from tests.helpers import admitted, audited, claim, connected, free_slot_without_handoff, sleep_past, sleep_past_lease


def test_lost_push_is_caught_up_by_the_tick(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S8, S8a, F4: with every push lost, the tick's per-key catch-up makes the
    oldest waiter due at once, also one far back in the backlog."""
    audited(registry, monitor)
    for name in ("A", "B", "C", "D"):
        engine.start("wf", {"k": "K"}, run_id=name)
    assert admitted(claim(engine, "A", "w")) == "admitted"
    for name in ("D", "C", "B"):
        assert engine.execute(name) == "parked"
    assert engine.get("C").wake_at - engine.now() > timedelta(minutes=30), "C is in the backlog (S8a)"  # type: ignore[operator]
    engine.dispatcher.queue.clear()
    free_slot_without_handoff(engine, "A")
    report = engine.tick()
    assert report.caught_up == ["B"] and list(engine.dispatcher.queue) == ["B"]
    assert report.dispatched == [], "a granted waiter is sent once, not again by the due batch (S7a)"
    engine.dispatcher.queue.clear()
    assert admitted(claim(engine, "B", "w2")) == "admitted"
    free_slot_without_handoff(engine, "B")  # B's slot freed with no handoff too
    report = engine.tick()
    assert report.caught_up == ["C"] and list(engine.dispatcher.queue) == ["C"]
    engine.dispatcher.drain()
    assert [engine.get(n).status for n in "CD"] == ["completed", "completed"]
    assert monitor.entered == ["C", "D"]


def test_concurrent_ticks_dispatch_each_due_run_once(make: Callable[..., Engine], registry: Registry) -> None:
    """Section 6: several ticks at once are safe: each due run is sent by one of them."""
    engine = make(REDELIVERY_SECONDS=0.5)
    registry.add("plain", "1", lambda c, i: None)
    for n in range(30):
        engine.start("plain", {}, run_id=f"p{n}")
    engine.dispatcher.queue.clear()
    sleep_past(engine, "wake_at", *(f"p{n}" for n in range(30)))  # every run is due
    reports = run_threads(3, lambda i: engine.tick())
    sent = [run_id for r in reports for run_id in r.dispatched]
    assert sorted(sent) == sorted(f"p{n}" for n in range(30))


def test_pending_run_whose_send_was_lost_is_redelivered(make: Callable[..., Engine], registry: Registry) -> None:
    """F4: a run whose Celery send was lost still runs: it carries a wake_at and the tick re-sends it."""
    engine = make(REDELIVERY_SECONDS=2.0)  # the first tick comes well within it, however loaded the machine
    registry.add("plain", "1", lambda c, i: "ok")
    run = engine.start("plain")
    engine.dispatcher.queue.clear()  # the broker lost the send
    assert engine.tick().dispatched == []
    sleep_past(engine, "wake_at", run.run_id)
    assert engine.tick().dispatched == [run.run_id]
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == "ok"


def test_expired_lease_is_recovered_then_dead_lettered(make: Callable[..., Engine], registry: Registry) -> None:
    """D4, S8, S10: the tick re-drives a running run whose lease expired,
    counting recoveries; past MAX_RECOVERIES the run is dead, its slot is freed
    in the same write, on_dead and run_dead fire, and the waiter takes the slot."""
    engine = make(MAX_RECOVERIES=2)  # the crashed claims take 0.05 s leases; B's turn a lease that outlasts it
    dead: list[str] = []
    hooked: list[str] = []
    registry.add(
        "crashy",
        "1",
        lambda c, i: None,
        singleton={"key": lambda i: "k"},
        on_dead=lambda run: hooked.append(run.run_id),
    )
    engine.start("crashy", {}, run_id="A")
    engine.start("crashy", {}, run_id="B")
    receiver = lambda sender, run, **kw: dead.append(run.run_id)  # noqa: E731
    with connected(receiver, signals.run_dead):
        for attempt in range(3):
            turn = claim(engine, "A", f"crashed-{attempt}", 0.05)
            assert turn.state.value == "run" and turn.recovered == (attempt > 0)
            assert engine.get("A").admitted, "a crashed holder keeps its slot (S10)"
            sleep_past_lease(engine, "A")
        engine.dispatcher.queue.clear()
        report = engine.tick()
        assert "A" in report.dispatched
        assert engine.execute("A") == "dead"
    a = engine.get("A")
    assert a.status == "dead" and not a.admitted and a.error["code"] == "max_recoveries"
    assert dead == ["A"] and hooked == ["A"]
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed"


def test_execution_timeout_cancels_and_releases(make: Callable[..., Engine], registry: Registry) -> None:
    """D5, S7: the tick settles overdue active runs as cancelled with code
    execution_timeout, then pushes the release."""
    engine = make()
    registry.add("slowish", "1", lambda ctx, i: ctx.sleep(3600), singleton={"key": lambda i: "k"}, timeout=0.2)
    engine.start("slowish", {}, run_id="A")
    assert engine.execute("A") == "suspended"
    engine.start("slowish", {}, run_id="B")
    engine.dispatcher.queue.clear()
    sleep_past(engine, "deadline_at", "A", "B")
    report = engine.tick()
    assert "A" in report.timed_out and "B" in report.timed_out
    a = engine.get("A")
    assert a.status == "cancelled" and a.error["code"] == "execution_timeout" and not a.admitted


@pytest.mark.django_db(transaction=True)
def test_deleting_a_holder_row_frees_the_slot(settings: Any, registry: Registry, monitor: Monitor) -> None:
    """F12: deleting A's row through the ORM frees the slot and pushes the next waiter."""
    settings.DURABLE_SINGLETON = {"DISPATCH": "manual"}
    from durable_singleton import get_engine
    from durable_singleton.models import Run
    from testproject.inventory.workflows import DemoSyncInventory

    engine = get_engine()
    DemoSyncInventory.dispatch({"store_id": "del"}, run_id="A")
    DemoSyncInventory.dispatch({"store_id": "del"}, run_id="B")
    assert admitted(claim(engine, "A", "w")) == "admitted"
    assert engine.execute("B") == "parked"
    engine.dispatcher.queue.clear()
    Run.objects.filter(pk="A").delete()
    assert list(engine.dispatcher.queue) == ["B"]
    engine.dispatcher.drain()
    assert engine.get("B").status == "completed"


def test_blocked_holder_keeps_its_slot_and_is_redriven(make: Callable[..., Engine], registry: Registry) -> None:
    """D3, S6: a blocked holder keeps its slot; the tick re-drives it."""
    engine = make()
    ready = threading.Event()

    def body(ctx: Any, input: Any) -> str:
        if not ready.is_set():
            ctx.block("waiting for the warehouse", poll_seconds=0.05)
        return "done"

    registry.add("blocky", "1", body, singleton={"key": lambda i: "k"})
    engine.start("blocky", {}, run_id="A")
    engine.start("blocky", {}, run_id="B")
    assert engine.execute("A") == "blocked"
    a = engine.get("A")
    assert a.status == "blocked" and a.admitted and a.park_reason == "waiting for the warehouse"
    assert engine.execute("B") == "parked"
    ready.set()
    sleep_past(engine, "wake_at", "A")  # its poll is due
    engine.dispatcher.queue.clear()
    assert "A" in engine.tick().dispatched
    engine.dispatcher.drain()
    assert engine.get("A").status == "completed"


def _idle_key(engine: Engine, registry: Registry) -> None:
    """Register ``keyed`` (limit 1) and leave key K idle: one run of it completed
    (on the Django store the key's row exists, as after any first claim)."""
    registry.add("keyed", "1", lambda c, i: "ok", singleton={"key": lambda i: "K"})
    engine.start("keyed", {}, run_id="first")
    engine.dispatcher.drain()
    assert engine.get("first").status == "completed"
    engine.dispatcher.sent.clear()


def test_catch_up_leaves_a_fresh_waiter_alone_while_its_first_turn_is_on_its_way(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """S8, S8a, S7a (#17): W is started on an idle key; its first turn is on
    its way (sent, its ``wake_at`` one redelivery window ahead). The tick's
    catch-up neither grants it nor sends it a second turn: W's own turn claims.
    Before, every tick under a backlog granted such waiters and sent each a
    second turn (``_grant`` ran 1.7-1.8 times per run)."""
    engine = make(REDELIVERY_SECONDS=30.0)
    _idle_key(engine, registry)
    engine.start("keyed", {}, run_id="W")
    report = engine.tick()
    assert report.caught_up == [] and report.dispatched == []
    assert not engine.get("W").admitted, "W is still a waiter: nothing granted it"
    assert engine.dispatcher.sent == ["W"], "one turn: the start's"
    engine.dispatcher.drain()
    assert engine.get("W").status == "completed"


def test_catch_up_grants_a_waiter_whose_first_turn_was_lost(make: Callable[..., Engine], registry: Registry) -> None:
    """S8, S8a, F4 (#17): W's first turn is lost. Within its redelivery window
    the catch-up leaves W alone; once its ``wake_at`` (``created_at`` +
    ``REDELIVERY_SECONDS``, on the store's clock) has passed, the next tick
    grants it and sends its turn, once (S7a), and W runs."""
    engine = make(REDELIVERY_SECONDS=2.0)  # the first tick comes well within it, however loaded the machine
    _idle_key(engine, registry)
    engine.start("keyed", {}, run_id="W")
    engine.dispatcher.queue.clear()  # the broker lost the first turn
    assert engine.tick().caught_up == []
    sleep_past(engine, "wake_at", "W")
    report = engine.tick()
    assert report.caught_up == ["W"] and report.dispatched == []
    assert engine.get("W").admitted
    assert list(engine.dispatcher.queue) == ["W"]
    engine.dispatcher.drain()
    assert engine.get("W").status == "completed"
