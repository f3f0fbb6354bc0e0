"""Breaks of the quota queue cap (S15, S16, R3, K2, X3e, X3j; commits 545307d
and 19907ad) by an independent tester: racing starts, cancels and settles on
one quota key, the runtime limit override, ``start_many`` batches, existing
run ids, children and schedules refused by a full quota, ``on_busy`` and the
cap, scoped engines, fair quotas, and the liveness of a quota's waiters after
a claim admits a run (X3d). On the in-memory store and on the DATABASE_URL
database (SQLite, PostgreSQL, MariaDB), real threads and real commits.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    ChildWorkflowError,
    QuotaQueueFullError,
    SingletonBusyError,
    SingletonQueueFullError,
)
from durable_singleton.records import RunRecord
from durable_singleton.schedules import Schedule, fire_due_schedules, schedule_store_for
from tests.conftest import run_threads
from tests.helpers import KeysInside
from tests.helpers import drain as _drain


def _settle_all(engine: Engine, rounds: int = 3) -> None:
    for _ in range(rounds):
        _drain(engine)
        engine.tick()
        _drain(engine)


def _hold(ctx: Any, input: dict[str, Any]) -> None:
    if input.get("hold"):
        ctx.wait_for_signal("go")


def _members(engine: Engine, name: str, key: str, namespace: str | None = None) -> list[RunRecord]:
    """The active runs carrying the quota key (name, key) (X3b), as stored."""
    return [
        r
        for r in engine.store.list_runs()
        if (name, key) in r.quota_keys and not r.is_terminal and (namespace is None or r.namespace == namespace)
    ]


def _holders(engine: Engine, name: str, key: str) -> list[str]:
    return [r.run_id for r in _members(engine, name, key) if r.quota_slot == "holder"]


# -- races -------------------------------------------------------------------------------------------


def test_racing_starts_and_cancels_never_leave_more_members_than_the_cap(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """S15, X3j, X3g: a quota of limit 1, max_queue_depth 3 (cap 4), full with a
    holder and 3 waiters; one thread cancels the waiters while 4 threads start
    runs on the key (half through ``start_many``). Every holder holds until
    signalled, so at the end the key's active members must be at most 4, and
    each refusal is a QuotaQueueFullError that wrote nothing."""
    capped = Quota("cq", key=lambda i: "K", limit=1, max_queue_depth=3)
    registry.add("a", "1", _hold, quotas=[capped])
    registry.add("b", "1", _hold, quotas=[capped], singleton={"key": lambda i: i["s"]})
    engines = [make() for _ in range(5)]
    engines[0].start("a", {"hold": True}, run_id="H")
    for n in range(3):
        engines[0].start("b", {"hold": True, "s": f"s{n}"}, run_id=f"W{n}")
    _drain(engines[0])
    assert _holders(engines[0], "cq", "K") == ["H"]
    for e in engines:
        e.dispatcher.queue.clear()  # type: ignore[attr-defined]

    def work(i: int) -> list[str]:
        if i == 4:
            for n in range(3):
                engines[i].cancel(f"W{n}")
                threading.Event().wait(0.01)
            return []
        made: list[str] = []
        for n in range(6):
            run_id = f"R{i}-{n}"
            if n % 2:
                [result] = engines[i].start_many("a", [{"hold": True}], run_ids=[run_id])
                if isinstance(result, BaseException):
                    assert isinstance(result, QuotaQueueFullError), result
                    assert engines[i].store.get_run(run_id) is None
                    continue
            else:
                try:
                    engines[i].start("b", {"hold": True, "s": run_id}, run_id=run_id)
                except QuotaQueueFullError:
                    assert engines[i].store.get_run(run_id) is None
                    continue
            made.append(run_id)
        return made

    results = run_threads(5, work, timeout=120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    members = _members(engines[0], "cq", "K")
    assert len(members) <= 4, sorted(r.run_id for r in members)
    created = sorted(r for made in results for r in made)
    assert len(created) <= 3  # the 3 cancelled waiters freed 3 places, no more


def test_racing_starts_on_many_quota_keys_and_claims_do_not_deadlock(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """X3e, S15, X3j: runs carrying a capped quota, an uncapped quota and a
    capped singleton key, on 3 quota keys; 4 threads start and execute runs at
    once (starts racing claims and settles). No thread raises (a deadlock
    surfaces as an OperationalError) or hangs, no quota key ever holds more
    members than its cap at the end of a start that succeeded beyond it, and
    every created run completes."""
    capped = Quota("cap-a", key=lambda i: i["k"], limit=2, max_queue_depth=2)
    other = Quota("cap-b", key=lambda i: i["j"], limit=1)
    registry.add("x", "1", lambda ctx, i: None, quotas=[capped, other])
    registry.add(
        "y", "1", lambda ctx, i: None, quotas=[capped], singleton={"key": lambda i: i["j"], "max_queue_depth": 3}
    )
    engines = [make() for _ in range(4)]

    def work(i: int) -> tuple[list[str], int]:
        made: list[str] = []
        refused = 0
        rnd = random.Random(i)
        for n in range(12):
            run_id = f"T{i}-{n}"
            k, j = f"k{rnd.randrange(3)}", f"j{rnd.randrange(2)}"
            try:
                engines[i].start("xy"[n % 2], {"k": k, "j": j}, run_id=run_id)
                made.append(run_id)
            except SingletonQueueFullError:
                refused += 1
            for run_id_ in list(made[-2:]):
                engines[i].execute(run_id_)
        return made, refused

    results = run_threads(4, work, timeout=180)
    assert [r for r in results if isinstance(r, BaseException)] == []
    for k in ("k0", "k1", "k2"):
        assert len(_members(engines[0], "cap-a", k)) <= 4
    for _ in range(4):  # the turns the race sent, on every engine's dispatcher
        for e in engines:
            _drain(e)
        engines[0].tick()
    created = [r for made, _ in results for r in made]
    stuck = {
        r.run_id: (str(r.status), r.quota_slot, r.quota_keys, r.singleton_key, r.park_reason, r.wake_at)
        for r in (engines[0].get(i) for i in created)
        if r.status != "completed"
    }
    if stuck:
        free = {
            k: (len(_holders(engines[0], "cap-a", k)), len(_members(engines[0], "cap-a", k)))
            for k in ("k0", "k1", "k2")
        }
        pytest.fail(f"runs left waiting after every turn was run: {stuck}; cap-a (holders, members): {free}")


def test_racing_starts_of_one_run_id_on_the_last_place_all_get_the_run(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """R3, S16, X3j: a quota key with one place left; 6 threads start the same
    run_id at once while 2 more start other ids: every start of the shared id
    returns that one run (never a QuotaQueueFullError), and the key never goes
    past its cap."""
    capped = Quota("last", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    engines = [make() for _ in range(8)]
    engines[0].start("a", {"hold": True}, run_id="H")

    def work(i: int) -> Any:
        if i < 6:
            return engines[i].start("a", {"hold": True}, run_id="SHARED").run_id
        try:
            return engines[i].start("a", {"hold": True}, run_id=f"O{i}").run_id
        except QuotaQueueFullError as exc:
            return exc

    results = run_threads(8, work, timeout=120)
    shared, others = results[:6], results[6:]
    members = sorted(r.run_id for r in _members(engines[0], "last", "*"))
    assert len(members) <= 2, members
    if "SHARED" in members:
        assert shared == ["SHARED"] * 6, shared
        assert all(isinstance(r, QuotaQueueFullError) for r in others), others
    else:
        # Another id took the place first: the shared id's starts were refused.
        assert all(isinstance(r, QuotaQueueFullError) for r in shared), shared


# -- on_busy and the cap -----------------------------------------------------------------------------


@pytest.mark.parametrize("on_busy", ["replace_queued", "cancel_in_progress"])
def test_a_superseding_start_is_refused_by_a_full_quota(engine: Engine, registry: Registry, on_busy: str) -> None:
    """S15, S16, X3j, X1: a quota of limit 1 and max_queue_depth 0 (cap 1),
    held by a run of another workflow. A start of a workflow with
    ``on_busy="replace_queued"`` / ``"cancel_in_progress"`` on a fresh
    singleton key replaces nothing (its key is empty) and would add a member
    past the quota's cap: it must raise QuotaQueueFullError and write nothing,
    in ``start`` and in ``start_many`` ("every start path")."""
    capped = Quota("sup", limit=1, max_queue_depth=0)
    registry.add("h", "1", _hold, quotas=[capped])
    registry.add("r", "1", _hold, quotas=[capped], singleton={"key": lambda i: i["s"], "on_busy": on_busy})
    engine.start("h", {"hold": True}, run_id="H")
    _drain(engine)
    with contextlib.suppress(QuotaQueueFullError):
        engine.start("r", {"s": "one"}, run_id="R1")
    [result] = engine.start_many("r", [{"s": "two"}], run_ids=["R2"])
    members = [(r.run_id, r.quota_slot) for r in _members(engine, "sup", "*")]
    assert members == [("H", "holder")], f"cap 1, members {members}"
    assert isinstance(result, QuotaQueueFullError), result


def test_a_skip_singleton_with_a_full_quota_names_the_quota(engine: Engine, registry: Registry) -> None:
    """X1, S15, X3j: ``on_busy="skip"`` on a free singleton key and a full
    capped quota: QuotaQueueFullError (the quota names itself, not
    SingletonBusyError); a busy singleton key with room in the quota:
    SingletonBusyError; both full: the quota's cap is counted first. Each
    writes nothing; the same in ``start_many``."""
    capped = Quota("skipq", limit=1, max_queue_depth=1)
    registry.add("h", "1", _hold, quotas=[capped])
    registry.add("s", "1", _hold, quotas=[capped], singleton={"key": lambda i: i["s"], "on_busy": "skip"})
    engine.start("s", {"hold": True, "s": "busy"}, run_id="S1")
    _drain(engine)
    with pytest.raises(SingletonBusyError):
        engine.start("s", {"s": "busy"}, run_id="S2")  # quota has 1 member of 2
    engine.start("h", {"hold": True}, run_id="H")  # quota now full (2)
    with pytest.raises(QuotaQueueFullError) as caught:
        engine.start("s", {"s": "free"}, run_id="S3")
    assert caught.value.quota == "skipq" and not isinstance(caught.value, SingletonBusyError)
    with pytest.raises(QuotaQueueFullError):
        engine.start("s", {"s": "busy"}, run_id="S4")  # both full: quota first
    results = engine.start_many("s", [{"s": "free"}, {"s": "busy"}], run_ids=["S5", "S6"])
    assert [type(r).__name__ for r in results] == ["QuotaQueueFullError", "QuotaQueueFullError"]
    assert [engine.store.get_run(r) for r in ("S2", "S3", "S4", "S5", "S6")] == [None] * 5


def test_a_capped_singleton_and_a_capped_quota_are_each_checked(engine: Engine, registry: Registry) -> None:
    """S15, X3j: a run with a capped singleton key (limit 1, depth 0) and a
    capped quota (limit 1, depth 2): a full singleton key with room in the
    quota raises SingletonQueueFullError (not the quota's error); a full quota
    with a free singleton key raises QuotaQueueFullError."""
    capped = Quota("both", limit=1, max_queue_depth=2)
    registry.add("w", "1", _hold, quotas=[capped], singleton={"key": lambda i: i["s"], "max_queue_depth": 0})
    engine.start("w", {"hold": True, "s": "a"}, run_id="A")
    with pytest.raises(SingletonQueueFullError) as caught:
        engine.start("w", {"s": "a"}, run_id="A2")
    assert not isinstance(caught.value, QuotaQueueFullError)
    engine.start("w", {"hold": True, "s": "b"}, run_id="B")
    engine.start("w", {"hold": True, "s": "c"}, run_id="C")
    with pytest.raises(QuotaQueueFullError):
        engine.start("w", {"s": "d"}, run_id="D")
    assert engine.store.get_run("A2") is None and engine.store.get_run("D") is None


# -- R3 and start_many ------------------------------------------------------------------------------


def test_an_existing_run_id_is_returned_when_the_quota_is_full(engine: Engine, registry: Registry) -> None:
    """R3, S16, X3j: with the quota key full, ``start``, ``start_many``,
    ``signal_with_start`` and ``Wf``-style starts of an existing run_id
    return that run (never QuotaQueueFullError); a new id is refused."""
    capped = Quota("r3", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    engine.start("a", {"hold": True}, run_id="A")
    engine.start("a", {"hold": True}, run_id="B")
    _drain(engine)
    assert engine.start("a", {"hold": True}, run_id="B").run_id == "B"
    assert engine.signal_with_start("a", {}, run_id="A", signal="x").run_id == "A"
    results = engine.start_many("a", [{}, {}, {}], run_ids=["A", "NEW", "B"])
    assert [getattr(r, "run_id", type(r).__name__) for r in results] == ["A", "QuotaQueueFullError", "B"]
    with pytest.raises(QuotaQueueFullError):
        engine.signal_with_start("a", {}, run_id="NEW2", signal="x")
    assert engine.store.get_run("NEW") is None and engine.store.get_run("NEW2") is None


def test_start_many_mixes_quota_keys_and_repeated_ids(engine: Engine, registry: Registry) -> None:
    """S15, S16, R3, X3j: one batch of a capped quota (limit 1, depth 1) over
    keys K and L, with repeated run ids: each run is created or refused in
    its place, counting the batch's earlier runs; a repeated id whose first
    entry was created returns that run even though the key is full; a
    repeated id whose first entry was refused is refused again; nothing
    refused is written."""
    capped = Quota("mix", key=lambda i: i["k"], limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    inputs = [{"k": "K"}, {"k": "K"}, {"k": "K"}, {"k": "L"}, {"k": "K"}, {"k": "K"}, {"k": "L"}]
    ids = ["k1", "k2", "k3", "l1", "k1", "k3", "l1"]
    results = engine.start_many("a", inputs, run_ids=ids)
    shown = [r.run_id if isinstance(r, RunRecord) else type(r).__name__ for r in results]
    assert shown == ["k1", "k2", "QuotaQueueFullError", "l1", "k1", "QuotaQueueFullError", "l1"]
    assert sorted(r.run_id for r in engine.store.list_runs()) == ["k1", "k2", "l1"]
    refused = results[2]
    assert isinstance(refused, QuotaQueueFullError) and (refused.quota, refused.key) == ("mix", "K")


def test_start_many_of_a_plain_and_a_capped_workflow_in_one_process(engine: Engine, registry: Registry) -> None:
    """S15, X3j: a quota's cap belongs to the quota: an uncapped quota beside
    it on the same workflow does not lift it (the second run of the batch is
    refused), and a workflow without quotas is never refused by it."""
    capped = Quota("pl-c", limit=1, max_queue_depth=0)
    free = Quota("pl-f", limit=1)
    registry.add("both", "1", _hold, quotas=[free, capped])
    registry.add("plain", "1", _hold)
    results = engine.start_many("both", [{"hold": True}, {}], run_ids=["B1", "B2"])
    assert isinstance(results[0], RunRecord) and isinstance(results[1], QuotaQueueFullError)
    plain = engine.start_many("plain", [{}, {}], run_ids=["P1", "P2"])
    assert [getattr(r, "run_id", r) for r in plain] == ["P1", "P2"]


# -- K2 -------------------------------------------------------------------------------------------


def test_the_quota_keys_override_sets_the_cap_before_and_after_runs(engine: Engine, registry: Registry) -> None:
    """K2, S15, X3j: an override set on a quota key before any run exists
    counts at the first start (limit 3 + depth 1 = 4 members); lowering it to
    1 evicts no one but refuses starts until the members drop below 1 + 1;
    the workflow-wide override of ``quota:<name>`` counts too; clearing it
    brings back the declared cap (2)."""
    capped = Quota("ov", key=lambda i: i["k"], limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    if not engine.store.supports_key_controls:
        pytest.skip("no key controls")
    engine.override_limit("quota:ov", "K", 3, by="t")
    for n in range(4):
        engine.start("a", {"k": "K", "hold": True}, run_id=f"K{n}")
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {"k": "K"}, run_id="K4")
    _drain(engine)
    assert len(_holders(engine, "ov", "K")) == 3
    engine.override_limit("quota:ov", "K", 1, by="t")
    assert len(_holders(engine, "ov", "K")) == 3  # never evicted
    for n in range(2):  # 3, then 2 members left: at or past 1 + 1
        engine.signal(f"K{n}", "go")
        _drain(engine)
        with pytest.raises(QuotaQueueFullError):
            engine.start("a", {"k": "K"}, run_id=f"X{n}")
    engine.signal("K2", "go")
    _drain(engine)
    # K3 is the only member left: 1 < 1 + 1, a start is accepted.
    engine.start("a", {"k": "K", "hold": True}, run_id="K5")
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {"k": "K"}, run_id="K6")
    engine.override_workflow_limit("quota:ov", 2, by="t")
    engine.start("a", {"k": "K", "hold": True}, run_id="K7")  # 3 of 2 + 1
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {"k": "K"}, run_id="K8")
    engine.override_limit("quota:ov", "K", None, by="t")
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {"k": "K"}, run_id="K9")  # declared: 1 + 1 = 2, 3 members
    assert all(engine.store.get_run(r) is None for r in ("K4", "X0", "X1", "K6", "K8", "K9"))


def test_a_raised_override_racing_starts_never_passes_the_new_cap(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """K2, S15, X3j: a quota of limit 1 and depth 1, full (2 members); one
    thread raises the key's override to 3 (cap 4) while 4 threads start runs:
    the key ends with exactly 4 members, never more."""
    capped = Quota("race-ov", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    engines = [make() for _ in range(5)]
    if not engines[0].store.supports_key_controls:
        pytest.skip("no key controls")
    engines[0].start("a", {"hold": True}, run_id="A")
    engines[0].start("a", {"hold": True}, run_id="B")
    raised = threading.Event()

    def work(i: int) -> int:
        if i == 4:
            engines[i].override_limit("quota:race-ov", "*", 3, by="t")
            raised.set()
            return 0
        made = 0
        for n in range(5):
            try:
                engines[i].start("a", {"hold": True}, run_id=f"R{i}-{n}")
                made += 1
            except QuotaQueueFullError:
                # Refused under the old cap or the new: the starts left race the override's
                # commit, and some come after it (on SQLite a thread's five starts could all
                # end before the override's write got the database's lock).
                raised.wait(10)
        return made

    results = run_threads(5, work, timeout=120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert len(_members(engines[0], "race-ov", "*")) == 4
    assert sum(results) == 2


# -- children, schedules, deletes, namespaces --------------------------------------------------------


def test_a_child_refused_by_a_full_quota_fails_in_its_parent(engine: Engine, registry: Registry) -> None:
    """S16, D7, X3j: the parent's ``call_child`` of a workflow whose quota key
    is full gets ChildWorkflowError (status "rejected", the quota named), the
    child is never written, and the parent sees the same on its replay."""
    capped = Quota("kid", limit=1, max_queue_depth=0)
    registry.add("child", "1", _hold, quotas=[capped])
    seen: list[str] = []

    def parent(ctx: Any, input: Any) -> str:
        try:
            ctx.call_child("child", {})
        except ChildWorkflowError as exc:
            seen.append(f"{exc.status}: {exc.error}")
            return "refused"
        return "ran"

    registry.add("parent", "1", parent)
    engine.start("child", {"hold": True}, run_id="HOLDER")
    engine.start("parent", {}, run_id="P")
    _drain(engine)
    assert engine.get("P").status == "completed" and engine.get("P").output == "refused"
    assert seen and seen[0].startswith("rejected") and "kid" in seen[0], seen
    assert engine.store.get_run("P:child:0") is None
    assert [r.run_id for r in _members(engine, "kid", "*")] == ["HOLDER"]


def test_a_child_in_its_parents_own_quota_is_refused_not_deadlocked(engine: Engine, registry: Registry) -> None:
    """S16, X3j, X3d: a parent holding the only place of a quota (limit 1,
    depth 0) starts a child of that quota: the child is refused (a failed
    child), not queued behind its own parent forever."""
    capped = Quota("self", limit=1, max_queue_depth=0)
    registry.add("child", "1", _hold, quotas=[capped])

    def parent(ctx: Any, input: Any) -> str:
        try:
            ctx.call_child("child", {})
        except ChildWorkflowError as exc:
            return exc.status
        return "ran"

    registry.add("parent", "1", parent, quotas=[capped])
    engine.start("parent", {}, run_id="P")
    _settle_all(engine)
    assert (engine.get("P").status, engine.get("P").output) == ("completed", "rejected")


def test_a_schedule_window_refused_by_a_full_quota_is_recorded(make: Callable[..., Engine], registry: Registry) -> None:
    """S16, S17, X3j: a scheduled start refused by its quota key's cap writes
    no run and is recorded as rejected, its detail naming the quota."""

    class Clock:
        now = datetime(2030, 1, 15, 10, 0, 30, tzinfo=UTC)

        def __call__(self) -> datetime:
            return self.now

    clock = Clock()
    capped = Quota("sched", limit=1, max_queue_depth=1)
    registry.add("h", "1", _hold, quotas=[capped])
    registry.add("report", "1", _hold, quotas=[capped], schedules=[Schedule("s", every=60, catch_up="all")])
    engine = make(clock=clock)
    engine.start("h", {"hold": True}, run_id="H")
    fire_due_schedules(engine, clock(), 10)
    clock.now = datetime(2030, 1, 15, 10, 3, 0, tzinfo=UTC)  # three windows, room for one run
    fire_due_schedules(engine, clock(), 10)
    firings = schedule_store_for(engine.store).firings("s")
    assert [str(f.outcome) for f in firings] == ["started", "rejected", "rejected"]
    assert engine.store.get_run(firings[1].run_id) is None
    assert "sched" in firings[1].detail


@pytest.mark.django_db(transaction=True)
def test_a_deleted_member_frees_its_place(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """S15, X3g, X3j: deleting an active member's row (the admin's delete)
    frees its place in the quota key's cap at once: the next start is
    accepted, and the deleted holder's waiter is admitted."""
    from durable_singleton import runtime
    from durable_singleton.models import Run
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    monkeypatch.setattr(runtime, "get_engine", lambda: engine)
    capped = Quota("del", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {"hold": True}, run_id="W")
    _drain(engine)
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {}, run_id="X")
    Run.objects.filter(pk="H").delete()
    _drain(engine)
    assert engine.get("W").quota_slot == "holder"
    engine.start("a", {"hold": True}, run_id="Y")
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {}, run_id="Z")


def test_scoped_engines_count_their_own_namespace(make: Callable[..., Engine], registry: Registry) -> None:
    """S15, X3j, D10: with ``scope_reads`` each namespace's engine counts only
    its namespace's members of the quota key; an unscoped engine counts every
    namespace's."""
    capped = Quota("ns", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    acme = make(namespace="acme", scope_reads=True)
    globex = make(namespace="globex", scope_reads=True)
    plain = make(namespace="acme")
    acme.start("a", {"hold": True}, run_id="A1")
    acme.start("a", {"hold": True}, run_id="A2")
    with pytest.raises(QuotaQueueFullError):
        acme.start("a", {}, run_id="A3")
    globex.start("a", {"hold": True}, run_id="G1")
    globex.start("a", {"hold": True}, run_id="G2")
    with pytest.raises(QuotaQueueFullError):
        globex.start("a", {}, run_id="G3")
    with pytest.raises(QuotaQueueFullError):
        plain.start("a", {}, run_id="P1")
    [refused] = acme.start_many("a", [{}], run_ids=["A4"])
    assert isinstance(refused, QuotaQueueFullError)
    assert sorted(r.run_id for r in acme.store.list_runs()) == ["A1", "A2", "G1", "G2"]


def test_a_fair_quotas_cap_counts_every_sub_key(engine: Engine, registry: Registry) -> None:
    """S15, X3j, X4: a fair quota (limit 1, depth 2) caps its key over all
    sub-keys together: 3 members of tenants t1 and t2 fill it, a start of t3
    is refused; a settled member frees a place for any tenant."""
    fair = Quota("fair", limit=1, max_queue_depth=2, fair_key=lambda i: i["t"], weights={"t1": 3})
    registry.add("a", "1", _hold, quotas=[fair])
    engine.start("a", {"t": "t1", "hold": True}, run_id="A")
    engine.start("a", {"t": "t1"}, run_id="B")
    engine.start("a", {"t": "t2"}, run_id="C")
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {"t": "t3"}, run_id="D")
    _drain(engine)
    engine.signal("A", "go")
    _drain(engine)
    assert {r: engine.get(r).status for r in "ABC"} == {"A": "completed", "B": "completed", "C": "completed"}
    engine.start("a", {"t": "t3"}, run_id="D")


def test_delayed_and_retried_members_count(engine: Engine, registry: Registry) -> None:
    """S15, X3j, X5, D9: a delayed start (``not_before``) is a member from its
    creation and counts; a failed run frees its place; a retried run is a
    member again."""
    capped = Quota("later", limit=1, max_queue_depth=1)
    flaky = {"n": 0}

    def body(ctx: Any, input: dict[str, Any]) -> None:
        if input.get("fail"):
            flaky["n"] += 1
            if flaky["n"] == 1:
                raise RuntimeError("flaky")
        _hold(ctx, input)

    registry.add("a", "1", body, quotas=[capped])
    engine.start("a", {"fail": True}, run_id="F")
    _drain(engine)
    assert engine.get("F").status == "failed"
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {}, run_id="L", not_before=3600)
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {}, run_id="X")
    engine.cancel("L")
    engine.retry("F")
    assert engine.get("F").quota_slot == "waiter"
    with pytest.raises(QuotaQueueFullError):
        engine.start("a", {}, run_id="Y")


# -- liveness after 19907ad ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [2, 3])
def test_every_free_quota_slot_is_filled_after_each_settle(engine: Engine, registry: Registry, limit: int) -> None:
    """X3d, X3g, 19907ad: a quota of limit 2 or 3 with 14 holding runs of two
    workflows (one also with its own singleton key per run, so never blocked
    by it); holders are released in a random order. After each release and a
    drain of the turns it sent (no tick), the quota has exactly
    min(limit, active) holders, in oldest-first order: no waiter is left
    waiting while a slot is free, and every run completes."""
    pool = Quota("live", limit=limit, max_queue_depth=20)
    registry.add("a", "1", _hold, quotas=[pool])
    registry.add("b", "1", _hold, quotas=[pool], singleton={"key": lambda i: i["s"]})
    ids = []
    for n in range(14):
        run_id = f"R{n:02d}"
        if n % 2:
            engine.start("b", {"hold": True, "s": run_id}, run_id=run_id)
        else:
            engine.start("a", {"hold": True}, run_id=run_id)
        ids.append(run_id)
    _drain(engine)
    rnd = random.Random(limit)
    done: list[str] = []
    while len(done) < len(ids):
        holders = sorted(_holders(engine, "live", "*"))
        active = [r for r in ids if r not in done]
        assert len(holders) == min(limit, len(active)), (holders, active)
        # Oldest first: the holders are the oldest `limit` runs not yet released ... or released-at-random
        # ones' successors: each holder is older than every waiter.
        waiters = [r for r in active if r not in holders]
        assert not waiters or max(holders) < min(waiters), (holders, waiters)
        victim = rnd.choice(holders)
        engine.signal(victim, "go")
        _drain(engine)
        assert engine.get(victim).status == "completed"
        done.append(victim)
    assert all(engine.get(r).status == "completed" for r in ids)


@pytest.mark.parametrize("limit", [2, 3])
def test_waiters_blocked_by_their_singleton_key_do_not_stall_the_quota(
    engine: Engine, registry: Registry, limit: int
) -> None:
    """X3d, X3g, 19907ad: a quota of limit 2 or 3; runs of a workflow on a
    shared singleton key (limit 1) interleaved with runs of a quota-only
    workflow, all quick. Within the engine's normal turns (drains and ticks,
    a bounded number of rounds on the clock), every run completes: no waiter
    of the quota is left behind while a slot is free."""
    pool = Quota("hol", limit=limit)
    registry.add("s", "1", lambda ctx, i: None, quotas=[pool], singleton={"key": lambda i: "one"})
    registry.add("q", "1", lambda ctx, i: None, quotas=[pool])
    ids = []
    for n in range(16):
        run_id = f"R{n:02d}"
        engine.start("sq"[n % 3 == 0], {}, run_id=run_id)
        ids.append(run_id)
    _drain(engine)
    statuses = {r: engine.get(r).status for r in ids}
    assert all(s == "completed" for s in statuses.values()), statuses


def test_racing_executors_drain_a_quota_of_three(
    make: Callable[..., Engine], registry: Registry, store_kind: str
) -> None:
    """X3d, X3e, 19907ad: 3 threads execute the turns of 18 quick runs of a
    quota of limit 3 (two workflows) through their own dispatchers: every run
    completes once, never more than 3 bodies at a time, no deadlock."""
    seen = KeysInside()

    def body(ctx: Any, input: Any) -> None:
        seen.enter(["three"])
        threading.Event().wait(0.005)
        seen.leave(["three"], ctx.run_id)

    pool = Quota("three", limit=3, max_queue_depth=30)
    registry.add("a", "1", body, quotas=[pool])
    registry.add("b", "1", body, quotas=[pool], singleton={"key": lambda i: i["s"], "limit": 2})
    engines = [make() for _ in range(3)]
    ids = []
    for n in range(18):
        ids.append(engines[n % 3].start("ab"[n % 2], {"s": str(n % 3)}, run_id=f"R{n:02d}").run_id)

    def work(i: int) -> None:
        for _ in range(200):
            _drain(engines[i])
            if all(engines[i].get(r).is_terminal for r in ids):
                return
            engines[i].tick()
            threading.Event().wait(0.01)

    results = run_threads(3, work, timeout=240)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert seen.most("three") <= 3
    statuses = {r: engines[0].get(r).status for r in ids}
    assert all(s == "completed" for s in statuses.values()), statuses


# -- other start paths ---------------------------------------------------------------------------------


def test_an_event_subscriber_refused_by_a_full_quota_starts_nothing(engine: Engine, registry: Registry) -> None:
    """S16, D8, X3j: ``emit`` of an event with two subscribers, one of them on
    a full capped quota: that one's start is refused (logged) and writes
    nothing, the other starts."""
    capped = Quota("ev", limit=1, max_queue_depth=0)
    registry.add("h", "1", _hold, quotas=[capped])
    registry.add("capped-sub", "1", _hold, quotas=[capped], events=["e"])
    registry.add("plain-sub", "1", _hold, events=["e"])
    engine.start("h", {"hold": True}, run_id="H")
    runs = engine.emit("e", {}, event_id="e1")
    assert [r.workflow_name for r in runs] == ["plain-sub"]
    assert [r.run_id for r in _members(engine, "ev", "*")] == ["H"]
    assert sorted(r.workflow_name for r in engine.store.list_runs()) == ["h", "plain-sub"]


@pytest.mark.django_db(transaction=True)
def test_a_refusal_inside_a_callers_transaction_keeps_the_transaction(registry: Registry) -> None:
    """S15, X3j, S13a: inside the caller's ``transaction.atomic()``, a refused
    start writes nothing and leaves the caller's transaction usable: the
    starts before and after it commit with it, and the cap still counts the
    runs the transaction wrote."""
    from django.db import transaction

    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    capped = Quota("txn", key=lambda i: i["k"], limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    with transaction.atomic():
        engine.start("a", {"k": "K", "hold": True}, run_id="A")
        engine.start("a", {"k": "K", "hold": True}, run_id="B")
        with pytest.raises(QuotaQueueFullError):
            engine.start("a", {"k": "K"}, run_id="C")
        [refused] = engine.start_many("a", [{"k": "K"}], run_ids=["D"])
        assert isinstance(refused, QuotaQueueFullError)
        engine.start("a", {"k": "L"}, run_id="E")
    assert sorted(r.run_id for r in engine.store.list_runs()) == ["A", "B", "E"]


@pytest.mark.django_db(transaction=True)
def test_racing_starts_in_callers_transactions_never_pass_the_cap(registry: Registry) -> None:
    """S15, X3j, S13a: 5 threads each open a transaction, read the quota key's
    members first (an InnoDB REPEATABLE READ snapshot fixed before the lock),
    then start 2 runs and commit: the key (limit 1, depth 2: cap 3) ends with
    at most 3 members and every refusal is a QuotaQueueFullError."""
    from django.db import connection, transaction

    from durable_singleton.models import QuotaMembership
    from durable_singleton.testing import make_engine

    if connection.vendor == "sqlite":
        pytest.skip("SQLite: a deferred transaction that read cannot take the write lock while others write")
    capped = Quota("ctx", limit=1, max_queue_depth=2)
    registry.add("a", "1", _hold, quotas=[capped])
    engines = [make_engine("django", registry=registry) for _ in range(5)]
    gate = threading.Barrier(5, timeout=60)

    def work(i: int) -> list[str]:
        made: list[str] = []
        with transaction.atomic():
            list(QuotaMembership.objects.filter(quota="ctx").values_list("pk", flat=True))
            gate.wait()
            for n in range(2):
                try:
                    engines[i].start("a", {"hold": True}, run_id=f"C{i}-{n}")
                    made.append(f"C{i}-{n}")
                except QuotaQueueFullError:
                    pass
        return made

    results = run_threads(5, work, timeout=120)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert len(_members(engines[0], "ctx", "*")) <= 3, results
    assert sum(len(r) for r in results) == len(_members(engines[0], "ctx", "*"))


@pytest.mark.parametrize("on_busy", ["replace_queued"])
def test_a_replacing_start_on_a_full_quota_keeps_the_count(engine: Engine, registry: Registry, on_busy: str) -> None:
    """X1, S15, X3j: on a full capped quota (limit 1, depth 1), a
    ``replace_queued`` start on the key of the quota's one waiter replaces
    that waiter: the count stays 2 (the cap), never 3."""
    capped = Quota("rep", limit=1, max_queue_depth=1)
    registry.add("h", "1", _hold, quotas=[capped])
    registry.add("r", "1", _hold, quotas=[capped], singleton={"key": lambda i: "k", "on_busy": on_busy})
    engine.start("h", {"hold": True}, run_id="H")
    engine.start("r", {}, run_id="R1")
    _drain(engine)
    with contextlib.suppress(QuotaQueueFullError):  # refusing is also within the rule
        engine.start("r", {}, run_id="R2")
    assert len(_members(engine, "rep", "*")) <= 2, [r.run_id for r in _members(engine, "rep", "*")]


def test_quota_keys_differing_in_case_or_trailing_space_have_their_own_caps(engine: Engine, registry: Registry) -> None:
    """S15, X3a, X3b, X3j: "K", "k" and "K " are three quota keys (MariaDB's
    default collation would fold them): each is capped on its own members. A
    quota name of 64 characters and a key of 127 (the longest allowed) work."""
    capped = Quota("case", key=lambda i: i["k"], limit=1, max_queue_depth=0)
    longest = Quota("q" * 64, key=lambda i: "é" * 127, limit=1, max_queue_depth=0)
    registry.add("a", "1", _hold, quotas=[capped])
    registry.add("z", "1", _hold, quotas=[longest])
    for n, k in enumerate(("K", "k", "K ")):
        engine.start("a", {"k": k, "hold": True}, run_id=f"A{n}")
    for n, k in enumerate(("K", "k", "K ")):
        with pytest.raises(QuotaQueueFullError) as caught:
            engine.start("a", {"k": k}, run_id=f"B{n}")
        assert caught.value.key == k
    engine.start("z", {"hold": True}, run_id="Z1")
    with pytest.raises(QuotaQueueFullError):
        engine.start("z", {}, run_id="Z2")
    assert sorted(r.run_id for r in engine.store.list_runs()) == ["A0", "A1", "A2", "Z1"]


@pytest.mark.django_db(transaction=True)
def test_the_quota_table_reports_a_capped_quota_keys_cap(registry: Registry) -> None:
    """X3j, S15 (as the admin covers singleton keys: ``KeyRow.capacity`` and
    the "full" filter): a capped quota key's row in the admin's quota table
    tells its cap (limit in force + max_queue_depth, K2) so that an operator
    can see why starts are refused."""
    from durable_singleton import queues
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    capped = Quota("shown", limit=1, max_queue_depth=1)
    registry.add("a", "1", _hold, quotas=[capped])
    engine.start("a", {"hold": True}, run_id="H")
    engine.start("a", {"hold": True}, run_id="W")
    [row] = queues.quota_table(reg=registry)
    assert (row.quota, row.holders + row.waiting) == ("shown", 2)
    assert getattr(row, "capacity", "no capacity field") == 2, sorted(vars(row))
