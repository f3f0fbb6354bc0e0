"""The limit in force (K2: the runtime override and the pause over the declared
limit, S2) is the one every reader of a key's slots applies: the slot audit
and what feeds on it (K4, O3, O4), the queue cap (S15), workflow-wide controls
and the admin's queue table. Regressions of #16: each of these judged a key by
its declared limit."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_singleton.audit import FindingKind
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import SingletonQueueFullError
from durable_singleton.health import check_health
from durable_singleton.models import Run
from durable_singleton.testing import make_engine
from tests.conftest import Monitor
from tests.helpers import admitted, audited, claim


def _kinds(engine: Engine) -> list[str]:
    return sorted(str(f.kind) for f in engine.audit_slots().findings)


def _start(engine: Engine, *names: str, key: str = "K") -> None:
    for name in names:
        engine.start("wf", {"k": key}, run_id=name)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]


def _overdue(*run_ids: str) -> None:
    """Make waiters due a minute ago: past the audit's two ticks, no worker took them."""
    Run.objects.filter(pk__in=run_ids).update(wake_at=timezone.now() - timedelta(seconds=60))


@pytest.fixture
def audited_engine(registry: Registry, monitor: Monitor) -> Engine:
    audited(registry, monitor)
    return make_engine("django", registry=registry, TICK_SECONDS=1.0)


# -- the slot audit (K4, O3) ------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_a_raised_and_filled_override_is_not_over_admission(audited_engine: Engine) -> None:
    """K4, K2, O3, O4: limit 1 overridden to 3 and three holders: the audit finds
    nothing, so durable_health exits 0 and the metrics count no finding (the audit
    judged the holders by the declared limit and reported over_admitted)."""
    engine = audited_engine
    _start(engine, "A", "B", "C")
    engine.override_limit("wf", "key:K", 3, by="ops")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert sorted(r.run_id for r in engine.store.active_runs_for_key("wf", "key:K") if r.admitted) == ["A", "B", "C"]
    assert _kinds(engine) == []
    assert engine.audit_slots().by_workflow() == {}, "the metrics would count a finding"
    engine.tick()  # a fresh heartbeat: the tick is not stale
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    report = check_health(engine, stale_seconds=3600, backlog_seconds=3600)
    assert report.healthy, report.as_dict()["problems"]  # durable_health exits 0


@pytest.mark.django_db(transaction=True)
def test_holders_left_over_a_lowered_override_are_not_over_admission_but_a_later_admission_is(
    registry: Registry, monitor: Monitor
) -> None:
    """K4, K2, S9: limit 2, two holders, override lowered to 1: the holders stay
    (never evicted) and the audit finds nothing; a holder admitted after the
    change beside another is over-admission under the limit in force."""
    audited(registry, monitor, limit=2)
    engine = make_engine("django", registry=registry, TICK_SECONDS=1.0)
    _start(engine, "A", "B", "C")
    assert admitted(claim(engine, "A")) == "admitted" and admitted(claim(engine, "B")) == "admitted"
    engine.override_limit("wf", "key:K", 1, by="ops")
    assert _kinds(engine) == []
    # Plant the fault: B re-admitted after the change (the claim would never do it).
    Run.objects.filter(pk="B").update(admitted_at=timezone.now() + timedelta(seconds=5))
    assert _kinds(engine) == ["over_admitted"]


@pytest.mark.django_db(transaction=True)
def test_a_paused_keys_waiter_is_not_stalled(audited_engine: Engine) -> None:
    """K4, K2, O3: a paused key admits no one, so its overdue waiter in front of a
    free slot is not a stalled waiter (the audit reported it, durable_health exited 1)."""
    engine = audited_engine
    _start(engine, "A")
    engine.pause_key("wf", "key:K", by="ops")
    assert admitted(claim(engine, "A")) == "parked"
    _overdue("A")
    assert _kinds(engine) == []
    engine.tick()  # a fresh heartbeat: the tick is not stale
    report = check_health(engine, stale_seconds=3600, backlog_seconds=3600)
    assert report.healthy, report.as_dict()["problems"]


@pytest.mark.django_db(transaction=True)
def test_a_stall_under_a_raised_override_is_found(audited_engine: Engine) -> None:
    """K4, K2: limit 1 overridden to 2 with one holder: the second slot is free,
    and a waiter overdue in front of it is a stalled waiter (judged by the
    declared limit the key looked full, and the stall was missed)."""
    engine = audited_engine
    _start(engine, "A", "B")
    assert admitted(claim(engine, "A")) == "admitted"
    assert admitted(claim(engine, "B")) == "parked"
    # Raise the override by the row alone: its wake-up push is lost (the stall to find).
    from durable_singleton.models import SingletonKey

    SingletonKey.objects.filter(workflow_name="wf", key="key:K").update(limit_override=2)
    _overdue("B")
    report = engine.audit_slots()
    assert [(f.kind, f.run_id) for f in report.findings] == [(FindingKind.STALLED_WAITER, "B")]


# -- the queue cap (S15) -------------------------------------------------------------------
def test_the_queue_cap_counts_against_a_raised_override(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S15, K2: limit 1 overridden to 4 with max_queue_depth 1: the cap in force is
    4 + 1, so five starts are accepted and the sixth refused (the declared limit
    gave a cap of 2: the third start was refused)."""
    audited(registry, monitor, max_queue_depth=1)
    _start(engine, "A")
    engine.override_limit("wf", "key:K", 4, by="ops")
    _start(engine, "B", "C", "D", "E")
    with pytest.raises(SingletonQueueFullError) as refused:
        engine.start("wf", {"k": "K"}, run_id="F")
    assert refused.value.max_queue_depth == 1
    assert engine.store.get_run("F") is None


def test_the_queue_cap_counts_against_a_lowered_override(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S15, K2: limit 2 overridden to 1 with max_queue_depth 0: the cap in force is
    1, so a second start is refused and nothing queues (the declared limit let it queue)."""
    audited(registry, monitor, limit=2, max_queue_depth=0)
    _start(engine, "A")
    engine.override_limit("wf", "key:K", 1, by="ops")
    with pytest.raises(SingletonQueueFullError):
        engine.start("wf", {"k": "K"}, run_id="B")
    assert engine.store.get_run("B") is None
    engine.override_limit("wf", "key:K", None, by="ops")
    _start(engine, "B")
    assert engine.store.get_run("B") is not None


# -- workflow-wide controls (K2) -------------------------------------------------------------
def test_pausing_a_workflow_pauses_keys_whose_runs_were_never_claimed(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K2: runs started on a new key (no claim yet, so no lock row on the Django
    store) are not admitted after pause_workflow; resuming admits the oldest
    (the pause skipped keys without a row, and their first claim admitted them)."""
    audited(registry, monitor)
    _start(engine, "A", "B", key="fresh")
    states = engine.pause_workflow("wf", by="ops", reason="deploy")
    assert [(s.key, s.paused) for s in states] == [("key:fresh", True)]
    assert admitted(claim(engine, "A")) == "parked"
    engine.resume_workflow("wf", by="ops")
    assert [r.run_id for r in engine.store.active_runs_for_key("wf", "key:fresh") if r.admitted] == ["A"]


# -- the admin's queue table (section 6) --------------------------------------------------------
@pytest.mark.django_db
def test_the_queue_table_shows_free_slots_under_the_limit_in_force(admin_client: Any) -> None:
    """Section 6, K2, S5: in the admin's queue table and its "stalled" filter a
    paused key and a key whose override was lowered to its holders have no free
    slot; a key whose override was raised past its holders has one, as the key's
    own page says (the table judged every key by its declared limit: "(free slot)",
    red after 10 s, on the paused and the lowered key; none on the raised one)."""
    from django.urls import reverse

    from durable_singleton.models import SingletonKey
    from durable_singleton.queues import queue_table
    from tests.factories import bulk_queue

    bulk_queue(["paused"], holders=0, waiters=2)
    bulk_queue(["lowered"], holders=1, waiters=1, limit=2)
    bulk_queue(["raised"], holders=1, waiters=1)
    bulk_queue(["plain"], holders=0, waiters=1)
    SingletonKey.objects.create(workflow_name="wf", key="paused", paused=True)
    SingletonKey.objects.create(workflow_name="wf", key="lowered", limit_override=1)
    SingletonKey.objects.create(workflow_name="wf", key="raised", limit_override=2)
    rows = {r.key: r for r in queue_table(limit=None).rows}
    assert {k: (r.limit, r.free_slots) for k, r in rows.items()} == {
        "paused": (1, 0),
        "lowered": (1, 0),
        "raised": (2, 1),
        "plain": (1, 1),
    }
    assert {r.key for r in queue_table(only="stalled", limit=None).rows} == {"raised", "plain"}

    url = reverse("admin:durable_singleton_run_queues")
    html = admin_client.get(url).content.decode()
    shown = {
        key: "free slot" in row
        for row in html.split('<tr class="ds-queue-row"')[1:]
        for key in [row.split('data-key="', 1)[1].split('"', 1)[0]]
    }
    assert shown == {"paused": False, "lowered": False, "raised": True, "plain": True}
    stalled = admin_client.get(url, {"only": "stalled"}).context["rows"]
    assert sorted(item["row"].key for item in stalled) == ["plain", "raised"]
    assert all(item["stuck"] for item in stalled)


@pytest.mark.vendor_agnostic
def test_the_declared_limit_falls_back_to_the_largest_stored_one() -> None:
    """S2, X3c: the declared limit is the latest registered version's; for a
    workflow this process does not declare, the largest limit stored on the
    key's runs; with none stored, None (the limit in force is then 1)."""
    from durable_singleton.admission import declared_limit, limit_in_force

    assert declared_limit({"wf": 3}, "wf", (5, None)) == 3
    assert declared_limit({}, "wf", (2, None, 5, 0)) == 5
    assert declared_limit({}, "wf") is None and limit_in_force(declared_limit({}, "wf")) == 1
    assert declared_limit({}, "quota:q", (1,)) == 1


@pytest.mark.vendor_agnostic
def test_the_declared_limit_fallback_is_spelt_once() -> None:
    """S2, STYLE "One place for a rule": no module reads the declared limits
    (``limits.get(...)``, ``limits[...]``) but admission.declared_limit; the
    fallback was written five ways (issue 32, item 5), one of them with no
    fallback to the stored limits at all."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "durable_singleton").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or func.name == "declared_limit":
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                    target: ast.expr | None = node.func.value
                elif isinstance(node, ast.Subscript):
                    target = node.value
                else:
                    continue
                if isinstance(target, ast.Name) and target.id == "limits":
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []
