"""The tick's catch-up (S8b) and waiters that carry quotas (X3h): zero compute.

A keyed waiter whose singleton key is free but whose quota is busy waits for
the quota, parked; its own ``wake_at`` (its retry, or the turn a quota handoff
sends, X3h) re-drives it. The catch-up picks keys with a free slot and a due
waiter; it used to pick this one too, and sent the waiter a turn, which
parked it again, at every tick for as long as the quota stayed busy (found by
a new user: 350 turns in 10 s for 20 such waiters, one tick a second). On the
in-memory store and the DATABASE_URL database (SQLite, PostgreSQL, MariaDB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.queues import queue_table
from durable_singleton.testing import make_engine
from tests.helpers import drain as _drain

ERP = Quota("erp-api", key=lambda i: i["tenant"], limit=1)


def _body(ctx: Any, input: dict[str, Any]) -> str:
    if input.get("hold"):
        ctx.wait_for_signal("go")
    return str(ctx.run_id)


def test_a_keyed_waiter_blocked_by_its_quota_is_not_sent_a_turn_by_every_tick(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """S8b, X3h, S6: C (quota only) holds quota key t; R1..R3 (a singleton key
    each, free, and the same quota key) wait for the quota. Ten ticks send them
    no turn (their attempts do not move) and the catch-up grants nothing; when
    C settles, the quota's handoff admits R1 and the others follow, each once.
    The waiters' own retries are an hour away: the ten ticks may take any time
    on a loaded machine without a retry coming due (#34 item 9)."""
    engine = make(ADMISSION_RETRY_SECONDS=3600.0)
    registry.add("charge", "1", _body, quotas=[ERP])
    registry.add("refund", "1", _body, singleton={"key": lambda i: i["order"]}, quotas=[ERP])
    engine.start("charge", {"tenant": "t", "hold": True}, run_id="C")
    _drain(engine)
    for n in (1, 2, 3):
        engine.start("refund", {"tenant": "t", "order": f"o{n}"}, run_id=f"R{n}")
    _drain(engine)
    waiters = ["R1", "R2", "R3"]
    assert [engine.get(r).quota_slot for r in waiters] == ["waiter"] * 3
    attempts = {r: engine.get(r).attempts for r in waiters}
    for _ in range(10):
        report = engine.tick()
        assert report.errors == []
        _drain(engine)
    assert {r: engine.get(r).attempts for r in waiters} == attempts
    assert all(engine.get(r).status != "running" and not engine.get(r).admitted for r in waiters)

    engine.signal("C", "go")
    for _ in range(4):
        _drain(engine)
        engine.tick()
    _drain(engine)
    assert [engine.get(r).status for r in ["C", *waiters]] == ["completed"] * 4


def test_the_catch_up_repairs_a_lost_turn_of_a_quota_waiter_with_room(engine: Engine, registry: Registry) -> None:
    """S8b, X3h: W (key o, quota key u) waits behind H (key o, quota key t). H
    settles; its handoff cannot admit W (W's quota key is not H's) and sends it
    a turn, which is lost. Key o and quota key u both have room: the tick's
    catch-up grants o and W runs, long before its backlog retry."""
    registry.add("refund", "1", _body, singleton={"key": lambda i: i["order"]}, quotas=[ERP])
    engine.start("refund", {"tenant": "t", "order": "o", "hold": True}, run_id="H")
    _drain(engine)
    engine.start("refund", {"tenant": "u", "order": "o"}, run_id="W")
    _drain(engine)
    assert not engine.get("W").admitted
    engine.signal("H", "go")
    queue = engine.dispatcher.queue  # type: ignore[attr-defined]
    while "H" in queue:
        queue.remove("H")
        engine.execute("H")  # H settles; the turns it sends are dropped below (lost)
    queue.clear()
    assert engine.get("H").status == "completed" and engine.get("W").status != "completed"
    for _ in range(3):
        engine.tick()
        _drain(engine)
    assert engine.get("W").status == "completed"


@pytest.mark.django_db(transaction=True)
def test_the_queue_table_does_not_call_a_quota_waiter_on_a_free_key_stalled() -> None:
    """S8a, X3d, section 6: the queue table's "free slot" mark and its
    ``stalled`` filter judge only the waiters a free slot of their key alone
    admits (``admission.key_only_waiter_q``). R waits for its quota on a key
    with a free slot: its key is not stalled; P, a plain waiter of a key with
    a free slot (its grant lost), is."""
    registry = Registry()
    registry.add("charge", "1", _body, quotas=[ERP])
    registry.add("refund", "1", _body, singleton={"key": lambda i: i["order"]}, quotas=[ERP])
    registry.add("plain", "1", _body, singleton={"key": lambda i: "P"})
    engine = make_engine("django", registry=registry)
    engine.start("charge", {"tenant": "t", "hold": True}, run_id="C")
    _drain(engine)
    engine.start("refund", {"tenant": "t", "order": "o1"}, run_id="R")
    _drain(engine)
    engine.start("plain", {}, run_id="P")  # its turn is never run: a waiter on a key with a free slot
    Run.objects.filter(pk="P").update(status="suspended", park_reason="singleton")
    rows = {(r.workflow, r.key): r for r in queue_table(reg=registry).rows}
    refund, plain = rows["refund", "o1"], rows["plain", "P"]
    assert (refund.waiting, refund.waiting_for_key, refund.free_slots, refund.stalled) == (1, 0, 1, False)
    assert (plain.waiting, plain.waiting_for_key, plain.free_slots, plain.stalled) == (1, 1, 1, True)
    stalled = {(r.workflow, r.key) for r in queue_table(reg=registry, only="stalled").rows}
    assert stalled == {("plain", "P")}


@pytest.mark.django_db(transaction=True)
def test_the_run_page_says_a_quota_waiter_on_a_free_key_waits_for_its_quotas() -> None:
    """X3d, section 6: the admin's run page of R (its key free, its quota held
    by C) says it waits for its quotas, never "a slot is free", and its
    activity says it is in line for its key and its quotas."""
    from django.contrib import admin as django_admin
    from django.utils import timezone

    from durable_singleton.admin.display import activity
    from durable_singleton.admin.runs import RunAdmin

    registry = Registry()
    registry.add("charge", "1", _body, quotas=[ERP])
    registry.add("refund", "1", _body, singleton={"key": lambda i: i["order"]}, quotas=[ERP])
    engine = make_engine("django", registry=registry)
    engine.start("charge", {"tenant": "t", "hold": True}, run_id="C")
    _drain(engine)
    engine.start("refund", {"tenant": "t", "order": "o1"}, run_id="R")
    _drain(engine)
    row = Run.objects.get(pk="R")
    place = str(RunAdmin(Run, django_admin.site).place_display(row))
    assert "it waits for its quotas" in place and "a slot is free" not in place
    assert "of its key and of its quotas" in str(activity(row, 0, None, timezone.now()))
