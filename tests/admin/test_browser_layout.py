"""The admin's layout at 1,280 and 1,400 px with long names (issue #19 item 4), in Debian's chromium.

The rows are the shapes the store writes (tests/factories.py) for a workflow named as the
django.tasks backend names them (``task:inventory.tasks.sync_store``), long store keys, a long
host name in the lease owner and long step names; the workflow is registered for the test so the
pages show its limit and cap. Each page is measured from element boxes: no text runs past its
cell into the next one or under a neighbour, no two cells or blocks overlap, no box scrolls or
cuts sideways (``scrollWidth`` against ``clientWidth``), header labels keep a gap between them,
and names wrap only after a separator (``.``, ``:``, ``-``, ``_``, ``/``), never mid-word.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_singleton.definitions import Singleton, registry
from durable_singleton.models import Run
from tests.admin.test_browser_admin import ARTIFACTS, BROWSER_TEST, Browser, submit_login
from tests.factories import RunFactory, StepFactory

pytestmark = BROWSER_TEST

TASK = "task:inventory.tasks.sync_store"
KEYS = ["store:north-east-distribution-centre-0001", "store:south-west-distribution-centre-0002"]
OWNER = "ip-10-0-12-34.eu-west-3.compute.internal:16319:3f9a0c1d2e4b"
TAGS = ["nightly", "priority:high", "customer:acme-corporation-international", "region:eu-west-3"]
WIDTHS = [1280, 1400]

#: Measures the page in the browser; returns a list of problems, each a sentence naming the elements.
MEASURE = r"""(scope) => {
  const problems = [];
  const name = (e) => {
    const id = e.id ? '#' + e.id : '';
    const cls = e.classList.length ? '.' + [...e.classList].join('.') : '';
    return `${e.tagName.toLowerCase()}${id}${cls} "${(e.innerText || '').trim().slice(0, 40)}"`;
  };
  const textBox = (e) => {
    // The boxes of the text itself (not of the elements that hold it, which fill their cells).
    const rects = [];
    const walker = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.data.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      rects.push(...[...range.getClientRects()].filter(r => r.width > 0 && r.height > 0));
    }
    if (!rects.length) return null;
    return {
      left: Math.min(...rects.map(r => r.left)), right: Math.max(...rects.map(r => r.right)),
      top: Math.min(...rects.map(r => r.top)), bottom: Math.max(...rects.map(r => r.bottom)),
    };
  };
  const meets = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  const root = document.documentElement;
  if (root.scrollWidth > window.innerWidth) {
    problems.push(`the page scrolls sideways: ${root.scrollWidth} px in a ${window.innerWidth} px window`);
  }
  // Nothing scrolls or is cut sideways inside the content.
  for (const e of document.querySelectorAll(scope + ', ' + scope + ' *')) {
    const style = getComputedStyle(e);
    if (style.display === 'none' || e.tagName === 'METER' || e.tagName === 'svg') continue;
    if (e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0 && style.overflowX !== 'visible') {
      problems.push(`${name(e)} is cut or scrolls: ${e.scrollWidth} px of content in ${e.clientWidth} px`);
    }
  }
  for (const table of document.querySelectorAll(scope + ' table')) {
    const box = table.getBoundingClientRect();
    const parent = table.parentElement.getBoundingClientRect();
    if (box.right > parent.right + 1 || box.right > window.innerWidth) {
      const at = Math.round(box.right), end = Math.round(parent.right);
      problems.push(`${name(table)} ends at ${at} px, past its box (${end} px)`);
    }
    for (const row of table.rows) {
      const cells = [...row.cells];
      cells.forEach((cell, i) => {
        const c = cell.getBoundingClientRect();
        const t = textBox(cell);
        if (t && (t.left < c.left - 1 || t.right > c.right + 1)) {
          const text = `${Math.round(t.left)}-${Math.round(t.right)}`;
          const box = `${Math.round(c.left)}-${Math.round(c.right)}`;
          problems.push(`the text of ${name(cell)} runs out of its cell (${text} px in ${box} px)`);
        }
        const next = cells[i + 1];
        if (!next) return;
        const n = next.getBoundingClientRect();
        if (meets(c, n)) problems.push(`${name(cell)} and ${name(next)} overlap`);
        const u = textBox(next);
        if (t && u && u.left - t.right < 6 && t.top < u.bottom && u.top < t.bottom) {
          problems.push(`${name(cell)} and ${name(next)} run together (${Math.round(u.left - t.right)} px apart)`);
        }
      });
    }
  }
  return problems;
}"""

#: Returns, for each element matched, the characters before which its text wraps to a new line.
WRAPS = r"""(selector) => [...document.querySelectorAll(selector)].map(e => {
  const walker = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
  const chars = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.data.length; i++) {
      const range = document.createRange();
      range.setStart(node, i); range.setEnd(node, i + 1);
      const r = range.getClientRects()[0];
      if (r) chars.push({c: node.data[i], top: r.top});
    }
  }
  const breaks = [];
  for (let i = 1; i < chars.length; i++) {
    if (chars[i].top > chars[i - 1].top + 2) breaks.push(chars[i - 1].c + '|' + chars[i].c);
  }
  return {text: e.innerText.trim(), breaks, lines: breaks.length + 1};
})"""

SEPARATORS = set(".:-_/ ,")


def _mid_word(wraps: list[dict[str, Any]]) -> list[str]:
    """Return the names that wrap between two letters or digits (not after a separator)."""
    return [
        f"{w['text']!r} breaks at {b!r}"
        for w in wraps
        for b in w["breaks"]
        if b[0] not in SEPARATORS and b[-1] not in SEPARATORS
    ]


@pytest.fixture
def long_names(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Register ``task:inventory.tasks.sync_store`` (limit 2, max_queue_depth 3) and store, per
    long key, two holders (one in a step with a long name, lease owned by a long host name),
    three waiters and a completed run, all tagged."""
    monkeypatch.setattr(registry, "workflows", dict(registry.workflows))
    monkeypatch.setattr(registry, "latest", dict(registry.latest))
    registry.add(
        TASK,
        "1",
        lambda ctx, input: None,
        singleton=Singleton(key=lambda input: str(input["key"]), limit=2, max_queue_depth=3),
    )
    now = timezone.now()
    for k, key in enumerate(KEYS):
        start = now - timedelta(minutes=3, seconds=k)
        on_key: dict[str, Any] = {"workflow_name": TASK, "singleton_key": key, "singleton_limit": 2, "tags": TAGS}
        for i in range(2):
            created = start + timedelta(seconds=i)
            holder = RunFactory(
                run_id=f"{TASK}:{key}:holder-{i}",
                holder=True,
                **on_key,
                created_at=created,
                started_at=created,
                admitted_at=created + timedelta(seconds=1),
                lease_owner=OWNER,
                lease_expires_at=now + timedelta(seconds=20),
                wake_at=now + timedelta(minutes=5) if i else None,
                park_reason="sleep" if i else "",
                status="suspended" if i else "running",
            )
            StepFactory(
                run=holder,
                position=0,
                name="fetch_inventory_from_supplier_catalogue",
                started_at=created + timedelta(seconds=1),
                finished_at=created + timedelta(seconds=2),
            )
        for i in range(3):
            RunFactory(
                run_id=f"{TASK}:{key}:waiter-{i}",
                waiter=True,
                **on_key,
                created_at=start + timedelta(seconds=10 + i),
                wake_at=now + timedelta(minutes=59) if i else now + timedelta(seconds=1),
            )
        RunFactory(run_id=f"{TASK}:{key}:done", finished=True, created_at=start - timedelta(minutes=1), **on_key)
    yield
    Run.objects.filter(workflow_name=TASK).delete()


def _log_in(browser: Browser, django_user_model: Any, width: int) -> None:
    django_user_model.objects.create_superuser("admin", password="pw-browser")

    def log_in(page: Any) -> None:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(browser.base_url + "/admin/login/")
        submit_login(page)
        page.wait_for_load_state()

    browser.do(log_in)


def _open(browser: Browser, path: str, ready: str) -> None:
    def go(page: Any) -> None:
        page.goto(browser.base_url + path)
        page.wait_for_selector(ready)

    browser.do(go)


def _shot(browser: Browser, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    browser.do(lambda page: page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True))


@pytest.mark.parametrize("width", WIDTHS)
def test_queue_table_stays_beside_the_filters_with_long_names(
    browser: Browser, long_names: None, django_user_model: Any, width: int
) -> None:
    """Issue #19 item 4 (section 6): the queue table of a workflow with a long name stays left of
    the filter sidebar, the cap bar covers no filter, no cell's text runs into the next, nothing
    is cut, and workflow names and keys wrap only after a separator."""
    _log_in(browser, django_user_model, width)
    _open(browser, "/admin/durable_singleton/run/queues/?refresh=0", "tr.ds-queue-row")
    _shot(browser, f"layout-queues-{width}")
    problems = browser.do(lambda page: page.evaluate(MEASURE, "#changelist"))
    beside = browser.do(
        lambda page: page.evaluate(
            """() => {
              const filter = document.querySelector('#changelist-filter').getBoundingClientRect();
              const hit = (e) => {
                const r = e.getBoundingClientRect();
                return r.right > filter.left + 1 && r.left < filter.right - 1
                  && r.bottom > filter.top && r.top < filter.bottom;
              };
              const cells = '#result_list, #result_list td, #result_list th, #result_list meter';
              return [...document.querySelectorAll(cells)]
                .filter(hit).map(e => e.tagName + ' ' + e.className + ' ' + e.innerText.trim().slice(0, 40));
            }"""
        )
    )
    wraps = browser.do(lambda page: page.evaluate(WRAPS, "#result_list td.field-workflow, #result_list th.field-key a"))
    assert not beside, f"under the filter sidebar at {width} px: {beside}"
    assert not problems, f"at {width} px: {problems}"
    assert not _mid_word(wraps), wraps
    assert TASK in browser.do(lambda page: page.inner_text("#result_list"))


@pytest.mark.parametrize("width", WIDTHS)
def test_key_page_headers_and_cells_fit_with_long_names(
    browser: Browser, long_names: None, django_user_model: Any, width: int
) -> None:
    """Issue #19 item 4 (section 6, S5): on a key's page the holders' and waiters' headers keep a
    gap between them, no cell runs into the next, the last column (created at) is not cut at the
    right edge, what a holder is doing takes at most two lines, and nothing scrolls sideways."""
    _log_in(browser, django_user_model, width)
    _open(
        browser,
        f"/admin/durable_singleton/run/queues/key/?workflow={TASK}&key={KEYS[0]}&refresh=0",
        "tr.ds-holder",
    )
    _shot(browser, f"layout-key-{width}")
    problems = browser.do(lambda page: page.evaluate(MEASURE, "#changelist"))
    doing = browser.do(lambda page: page.evaluate(WRAPS, "#ds-holders-table td.ds-doing"))
    headers = browser.do(lambda page: page.evaluate(WRAPS, "#ds-holders-table thead th, #ds-waiters-table thead th"))
    assert not problems, f"at {width} px: {problems}"
    assert doing and max(d["lines"] for d in doing) <= 2, doing
    assert all(h["lines"] <= 2 for h in headers), headers
    last = browser.do(lambda page: page.inner_text("#ds-holders-table thead th:last-child"))
    assert last.strip().lower() == "created at"


@pytest.mark.parametrize("width", WIDTHS)
def test_run_list_shows_whole_tags_and_breaks_names_at_separators(
    browser: Browser, long_names: None, django_user_model: Any, width: int
) -> None:
    """Issue #19 item 4 (section 6): the run list shows every tag whole (``singleton:<key>`` is
    not cut), breaks workflow names, keys and run ids only after a separator, lets no cell run
    into the next and needs no sideways scrolling."""
    _log_in(browser, django_user_model, width)
    _open(browser, f"/admin/durable_singleton/run/?workflow_name={TASK}", "#result_list")
    _shot(browser, f"layout-runs-{width}")
    problems = browser.do(lambda page: page.evaluate(MEASURE, "#changelist .results"))
    wraps = browser.do(
        lambda page: page.evaluate(
            WRAPS,
            "#result_list td.field-workflow_name, #result_list .ds-key, #result_list .ds-run-id, #result_list .ds-tag",
        )
    )
    tags = browser.do(
        lambda page: page.eval_on_selector_all(
            "#result_list tbody tr:first-child .ds-tag", "ts => ts.map(t => t.innerText.trim())"
        )
    )
    assert not problems, f"at {width} px: {problems}"
    assert not _mid_word(wraps), [w for w in wraps if w["breaks"]]
    assert f"singleton:{KEYS[0]}" in tags or f"singleton:{KEYS[1]}" in tags, tags
    assert all(tag in tags for tag in TAGS), tags


@pytest.mark.parametrize("width", WIDTHS)
def test_run_list_shows_generated_run_ids_unbroken(
    browser: Browser, long_names: None, django_user_model: Any, width: int
) -> None:
    """Issue #34 item 7 (section 6): a generated run id (``uuid4().hex``, 32 hex digits) is one
    unbroken line in the run list at 1,280 and 1,400 px (it wrapped into 3-4 uneven pieces), its
    first 8 characters shown and the whole id in the tooltip; the list still fits."""
    ids = [uuid.uuid4().hex for _ in range(4)]
    for n, run_id in enumerate(ids):
        RunFactory(
            run_id=run_id, workflow_name=TASK, singleton_key=KEYS[n % 2], singleton_limit=2, waiter=True, tags=TAGS
        )
    _log_in(browser, django_user_model, width)
    _open(browser, f"/admin/durable_singleton/run/?workflow_name={TASK}", "#result_list")
    problems = browser.do(lambda page: page.evaluate(MEASURE, "#changelist .results"))
    wraps = browser.do(lambda page: page.evaluate(WRAPS, "#result_list .ds-run-id"))
    titles = browser.do(lambda page: page.eval_on_selector_all("#result_list .ds-run-id", "es => es.map(e => e.title)"))
    generated = [w for w, title in zip(wraps, titles, strict=True) if title in ids]
    assert sorted(t for t in titles if t in ids) == sorted(ids)
    assert generated and all(w["lines"] == 1 for w in generated), generated
    assert all(w["text"].rstrip("…") in ids_prefixes(ids) for w in generated), generated
    assert not problems, f"at {width} px: {problems}"


def ids_prefixes(ids: list[str]) -> set[str]:
    """Return the first 8 characters of each id."""
    return {run_id[:8] for run_id in ids}
