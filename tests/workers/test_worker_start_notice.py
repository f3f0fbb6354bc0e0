"""A start under ``DISPATCH = "worker"`` writes its run and its turn notice in one transaction (O1a, O7).

No worker process here: the test process only writes runs, as a web process
does. Commits are counted on the real connection: each ``commit()`` of the
connection, plus each write sent outside a transaction (autocommit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction

from durable_singleton.conf import Settings
from durable_singleton.engine import Engine
from durable_singleton.models import Run, TurnNotice
from durable_singleton.runtime import build_engine

pytestmark = pytest.mark.django_db(transaction=True)

WORKFLOW = "fault-hold"
#: Statements that write (PostgreSQL's fast path sends its start as ``EXECUTE`` of a prepared ``WITH ... INSERT``).
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "WITH", "EXECUTE")


@pytest.fixture
def web() -> Engine:
    """The engine of a process that only writes runs: DISPATCH 'worker', no worker started."""
    return build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}))


@contextmanager
def commits() -> Iterator[list[str]]:
    """Record each commit of this thread's connection: ``"commit"`` for a
    transaction's commit, ``"autocommit: <sql>"`` for a write sent outside one
    (one statement, one commit)."""
    seen: list[str] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if not connection.in_atomic_block and sql.lstrip().upper().startswith(WRITES):
            seen.append(f"autocommit: {sql[:60]}")
        return execute(sql, params, many, context)

    connection.ensure_connection()
    real_commit = connection.commit

    def commit() -> None:
        seen.append("commit")
        real_commit()

    connection.commit = commit  # type: ignore[method-assign]
    try:
        with connection.execute_wrapper(wrapper):
            yield seen
    finally:
        del connection.commit


def test_a_start_commits_its_run_and_its_notice_together(web: Engine) -> None:
    """O1a, O7: outside a caller's transaction a start in "worker" mode is one
    commit, holding both the run row and its turn notice (it was two: the
    run, then the notice in a transaction of its own). On PostgreSQL's fast
    path it is one statement that inserts both (autocommit)."""
    with commits() as seen:
        web.start(WORKFLOW, {"store_id": "one", "seconds": 0}, run_id="one")
    assert len(seen) == 1, seen
    assert list(TurnNotice.objects.values_list("run_id", flat=True)) == ["one"]


def test_start_many_and_signal_with_start_commit_runs_and_notices_together(web: Engine) -> None:
    """O1a, O7, S18: a batch start is one commit for its runs and their
    notices, and so is the start of signal_with_start (its signal is a write
    of its own, after)."""
    with commits() as seen:
        web.start_many(WORKFLOW, [{"store_id": f"m{i}", "seconds": 0} for i in range(3)])
    assert seen == ["commit"], seen
    assert TurnNotice.objects.count() == 3
    with commits() as seen:
        web.signal_with_start(WORKFLOW, {"store_id": "sig", "seconds": 0}, run_id="sig", signal="go")
    assert len(seen) == 2, seen  # the start (run and notice), then the signal
    assert TurnNotice.objects.filter(run_id="sig").exists()


def test_a_rolled_back_caller_transaction_leaves_neither_run_nor_notice(web: Engine) -> None:
    """O1a: inside a caller's atomic block (an ATOMIC_REQUESTS view) the
    start's run and notice join the caller's transaction: rolled back with
    it, they leave nothing; committed with it, both are there."""
    with pytest.raises(RuntimeError), transaction.atomic():
        web.start(WORKFLOW, {"store_id": "rb", "seconds": 0}, run_id="rb")
        web.start_many(WORKFLOW, [{"store_id": "rb2", "seconds": 0}], run_ids=["rb2"])
        assert TurnNotice.objects.count() == 2
        raise RuntimeError("the view failed")
    assert not Run.objects.exists()
    assert not TurnNotice.objects.exists()
    with transaction.atomic():
        web.start(WORKFLOW, {"store_id": "ok", "seconds": 0}, run_id="ok")
    assert list(TurnNotice.objects.values_list("run_id", flat=True)) == ["ok"]


def test_a_transient_error_on_the_notice_retries_the_start_whole(web: Engine) -> None:
    """O1a, section 7: a named transient error ("database is locked") on the
    notice's INSERT (on PostgreSQL, the one statement that writes run and
    notice) rolls back the run row with it, and the store's retry
    starts again: the start returns, with exactly one run and one notice (it
    used to leave the run committed without a notice and raise)."""
    table = TurnNotice._meta.db_table
    failed: list[str] = []

    def fail_once(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        # PostgreSQL's fast path writes the run and its notice in one prepared statement ("..._notice_...").
        notice = table in sql or "_notice_" in sql
        if not failed and notice and sql.lstrip().upper().startswith(("INSERT", "EXECUTE", "WITH")):
            failed.append(sql)
            raise OperationalError("database is locked")
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_once):
        run = web.start(WORKFLOW, {"store_id": "tr", "seconds": 0}, run_id="tr")
    assert failed, "the notice's INSERT was not seen"
    assert run.run_id == "tr"
    assert Run.objects.filter(pk="tr").count() == 1
    assert list(TurnNotice.objects.values_list("run_id", flat=True)) == ["tr"]


def test_a_django_tasks_enqueue_commits_its_run_and_its_notice_together(settings: Any) -> None:
    """O1a, O7: the django.tasks backend's ``enqueue`` starts a run through
    the engine, so under DISPATCH "worker" it too is one commit holding the
    run and its notice."""
    pytest.importorskip("django.tasks", reason="Django 5.2 has no django.tasks (added in Django 6.0)")
    from durable_singleton.runtime import get_engine
    from testproject.inventory import jobs

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}
    assert get_engine().dispatcher.dispatches_in_transaction
    with commits() as seen:
        result = jobs.fail.enqueue("queued")
    assert len(seen) == 1, seen
    assert list(TurnNotice.objects.values_list("run_id", flat=True)) == [result.id]
