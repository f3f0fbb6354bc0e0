"""An unrenewed holder in a real browser (K3, issue #19 item 3): Debian's chromium, driven
by Playwright (the fixtures of tests/admin/test_browser_admin.py), against the live server.

A holder's lease is planted as last renewed 15 s ago (claimed for ``LEASE_SECONDS - 15``,
as tests/core/test_unrenewed_lease.py does) and its waiter's retry comes and goes with no
worker: the key page, refreshing itself, keeps saying the holder's lease was not renewed
and the waiter's retry is overdue; the waiter's page has a title that agrees with its status.
"""

from __future__ import annotations

import re
import time
from typing import Any

from durable_singleton.runtime import get_engine
from tests.admin.test_browser_admin import BROWSER_TEST, Browser, submit_login, wait_until
from tests.helpers import admitted, claim

#: The cell's brief words; its title carries the renewal interval too (issue #19 item 4).
UNRENEWED = r"lease not renewed for \d+ s; recovered at \d\d:\d\d:\d\d"
UNRENEWED_TITLE = r"lease not renewed for \d+ s \(renewed every 10 s\); recovered at \d\d:\d\d:\d\d"

pytestmark = BROWSER_TEST


def test_key_page_keeps_saying_the_holder_is_unrenewed_and_the_retry_overdue(
    browser: Browser, settings: Any, django_user_model: Any
) -> None:
    """K3, R5: in the browser, the holder's row is marked and reads "lease not renewed for
    N s (renewed every 10 s); recovered at T", the waiter's next attempt reads "waiting for
    the holder's lease to expire at T" in neutral colour (a normal recovery, D4; issue #34
    item 7: it read a red "overdue since"), before and after the page refreshes itself; the first waiter's explanation
    waits for the recovery; the waiter's page title says "(waiting)" as its status does."""
    # A long lease: chromium may take many seconds to start on a loaded machine, and the
    # planted lease must not expire before the page is read.
    settings.DURABLE_SINGLETON = {
        **settings.DURABLE_SINGLETON,
        "DISPATCH": "manual",
        "LEASE_SECONDS": 300.0,
        "LEASE_RENEW_SECONDS": 10.0,
    }
    engine = get_engine()
    for name in ("U1", "U2"):
        engine.start("sync-inventory", {"store_id": "U", "duration": 3.0}, run_id=name)
    assert admitted(claim(engine, "U1", "vm:16319:dead", lease_seconds=engine.settings.LEASE_SECONDS - 15)) == (
        "admitted"
    )
    assert engine.execute("U2") == "parked"
    engine.dispatcher.queue.clear()
    wake = engine.get("U2").wake_at
    assert wake is not None
    time.sleep(max(0.0, (wake - engine.store.now()).total_seconds()) + 0.2)  # due, and nobody takes it

    django_user_model.objects.create_superuser("admin", password="pw-browser")
    browser.goto(
        "/admin/login/?next=/admin/durable_singleton/run/queues/key/%3Fworkflow%3Dsync-inventory%26key%3Dstore%3AU"
    )

    def log_in(page: Any) -> None:
        submit_login(page)
        page.wait_for_selector("#ds-live")

    browser.do(log_in)

    def read(page: Any) -> dict[str, str]:
        return {
            "stamp": page.get_attribute(".ds-live-status time", "datetime") or "",
            "holder": page.inner_text('tr.ds-holder.ds-unrenewed[data-run-id="U1"]'),
            "title": page.get_attribute('tr.ds-holder.ds-unrenewed[data-run-id="U1"] .ds-unrenewed', "title") or "",
            "wake": page.inner_text('tr.ds-waiter[data-run-id="U2"] .ds-wake'),
            "colour": page.eval_on_selector(
                'tr.ds-waiter[data-run-id="U2"] .ds-wake > span', "e => getComputedStyle(e).color"
            ),
            "body": page.eval_on_selector('tr.ds-waiter[data-run-id="U2"]', "e => getComputedStyle(e).color"),
            "explain": page.inner_text("#ds-explain"),
        }

    first = browser.do(read)
    for shown in (first, wait_until(lambda: (r := browser.do(read))["stamp"] != first["stamp"] and r, 30, "a refresh")):
        assert re.search(UNRENEWED, shown["holder"]), shown
        assert re.search(UNRENEWED_TITLE, shown["title"]), shown
        assert shown["wake"].startswith("waiting for the holder's lease to expire at"), shown
        assert shown["colour"] == shown["body"], shown
        assert "until the recovery of U1" in shown["explain"], shown
    browser.shot("admin-queue-key-unrenewed-holder")

    browser.goto("/admin/durable_singleton/run/U2/change/")
    title, state = browser.do(lambda page: (page.title(), page.inner_text(".field-state_display .readonly")))
    assert "sync-inventory U2 (waiting)" in title and state.strip().startswith("waiting"), (title, state)
