"""Issue #11 in a real browser (Debian's chromium via Playwright, the live server, the embedded
worker): the run page's "why is it waiting" sentence (K3) as the waiter moves up to holder, and
the schedules page with its next windows and the pause action (S17). Screenshots go to
``artifacts/`` (the docs' copies are docs/_static/admin-explain.png and admin-schedules.png)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from durable_singleton.engine import Engine
from durable_singleton.models import ScheduleState
from durable_singleton.schedules import fire_due_schedules
from tests.admin.test_browser_admin import ARTIFACTS, BROWSER_TEST, CAPPED, Browser, submit_login, wait_until

pytestmark = BROWSER_TEST


def _log_in(browser: Browser, django_user_model: Any, next_url: str) -> None:
    django_user_model.objects.create_superuser("admin", password="pw-browser")
    browser.goto(f"/admin/login/?next={quote(next_url)}")

    def log_in(page: Any) -> None:
        submit_login(page)
        page.wait_for_load_state()

    browser.do(log_in)


def _top_shot(browser: Browser, name: str, height: int) -> None:
    """Save the top ``height`` pixels of the page as ``artifacts/<name>-top.png`` (the docs' picture)."""
    ARTIFACTS.mkdir(exist_ok=True)
    target = str(ARTIFACTS / f"{name}-top.png")
    browser.do(lambda page: page.screenshot(path=target, clip={"x": 0, "y": 0, "width": 1400, "height": height}))


def test_run_page_says_why_a_run_waits_and_behind_whom(
    browser: Browser, thread_workers: Engine, django_user_model: Any
) -> None:
    """K3: the waiter's run page opens with one sentence naming its position, the
    holder it waits behind and the limit; once the holder finished, the same page
    says the run holds the slot, or that it finished."""
    # Logged in first: on a loaded machine the login (a password hash each way) could
    # otherwise outlast the holder's 8 s body before the waiter's page is read.
    _log_in(browser, django_user_model, "/admin/durable_singleton/run/")
    holder = thread_workers.start(CAPPED, {"store_id": "W", "duration": 8.0}, run_id="holder-W").run_id
    waiter = thread_workers.start(CAPPED, {"store_id": "W", "duration": 0.5}, run_id="waiter-W").run_id
    wait_until(lambda: thread_workers.get(holder).admitted, 20, "the holder's admission")
    browser.goto(f"/admin/durable_singleton/run/{waiter}/change/")

    def sentence(page: Any) -> str:
        page.reload()
        return str(page.inner_text("#ds-explain"))

    text = browser.do(sentence)
    assert "Run waiter-W is waiting: position 1 of 1 in line for key 'store:W' of sync-inventory" in text, text
    assert "behind holder-W (running, holding for" in text and "(limit 1)" in text, text
    browser.shot("admin-explain")
    _top_shot(browser, "admin-explain", 330)

    def moved_on() -> str | None:
        text = browser.do(sentence)
        return text if "holds a slot" in text or "is completed" in text else None

    later = wait_until(moved_on, 30, "the waiter to be admitted")
    assert "Run waiter-W" in later


def test_schedules_page_lists_next_windows_and_pauses_a_schedule(
    browser: Browser, thread_workers: Engine, django_user_model: Any
) -> None:
    """S17: the schedules page lists the test project's schedules with their next
    window; selecting one and running the pause action marks it paused."""
    fire_due_schedules(thread_workers, thread_workers.now(), 10)
    _log_in(browser, django_user_model, "/admin/durable_singleton/schedulestate/")

    def listed(page: Any) -> str:
        return str(page.inner_text("#result_list"))

    text = browser.do(listed)
    assert "sync-store-north" in text and "sync-store-south" in text and "(in " in text, text
    browser.shot("admin-schedules")
    _top_shot(browser, "admin-schedules", 400)

    def pause_north(page: Any) -> str:
        row = page.locator("#result_list tr", has_text="sync-store-north")
        row.locator("input.action-select").check()
        page.select_option("select[name=action]", "pause_selected")
        page.click("button[name=index]")
        page.wait_for_selector("ul.messagelist li")
        return str(page.inner_text("ul.messagelist"))

    assert browser.do(pause_north).strip() == "1 schedule paused."
    deadline = time.monotonic() + 5
    while not ScheduleState.objects.get(name="sync-store-north").paused:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "paused" in browser.do(listed)


def test_key_page_controls_pause_override_and_record_who(
    browser: Browser, thread_workers: Engine, django_user_model: Any
) -> None:
    """K2: on a key's page a superuser pauses the key with a reason and overrides
    its limit; the page shows the state and the recorded changes with the user's
    name; a run started meanwhile waits (paused) until the key is resumed."""
    from durable_singleton.models import KeyControlChange

    url = "/admin/durable_singleton/run/queues/key/?workflow=sync-inventory-wide&key=store:CTL"
    thread_workers.start("sync-inventory-wide", {"store_id": "CTL", "duration": 0.2}, run_id="ctl-0")
    wait_until(lambda: thread_workers.get("ctl-0").status == "completed", 20, "the first run")
    _log_in(browser, django_user_model, url)

    def control(page: Any, button: str, reason: str = "", limit: str | None = None) -> str:
        page.fill("#ds-controls-form input[name=reason]", reason)
        if limit is not None:
            page.fill("#ds-controls-form input[name=limit]", limit)
        with page.expect_navigation():
            page.click(f"#ds-controls-form button[value={button}]")
        return str(page.inner_text("#ds-controls"))

    text = browser.do(lambda page: control(page, "pause", "supplier outage"))
    assert "Paused" in text and "supplier outage" in text and "admin" in text, text
    text = browser.do(lambda page: control(page, "limit", "", "5"))
    assert "overridden to 5" in text, text
    browser.shot("admin-key-controls")
    _top_shot(browser, "admin-key-controls", 900)
    thread_workers.start("sync-inventory-wide", {"store_id": "CTL", "duration": 0.2}, run_id="ctl-1")
    time.sleep(1.5)
    assert thread_workers.get("ctl-1").status != "completed", "a paused key admits nothing"
    browser.do(lambda page: control(page, "resume", "fixed"))
    wait_until(lambda: thread_workers.get("ctl-1").status == "completed", 20, "the run after resuming")
    assert list(KeyControlChange.objects.order_by("changed_at").values_list("field", "changed_by", "reason")) == [
        ("paused", "admin", "supplier outage"),
        ("limit_override", "admin", ""),
        ("paused", "admin", "fixed"),
    ]


def test_an_operator_adds_a_paused_schedule_edits_it_and_resumes_it_in_its_form(
    browser: Browser, thread_workers: Engine, django_user_model: Any
) -> None:
    """S17: an operator adds a paused one-second schedule in the admin, opens it
    again (its name read-only), changes its input and unticks "paused"; the form
    saves, and the embedded worker's tick then fires the windows that passed
    while it was paused as its catch-up policy ("latest") says: the newest, the
    older ones in one missed record from the paused cursor."""
    _log_in(browser, django_user_model, "/admin/durable_singleton/schedulestate/add/")

    def add(page: Any) -> str:
        page.fill("#id_name", "ops-browser")
        page.fill("#id_workflow_name", "sync-inventory-wide")
        page.fill("#id_every_seconds", "1")
        page.fill("#id_input", '{"store_id": "BR"}')
        page.select_option("#id_catch_up", "latest")
        page.check("#id_paused")
        with page.expect_navigation():
            page.click("input[name=_save]")
        return str(page.inner_text("ul.messagelist"))

    assert "was added successfully" in browser.do(add)
    row = ScheduleState.objects.get(name="ops-browser")
    assert row.paused and row.source == "admin" and row.next_fire_at is not None
    paused_at = row.next_fire_at
    time.sleep(3.5)  # windows pass while it is paused
    # Only this schedule's runs: the test project's own schedules (sync-store-*, every
    # 15 minutes) fire on the same tick when a quarter hour passes during the sleep.
    fired = [run.run_id for run in thread_workers.store.list_runs() if run.run_id.startswith("schedule:ops-browser:")]
    assert not fired, "a paused schedule fires nothing"
    browser.goto(f"/admin/durable_singleton/schedulestate/{row.pk}/change/")

    def edit(page: Any) -> str:
        assert page.query_selector("#id_name") is None and "ops-browser" in page.inner_text("#content")
        page.fill("#id_input", '{"store_id": "BR", "edited": true}')
        page.uncheck("#id_paused")
        with page.expect_navigation():
            page.click("input[name=_save]")
        errors = page.query_selector(".errornote, .errorlist")
        return str(errors.inner_text()) if errors else str(page.inner_text("ul.messagelist"))

    message = browser.do(edit)
    assert "was changed successfully" in message, message
    row.refresh_from_db()
    assert (row.paused, row.input) == (False, {"store_id": "BR", "edited": True})
    firings = wait_until(
        lambda: list(row.firings.order_by("window_at")[:2]) if row.firings.filter(outcome="started").exists() else None,
        20,
        "the first window after the resume",
    )
    missed, started = firings
    assert (missed.outcome, missed.window_at) == ("missed", paused_at), (missed, started)
    assert int(missed.detail.split(" window")[0]) >= 3 and started.outcome == "started", missed.detail
    run = thread_workers.get(started.run_id)
    assert run.input == {"store_id": "BR", "edited": True}
