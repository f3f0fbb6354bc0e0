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

from durable_singleton.engine import Engine
from tests.stores.deep_queue import deep_engine, measured_steps

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB server's handler read counters"),
]

#: The most rows any of the four steps may read, whatever the depth (a handful of index probes).
BOUND = 60


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
    made = deep_engine()
    assert made.store._mysql_room() is not None  # type: ignore[attr-defined]
    return made


def test_the_rooms_steps_read_as_many_rows_at_ten_thousand_waiters_as_at_ten(engine: Engine) -> None:
    """S5, S7, S8a, #32: on MariaDB a start behind a deep queue, a waiter's claim
    (``ds_claim``), a holder's settle and handoff (``ds_settle_handoff``) and the
    confirmation of the waiter it admitted (``ds_take_lease``) read a bounded number of
    rows: the same at 10 and at 10,000 waiters, each under ``BOUND``."""
    shallow = measured_steps(engine, 10, _reads)
    deep = measured_steps(engine, 10_000, _reads)
    assert all(deep[step] <= BOUND for step in deep), deep
    assert all(deep[step] <= shallow[step] + 5 for step in deep), (shallow, deep)
