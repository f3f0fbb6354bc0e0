"""Namespaces: D10, D7, R3, S11, S16, S18 (issue #18 item 2).

A run id names one run, in one namespace. An engine with ``scope_reads``
never returns nor reveals a run of another namespace: a start (``start``,
``start_many``, ``signal_with_start``, ``emit``) of an id that another
namespace uses raises :class:`RunIdInUseError` (or returns it in its place in
a batch) and writes nothing; every read (``get``, ``signal``, ``cancel``,
``retry``, ``wake``, ``explain``, the django.tasks results) says the run does
not exist. A child always lives in its parent's namespace: a child id that
another namespace uses is a rejected child on every engine, scoped or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    ChildWorkflowError,
    RunIdInUseError,
    RunNotFoundError,
    SingletonQueueFullError,
)
from durable_singleton.stores.base import RunRecord
from tests.conftest import Monitor, run_threads
from tests.helpers import audited, claim

SECRET = {"k": "K", "card": "4111-secret"}


def _tenants(make: Callable[..., Engine]) -> tuple[Engine, Engine]:
    return make(namespace="acme", scope_reads=True), make(namespace="globex", scope_reads=True)


def _acme_run(acme: Engine, registry: Registry, monitor: Monitor, *, finish: bool = True) -> RunRecord:
    audited(registry, monitor, max_queue_depth=50)
    acme.start("wf", SECRET, run_id="shared")
    if finish:
        acme.dispatcher.drain()
    return acme.store.get_run("shared")  # type: ignore[return-value]


def _untouched(acme: Engine, before: RunRecord) -> None:
    after = acme.store.get_run("shared")
    assert after == before, "the other namespace's run was changed"
    assert acme.store.load_signals("shared") == []


def _reveals_nothing(exc: BaseException) -> None:
    assert "acme" not in str(exc) and "secret" not in str(exc)


def test_scoped_start_of_an_id_used_in_another_namespace_raises_and_reveals_nothing(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D10, R3: globex starting acme's run id gets RunIdInUseError, not acme's run
    with its input and output (on e035ec7 it got the run back while its get said
    there was no such run); nothing is written, nothing sent."""
    acme, globex = _tenants(make)
    before = _acme_run(acme, registry, monitor)
    with pytest.raises(RunIdInUseError) as caught:
        globex.start("wf", {"k": "K"}, run_id="shared")
    assert caught.value.run_id == "shared"
    _reveals_nothing(caught.value)
    with pytest.raises(RunNotFoundError):
        globex.get("shared")
    assert globex.dispatcher.sent == []
    _untouched(acme, before)


def test_scoped_start_many_returns_the_error_in_the_place_of_an_id_used_elsewhere(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D10, R3, S15: in a batch, an id of another namespace is returned as its
    RunIdInUseError in its place (as a full queue's error is); the others are created."""
    acme, globex = _tenants(make)
    before = _acme_run(acme, registry, monitor)
    out = globex.start_many("wf", [{"k": "K", "n": 1}, {"k": "K", "n": 2}], run_ids=["fresh", "shared"])
    assert isinstance(out[0], RunRecord) and out[0].namespace == "globex"
    assert isinstance(out[1], RunIdInUseError) and out[1].run_id == "shared"
    _reveals_nothing(out[1])
    assert globex.dispatcher.sent == ["fresh"]
    _untouched(acme, before)


def test_scoped_signal_with_start_of_an_id_used_elsewhere_signals_nothing(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D10, S18: signal_with_start of another namespace's active run raises
    RunIdInUseError and buffers no signal on that run."""
    acme, globex = _tenants(make)
    before = _acme_run(acme, registry, monitor, finish=False)
    with pytest.raises(RunIdInUseError):
        globex.signal_with_start("wf", {"k": "K"}, run_id="shared", signal="go", payload=1)
    _untouched(acme, before)


def test_scoped_emit_of_an_event_id_used_elsewhere_starts_nothing(
    make: Callable[..., Engine], registry: Registry
) -> None:
    """D10, D8: globex emitting an event id whose derived run ids acme already
    used raises RunIdInUseError before starting any subscriber."""
    acme, globex = _tenants(make)
    registry.add("on-a", "1", lambda ctx, i: i, events=["evt"])
    registry.add("on-b", "1", lambda ctx, i: i, events=["evt"])
    acme.start("on-b", SECRET, run_id="event:e1:on-b")
    with pytest.raises(RunIdInUseError):
        globex.emit("evt", {"n": 1}, event_id="e1")
    assert [r.run_id for r in globex.store.list_runs()] == ["event:e1:on-b"]


@pytest.mark.parametrize("call", ["get", "signal", "cancel", "retry", "wake", "explain"])
def test_scoped_reads_and_actions_on_another_namespace_run_say_it_does_not_exist(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor, call: str
) -> None:
    """D10: every read and action of a scoped engine on another namespace's run
    raises RunNotFoundError and changes nothing."""
    acme, globex = _tenants(make)
    before = _acme_run(acme, registry, monitor, finish=call != "retry")
    if call == "retry":
        acme.cancel("shared")
        before = acme.store.get_run("shared")  # type: ignore[assignment]
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: globex.get("shared"),
        "signal": lambda: globex.signal("shared", "go", 1),
        "cancel": lambda: globex.cancel("shared"),
        "retry": lambda: globex.retry("shared"),
        "wake": lambda: globex.wake("shared"),
        "explain": lambda: globex.explain("shared"),
    }
    with pytest.raises(RunNotFoundError):
        calls[call]()
    _untouched(acme, before)


def test_scoped_explain_names_no_holder_of_another_namespace(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D10, S11, K3: admission is global, so globex's waiter queues behind acme's
    holder; its explanation counts that holder but names no run of acme (on
    e035ec7 it named acme's holder, its status and how long it held)."""
    acme, globex = _tenants(make)
    audited(registry, monitor)
    acme.start("wf", {"k": "K"}, run_id="acme-holder")
    claim(acme, "acme-holder")
    globex.start("wf", {"k": "K"}, run_id="globex-waiter")
    claim(globex, "globex-waiter")
    explanation = globex.explain("globex-waiter")
    assert explanation.holder_count == 1
    assert "acme-holder" not in explanation.sentence
    assert all(h.run_id != "acme-holder" for h in explanation.holders)
    assert "acme-holder" in acme.explain("acme-holder").sentence


@pytest.mark.parametrize("scoped", [True, False])
def test_a_child_id_used_in_another_namespace_is_a_rejected_child(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor, scoped: bool
) -> None:
    """D7, D10: a child lives in its parent's namespace. A globex parent whose
    call_child names acme's finished run id gets a rejected child
    (ChildWorkflowError), never acme's output, whether the engine executing the
    parent's turn is scoped or not (workers usually are not)."""
    acme = make(namespace="acme", scope_reads=True)
    globex = make(namespace="globex", scope_reads=scoped)
    _acme_run(acme, registry, monitor)
    seen: list[Any] = []

    def parent(ctx: Any, input: Any) -> Any:
        try:
            seen.append(ctx.call_child("wf", {"k": "K"}, run_id="shared"))
        except ChildWorkflowError as exc:
            seen.append(exc)
        return "done"

    registry.add("parent", "1", parent)
    globex.start("parent", None, run_id="p")
    globex.dispatcher.drain()
    assert len(seen) == 1 and isinstance(seen[0], ChildWorkflowError), seen
    assert seen[0].status == "rejected"
    _reveals_nothing(seen[0])
    assert globex.store.get_run("p").status == "completed"  # type: ignore[union-attr]


def test_tenants_racing_to_start_the_same_ids_never_get_each_others_runs(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """D10, R3, S16: acme and globex racing start_many and start over the same
    40 ids: each id is one run, in one namespace; its own tenant gets it back,
    the other gets RunIdInUseError, never the run."""
    audited(registry, monitor, max_queue_depth=10_000)
    registry.add("plain", "1", lambda ctx, i: i)
    engines = [make(namespace="acme", scope_reads=True), make(namespace="globex", scope_reads=True)]
    for round_no, workflow in enumerate(["plain", "wf", "plain", "wf"]):
        ids = [f"race-{round_no}-{n}" for n in range(40)]

        def racer(i: int, ids: list[str] = ids, workflow: str = workflow) -> list[Any]:
            inputs = [{"k": "K", "by": i} for _ in ids]
            if i == 1:
                out: list[Any] = []
                for inp, run_id in zip(inputs, ids, strict=True):
                    try:
                        out.append(engines[i].start(workflow, inp, run_id=run_id))
                    except RunIdInUseError as exc:
                        out.append(exc)
                return out
            return list(engines[i].start_many(workflow, inputs, run_ids=ids))

        results = run_threads(2, racer)
        stored = {r.run_id: r for r in engines[0].store.list_runs() if r.run_id in ids}
        assert sorted(stored) == sorted(ids)
        for i, result in enumerate(results):
            assert not isinstance(result, BaseException), result
            for run_id, got in zip(ids, result, strict=True):
                assert not isinstance(got, SingletonQueueFullError)
                if stored[run_id].namespace == engines[i].namespace:
                    assert isinstance(got, RunRecord) and got.input == {"k": "K", "by": i}
                else:
                    assert isinstance(got, RunIdInUseError), (run_id, got)
