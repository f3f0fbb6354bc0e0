"""Hostile-input fuzzing with hypothesis (issue #12 item 4; SPEC section 7, R1, R3, S1, S15, D2).

Every call with generated input either succeeds and what it stored reads
back equal, or raises a typed exception from ``durable_singleton.exceptions``
and writes nothing (row counts of every table compared before and after).
Runs on the database named by DATABASE_URL (SQLite, PostgreSQL, MariaDB)
with real commits. The number of inputs tried is printed at the end of the
module (``pytest -s`` or the terminal summary).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.urls import reverse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_singleton import exceptions
from durable_singleton.admission import RESERVED_TAGS
from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry, Singleton
from durable_singleton.engine import Engine
from durable_singleton.models import Run, Signal, SingletonKey, Step
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.django_db(transaction=True)

TRIED: Counter[str] = Counter()
_UNIQUE = itertools.count(1)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Text as hostile as Python strings get: NUL and other controls, lone
# surrogates, whitespace only, astral characters, very long.
hostile_text = st.one_of(
    st.text(max_size=40),
    st.text(st.characters(codec=None, categories=None), max_size=40),
    st.sampled_from(
        [
            "",
            " ",
            "\t\n",
            "\x00",
            "a\x00b",
            "\ud800",
            "x\udfff",
            "\u200b",
            "\ufeff",
            "😀" * 3,
            "'; DROP TABLE x; --",
            "durable:singleton:admitted",
        ]
    ),
    st.integers(150, 400).map(lambda n: "k" * n),
    st.text(min_size=1, max_size=5).map(lambda t: t * 60),
)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    hostile_text,
)
json_like = st.recursive(
    json_leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(hostile_text, children, max_size=4), st.tuples(children)
    ),
    max_leaves=20,
)
not_json = st.one_of(
    st.binary(max_size=8),
    st.sets(st.integers(), max_size=3),
    st.builds(object),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


inputs = st.one_of(json_like, not_json)


def _counts() -> dict[str, int]:
    return {m.__name__: m.objects.count() for m in (Run, Step, Signal, SingletonKey)}


def _json_round_trip(value: Any) -> Any:
    return json.loads(json.dumps(value, allow_nan=False))


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: floats compared with their stored precision."""
    try:
        if json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True):
            return True
    except RecursionError:
        return repr(a) == repr(b)
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b, rel_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _storable(value: Any, max_bytes: int = 1_000_000) -> bool:
    """The contract's oracle for a JSON input or payload (section 7): JSON
    without NaN or infinities, no NUL and no lone surrogate, nested at most
    30 levels (MAX_JSON_DEPTH), at most ``max_bytes`` encoded (MAX_INPUT_BYTES)."""

    def depth(node: Any) -> int:
        if isinstance(node, dict):
            return 1 + max((depth(v) for v in node.values()), default=0)
        if isinstance(node, list | tuple):
            return 1 + max((depth(v) for v in node), default=0)
        return 0

    try:
        if depth(value) > 30:
            return False
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError):
        return False
    return size <= max_bytes and "\x00" not in text and "\\u0000" not in text


def attempt(kind: str, call: Callable[[], Any], check: Callable[[Any], None], *, valid: bool | None = None) -> None:
    """Run ``call``; on success run ``check`` on its result; on a typed error
    assert nothing was written. Any other exception fails the test. With
    ``valid`` given (the contract's verdict on the input), a valid input that
    is refused, or an invalid one that is accepted, fails the test too."""
    TRIED[f"{kind}:{connection.vendor}"] += 1
    before = _counts()
    try:
        result = call()
    except exceptions.DurableSingletonError as exc:
        assert _counts() == before, f"{kind}: a refused call wrote rows"
        assert valid is not True, f"{kind}: valid input refused: {exc!r}"
        return
    assert valid is not False, f"{kind}: invalid input accepted"
    check(result)


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = "fuzz inputs tried: " + ", ".join(f"{k}={v}" for k, v in sorted(TRIED.items()))
    line += f"; total={sum(TRIED.values())}"
    if reporter is not None:
        reporter.write_line(line)
    print(line)


@pytest.fixture
def fz() -> Engine:
    registry = Registry()
    engine = make_engine("django", registry=registry)

    def body(ctx: Any, input: Any) -> Any:
        return input

    registry.add("fz-plain", "1", body, events=["fz-event"])
    registry.add("fz-key", "1", body, singleton=Singleton(key=lambda i: i["k"], limit=1))
    registry.add("fz-capped", "1", body, singleton=Singleton(key=lambda i: i["k"], limit=1, max_queue_depth=1))
    return engine


@FUZZ
@given(key=st.one_of(hostile_text, st.integers(), st.none(), st.lists(st.text(), max_size=2)))
def test_keys(fz: Engine, key: Any) -> None:
    """S1, section 7: a key function's result is stored and read back equal, or
    refused with SingletonKeyError and no row; capped starts too (S15)."""
    for name in ("fz-key", "fz-capped"):

        def check(run: Any, name: str = name) -> None:
            stored = fz.get(run.run_id)
            assert stored.singleton_key == key
            assert f"singleton:{key}" in stored.tags

        attempt(f"key-{name}", lambda name=name: fz.start(name, {"k": key}), check)


@FUZZ
@given(value=inputs)
def test_inputs(fz: Engine, value: Any) -> None:
    """Section 7: an input is stored and reads back equal (as JSON), or
    InvalidInputError and no row; so is a signal payload (D2)."""

    def check(run: Any) -> None:
        assert _same(fz.get(run.run_id).input, _json_round_trip(value))

    attempt("input", lambda: fz.start("fz-plain", value), check, valid=_storable(value))
    target = fz.start("fz-plain", None)

    def check_signal(_: Any) -> None:
        stored = fz.store.load_signals(target.run_id)[-1]
        assert stored.name == "s" and _same(stored.payload, _json_round_trip(value))

    attempt("signal-payload", lambda: fz.signal(target.run_id, "s", value), check_signal, valid=_storable(value))


@FUZZ
@given(depth=st.integers(0, 20), size=st.sampled_from([0, 1, 999_000, 1_000_001, 3_000_000]))
def test_huge_inputs(fz: Engine, depth: int, size: int) -> None:
    """Section 7: a huge input is stored and read back, or InvalidInputError
    (MAX_INPUT_BYTES, 1 MB by default) and no row."""
    value = {"blob": "x" * size, "deep": _nested(depth)}

    def check(run: Any) -> None:
        assert _same(fz.get(run.run_id).input, value)

    attempt("input-huge", lambda: fz.start("fz-plain", value), check, valid=_storable(value))


@settings(FUZZ, max_examples=30, report_multiple_bugs=False)
@given(depth=st.integers(31, 5000))
def test_deeply_nested_inputs(fz: Engine, depth: int) -> None:
    """Section 7: a deeply nested input is stored and read back, or
    InvalidInputError and no row (nesting past MAX_JSON_DEPTH is refused on
    every database: found by this test as an IntegrityError on MariaDB and a
    RecursionError on insert or read everywhere)."""
    value = _nested(depth)

    def check(run: Any) -> None:
        assert _same(fz.get(run.run_id).input, value)

    attempt("input-deep", lambda: fz.start("fz-plain", value), check, valid=_storable(value))


@FUZZ
@given(run_id=st.one_of(hostile_text, st.integers(), st.none(), st.binary(max_size=4)))
def test_run_ids(fz: Engine, run_id: Any) -> None:
    """R1, R3: a run id is stored and found again, or InvalidRunIdError and no
    row; get, cancel and signal of any id return or raise RunNotFoundError."""

    def check(run: Any) -> None:
        if run_id is None:
            return
        assert run.run_id == run_id
        assert fz.get(run_id).run_id == run_id
        assert fz.start("fz-plain", 1, run_id=run_id).run_id == run_id  # idempotent (R3)

    attempt("run-id-start", lambda: fz.start("fz-plain", 1, run_id=run_id), check)
    for verb, call in (
        ("get", lambda: fz.get(run_id)),
        ("cancel", lambda: fz.cancel(run_id)),
        ("signal", lambda: fz.signal(run_id, "s", 1)),
    ):
        attempt(f"run-id-{verb}", call, lambda run: None)


@FUZZ
@given(tags=st.one_of(st.lists(hostile_text, max_size=4), hostile_text, st.none(), st.lists(st.integers(), max_size=2)))
def test_tags(fz: Engine, tags: Any) -> None:
    """R1, S12: caller tags are stored and read back (reserved markers
    stripped), or ValidationError and no row."""

    def check(run: Any) -> None:
        stored = fz.get(run.run_id).user_tags
        expected = [t for t in dict.fromkeys(tags) if t not in RESERVED_TAGS]
        assert list(stored) == expected

    attempt("tags", lambda: fz.start("fz-plain", 1, tags=tags), check)


@FUZZ
@given(
    event=st.one_of(st.just("fz-event"), hostile_text),
    event_id=st.one_of(st.none(), hostile_text),
    payload=json_like,
)
def test_events(fz: Engine, event: Any, event_id: Any, payload: Any) -> None:
    """D8, R3: an event starts its subscribers with the payload stored, once
    per event id, or raises a typed error and writes nothing."""
    if event_id is not None:
        event_id = f"{next(_UNIQUE)}{event_id}"  # unique per example: an id seen before returns its runs (R3)

    def check(runs: Any) -> None:
        for run in runs:
            assert _same(fz.get(run.run_id).input, _json_round_trip(payload))
        if event_id is not None:
            assert [r.run_id for r in fz.emit(event, payload, event_id=event_id)] == [r.run_id for r in runs]

    attempt("emit", lambda: fz.emit(event, payload, event_id=event_id), check)


@FUZZ
@given(run_id=hostile_text, signal=hostile_text, namespace=st.one_of(st.none(), hostile_text))
def test_signal_with_start_and_namespaces(fz: Engine, run_id: str, signal: str, namespace: Any) -> None:
    """S18, D10: signal_with_start and a start in a namespace store what they
    were given, or raise a typed error and write nothing."""

    def check_sws(run: Any) -> None:
        assert fz.get(run_id).run_id == run_id
        assert fz.store.load_signals(run_id)[-1].name == signal

    attempt("signal-with-start", lambda: fz.signal_with_start("fz-plain", 1, run_id=run_id, signal=signal), check_sws)

    def check_ns(run: Any) -> None:
        assert fz.get(run.run_id).namespace == (namespace if namespace is not None else fz.namespace)

    attempt("namespace", lambda: fz.start("fz-plain", 1, namespace=namespace), check_ns)


@FUZZ
@given(run_ids=st.lists(st.one_of(st.none(), hostile_text), min_size=1, max_size=4))
def test_start_many_run_ids(fz: Engine, run_ids: list[Any]) -> None:
    """R1, R3, S15: a bulk start stores every run under its id (duplicates
    deduped), or raises a typed error and writes nothing."""

    def check(results: Any) -> None:
        for run_id, result in zip(run_ids, results, strict=True):
            assert not isinstance(result, BaseException)
            if run_id is not None:
                assert result.run_id == run_id and fz.get(run_id).run_id == run_id

    attempt("start-many", lambda: fz.start_many("fz-plain", [1] * len(run_ids), run_ids=run_ids), check)


@FUZZ
@given(name=st.one_of(hostile_text, st.integers(), st.none()))
def test_signal_names(fz: Engine, name: Any) -> None:
    """D2: a signal name is stored and read back, or ValidationError and no row."""
    target = fz.start("fz-plain", None)

    def check(_: Any) -> None:
        assert fz.store.load_signals(target.run_id)[-1].name == name

    attempt("signal-name", lambda: fz.signal(target.run_id, name, 1), check)


scalar = st.one_of(st.integers(-3, 3), st.none(), st.booleans(), st.floats(), st.text(max_size=3))


@FUZZ
@given(
    name=hostile_text,
    version=st.one_of(hostile_text, st.integers()),
    key=st.one_of(st.just(lambda i: "k"), scalar),
    limit=scalar,
    depth=scalar,
    timeout=st.one_of(scalar, st.floats(min_value=-1, max_value=1e12)),
)
def test_declarations(name: Any, version: Any, key: Any, limit: Any, depth: Any, timeout: Any) -> None:
    """Section 7: a declaration is registered or refused with
    InvalidWorkflowError naming the workflow and the field."""
    TRIED[f"declaration:{connection.vendor}"] += 1
    registry = Registry()
    try:
        registry.add(
            name,
            version,
            lambda ctx, i: i,
            singleton=Singleton(key=key, limit=limit, max_queue_depth=depth),
            timeout=timeout,
        )
    except exceptions.InvalidWorkflowError:
        return
    definition = registry.get(name, version)
    assert definition.singleton is not None and definition.singleton.limit == limit


setting_names = st.sampled_from(
    [
        "LEASE_SECONDS",
        "LEASE_RENEW_SECONDS",
        "TICK_BATCH",
        "MAX_RECOVERIES",
        "MAX_INPUT_BYTES",
        "STORE",
        "DISPATCH",
        "NAMESPACE",
        "REDELIVERY_SECONDS",
        "ADMISSION_RETRY_SECONDS",
        "NOT_A_SETTING",
    ]
)


@FUZZ
@given(overrides=st.dictionaries(setting_names, st.one_of(scalar, hostile_text, st.floats()), max_size=3))
def test_settings(overrides: dict[str, Any]) -> None:
    """Section 7: settings are accepted or refused with ConfigurationError."""
    TRIED[f"settings:{connection.vendor}"] += 1
    try:
        conf = Settings.from_mapping(overrides)
    except exceptions.ConfigurationError:
        return
    for name, value in overrides.items():
        assert getattr(conf, name) == value or (value != value)  # NaN


@pytest.fixture
def admin_client() -> Client:
    user = User.objects.create_superuser("fuzz", "fuzz@example.com", "x")
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return client


@FUZZ
@given(
    params=st.lists(
        st.tuples(
            st.sampled_from(["q", "o", "p", "status", "workflow", "key", "e", "all", "singleton_key", "_changelist"]),
            hostile_text,
        ),
        max_size=3,
    ),
    page=st.sampled_from(["run_changelist", "run_queues", "run_queue_key"]),
)
def test_admin_query_strings(admin_client: Client, params: list[tuple[str, str]], page: str) -> None:
    """Section 6: the admin answers any query string without a server error."""
    TRIED[f"admin:{connection.vendor}"] += 1
    query = urlencode([(k, v.encode("utf-8", "surrogatepass")) for k, v in params])
    response = admin_client.get(f"{reverse('admin:durable_singleton_' + page)}?{query}")
    assert response.status_code < 500, (page, params, response.status_code)


def test_nesting_up_to_the_limit_is_stored_and_deeper_is_refused(fz: Engine) -> None:
    """Section 7: MAX_JSON_DEPTH levels are stored and read back on every database; one more is refused."""
    from durable_singleton.context import MAX_JSON_DEPTH

    deepest = _nested(MAX_JSON_DEPTH - 1)  # MAX_JSON_DEPTH lists
    run = fz.start("fz-plain", {"deep": _nested(MAX_JSON_DEPTH - 2)})
    assert _same(fz.get(run.run_id).input, {"deep": _nested(MAX_JSON_DEPTH - 2)})
    assert _same(fz.get(fz.start("fz-plain", deepest).run_id).input, deepest)
    with pytest.raises(exceptions.InvalidInputError):
        fz.start("fz-plain", [deepest])
