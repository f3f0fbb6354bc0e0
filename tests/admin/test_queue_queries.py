"""The read-only queue queries behind the admin and ``durable_queues`` (SPEC section 6, S5, S12, S15)."""

from __future__ import annotations

import io
import json
import random
import sys
import uuid
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_singleton import Singleton
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.queues import format_age, key_queue, queue_table, run_place
from durable_singleton.stores.base import AdmissionResult
from durable_singleton.testing import make_engine
from tests.factories import T0, RunFactory, bulk_queue
from tests.helpers import settle


def register(reg: Registry, name: str = "wf", *, limit: int = 1, depth: int | None = None) -> None:
    reg.add(
        name, "1", lambda ctx, i: None, singleton=Singleton(key=lambda i: i["k"], limit=limit, max_queue_depth=depth)
    )


def claim(engine: Engine, run_id: str, limit: int) -> AdmissionResult:
    """Take a turn's lease and run the store's claim for ``run_id`` (S5), as execute() does."""
    from tests.helpers import admitted
    from tests.helpers import claim as begin

    return AdmissionResult(admitted(begin(engine, run_id)))


@pytest.mark.django_db
def test_table_counts_holders_waiters_oldest_wait_and_fullness() -> None:
    """Section 6: per workflow and key, limit, holders, waiting, oldest waiter and cap; S12: an untracked
    suspended run counts as a holder; terminal runs are not in the queue."""
    reg = Registry()
    register(reg, "capped", limit=1, depth=2)
    bulk_queue(["A"], workflow="capped", holders=1, waiters=2)
    bulk_queue(["B"], workflow="capped", holders=0, waiters=1, legacy_holders=1, start=T0 + timedelta(seconds=5))
    bulk_queue(["C"], workflow="unregistered", holders=2, waiters=0, limit=3)
    bulk_queue(["D"], workflow="capped", holders=0, waiters=0, finished=3)
    page = queue_table(reg=reg, sort="key")
    rows = {(r.workflow, r.key): r for r in page.rows}
    assert set(rows) == {("capped", "A"), ("capped", "B"), ("unregistered", "C")}
    a = rows["capped", "A"]
    assert (a.limit, a.holders, a.waiting, a.active, a.max_queue_depth, a.capacity) == (1, 1, 2, 3, 2, 3)
    assert a.fullness == 1.0
    assert a.oldest_waiter_at == T0 + timedelta(milliseconds=1)
    assert a.oldest_wait_seconds(T0 + timedelta(seconds=10)) == pytest.approx(9.999)
    b = rows["capped", "B"]
    assert (b.holders, b.waiting, b.active) == (1, 1, 2)
    c = rows["unregistered", "C"]
    assert (c.limit, c.holders, c.waiting, c.max_queue_depth, c.capacity, c.fullness) == (3, 2, 0, None, None, None)
    assert (page.keys, page.holders, page.waiting) == (3, 4, 3)


@pytest.mark.django_db
def test_table_filters_sorts_and_pages() -> None:
    """Section 6: the queue table is filterable (workflow, key text, waiting/full/stalled) and sortable."""
    reg = Registry()
    register(reg, "wf", limit=2, depth=3)
    bulk_queue([f"k{n:02}" for n in range(10)], holders=2, waiters=3, limit=2)  # full: 5/5
    bulk_queue(["quiet"], holders=1, waiters=0, limit=2)
    bulk_queue(["stuck"], holders=0, waiters=2, limit=2, start=T0 - timedelta(hours=1))
    bulk_queue(["other"], workflow="wf2", holders=1, waiters=1)
    assert queue_table(reg=reg).keys == 13
    assert [r.key for r in queue_table(reg=reg, only="stalled").rows] == ["stuck"]
    assert {r.key for r in queue_table(reg=reg, only="full").rows} == {f"k{n:02}" for n in range(10)}
    assert "quiet" not in {r.key for r in queue_table(reg=reg, only="waiting", limit=None).rows}
    assert queue_table(reg=reg, only="waiting").keys == 12
    assert [r.key for r in queue_table(reg=reg, workflow="wf2").rows] == ["other"]
    assert [r.key for r in queue_table(reg=reg, key_contains="tuc").rows] == ["stuck"]
    assert queue_table(reg=reg, sort="oldest").rows[0].key == "stuck"
    assert queue_table(reg=reg, sort="-waiting").rows[0].waiting == 3
    assert queue_table(reg=reg, sort="waiting").rows[0].key == "quiet"
    assert queue_table(reg=reg, sort="-fullness").rows[0].fullness == 1.0
    assert queue_table(reg=reg, sort="fullness").rows[0].fullness is not None  # no cap sorts last
    page1 = queue_table(reg=reg, sort="key", limit=5)
    page3 = queue_table(reg=reg, sort="key", offset=10, limit=5)
    assert [r.key for r in page1.rows] == ["k00", "k01", "k02", "k03", "k04"]
    assert [r.key for r in page3.rows] == ["other", "quiet", "stuck"]
    with pytest.raises(ValueError, match="unknown sort"):
        queue_table(reg=reg, sort="nope")
    with pytest.raises(ValueError, match="unknown filter"):
        queue_table(reg=reg, only="nope")


@pytest.mark.django_db
def test_table_takes_two_queries_whatever_the_number_of_keys() -> None:
    """Issue #5 point 5: a bounded number of queries, no query per row: the page and its totals
    come from one grouped query, the runtime controls of the page's keys (K2) from one more."""
    reg = Registry()
    register(reg, limit=1, depth=5)
    bulk_queue([f"small-{n}" for n in range(3)])
    with CaptureQueriesContext(connection) as small:
        assert len(queue_table(reg=reg).rows) == 3
    bulk_queue([f"big-{n}" for n in range(300)], start=T0 + timedelta(hours=1))
    with CaptureQueriesContext(connection) as big:
        assert len(queue_table(reg=reg, limit=None).rows) == 303
    assert len(small) == len(big) == 2
    past_the_end = queue_table(reg=reg, offset=400, limit=100)
    assert (past_the_end.rows, past_the_end.keys, past_the_end.waiting) == ([], 303, 909)


@pytest.mark.django_db(transaction=True)
def test_key_queue_lists_waiters_in_the_order_the_claim_admits_them() -> None:
    """S5 step 3, issue #5 point 2: the key page's waiter order is the claim's order. Runs created at
    the same microsecond with shuffled ids, and runs at other times, are listed; then the holder is
    settled and every waiter claims at once in random order, repeatedly: each time the one admitted
    is the head of the listed queue."""
    reg = Registry()
    register(reg, limit=1)
    now = [T0]
    engine = make_engine("django", registry=reg, clock=lambda: now[0])
    ids = [f"{chr(97 + n)}-{uuid.uuid4().hex[:6]}" for n in range(8)]
    random.shuffle(ids)
    for n, run_id in enumerate(ids):
        if n % 3 == 0:
            now[0] = T0 + timedelta(seconds=n)  # runs in between share one timestamp
        engine.start("wf", {"k": "K"}, run_id=run_id)
    head = key_queue("wf", "K", reg=reg).waiters[0].run.run_id
    assert claim(engine, head, 1) is AdmissionResult.ADMITTED
    rng = random.Random(5)
    admitted = [head]
    while True:
        queue = key_queue("wf", "K", reg=reg)
        assert [h.run.run_id for h in queue.holders] == [admitted[-1]]
        listed = [w.run.run_id for w in queue.waiters]
        assert [w.position for w in queue.waiters] == list(range(1, len(listed) + 1))
        assert settle(engine, admitted[-1], "completed")
        if not listed:
            break
        order = listed[:]
        rng.shuffle(order)
        verdicts = {run_id: claim(engine, run_id, 1) for run_id in order}
        winners = [r for r, v in verdicts.items() if v is AdmissionResult.ADMITTED]
        assert winners == [listed[0]], f"claim admitted {winners}, page listed {listed[0]} first"
        admitted.append(winners[0])
    assert sorted(admitted) == sorted(ids)


@pytest.mark.django_db
def test_key_queue_pages_waiters_with_positions_in_four_queries() -> None:
    """Issue #5 points 2 and 5: positions continue across pages; four queries whatever the
    length (holders, waiting count, a page of waiters, the key's controls row, K2)."""
    bulk_queue(["K"], holders=1, waiters=250, legacy_holders=1)
    with CaptureQueriesContext(connection) as queries:
        queue = key_queue("wf", "K", offset=200, limit=100, reg=Registry())
    assert len(queries) == 4
    assert queue.waiting == 250
    assert [w.position for w in queue.waiters] == list(range(201, 251))
    assert [h.run.run_id for h in queue.holders] == ["wf-K-0", "wf-K-252"]
    assert queue.limit == 1 and queue.max_queue_depth is None


@pytest.mark.django_db
def test_run_place_names_position_and_holders() -> None:
    """Issue #5 point 1: a waiter's place is its position behind the named holders; a holder's is
    the time it took its slot; terminal and non-singleton runs have none."""
    bulk_queue(["K"], holders=2, waiters=3, limit=2)
    runs = {r.run_id: r for r in Run.objects.all()}
    place = run_place(runs["wf-K-3"])
    assert (place.kind, place.position, place.holders) == ("waiter", 2, ("wf-K-0", "wf-K-1"))
    holder = run_place(runs["wf-K-0"])
    assert holder.kind == "holder" and holder.since == runs["wf-K-0"].started_at
    assert run_place(runs["wf-K-5"]).kind == "terminal"
    plain = RunFactory.build(run_id="x", workflow_name="p", status="running")
    assert run_place(plain).kind == "none"


def test_format_age() -> None:
    assert [format_age(s) for s in (None, 4.25, 192, 7500, 3 * 86400 + 4 * 3600 + 5)] == [
        "—",
        "4.2 s",
        "3 min 12 s",
        "2 h 5 min",
        "3 d 4 h",
    ]


@pytest.mark.django_db
def test_durable_queues_prints_the_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue #5 point 4: the management command prints the admin's queue table, or JSON."""
    bulk_queue(["store:A", "store:B"], waiters=2)
    bulk_queue(["store:C"], waiters=0, start=T0 + timedelta(minutes=1))
    call_command("durable_queues")
    text = capsys.readouterr().out
    assert "3 keys with active runs, 3 holding, 4 waiting" in text
    assert "store:A" in text and "store:C" in text
    call_command("durable_queues", "--json", "--only", "waiting", "--sort", "key")
    document = json.loads(capsys.readouterr().out)
    assert [row["key"] for row in document["rows"]] == ["store:A", "store:B"]
    assert document["rows"][0] | {"oldest_wait_seconds": None} == {
        "workflow": "wf",
        "key": "store:A",
        "limit": 1,
        "holders": 1,
        "waiting": 2,
        "active": 3,
        "oldest_waiter_at": (T0 + timedelta(milliseconds=1)).isoformat(),
        "oldest_wait_seconds": None,
        "max_queue_depth": None,
        "capacity": None,
        "fullness": None,
        "paused": False,
        "limit_override": None,
        "throttled": 0,
    }
    with pytest.raises(CommandError, match="unknown sort"):
        call_command("durable_queues", "--sort", "bogus")


def _without_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import rich`` fail, as when the optional extra is not installed."""
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setitem(sys.modules, "rich.console", None)


@pytest.mark.django_db
def test_durable_queues_prints_plain_columns_without_rich(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rich is an optional extra (issue #10): without it the command prints the same table as plain columns."""
    _without_rich(monkeypatch)
    bulk_queue(["store:A", "store:B"], waiters=2)
    call_command("durable_queues", "--sort", "key")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 keys with active runs, 2 holding, 4 waiting"
    assert lines[1].split() == ["workflow", "key", "limit", "holders", "waiting", "oldest", "waiter", "cap", "full"]
    assert lines[2].split()[:5] == ["wf", "store:A", "1", "1", "2"]
    assert lines[3].split()[:5] == ["wf", "store:B", "1", "1", "2"]
    assert lines[4].startswith("as of ")


class _Terminal(io.StringIO):
    """An output that says it is a terminal, as a user's shell is."""

    def isatty(self) -> bool:
        return True


@pytest.mark.django_db
def test_durable_queues_never_cuts_a_name_piped_or_drawn(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """O3: a long workflow name and key are printed whole. Piped or redirected (here:
    captured) at a terminal width of 40 columns, each key's row is one line of plain
    columns with both names whole (rich drew it at the terminal's width and cut the
    names to "…", so `| grep` and the tests run under xdist found "thrott…"); drawn on
    a terminal, a cell folds onto more lines and loses no character."""
    monkeypatch.setenv("COLUMNS", "40")
    workflow, key = "sync-inventory-of-the-northern-warehouses", "store:" + "n" * 60
    bulk_queue([key], workflow=workflow, waiters=1)
    call_command("durable_queues")
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == [workflow, key] for line in lines), lines
    assert not any("…" in line for line in lines), lines
    drawn = _Terminal()
    call_command("durable_queues", stdout=drawn)
    text = drawn.getvalue()
    assert "┃" in text and "…" not in text, text  # the rich drawing, nothing cut
    cells = "".join(part.strip() for line in text.splitlines() for part in line.split("│")[1:2])
    assert workflow in cells, text


@pytest.mark.django_db
def test_durable_queues_title_says_one_key_in_the_singular(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """O3: one key with active runs is "1 key", not "1 keys" (ngettext, as the admin's messages)."""
    _without_rich(monkeypatch)
    bulk_queue(["store:A"], waiters=1)
    call_command("durable_queues")
    assert capsys.readouterr().out.splitlines()[0] == "1 key with active runs, 1 holding, 1 waiting"


@pytest.mark.django_db
def test_durable_queues_cap_is_the_figure_full_counts_against(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """S15, issue #19 point 8: the cap column is limit + max_queue_depth, the
    active runs at which start refuses, the same figure as the one after the
    slash in the full column (it showed max_queue_depth: "cap 2" beside "2/3")."""
    _without_rich(monkeypatch)
    bulk_queue(["store:A"], workflow="sync-inventory", holders=1, waiters=1)  # limit 1, max_queue_depth 2
    call_command("durable_queues")
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-3:] == ["3", "2/3", "(67%)"], lines


@pytest.mark.django_db
def test_durable_queues_runs_lists_holders_and_waiters_by_id_in_admission_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """S5 step 3, issue #19 point 8: --runs names each key's holders and its
    waiters in the claim's order (oldest first), at most --runs-per-key of
    each, and says how many more wait; --json carries the same ids."""
    bulk_queue(["store:A"], holders=1, waiters=3)
    bulk_queue(["store:B"], holders=1, waiters=0, start=T0 + timedelta(minutes=1))
    call_command("durable_queues", "--runs", "--runs-per-key=2", "--sort=key")
    text = capsys.readouterr().out
    assert "wf  store:A\n  holding (1): wf-store:A-0\n  waiting (3): wf-store:A-1 wf-store:A-2 (and 1 more)\n" in text
    assert "wf  store:B\n  holding (1): wf-store:B-0\n  waiting (0): —\n" in text
    call_command("durable_queues", "--runs", "--json", "--sort=key")
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["key"], r["holder_ids"], r["waiter_ids"]) for r in rows] == [
        ("store:A", ["wf-store:A-0"], ["wf-store:A-1", "wf-store:A-2", "wf-store:A-3"]),
        ("store:B", ["wf-store:B-0"], []),
    ]
    call_command("durable_queues", "--json")
    assert "holder_ids" not in json.loads(capsys.readouterr().out)["rows"][0]
    with pytest.raises(CommandError, match="--runs-per-key"):
        call_command("durable_queues", "--runs", "--runs-per-key=0")
