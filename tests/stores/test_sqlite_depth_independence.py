"""The SQLite room's start, claim, handoff and confirmation read a bounded number of rows
whatever the depth of the key's queue (S5, S7, S8a, issue 32 item 3), and so does its claim
of a run that carries a throttle, whatever the number of due waiters of its throttle key
(X6c, issue 33).

A key with 10,000 parked waiters behind a parked holder, beside many keys of one finished
run each (the statistics a busy table has after a many-keys workload), then ANALYZE. Every
statement the four steps send is captured as it runs and explained (``EXPLAIN QUERY PLAN``
with its own parameters): the run table is only ever searched through an index, never
scanned nor read whole into a Bloom filter, and a search of a key's runs reads them in the
queue's order (no temporary B-tree sorts them). The virtual machine instructions each step
runs (counted by the connection's progress handler, SQLite's row counter) stay under a bound
far below a read of every run, and about the same at 10 and at 10,000 waiters. The PostgreSQL and
MariaDB twins: tests/stores/test_depth_independence.py, test_mysql_depth_independence.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from bench.depth import analyze, copy_runs
from durable_singleton import Throttle
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run, ThrottleMembership
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.stores.deep_queue import deep_engine, many_keys, measured_steps

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's query plans"),
]

DEPTH = 10_000
OTHER_KEYS = 5_000
RUN = Run._meta.db_table
#: The most virtual machine instructions a step's statements may run at any depth (a step
#: runs about 500 to 3,000; reading every run of the table, 15,000 rows, about 75,000).
OPS_BOUND = 10_000
#: The instructions a step may run at 10,000 waiters beyond its count at 10.
SLACK = 1_000


def _captured(fn: Callable[[], Any]) -> tuple[list[tuple[str, Any]], int]:
    """Run ``fn()``; return the statements it sent with their parameters (transaction
    control left out) and the virtual machine instructions they ran, in hundreds."""
    sent: list[tuple[str, Any]] = []
    steps = [0]

    def keep(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not re.match(r"\s*(BEGIN|COMMIT|ROLLBACK|SAVEPOINT|RELEASE)\b", sql, re.I):
            sent.append((sql, params))
        return execute(sql, params, many, context)

    def tick() -> int:
        steps[0] += 1
        return 0

    connection.ensure_connection()
    connection.connection.set_progress_handler(tick, 100)
    try:
        with connection.execute_wrapper(keep):
            fn()
    finally:
        connection.connection.set_progress_handler(None, 100)
    return sent, steps[0] * 100


def _plan(sql: str, params: Any) -> list[str]:
    """The lines of ``EXPLAIN QUERY PLAN`` of ``sql`` with ``params``, each indented by its depth."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        rows = cursor.fetchall()
    depth = {0: -1}
    lines = []
    for node, parent, _unused, detail in rows:
        depth[node] = depth.get(parent, -1) + 1
        lines.append("  " * depth[node] + detail)
    return lines


def _aliases_of_runs(sql: str) -> set[str]:
    """The names the statement gives the run table (its aliases, and the table's own name)."""
    found = {RUN}
    for alias in re.findall(rf"\b{RUN}\b\s+(?:AS\s+)?([A-Za-z_][A-Za-z_0-9]*)", sql, re.I):
        if alias.upper() not in {"WHERE", "SET", "ON", "INNER", "LEFT", "JOIN", "USING", "ORDER", "GROUP", "LIMIT"}:
            found.add(alias)
    return found


def _unbounded(statements: list[tuple[str, Any]]) -> list[str]:
    """The plan lines that read a key's runs without a bound: a scan of the run table, or a
    search of it whose rows a temporary B-tree sorts (the statement's whole plan given)."""
    bad = []
    for sql, params in statements:
        plan = _plan(sql, params)
        runs = _aliases_of_runs(sql)
        for i, line in enumerate(plan):
            detail = line.strip()
            scanned = re.match(r"(?:SCAN|BLOOM FILTER ON) (\S+)", detail)
            if scanned and scanned.group(1) in runs:
                bad.append(f"{detail}\n" + "\n".join(plan) + f"\n-- {sql[:300]}")
            searched = re.match(r"SEARCH (\S+) USING (?:COVERING )?INDEX (\S+) \((.*)\)", detail)
            if searched and searched.group(1) in runs and "run_id=?" not in searched.group(3):
                indent = len(line) - len(detail)
                siblings: list[str] = []  # the later children of its parent (a shallower line ends them)
                for later in plan[i + 1 :]:
                    depth = len(later) - len(later.lstrip())
                    if depth < indent:
                        break
                    if depth == indent:
                        siblings.append(later.strip())
                if any(s.startswith("USE TEMP B-TREE FOR") and "ORDER BY" in s for s in siblings):
                    bad.append(f"{detail} sorted\n" + "\n".join(plan) + f"\n-- {sql[:300]}")
    return bad


@pytest.fixture
def engine() -> Engine:
    made = deep_engine()
    assert made.store._sqlite_room() is not None  # type: ignore[attr-defined]
    return made


def test_the_rooms_steps_read_a_bounded_number_of_rows_at_any_depth(engine: Engine) -> None:
    """S5, S7, S8a, #32: on SQLite a start behind a deep queue, a waiter's claim (the room's
    ``claim``), a holder's settle and handoff (``finish``) and the confirmation of the waiter
    it admitted (``take``) never scan the run table (nor read it into a Bloom filter) nor
    sort a key's runs, under the statistics of a busy table, and run a bounded number of
    instructions, about as many at 10,000 waiters as at 10. Failed before the claim's
    compare-and-set tested no column of the run alone: once ANALYZE had run, SQLite read
    every run of the table into a Bloom filter at each claim (26,000 instructions at 10
    waiters beside 5,000 keys, 76,000 at 10,000, against 1,100 at both since)."""
    many_keys(engine, OTHER_KEYS)
    shallow = measured_steps(engine, 10, _captured)
    deep = measured_steps(engine, DEPTH, _captured)
    for name, (statements, _ops) in deep.items():
        assert statements, name
        assert not _unbounded(statements), (name, _unbounded(statements))
    ops = {name: (shallow[name][1], deep[name][1]) for name in deep}
    assert all(max(small, big) <= OPS_BOUND and big <= small + SLACK for small, big in ops.values()), ops


def _throttled_claim(engine: Engine, depth: int) -> tuple[list[tuple[str, Any]], int]:
    """A throttle key of 2 an hour, full (two runs admitted), ``depth`` due waiters started
    behind them and one more, ``tail``, then ANALYZE: the statements and instructions of
    the claim of ``tail`` (the room's ``claim_throttled`` parks it until the window opens)."""
    key = f"t-{depth}"
    for name in ("a", "b", "first"):
        engine.start("throttled", {"t": key}, run_id=f"{key}-{name}")
    engine.execute(f"{key}-a")
    engine.execute(f"{key}-b")
    copy_runs(connection, f"{key}-first", depth - 1, run_id=f"{key}-waiter-")
    member = ThrottleMembership._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {member} (run_id, throttle, key, created_at, priority)"
            f" SELECT r.run_id, %s, %s, r.created_at, r.priority FROM {RUN} r WHERE r.run_id LIKE %s",
            ["deep-rate", key, f"{key}-waiter-%"],
        )
    engine.start("throttled", {"t": key}, run_id=f"{key}-tail")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    analyze(connection)
    measured = _captured(lambda: engine.execute(f"{key}-tail"))
    tail = Run.objects.get(pk=f"{key}-tail")
    assert (tail.status, tail.park_reason) == (RunStatus.SUSPENDED, "throttled:deep-rate")
    return measured


def test_a_throttled_claim_reads_a_bounded_number_of_rows_at_any_depth() -> None:
    """X6c, X6d, S5, #33: on SQLite the claim of a run that carries a throttle (the room's
    ``claim_throttled``) behind 10 and 2,000 due waiters of its throttle key, beside 5,000 keys
    of one finished run, under ANALYZE's statistics, never scans the run table (nor reads it
    into a Bloom filter) nor sorts a key's runs, and runs about as many instructions at both
    depths: it reads the key's first ``limit`` due waiters, each run by its key. A join of the
    memberships to their runs, tested on the run alone, had SQLite read every run into a Bloom
    filter (and build an automatic index of the run table) at each claim."""
    registry = Registry()
    registry.add("deep", "1", lambda ctx, i: ctx.wait_for_signal("go"), singleton={"key": lambda i: i["k"]})
    rate = Throttle("deep-rate", key=lambda i: i["t"], limit=2, period=3600)
    registry.add("throttled", "1", lambda ctx, i: None, throttles=[rate])
    engine = make_engine(DjangoStore(), registry=registry)
    many_keys(engine, OTHER_KEYS)
    shallow = _throttled_claim(engine, 10)
    deep = _throttled_claim(engine, 2_000)
    for statements, _ops in (shallow, deep):
        assert any("durable_singleton:claim_throttled" in sql for sql, _ in statements), statements
        assert not _unbounded(statements), _unbounded(statements)
    assert max(shallow[1], deep[1]) <= OPS_BOUND and deep[1] <= shallow[1] + SLACK, (shallow[1], deep[1])
