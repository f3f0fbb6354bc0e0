"""Visible causes (issue #9): the admin's key page and the demo's live lanes
tell "waiting for the key" from "could run now, waiting for a worker"."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_singleton.models import Run
from durable_singleton.queues import Cause, run_cause
from durable_singleton.testing import make_engine
from testproject.demo.live import load_lanes

KEY_PAGE = reverse("admin:durable_singleton_run_queue_key")


def test_run_cause_tells_key_waits_from_worker_waits() -> None:
    """S5, S6: a due holder and an admissible waiter wait for a worker; a
    waiter behind the free slots waits for the key; a holder with a later
    wake is parked (keeps its slot)."""
    now = timezone.now()
    past, later = now - timedelta(seconds=1), now + timedelta(minutes=1)
    kw = {"now": now}
    assert run_cause(status="running", holder=True, wake_at=None, position=None, free_slots=0, **kw) is Cause.RUNNING
    assert run_cause(status="suspended", holder=True, wake_at=past, position=None, free_slots=0, **kw) is (
        Cause.NEEDS_WORKER
    )
    assert run_cause(status="suspended", holder=True, wake_at=later, position=None, free_slots=0, **kw) is Cause.PARKED
    assert run_cause(status="blocked", holder=True, wake_at=None, position=None, free_slots=0, **kw) is Cause.PARKED
    assert run_cause(status="pending", holder=False, wake_at=later, position=1, free_slots=1, **kw) is (
        Cause.NEEDS_WORKER
    )
    assert run_cause(status="pending", holder=False, wake_at=past, position=2, free_slots=1, **kw) is Cause.NEEDS_KEY
    assert run_cause(status="suspended", holder=False, wake_at=past, position=1, free_slots=0, **kw) is (
        Cause.NEEDS_KEY
    )


def _plant() -> None:
    """store:v (limit 1): v-0 holder sleeping till later, v-1 and v-2 waiting
    for the key; store:w: no holder, w-0 and w-1 waiting, w-0 admissible."""
    engine = make_engine("django")
    for run_id, store in (("v-0", "v"), ("v-1", "v"), ("v-2", "v"), ("w-0", "w"), ("w-1", "w")):
        engine.start("demo-sync-inventory", {"store_id": store, "duration": 0}, run_id=run_id)
    later = timezone.now() + timedelta(minutes=5)
    Run.objects.filter(pk="v-0").update(status="suspended", singleton_slot="holder", wake_at=later)


@pytest.mark.django_db(transaction=True)
def test_admin_key_page_shows_each_runs_cause(admin_client: Client) -> None:
    """The key page's "now" column: a holder parked, waiters for the key; on a
    key with a free slot, the front waiter waits for a worker."""
    _plant()
    page = admin_client.get(KEY_PAGE, {"workflow": "demo-sync-inventory", "key": "store:v"}).content.decode()
    causes = re.findall(r'data-run-id="([^"]+)".*?data-cause="([^"]+)"', page, flags=re.S)
    assert causes == [("v-0", "parked"), ("v-1", "needs_key"), ("v-2", "needs_key")]
    page = admin_client.get(KEY_PAGE, {"workflow": "demo-sync-inventory", "key": "store:w"}).content.decode()
    causes = re.findall(r'data-run-id="([^"]+)".*?data-cause="([^"]+)"', page, flags=re.S)
    assert causes == [("w-0", "needs_worker"), ("w-1", "needs_key")]
    assert "waiting for a worker" in page and "waiting for the key" in page


@pytest.mark.django_db(transaction=True)
def test_demo_lanes_split_ready_runs_from_key_waiters() -> None:
    """The demo's live picture: a key with a free slot and waiters shows its
    front waiter as ready (waiting for a worker), not as a stuck key."""
    _plant()
    ids = ["v-0", "v-1", "v-2", "w-0", "w-1"]
    v, w = load_lanes("demo-sync-inventory", ["store:v", "store:w"], {"store:v": 1, "store:w": 1}, ids)
    assert (v.holders, v.ready, v.waiters, v.held) == (["v-0"], [], ["v-1", "v-2"], 1)
    assert (w.holders, w.ready, w.waiters, w.held) == ([], ["w-0"], ["w-1"], 0)
