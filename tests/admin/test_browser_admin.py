"""The admin's queue pages in a real browser (issue #5 point 6): Debian's chromium, driven by
Playwright, against the live server while real workers drain a burst.

The workers are either the embedded ThreadDispatcher (worker threads and the tick thread) in the
live server's process, on whichever database DATABASE_URL names, or, on PostgreSQL with Redis,
two ``celery worker`` processes. Screenshots go to ``artifacts/``. Playwright's sync API runs its
own event loop, which Django's ORM refuses to share a thread with, so the browser lives on a
thread of its own and the test hands it one step at a time. One chromium serves a module's
tests; each test gets a fresh browser context (no cookie or storage of an earlier test) and page.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine
from testproject.inventory.models import BodyAudit
from tests.admin.test_queue_queries import claim
from tests.celery_workers import celery_stack_missing, celery_workers

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDE = "sync-inventory-wide"  # limit 2, no cap
CAPPED = "sync-inventory"  # limit 1, max_queue_depth 2

#: The marks of every browser test: slow, skipped without chromium, on the live server's database.
BROWSER_TEST = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (tools/services.py install)"
    ),
    pytest.mark.django_db(transaction=True),
]
pytestmark = BROWSER_TEST


class Chromium:
    """Playwright's chromium owned by one thread; :meth:`call` runs ``fn(browser)`` there and
    returns its result. Started once per module (launching takes seconds on a loaded machine)."""

    def __init__(self) -> None:
        self._steps: queue.Queue[tuple[Callable[[Any], Any], Future[Any]] | None] = queue.Queue()
        self._ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, name="playwright", daemon=True)
        self._thread.start()
        self._ready.result(timeout=60)

    def _run(self) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                try:
                    self._ready.set_result(None)
                    while (step := self._steps.get()) is not None:
                        fn, result = step
                        try:
                            result.set_result(fn(browser))
                        except BaseException as exc:  # handed to the test thread
                            result.set_exception(exc)
                finally:
                    browser.close()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def call[T](self, fn: Callable[[Any], T], timeout: float = 90) -> T:
        result: Future[T] = Future()
        self._steps.put((fn, result))
        return result.result(timeout=timeout)

    def close(self) -> None:
        self._steps.put(None)
        self._thread.join(30)


def hang_report() -> str:
    """Every thread's stack in this process (the live server's request threads among them)
    and, on PostgreSQL and MariaDB, the database's sessions that are not idle with what
    they wait for: the report of a page that timed out."""
    import sys
    import traceback

    lines = ["threads of this process:"]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "MainThread":
            continue
        lines.append(f"--- {names.get(ident, ident)}")
        lines.extend(line.rstrip() for line in traceback.format_stack(frame)[-12:])
    sessions = {
        "postgresql": "SELECT pid, state, wait_event_type, wait_event, left(query, 300), pg_blocking_pids(pid) "
        "FROM pg_stat_activity WHERE datname = current_database() AND state <> 'idle' AND pid <> pg_backend_pid()",
        "mysql": "SELECT id, command, time, state, left(info, 300) FROM information_schema.processlist "
        "WHERE command <> 'Sleep' AND id <> connection_id()",
    }.get(connections["default"].vendor)
    if sessions is not None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute(sessions)
                lines.append("database sessions not idle:")
                lines.extend(repr(row) for row in cursor.fetchall())
        except Exception as exc:  # the report must not hide the timeout
            lines.append(f"database sessions: not read ({exc!r})")
    return "\n".join(lines)


def submit_login(page: Any, username: str = "admin", password: str = "pw-browser") -> None:
    """On the admin's login page ``page``, fill in ``username`` and ``password`` and submit."""
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")


class Browser:
    """A page in a fresh context of ``chromium``; :meth:`do` runs ``fn(page)`` on chromium's
    thread and returns its result."""

    def __init__(self, chromium: Chromium, base_url: str) -> None:
        self.base_url = base_url
        self._chromium = chromium

        def open_page(browser: Any) -> Any:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            page = context.new_page()
            page.set_default_timeout(30_000)
            return page

        self._page = chromium.call(open_page, timeout=60)

    def do[T](self, fn: Callable[[Any], T], timeout: float = 90) -> T:
        try:
            return self._chromium.call(lambda _: fn(self._page), timeout=timeout)
        except Exception as exc:
            if "Timeout" not in type(exc).__name__:
                raise
            # A page that never loaded: say what the live server (this process) and the
            # database were doing, so that a hang can be told from a slow machine.
            raise AssertionError(f"{exc}\n{hang_report()}") from exc

    def goto(self, path: str) -> None:
        self.do(lambda page: page.goto(self.base_url + path))

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        target = ARTIFACTS / f"{name}.png"
        self.do(lambda page: page.screenshot(path=str(target), full_page=True))
        return target

    def close(self) -> None:
        self._chromium.call(lambda _: self._page.context.close(), timeout=30)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    c = Chromium()
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def browser(chromium: Chromium, live_server: Any) -> Iterator[Browser]:
    b = Browser(chromium, live_server.url)
    try:
        yield b
    finally:
        b.close()


def _thread_workers(settings: Any) -> Iterator[Engine]:
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "thread", "WORKER_THREADS": 4}
    engine = get_engine()
    engine.dispatcher.start()
    try:
        yield engine
    finally:
        engine.dispatcher.stop()
        connections.close_all()


@pytest.fixture(params=["threads", pytest.param("celery", marks=pytest.mark.celery)])
def workers(request: pytest.FixtureRequest, settings: Any) -> Iterator[Engine]:
    """The default engine (the one the admin's actions call) and real workers executing its turns:
    ``threads``, the embedded worker (4 worker threads and a 1 s tick) in this process, the live
    server's; or ``celery``, two ``celery worker`` processes on PostgreSQL and Redis."""
    if request.param == "threads":
        yield from _thread_workers(settings)
        return
    if reason := celery_stack_missing():
        pytest.skip(reason)
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "celery"}
    request.getfixturevalue("celery_workers").start(2, concurrency=2)
    yield get_engine()


@pytest.fixture
def thread_workers(settings: Any) -> Iterator[Engine]:
    yield from _thread_workers(settings)


def waiting_of(key: str, after: datetime | None = None) -> Callable[[Any], int | None]:
    """Read the key's waiting count from the open queue page; with ``after``, only from a
    refresh taken after that moment (the page refreshes itself while runs are being started)."""

    def read(page: Any) -> int | None:
        if after is not None:
            stamp = page.get_attribute(".ds-live-status time", "datetime")
            if stamp is None or datetime.fromisoformat(stamp) <= after:
                return None
        cell = page.query_selector(f'tr[data-key="{key}"] td.field-waiting')
        return int(cell.inner_text().strip()) if cell else None

    return read


def wait_until[T](check: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_watch_a_burst_drain_and_cancel_a_waiter(browser: Browser, workers: Engine, django_user_model: Any) -> None:
    """Issue #5 point 6 (S5, S7, D6, F11): a superuser logs in and watches the queue page while real
    workers drain a burst. Without reloading, the page shows the key's waiters and the count
    falls; on the key's page the last waiter is cancelled with the admin action; its body never
    runs, every other run completes, and no key ever had more bodies at once than its limit."""
    kind = "celery" if isinstance(workers.dispatcher, CeleryDispatcher) else "threads"
    django_user_model.objects.create_superuser("admin", password="pw-browser")
    browser.goto("/admin/login/?next=/admin/durable_singleton/run/queues/")

    def log_in(page: Any) -> str:
        submit_login(page)
        page.wait_for_selector("#ds-live")
        return page.inner_text("#ds-live")

    assert "No key has active runs." in browser.do(log_in)

    burst = {
        (WIDE, "A"): [workers.start(WIDE, {"store_id": "A", "duration": 3.0}).run_id for _ in range(12)],
        (CAPPED, "B"): [workers.start(CAPPED, {"store_id": "B", "duration": 3.0}).run_id for _ in range(3)],
        (WIDE, "C"): [workers.start(WIDE, {"store_id": "C", "duration": 2.0}).run_id for _ in range(3)],
    }

    # The page refreshes itself: the burst appears without a reload. A refresh may land while
    # the burst is still being started; the count is read from the first one after it.
    started = timezone.now()
    first = wait_until(lambda: browser.do(waiting_of("store:A", after=started)), 20, "store:A on the queue page")
    assert first >= 6, f"10 of 12 runs wait behind 2 holders at first, the page showed {first}"

    def b_full(page: Any) -> str | None:
        row = page.query_selector('tr[data-key="store:B"]')
        text = row.inner_text() if row else ""
        return text if waiting_of("store:B")(page) == 2 else None

    b_row = wait_until(lambda: browser.do(b_full), 20, "store:B with 2 waiters")
    assert "3/3" in b_row and "100%" in b_row, f"store:B is at its cap (limit 1 + max_queue_depth 2): {b_row!r}"
    browser.shot(f"admin-queues-burst-{kind}")
    seen = [first]

    def fell() -> bool:
        seen.append(browser.do(waiting_of("store:A")) or 0)
        return seen[-1] < first

    wait_until(fell, 30, f"the waiting count of store:A to fall below {first}")
    assert seen == sorted(seen, reverse=True), f"the count only falls: {seen}"
    browser.shot(f"admin-queues-falling-{kind}")

    # The key's page: holders, then waiters in admission order; cancel the last waiter.
    def open_key_page(page: Any) -> None:
        with page.expect_navigation():
            page.click('tr[data-key="store:A"] th.field-key a')
        page.wait_for_selector("tr.ds-holder, tr.ds-waiter", timeout=15_000)

    browser.do(open_key_page)
    rows = browser.do(
        lambda page: page.eval_on_selector_all(
            "tr.ds-waiter", "rs => rs.map(r => [r.dataset.position, r.dataset.runId])"
        )
    )
    assert rows, "store:A still has waiters"
    assert [int(p) for p, _ in rows] == list(range(1, len(rows) + 1))
    listed = [run_id for _, run_id in rows]
    now_waiting = list(Run.objects.for_key(WIDE, "store:A").waiting().values_list("run_id", flat=True))
    # The claim's order (S5): what still waits is the page's list less the runs admitted since it loaded.
    assert now_waiting == listed[len(listed) - len(now_waiting) :], (listed, now_waiting)
    oldest_first = Run.objects.filter(run_id__in=listed).order_by("created_at", "run_id")
    assert listed == list(oldest_first.values_list("run_id", flat=True)), "waiters are listed oldest first"
    victim = rows[-1][1]
    browser.shot(f"admin-queue-key-{kind}")

    def cancel(page: Any) -> str:
        page.check(f'tr[data-run-id="{victim}"] input.action-select')
        page.select_option("select[name=action]", "cancel_runs")
        page.click("button[name=index]")
        page.wait_for_selector("ul.messagelist li")
        return page.inner_text("ul.messagelist")

    assert browser.do(cancel).strip() == "Cancelled 1 run."
    assert Run.objects.get(pk=victim).status == "cancelled"
    assert browser.do(lambda page: page.query_selector(f'tr[data-run-id="{victim}"]')) is None
    browser.shot(f"admin-queue-key-cancelled-{kind}")

    # Back on the queue page, the burst drains to nothing.
    browser.goto("/admin/durable_singleton/run/queues/")
    wait_until(
        lambda: "No key has active runs." in browser.do(lambda page: page.inner_text("#ds-live")),
        90,
        "the burst to drain",
    )
    browser.shot(f"admin-queues-drained-{kind}")

    # The burst's runs only: the test project's schedules fire on their own windows
    # (a quarter hour) if the test runs across one.
    started = {run_id for ids in burst.values() for run_id in ids}
    runs = {r.run_id: r.status for r in Run.objects.filter(run_id__in=started)}
    expected_done = started - {victim}
    assert {r for r, s in runs.items() if s == "completed"} == expected_done
    assert not BodyAudit.objects.filter(run_id=victim).exists(), "the cancelled waiter's body never ran"
    limits = {"store:A": 2, "store:B": 1, "store:C": 2}
    for key, limit in limits.items():
        spans = [(a.entered_at, a.exited_at) for a in BodyAudit.objects.filter(key=key)]
        assert all(exited is not None for _, exited in spans)
        most = max(sum(1 for s, e in spans if s <= at < e) for at, _ in spans)
        assert most <= limit, f"{key}: {most} bodies at once, limit {limit}"


def test_view_only_staff_watch_without_actions(browser: Browser, settings: Any, django_user_model: Any) -> None:
    """Issue #5 point 3 in the browser: a staff user with only the view permission sees the queue
    and the key's waiters, and is offered no action and no checkbox. The queue stays put while
    the page is read: one holder and two waiters claimed through the store, no worker (S5)."""
    from django.contrib.auth.models import Permission

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    user = django_user_model.objects.create_user("watcher", password="pw-view", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_run"))
    ids = [engine.start(CAPPED, {"store_id": "V", "duration": 3.0}).run_id for _ in range(3)]
    for run_id in ids:
        claim(engine, run_id, 1)
    engine.dispatcher.queue.clear()
    browser.goto(
        "/admin/login/?next=/admin/durable_singleton/run/queues/key/%3Fworkflow%3Dsync-inventory%26key%3Dstore%3AV"
    )

    def log_in(page: Any) -> str:
        submit_login(page, "watcher", "pw-view")
        page.wait_for_selector("#ds-live")
        page.wait_for_function("document.querySelectorAll('tr.ds-waiter').length == 2", timeout=20_000)
        return page.content()

    html = browser.do(log_in)
    assert 'class="action-select"' not in html and 'name="action"' not in html
    assert re.findall(r'data-run-id="([^"]+)" data-position', html) == ids[1:]
    browser.shot("admin-queue-key-view-only")


def test_run_list_fits_a_1400_px_window(browser: Browser, settings: Any, django_user_model: Any) -> None:
    """Issue #10 item 8: with long keys and many tags, the run list (filters beside it) needs no
    horizontal scrolling in a 1,400 px wide window; tags come last, cut, and whole in the tooltip.
    Waiters read "waiting" (S5), and a backlog waiter's far wake is marked as the fallback (S8a)."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    tags = ["nightly", "priority:high", "customer:acme-corporation-international", "region:eu-west-3"]
    store = "north-east-distribution-centre-0001"
    first = [engine.start(WIDE, {"store_id": store}, tags=tags).run_id for _ in range(4)]
    for run_id in first:  # two holders (running), two waiters parked for about a second
        claim(engine, run_id, 2)
    for _ in range(2):  # behind them: parked at creation with the backlog wake (S8a)
        engine.start(WIDE, {"store_id": store}, tags=tags)
    done = engine.start(CAPPED, {"store_id": "south-west-distribution-centre-0002"}, tags=tags)
    engine.execute(done.run_id)
    engine.dispatcher.queue.clear()
    django_user_model.objects.create_superuser("admin", password="pw-browser")
    browser.goto("/admin/login/?next=/admin/durable_singleton/run/")

    def measure(page: Any) -> dict[str, Any]:
        submit_login(page)
        page.wait_for_selector("#result_list")
        return page.evaluate(
            """() => ({
                scroll: document.documentElement.scrollWidth,
                window: window.innerWidth,
                table: document.querySelector('#result_list').getBoundingClientRect().right,
                last: [...document.querySelectorAll('#result_list thead th')].pop().innerText.trim(),
                tagTitle: document.querySelector('#result_list .ds-tags').title,
                results: document.querySelector('#changelist .results').scrollWidth,
                box: document.querySelector('#changelist .results').clientWidth,
                states: [...document.querySelectorAll('#result_list .ds-state')].map(e => e.innerText.trim()),
                fallbacks: document.querySelectorAll('#result_list .ds-backlog').length,
            })"""
        )

    seen = browser.do(measure)
    browser.shot("admin-runs")
    assert seen["window"] == 1400
    assert seen["scroll"] <= seen["window"] and seen["table"] <= seen["window"], seen
    assert seen["results"] <= seen["box"], f"the run table scrolls sideways inside its box: {seen}"
    assert seen["last"].lower() == "tags", seen
    assert all(tag in seen["tagTitle"] for tag in tags), seen
    assert ("waiting" in seen["states"] and "running" not in seen["states"]) or "completed" in seen["states"], seen
