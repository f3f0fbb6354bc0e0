"""A lease-fenced write of the Django store's ORM path that meets a named transient error
is retried, not handed to the engine as a store that failed (SPEC section 7, R5a, R4).

A deadlock or a lock wait timeout rolls the statement back, so the store retries it
(:meth:`DjangoStore._retrying`); the claims and the settles with a slot to hand off always
did. A keyless run's settle (the compare-and-set alone), a park and a step's write did not:
a deadlock with a racing claim of the same run (three turns of a run whose lease expired,
MariaDB, two CI runs side by side) reached the engine as "the store failed around the
body", and the run whose body had completed was handed back ``pending`` to run again.

Here another connection holds the run's row (SQLite: the database's write lock) for
1.5 s while this connection waits at most 1 s for a lock: the first try of the write
fails with the database's lock timeout, a later one succeeds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, connections, transaction

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.records import StepRecord
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from tests.helpers import claim

pytestmark = pytest.mark.django_db(transaction=True)

HOLD_SECONDS = 1.5

#: This connection's lock wait of 1 s, and the statement that puts it back, per database.
LOCK_WAIT = {
    "postgresql": ("SET lock_timeout = '1s'", "RESET lock_timeout"),
    "mysql": ("SET SESSION innodb_lock_wait_timeout = 1", "SET SESSION innodb_lock_wait_timeout = DEFAULT"),
    "sqlite": ("PRAGMA busy_timeout = 1000", "PRAGMA busy_timeout = 30000"),
}


@contextmanager
def _short_lock_wait() -> Iterator[None]:
    wait, reset = LOCK_WAIT[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(wait)
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(reset)


@contextmanager
def _row_held(run_id: str) -> Iterator[None]:
    """Another connection (a thread's own) holds ``run_id``'s row for HOLD_SECONDS
    (SQLite: a write transaction, which holds the whole database)."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                if connection.vendor == "sqlite":
                    Run.objects.filter(pk=run_id).update(park_reason="held")
                else:
                    Run.objects.select_for_update().filter(pk=run_id).values_list("pk", flat=True).first()
                held.set()
                done.wait(HOLD_SECONDS)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(60), "the other connection never took the row"
    timer = threading.Timer(HOLD_SECONDS, done.set)
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.cancel()
        thread.join(60)


def _claimed(registry: Registry) -> tuple[Engine, Any]:
    registry.add("plain", "1", lambda ctx, i: None)
    engine = make_engine(DjangoStore(raw_sql=False), registry=registry)
    engine.start("plain", {}, run_id="r")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    turn = claim(engine, "r", owner="me")
    assert turn.state is TurnState.RUN and turn.run is not None
    return engine, turn.run


def _settle(engine: Engine, run: Any) -> None:
    done = engine.store.finish(run, "me", RunStatus.COMPLETED, output={"ok": 1}, limits={})
    assert done.run is not None and done.run.status == RunStatus.COMPLETED
    assert Run.objects.get(pk="r").status == RunStatus.COMPLETED


def _park(engine: Engine, run: Any) -> None:
    assert engine.store.park("r", "me", RunStatus.SUSPENDED, wake_at=None, reason="waiting") == "parked"
    assert Run.objects.get(pk="r").status == RunStatus.SUSPENDED


def _save_step(engine: Engine, run: Any) -> None:
    now = datetime.now(UTC)
    assert engine.store.save_step("r", "me", StepRecord(0, "fetch", {"n": 1}, now, now)) is True
    assert Run.objects.get(pk="r").step_count == 1


def _cancel(engine: Engine, run: Any) -> None:
    cancelled = engine.store.request_cancel("r", limits={})
    assert cancelled is not None
    assert Run.objects.get(pk="r").cancel_requested is True


def _signal(engine: Engine, run: Any) -> None:
    assert engine.store.add_signal("r", "go", {"n": 1}, signal_id="s1") is not None
    assert [s.name for s in engine.store.load_signals("r")] == ["go"]


def _timeout_cancel(engine: Engine, run: Any) -> None:
    assert engine.store.request_timeout_cancel("r") is True
    assert Run.objects.get(pk="r").cancel_requested is True


WRITES: dict[str, Callable[[Engine, Any], None]] = {
    "settle": _settle,
    "park": _park,
    "save_step": _save_step,
    "cancel": _cancel,
    "signal": _signal,
    "timeout_cancel": _timeout_cancel,
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_that_waits_past_its_lock_timeout_is_retried(registry: Registry, write: str) -> None:
    """Section 7, R5a, R4, R6, D2: a keyless run's settle, a park, a step's write, a
    cancel of the running run (the user's and the timeout's) and a signal to it meet
    the database's lock timeout once (another connection holds the run's row for
    1.5 s, this one waits 1 s) and succeed on a retry, written once. Before, each
    raised the OperationalError to its caller."""
    engine, run = _claimed(registry)
    with _short_lock_wait(), _row_held("r"):
        WRITES[write](engine, run)


def test_a_retry_of_a_failed_run_that_waits_past_its_lock_timeout_is_retried(registry: Registry) -> None:
    """Section 7, R5a: the reset of a failed run for a retry (``durable_retry``, the
    admin's action) meets the lock timeout once and succeeds on a retry: the run is
    pending again, once. Before, the OperationalError reached the caller."""
    engine, run = _claimed(registry)
    done = engine.store.finish(run, "me", RunStatus.FAILED, error={"type": "E"}, limits={})
    assert done.run is not None and done.run.status == RunStatus.FAILED
    with _short_lock_wait(), _row_held("r"):
        reset = engine.store.reset_for_retry("r", 0.0, None)
    assert reset is not None and reset.status == RunStatus.PENDING
    assert Run.objects.get(pk="r").status == RunStatus.PENDING
