"""The lanes of a workflow (issue #19 item 5): the read model (``durable_singleton.lanes``) and the
admin page that draws it as SVG, on the configured database with the store's own claims,
settles and handoffs (S5, S6, S7, K2)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError
from durable_singleton.lanes import MAX_MINUTES, workflow_lanes
from durable_singleton.runtime import get_engine
from tests.admin.test_admin_pages import CAPPED, KEY, QUEUES, WIDE, start_queue
from tests.factories import RunFactory
from tests.helpers import settle

pytestmark = pytest.mark.django_db(transaction=True)

LANES = reverse("admin:durable_singleton_run_lanes")


@pytest.fixture
def engine(settings: Any) -> Iterator[Engine]:
    """The default engine with a manual dispatcher: turns wait until the test drains them."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()
    yield engine
    engine.dispatcher.queue.clear()


def test_a_lane_shows_the_holder_the_waiters_in_order_and_the_handoff(engine: Engine) -> None:
    """S5, S7: one holder and two waiters draw one lane: the holder's span open at now, the
    waiters by position in admission order. When the holder settles, the store hands its slot
    to the first waiter: its span closes at the release, the waiter's opens, and the lane marks
    the handoff between the two."""
    start_queue(engine, CAPPED, "L", 3, admit=1)
    lanes = workflow_lanes(CAPPED, now=engine.now(), minutes=5)
    (lane,) = lanes.lanes
    assert (lane.key, lane.limit, lane.holders, lane.waiting) == ("store:L", 1, 1, 2)
    assert [(h.run_id, h.end) for h in lane.holds] == [("L-0", None)]
    assert lane.waiters == ["L-1", "L-2"]
    assert lane.handoffs == []

    assert settle(engine, "L-0", "completed")
    lanes = workflow_lanes(CAPPED, now=engine.now(), minutes=5)
    (lane,) = lanes.lanes
    first, second = lane.holds
    assert (first.run_id, second.run_id, second.end) == ("L-0", "L-1", None)
    assert first.end is not None and first.end <= second.start
    assert [(h.released_by, h.admitted) for h in lane.handoffs] == [("L-0", "L-1")]
    assert lane.waiters == ["L-2"] and lane.waiting == 1
    assert [h.run_id for h in lane.admissions(lanes.start)] == ["L-0", "L-1"]
    assert first.slot == second.slot == 0


def test_overlapping_holders_of_a_wider_key_take_a_row_each(engine: Engine) -> None:
    """S5: a key with limit 2 and two holders draws two rows; the waiter behind them is position 1."""
    start_queue(engine, WIDE, "W", 3, admit=2)
    (lane,) = workflow_lanes(WIDE, now=engine.now()).lanes
    assert lane.limit == lane.slots == 2
    assert sorted(h.slot for h in lane.holds) == [0, 1]
    assert lane.waiters == ["W-2"]


def test_the_window_leaves_out_runs_that_finished_before_it() -> None:
    """A run that held the key and finished before the window began draws nothing; one that
    finished inside it draws a closed span, its key a lane with no waiter."""
    now = get_engine().now()
    for run_id, ago in (("old", 20), ("recent", 2)):
        RunFactory(
            run_id=run_id,
            workflow_name=CAPPED,
            singleton_key="store:Q",
            finished=True,
            created_at=now - timedelta(minutes=ago, seconds=5),
            admitted_at=now - timedelta(minutes=ago, seconds=4),
            finished_at=now - timedelta(minutes=ago),
        )
    (lane,) = workflow_lanes(CAPPED, now=now, minutes=10).lanes
    assert [h.run_id for h in lane.holds] == ["recent"]
    assert (lane.waiting, lane.waiters) == (0, [])
    assert [h.run_id for h in workflow_lanes(CAPPED, now=now, minutes=30).lanes[0].holds] == ["old", "recent"]


def test_a_handoff_stamped_by_two_clocks_stays_on_one_row() -> None:
    """S7: the release's ``finished_at`` (the store's clock, microseconds) may be stamped a fraction
    of a millisecond after the admission's ``admitted_at`` (SQLite's clock, milliseconds): the two
    spans still follow one another on the key's one row, joined by the handoff."""
    now = get_engine().now()
    released = now - timedelta(seconds=5)
    on_key = {"workflow_name": CAPPED, "singleton_key": "store:H"}
    RunFactory(
        run_id="before",
        finished=True,
        created_at=released - timedelta(seconds=3),
        admitted_at=released - timedelta(seconds=2),
        finished_at=released,
        **on_key,
    )
    RunFactory(
        run_id="after",
        holder=True,
        created_at=released - timedelta(seconds=1),
        admitted_at=released - timedelta(microseconds=400),
        **on_key,
    )
    (lane,) = workflow_lanes(CAPPED, now=now).lanes
    assert [(h.run_id, h.slot) for h in lane.holds] == [("before", 0), ("after", 0)]
    assert lane.slots == 1
    assert [(h.released_by, h.admitted) for h in lane.handoffs] == [("before", "after")]


@pytest.mark.parametrize("minutes", [0, MAX_MINUTES + 1, -3])
def test_a_window_out_of_bounds_is_refused(minutes: int) -> None:
    """Bad input: a typed error naming the bounds, nothing read."""
    with pytest.raises(InvalidInputError, match=f"from 1 to {MAX_MINUTES}"):
        workflow_lanes(CAPPED, now=get_engine().now(), minutes=minutes)


def test_lanes_cost_a_bounded_number_of_queries(engine: Engine, django_assert_max_num_queries: Any) -> None:
    """Five queries whatever the number of keys and runs: the busy keys and their totals, their
    controls (K2), holders and first waiters (two), and the spans of the window."""
    for store in ("A", "B", "C", "D"):
        start_queue(engine, WIDE, store, 4, admit=2)
    now = engine.now()
    with django_assert_max_num_queries(5):
        lanes = workflow_lanes(WIDE, now=now, max_keys=3)
    assert len(lanes.lanes) == 3 and lanes.more_keys


# -- the admin page -------------------------------------------------------------------------------
def test_the_lanes_page_draws_bars_waiters_and_handoffs_as_svg(admin_client: Client, engine: Engine) -> None:
    """Issue #19 item 5: the page draws a bar per holder and a numbered box per waiter, with the
    run ids; ``?fragment=1`` is the drawing alone (what the page fetches to redraw in place)."""
    start_queue(engine, CAPPED, "P", 3, admit=1)
    assert settle(engine, "P-0", "completed")
    html = admin_client.get(LANES, {"workflow": CAPPED}).content.decode()
    assert '<svg id="ds-lanes-svg"' in html and 'data-key="store:P"' in html
    assert re.search(r'class="ds-hold ds-hold-completed" data-run-id="P-0"', html)
    assert re.search(r'class="ds-hold ds-hold-\w+" data-run-id="P-1" data-state="\w+" data-holding="1"', html)
    assert 'class="ds-waiter" data-run-id="P-2" data-position="1"' in html
    assert 'class="ds-handoff" data-from="P-0" data-to="P-1"' in html
    assert 'class="ds-admit" data-run-id="P-1"' in html
    fragment = admin_client.get(LANES, {"workflow": CAPPED, "fragment": "1"}).content.decode()
    assert "<svg" in fragment and "<html" not in fragment and 'data-position="1"' in fragment


def test_the_window_is_a_bounded_query_parameter(admin_client: Client, engine: Engine) -> None:
    """``?minutes=N`` picks the window; it is held to 1 to 60 and a non-number means the default."""
    start_queue(engine, CAPPED, "M", 1, admit=1)
    for asked, shown in (("5", "5"), ("600", "60"), ("0", "1"), ("soon", "10")):
        html = admin_client.get(LANES, {"workflow": CAPPED, "minutes": asked}).content.decode()
        assert f"over the last {shown} minutes" in html, asked


def test_lanes_are_linked_from_the_queue_table_and_each_key_page(admin_client: Client, engine: Engine) -> None:
    """The queue table links the lanes page and each row its workflow's lanes; a key's page links
    its workflow's lanes with the key first."""
    start_queue(engine, CAPPED, "K", 2, admit=1)
    queues = admin_client.get(QUEUES).content.decode()
    assert f'href="{LANES}?workflow=sync-inventory&amp;key=store%3AK"' in queues
    assert 'id="ds-lanes-link"' in queues
    page = admin_client.get(f"{KEY}?workflow={CAPPED}&key=store:K").content.decode()
    assert f'href="{LANES}?workflow=sync-inventory&amp;key=store%3AK"' in page


def test_view_only_staff_see_the_lanes_and_others_do_not(client: Client, django_user_model: Any) -> None:
    """The page needs the run's view permission, as the queue pages do."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("watcher", password="pw", is_staff=True)
    client.force_login(user)
    assert client.get(LANES, {"workflow": CAPPED}).status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="view_run"))
    assert client.get(LANES, {"workflow": CAPPED}).status_code == 200
    client.logout()
    assert client.get(LANES).status_code == 302
