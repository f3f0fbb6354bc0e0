"""Shared quotas (X3, #20 item 3): ``Quota(name, key=fn, limit=N)`` named by
several workflows in ``quotas=[...]``, beside or instead of ``singleton``.

A run is admitted only when every limit it carries has room, oldest first in
each (X3d); it takes a slot and a fencing token in each (X3c, X3f) and frees
them all when it settles, waking the quota's next waiters (X3g). On the
in-memory store and on the DATABASE_URL database (SQLite, PostgreSQL,
MariaDB); the racing test uses real threads and real commits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    InvalidWorkflowError,
    QuotaQueueFullError,
    SingletonKeyError,
    UnknownWorkflowError,
    UnsupportedByStoreError,
)
from tests.conftest import run_threads
from tests.helpers import drain as _drain
from tests.helpers import execute_racing, store_method_replaced
from tests.helpers import holding_body as _holding

STRIPE = Quota("stripe-api", key=lambda i: i.get("account", "*"), limit=1)


def test_two_workflows_sharing_a_quota_take_turns_oldest_first(engine: Engine, registry: Registry) -> None:
    """X3, X3d, X3g: A1 (workflow a) holds the quota's one slot; B1 (workflow b)
    then A2 wait, whatever their workflow; A1's settle wakes B1, the oldest,
    and B1's settle wakes A2."""
    log: list[str] = []
    registry.add("a", "1", _holding(log), quotas=[STRIPE])
    registry.add("b", "1", _holding(log), quotas=[STRIPE])
    engine.start("a", {"hold": True}, run_id="A1")
    engine.start("b", {"hold": True}, run_id="B1")
    engine.start("a", {}, run_id="A2")
    _drain(engine)
    assert engine.get("A1").status == "suspended" and engine.get("A1").quota_slot == "holder"
    assert [engine.get(r).quota_slot for r in ("B1", "A2")] == ["waiter", "waiter"]
    assert engine.get("A1").tags == ["quota:stripe-api:*"]  # X3b
    engine.signal("A1", "go")
    _drain(engine)
    assert log == ["A1"]
    assert engine.get("B1").quota_slot == "holder" and engine.get("A2").quota_slot == "waiter"
    engine.signal("B1", "go")
    _drain(engine)
    assert log == ["A1", "B1", "A2"]
    assert all(engine.get(r).status == "completed" and engine.get(r).quota_slot is None for r in log)


def test_quota_keys_are_separate_and_tokens_increase(engine: Engine, registry: Registry) -> None:
    """X3b, X3f: two accounts are two quota keys, admitted side by side; each
    admission of one key stamps a larger token, read as ``ctx.quota_tokens``."""
    tokens: dict[str, dict[str, int]] = {}

    def body(ctx: Any, input: dict[str, Any]) -> None:
        tokens[ctx.run_id] = ctx.quota_tokens

    registry.add("a", "1", body, quotas=[STRIPE])
    for run_id, account in (("X1", "x"), ("Y1", "y"), ("X2", "x")):
        engine.start("a", {"account": account}, run_id=run_id)
    _drain(engine)
    assert set(tokens) == {"X1", "Y1", "X2"}
    assert tokens["X1"]["stripe-api"] < tokens["X2"]["stripe-api"]
    assert engine.get("X2").tags == ["quota:stripe-api:x"]
    assert engine.store.quota_tokens("X2") == {}  # settled: holds none (X3c)


def test_a_run_needing_a_busy_singleton_leaves_the_quota_slot_free_and_keeps_its_place(
    engine: Engine, registry: Registry
) -> None:
    """X3d: W2 needs its singleton key (held by W1) and the quota (2 slots, one
    held by W1). It takes no quota slot while it waits. V1, newer, is behind
    W2 in the quota's line and does not overtake it (no starvation); when W1
    settles, W2 and then V1 are admitted, never more than 2 quota holders."""
    log: list[str] = []
    shared = Quota("db", limit=2)
    registry.add("w", "1", _holding(log), singleton={"key": lambda i: "k"}, quotas=[shared])
    registry.add("v", "1", _holding(log), quotas=[shared])
    engine.start("w", {"hold": True}, run_id="W1")
    engine.start("w", {}, run_id="W2")
    engine.start("v", {}, run_id="V1")
    _drain(engine)
    assert engine.get("W1").quota_slot == "holder" and engine.get("W1").admitted
    assert engine.get("W2").quota_slot == "waiter" and not engine.get("W2").admitted
    assert engine.get("V1").quota_slot == "waiter" and log == []
    engine.signal("W1", "go")
    _drain(engine)
    assert log == ["W1", "W2", "V1"]


def test_a_cancelled_waiter_and_a_retried_run_keep_the_line(engine: Engine, registry: Registry) -> None:
    """X3g, D9: a cancelled waiter frees nothing and leaves the line; a failed
    run retried is a waiter again in every quota and waits its turn."""
    log: list[str] = []
    fail = {"once": True}

    def body(ctx: Any, input: dict[str, Any]) -> None:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        if input.get("fail") and fail.pop("once", False):
            raise RuntimeError("flaky")
        log.append(ctx.run_id)

    registry.add("a", "1", body, quotas=[STRIPE])
    engine.start("a", {"fail": True}, run_id="F")
    _drain(engine)
    assert engine.get("F").status == "failed" and engine.get("F").quota_slot is None
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {}, run_id="C")
    _drain(engine)
    engine.cancel("C")
    assert engine.get("C").status == "cancelled" and engine.get("C").quota_slot is None
    retried = engine.retry("F")
    assert retried.quota_slot == "waiter"
    _drain(engine)
    assert engine.get("F").status != "completed"  # H holds the one slot
    engine.signal("H", "go")
    _drain(engine)
    assert log == ["H", "F"]


def test_quota_declarations_are_checked_at_registration(registry: Registry) -> None:
    """X3a, X3j: a bad name, limit, key or max_queue_depth; a quota named twice;
    one name declared with two limits or two queue caps; a workflow named
    ``quota:...``."""

    def body(ctx: Any, input: Any) -> None:
        return None

    for bad in (Quota(""), Quota("a:b"), Quota("x" * 65), Quota("q", limit=0), Quota("q", key="k")):  # type: ignore[arg-type]
        with pytest.raises(InvalidWorkflowError):
            registry.add("w", "1", body, quotas=[bad])
    with pytest.raises(InvalidWorkflowError):
        registry.add("w", "1", body, quotas=[Quota("q"), Quota("q")])
    with pytest.raises(InvalidWorkflowError):
        registry.add("w", "1", body, quotas=Quota("q"))  # type: ignore[arg-type]
    with pytest.raises(InvalidWorkflowError):
        registry.add("quota:w", "1", body)
    for depth in (-1, True, 1.5, "2"):
        with pytest.raises(InvalidWorkflowError, match="max_queue_depth"):
            registry.add("w", "1", body, quotas=[Quota("q", max_queue_depth=depth)])  # type: ignore[arg-type]
    registry.add("w", "1", body, quotas=[Quota("q", limit=2)])
    with pytest.raises(InvalidWorkflowError):
        registry.add("v", "1", body, quotas=[Quota("q", limit=3)])
    with pytest.raises(InvalidWorkflowError, match="max_queue_depth"):
        registry.add("v", "1", body, quotas=[Quota("q", limit=2, max_queue_depth=5)])


def test_a_bad_quota_key_raises_and_writes_nothing(engine: Engine, registry: Registry) -> None:
    """X3a: a key function that raises, returns a non-str, an empty str or a key
    past 127 characters raises SingletonKeyError naming the quota (not a
    singleton key, which this workflow does not have); no run is written."""
    keys: list[Any] = [1, "", "k" * 128]

    def key(input: Any) -> Any:
        if not keys:
            raise LookupError("no account")
        return keys.pop(0)

    registry.add("w", "1", lambda ctx, i: None, quotas=[Quota("q", key=key)])
    for _ in range(4):
        with pytest.raises(SingletonKeyError) as caught:
            engine.start("w", {})
        assert str(caught.value).startswith("workflow 'w': quota 'q': key ") and "singleton" not in str(caught.value)
    assert engine.store.list_runs() == []


def test_caller_tags_spelled_as_a_quota_key_are_dropped(engine: Engine, registry: Registry) -> None:
    """X3b: a caller's tag ``quota:...`` is dropped, never read as a membership."""
    registry.add("w", "1", lambda ctx, i: None)
    run = engine.start("w", {}, tags=["quota:stripe-api:*", "mine"])
    assert run.tags == ["mine"] and run.quota_keys == ()
    assert engine.get(run.run_id).tags == ["mine"] and engine.get(run.run_id).quota_slot is None


def test_a_store_without_quotas_refuses_the_start(registry: Registry) -> None:
    """X3: a store without ``supports_quotas`` refuses a start of a workflow that
    declares quotas, before anything is written."""
    from durable_singleton.stores.memory import MemoryStore
    from durable_singleton.testing import make_engine

    class Plain(MemoryStore):
        supports_quotas = False

    engine = make_engine(Plain(), registry=registry)
    registry.add("w", "1", lambda ctx, i: None, quotas=[STRIPE])
    with pytest.raises(UnsupportedByStoreError):
        engine.start("w", {})
    assert engine.store.list_runs() == []


@pytest.mark.parametrize("shape", ["quotas", "singleton", "fair"])
def test_racing_claims_never_exceed_a_quota(
    make: Callable[..., Engine], registry: Registry, store_kind: str, shape: str
) -> None:
    """X3d, X3e: three workflows share a quota of 2 (one also with a singleton
    key of limit 2 per account); 4 threads claim 24 runs at once and each body
    counts the runs inside the quota: never more than 2 at a time, every run
    completes once, and no claim deadlocks (the threads all return); and the
    same with the quota fair across two sub-keys (X4)."""
    inside = {"now": 0, "max": 0}
    lock = threading.Lock()
    done: list[str] = []

    def body(ctx: Any, input: dict[str, Any]) -> None:
        with lock:
            inside["now"] += 1
            inside["max"] = max(inside["max"], inside["now"])
        threading.Event().wait(0.01)
        with lock:
            inside["now"] -= 1
            done.append(ctx.run_id)

    pool = Quota("pool", limit=2, fair_key=(lambda i: i["k"]) if shape == "fair" else None)
    single = {"key": lambda i: i["k"], "limit": 2} if shape == "singleton" else None
    registry.add("a", "1", body, quotas=[pool], singleton=single)
    registry.add("b", "1", body, quotas=[pool])
    # A fair quota is the only limit of a workflow that names it (X4d).
    registry.add("c", "1", body, quotas=[pool] if shape == "fair" else [pool, Quota("other", limit=3)])
    engines = [make() for _ in range(4)]
    ids = []
    for n in range(24):
        run = engines[0].start("abc"[n % 3], {"k": str(n % 2)}, run_id=f"R{n}")
        ids.append(run.run_id)
    for e in engines:
        e.dispatcher.queue.clear()  # type: ignore[attr-defined]

    execute_racing(engines, ids, done)
    assert inside["max"] <= 2
    assert sorted(done) == sorted(ids)
    assert all(engines[0].get(r).status == "completed" for r in ids)


def test_racing_starts_never_exceed_a_quota_queue_cap(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """S15, X3j, X3e: a quota of limit 1 and max_queue_depth 2, shared by two
    workflows (one also on a singleton key with its own cap): 6 threads start
    4 runs each at once, half through ``start_many``; exactly 3 are created
    (the cap's count under the quota key's lock), every other start is refused
    with QuotaQueueFullError and wrote nothing, and no start deadlocks."""
    capped = Quota("capped", limit=1, max_queue_depth=2)
    registry.add("a", "1", lambda ctx, i: None, quotas=[capped])
    registry.add("b", "1", lambda ctx, i: None, quotas=[capped], singleton={"key": lambda i: "s", "max_queue_depth": 9})
    engines = [make() for _ in range(6)]

    def starter(i: int) -> list[str]:
        made: list[str] = []
        for n in range(4):
            run_id = f"R{i}-{n}"
            if n % 2:
                [result] = engines[i].start_many("ab"[i % 2], [{}], run_ids=[run_id])
                if isinstance(result, BaseException):
                    assert isinstance(result, QuotaQueueFullError), result
                    continue
            else:
                try:
                    engines[i].start("ab"[i % 2], {}, run_id=run_id)
                except QuotaQueueFullError:
                    continue
            made.append(run_id)
        return made

    results = run_threads(6, starter, timeout=120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    created = sorted(r for made in results for r in made)
    assert len(created) == 3
    assert sorted(r.run_id for r in engines[0].store.list_runs()) == created


def test_key_controls_address_a_quota_key(engine: Engine, registry: Registry) -> None:
    """K2, X3b: ``quota:<name>`` and the key override a quota key's limit
    (raising it admits the waiters at once) and pause it (nothing more is
    admitted, the holder keeps its slot; resuming admits the waiter); an
    unknown quota is an unknown name."""
    log: list[str] = []
    registry.add("a", "1", _holding(log), quotas=[STRIPE])
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {}, run_id="W1")
    engine.start("a", {}, run_id="W2")
    _drain(engine)
    state = engine.override_limit("quota:stripe-api", "*", 2, by="ops")
    assert state.limit == 2
    _drain(engine)
    assert log == ["W1", "W2"]  # W1 admitted beside the holder at once, W2 on W1's settle
    engine.pause_key("quota:stripe-api", "*", by="ops")
    engine.start("a", {}, run_id="W3")
    _drain(engine)
    assert log == ["W1", "W2"] and engine.get("W3").quota_slot == "waiter"
    assert engine.get("H").quota_slot == "holder"
    engine.resume_key("quota:stripe-api", "*", by="ops")
    _drain(engine)
    assert log == ["W1", "W2", "W3"]
    with pytest.raises(UnknownWorkflowError):
        engine.pause_key("quota:nope", "*")


def test_explain_names_the_quota_a_waiter_waits_for(engine: Engine, registry: Registry) -> None:
    """K3, X3j: a waiter of a quota is explained with its place in the quota
    key's queue and the holder it waits behind, as a waiter (not as a run a
    worker failed to take); a waiter of its singleton key too gets both; a
    holder is said to hold its quota slot."""
    registry.add("a", "1", _holding([]), quotas=[STRIPE])
    registry.add("k", "1", _holding([]), quotas=[STRIPE], singleton={"key": lambda i: "one"})
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {}, run_id="W1")
    engine.start("a", {}, run_id="W2")
    engine.start("k", {"account": "acct-2", "hold": True}, run_id="KH")
    engine.start("k", {"account": "acct-2"}, run_id="KW")
    _drain(engine)
    explained = engine.explain("W2")
    assert explained.state == "waiter"
    assert [(p.quota, p.key, p.position, p.depth, p.holders) for p in explained.quotas] == [
        ("stripe-api", "*", 2, 2, ["H"])
    ]
    assert explained.sentence.startswith("Run W2 is a waiter (")
    assert "it waits for quota 'stripe-api' (key '*') position 2 of 2, behind H (X3d)" in explained.sentence
    assert "could run now" not in explained.sentence and "no worker" not in explained.sentence
    held = engine.explain("H")
    assert held.quotas == [] and held.sentence.endswith("It holds a slot of quota 'stripe-api' (key '*') (X3c).")
    both = engine.explain("KW")  # behind KH on its singleton key and in its quota key
    assert both.state == "waiter" and "It also waits for quota 'stripe-api' (key 'acct-2')" in both.sentence


@pytest.mark.django_db(transaction=True)
def test_the_slot_audit_finds_and_wakes_a_quota_waiter_no_worker_took(registry: Registry) -> None:
    """K4, X3d, X3j: Q waits in a quota with no holder (its key has room) and its turn was
    lost ten minutes ago (its wake time is that old): the audit reports a
    ``stalled_waiter`` under ``quota:<name>``, and with repair makes Q due now and sends
    its turn, which admits it. W, behind a holder of its quota key, is no finding. Before,
    the audit looked at singleton keys alone and skipped every quota carrier: a quota-only
    run was never reported (found by a tester: a false "all clear")."""
    from datetime import timedelta

    from durable_singleton.audit import FindingKind, audit_slots
    from durable_singleton.models import Run
    from durable_singleton.testing import make_engine

    registry.add("a", "1", _holding([]), quotas=[STRIPE])
    engine = make_engine("django", registry=registry)
    engine.start("a", {"account": "held", "hold": True}, run_id="H")
    _drain(engine)
    engine.start("a", {"account": "held"}, run_id="W")
    engine.start("a", {"account": "free"}, run_id="Q")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # both turns lost
    ten_minutes_ago = engine.store.now() - timedelta(minutes=10)
    Run.objects.filter(pk__in=["W", "Q"]).update(wake_at=ten_minutes_ago)
    report = audit_slots(engine)
    found = [(f.workflow, f.key, f.run_id) for f in report.findings if f.kind == FindingKind.STALLED_WAITER]
    assert found == [("quota:stripe-api", "free", "Q")], report.findings
    repaired = audit_slots(engine, repair=True)
    assert [f.repaired for f in repaired.findings if f.kind == FindingKind.STALLED_WAITER] == [True]
    _drain(engine)
    assert engine.get("Q").status == "completed" and engine.get("W").status in ("pending", "suspended")


def test_explain_says_a_quota_waiter_with_room_could_run_now(engine: Engine, registry: Registry) -> None:
    """K3, X3d: a waiter of a quota whose key has a free slot for it, and nothing else
    holding it back, is a run no worker took: explain says it could run now (state
    ``runnable``), as for a singleton key's waiter. Before, it said the run waited for
    the quota ("a slot freed sends it a turn"), though the quota had no holder (found by
    a tester). Behind a holder it is still a waiter."""
    registry.add("a", "1", _holding([]), quotas=[STRIPE])
    engine.start("a", {"account": "free"}, run_id="Q")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # its turn was lost
    explained = engine.explain("Q")
    assert explained.state == "runnable", explained.sentence
    assert explained.sentence.startswith("Run Q could run now: it is within the free slots of quota 'stripe-api'")
    assert "no worker has taken its turn" in explained.sentence
    engine.start("a", {"account": "held", "hold": True}, run_id="H")
    _drain(engine)
    engine.start("a", {"account": "held"}, run_id="W")
    _drain(engine)
    behind = engine.explain("W")
    assert behind.state == "waiter" and "could run now" not in behind.sentence, behind.sentence


@pytest.mark.django_db(transaction=True)
def test_the_audit_finds_an_over_admitted_quota_key_and_not_a_quota_waiter(registry: Registry) -> None:
    """K4, X3j: a quota key with more holders than its limit is an
    ``over_admitted`` finding on ``quota:<name>``; a waiter at its singleton
    key's front that waits for its quota is not a stalled waiter."""
    from datetime import timedelta

    from durable_singleton.audit import audit_slots
    from durable_singleton.models import QuotaMembership, Run
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    registry.add("a", "1", _holding([]), singleton={"key": lambda i: i["k"]}, quotas=[STRIPE])
    engine.start("a", {"k": "1", "hold": True}, run_id="H")
    engine.start("a", {"k": "2"}, run_id="W")
    _drain(engine)
    assert engine.get("W").quota_slot == "waiter" and not engine.get("W").admitted
    later = engine.now() + timedelta(seconds=3600)
    assert audit_slots(engine, now=later).findings == []
    # A second holder written behind the claim's back: two holders for a limit of 1.
    QuotaMembership.objects.filter(run_id="W").update(slot="holder")
    Run.objects.filter(pk="W").update(quota_slot="holder")
    findings = audit_slots(engine, now=later).findings
    assert [(f.kind, f.workflow, f.key) for f in findings] == [("over_admitted", "quota:stripe-api", "*")]


@pytest.mark.django_db(transaction=True)
def test_metrics_count_a_quotas_holders_and_waiters(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """X3j, O4: the database collector reports a quota as the workflow
    ``quota:<name>``: its holders, its waiters and its oldest wait."""
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from durable_singleton import runtime
    from durable_singleton.metrics import DatabaseCollector
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    monkeypatch.setattr(runtime, "get_engine", lambda: engine)
    registry.add("a", "1", _holding([]), quotas=[STRIPE])
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {}, run_id="W1")
    engine.start("a", {}, run_id="W2")
    _drain(engine)
    families = {f.name: f.samples for f in DatabaseCollector().collect()}

    def value(name: str) -> float:
        return sum(s.value for s in families[name] if s.labels.get("workflow") == "quota:stripe-api")

    assert value("durable_singleton_holders") == 1
    assert value("durable_singleton_waiters") == 2
    assert value("durable_singleton_oldest_wait_seconds") >= 0
    assert any(
        s.labels.get("workflow") == "quota:stripe-api" for s in families["durable_singleton_oldest_wait_seconds"]
    )


@pytest.mark.django_db(transaction=True)
def test_the_retention_purge_deletes_finished_runs_with_their_quota_memberships(registry: Registry) -> None:
    """O2, X3g: a finished run that carried quotas is purged with its
    memberships (a raw delete of the run alone breaks their foreign key)."""
    from datetime import timedelta

    from durable_singleton.models import QuotaMembership, Run
    from durable_singleton.retention import purge_finished
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    registry.add("a", "1", _holding([]), quotas=[STRIPE, Quota("other", limit=2)])
    ids = [engine.start("a", {}).run_id for _ in range(3)]
    _drain(engine)
    assert QuotaMembership.objects.filter(run_id__in=ids).count() == 6
    report = purge_finished(engine, before=engine.now() + timedelta(seconds=60))
    assert report.runs == 3
    assert not Run.objects.filter(pk__in=ids).exists()
    assert not QuotaMembership.objects.filter(run_id__in=ids).exists()


@pytest.mark.django_db(transaction=True)
def test_the_admin_queues_page_lists_quota_keys(
    registry: Registry, admin_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X3j, S15: the admin's queue page shows each quota key with active members:
    its limit in force, holders, waiters and oldest wait, a runtime override
    (K2), and a capped quota's active members against its cap."""
    from django.urls import reverse

    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    registry.add("a", "1", _holding([]), quotas=[STRIPE])
    engine.start("a", {"account": "acct-1", "hold": True}, run_id="H")
    engine.start("a", {"account": "acct-1"}, run_id="W")
    _drain(engine)
    engine.override_limit("quota:stripe-api", "acct-1", 1, by="ops")
    from durable_singleton.definitions import registry as declared

    capped = Quota("capped", limit=1, max_queue_depth=2)
    registry.add("b", "1", _holding([]), quotas=[capped])
    monkeypatch.setitem(declared.quotas, "capped", capped)  # the admin reads the process's declarations
    engine.start("b", {"hold": True}, run_id="CH")
    engine.start("b", {}, run_id="CW")
    _drain(engine)
    response = admin_client.get(reverse("admin:durable_singleton_run_queues"))
    assert response.status_code == 200
    rows = [item["row"] for item in response.context["quota_rows"]]
    assert sorted((r.workflow, r.key, r.limit, r.holders, r.waiting, r.limit_override, r.capacity) for r in rows) == [
        ("quota:capped", "*", 1, 1, 1, None, 3),
        ("quota:stripe-api", "acct-1", 1, 1, 1, 1, None),
    ]
    html = response.content.decode()
    assert 'class="ds-quota-row" data-workflow="quota:stripe-api" data-key="acct-1"' in html
    assert ">2 / 3</span>" in html


# -- fairness inside a quota (X4) ----------------------------------------------------------------


def _tenant(input: dict[str, Any]) -> str:
    return str(input["tenant"])


def test_a_fair_quota_serves_sub_keys_round_robin(engine: Engine, registry: Registry) -> None:
    """X4: one tenant's burst of 20 does not starve another's single run: with
    ``fair_key`` B1, started after the burst, takes the quota's next slot
    (FIFO would run all of A's first); then B's next run, started after A05
    ran, goes between A's; explain gives each waiter the place it is served in."""
    log: list[str] = []
    registry.add("a", "1", _holding(log), quotas=[Quota("api", limit=1, fair_key=_tenant)])
    engine.start("a", {"tenant": "A", "hold": True}, run_id="H")
    for n in range(1, 21):
        engine.start("a", {"tenant": "A"}, run_id=f"A{n:02}")
    engine.start("a", {"tenant": "B"}, run_id="B1")
    _drain(engine)
    assert [p.position for p in engine.explain("B1").quotas] == [1]
    assert [p.position for p in engine.explain("A02").quotas] == [3]
    engine.signal("H", "go")
    _drain(engine)
    assert log[:4] == ["H", "B1", "A01", "A02"]
    assert sorted(log) == sorted(["H", "B1", *(f"A{n:02}" for n in range(1, 21))])


def test_weights_give_a_sub_key_that_many_slots_per_round(engine: Engine, registry: Registry) -> None:
    """X4: with ``weights={"A": 2}`` a round serves two of A's runs, then one of B's."""
    log: list[str] = []
    quota = Quota("api", limit=1, fair_key=_tenant, weights={"A": 2})
    registry.add("a", "1", _holding(log), quotas=[quota])
    engine.start("a", {"tenant": "B", "hold": True}, run_id="H")
    for n in range(1, 6):
        engine.start("a", {"tenant": "A"}, run_id=f"A{n}")
    engine.start("a", {"tenant": "B"}, run_id="B1")
    engine.start("a", {"tenant": "B"}, run_id="B2")
    _drain(engine)
    engine.signal("H", "go")
    _drain(engine)
    # Tags: A 0, 500, 1000, 1500, 2000 (two per turn); B 1000, 2000 (after H's 0).
    assert log == ["H", "A1", "A2", "A3", "B1", "A4", "A5", "B2"]


def test_fair_quota_declarations_and_sub_keys_are_checked(engine: Engine, registry: Registry) -> None:
    """X4, X3a: a bad ``fair_key`` or ``weights`` raises InvalidWorkflowError at
    registration; a fair_key that returns a bad sub-key raises SingletonKeyError
    at the start and writes nothing."""

    def body(ctx: Any, input: Any) -> None:
        return None

    bad = [
        Quota("q", fair_key="tenant"),  # type: ignore[arg-type]
        Quota("q", weights={"A": 2}),
        Quota("q", fair_key=_tenant, weights={"A": 0}),
        Quota("q", fair_key=_tenant, weights={"": 1}),
        Quota("q", fair_key=_tenant, weights=[("A", 1)]),  # type: ignore[arg-type]
    ]
    for quota in bad:
        with pytest.raises(InvalidWorkflowError):
            registry.add("w", "1", body, quotas=[quota])
    registry.add("w", "1", body, quotas=[Quota("q", fair_key=lambda i: i["tenant"])])
    for tenant in (None, "", "t" * 128, "bell\x07"):
        with pytest.raises(SingletonKeyError):
            engine.start("w", {"tenant": tenant})
    assert engine.store.list_runs() == []


def test_a_fair_quota_is_the_only_limit_of_a_workflow(registry: Registry) -> None:
    """X4d, X3d: a workflow that names a fair quota carries no other limit. Found by
    the quota model test on MariaDB: runs of a workflow on a fair quota and a FIFO
    quota, with other workflows on the FIFO quota, ended with every run a waiter and
    none admitted, as the oldest-first order put A before B in the FIFO quota and
    the tags put B before A in the fair one. Refused at registration, with another
    quota or a singleton key, whatever the order; a fair quota alone is accepted,
    and so is a workflow whose quotas are all oldest first."""

    def body(ctx: Any, input: Any) -> None:
        return None

    fair = Quota("fair", key=lambda i: i["q"], limit=2, fair_key=_tenant)
    fifo = Quota("fifo", key=lambda i: i["q"], limit=2)
    other_fair = Quota("fair2", limit=1, fair_key=_tenant)
    for quotas, singleton in (
        ([fair, fifo], None),
        ([fifo, fair], None),
        ([fair, other_fair], None),
        ([fair], {"key": lambda i: i["q"]}),
    ):
        with pytest.raises(InvalidWorkflowError, match="X4d"):
            registry.add("mixed", "1", body, quotas=quotas, singleton=singleton)
    assert "mixed" not in registry.latest and "fair" not in registry.quotas
    registry.add("fair-only", "1", body, quotas=[fair])
    registry.add("fifo-only", "1", body, quotas=[fifo, Quota("fifo2", limit=1)], singleton={"key": lambda i: "k"})


def test_a_store_on_the_fallback_claim_refuses_quotas(registry: Registry) -> None:
    """X3, S14: a store whose claim is the base class's scan (no atomic
    admission) knows no quota: a start of a workflow with quotas is refused
    and writes nothing, whatever its ``supports_quotas`` says."""
    from durable_singleton.stores.base import BaseStore
    from durable_singleton.stores.memory import MemoryStore
    from durable_singleton.testing import make_engine

    class ScanOnly(MemoryStore):
        supports_atomic_admission = False
        begin_turn = BaseStore.begin_turn

    engine = make_engine(ScanOnly(), registry=registry)
    registry.add("w", "1", lambda ctx, i: None, quotas=[STRIPE])
    with pytest.raises(UnsupportedByStoreError):
        engine.start("w", {})
    assert engine.store.list_runs() == []


@pytest.mark.django_db(transaction=True)
def test_a_superseding_start_frees_a_replaced_runs_other_quota_key_under_its_lock(registry: Registry) -> None:
    """X3g, X3e, X1: a replace_queued start whose run carries quota key "b"
    replaces a waiter that carries quota key "a": the transaction that frees
    the waiter's slot of "a" holds the lock of "a", taken before the singleton
    key's (read from the key's active runs before the locks); the run then
    runs once the quota frees."""
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    per_account = Quota("per-account", key=lambda i: i["account"], limit=1)
    log: list[str] = []
    registry.add("hold", "1", _holding(log), quotas=[per_account])
    registry.add(
        "rq", "1", _holding(log), quotas=[per_account], singleton={"key": lambda i: "k", "on_busy": "replace_queued"}
    )
    engine.start("hold", {"account": "a", "hold": True}, run_id="HA")
    engine.start("hold", {"account": "b", "hold": True}, run_id="HB")
    engine.start("rq", {"account": "a"}, run_id="W")  # waits for "a"'s slot
    _drain(engine)
    store = engine.store
    locked: list[tuple[str, str]] = []
    lock_key = store.lock_key

    def recording(workflow_name: str, key: str) -> Any:
        locked.append((workflow_name, key))
        return lock_key(workflow_name, key)

    with store_method_replaced(engine, "lock_key", recording):
        engine.start("rq", {"account": "b"}, run_id="N")
    assert engine.get("W").status == "cancelled" and engine.get("W").error["code"] == "replaced"
    # The start's transaction; then the release of W (Core.release), one key per transaction.
    assert locked == [
        ("quota:per-account", "a"),
        ("quota:per-account", "b"),
        ("rq", "k"),
        ("rq", "k"),
        ("quota:per-account", "a"),
    ]
    engine.signal("HB", "go")
    _drain(engine)
    assert log == ["HB", "N"] and engine.get("N").status == "completed"


@pytest.mark.django_db(transaction=True)
def test_durable_queues_lists_quota_keys(
    registry: Registry, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """X3j, S15: ``manage.py durable_queues`` lists the shared quotas' keys with
    active members below the singleton keys, as text and as JSON (its cap
    included), and its --workflow / --only filters apply to them; a quota-only
    workflow's waiters are no longer invisible there."""
    import json

    from django.core.management import call_command

    from durable_singleton.definitions import registry as declared
    from durable_singleton.models import Run
    from durable_singleton.testing import make_engine

    # The command counts every quota key of the database: a run another test's thread
    # committed after that test ended would be counted here (a thread outliving its test).
    assert not Run.objects.exists(), "an earlier test left runs in the database"
    engine = make_engine("django", registry=registry)
    erp = Quota("erp-api", key=lambda i: i["tenant"], limit=1, max_queue_depth=2)
    registry.add("sync", "1", _holding([]), quotas=[erp])
    monkeypatch.setitem(declared.quotas, "erp-api", erp)  # the command reads the process's declarations
    engine.start("sync", {"tenant": "t1", "hold": True}, run_id="H")
    engine.start("sync", {"tenant": "t1"}, run_id="W")
    _drain(engine)
    call_command("durable_queues")
    text = capsys.readouterr().out
    assert "1 quota key with active members" in text and "quota:erp-api" in text and "2/3 (67%)" in text
    call_command("durable_queues", "--json", "--workflow", "quota:erp-api")
    document = json.loads(capsys.readouterr().out)
    assert [(q["quota"], q["key"], q["holders"], q["waiting"], q["capacity"]) for q in document["quotas"]] == [
        ("erp-api", "t1", 1, 1, 3)
    ]
    call_command("durable_queues", "--json", "--only", "full")
    assert json.loads(capsys.readouterr().out)["quotas"] == []
    call_command("durable_queues", "--json", "--workflow", "sync")
    assert json.loads(capsys.readouterr().out)["quotas"] == []


@pytest.mark.django_db(transaction=True)
def test_a_superseding_start_relocks_when_a_run_with_another_quota_key_commits_meanwhile(registry: Registry) -> None:
    """X3g, X3e, X1: between the superseding start's unlocked read of its key's
    quota keys and its locks, another process commits a waiter carrying quota
    key "c": the start finds it among the runs to replace, writes nothing,
    and starts again with "c" locked before the singleton key; the waiter is
    replaced. Needs a second connection that commits while the first holds
    its locks (PostgreSQL, MariaDB)."""
    from django.db import connection, connections

    from durable_singleton.testing import make_engine

    if connection.vendor == "sqlite":
        pytest.skip("SQLite: one writer at a time; the racing insert would wait for the start")
    engine = make_engine("django", registry=registry)
    per_account = Quota("per-account", key=lambda i: i["account"], limit=1)
    registry.add(
        "rq", "1", _holding([]), quotas=[per_account], singleton={"key": lambda i: "k", "on_busy": "replace_queued"}
    )
    engine.start("rq", {"account": "a", "hold": True}, run_id="H")
    _drain(engine)
    store = engine.store
    locked: list[tuple[str, str]] = []
    lock_key = store.lock_key
    racer, _, _ = engine._new_run(
        "rq", {"account": "c"}, run_id="C", tags=(), version=None, parent_run_id=None, namespace=None
    )

    def insert_racer() -> None:
        store.create_run(racer, cap=None)  # a plain insert, committed on its own connection
        connections.close_all()

    def recording(workflow_name: str, key: str) -> Any:
        if not locked:
            t = threading.Thread(target=insert_racer)
            t.start()
            t.join(60)
            assert not t.is_alive(), "a thread of the test is still running"
        locked.append((workflow_name, key))
        return lock_key(workflow_name, key)

    with store_method_replaced(engine, "lock_key", recording):
        engine.start("rq", {"account": "b"}, run_id="N")
    assert engine.get("C").status == "cancelled" and engine.get("C").error["code"] == "replaced"
    first, again = locked[:3], locked[3:7]
    assert first == [("quota:per-account", "a"), ("quota:per-account", "b"), ("rq", "k")]
    assert again == [("quota:per-account", p) for p in "abc"] + [("rq", "k")]
