"""The SQLite room's statements build no index while they run (issue 33's claim cost, X6, S5).

A statement that looks one run up in one of its small materialized tables (a waiter's place
among the throttle key's first waiters, among its singleton key's waiters, its token) probes
it once. Left to itself SQLite builds an automatic index on the table for that one probe,
which costs more than a scan of it: the throttled claim spent about a tenth of its time
building three of them (``python -m bench.throttle``'s claim). Each such probe is written
``+alias.run_id = ...``, and ``EXPLAIN QUERY PLAN`` of every statement of the room shows no
``AUTOMATIC`` index. The plans do not depend on the parameters' values, so each statement is
explained with every parameter NULL.
"""

from __future__ import annotations

import re

import pytest
from django.db import connection

from durable_singleton.stores import sqlite as lite

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's query plans"),
]

#: Each statement of the room that reads (bump_token is an INSERT ... VALUES: no plan).
STATEMENTS = {
    "start": lite.START,
    "claim": lite.CLAIM,
    "take": lite.TAKE,
    "settle": lite.SETTLE,
    "finish": lite.FINISH,
    "claim_throttled": lite.CLAIM_THROTTLED,
    "record_throttle_admission": lite.RECORD_THROTTLE_ADMISSION,
}


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_no_statement_of_the_room_builds_an_automatic_index(name: str) -> None:
    statement = STATEMENTS[name]
    params = dict.fromkeys(re.findall(r"%\((\w+)\)s", statement))
    room = lite.room_of("default", 5.0)
    assert room is not None
    with room._cursor() as cursor:  # the room's cursor: ds_now defined on its connection
        cursor.execute("EXPLAIN QUERY PLAN " + statement, params)
        plan = [row[3] for row in cursor.fetchall()]
    assert plan, name
    built = [line for line in plan if "AUTOMATIC" in line]
    assert not built, f"{name} builds {built}:\n" + "\n".join(plan)
