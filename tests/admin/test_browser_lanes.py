"""The lanes page in Debian's chromium (issue #19 item 5): a holder drawn as a bar, its waiters as
numbered boxes in admission order, and the drawing redrawn in place (no reload) when the slot is
handed off (S5, S7). The second test drives a burst through the embedded worker and saves the
docs' picture (``artifacts/lanes.png``; docs/_static/admin-lanes.png is a copy)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as declared
from durable_singleton.engine import Engine
from durable_singleton.models import QuotaMembership, Run
from durable_singleton.runtime import get_engine
from tests.admin.test_admin_pages import CAPPED, start_queue
from tests.admin.test_browser_admin import ARTIFACTS, BROWSER_TEST, Browser, wait_until
from tests.admin.test_quota_pages import plain_and_keyed
from tests.helpers import drain, settle

pytestmark = BROWSER_TEST

DEMO = "demo-sync-inventory"  # limit 1, no cap

#: What the drawing shows, read from the SVG's elements and their boxes on the screen.
READ = r"""() => {
  const svg = document.querySelector('#ds-lanes-svg');
  if (!svg) return null;
  const box = (e) => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, w: r.width, h: r.height}; };
  const now = svg.querySelector('.ds-now').getBoundingClientRect().x;
  return {
    svg: box(svg),
    now,
    scroll: document.documentElement.scrollWidth, window: window.innerWidth,
    kept: window.__dsKept === 1,
    refreshed: document.querySelector('#ds-lanes').dataset.refreshedAt || null,
    lanes: [...svg.querySelectorAll('.ds-lane')].map(l => l.dataset.key),
    rows: [...svg.querySelectorAll('.ds-lane')].map(l => l.querySelectorAll('.ds-slot-row').length),
    bars: [...svg.querySelectorAll('rect.ds-hold')].map(b => ({
      run: b.dataset.runId, state: b.dataset.state, holding: b.dataset.holding === '1', ...box(b)})),
    waiters: [...svg.querySelectorAll('.ds-waiter')].map(w => ({
      run: w.dataset.runId, position: Number(w.dataset.position), text: w.querySelector('text').textContent.trim(),
      ...box(w)})),
    handoffs: [...svg.querySelectorAll('.ds-handoff')].map(h => [h.dataset.from, h.dataset.to]),
    admissions: [...svg.querySelectorAll('.ds-admit')].map(a => a.dataset.runId),
  };
}"""


def _log_in(browser: Browser, django_user_model: Any, path: str, width: int = 1280) -> None:
    django_user_model.objects.create_superuser("admin", password="pw-browser")

    def log_in(page: Any) -> None:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(browser.base_url + "/admin/login/?" + urlencode({"next": path}))
        page.fill("#id_username", "admin")
        page.fill("#id_password", "pw-browser")
        page.click("input[type=submit]")
        page.wait_for_selector("#ds-lanes")

    browser.do(log_in)


def test_lanes_draw_the_holder_and_the_waiters_and_redraw_in_place(
    browser: Browser, settings: Any, django_user_model: Any
) -> None:
    """S5, S7: one holder and two waiters of store:S. The holder is a bar ending at the now line,
    the waiters boxes 1 and 2 (in admission order) right of it. The holder settles and the store
    hands its slot to the first waiter; without a reload the drawing shows the handoff, the new
    holder's bar and the remaining waiter at position 1, then a run started meanwhile at 2."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()
    start_queue(engine, CAPPED, "S", 3, admit=1)
    _log_in(browser, django_user_model, f"/admin/durable_singleton/run/queues/lanes/?workflow={CAPPED}&refresh=1")
    seen = browser.do(lambda page: page.evaluate(READ))
    assert seen["lanes"] == ["store:S"], seen
    (bar,) = seen["bars"]
    assert (bar["run"], bar["holding"], bar["state"]) == ("S-0", True, "running"), bar
    assert bar["w"] > 0 and bar["h"] > 0 and bar["x"] + bar["w"] <= seen["now"] + 1, (bar, seen["now"])
    assert [(w["run"], w["position"], w["text"]) for w in seen["waiters"]] == [("S-1", 1, "1"), ("S-2", 2, "2")]
    assert all(w["x"] > seen["now"] and w["w"] > 0 for w in seen["waiters"]), seen
    assert seen["scroll"] <= seen["window"] and seen["svg"]["x"] + seen["svg"]["w"] <= seen["window"], seen
    browser.do(lambda page: page.evaluate("() => { window.__dsKept = 1; }"))

    assert settle(engine, "S-0", "completed")
    engine.start(CAPPED, {"store_id": "S", "duration": 0}, run_id="S-3")
    engine.dispatcher.queue.clear()

    def redrawn() -> dict[str, Any] | None:
        now = browser.do(lambda page: page.evaluate(READ))
        waiting = [(w["run"], w["position"]) for w in now["waiters"]] if now else []
        return now if now and ["S-0", "S-1"] in now["handoffs"] and waiting == [("S-2", 1), ("S-3", 2)] else None

    later = wait_until(redrawn, 30, "the drawing to show the handoff and the new waiter")
    assert later["kept"] and later["refreshed"], "redrawn in place, not by reloading the page"
    states = {b["run"]: (b["state"], b["holding"]) for b in later["bars"]}
    assert states["S-0"] == ("completed", False) and states["S-1"][1], states
    assert later["admissions"].count("S-1") == 1


def test_a_burst_on_one_key_backs_up_only_its_lane(
    browser: Browser, thread_workers: Engine, django_user_model: Any
) -> None:
    """The reference text's live system, drawn: three keys, one slot each; a burst on store:A
    backs up only A's lane, whose holders follow one another through handoffs, while B and C
    each run theirs. Saves the docs' screenshot once A has handed off four times and still
    has waiters."""
    burst = [thread_workers.start(DEMO, {"store_id": "A", "duration": 2.5}).run_id for _ in range(8)]
    for store, runs, seconds in (("B", 3, 4.0), ("C", 2, 6.0)):
        for _ in range(runs):
            thread_workers.start(DEMO, {"store_id": store, "duration": seconds})
    lanes = f"/admin/durable_singleton/run/queues/lanes/?workflow={DEMO}&minutes=1&refresh=1"
    _log_in(browser, django_user_model, lanes, 1400)

    def busy() -> dict[str, Any] | None:
        seen = browser.do(lambda page: page.evaluate(READ))
        if not seen:
            return None
        a_handoffs = [h for h in seen["handoffs"] if h[0] in burst and h[1] in burst]
        return seen if len(a_handoffs) >= 4 and any(w["run"] in burst for w in seen["waiters"]) else None

    seen = wait_until(busy, 90, "store:A to hand off four times with waiters left")
    assert {"store:A", "store:B", "store:C"} <= set(seen["lanes"]), seen["lanes"]
    spans = list(
        Run.objects.filter(workflow_name=DEMO)
        .order_by("singleton_key", "admitted_at")
        .values_list("run_id", "singleton_key", "status", "singleton_slot", "created_at", "admitted_at", "finished_at")
    )
    assert set(seen["rows"]) == {1}, f"one slot, one row: a handoff's spans follow one another {seen}, {spans}"
    waiting_a = [w for w in seen["waiters"] if w["run"] in burst]
    assert [w["position"] for w in waiting_a] == list(range(1, len(waiting_a) + 1))
    order = list(Run.objects.filter(run_id__in=burst).order_by("created_at", "run_id").values_list("run_id", flat=True))
    assert [w["run"] for w in waiting_a] == order[len(order) - len(waiting_a) :], "the waiters in admission order"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.do(lambda page: page.locator("#content").screenshot(path=str(ARTIFACTS / "lanes.png")))
    wait_until(
        lambda: Run.objects.filter(run_id__in=burst, status="completed").count() == len(burst), 90, "the burst to drain"
    )


#: Every text box of the drawing, and each lane's label with the marks drawn near it.
BOXES = r"""() => {
  const svg = document.querySelector('#ds-lanes-svg');
  const box = (e) => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, r: r.right, b: r.bottom}; };
  const name = (e) => (e.getAttribute('class') || e.tagName) + ' "' + (e.textContent || '').trim().slice(0, 30) + '"';
  return {
    svg: box(svg),
    texts: [...svg.querySelectorAll('text')].filter(t => t.getBBox().width > 0).map(t => ({name: name(t), ...box(t)})),
    lanes: [...svg.querySelectorAll('.ds-lane')].map(l => ({
      key: l.dataset.key,
      label: box(l.querySelector('.ds-lane-label')),
      marks: [...l.querySelectorAll('.ds-admit, .ds-handoff')].map(m => ({name: name(m), ...box(m)})),
    })),
    legend: document.querySelector('.ds-lanes-legend').innerText,
  };
}"""


def _stamper(
    engine: Engine, runs: dict[str, dict[str, float]], memberships: dict[str, float] | None = None
) -> Callable[[], None]:
    """Return what stamps ``runs``' times (``{run_id: {field: seconds before now}}``) and the
    ``created_at`` of ``memberships``' quota memberships (``{run_id: seconds before now}``) that
    many seconds before the database's clock at the call (R5), as the claim and the release
    stamp them: :func:`_overlaps` calls it before each page it reads."""

    def stamp() -> None:
        now = engine.store.now()
        for run_id, fields in runs.items():
            Run.objects.filter(pk=run_id).update(**{name: now - timedelta(seconds=s) for name, s in fields.items()})
        for run_id, seconds in (memberships or {}).items():
            QuotaMembership.objects.filter(run_id=run_id).update(created_at=now - timedelta(seconds=seconds))

    return stamp


def _meet(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Tell whether two boxes overlap by more than half a pixel each way."""
    return a["x"] < b["r"] - 0.5 and b["x"] < a["r"] - 0.5 and a["y"] < b["b"] - 0.5 and b["y"] < a["b"] - 0.5


@pytest.mark.parametrize("width", [1280, 1400])
def test_no_two_texts_of_the_drawing_overlap_and_no_mark_covers_a_label(
    browser: Browser, settings: Any, django_user_model: Any, width: int
) -> None:
    """Issue #34 item 5 (section 6, S7): at 1,280 and 1,400 px, for every window length
    offered, no two text boxes of the lanes drawing overlap (the axis labels ``-1 min`` and
    ``now`` did in the 10-minute window, ``-30 s`` and ``now`` in the 5-minute one), no
    admission mark or handoff line covers its lane's label, and the legend names the amber
    bar of a holder whose lease was not renewed (K3)."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()
    start_queue(engine, CAPPED, "T", 3, admit=1)
    start_queue(engine, CAPPED, "U", 2, admit=1)
    assert settle(engine, "T-0", "completed")  # an admission and a handoff in the window
    # Stamped 50 s before each page is read, so that in every window the admission and the
    # handoff are drawn left, under the lane's label line.
    stamp = _stamper(
        engine,
        {
            "T-0": {"created_at": 58, "admitted_at": 57, "finished_at": 50},
            "T-1": {"created_at": 57.5, "admitted_at": 50},
            "T-2": {"created_at": 57},
        },
    )
    base = f"/admin/durable_singleton/run/queues/lanes/?workflow={CAPPED}&refresh=0"
    _log_in(browser, django_user_model, base, width)
    problems, seen = _overlaps(browser, base, 2, stamp)
    assert problems == [], problems
    assert "lease not renewed" in seen["legend"], seen["legend"]


def _overlaps(browser: Browser, base: str, lanes: int, stamp: Callable[[], None]) -> tuple[list[str], dict[str, Any]]:
    """Read the drawing of ``base`` in every window offered, with ``lanes`` lanes drawn and a
    mark in one at least; return what overlaps (two texts, a mark over a lane's label, a
    label past the drawing's right edge) and the last window's boxes.

    Each page draws the minutes before its own *now* on the database's clock, so ``stamp``
    (:func:`_stamper`) puts the admissions back to the same seconds before that clock right
    before each page is read: stamped once, they left the 1-minute window as soon as the
    pages read since took more than the margin (ten reads in the quota test, over 10 s in
    the loaded CI passes: its second page's 1-minute window drew no mark)."""
    from durable_singleton.admin.lanes import MINUTE_CHOICES

    problems = []
    seen: dict[str, Any] = {}
    for minutes in MINUTE_CHOICES:

        def read(page: Any, minutes: int = minutes) -> dict[str, Any]:
            page.goto(f"{browser.base_url}{base}&minutes={minutes}")
            page.wait_for_selector("#ds-lanes-svg")
            return dict(page.evaluate(BOXES))

        stamp()
        seen = browser.do(read)
        texts = seen["texts"]
        assert any("now" in t["name"] for t in texts) and len(seen["lanes"]) == lanes, seen
        problems += [
            f"{minutes} min: {a['name']} and {b['name']} overlap"
            for i, a in enumerate(texts)
            for b in texts[i + 1 :]
            if _meet(a, b)
        ]
        problems += [
            f"{minutes} min: {mark['name']} covers the label of {lane['key']}"
            for lane in seen["lanes"]
            for mark in lane["marks"]
            if _meet(mark, lane["label"])
        ]
        problems += [
            f"{minutes} min: the label of {lane['key']} runs past the drawing"
            for lane in seen["lanes"]
            if lane["label"]["r"] > seen["svg"]["r"] + 0.5
        ]
        assert any(lane["marks"] for lane in seen["lanes"]), (f"{minutes} min: no mark drawn", seen)
    return problems, seen


@pytest.mark.parametrize("width", [1280, 1400])
def test_a_quota_lanes_texts_do_not_overlap(
    browser: Browser,
    django_user_model: Any,
    registry: Registry,
    monkeypatch: pytest.MonkeyPatch,
    width: int,
) -> None:
    """Issue #34 item 6 (X3, X3d, section 6): the lane of quota billing's key acme, labelled
    with its limit, counts and causes ("limit 1 · 1 holding · 3 waiting: 2 for a slot of the
    quota, 1 not due yet"), after the handoff from H (plain) to W1 (keyed), drawn alone
    (``?quota=billing``) and after the keyed workflow's own key: at 1,280 and 1,400 px and in
    every window, no two text boxes overlap, no mark covers a label, and every label ends
    inside the drawing."""
    engine = plain_and_keyed(registry, monkeypatch)
    for name, definition in registry.latest.items():  # the admin reads the process's registry
        monkeypatch.setitem(declared.latest, name, definition)
    engine.start("plain", {"account": "acme", "hold": True}, run_id="H")
    drain(engine)
    engine.start("keyed", {"account": "acme", "store": "S1", "hold": True}, run_id="W1")
    engine.start("plain", {"account": "acme"}, run_id="W2")
    engine.start("plain", {"account": "acme"}, run_id="W3")
    engine.start("plain", {"account": "acme"}, run_id="D", not_before=3600.0)
    drain(engine)
    engine.signal("H", "go")
    drain(engine)
    assert Run.objects.get(pk="W1").quota_slot == "holder"
    # Stamped about 50 s before each page is read, as test_no_two_texts_of_the_drawing_overlap...
    # does: the admission and the handoff are drawn left, under the lane's label line, in every window.
    stamp = _stamper(
        engine,
        {"H": {"created_at": 58, "admitted_at": 57, "finished_at": 50}, "W1": {"created_at": 57.5, "admitted_at": 50}},
        {"H": 58, "W1": 57.5},
    )
    base = "/admin/durable_singleton/run/queues/lanes/?quota=billing&refresh=0"
    _log_in(browser, django_user_model, base, width)
    problems, seen = _overlaps(browser, base, 1, stamp)
    label = [t["name"] for t in seen["texts"] if "ds-lane-label" in t["name"]]
    assert label and "quota billing · acme" in label[0], seen["texts"]
    summary = browser.do(lambda page: page.locator(".ds-lane-quota .ds-lane-summary").text_content())
    assert summary == "limit 1 · 1 holding · 3 waiting: 2 for a slot of the quota, 1 not due yet", summary
    problems += _overlaps(browser, "/admin/durable_singleton/run/queues/lanes/?workflow=keyed&refresh=0", 2, stamp)[0]
    assert problems == [], problems
