"""The admin's throttle pages (SPEC X6, K2, K3; issue #33 item 4): the queue page lists
the throttle keys with waiters (the rate, its use in the current window, the waiters
over the rate, the next admission), linked to a throttle key's page: its waiters in its
admission order with why each waits, the admissions in its window and its controls,
whose form changes the throttle key and comes back to that page. On the DATABASE_URL
database with its own claims; times are the database's clock (R5)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from durable_singleton import Throttle
from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as declared
from durable_singleton.engine import Engine
from durable_singleton.testing import make_engine
from tests.admin.test_quota_pages import assert_the_key_page_is_bounded
from tests.helpers import drain

pytestmark = pytest.mark.django_db(transaction=True)

ERP = Throttle("erp-rate", key=lambda i: i["tenant"], limit=1, period=600.0)
THROTTLE_KEY = reverse("admin:durable_singleton_run_throttle_key")
QUEUES = reverse("admin:durable_singleton_run_queues")
APPLY = reverse("admin:durable_singleton_keycontrol_apply")


@pytest.fixture
def throttled(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """``sync`` carries ``erp-rate`` (1 per 10 min): A of tenant t1 is admitted and
    completes; B and C of t1 are parked over the rate until the window opens."""
    return _two_over_the_rate(registry, monkeypatch, "sync")


def _two_over_the_rate(
    registry: Registry, monkeypatch: pytest.MonkeyPatch, workflow: str, **declaration: Any
) -> Engine:
    """``workflow`` (with ``declaration``) carries ``erp-rate``: A of tenant t1 is
    admitted and completes; B and C of t1 are parked over the rate. The admin reads
    the process's declarations."""
    engine = make_engine("django", registry=registry)
    registry.add(workflow, "1", lambda ctx, i: None, throttles=[ERP], **declaration)
    monkeypatch.setitem(declared.throttles, "erp-rate", ERP)
    monkeypatch.setitem(declared.latest, workflow, registry.latest[workflow])
    for run_id in ("A", "B", "C"):
        engine.start(workflow, {"tenant": "t1"}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["completed", "suspended", "suspended"]
    return engine


def _waiters(html: str) -> dict[str, str]:
    return {
        m[1]: m[2] for m in re.finditer(r'<tr class="ds-waiter[^"]*" data-run-id="([^"]+)"[^>]*>(.*?)</tr>', html, re.S)
    }


def test_the_queue_page_lists_a_throttle_key_linked_to_its_page(admin_client: Client, throttled: Engine) -> None:
    """X6, K3: the queue page's "Throttles" table lists erp-rate · t1 (a throttle-only
    workflow's parked runs showed nowhere): 1 per 10 min, 1 / 1 in the window, 2 waiting,
    2 over the rate, linked to the throttle key's page; the workflow filter offers sync."""
    response = admin_client.get(QUEUES)
    html = response.content.decode()
    row = re.search(
        r'<tr class="ds-throttle-row" data-workflow="throttle:erp-rate" data-key="t1">(.*?)</tr>', html, re.S
    )
    assert row is not None, html
    assert f'href="{THROTTLE_KEY}?throttle=erp-rate&amp;key=t1"' in row[1]
    assert "1 per 10 min 0 s" in row[1] and "1 / 1" in row[1]
    [item] = response.context["throttle_rows"]
    assert (item["row"].waiting, item["row"].throttled) == (2, 2)
    assert re.search(r'href="\?workflow=sync"[^>]*>sync<', html), html
    chosen = admin_client.get(QUEUES, {"workflow": "sync"})
    assert [(i["row"].throttle, i["row"].key) for i in chosen.context["throttle_rows"]] == [("erp-rate", "t1")]


def test_the_throttle_key_page_says_why_each_waiter_waits(admin_client: Client, throttled: Engine) -> None:
    """X6d, K3: the page lists B and C at positions 1 and 2, each "throttled by erp-rate:
    next admission at" its not_before, and A's admission in the current window; the
    explanation of B says the same."""
    html = admin_client.get(THROTTLE_KEY, {"throttle": "erp-rate", "key": "t1"}).content.decode()
    waiters = _waiters(html)
    assert list(waiters) == ["B", "C"], html
    for run_id in ("B", "C"):
        assert "throttled by erp-rate: next admission at" in waiters[run_id], waiters[run_id]
        opening = throttled.get(run_id).not_before
        assert opening is not None and f'datetime="{opening.isoformat()}"' in waiters[run_id]
    assert re.search(r'<tr class="ds-admission" data-run-id="A">', html), html
    assert 'id="ds-admitted">1<' in html and 'id="ds-throttled">2<' in html
    assert "throttled by 'erp-rate'" in throttled.explain("B").sentence


def test_the_throttle_key_page_controls_change_the_throttle_key(admin_client: Client, throttled: Engine) -> None:
    """K2, X6: the page's controls form addresses throttle:erp-rate · t1; overriding its
    limit to 3 comes back to the throttle key's page (it went to a singleton key's page
    of the workflow "throttle:erp-rate"), is recorded, and makes B and C due at once."""
    html = admin_client.get(THROTTLE_KEY, {"throttle": "erp-rate", "key": "t1"}).content.decode()
    assert 'name="workflow" value="throttle:erp-rate"' in html and 'name="key" value="t1"' in html
    response = admin_client.post(
        APPLY, {"workflow": "throttle:erp-rate", "key": "t1", "control": "limit", "limit": "3", "reason": "backlog"}
    )
    assert response.status_code == 302
    assert response["Location"] == f"{THROTTLE_KEY}?throttle=erp-rate&key=t1"
    state = throttled.key_controls("throttle:erp-rate", "t1")
    assert (state.limit, state.limit_override) == (3, 3)
    # Made due now (their turns went to the admin process's dispatcher): their claims admit them.
    now = throttled.store.now()
    for run_id in ("B", "C"):
        woken = throttled.get(run_id).not_before
        assert woken is not None and woken <= now
        throttled.execute(run_id)
    assert [throttled.get(r).status for r in ("B", "C")] == ["completed", "completed"]


def test_the_throttle_key_page_costs_a_bounded_number_of_queries(
    admin_client: Client, throttled: Engine, django_assert_max_num_queries: Any
) -> None:
    """Section 6: the page's queries do not grow with its waiters (no query per row)."""
    bound = django_assert_max_num_queries(16)
    page = (THROTTLE_KEY, {"throttle": "erp-rate", "key": "t1"})
    assert_the_key_page_is_bounded(admin_client, throttled, ("sync", {"tenant": "t1"}), page, bound)


def test_a_singleton_keys_page_says_a_waiter_is_throttled(
    admin_client: Client, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X6d, K3: ``keyed`` carries a singleton key and erp-rate; A ran, B is parked over the
    rate while the key is free. The key's page reads B "throttled" (it read "waiting for a
    quota", and its next attempt "at a release", the backlog's fallback) with its next
    attempt at the window's opening."""
    from durable_singleton import Singleton

    engine = make_engine("django", registry=registry)
    registry.add("keyed", "1", lambda ctx, i: None, singleton=Singleton(key=lambda i: "k", limit=1), throttles=[ERP])
    monkeypatch.setitem(declared.throttles, "erp-rate", ERP)
    monkeypatch.setitem(declared.latest, "keyed", registry.latest["keyed"])
    for run_id in ("A", "B"):
        engine.start("keyed", {"tenant": "t1"}, run_id=run_id)
    drain(engine)
    opening = engine.get("B").not_before
    assert engine.get("A").status == "completed" and opening is not None
    html = admin_client.get(reverse("admin:durable_singleton_run_queue_key"), {"workflow": "keyed", "key": "k"})
    row = _waiters(html.content.decode())["B"]
    assert 'data-cause="throttled">throttled<' in row, row
    assert "at a release" not in row and f'datetime="{opening.isoformat()}"' in row, row


def test_the_queue_table_and_lanes_count_throttled_waiters_apart(
    admin_client: Client, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X6d, X3d: ``keyed`` (a singleton key and erp-rate) has a free slot and B and C parked
    over the rate. The queue table's row says "(2 throttled)" and the key's lane "(2
    throttled until their window opens)"; neither counts them "for a shared quota" (both
    did: a throttle carrier carries the quota marker)."""
    from durable_singleton import Singleton

    _two_over_the_rate(registry, monkeypatch, "keyed", singleton=Singleton(key=lambda i: "k", limit=1))
    queues = admin_client.get(QUEUES, {"workflow": "keyed"}).content.decode()
    row = re.search(r'<tr class="ds-queue-row" data-workflow="keyed" data-key="k">(.*?)</tr>', queues, re.S)
    assert row is not None and "(2 throttled)" in row[1] and "waiting for a quota" not in row[1], queues
    lanes = admin_client.get(reverse("admin:durable_singleton_run_lanes"), {"workflow": "keyed"}).content.decode()
    assert "0 holding · 2 waiting (2 throttled until their window opens)" in lanes, lanes
    assert "for a shared quota" not in lanes
