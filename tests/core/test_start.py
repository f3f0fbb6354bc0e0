"""Starting runs: R1, R3, S1, S3, S12, S15, S16, S19 and section 7."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from durable_singleton import ADMITTED_TAG, TRACKED_TAG
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    InvalidInputError,
    InvalidRunIdError,
    SingletonKeyError,
    SingletonQueueFullError,
    UnknownWorkflowError,
)
from tests.conftest import Monitor
from tests.helpers import audited


def test_start_is_idempotent_by_run_id(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """R3, S19: the same run_id started twice is one run; the second start returns it."""
    audited(registry, monitor)
    first = engine.start("wf", {"k": "A"}, run_id="same")
    second = engine.start("wf", {"k": "B"}, run_id="same")
    assert second.run_id == first.run_id and second.input == {"k": "A"}
    assert len(engine.store.list_runs()) == 1
    assert engine.dispatcher.sent == ["same"]


def test_key_is_computed_once_and_tagged(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S1, S12: tagged singleton:<key> and tracked at start; reserved markers stripped from caller tags."""
    calls: list[object] = []

    def key(i: dict) -> str:
        calls.append(i)
        return f"store:{i['k']}"

    registry.add("keyed", "1", lambda c, i: None, singleton={"key": key})
    run = engine.start("keyed", {"k": "A"}, tags=["mine", ADMITTED_TAG, TRACKED_TAG, "mine"])
    stored = engine.get(run.run_id)
    assert stored.tags == ["mine", "singleton:store:A", TRACKED_TAG]
    engine.dispatcher.drain()
    assert len(calls) == 1, "the key function runs once, at start"
    assert engine.get(run.run_id).tags == ["mine", "singleton:store:A"], "markers are removed at terminal"


@pytest.mark.parametrize(
    ("key_fn", "problem"),
    [
        (lambda i: 1 / 0, "raised ZeroDivisionError"),
        (lambda i: 42, "returned int"),
        (lambda i: "", "empty"),
        (lambda i: "x" * 192, "192 characters"),
    ],
)
def test_bad_key_raises_and_writes_nothing(engine: Engine, registry: Registry, key_fn: Callable, problem: str) -> None:
    """S1: a key function that raises or returns a non-string/empty/oversize key: clear error, no row."""
    registry.add("bad-key", "1", lambda c, i: None, singleton={"key": key_fn})
    with pytest.raises(SingletonKeyError, match=problem):
        engine.start("bad-key", {})
    assert engine.store.list_runs() == []
    assert engine.dispatcher.sent == []


@pytest.mark.parametrize("run_id", ["", 12, "r" * 192])
def test_invalid_run_id_raises_and_writes_nothing(engine: Engine, registry: Registry, run_id: object) -> None:
    """R1: a run id is a non-empty string of bounded length."""
    registry.add("plain", "1", lambda c, i: None)
    with pytest.raises(InvalidRunIdError):
        engine.start("plain", {}, run_id=run_id)  # type: ignore[arg-type]
    assert engine.store.list_runs() == []


def test_unknown_workflow_and_non_json_input_raise_typed_errors(engine: Engine, registry: Registry) -> None:
    registry.add("plain", "1", lambda c, i: None)
    with pytest.raises(UnknownWorkflowError):
        engine.start("nope", {})
    with pytest.raises(InvalidInputError):
        engine.start("plain", {"when": object()})
    with pytest.raises(InvalidInputError):
        engine.start("plain", float("nan"))
    assert engine.store.list_runs() == []


def test_generated_run_ids_are_unique_and_created_at_has_microseconds(engine: Engine, registry: Registry) -> None:
    registry.add("plain", "1", lambda c, i: None)
    runs = [engine.start("plain", {}) for _ in range(20)]
    assert len({r.run_id for r in runs}) == 20
    stored = engine.store.list_runs()
    assert any(r.created_at.microsecond for r in stored), "created_at keeps microseconds (R1)"


def test_start_never_blocks_on_a_busy_key_without_cap(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S3: without max_queue_depth, starts on a busy key all succeed."""
    audited(registry, monitor)
    runs = [engine.start("wf", {"k": "A"}) for _ in range(25)]
    assert len(runs) == 25 and all(r.status == "pending" for r in runs)


def test_queue_cap_rejects_and_recovers(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """S15, S16, F5: at limit + max_queue_depth, start raises and writes nothing;
    after a slot frees, starts are accepted again; an existing run_id is never rejected."""
    audited(registry, monitor, limit=1, max_queue_depth=2)
    first = engine.start("wf", {"k": "A"}, run_id="a0")
    engine.start("wf", {"k": "A"}, run_id="a1")
    engine.start("wf", {"k": "A"}, run_id="a2")
    with pytest.raises(SingletonQueueFullError) as info:
        engine.start("wf", {"k": "A"}, run_id="a3")
    err = info.value
    assert (err.workflow, err.key, err.max_queue_depth) == ("wf", "key:A", 2)
    assert "wf" in str(err) and "key:A" in str(err) and "2" in str(err)
    assert engine.store.get_run("a3") is None
    assert engine.start("wf", {"k": "A"}, run_id="a0").run_id == first.run_id, "idempotent re-start is not rejected"
    assert engine.start("wf", {"k": "B"}).singleton_key == "key:B", "another key still accepts"
    engine.execute("a0")  # completes; a1 and a2 remain
    engine.start("wf", {"k": "A"}, run_id="a3")
    with pytest.raises(SingletonQueueFullError):
        engine.start("wf", {"k": "A"}, run_id="a4")


def test_cap_counts_only_engine_namespace_when_scope_reads(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """S15: the cap's count is scoped to the engine's namespace when scope_reads is on."""
    audited(registry, monitor, limit=1, max_queue_depth=0)
    acme = make()
    acme.namespace, acme.scope_reads = "acme", True
    globex = make()
    globex.namespace, globex.scope_reads = "globex", True
    acme.start("wf", {"k": "A"})
    globex.start("wf", {"k": "A"})
    with pytest.raises(SingletonQueueFullError):
        acme.start("wf", {"k": "A"})


def test_class_dispatch_uses_default_engine(settings, transactional_db) -> None:  # type: ignore[no-untyped-def]
    """Wf.dispatch and Wf.start start through the default engine (S16)."""
    settings.DURABLE_SINGLETON = {"DISPATCH": "manual"}
    from durable_singleton import get_engine
    from testproject.inventory.workflows import SyncInventory

    run = SyncInventory.dispatch({"store_id": "Z"}, run_id="dispatch-1")
    again = SyncInventory.start({"store_id": "Z"}, run_id="dispatch-1")
    assert run.run_id == again.run_id == "dispatch-1"
    get_engine().dispatcher.drain()
    assert get_engine().get("dispatch-1").status == "completed"


def test_turn_is_sent_only_after_the_creating_transaction_commits(transactional_db, registry: Registry) -> None:  # type: ignore[no-untyped-def]
    """Section 6: the task is sent after the creating transaction commits; a rollback sends nothing."""
    from django.db import transaction

    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    registry.add("plain", "1", lambda c, i: None)
    with transaction.atomic():
        engine.start("plain", {}, run_id="committed")
        assert engine.dispatcher.sent == []
    assert engine.dispatcher.sent == ["committed"]
    with pytest.raises(RuntimeError), transaction.atomic():
        engine.start("plain", {}, run_id="rolled-back")
        raise RuntimeError("rollback")
    assert engine.dispatcher.sent == ["committed"]
    assert engine.store.get_run("rolled-back") is None


def test_run_ids_and_keys_compare_exactly(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """R3, S1: ids and keys differing only in case or trailing spaces are distinct
    (MySQL/MariaDB columns use a binary collation)."""
    audited(registry, monitor)
    ids = ["job-ABC", "job-abc", "job-abc "]
    for n, run_id in enumerate(ids):
        assert engine.start("wf", {"k": ["Q", "q", "q "][n]}, run_id=run_id).run_id == run_id
    runs = {r.run_id: r for r in engine.store.list_runs()}
    assert sorted(runs) == sorted(ids)
    assert sorted(r.singleton_key for r in runs.values()) == sorted(["key:Q", "key:q", "key:q "])
    engine.dispatcher.queue.clear()
    assert [engine.execute(run_id) for run_id in ids] == ["completed"] * 3, "three keys, three free slots"
