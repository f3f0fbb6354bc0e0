"""Dropping a broken connection never drops a healthy one.

Found by the breaker of issue #12: ``DjangoStore.discard_broken_connection``
(called before each turn, each tick job and the heartbeat) used Django's
``close_if_unusable_or_obsolete``, which also closes every connection older
than ``CONN_MAX_AGE``. With Django's default ``CONN_MAX_AGE = 0`` every
connection is "obsolete" at once, so each tick opened a new database
connection for each of its jobs (seven per tick and per ticking process), and
each turn of a chain of handoffs opened its own: a connection setup (TCP and
authentication, several milliseconds on PostgreSQL) per job and per turn,
where the method's contract is to drop only a connection an error left
unusable. Django closes obsolete connections between requests and tasks
(``close_old_connections``), which the engine's Celery task already calls.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import connection
from django.db.backends.signals import connection_created

from durable_singleton.definitions import Registry
from durable_singleton.testing import make_engine
from tests.helpers import kill_this_connection

pytestmark = pytest.mark.django_db(transaction=True)


def test_ticks_and_turns_keep_a_healthy_connection(settings: Any) -> None:
    """S8b, O1: three ticks and a chain of three turns on a healthy connection
    open no new connection, whatever CONN_MAX_AGE says (0 here, Django's default)."""
    if connection.vendor == "sqlite":
        pytest.skip("the in-memory SQLite test database is never closed")
    engine = make_engine("django", registry=Registry())
    engine.registry.add("conn", "1", lambda ctx, input: input, singleton={"key": lambda i: "k"})
    runs = [engine.start("conn", n) for n in range(3)]
    connection.settings_dict["CONN_MAX_AGE"] = 0
    connection.close()
    connection.ensure_connection()  # opened with CONN_MAX_AGE = 0: obsolete at once
    opened: list[Any] = []

    def count(sender: Any, connection: Any, **kwargs: Any) -> None:
        opened.append(connection)

    connection_created.connect(count)
    try:
        for _ in range(3):
            assert engine.tick().errors == []
        for run in runs:
            engine.execute(run.run_id)
    finally:
        connection_created.disconnect(count)
    assert [engine.get(r.run_id).status for r in runs] == ["completed"] * 3
    assert opened == [], f"{len(opened)} new connections for 3 ticks and 3 turns on a healthy one"


def test_with_health_checks_a_connection_killed_while_idle_costs_no_tick_job() -> None:
    """S8b, O1: with Django's ``CONN_HEALTH_CHECKS`` on (as the soak runs), a
    connection killed by the server between two ticks (a failover, an idle
    timeout, ``pg_terminate_backend``) is found by the health check before the
    next tick's first query, as Django does at each request: no job of that
    tick fails."""
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no server to kill a connection")
    engine = make_engine("django", registry=Registry())
    engine.registry.add("idle", "1", lambda ctx, input: input, singleton={"key": lambda i: "k"})
    connection.settings_dict["CONN_HEALTH_CHECKS"] = True
    connection.close()
    try:
        assert engine.tick().errors == []
        kill_this_connection()
        time.sleep(0.2)  # the server has closed the idle connection
        assert engine.tick().errors == []
    finally:
        connection.settings_dict["CONN_HEALTH_CHECKS"] = False
        connection.close()
