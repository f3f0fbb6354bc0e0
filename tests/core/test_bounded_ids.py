"""Bounded derived ids and tags (section 7, R1, D7, D8, S12; #18 item 4).

An id built from legal parts could pass the 191-character column: a parent
with a legal 185-character id failed its child call, and ``emit`` with a
long ``event_id`` raised after starting some subscribers but not others.
Derived ids now always fit (a deterministic hash suffix past 191
characters), and ``emit`` validates every subscriber's start before making
any. Tags were unbounded (8,000 gave an untyped OperationalError on
MariaDB) and de-duplicated in quadratic time (100,000 took 84 s): at most
``MAX_TAGS`` distinct tags, else InvalidInputError, de-duplicated in one
pass. In memory and on the DATABASE_URL database."""

from __future__ import annotations

from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError, SingletonKeyError
from durable_singleton.values import ID_MAX_LENGTH, derived_id
from tests.helpers import drain as _drain


def _all_runs(engine: Engine) -> list[str]:
    return sorted(r.run_id for r in engine.store.list_runs())


def test_derived_ids_fit_are_deterministic_and_keep_short_ids() -> None:
    """R1, R3: a derived id that fits is unchanged; a longer one is cut to 191
    characters with a hash suffix, the same for the same text, different for
    texts that differ only past the cut."""
    assert derived_id("parent:child:0") == "parent:child:0"
    long_a, long_b = "p" * 185 + ":child:1", "p" * 185 + ":child:2"
    assert len(derived_id(long_a)) == ID_MAX_LENGTH == len(derived_id(long_b))
    assert derived_id(long_a) == derived_id(long_a) != derived_id(long_b)
    assert derived_id(long_a).startswith("p" * 100)


def test_a_child_of_a_185_character_parent_is_started_and_returns(engine: Engine, registry: Registry) -> None:
    """D7, R1: a parent with a legal 185-character id calls two children; each
    child id is derived to fit the column, the children complete, and the
    parent gets their outputs (on replay too: the ids are deterministic)."""
    registry.add("child", "1", lambda ctx, i: i * 2)
    registry.add("parent", "1", lambda ctx, i: [ctx.call_child("child", 1), ctx.call_child("child", 2)])
    parent_id = "p" * 185
    engine.start("parent", None, run_id=parent_id)
    _drain(engine)
    parent = engine.get(parent_id)
    assert (parent.status, parent.output) == ("completed", [2, 4]), parent.error
    children = [r for r in _all_runs(engine) if r != parent_id]
    assert len(children) == 2 and all(len(c) <= ID_MAX_LENGTH for c in children)
    # Positions 0 and 2: each call_child also stores the outcome it saw (#18 item 6).
    assert sorted(children) == sorted(derived_id(f"{parent_id}:child:{n}") for n in (0, 2))


def test_emit_with_a_long_event_id_starts_every_subscriber_once(engine: Engine, registry: Registry) -> None:
    """D8, R3: with a 120-character event id, a subscriber whose name makes
    ``event:<id>:<workflow>`` longer than 191 characters is started like the
    others, with a derived id; emitting again starts nothing new."""
    registry.add("short", "1", lambda ctx, i: i, events=["order.created"])
    registry.add("w" * 100, "1", lambda ctx, i: i, events=["order.created"])
    event_id = "e" * 120
    first = engine.emit("order.created", {"n": 1}, event_id=event_id)
    assert len(first) == 2 and all(len(r.run_id) <= ID_MAX_LENGTH for r in first)
    again = engine.emit("order.created", {"n": 1}, event_id=event_id)
    assert [r.run_id for r in again] == [r.run_id for r in first]
    assert len(_all_runs(engine)) == 2


def test_emit_that_one_subscriber_refuses_starts_none(engine: Engine, registry: Registry) -> None:
    """D8, S1, section 7: when one subscriber's key function refuses the
    payload, emit raises before starting any subscriber (it started the ones
    registered before it)."""
    registry.add("first", "1", lambda ctx, i: i, events=["evt"])
    registry.add("picky", "1", lambda ctx, i: i, events=["evt"], singleton={"key": lambda i: i["tenant"]})
    with pytest.raises(SingletonKeyError):
        engine.emit("evt", {"no": "tenant"}, event_id="x1")
    with pytest.raises(SingletonKeyError):
        engine.emit("evt", {"no": "tenant"})
    assert _all_runs(engine) == []


def test_more_than_max_tags_is_invalid_input_and_writes_nothing(make: Any) -> None:
    """Section 7, S12: at most MAX_TAGS distinct tags (duplicates and the
    reserved markers do not count); one more is InvalidInputError and no row.
    The accepted tags keep their first order."""
    engine = make(MAX_TAGS=3)
    engine.registry.add("tagged", "1", lambda ctx, i: i)
    with pytest.raises(InvalidInputError, match="MAX_TAGS = 3"):
        engine.start("tagged", None, run_id="too-many", tags=["a", "b", "c", "d"])
    assert _all_runs(engine) == []
    run = engine.start("tagged", None, run_id="ok", tags=["b", "a", "b", "durable:singleton:admitted", "c", "a"])
    assert engine.get(run.run_id).user_tags == ("b", "a", "c")


@pytest.mark.parametrize("count", [8_000, 100_000])
def test_thousands_of_distinct_tags_are_refused_at_once(engine: Engine, registry: Registry, count: int) -> None:
    """Section 7, S12: 8,000 tags (an OperationalError on MariaDB) and 100,000
    (84 s of quadratic de-duplication) are refused with InvalidInputError by
    the default MAX_TAGS = 100, writing nothing."""
    registry.add("tagged", "1", lambda ctx, i: i)
    with pytest.raises(InvalidInputError, match="MAX_TAGS = 100"):
        engine.start("tagged", None, run_id="many", tags=[f"tag-{n}" for n in range(count)])
    assert _all_runs(engine) == []
