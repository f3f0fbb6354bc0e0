"""The admin's quota pages (issue #34 item 6): a shared quota key's holders and waiters across
workflows with their positions and causes (X3, X3d, K3), linked from the queue table, and the
cause beside a waiter whose own key has a free slot but which waits for a quota, on the Django
store with its own claims."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from durable_singleton import Quota, Singleton
from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as declared
from durable_singleton.engine import Engine
from durable_singleton.testing import make_engine
from tests.helpers import drain, holding_body

pytestmark = pytest.mark.django_db(transaction=True)

SHARED = Quota("billing", key=lambda i: i.get("account", "*"), limit=1)
QUOTA_KEY = reverse("admin:durable_singleton_run_quota_key")
QUEUES = reverse("admin:durable_singleton_run_queues")
KEY = reverse("admin:durable_singleton_run_queue_key")


def plain_and_keyed(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """An engine on the Django store and ``registry`` with the quota ``billing`` (limit 1,
    per account) carried by an unkeyed workflow ``plain`` and a keyed one ``keyed`` (key
    per store, limit 1), both holding until signalled; the admin reads ``billing`` from
    the process's declarations."""
    engine = make_engine("django", registry=registry)
    registry.add("plain", "1", holding_body([]), quotas=[SHARED])
    registry.add(
        "keyed",
        "1",
        holding_body([]),
        singleton=Singleton(key=lambda i: f"store:{i['store']}", limit=1),
        quotas=[SHARED],
    )
    monkeypatch.setitem(declared.quotas, "billing", SHARED)
    return engine


def assert_the_key_page_is_bounded(
    client: Client, engine: Engine, start: tuple[str, dict[str, Any]], page: tuple[str, dict[str, str]], most: Any
) -> None:
    """Section 6: 30 more waiters (``start``: workflow and input, run ids M0..M29) do not
    grow the queries of the admin key page ``page`` (its URL and parameters): its GET
    takes at most ``most`` (pytest-django's ``django_assert_max_num_queries(n)``, bound)
    and lists the 2 waiters before them and the 30."""
    for n in range(30):
        engine.start(*start, run_id=f"M{n}")
    drain(engine)
    with most:
        response = client.get(*page)
    assert response.content.decode().count('class="ds-waiter') == 32


@pytest.fixture
def shared(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """A quota ``billing`` (limit 1) carried by an unkeyed workflow ``plain`` and a keyed
    one ``keyed`` (key per store, limit 1): H (plain) holds acme's slot; W1 (keyed, store
    S1: a free slot of its key) and W2 (plain) wait for it, in that order."""
    engine = plain_and_keyed(registry, monkeypatch)
    engine.start("plain", {"account": "acme", "hold": True}, run_id="H")
    drain(engine)
    engine.start("keyed", {"account": "acme", "store": "S1"}, run_id="W1")
    engine.start("plain", {"account": "acme"}, run_id="W2")
    drain(engine)
    return engine


def test_a_quota_key_page_lists_holders_and_waiters_across_workflows(admin_client: Client, shared: Engine) -> None:
    """X3, X3d, K3: the quota key page lists the holder H (of workflow plain) and the waiters
    W1 (keyed) and W2 (plain) at positions 1 and 2, the positions explain gives, each
    "waiting for a quota"; the queue table's shared quotas link it."""
    html = admin_client.get(QUOTA_KEY, {"quota": "billing", "key": "acme"}).content.decode()
    holders, waiters = _rows_of(html, "holder"), _rows_of(html, "waiter")
    assert list(holders) == ["H"] and "plain" in holders["H"]
    assert list(waiters) == ["W1", "W2"], waiters
    assert 'data-position="1"' in html and "keyed" in waiters["W1"] and "store:<wbr>S1" in waiters["W1"]
    for run_id, position in (("W1", 1), ("W2", 2)):
        assert 'data-cause="needs_quota">waiting for a quota<' in waiters[run_id], waiters[run_id]
        explained = shared.explain(run_id)
        assert explained.quotas and explained.quotas[0].position == position
    queues = admin_client.get(QUEUES).content.decode()
    assert f'href="{QUOTA_KEY}?quota=billing&amp;key=acme"' in queues


def test_a_waiter_whose_key_is_free_names_the_quota_it_waits_for(admin_client: Client, shared: Engine) -> None:
    """X3d, S8a: W1's own key store:S1 has a free slot; its key page says it is waiting for a
    quota and links billing · acme (it read "waiting for a worker", and the queue table
    "0 holding · 1 waiting" with no cause); the queue table's row says why."""
    html = admin_client.get(KEY, {"workflow": "keyed", "key": "store:S1"}).content.decode()
    row = _rows_of(html, "waiter")["W1"]
    assert 'data-cause="needs_quota">waiting for a quota' in row, row
    assert f'href="{QUOTA_KEY}?quota=billing&amp;key=acme"' in row, row
    queues = admin_client.get(QUEUES, {"workflow": "keyed"}).content.decode()
    table_row = re.search(
        r'<tr class="ds-queue-row" data-workflow="keyed" data-key="store:S1">(.*?)</tr>', queues, re.S
    )
    assert table_row is not None and "1 waiting for a quota" in table_row[1], queues


def test_the_quota_key_page_costs_a_bounded_number_of_queries(
    admin_client: Client, shared: Engine, django_assert_max_num_queries: Any
) -> None:
    """Section 6: the page's queries do not grow with its waiters (no query per row)."""
    page = (QUOTA_KEY, {"quota": "billing", "key": "acme"})
    assert_the_key_page_is_bounded(
        admin_client, shared, ("plain", {"account": "acme"}), page, django_assert_max_num_queries(14)
    )


def _rows_of(html: str, kind: str) -> dict[str, str]:
    """Return the table rows of ``kind`` (holder or waiter) by run id."""
    return {
        m[1]: m[2]
        for m in re.finditer(rf'<tr class="ds-{kind}[^"]*" data-run-id="([^"]+)"[^>]*>(.*?)</tr>', html, re.S)
    }


def test_the_lanes_say_a_free_keys_waiter_waits_for_a_quota(admin_client: Client, shared: Engine) -> None:
    """X3d: the lane of store:S1 (no holder, one waiter) says that waiter waits for a shared
    quota, instead of a bare "0 holding · 1 waiting"."""
    html = admin_client.get(reverse("admin:durable_singleton_run_lanes"), {"workflow": "keyed"}).content.decode()
    assert "0 holding · 1 waiting (1 for a shared quota" in html, html


def test_a_quota_only_workflow_is_in_the_queue_pages_workflow_filter(
    admin_client: Client, shared: Engine, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X3, section 6: ``plain`` carries the quota and no singleton key; the queue page's
    workflow filter offers it, and choosing it lists the shared quota keys its runs carry
    (billing · acme), while a workflow without quotas lists none."""
    monkeypatch.setitem(declared.latest, "plain", registry.latest["plain"])  # the admin reads the process's registry
    html = admin_client.get(QUEUES).content.decode()
    assert re.search(r'href="\?workflow=plain"[^>]*>plain<', html), html
    chosen = admin_client.get(QUEUES, {"workflow": "plain"})
    assert [(i["row"].quota, i["row"].key) for i in chosen.context["quota_rows"]] == [("billing", "acme")]
    other = admin_client.get(QUEUES, {"workflow": "sync-inventory"})
    assert other.context["quota_rows"] == []
