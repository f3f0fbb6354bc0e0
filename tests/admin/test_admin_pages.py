"""The admin: read-only run pages, the queue pages, engine actions, permissions and query counts
(issue #5; SPEC section 6, S5, S7, S12, S15, D6, D9, F11, F12)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from durable_singleton.admin import ActionLocation
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine
from durable_singleton.stores.base import AdmissionResult
from durable_singleton.testing import make_engine
from testproject.inventory.models import BodyAudit
from tests.admin.test_queue_queries import claim
from tests.factories import T0, SignalFactory, StepFactory, bulk_queue
from tests.helpers import settle

# Real commits: the engine dispatches turns and pushes releases after commit (S7).
pytestmark = pytest.mark.django_db(transaction=True)

RUNS = reverse("admin:durable_singleton_run_changelist")
QUEUES = reverse("admin:durable_singleton_run_queues")
KEY = reverse("admin:durable_singleton_run_queue_key")
WIDE = "sync-inventory-wide"  # testproject: limit 2, no cap
CAPPED = "sync-inventory"  # testproject: limit 1, max_queue_depth 2
CHANGE_FORM_ACTIONS = ActionLocation is not None  # Django 6.1+


def change_url(run_id: str) -> str:
    return reverse("admin:durable_singleton_run_change", args=[run_id])


def key_url(workflow: str, key: str) -> str:
    return f"{KEY}?workflow={workflow}&key={key}"


@pytest.fixture
def admin_engine(settings: Any) -> Iterator[Engine]:
    """The default engine (what the admin's actions call), with a manual dispatcher: turns
    queue up until the test drains them."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()
    engine.dispatcher.sent.clear()
    yield engine
    engine.dispatcher.queue.clear()


def start_queue(engine: Engine, workflow: str, store: str, n: int, *, admit: int, sleeping: bool = False) -> list[str]:
    """Start ``n`` runs of ``workflow`` for ``store`` (key ``store:<store>``); the first
    ``admit`` take a slot through the store's claim (and, if ``sleeping``, park as a holder
    that sleeps, D1), the others are claimed and parked as waiters."""
    ids = [f"{store}-{i}" for i in range(n)]
    for run_id in ids:
        engine.start(workflow, {"store_id": store, "duration": 0}, run_id=run_id)
    limit = engine.registry.get(workflow).singleton.limit
    for i, run_id in enumerate(ids):
        verdict = claim(engine, run_id, limit)
        assert verdict is (AdmissionResult.ADMITTED if i < admit else AdmissionResult.PARKED)
        if sleeping and i < admit:
            owner = Run.objects.get(pk=run_id).lease_owner
            later = engine.now() + timedelta(hours=1)
            assert engine.store.park(run_id, owner, "suspended", wake_at=later, reason="sleep") == "parked"
    engine.dispatcher.queue.clear()
    engine.dispatcher.sent.clear()
    return ids


def staff(django_user_model: Any, name: str, *perms: str) -> Any:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="durable_singleton", codename__in=perms)
    )
    return user


@pytest.fixture
def viewer_client(client: Client, django_user_model: Any) -> Client:
    client.force_login(staff(django_user_model, "viewer", "view_run"))
    return client


@pytest.fixture
def operator_client(client: Client, django_user_model: Any) -> Client:
    client.force_login(staff(django_user_model, "operator", "view_run", "change_run"))
    return client


def listed(response: Any) -> list[str]:
    return [run.run_id for run in response.context["cl"].result_list]


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# -- the run list and the run page ---------------------------------------------------------------


def test_run_list_filters_by_workflow_status_namespace_key_and_slot(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 1: filters for workflow, status, namespace and key (and slot)."""
    start_queue(admin_engine, WIDE, "A", 3, admit=2)
    start_queue(admin_engine, CAPPED, "B", 2, admit=1)
    other = make_engine("django", namespace="tenant-b")
    other.start(WIDE, {"store_id": "C"}, run_id="C-0")
    assert set(listed(admin_client.get(RUNS))) == {"A-0", "A-1", "A-2", "B-0", "B-1", "C-0"}
    assert set(listed(admin_client.get(RUNS, {"workflow_name": CAPPED}))) == {"B-0", "B-1"}
    assert set(listed(admin_client.get(RUNS, {"status__exact": "suspended"}))) == {"A-2", "B-1"}
    assert listed(admin_client.get(RUNS, {"namespace__exact": "tenant-b"})) == ["C-0"]
    assert set(listed(admin_client.get(RUNS, {"singleton_key": "store:A"}))) == {"A-0", "A-1", "A-2"}
    assert set(listed(admin_client.get(RUNS, {"singleton_slot__exact": "holder"}))) == {"A-0", "A-1", "B-0"}
    response = admin_client.get(RUNS, {"singleton_key": "store:B", "status__exact": "running"})
    assert listed(response) == ["B-0"]
    assert b'value="store:B"' in response.content  # the key box keeps its value


def test_run_list_searches_run_id_and_key_and_shows_tags(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 1: search by run id and key; caller tags, the key tag and the markers are shown (S1, S12)."""
    admin_engine.start(WIDE, {"store_id": "north"}, run_id="run-alpha", tags=["nightly"])
    admin_engine.start(WIDE, {"store_id": "south"}, run_id="run-beta")
    assert claim(admin_engine, "run-alpha", 2) is AdmissionResult.ADMITTED
    assert listed(admin_client.get(RUNS, {"q": "alpha"})) == ["run-alpha"]
    assert listed(admin_client.get(RUNS, {"q": "store:south"})) == ["run-beta"]
    html = admin_client.get(RUNS, {"q": "alpha"}).content.decode()
    for tag in ("nightly", "singleton:store:north", "durable:singleton:tracked", "durable:singleton:admitted"):
        assert f">{tag}</span>" in html.replace("<wbr>", "")
    beta = admin_client.get(RUNS, {"q": "beta"}).content.decode()
    assert "durable:singleton:admitted" not in beta and "durable:singleton:tracked" in beta


def test_run_page_shows_data_steps_signals_lease_and_holder_since(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 1: input, output, error, steps with times, buffered signals, lease owner and
    expiry, wake_at, and a holder's place: holder since when (R4, R5, D2)."""
    start_queue(admin_engine, WIDE, "A", 1, admit=1)
    run = Run.objects.get(pk="A-0")
    store = admin_engine.store
    StepFactory(
        run=run, position=0, name="inventory:fetch", result=[{"sku": "A-1"}], finished_at=T0 + timedelta(seconds=2)
    )
    admin_engine.signal("A-0", "approve", {"by": "ops"})
    admin_engine.signal("A-0", "approve", {"by": "second"})
    first = store.load_signals("A-0")[0]
    StepFactory(run=run, position=1, name="durable:signal", result={"seq": first.seq, "payload": {}}, finished_at=T0)
    html = admin_client.get(change_url("A-0")).content.decode()
    assert "&quot;store_id&quot;: &quot;A&quot;" in html  # input, pretty JSON
    assert "2 steps" in html and "inventory:fetch" in html and "2.000" in html
    assert "2 signals" in html and "(1 buffered)" in html
    assert "consumed" in html and "&quot;by&quot;: &quot;second&quot;" in html
    assert run.lease_owner in html and "lease expires" in html.lower() and "valid" in html
    assert "Wake at" in html or "wake at" in html
    assert re.search(r"holder</a> since <time datetime=\"[^\"]+\">", html)


def test_run_page_names_a_waiters_position_and_holders(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 1, S5: a waiter's page says "position N behind holders X, Y"."""
    start_queue(admin_engine, WIDE, "A", 4, admit=2)
    html = admin_client.get(change_url("A-3")).content.decode()
    text = re.sub(r"<[^>]+>", "", html)
    assert "position 2 behind holders A-0, A-1" in text
    settle(admin_engine, "A-0", "failed", error={"code": "boom"})
    finished = admin_client.get(change_url("A-0")).content.decode()
    assert "no slot: the run has finished" in finished
    assert "&quot;code&quot;: &quot;boom&quot;" in finished  # the error


def test_runs_cannot_be_added_or_freely_edited(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 1: runs are written by the engine: no add page, no save button, a saving POST is refused."""
    start_queue(admin_engine, WIDE, "A", 1, admit=1)
    assert admin_client.get(reverse("admin:durable_singleton_run_add")).status_code == 403
    page = admin_client.get(change_url("A-0"))
    assert page.status_code == 200 and b'name="_save"' not in page.content and b'name="_continue"' not in page.content
    before = Run.objects.get(pk="A-0")
    response = admin_client.post(change_url("A-0"), {"_save": "1", "status": "completed", "namespace": "x"})
    assert response.status_code == 403
    after = Run.objects.get(pk="A-0")
    assert (after.status, after.namespace, after.updated_at) == (before.status, before.namespace, before.updated_at)


# -- the queue pages -------------------------------------------------------------------------------


def test_queues_page_lists_keys_with_limit_holders_waiting_age_cap_and_fullness(
    admin_client: Client, admin_engine: Engine
) -> None:
    """Issue #5 point 2 and S15: every workflow and key with active runs; the cap comes from the
    registered definition and fullness counts toward limit + max_queue_depth."""
    start_queue(admin_engine, WIDE, "A", 5, admit=2)
    start_queue(admin_engine, CAPPED, "B", 3, admit=1)
    response = admin_client.get(QUEUES)
    assert response.status_code == 200
    assert response.templates[0].name == "admin/durable_singleton/queues.html"
    rows = {(r["row"].workflow, r["row"].key): r for r in response.context["rows"]}
    wide, capped = rows[WIDE, "store:A"]["row"], rows[CAPPED, "store:B"]["row"]
    assert (wide.limit, wide.holders, wide.waiting, wide.capacity) == (2, 2, 3, None)
    assert (capped.limit, capped.holders, capped.waiting, capped.max_queue_depth, capped.fullness) == (1, 1, 2, 2, 1.0)
    assert rows[CAPPED, "store:B"]["fullness_pct"] == 100
    html = response.content.decode()
    assert 'data-key="store:A"' in html and "3/3" in html and "no cap" in html
    assert [r["row"].key for r in admin_client.get(QUEUES, {"o": "waiting"}).context["rows"]] == ["store:B", "store:A"]
    assert [r["row"].key for r in admin_client.get(QUEUES, {"only": "full"}).context["rows"]] == ["store:B"]
    assert [r["row"].key for r in admin_client.get(QUEUES, {"workflow": WIDE}).context["rows"]] == ["store:A"]
    assert [r["row"].key for r in admin_client.get(QUEUES, {"q": ":B"}).context["rows"]] == ["store:B"]
    past_the_end = admin_client.get(QUEUES, {"p": "9"})
    assert past_the_end.context["page_number"] == 1 and len(past_the_end.context["rows"]) == 2


def test_key_page_lists_holders_and_waiters_in_admission_order(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 2, S5 step 3: holders, then waiters with positions in (created_at, run_id) order."""
    start_queue(admin_engine, WIDE, "A", 5, admit=2)
    response = admin_client.get(key_url(WIDE, "store:A"))
    assert [h["run"].run_id for h in response.context["holders"]] == ["A-0", "A-1"]
    assert [(w["position"], w["run"].run_id) for w in response.context["waiters"]] == [
        (1, "A-2"),
        (2, "A-3"),
        (3, "A-4"),
    ]
    html = response.content.decode()
    assert html.index('data-run-id="A-2"') < html.index('data-run-id="A-3"') < html.index('data-run-id="A-4"')
    assert admin_client.get(KEY).status_code == 302  # no key named: back to the queue table
    assert admin_client.get(key_url(WIDE, "store:A") + "&p=7").context["waiters"][0]["position"] == 1


def test_queue_pages_refresh_themselves_unless_paused(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 2: the page refreshes itself while open (a small fetch script); ?refresh=0 stops it."""
    start_queue(admin_engine, WIDE, "A", 1, admit=1)
    for url in (QUEUES, key_url(WIDE, "store:A")):
        live = admin_client.get(url).content.decode()
        assert 'id="ds-live"' in live and "window.setInterval(refresh" in live
        sep = "&" if "?" in url else "?"
        assert "window.setInterval" not in admin_client.get(f"{url}{sep}refresh=0").content.decode()


def _page_queries(client: Client, keys: int) -> dict[str, int]:
    counts = {}
    for name, url in (
        ("queues", QUEUES),
        ("queues, sorted and filtered", f"{QUEUES}?o=-fullness&only=waiting&q=store&p=2"),
        ("key page", key_url(WIDE, "store:long")),
        ("key page 2", key_url(WIDE, "store:long") + "&p=2"),
        ("run list", RUNS),
        ("run page (waiter)", change_url(f"{WIDE}-store:long-{keys + 1}")),
        ("run page (holder)", change_url(f"{WIDE}-store:long-0")),
    ):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200, url
        counts[name] = len(queries)
    return counts


def test_queue_pages_run_a_bounded_number_of_queries(
    admin_client: Client, django_assert_max_num_queries: Callable[..., Any]
) -> None:
    """Issue #5 point 5: no query per row. The queue table, a key's page, the run list and a run's
    page take as many queries with 420 keys (2,100 active runs, 420 waiters on one key) as with 120."""
    bulk_queue([f"store:{n}" for n in range(120)], workflow=WIDE, holders=2, waiters=3, limit=2)
    bulk_queue(
        ["store:long"], workflow=WIDE, holders=2, waiters=120, legacy_holders=1, limit=2, start=T0 - timedelta(1)
    )
    admin_client.get(change_url(f"{WIDE}-store:0-0"))  # the session's and the content type cache's first use
    small = _page_queries(admin_client, 120)
    Run.objects.filter(singleton_key="store:long").delete()
    bulk_queue([f"store:{n}" for n in range(120, 420)], workflow=WIDE, holders=2, waiters=3, limit=2)
    bulk_queue(
        ["store:long"], workflow=WIDE, holders=2, waiters=420, legacy_holders=1, limit=2, start=T0 - timedelta(1)
    )
    assert Run.objects.count() > 2500
    big = _page_queries(admin_client, 420)
    assert big == small
    # session, user, the grouped queue query, the keys' controls (K2), the quota keys' grouped query (X3j),
    # the throttle keys' grouped query (X6)
    with django_assert_max_num_queries(6):
        admin_client.get(QUEUES)
    # session, user, holders, waiting count, a page of waiters, the key's controls row; then
    # the first waiter's explanation (K3): the run, the oldest holders, depth and position,
    # the key's controls, recent durations; the controls panel (K2): the key's state and its
    # last changes; the engine's clock reading the database's clock (once per engine
    # every 5 minutes, R5); and the database's clock, on which the page and the explanation
    # judge leases and wake times (R5, K3: one query each off SQLite)
    with django_assert_max_num_queries(16):
        admin_client.get(key_url(WIDE, "store:long"))


# -- actions and permissions -----------------------------------------------------------------------


def post_action(client: Client, url: str, action: str, ids: list[str], **extra: Any) -> Any:
    return client.post(url, {"action": action, "_selected_action": ids, "index": 0, **extra}, follow=True)


def test_cancel_a_waiter_from_the_run_list(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 3, D6, F11: cancelling a waiter through the engine; it is cancelled at once and its
    body never runs; the report uses message_user."""
    start_queue(admin_engine, CAPPED, "A", 3, admit=1)
    response = post_action(admin_client, RUNS, "cancel_runs", ["A-1"])
    assert messages_of(response) == ["Cancelled 1 run."]
    assert Run.objects.get(pk="A-1").status == "cancelled"
    assert settle(admin_engine, "A-0", "completed")
    admin_engine.release(admin_engine.get("A-0"))
    admin_engine.dispatcher.drain()
    assert Run.objects.get(pk="A-2").status == "completed"
    assert not BodyAudit.objects.filter(run_id="A-1").exists()
    again = post_action(admin_client, RUNS, "cancel_runs", ["A-1", "A-2"])
    assert messages_of(again) == ["Skipped 2 runs that have already finished."]


def test_cancel_the_holder_from_the_key_page_admits_the_next_waiter(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 3, S7, F12: cancelling a sleeping holder from its key's page releases the slot
    at once: the oldest waiter is pushed and admitted; the page redirects back to the key."""
    start_queue(admin_engine, CAPPED, "A", 3, admit=1, sleeping=True)
    url = key_url(CAPPED, "store:A")
    response = post_action(admin_client, url, "cancel_runs", ["A-0"])
    assert response.redirect_chain[-1][0].endswith(url.split("/admin/durable_singleton/run/")[1])
    assert messages_of(response) == ["Cancelled 1 run."]
    assert Run.objects.get(pk="A-0").status == "cancelled"
    assert admin_engine.dispatcher.sent == ["A-1"]
    admin_engine.dispatcher.drain()
    assert [Run.objects.get(pk=r).status for r in ("A-1", "A-2")] == ["completed", "completed"]


def test_retry_from_the_run_page_and_wake_from_the_list(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 3, D9: retry sends a failed run back through admission as a waiter; wake
    dispatches a parked run now; runs in the wrong state are skipped and reported."""
    start_queue(admin_engine, WIDE, "A", 3, admit=2)
    settle(admin_engine, "A-0", "failed", error={"code": "boom"})
    form_action = {"CHANGE_FORM-action": "retry_runs", "_selected_action": ["A-0"], "index": 0}
    if CHANGE_FORM_ACTIONS:
        response = admin_client.post(change_url("A-0"), form_action, follow=True)
    else:  # Django < 6.1: no actions on a run's page, and such a POST saves nothing
        assert admin_client.post(change_url("A-0"), form_action).status_code == 403
        response = post_action(admin_client, RUNS, "retry_runs", ["A-0"])
    assert messages_of(response) == ["Retried 1 run."]
    retried = Run.objects.get(pk="A-0")
    assert (retried.status, retried.singleton_slot, retried.singleton_key) == ("pending", "waiter", "store:A")
    admin_engine.dispatcher.sent.clear()
    response = post_action(admin_client, RUNS, "wake_runs", ["A-1", "A-2"])
    assert messages_of(response) == ["Woke 1 run.", "Skipped 1 run that is not parked."]
    assert admin_engine.dispatcher.sent == ["A-2"]


def test_view_only_staff_see_everything_and_act_on_nothing(viewer_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 3: the view permission shows every page, with no action; POSTs change nothing."""
    start_queue(admin_engine, CAPPED, "A", 2, admit=1)
    for url in (RUNS, QUEUES, key_url(CAPPED, "store:A"), change_url("A-1")):
        response = viewer_client.get(url)
        assert response.status_code == 200, url
        assert b"cancel_runs" not in response.content and b'class="action-select"' not in response.content, url
    assert (
        viewer_client.post(
            key_url(CAPPED, "store:A"), {"action": "cancel_runs", "_selected_action": ["A-1"], "index": 0}
        ).status_code
        == 403
    )
    form_post = {"CHANGE_FORM-action": "cancel_runs", "_selected_action": ["A-1"], "index": 0}
    assert viewer_client.post(change_url("A-1"), form_post).status_code == 403
    viewer_client.post(RUNS, {"action": "cancel_runs", "_selected_action": ["A-1"], "index": 0})
    assert Run.objects.get(pk="A-1").status == "suspended"


def test_change_permission_is_needed_to_act(operator_client: Client, admin_engine: Engine) -> None:
    """Issue #5 point 3: staff with the change permission (not superusers) get the engine actions."""
    start_queue(admin_engine, CAPPED, "A", 2, admit=1)
    page = operator_client.get(key_url(CAPPED, "store:A")).content.decode()
    assert 'value="cancel_runs"' in page and 'class="action-select"' in page and "delete_selected" not in page
    response = post_action(operator_client, key_url(CAPPED, "store:A"), "cancel_runs", ["A-1"])
    assert messages_of(response) == ["Cancelled 1 run."]


def test_actions_need_a_csrf_token(django_user_model: Any, admin_engine: Engine) -> None:
    """Issue #5 point 3: CSRF as Django does it: a POST without the token is refused."""
    start_queue(admin_engine, CAPPED, "A", 2, admit=1)
    client = Client(enforce_csrf_checks=True)
    client.force_login(django_user_model.objects.create_superuser("root", password="pw"))
    url = key_url(CAPPED, "store:A")
    data = {"action": "cancel_runs", "_selected_action": ["A-1"], "index": 0}
    assert client.post(url, data).status_code == 403
    assert Run.objects.get(pk="A-1").status == "suspended"
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', client.get(url).content.decode())
    assert token is not None
    assert client.post(url, {**data, "csrfmiddlewaretoken": token.group(1)}).status_code == 302
    assert Run.objects.get(pk="A-1").status == "cancelled"


def test_deleting_a_holder_in_the_admin_frees_its_slot(admin_client: Client, admin_engine: Engine) -> None:
    """F12: deleting a holder's row through the admin releases its slot (S7): the next waiter is pushed."""
    start_queue(admin_engine, CAPPED, "A", 2, admit=1)
    response = admin_client.post(reverse("admin:durable_singleton_run_delete", args=["A-0"]), {"post": "yes"})
    assert response.status_code == 302
    assert not Run.objects.filter(pk="A-0").exists()
    assert admin_engine.dispatcher.sent == ["A-1"]
    admin_engine.dispatcher.drain()
    assert Run.objects.get(pk="A-1").status == "completed"


# -- what a new user reads: waiting, the backlog wake, the holder's step (issue #10 item 8) --------


def row_of(html: str, run_id: str) -> str:
    """Return the run list's (or a queue page's) table row of ``run_id``."""
    rows = re.findall(r"<tr[^>]*>.*?</tr>", html, flags=re.S)
    found = [r for r in rows if f'class="ds-run-id" title="{run_id}"' in r or f'data-run-id="{run_id}"' in r]
    assert found, f"no row for {run_id}"
    return found[0]


def test_waiters_read_waiting_whatever_their_stored_status(admin_client: Client, admin_engine: Engine) -> None:
    """S5: pending runs are in line from creation, parked ones too; both read "waiting" on the run
    list, the run page and the key page, with the stored status in the tooltip. Holders read as stored."""
    start_queue(admin_engine, WIDE, "W", 3, admit=2)  # W-2 parked: suspended
    admin_engine.start(WIDE, {"store_id": "W"}, run_id="W-new")  # not yet claimed: pending
    assert Run.objects.get(pk="W-2").status == "suspended" and Run.objects.get(pk="W-new").status == "pending"
    page = admin_client.get(RUNS).content.decode()
    for run_id, stored in (("W-2", "suspended"), ("W-new", "pending")):
        row = row_of(page, run_id)
        assert ">waiting</span>" in row and f"stored status: {stored}" in row, row
        assert ">waiting</span>" in admin_client.get(change_url(run_id)).content.decode()
    holder = re.sub(r"<[^>]+>", " ", row_of(page, "W-0"))
    assert "running holder" in " ".join(holder.split()) and "waiting" not in holder
    key_page = admin_client.get(key_url(WIDE, "store:W")).content.decode()
    assert ">waiting</span>" in row_of(key_page, "W-2") and ">waiting</span>" in row_of(key_page, "W-new")


def test_a_backlog_waiters_late_wake_is_explained_where_shown(admin_client: Client, admin_engine: Engine) -> None:
    """S8a: a start behind limit holders and limit waiters is parked with a wake an hour away; the
    run list marks that time as the fallback, the run page and the key page say why and that a
    release (S7) or the tick's catch-up admits it sooner. A near retry is shown plainly."""
    start_queue(admin_engine, WIDE, "B", 4, admit=2)  # 2 holders, 2 waiters retrying in about 1 s
    admin_engine.start(WIDE, {"store_id": "B"}, run_id="B-deep")
    deep = Run.objects.get(pk="B-deep")
    assert deep.park_reason == "singleton" and deep.wake_at - deep.created_at > timedelta(minutes=30)
    page = admin_client.get(RUNS).content.decode()
    assert ">fallback</span>" in row_of(page, "B-deep") and "S8a" in row_of(page, "B-deep")
    assert "fallback" not in row_of(page, "B-2")
    run_page = admin_client.get(change_url("B-deep")).content.decode()
    assert "help ds-backlog-help" in run_page and "the release of a holder wakes the next waiters at once" in run_page
    assert "help ds-backlog-help" not in admin_client.get(change_url("B-2")).content.decode()
    key_page = admin_client.get(key_url(WIDE, "store:B")).content.decode()
    assert "at a release" in row_of(key_page, "B-deep") and "help ds-backlog-help" in key_page


def test_the_step_a_holder_is_running_is_shown(admin_client: Client, admin_engine: Engine) -> None:
    """R4, D1, D2: a running holder shows the step it is in (finished steps + 1) and the last one
    finished, on the key page and its own page; a parked holder says why (sleeping, a signal)."""
    start_queue(admin_engine, WIDE, "S", 2, admit=2)
    holder = Run.objects.get(pk="S-0")
    StepFactory(run=holder, position=0, name="inventory:fetch")
    StepFactory(run=holder, position=1, name="inventory:reconcile")
    SignalFactory(run=holder, name="approve")
    second = Run.objects.get(pk="S-1")
    later = admin_engine.now() + timedelta(minutes=5)
    assert (
        admin_engine.store.park("S-1", second.lease_owner, "suspended", wake_at=later, reason="signal:approve")
        == "parked"
    )
    key_page = admin_client.get(key_url(WIDE, "store:S")).content.decode()
    text = re.sub(r"<[^>]+>", "", row_of(key_page, "S-0"))
    assert "running step 3 (2 done, last: inventory:reconcile)" in text, text
    assert "waiting for signal approve" in row_of(key_page, "S-1")
    run_page = re.sub(r"<[^>]+>", "", admin_client.get(change_url("S-0")).content.decode())
    assert "running step 3 (2 done, last: inventory:reconcile)" in run_page and "(1 buffered)" in run_page
    start_queue(admin_engine, CAPPED, "Z", 1, admit=1, sleeping=True)
    assert "sleeping until" in row_of(admin_client.get(key_url(CAPPED, "store:Z")).content.decode(), "Z-0")


def test_long_names_break_after_separators_and_stay_escaped() -> None:
    """Issue #19 item 4: a name gets a line-break opportunity after each separator and every
    8 digits of a uuid's hex, never elsewhere, and its text stays escaped."""
    from durable_singleton.admin.display import breakable

    assert breakable("task:inventory.tasks.sync_store") == "task:<wbr>inventory.<wbr>tasks.<wbr>sync_<wbr>store"
    assert breakable("store:<b>") == "store:<wbr>&lt;b&gt;"
    assert breakable("3f9a0c1d2e4b4c5d8e9f0a1b2c3d4e5f") == "3f9a0c1d<wbr>2e4b4c5d<wbr>8e9f0a1b<wbr>2c3d4e5f"
    assert breakable("supercalifragilistic") == "supercalifragilistic"


def test_a_finished_runs_page_shows_no_park_reason(admin_client: Client, admin_engine: Engine) -> None:
    """Issue #34 item 7 (section 6, S5): a waiter parked for its key (``park_reason`` singleton),
    then admitted and completed, has no park reason on its page: the field reads "—" once the
    run has finished, whatever the row keeps; an active waiter's page still names it."""
    start_queue(admin_engine, CAPPED, "PR", 2, admit=1)
    waiting = admin_client.get(change_url("PR-1")).content.decode()
    assert re.search(r"Park reason:</label>\s*<div class=\"readonly\">singleton</div>", waiting), waiting
    assert settle(admin_engine, "PR-0", "completed")
    assert settle(admin_engine, "PR-1", "completed")
    page = admin_client.get(change_url("PR-1")).content.decode()
    assert Run.objects.get(pk="PR-1").status == "completed"
    field = re.search(r"Park reason:</label>\s*<div class=\"readonly\">(.*?)</div>", page, re.S)
    assert field is not None and "singleton" not in field[1], field and field[1]
