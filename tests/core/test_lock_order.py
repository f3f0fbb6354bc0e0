"""The lock order of every path, the key's row in ``SingletonKey`` first, then
run rows (docs/design.rst, S13, S9), holds for deleting a run too: the store's
``delete_run`` and the admin's delete view (through ``Run.delete``, whose
release of the freed slot locks the key, F12). Regression of #16: both locked
the run's row first, then the key's, so a racing claim of the key could deadlock
with them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.urls import reverse
from django.utils import timezone

from durable_singleton.models import Run, SingletonKey
from durable_singleton.stores.django import DjangoStore
from tests.conftest import vendor
from tests.factories import bulk_queue

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def _statements() -> Iterator[list[str]]:
    """Record the SQL this thread's connection sends."""
    sent: list[str] = []

    def record(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield sent


def _first(sent: list[str], table: str, *verbs: str) -> int:
    """Index of the first statement on ``table`` that locks a row (one of ``verbs``)."""
    for n, sql in enumerate(sent):
        upper = sql.upper()
        if table.upper() in upper and any(v in upper for v in verbs):
            return n
    raise AssertionError(f"no statement locks a row of {table}: {sent}")


def _assert_key_then_run(sent: list[str]) -> None:
    key_lock = _first(sent, SingletonKey._meta.db_table, "FOR UPDATE", "UPDATE ", "INSERT")
    run_lock = _first(sent, Run._meta.db_table, "FOR UPDATE", "DELETE")
    assert key_lock < run_lock, f"the run's row was locked before the key's: {sent[run_lock]!r}"


def test_delete_run_locks_the_key_row_then_the_run_row() -> None:
    """Lock order (docs/design.rst), F12: DjangoStore.delete_run of an active holder
    locks its key's row before its own; the slot is freed and granted."""
    bulk_queue(["K"], holders=1, waiters=1, finished=0)
    store = DjangoStore()
    with _statements() as sent:
        assert store.delete_run("wf-K-0") is not None
    _assert_key_then_run(sent)
    assert Run.objects.get(pk="wf-K-1").singleton_slot == "holder"


def test_the_admin_delete_view_locks_the_key_row_then_the_run_row(admin_client: Any) -> None:
    """Lock order (docs/design.rst), F12: the admin's delete view of an active holder
    locks its key's row before the DELETE of its row; the slot is freed and granted."""
    bulk_queue(["K"], holders=1, waiters=1, finished=0)
    url = reverse("admin:durable_singleton_run_delete", args=["wf-K-0"])
    with _statements() as sent:
        response = admin_client.post(url, {"post": "yes"})
    assert response.status_code == 302
    assert not Run.objects.filter(pk="wf-K-0").exists()
    _assert_key_then_run(sent)
    assert Run.objects.get(pk="wf-K-1").singleton_slot == "holder"


def _lock_waiters() -> int:
    """How many other connections wait for a row lock now (MariaDB: run a statement
    that has not returned), seen from this thread's connection."""
    sql = {
        "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'",
        # The claim is idle (Sleep) in its transaction: a statement still running is the delete's, waiting.
        "mysql": "SELECT count(*) FROM information_schema.PROCESSLIST WHERE COMMAND = 'Query' "
        "AND ID <> CONNECTION_ID() AND DB = DATABASE()",
    }[vendor()]
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return int(cursor.fetchone()[0])


@pytest.mark.races
@pytest.mark.parametrize("how", ["store", "admin"])
def test_a_delete_racing_a_claim_of_its_key_never_deadlocks(how: str) -> None:
    """Lock order (docs/design.rst), S13, S9: a settle holds the key's lock and then
    writes its holder's row while a delete of that holder runs: the delete
    waits for the key, the settle's write goes through, then the delete; neither
    fails (with the run's row locked first, the settle's write and the delete's
    key lock waited for each other: a deadlock, 40P01 / 1213)."""
    if vendor() not in ("postgresql", "mysql"):
        pytest.skip("SQLite has no row locks: its write lock serializes the two")
    bulk_queue(["K"], holders=1, waiters=1, finished=0)
    SingletonKey.objects.create(workflow_name="wf", key="K")
    store = DjangoStore()
    key_locked, write_now = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            with transaction.atomic():
                store.lock_key("wf", "K")
                key_locked.set()
                assert write_now.wait(30)
                # The claim settles the holder the delete is after (finish: key, then run).
                Run.objects.filter(pk="wf-K-0").update(updated_at=timezone.now())
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    def delete() -> None:
        try:
            assert key_locked.wait(30)
            if how == "store":
                store.delete_run("wf-K-0")
            else:
                Run.objects.get(pk="wf-K-0").delete()  # what the admin's delete view does
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claim), threading.Thread(target=delete)]
    for t in threads:
        t.start()
    assert key_locked.wait(30)
    deadline = time.monotonic() + 30
    while _lock_waiters() == 0:  # the delete waits for a lock the claim holds
        assert time.monotonic() < deadline, f"the delete never waited for the claim's lock: {errors}"
        time.sleep(0.05)
    write_now.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    assert errors == []
    assert not Run.objects.filter(pk="wf-K-0").exists()
