"""Breaks of the shared quotas found by an independent tester (#20, X3), each
kept as a test that failed before its fix: a stalled holder read its
takeover's quota token (X3f, K1); deleting a quota waiter or holder through
the ORM (the admin) sent the quota's next waiters no turn (X3g, F12);
``replace_queued`` kept two waiters on a key whose workflow has quotas (X1);
a quota name with a control character, a blank one, or a limit past
MAX_LIMIT registered (X3a); ``quotas=None`` raised TypeError; a module
executed twice could not re-register its quota (X3a). On the in-memory store
and the DATABASE_URL database (SQLite, PostgreSQL, MariaDB).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from durable_singleton import Quota, runtime, workflow
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidWorkflowError
from tests.conftest import spawn
from tests.core.test_turn_protocol_faults import TokenCheckingStore, _set_lease

A = Quota("la", limit=1)
B = Quota("lb", limit=1)


def _hold(ctx: Any, input: dict[str, Any]) -> None:
    if input.get("hold"):
        ctx.wait_for_signal("go")


def _settle_all(engine: Engine) -> None:
    for _ in range(3):
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        engine.tick()
        engine.dispatcher.drain()  # type: ignore[attr-defined]


def test_a_stalled_holder_keeps_its_own_quota_token(engine: Engine, registry: Registry) -> None:
    """X3f, K1: the first executor stalls, its lease is taken over with a new
    token; when it wakes, ``ctx.quota_tokens`` still gives its own, smaller
    token, so a system that keeps the highest token refuses its late write."""
    external = TokenCheckingStore()
    calls: list[int] = []
    stall, inside, read = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def body(ctx: Any, input: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            seen["before"] = ctx.quota_tokens["fq"]
            assert external.write("worker 1 before its stall", seen["before"])
            inside.set()
            stall.wait(30)
            seen["late"] = ctx.quota_tokens.get("fq", -1)
            read.set()
            return
        seen["takeover"] = ctx.quota_tokens["fq"]
        assert external.write("worker 2", seen["takeover"])
        stall.set()
        assert read.wait(10)

    registry.add("f", "1", body, quotas=[Quota("fq", limit=1)])
    engine.start("f", {}, run_id="A")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    thread = spawn(engine.execute, "A")
    assert inside.wait(10)
    _set_lease(engine, "A", -1)
    engine.tick()
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    stall.set()
    thread.join(60)
    assert not thread.is_alive(), "a thread of the test is still running"
    assert seen["takeover"] > seen["before"]
    assert seen["late"] == seen["before"], seen
    assert not external.write("worker 1 after its stall", seen["late"])


@pytest.fixture
def orm_engine(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """A Django-store engine that the delete receivers release through."""
    from durable_singleton.testing import make_engine

    engine = make_engine("django", registry=registry)
    monkeypatch.setattr(runtime, "get_engine", lambda: engine)
    yield engine


@pytest.mark.django_db(transaction=True)
def test_deleting_the_front_waiter_of_a_quota_sends_the_next_its_turn(orm_engine: Engine, registry: Registry) -> None:
    """X3g, F12: W1 (quotas A and B) is at A's front, blocked by B's holder; W2
    (A only) waits behind it with the backlog delay. Deleting W1's row (the
    admin's delete) sends W2 its turn: it runs now, not an hour later."""
    from durable_singleton.models import Run

    registry.add("wb", "1", _hold, quotas=[B])
    registry.add("wab", "1", _hold, quotas=[A, B])
    registry.add("wa", "1", _hold, quotas=[A])
    orm_engine.start("wb", {"hold": True}, run_id="HB")
    orm_engine.start("wab", {}, run_id="W1")
    orm_engine.start("wa", {}, run_id="W2")
    orm_engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert orm_engine.get("W2").quota_slot == "waiter"
    Run.objects.filter(pk="W1").delete()
    _settle_all(orm_engine)
    assert orm_engine.get("W2").status == "completed"


@pytest.mark.django_db(transaction=True)
def test_deleting_a_quota_holder_sends_its_waiter_its_turn(orm_engine: Engine, registry: Registry) -> None:
    """X3g, F12: deleting the row of a run that holds a quota frees its slot and
    sends the quota's front waiter its turn in the same call."""
    from durable_singleton.models import Run

    registry.add("wa", "1", _hold, quotas=[A])
    orm_engine.start("wa", {"hold": True}, run_id="H")
    orm_engine.start("wa", {}, run_id="X1")
    orm_engine.dispatcher.drain()  # type: ignore[attr-defined]
    Run.objects.filter(pk="H").delete()
    orm_engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert orm_engine.get("X1").status == "completed"


def test_replace_queued_keeps_one_waiter_when_the_workflow_has_quotas(engine: Engine, registry: Registry) -> None:
    """X1, X3h: the singleton key has a free slot but the quota is busy, so its
    waiter is not being admitted: each new start replaces it, and the key has at
    most one waiter; when the quota frees, the last start runs."""
    log: list[str] = []

    def body(ctx: Any, input: dict[str, Any]) -> None:
        _hold(ctx, input)
        log.append(ctx.run_id)

    registry.add("wb", "1", body, quotas=[B])
    registry.add("rq", "1", body, quotas=[B], singleton={"key": lambda i: "k", "on_busy": "replace_queued"})
    engine.start("wb", {"hold": True}, run_id="HB")
    for run_id in ("R1", "R2", "R3"):
        engine.start("rq", {}, run_id=run_id)
        engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert [r for r in ("R1", "R2", "R3") if not engine.get(r).is_terminal] == ["R3"]
    assert engine.get("R1").error["code"] == engine.get("R2").error["code"] == "replaced"
    engine.signal("HB", "go")
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == ["HB", "R3"]


@pytest.mark.parametrize("name", ["\x00", "a\x00b", " ", "\t", "a\nb", "\ud800"])
def test_a_quota_name_no_database_stores_as_it_is_is_refused(registry: Registry, name: str) -> None:
    """X3a, R1: a NUL, a control character, a blank name or a lone surrogate is
    refused at registration, as every other stored name is (values.check_text)."""
    with pytest.raises(InvalidWorkflowError):
        registry.add("w", "1", lambda ctx, i: None, quotas=[Quota(name)])
    assert "w" not in registry.latest


@pytest.mark.parametrize("limit", [2**31, 2**63])
def test_a_quota_limit_past_max_limit_is_refused(registry: Registry, limit: int) -> None:
    """X3a: a limit stops at MAX_LIMIT (2**31 - 1), as a runtime override does (K2)."""
    with pytest.raises(InvalidWorkflowError):
        registry.add("w", "1", lambda ctx, i: None, quotas=[Quota("big", limit=limit)])


def test_quotas_none_is_a_typed_error(registry: Registry) -> None:
    """X3a: ``@workflow(quotas=None)`` raises InvalidWorkflowError, not TypeError."""
    with pytest.raises(InvalidWorkflowError):
        workflow(name="w", quotas=None, registry=registry)(lambda ctx, i: None)  # type: ignore[arg-type]


def test_a_module_executed_twice_re_registers_its_quota(registry: Registry) -> None:
    """X3a: a module executed again (a reload, a second import) declares its
    quota with a new lambda of the same module, name and code: the same
    declaration, re-registered; another limit is still a conflict."""
    source = (
        "from durable_singleton import Quota\n"
        "Q = Quota('reload-q', key=lambda i: i['a'], limit=2)\n"
        "def body(ctx, input):\n    return None\n"
    )
    modules = []
    for _ in range(2):
        module = types.ModuleType("ds_reloaded_module")
        exec(compile(source, "ds_reloaded_module.py", "exec"), module.__dict__)
        modules.append(module)
    registry.add("rw", "1", modules[0].body, quotas=[modules[0].Q])
    registry.add("rw", "1", modules[1].body, quotas=[modules[1].Q])
    with pytest.raises(InvalidWorkflowError):
        registry.add("other", "1", modules[1].body, quotas=[Quota("reload-q", key=modules[1].Q.key, limit=3)])
