"""Lanes of shared quota keys (issue #34 item 6): a quota key's lane draws every workflow's
holders and waiters of that key, each span from its run's admission in all its limits at once
(X3: ``admitted_at``), labelled with the quota's limit, counts and why its waiters wait (X3d,
K3); a quota-only workflow has lanes; the lanes page narrows to one quota with ``?quota=``;
its queries do not grow with the runs (section 6). On the Django store with its own claims,
settles and handoffs."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from durable_singleton import Quota, Singleton
from durable_singleton import lanes as read
from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as declared
from durable_singleton.engine import Engine
from durable_singleton.models import QuotaMembership, Run
from durable_singleton.queues import Cause
from durable_singleton.testing import make_engine
from tests.admin.test_quota_pages import SHARED, shared
from tests.helpers import drain, holding_body

__all__ = ["shared"]  # the fixture, imported for this module's tests

pytestmark = pytest.mark.django_db(transaction=True)

LANES = reverse("admin:durable_singleton_run_lanes")
QUOTA_KEY = reverse("admin:durable_singleton_run_quota_key")
POOL = Quota("pool", key=lambda i: "all", limit=3)


@pytest.fixture
def admin_registry(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The admin reads the process's registry: the test's workflows and quotas declared there."""
    for name, definition in registry.latest.items():
        monkeypatch.setitem(declared.latest, name, definition)
    for name, quota in registry.quotas.items():
        monkeypatch.setitem(declared.quotas, name, quota)
    return registry


def test_a_quota_only_workflow_has_the_lanes_of_its_quota_keys(shared: Engine, registry: Registry) -> None:
    """X3, K3: ``plain`` carries the quota billing and no singleton key; its lanes are the keys
    of billing: acme's lane holds H (plain) and has W1 (keyed, its own key store:S1 free) and
    W2 (plain) in line, in the quota's order, both behind the quota's holder. It had no lane."""
    lanes = read.workflow_lanes("plain", now=shared.store.now(), reg=registry)
    (lane,) = lanes.lanes
    assert (lane.quota, lane.key, lane.limit, lane.holders, lane.waiting) == ("billing", "acme", 1, 1, 2)
    assert [(h.run_id, h.end) for h in lane.holds] == [("H", None)]
    assert lane.waiters == ["W1", "W2"]
    assert {r: (m.workflow, m.singleton_key, m.cause) for r, m in lane.members.items()} == {
        "H": ("plain", None, None),
        "W1": ("keyed", "store:S1", Cause.NEEDS_QUOTA),
        "W2": ("plain", None, Cause.NEEDS_QUOTA),
    }
    assert lane.causes == {Cause.NEEDS_QUOTA: 2} and lane.not_due == 0
    # The keyed workflow's lanes: its own key, then the quota key it carries, the same lane.
    keyed = read.workflow_lanes("keyed", now=shared.store.now(), reg=registry)
    assert [(q.quota, q.key) for q in keyed.lanes] == [(None, "store:S1"), ("billing", "acme")]
    assert keyed.lanes[1].waiters == ["W1", "W2"]


def test_a_quota_lane_draws_each_span_from_the_runs_admission_and_the_handoffs(
    shared: Engine, registry: Registry
) -> None:
    """X3, X3h, S7: the holder H settles; the quota's handoff admits W1 (keyed), then W1's
    release admits W2 (plain). The quota lane draws three spans one after the other on one
    row, each from its run's ``admitted_at`` (its admission in every limit at once) to its
    ``finished_at``, and the two handoffs across workflows."""
    shared.signal("H", "go")
    drain(shared)
    lanes = read.quota_lanes("billing", now=shared.store.now(), reg=registry)
    (lane,) = lanes.lanes
    stored = {r: (a, f) for r, a, f in Run.objects.values_list("run_id", "admitted_at", "finished_at")}
    assert [(h.run_id, h.start, h.end) for h in lane.holds] == [
        (run_id, *stored[run_id]) for run_id in ("H", "W1", "W2")
    ]
    assert {h.slot for h in lane.holds} == {0} and lane.slots == 1
    assert [(h.released_by, h.admitted) for h in lane.handoffs] == [("H", "W1"), ("W1", "W2")]
    assert (lane.waiting, lane.waiters, lane.holders) == (0, [], 0)
    assert (lanes.quota, lanes.workflow) == ("billing", "")


def test_a_quota_lane_counts_its_waiters_by_cause(registry: Registry) -> None:
    """X3d, X5, S5: quota pool (limit 3): K0 (keyed, store S1) holds its key and a pool slot;
    K1 (store S1) is first in the pool's line within its free slots but waits for its own key;
    P1 (plain, no turn run yet) is second, within the free slots, and waits for a worker; P2
    and P3 wait behind the pool's holders; D (not_before in an hour) is not in line yet. Drawn
    with one waiter per lane, the counts are still exact (one query reads them)."""
    engine = make_engine("django", registry=registry)
    registry.add("plain", "1", holding_body([]), quotas=[POOL])
    registry.add(
        "keyed", "1", holding_body([]), singleton=Singleton(key=lambda i: f"store:{i['store']}"), quotas=[POOL]
    )
    engine.start("keyed", {"store": "S1", "hold": True}, run_id="K0")
    drain(engine)
    engine.start("keyed", {"store": "S1"}, run_id="K1")
    drain(engine)
    for run_id in ("P1", "P2", "P3"):
        engine.start("plain", {}, run_id=run_id)
    engine.start("plain", {}, run_id="D", not_before=3600.0)
    lanes = read.quota_lanes("pool", now=engine.store.now(), reg=registry, waiters_per_key=1)
    (lane,) = lanes.lanes
    assert (lane.limit, lane.holders, lane.waiting, lane.not_due) == (3, 1, 5, 1)
    assert lane.waiters == ["K1"] and lane.members["K1"].cause == Cause.NEEDS_KEY
    assert lane.causes == {Cause.NEEDS_KEY: 1, Cause.NEEDS_WORKER: 1, Cause.NEEDS_QUOTA: 2}
    full = read.quota_lanes("pool", now=engine.store.now(), reg=registry).lanes[0]
    assert [(r, full.members[r].cause) for r in full.waiters] == [
        ("K1", Cause.NEEDS_KEY),
        ("P1", Cause.NEEDS_WORKER),
        ("P2", Cause.NEEDS_QUOTA),
        ("P3", Cause.NEEDS_QUOTA),
    ]
    assert full.causes == lane.causes


# -- the admin page -------------------------------------------------------------------------------
def test_the_lanes_page_draws_a_quota_lane_labelled_with_its_limit_counts_and_cause(
    admin_client: Client, shared: Engine, admin_registry: Registry
) -> None:
    """X3, X3d, K3: ``?quota=billing`` draws acme's lane, named as a quota key and linked to its
    page, labelled "limit 1 · 1 holding · 2 waiting: 2 for a slot of the quota"; the holder's
    bar and the waiters' boxes name each run's workflow and own key, a box its cause. The
    quota-only workflow ``plain`` is offered and draws the same lane; ``billing`` is offered."""
    html = admin_client.get(LANES, {"quota": "billing"}).content.decode()
    lane = _lane(html, "billing", "acme")
    assert "quota billing · acme" in lane and f'href="{QUOTA_KEY}?quota=billing&amp;key=acme"' in lane
    assert "limit 1 · 1 holding · 2 waiting: 2 for a slot of the quota" in lane, lane
    assert re.search(r'data-run-id="H"[^>]*>.*?<title>H \(plain\): ', lane, re.S), lane
    for position, (run_id, whose) in enumerate((("W1", "keyed · store:S1"), ("W2", "plain")), 1):
        box = re.search(rf'<g class="ds-waiter" data-run-id="{run_id}" ([^>]*)>(.*?)</g>', lane, re.S)
        assert box is not None, lane
        assert f'data-position="{position}" data-cause="needs_quota"' in box[1], box[0]
        assert f"position {position}: {run_id} ({whose}), waiting for a quota" in box[2], box[0]
    assert "Lanes of the shared quota billing" in html
    picker = admin_client.get(LANES).content.decode()
    assert re.search(r'href="\?workflow=plain"', picker) and re.search(r'href="\?quota=billing"', picker), picker
    assert 'id="ds-lanes-quotas"' in picker and 'id="ds-lanes-svg"' not in picker  # a picker, no drawing
    by_workflow = admin_client.get(LANES, {"workflow": "plain"}).content.decode()
    assert _lane(by_workflow, "billing", "acme") and 'href="?workflow=plain&amp;quota=billing"' in by_workflow
    queues = admin_client.get(reverse("admin:durable_singleton_run_queues")).content.decode()
    assert f'href="{LANES}?quota=billing&amp;key=acme"' in queues
    page = admin_client.get(QUOTA_KEY, {"quota": "billing", "key": "acme"}).content.decode()
    assert f'href="{LANES}?quota=billing&amp;key=acme"' in page


def test_a_quota_name_no_column_can_hold_is_a_bad_request(admin_client: Client) -> None:
    """Section 7: ``?quota=`` is read through admin/params as every parameter is: NUL or
    overlong text answers 400, not a database error."""
    for value in ("bill\x00ing", "x" * 3000):
        assert admin_client.get(LANES, {"quota": value}).status_code == 400


def _bulk_quota(keys: int, waiters: int, now: datetime) -> None:
    """Insert, in bulk, the rows the store leaves for ``keys`` keys of quota billing: per key
    one plain holder (admitted a minute ago), one finished run (admitted and ended in the
    window) and ``waiters`` waiters, each with its membership (X3b)."""
    runs, members = [], []
    for k in range(keys):
        base = now - timedelta(minutes=2, seconds=k)
        kinds = ["finished", "holder"] + ["waiter"] * waiters
        for i, kind in enumerate(kinds):
            run_id = f"B{k}-{i}"
            created = base + timedelta(milliseconds=i)
            runs.append(
                Run(
                    run_id=run_id,
                    workflow_name="plain",
                    workflow_version="1",
                    status={"finished": "completed", "holder": "running", "waiter": "suspended"}[kind],
                    quota_slot=None if kind == "finished" else kind,
                    created_at=created,
                    updated_at=created,
                    admitted_at=None if kind == "waiter" else created + timedelta(seconds=1),
                    finished_at=created + timedelta(seconds=30) if kind == "finished" else None,
                    lease_owner="w" if kind == "holder" else None,
                    lease_expires_at=now + timedelta(seconds=30) if kind == "holder" else None,
                )
            )
            members.append(
                QuotaMembership(
                    run_id=run_id,
                    quota="billing",
                    key=f"acct-{k}",
                    slot=None if kind == "finished" else kind,
                    created_at=created,
                )
            )
    Run.objects.bulk_create(runs, batch_size=500)
    QuotaMembership.objects.bulk_create(members, batch_size=500)


def test_quota_lanes_cost_the_same_queries_with_ten_times_the_runs(
    admin_client: Client, registry: Registry, monkeypatch: pytest.MonkeyPatch, django_assert_max_num_queries: Any
) -> None:
    """Section 6 (no query per row), X3: the lanes page of a quota-only workflow and of a quota
    take as many queries with 40 quota keys and 1,680 runs as with 4 keys and 48: the busy
    keys and their controls, the spans, the first waiters with their counts by cause (four
    for the quota keys), beside the singleton keys' five, the session's and the clock's."""
    registry.add("plain", "1", holding_body([]), quotas=[SHARED])
    monkeypatch.setitem(declared.latest, "plain", registry.latest["plain"])  # the admin reads the process's
    monkeypatch.setitem(declared.quotas, "billing", SHARED)
    now = make_engine("django", registry=registry).store.now()
    _bulk_quota(4, 10, now)
    admin_client.get(LANES)  # the session's and the content type cache's first use
    urls = [f"{LANES}?workflow=plain&refresh=0", f"{LANES}?quota=billing&refresh=0"]
    small = [_queries(admin_client, url) for url in urls]
    Run.objects.all().delete()
    _bulk_quota(40, 40, now)
    assert Run.objects.count() == 40 * 42
    big = [_queries(admin_client, url) for url in urls]
    assert big == small, (small, big)
    with django_assert_max_num_queries(15):
        html = admin_client.get(urls[0]).content.decode()
    assert html.count('class="ds-lane ds-lane-quota"') == 30 and "more busy keys than shown" in html
    assert "limit 1 · 1 holding · 40 waiting: 40 for a slot of the quota" in html


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200, url
    return len(queries)


def _lane(html: str, quota: str, key: str) -> str:
    """Return the SVG group of the quota key's lane (empty if it is not drawn)."""
    found = re.search(rf'<g class="ds-lane[^"]*" data-key="{key}" data-quota="{quota}"[^>]*>(.*?)\n  </g>', html, re.S)
    return found[1] if found else ""
