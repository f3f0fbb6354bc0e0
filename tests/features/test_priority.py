"""Priority inside a key (SPEC X8, issue 33 items 3 and 4): the queue order
(priority DESC, created_at, run_id) on each store path, the holder never
preempted, bad input refused with nothing written, a row of an older release,
explain's words, the admin's column and django.tasks' ``priority``.

The conformance suite (durable_singleton.testing.conformance) states the order
on every store; here the paths it does not reach by itself: the ORM path on
PostgreSQL (``DjangoStore(raw_sql=False)``, which the conformance suite's
DjangoStore leaves for the fast path), the Workflow class API and the rest.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidPriorityError
from durable_singleton.explain import explain
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine

from ..helpers import claim

STORES: dict[str, Callable[[], Any]] = {
    "memory": MemoryStore,
    "django": DjangoStore,  # the fast path on PostgreSQL, the ORM path elsewhere
    "orm": lambda: DjangoStore(raw_sql=False),
}


def _engine(store: Any) -> tuple[Engine, list[str]]:
    """An engine over ``store`` with ``wf`` (limit 1 per input["k"]) whose body records its run id."""
    registry = Registry()
    entered: list[str] = []

    def body(ctx: Any, input: Any) -> None:
        entered.append(ctx.run_id)

    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "limit": 1, "max_queue_depth": None})
    return make_engine(store, registry=registry), entered


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", sorted(STORES))
def test_each_store_path_admits_higher_priority_first_and_fifo_within_a_priority(kind: str) -> None:
    """X8, S5 step 3, S7: behind a holder, ten waiters of four priorities are
    admitted by (priority DESC, created_at, run_id) one at a time, through the
    handoff, on the memory store, the Django store and its ORM path."""
    engine, entered = _engine(STORES[kind]())
    engine.start("wf", {"k": "K"}, run_id="holder", priority=-100)
    engine.execute("holder")  # held: the later, higher priorities do not preempt it
    entered.clear()
    plan = [("a", 0), ("b", 3), ("c", 0), ("d", -1), ("e", 3), ("f", 100), ("g", 0), ("h", -1), ("i", 3), ("j", 99)]
    engine.start("wf", {"k": "K"}, run_id="blocker", priority=0)
    for run_id, priority in plan:
        engine.start("wf", {"k": "K"}, run_id=run_id, priority=priority)
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    expected = ["f", "j", "b", "e", "i", "blocker", "a", "c", "g", "d", "h"]
    assert entered == expected
    assert all(engine.get(r).status == RunStatus.COMPLETED for r in expected)


@pytest.mark.django_db(transaction=True)
def test_a_holder_of_low_priority_keeps_its_slot_while_a_high_priority_run_waits() -> None:
    """X8, S4, S5: a holder of priority -100 keeps its slot; a run of priority 100
    started after it is parked behind it, and admitted at its settle (the handoff)."""
    engine, _entered = _engine(DjangoStore())
    engine.start("wf", {"k": "K"}, run_id="low", priority=-100)
    assert claim(engine, "low").run is not None and engine.get("low").admitted
    engine.start("wf", {"k": "K"}, run_id="high", priority=100)
    engine.execute("high")
    assert engine.get("high").status == RunStatus.SUSPENDED and not engine.get("high").admitted
    assert engine.get("low").admitted and engine.get("low").status == RunStatus.RUNNING


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bad", [True, 2.0, "5", None, 101, -101])
def test_a_bad_priority_from_the_workflow_class_raises_and_writes_nothing(bad: Any) -> None:
    """X8, section 7: BaseWorkflow.start (and so dispatch) refuses a priority that is
    not an int from -100 to 100 with InvalidPriorityError (a ValidationError), and
    no run is written; a run id already used is no excuse for a bad priority."""
    from durable_singleton.exceptions import ValidationError
    from testproject.inventory.workflows import SyncInventoryWide

    engine = get_engine()
    SyncInventoryWide.start({"store_id": "V"}, run_id="kept", priority=7)
    with pytest.raises(InvalidPriorityError) as refused:
        SyncInventoryWide.dispatch({"store_id": "V"}, run_id="new", engine=engine, priority=bad)
    assert isinstance(refused.value, ValidationError)
    with pytest.raises(InvalidPriorityError):
        SyncInventoryWide.start({"store_id": "V"}, run_id="kept", priority=bad)
    assert list(Run.objects.values_list("run_id", "priority")) == [("kept", 7)]


@pytest.mark.django_db(transaction=True)
def test_a_run_found_by_its_run_id_keeps_the_priority_it_was_started_with() -> None:
    """X8, R3: a second start of a run id returns the run as stored, its priority
    unchanged, whatever priority the second start gives."""
    engine, _entered = _engine(DjangoStore())
    engine.start("wf", {"k": "K"}, run_id="A", priority=10)
    again = engine.start("wf", {"k": "K"}, run_id="A", priority=-10)
    assert again.priority == 10 and Run.objects.get(pk="A").priority == 10


@pytest.mark.django_db(transaction=True)
def test_a_row_an_older_release_inserts_without_the_column_gets_priority_zero() -> None:
    """X8, S12 (rolling upgrade): the column has a database default, so an INSERT
    that does not name it (a process of the release before migration 0019) writes
    a run of priority 0, which queues by creation among the runs of priority 0."""
    stamp = timezone.now()
    table = connection.ops.quote_name(Run._meta.db_table)
    columns = [
        "run_id",
        "workflow_name",
        "workflow_version",
        "namespace",
        "status",
        "tags",
        "singleton_tracked",
        "created_at",
        "updated_at",
        "attempts",
        "recoveries",
        "park_reason",
        "cancel_requested",
        "step_count",
    ]
    values: list[Any] = ["old", "wf", "1", "default", "pending", "[]", False, stamp, stamp, 0, 0, "", False, 0]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({', '.join(connection.ops.quote_name(c) for c in columns)})"
            f" VALUES ({', '.join(['%s'] * len(values))})",
            [connection.ops.adapt_datetimefield_value(v) if v is stamp else v for v in values],
        )
    assert Run.objects.get(pk="old").priority == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["memory", "django"])
def test_explain_gives_a_waiters_position_among_its_priority(kind: str) -> None:
    """X8, K3: explain says where a waiter stands in the whole line and among the
    waiters of its own priority ("position 2 among priority 10"); a waiter of
    priority 0 with no other priority ahead gets no priority words."""
    engine, _entered = _engine(STORES[kind]())
    engine.start("wf", {"k": "H"}, run_id="h")
    assert claim(engine, "h").run is not None
    engine.start("wf", {"k": "H"}, run_id="first0", priority=0)
    engine.start("wf", {"k": "H"}, run_id="a10", priority=10)
    engine.start("wf", {"k": "H"}, run_id="b10", priority=10)
    engine.start("wf", {"k": "H"}, run_id="late0", priority=0)
    b10 = explain(engine, "b10")
    assert (b10.position, b10.priority, b10.priority_position) == (2, 10, 2)
    assert "position 2 of 4" in b10.sentence and "(position 2 among priority 10)" in b10.sentence
    late = explain(engine, "late0")
    assert (late.position, late.priority_position) == (4, 2)
    assert "(position 2 among priority 0)" in late.sentence
    only = explain(engine, "a10")
    assert only.position == 1


@pytest.mark.django_db(transaction=True)
def test_the_key_page_lists_waiters_in_priority_order_with_their_priority(admin_client: Client, settings: Any) -> None:
    """X8, section 6: the admin's key page lists a key's waiters in the claim's order
    (priority DESC, created_at, run_id), each with its priority in a column, and a
    run's page shows its priority."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    workflow = "sync-inventory-wide"  # testproject: limit 2, no cap
    for run_id in ("w0", "w1"):
        engine.start(workflow, {"store_id": "P", "duration": 0}, run_id=run_id)
        assert claim(engine, run_id).run is not None
    for run_id, priority in (("low", -5), ("mid", 0), ("top", 50)):
        engine.start(workflow, {"store_id": "P", "duration": 0}, run_id=run_id, priority=priority)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    url = reverse("admin:durable_singleton_run_queue_key") + f"?workflow={workflow}&key=store:P"
    response = admin_client.get(url)
    rows = [(w["position"], w["run"].run_id, w["run"].priority) for w in response.context["waiters"]]
    assert rows == [(1, "top", 50), (2, "mid", 0), (3, "low", -5)]
    html = response.content.decode()
    assert '<td class="ds-num ds-priority">50</td>' in html and ">priority<" in html.lower()
    page = admin_client.get(reverse("admin:durable_singleton_run_change", args=["top"])).content.decode()
    assert "Priority" in page and ">50<" in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    importlib.util.find_spec("django.tasks") is None, reason="Django 5.2 has no django.tasks (added in Django 6.0)"
)
def test_a_tasks_priority_is_its_runs_priority_and_orders_its_key(settings: Any) -> None:
    """X8 (django.tasks): the backend supports priority; a task enqueued with
    ``using(priority=p)`` is a run of priority p, its result's task carries p, and
    a key's tasks run higher priority first, in enqueue order within one."""
    from django.tasks import task_backends

    from testproject.inventory import jobs
    from testproject.inventory.models import BodyAudit

    assert task_backends["default"].supports_priority
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    low = jobs.sync_store.using(priority=-10).enqueue("T")
    plain = jobs.sync_store.enqueue("T")
    high = jobs.sync_store.using(priority=10).enqueue("T")
    assert [Run.objects.get(pk=r.id).priority for r in (low, plain, high)] == [-10, 0, 10]
    assert jobs.sync_store.get_result(high.id).task.priority == 10
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    audits = BodyAudit.objects.filter(run_id__in=[low.id, plain.id, high.id]).order_by("entered_at")
    assert [a.run_id for a in audits] == [high.id, plain.id, low.id]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", sorted(STORES))
def test_a_start_that_queues_before_the_waiters_is_not_parked_as_behind_a_deep_queue(kind: str) -> None:
    """S8a, X8: a start is created parked for the handoff (the backlog's late
    retry) only behind ``limit`` holders and ``limit`` waiters it queues behind.
    A start of a higher priority than every waiter queues first, so its key is
    not deep for it: it gets its turn as any start does. Before, the depth check
    counted every waiter and parked it with the hour's fallback at position 1
    (found by a new user on SQLite; the same count stood on every store path)."""
    registry = Registry()

    def body(ctx: Any, input: Any) -> None:
        if input.get("park"):
            ctx.wait_for_signal("go")  # a holder parked with its slot (D2, S6)

    registry.add("wf", "1", body, singleton={"key": lambda i: i["k"], "limit": 1, "max_queue_depth": None})
    engine = make_engine(STORES[kind](), registry=registry)
    engine.start("wf", {"k": "K", "park": True}, run_id="holder")
    engine.execute("holder")
    assert engine.get("holder").status == RunStatus.SUSPENDED
    engine.start("wf", {"k": "K"}, run_id="low")
    engine.start("wf", {"k": "K"}, run_id="same", priority=0)
    engine.start("wf", {"k": "K"}, run_id="high", priority=10)
    assert engine.get("same").park_reason == "singleton"  # behind the holder and "low": deep
    high = engine.get("high")
    assert not high.park_reason and high.status == RunStatus.PENDING, (high.park_reason, high.wake_at)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", sorted(STORES))
def test_a_fair_quota_orders_one_sub_keys_waiters_by_priority(kind: str) -> None:
    """X8, X8c, X4b: in a fair quota of one slot, tenant big holds it with b1 and queues
    b2, b3 (priority 0) then b4 (priority 10); tenant small queues s1. When b1 settles,
    the round-robin across tenants is kept (s1 first: its tag is the virtual time) and
    within big the higher priority goes first: s1, b4, b2, b3. Before, b4's tag came
    after b2's and b3's whatever its priority (s1, b2, b3, b4), on every store path."""
    from durable_singleton import Quota

    registry = Registry()
    entered: list[str] = []
    fair = Quota("fair-prio", key=lambda i: "q", limit=1, fair_key=lambda i: i["t"])
    registry.add("wf", "1", lambda ctx, i: entered.append(ctx.run_id), quotas=[fair])
    engine = make_engine(STORES[kind](), registry=registry)
    engine.start("wf", {"t": "big"}, run_id="b1")
    assert claim(engine, "b1").run is not None
    for run_id, tenant, priority in [("b2", "big", 0), ("b3", "big", 0), ("s1", "small", 0), ("b4", "big", 10)]:
        engine.start("wf", {"t": tenant}, run_id=run_id, priority=priority)
    held = engine.get("b1")
    engine.store.finish(held, held.lease_owner, "completed", limits=engine.limits())
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert entered == ["s1", "b4", "b2", "b3"]
