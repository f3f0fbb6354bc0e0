"""The MariaDB/MySQL room's start, claim, handoff and confirmation read as many rows at
10,000 waiters as at 10 (S5, S7, S8a, issue 32 item 3), counted by the server's
``Handler_read_*`` session counters, which count every row a statement reads, the
statements inside the procedures included. The PostgreSQL twin explains its plans
(tests/stores/test_depth_independence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus, SlotState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB server's handler read counters"),
]

#: The most rows any of the four steps may read, whatever the depth (a handful of index probes).
BOUND = 60

_DIGIT = " UNION ALL ".join(f"SELECT {d}" + (" AS d" if d == 0 else "") for d in range(10))
#: 0 .. 99,999 without a recursive CTE (MySQL 8 stops one at 1,000 iterations by default).
_NUMBERS = (
    "SELECT a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS i"
    f" FROM ({_DIGIT}) a, ({_DIGIT}) b, ({_DIGIT}) c, ({_DIGIT}) e, ({_DIGIT}) f"
)


def _copy(source: str, count: int, prefix: str) -> None:
    """Insert ``count`` copies of the run ``source``, ids ``prefix`` || n, each a
    microsecond later than the last (a queue of parked waiters behind it)."""
    columns = [f.column for f in Run._meta.concrete_fields]
    values = [
        "CONCAT(%s, n.i)"
        if c == "run_id"
        else "r.created_at + INTERVAL (n.i + 1) MICROSECOND"
        if c == "created_at"
        else f"r.`{c}`"
        for c in columns
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {Run._meta.db_table} ({', '.join(f'`{c}`' for c in columns)})"
            f" SELECT {', '.join(values)} FROM {Run._meta.db_table} r, ({_NUMBERS}) n"
            f" WHERE r.run_id = %s AND n.i < {int(count)}",
            [prefix, source],
        )


def _reads(fn: Callable[[], Any]) -> int:
    """The rows the session's statements read while ``fn`` ran (every ``Handler_read_*``)."""

    def counters() -> dict[str, int]:
        with connection.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Handler_read%%'")
            return {str(k): int(v) for k, v in cursor.fetchall()}

    before = counters()
    fn()
    after = counters()
    return sum(after[k] - before.get(k, 0) for k in after)


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.add("deep", "1", lambda ctx, i: ctx.wait_for_signal("go"), singleton={"key": lambda i: i["k"]})
    made = make_engine(DjangoStore(), registry=registry)
    assert made.store._mysql_room() is not None  # type: ignore[attr-defined]
    made.now()
    return made


def _steps(engine: Engine, depth: int) -> dict[str, int]:
    """A key with a parked holder and ``depth`` parked waiters; the rows read by a new
    waiter's start and claim (parked at the back), the holder's settle and handoff, and
    the confirmation of the waiter it admitted."""
    key = f"deep-{depth}"
    holder, first, tail = f"{key}-holder", f"{key}-first", f"{key}-tail"
    engine.start("deep", {"k": key}, run_id=holder)
    engine.execute(holder)
    engine.start("deep", {"k": key}, run_id=first)
    engine.execute(first)
    _copy(first, depth - 2, f"{key}-waiter-")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE TABLE {Run._meta.db_table}")
        cursor.fetchall()
    reads = {
        "start": _reads(lambda: engine.start("deep", {"k": key}, run_id=tail)),
        "claim": _reads(lambda: engine.execute(tail)),
    }
    assert Run.objects.filter(singleton_key=key, singleton_slot=SlotState.WAITER).count() == depth
    engine.signal(holder, "go", 1)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    reads["handoff"] = _reads(lambda: engine.execute(holder))
    assert Run.objects.get(pk=first).singleton_slot == SlotState.HOLDER  # the oldest waiter (S5)
    reads["confirmation"] = _reads(lambda: engine.execute(first))
    assert Run.objects.get(pk=holder).status == RunStatus.COMPLETED
    assert Run.objects.get(pk=first).status == RunStatus.SUSPENDED  # waiting for its signal, with its slot
    return reads


def test_the_rooms_steps_read_as_many_rows_at_ten_thousand_waiters_as_at_ten(engine: Engine) -> None:
    """S5, S7, S8a, #32: on MariaDB a start behind a deep queue, a waiter's claim
    (``ds_claim``), a holder's settle and handoff (``ds_settle_handoff``) and the
    confirmation of the waiter it admitted (``ds_take_lease``) read a bounded number of
    rows: the same at 10 and at 10,000 waiters, each under ``BOUND``."""
    shallow = _steps(engine, 10)
    deep = _steps(engine, 10_000)
    assert all(deep[step] <= BOUND for step in deep), deep
    assert all(deep[step] <= shallow[step] + 5 for step in deep), (shallow, deep)
