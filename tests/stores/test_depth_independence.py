"""The claim, the handoff and the start read a bounded number of rows whatever the
depth of the key's queue (S5, S8a, issue 32 item 3).

A key with 10,000 parked waiters behind a parked holder, beside many keys with
about one run each (the statistics a busy table has after a many-keys workload),
then ANALYZE. On PostgreSQL each statement the fast path sends is explained as
it runs (``auto_explain``: analyze, JSON, nested statements) under
``plan_cache_mode = force_generic_plan``, the plan a worker's prepared statement
settles on: no plan node may produce or filter out more than a small number of
rows. Before migration 0014 the claim's queue read went through
``ds_run_legacy_idx`` or the key-only ``ds_run_key_idx`` and sorted every run of
the key (10,001 rows). MariaDB and SQLite are not checked here: their
statements are sent with the key's value and planned with it, never as a
generic plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores import pg
from tests.stores.deep_queue import deep_engine, many_keys

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="EXPLAIN of PostgreSQL's prepared statements"),
]

#: The waiters queued on the deep key, and the other keys with one finished run each.
DEPTH = 10_000
OTHER_KEYS = 20_000
#: The most rows any plan node of a bounded statement may produce or filter out
#: (the front of a queue of limit 1 is 2 rows; a handful of index probes besides).
BOUND = 50

_EXPLAIN_ON = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_format = 'json'",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_level = 'notice'",
    "SET client_min_messages = notice",
    "SET plan_cache_mode = force_generic_plan",
)
_EXPLAIN_OFF = (
    "SET auto_explain.log_min_duration = -1",
    "SET client_min_messages = DEFAULT",
    "SET plan_cache_mode = DEFAULT",
)


def _explained(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run ``fn()`` with every executed statement explained; return the plans (JSON)."""
    import json

    connection.ensure_connection()
    raw = connection.connection
    notes: list[str] = []

    def keep(diagnostic: Any) -> None:
        notes.append(str(diagnostic.message_primary or ""))

    raw.add_notice_handler(keep)
    with connection.cursor() as cursor:
        for sql in _EXPLAIN_ON:
            cursor.execute(sql)
    try:
        fn()
    finally:
        with connection.cursor() as cursor:
            for sql in _EXPLAIN_OFF:
                cursor.execute(sql)
        raw.remove_notice_handler(keep)
    plans = []
    for note in notes:
        head, _, body = note.partition("plan:")
        if head.startswith("duration:") and body.strip():
            plans.append(json.loads(body))
    return plans


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _wide(plans: list[dict[str, Any]]) -> list[str]:
    """The nodes of ``plans`` that produced or filtered out more than ``BOUND`` rows,
    each as its rows, type, index, CTE and conditions."""
    wide = []
    for n, explained in enumerate(plans):
        for node in _nodes(explained["Plan"]):
            rows = int(node.get("Actual Rows", 0)) * max(1, int(node.get("Actual Loops", 1)))
            rows += sum(int(v) for k, v in node.items() if k.startswith("Rows Removed by"))
            if rows > BOUND:
                where = [node.get(k) for k in ("Index Name", "Subplan Name", "Index Cond", "Filter") if node.get(k)]
                wide.append(f"statement {n}: {rows} rows, {node['Node Type']} {where}")
    return wide


def _copy(source: str, count: int, *, run_id: str, key: str | None = None, priority: str = "r.priority") -> None:
    """Insert ``count`` copies of the run ``source``, each a new id (``run_id`` || n)
    and a later ``created_at``, and with ``key`` (|| n) its key if given; ``priority``:
    the SQL of each copy's priority (of n, the copy's number; X8)."""
    columns = list(pg.COLUMNS)
    values = []
    for c in columns:
        if c == "run_id":
            values.append("%s || n::text")
        elif c == "created_at":
            values.append("r.created_at + make_interval(secs => n / 1000.0)")
        elif c == "singleton_key" and key is not None:
            values.append("%s || n::text")
        elif c == "priority":
            values.append(priority)
        else:
            values.append(f"r.{c}")
    params: list[Any] = [run_id] + ([key] if key is not None else []) + [source]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {pg.RUN} ({', '.join(columns)}) SELECT {', '.join(values)}"
            f" FROM {pg.RUN} r, generate_series(1, {int(count)}) n WHERE r.run_id = %s",
            params,
        )


@pytest.fixture
def engine() -> Engine:
    return deep_engine()


def _deep_key(engine: Engine, priorities: str = "r.priority") -> None:
    """The many keys of one finished run each, the deep key's parked holder and
    ``DEPTH`` parked waiters (the last one, ``tail``, created parked), then ANALYZE;
    ``priorities``: the SQL of each copied waiter's priority (X8)."""
    many_keys(engine, OTHER_KEYS)
    # The deep key: a parked holder, a parked waiter copied DEPTH times, then the tail.
    engine.start("deep", {"k": "deep"}, run_id="holder")
    engine.execute("holder")
    engine.start("deep", {"k": "deep"}, run_id="waiter")
    engine.execute("waiter")
    assert Run.objects.get(pk="waiter").singleton_slot == "waiter"
    _copy("waiter", DEPTH - 2, run_id="waiter-", priority=priorities)
    engine.start("deep", {"k": "deep"}, run_id="tail")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {pg.RUN}")
    assert Run.objects.filter(singleton_key="deep", singleton_slot="waiter").count() == DEPTH


def test_the_claim_the_handoff_and_the_start_read_a_bounded_number_of_rows_at_any_depth(engine: Engine) -> None:
    """S5, S8a (issue 32 item 3): with 10,000 waiters on one key and the
    statistics of a busy table, each plan node of the claim (a waiter's first
    turn, parked again behind the holder), the start of one more waiter, and the
    handoff (the holder ends, the oldest waiter is admitted) produces or filters
    out at most ``BOUND`` rows, as the worker's generic plans run them. Fails
    with ``ds_run_legacy_idx`` and with the key-only ``ds_run_key_idx`` (migration 0014 drops the one
    on PostgreSQL and widens the other)."""
    _deep_key(engine)

    claim = _explained(lambda: engine.execute("tail"))
    assert Run.objects.get(pk="tail").status == RunStatus.SUSPENDED
    start = _explained(lambda: engine.start("deep", {"k": "deep"}, run_id="late"))
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.signal("holder", "go", 1)
    handoff = _explained(lambda: engine.execute("holder"))
    assert engine.get("holder").status == RunStatus.COMPLETED
    assert Run.objects.get(pk="waiter").singleton_slot == "holder"

    for name, plans in (("claim", claim), ("start", start), ("handoff", handoff)):
        assert plans, name
        assert not _wide(plans), (name, _wide(plans))


def test_the_reads_stay_bounded_and_the_handoff_admits_by_priority_with_mixed_priorities(engine: Engine) -> None:
    """X8, S5, S8a: the same deep key with its 10,000 waiters spread over seven
    priorities (-3 to 3): the claim, the start of a waiter of priority 5 and the
    handoff still read at most ``BOUND`` rows per plan node (the queue indexes
    carry ``priority DESC``, migration 0019), and the handoff admits the waiter of
    the highest priority, the latest started. Fails without the index change (the
    front is sorted from every run of the key)."""
    _deep_key(engine, priorities="mod(n, 7) - 3")

    claim = _explained(lambda: engine.execute("tail"))
    assert Run.objects.get(pk="tail").status == RunStatus.SUSPENDED
    start = _explained(lambda: engine.start("deep", {"k": "deep"}, run_id="urgent", priority=5))
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    engine.signal("holder", "go", 1)
    handoff = _explained(lambda: engine.execute("holder"))
    assert engine.get("holder").status == RunStatus.COMPLETED
    assert Run.objects.get(pk="urgent").singleton_slot == "holder"
    assert Run.objects.filter(singleton_key="deep", singleton_slot="holder").count() == 1

    for name, plans in (("claim", claim), ("start", start), ("handoff", handoff)):
        assert plans, name
        assert not _wide(plans), (name, _wide(plans))
