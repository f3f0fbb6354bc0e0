"""Bounded input at the admin (section 7, section 6; #18 item 4): no query
string or form value gives an HTTP 500. A huge ``?p=`` (an OFFSET beyond
every database's range), NUL (PostgreSQL refuses it in text), overlong
values and non-finite ``?refresh=`` are answered with the page (the value
ignored or clamped), a 400, or a form error, and nothing is written."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from durable_singleton.models import KeyControlChange, Run, SingletonKey
from durable_singleton.runtime import get_engine

pytestmark = pytest.mark.django_db(transaction=True)

BAD = ["%00", "a%00b", "%ED%A0%80", "%FF", "x" * 3000, "9" * 40, "-9" * 20, "1e308", "inf", "nan"]


@pytest.fixture
def client(admin_client: Client, settings: Any) -> Client:
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    for n in range(3):
        engine.start("sync-inventory-wide", {"store_id": "ADMB"}, run_id=f"admb-{n}")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    admin_client.raise_request_exception = False  # a 500 is an answer to assert on, not a test error
    return admin_client


def _state() -> tuple[Any, ...]:
    return (
        sorted(Run.objects.values_list("run_id", "status", "updated_at")),
        sorted(SingletonKey.objects.values_list("workflow_name", "key", "paused", "limit_override")),
        KeyControlChange.objects.count(),
    )


def _pages() -> dict[str, tuple[str, list[str]]]:
    """Each page and the query parameters it reads."""
    return {
        "queues": (reverse("admin:durable_singleton_run_queues"), ["p", "workflow", "q", "o", "only", "refresh"]),
        "key": (
            reverse("admin:durable_singleton_run_queue_key") + "?workflow=sync-inventory-wide&key=store:ADMB&",
            ["p", "refresh"],
        ),
        "key-names": (reverse("admin:durable_singleton_run_queue_key") + "?", ["workflow", "key"]),
        "lanes": (
            reverse("admin:durable_singleton_run_lanes") + "?workflow=sync-inventory-wide&",
            ["minutes", "refresh", "key", "fragment"],
        ),
        "lanes-names": (reverse("admin:durable_singleton_run_lanes") + "?", ["workflow", "key", "quota"]),
        "quota": (reverse("admin:durable_singleton_run_quota_key") + "?quota=billing&key=acme&", ["p", "refresh"]),
        "quota-names": (reverse("admin:durable_singleton_run_quota_key") + "?", ["quota", "key"]),
        "throttle": (
            reverse("admin:durable_singleton_run_throttle_key") + "?throttle=erp-rate&key=t1&",
            ["p", "refresh"],
        ),
        "throttle-names": (reverse("admin:durable_singleton_run_throttle_key") + "?", ["throttle", "key"]),
        "runs": (
            reverse("admin:durable_singleton_run_changelist"),
            ["p", "q", "workflow_name", "singleton_key", "status", "namespace"],
        ),
        "changes": (reverse("admin:durable_singleton_keycontrolchange_changelist"), ["p", "q", "workflow_name"]),
        "schedules": (reverse("admin:durable_singleton_schedulestate_changelist"), ["p", "q", "workflow_name"]),
        "firings": (reverse("admin:durable_singleton_schedulefiring_changelist"), ["p", "q", "workflow_name"]),
        "workers": (reverse("admin:durable_singleton_workerprocess_changelist"), ["p", "q", "host", "mode", "o"]),
    }


@pytest.mark.parametrize("page", list(_pages()))
def test_no_query_string_gives_a_server_error(client: Client, page: str) -> None:
    """Section 7, section 6: every query parameter each admin page reads, set
    to each bad value, is answered (200, 302 or 400), never with a 500, and
    writes nothing."""
    url, params = _pages()[page]
    before = _state()
    answers = {}
    for param in params:
        for value in BAD:
            joiner = "&" if "?" in url else "?"
            named = page in ("key-names", "lanes-names", "quota-names", "throttle-names")
            extra = "&key=store:ADMB" if named and param in ("workflow", "quota", "throttle") else ""
            other = {"quota-names": "&quota=billing", "throttle-names": "&throttle=erp-rate"}.get(
                page, "&workflow=sync-inventory-wide"
            )
            extra = other if named and param == "key" else extra
            answers[(param, value[:12])] = client.get(f"{url}{joiner}{param}={value}{extra}").status_code
    assert {k: v for k, v in answers.items() if v not in (200, 302, 400)} == {}
    assert _state() == before


def test_every_admin_page_of_the_app_is_probed() -> None:
    """Section 7: each page this app adds to the admin (a URL without arguments under
    ``admin:durable_singleton_*``) is in the bad-query-string test above, so a new page
    cannot read its query string unchecked unnoticed."""
    from django.contrib import admin

    names = set()
    for pattern in admin.site.get_urls():
        for sub in getattr(pattern, "url_patterns", [pattern]):
            name = getattr(sub, "name", None) or ""
            if name.startswith("durable_singleton_") and not sub.pattern.converters and "add" not in name:
                names.add(name)
    probed = {
        reverse(f"admin:{name}").split("?")[0]
        for name in names
        if not name.endswith(("_delete", "_history", "_change", "_apply"))
    }
    covered = {url.split("?")[0] for url, _ in _pages().values()}
    assert probed - covered == set()


@pytest.mark.parametrize("refresh", ["nan", "inf", "-inf", "1e400", "x"])
def test_the_lanes_page_reads_refresh_as_the_queue_pages_do(client: Client, refresh: str) -> None:
    """Section 7: ``?refresh=nan`` or ``inf`` on the lanes page is ignored (the page's default
    period), as on the queue pages: never rendered as "every nan s" nor into the page's script."""
    for name in ("lanes", "queues"):
        html = client.get(
            reverse(f"admin:durable_singleton_run_{name}"), {"workflow": "sync-inventory-wide", "refresh": refresh}
        )
        text = html.content.decode()
        assert html.status_code == 200 and "Refreshes every 2 s" in text, (name, refresh)
        assert not re.search(r"every (nan|inf)|(nan|inf) \* 1000|data-refresh=\"(nan|inf)", text, re.I), (name, refresh)


@pytest.mark.parametrize("value", ["%00", "x%00", "x" * 3000])
def test_a_bad_run_id_in_the_change_page_url_is_not_a_server_error(client: Client, value: str) -> None:
    """Section 7: a run's page whose id no column can hold answers 302 (the
    admin's "does not exist") or 404, never 500."""
    url = reverse("admin:durable_singleton_run_change", args=["PLACEHOLDER"]).replace("PLACEHOLDER", value)
    assert client.get(url).status_code in (302, 404)


@pytest.mark.parametrize(
    "form",
    [
        {"control": "limit", "limit": str(10**30)},
        {"control": "limit", "limit": str(2**31)},
        {"control": "limit", "limit": "9" * 5000},
        {"control": "limit", "limit": "inf"},
        {"control": "pause", "reason": "why\x00"},
        {"control": "pause", "key": "store:\x00"},
        {"control": "pause", "key": "x" * 3000},
        {"control": "pause", "workflow": "sync\x00inventory-wide"},
    ],
    ids=lambda form: "-".join(f"{k}={v[:10]!r}" for k, v in form.items()),
)
def test_the_controls_form_answers_a_bad_value_with_a_form_error(client: Client, form: dict[str, str]) -> None:
    """Section 7, K2: the key page's controls form refuses a limit beyond the
    column, NUL and overlong text with an error message on the key page,
    and writes nothing."""
    before = _state()
    data = {"workflow": "sync-inventory-wide", "key": "store:ADMB", "reason": "", **form}
    response = client.post(reverse("admin:durable_singleton_keycontrol_apply"), data, follow=True)
    assert response.status_code == 200
    messages = [str(m) for m in response.context["messages"]]
    assert messages and all(m for m in messages), messages
    assert _state() == before
