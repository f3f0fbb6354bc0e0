"""Bounded input at the key controls (section 7, K2; #18 item 4): every bad key,
reason, author, limit override and history limit is a typed
:class:`ValidationError` that writes nothing: no lock row, no recorded change.
NUL, lone surrogates and integers beyond the column gave database errors
(PostgreSQL refuses NUL, MariaDB and PostgreSQL lone surrogates,
``limit_override`` is a 32-bit integer). In memory and on the DATABASE_URL
database."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import ValidationError

BAD_KEYS = ["", "   ", "\x00", "a\x00b", "\ud800", "k\udcff", "tab\there", "k" * 192, 7, None]
BAD_TEXT = ["\x00", "why\x00", "\ud800", "by \udcff", "\x1b[31m"]
BAD_LIMITS = [0, -1, 2**31, 10**30, True, 1.5, "3", float("inf")]
BAD_HISTORY_LIMITS = [0, -1, 10**30, True, "5", 2.0]


@pytest.fixture
def controlled(make: Callable[..., Engine], registry: Registry) -> Engine:
    registry.add("wf", "1", lambda ctx, i: i, singleton={"key": lambda i: f"key:{i['k']}", "limit": 1})
    engine = make()
    engine.start("wf", {"k": "K"}, run_id="r1")  # a key with a lock row, for the workflow-wide calls
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    return engine


def _written(engine: Engine) -> tuple[Any, ...]:
    """What the controls have written: every key's state and every recorded change."""
    keys = tuple(engine.key_controls("wf", k) for k in ("key:K",))
    return keys, tuple(engine.control_history("wf"))


def _calls(key: object = "key:K", limit: object = 2, by: object = "", reason: object = "") -> list[Callable[[], Any]]:
    def call(method: str, *args: object) -> Callable[[], Any]:
        return lambda engine: getattr(engine, method)("wf", *args, by=by, reason=reason)

    return [
        call("pause_key", key),
        call("resume_key", key),
        call("override_limit", key, limit),
        call("pause_workflow"),
        call("override_workflow_limit", limit),
    ]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_bad_key_is_refused_and_writes_nothing(controlled: Engine, key: object) -> None:
    """Section 7, K2, R1: a key that no column can hold (empty, NUL, a control
    character, a lone surrogate, too long, not a str) is a ValidationError from
    every per-key control and from the reads, and nothing is written."""
    before = _written(controlled)
    for call in _calls(key=key)[:3]:
        with pytest.raises(ValidationError):
            call(controlled)
    with pytest.raises(ValidationError):
        controlled.key_controls("wf", key)  # type: ignore[arg-type]
    if key is not None:
        with pytest.raises(ValidationError):
            controlled.control_history("wf", key)  # type: ignore[arg-type]
    assert _written(controlled) == before


@pytest.mark.parametrize("field", ["by", "reason"])
@pytest.mark.parametrize("text", BAD_TEXT, ids=repr)
def test_a_bad_author_or_reason_is_refused_and_writes_nothing(controlled: Engine, field: str, text: str) -> None:
    """Section 7, K2: NUL, a control character or a lone surrogate in ``by`` or
    ``reason`` is a ValidationError from every control, and nothing is written
    (tabs and newlines are allowed: a reason is free text)."""
    before = _written(controlled)
    for call in _calls(**{field: text}):
        with pytest.raises(ValidationError):
            call(controlled)
    assert _written(controlled) == before
    controlled.pause_key("wf", "key:K", **{field: "line one\n\tline two"})
    assert controlled.control_history("wf", "key:K")[0].__dict__[field] == "line one\n\tline two"


@pytest.mark.parametrize("field,length", [("by", 151), ("reason", 1001)])
def test_an_overlong_author_or_reason_is_refused(controlled: Engine, field: str, length: int) -> None:
    """Section 7, K2: ``by`` holds 150 characters, ``reason`` 1000."""
    before = _written(controlled)
    with pytest.raises(ValidationError, match=field):
        controlled.pause_key("wf", "key:K", **{field: "x" * length})
    assert _written(controlled) == before


@pytest.mark.parametrize("limit", BAD_LIMITS, ids=repr)
def test_a_limit_override_out_of_range_is_refused_and_writes_nothing(controlled: Engine, limit: object) -> None:
    """Section 7, K2: an override is a whole number from 1 to 2**31 - 1 (the
    column of every database), or None; anything else is a ValidationError
    from the per-key and the workflow-wide override, and nothing is written."""
    before = _written(controlled)
    for call in _calls(limit=limit)[2::2]:
        with pytest.raises(ValidationError, match="limit override"):
            call(controlled)
    assert _written(controlled) == before
    state = controlled.override_limit("wf", "key:K", 2**31 - 1)
    assert state.limit == 2**31 - 1 and controlled.key_controls("wf", "key:K").limit_override == 2**31 - 1


@pytest.mark.parametrize("limit", BAD_HISTORY_LIMITS, ids=repr)
def test_a_history_limit_out_of_range_is_refused(controlled: Engine, limit: object) -> None:
    """Section 7, K2: ``control_history(limit=)`` is a whole number from 1 to
    10,000; a huge one gave a database error (LIMIT beyond bigint)."""
    with pytest.raises(ValidationError, match="limit"):
        controlled.control_history("wf", "key:K", limit=limit)  # type: ignore[arg-type]
    assert controlled.control_history("wf", limit=10_000) == []
