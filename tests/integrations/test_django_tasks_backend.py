"""The django.tasks backend: Django's ``@task`` functions enqueued as durable
runs, gated per key, their results read through django.tasks' own API.

The tasks are the test project's (testproject/inventory/jobs.py), configured
in its ``TASKS`` setting: ``sync_store`` has limit 1 and max_queue_depth 2 per
store. Turns run on the manual dispatcher (the test drains them) or on the
embedded worker's threads, against the DATABASE_URL database.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import pairwise
from typing import Any

import pytest

pytest.importorskip("django.tasks", reason="Django 5.2 has no django.tasks (added in Django 6.0)")

from django.tasks import TaskResultStatus, task_backends
from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
from django.tasks.signals import task_enqueued, task_finished, task_started

from durable_singleton import SingletonQueueFullError
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import ThreadDispatcher
from durable_singleton.engine import Engine, StoreClock
from durable_singleton.exceptions import InvalidInputError, SingletonKeyError, UnknownWorkflowError
from durable_singleton.identity import process_name
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine
from durable_singleton.tasks_backend import (
    DurableSingletonBackend,
    register_configured_tasks,
    task_workflow_name,
)
from testproject.inventory import jobs
from testproject.inventory.models import BodyAudit
from tests.helpers import manual_default_engine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def manual(settings: Any) -> Engine:
    """The default engine with the manual dispatcher: turns wait for ``drain()``."""
    return manual_default_engine(settings)  # type: ignore[no-any-return]


@pytest.fixture
def embedded(settings: Any) -> Iterator[Engine]:
    """The default engine with the embedded worker (4 threads, a tick every 0.2 s)."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "thread", "TICK_SECONDS": 0.2}
    engine = get_engine()
    dispatcher = engine.dispatcher
    assert isinstance(dispatcher, ThreadDispatcher)
    dispatcher.start()  # as a serving process does (O1); tests never start it by themselves
    yield engine
    dispatcher.stop()


def wait_finished(results: list[Any], seconds: float = 120.0) -> None:
    """Refresh ``results`` until every one is finished, or fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    for result in results:
        while not result.is_finished:
            assert time.monotonic() < deadline, f"task {result.id} is still {result.status}"
            time.sleep(0.05)
            result.refresh()


def test_a_task_is_a_durable_run_gated_per_key_and_its_result_is_read_back(manual: Engine) -> None:
    """Three syncs of one store are accepted and queue behind one holder (S3,
    S5); the fourth is refused with SingletonQueueFullError and writes nothing
    (S15); each result reads READY until run, then SUCCESSFUL with its return
    value, through Task.get_result and TaskResult.refresh."""
    results = [jobs.sync_store.enqueue("A") for _ in range(3)]
    assert [r.status for r in results] == [TaskResultStatus.READY] * 3
    with pytest.raises(SingletonQueueFullError) as refused:
        jobs.sync_store.enqueue("A")
    assert refused.value.key == "store:A" and refused.value.max_queue_depth == 2
    runs = Run.objects.filter(workflow_name=task_workflow_name(jobs.sync_store))
    assert sorted(runs.values_list("run_id", flat=True)) == sorted(r.id for r in results)
    assert set(runs.values_list("singleton_key", flat=True)) == {"store:A"}

    manual.dispatcher.drain()

    for result in results:
        fetched = jobs.sync_store.get_result(result.id)
        assert fetched.status == TaskResultStatus.SUCCESSFUL
        assert fetched.return_value == {"store_id": "A", "attempt": 1}
        assert fetched.args == ["A"] and fetched.kwargs == {}
        assert fetched.enqueued_at and fetched.started_at and fetched.finished_at
        result.refresh()
        assert result.is_finished and result.return_value == {"store_id": "A", "attempt": 1}
    # Admitted oldest first, one at a time (S5, S9).
    audits = list(BodyAudit.objects.filter(run_id__in=[r.id for r in results]).order_by("entered_at"))
    assert [a.run_id for a in audits] == [r.id for r in results]
    assert all(a.exited_at <= b.entered_at for a, b in pairwise(audits))
    # The cap frees once the backlog drains (S15).
    assert jobs.sync_store.enqueue("A").status == TaskResultStatus.READY


def test_a_failing_task_reports_its_exception_class_and_traceback(manual: Engine) -> None:
    """A task that raises fails its run; the result is FAILED with the
    exception's class path and traceback, and return_value raises (R2)."""
    result = jobs.fail.enqueue("out of stock")
    manual.dispatcher.drain()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "out of stock" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018


@pytest.mark.parametrize(
    ("job", "argument", "path"),
    [
        (jobs.exits, "stock sync exits", "builtins.SystemExit"),
        (jobs.interrupts, "stock sync interrupted", "builtins.KeyboardInterrupt"),
    ],
)
def test_a_task_raising_system_exit_or_keyboard_interrupt_fails_and_the_worker_goes_on(
    manual: Engine, job: Any, argument: str, path: str
) -> None:
    """R7 (#18 item 5): a task that calls ``sys.exit()`` or raises
    KeyboardInterrupt fails with that class and its message; ``drain`` (the
    worker) is not stopped by it and runs the next task. Before: the exception
    left the turn, the run stayed RUNNING and the worker's loop ended."""
    results = [job.enqueue(argument), jobs.fail.enqueue("after it")]
    manual.dispatcher.drain()
    for result in results:
        result.refresh()
    assert [r.status for r in results] == [TaskResultStatus.FAILED, TaskResultStatus.FAILED]
    [error] = results[0].errors
    assert error.exception_class_path == path
    assert error.traceback.rstrip().endswith(f"{path.removeprefix('builtins.')}: {argument}")
    assert results[1].errors[0].exception_class is ValueError


def test_an_async_task_and_a_task_with_context_run_on_the_worker(manual: Engine) -> None:
    """An ``async def`` task runs on the worker's thread; a task taking the
    context sees its own result id and attempt number."""
    doubled = jobs.double.enqueue(21)
    synced = jobs.sync_store.enqueue("CTX")
    manual.dispatcher.drain()
    assert jobs.double.get_result(doubled.id).return_value == 42
    assert jobs.sync_store.get_result(synced.id).return_value == {"store_id": "CTX", "attempt": 1}
    assert BodyAudit.objects.filter(run_id=synced.id).exists()


def test_results_of_unknown_runs_and_of_other_tasks_are_refused(manual: Engine) -> None:
    """get_result raises TaskResultDoesNotExist for an unknown id and for a
    run that is not a task's; Task.get_result refuses another task's result."""
    result = jobs.double.enqueue(1)
    with pytest.raises(TaskResultMismatch):
        jobs.fail.get_result(result.id)
    with pytest.raises(TaskResultDoesNotExist):
        jobs.double.get_result("no-such-run")
    with pytest.raises(TaskResultDoesNotExist):
        jobs.double.get_result("nul\x00id")
    plain = manual.start("sync-inventory", {"store_id": "P"})
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(plain.run_id)


def test_bad_arguments_raise_typed_errors_and_write_nothing(manual: Engine) -> None:
    """A key callable that cannot take the arguments raises SingletonKeyError
    (S1); arguments that are not JSON raise InvalidInputError (section 7);
    neither writes a row."""
    before = Run.objects.count()
    with pytest.raises(SingletonKeyError):
        jobs.sync_store.enqueue()
    with pytest.raises(InvalidInputError):
        jobs.double.enqueue(object())
    assert Run.objects.count() == before


def test_the_django_task_signals_are_sent(manual: Engine) -> None:
    """task_enqueued at enqueue, task_started and task_finished around the body."""
    seen: list[tuple[str, str]] = []

    def receiver(name: str) -> Any:
        def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
            seen.append((name, str(task_result.status)))

        return receive

    handlers = {
        signal: receiver(name)
        for signal, name in [(task_enqueued, "enqueued"), (task_started, "started"), (task_finished, "finished")]
    }
    for signal, handler in handlers.items():
        signal.connect(handler)
    try:
        jobs.double.enqueue(2)
        manual.dispatcher.drain()
    finally:
        for signal, handler in handlers.items():
            signal.disconnect(handler)
    assert seen == [("enqueued", "READY"), ("started", "RUNNING"), ("finished", "SUCCESSFUL")]


def test_embedded_worker_runs_tasks_one_per_key_and_keys_in_parallel(embedded: Engine) -> None:
    """On the embedded worker's threads, three syncs of store E1 never overlap
    (S9) and are admitted in enqueue order (S5); syncs of E2 run beside them."""
    e1 = [jobs.sync_store.enqueue("E1", duration=0.3) for _ in range(3)]
    e2 = [jobs.sync_store.enqueue("E2", duration=0.3) for _ in range(2)]
    wait_finished([*e1, *e2])
    assert all(r.status == TaskResultStatus.SUCCESSFUL for r in [*e1, *e2])
    audits = {a.run_id: a for a in BodyAudit.objects.filter(run_id__in=[r.id for r in [*e1, *e2]])}
    first = [audits[r.id] for r in e1]
    assert [a.run_id for a in sorted(first, key=lambda a: a.entered_at)] == [r.id for r in e1]
    assert all(a.exited_at <= b.entered_at for a, b in pairwise(first))
    other = [audits[r.id] for r in e2]
    assert any(a.entered_at < b.exited_at and b.entered_at < a.exited_at for a in first for b in other), (
        "two keys never ran at the same time"
    )


def test_a_worker_learns_a_task_workflow_from_its_name() -> None:
    """A process that never enqueued a task (a worker) resolves the workflow
    from its name on its first turn; singleton tasks are registered at startup
    with their configured limit, so the tick's catch-up knows them (S8a)."""
    fresh = Registry()
    configured = register_configured_tasks(fresh)
    assert [d.name for d in configured] == [task_workflow_name(jobs.sync_store)]
    assert configured[0].singleton is not None and configured[0].singleton.limit == 1
    definition = fresh.get(task_workflow_name(jobs.double))
    assert definition.singleton is None
    with pytest.raises(UnknownWorkflowError):
        fresh.get("task:testproject.inventory.jobs.no_such_task")
    with pytest.raises(UnknownWorkflowError):
        fresh.get("task:testproject.inventory.models.BodyAudit")


def test_check_reports_bad_backend_options() -> None:
    """Unknown OPTIONS (E030) and unusable SINGLETONS entries (E031) are
    reported by Django's check framework, naming the entry."""
    backend = DurableSingletonBackend(
        "bad",
        {
            "QUEUES": ["default", "slow"],
            "OPTIONS": {
                "SINGLETON": {},
                "SINGLETONS": {
                    "testproject.inventory.jobs.no_such_task": {"key": "testproject.inventory.jobs.store_key"},
                    "testproject.inventory.jobs.double": {"key": "no.such.function"},
                    "testproject.inventory.jobs.fail": {"key": str, "size": 3},
                },
            },
        },
    )
    messages = backend.check()
    assert [m.id for m in messages] == ["durable_singleton.E030"] + ["durable_singleton.E031"] * 3
    assert "no_such_task" in messages[1].msg and "no.such.function" in messages[2].msg
    assert task_backends["default"].check() == []


def test_a_return_value_that_is_not_json_fails_the_task_and_task_finished_says_failed(manual: Engine) -> None:
    """A task returning a set ends FAILED with TypeError, as Django's own
    backends report it, and task_finished carries the status the run settled
    with, never SUCCESSFUL for a run that failed (R2; #18)."""
    finished: list[str] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append(str(task_result.status))

    task_finished.connect(receive)
    try:
        result = jobs.returns_set.enqueue(3)
        manual.dispatcher.drain()
    finally:
        task_finished.disconnect(receive)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is TypeError
    assert "Unsupported type" in result.errors[0].traceback
    assert finished == ["FAILED"]


def test_a_return_value_that_is_not_json_says_it_is_not_json_serializable(manual: Engine) -> None:
    """The error of a task whose return value JSON cannot hold says, in the
    words of Django's own TypeError, that it "is not JSON serializable", and
    names the type (R2; #34 item 10: django-tasks-db's suite expects them)."""
    result = jobs.returns_set.enqueue(3)
    manual.dispatcher.drain()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is TypeError
    assert "is not JSON serializable" in result.errors[0].traceback
    assert "set" in result.errors[0].traceback


def test_arguments_that_are_not_json_raise_a_type_error_and_write_nothing(manual: Engine) -> None:
    """Django's task API raises TypeError for arguments JSON cannot hold; the
    backend's error is that TypeError and an InvalidInputError at once
    (section 7), and no row is written."""
    before = Run.objects.count()
    with pytest.raises(TypeError, match="Unsupported type") as raised:
        jobs.double.enqueue({1, 2})
    assert isinstance(raised.value, InvalidInputError)
    assert Run.objects.count() == before


def test_worker_ids_name_the_worker_of_each_attempt(manual: Engine) -> None:
    """TaskResult.worker_ids has one entry per execution of the task, each the
    worker (its process's name, host:pid:token) that ran it; attempts counts
    them (Django's contract)."""
    result = jobs.double.enqueue(4)
    assert result.worker_ids == [] and result.attempts == 0
    manual.dispatcher.drain()
    result.refresh()
    assert result.worker_ids == [process_name()]
    assert result.attempts == 1


def test_check_accepts_several_queues_and_reports_the_app_missing(settings: Any) -> None:
    """QUEUES naming several queues is valid (Django validates each task's
    queue_name against it); a backend used without durable_singleton in
    INSTALLED_APPS is reported (E032), since its runs need the app's models."""
    backend = DurableSingletonBackend("queues", {"QUEUES": ["default", "queue-1"]})
    assert backend.check() == []
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "durable_singleton"]
    [message] = backend.check()
    assert message.id == "durable_singleton.E032"


def test_a_task_queue_name_is_kept_with_its_run(manual: Engine, settings: Any) -> None:
    """A task enqueued on one of QUEUES reads back with that queue_name, so the
    result equals the one enqueue returned (Django's contract)."""
    settings.TASKS = {"default": {**settings.TASKS["default"], "QUEUES": ["default", "queue-1"]}}
    result = jobs.double.using(queue_name="queue-1").enqueue(5)
    fetched = jobs.double.get_result(result.id)
    assert fetched.task.queue_name == "queue-1"
    assert fetched == result


def test_started_at_is_never_before_enqueued_at_on_a_process_whose_clock_stepped(
    manual: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R8: enqueued_at (the run's created_at) and started_at come from the
    database's clock, and finished_at too, even on a process whose clock
    stepped an hour forward after its last correction: a result never reads
    as started before it was enqueued, or finished before it started."""
    clock = manual.now
    assert isinstance(clock, StoreClock)
    clock()
    local = clock._local
    monkeypatch.setattr(clock, "_local", lambda: local() + timedelta(hours=1))
    results = [jobs.double.enqueue(n) for n in range(3)]
    manual.dispatcher.drain()
    for result in results:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
        assert result.enqueued_at <= result.started_at <= result.finished_at, result


def test_task_finished_is_sent_failed_for_a_task_cancelled_before_it_ran(manual: Engine) -> None:
    """D6: a task whose run is cancelled before a worker ran it ends FAILED
    with RunCancelledError, and task_finished is sent once, with that result,
    by the process that settled it."""
    finished: list[tuple[str, str]] = []

    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        finished.append((task_result.id, str(task_result.status)))

    task_finished.connect(receive)
    try:
        result = jobs.double.enqueue(7)
        manual.cancel(result.id)
        manual.dispatcher.drain()
    finally:
        task_finished.disconnect(receive)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class_path == "durable_singleton.exceptions.RunCancelledError"
    assert finished == [(result.id, "FAILED")]


def test_run_after_is_a_delayed_start_that_blocks_no_due_task_on_its_key(manual: Engine) -> None:
    """#18 item 9, X5: a task enqueued with run_after an hour ahead is a run whose
    not_before is that time; its result reads READY and names its run_after; a
    due sync of the same store enqueued after it runs past it (one key, limit 1);
    once due, the tick sends it and it succeeds. Django refuses a naive run_after."""
    from django.db.models import F
    from django.tasks.exceptions import InvalidTask
    from django.utils import timezone

    later = manual.store.now() + timedelta(hours=1)
    delayed = jobs.sync_store.using(run_after=later).enqueue("A")
    assert delayed.status == TaskResultStatus.READY and delayed.task.run_after == later
    assert Run.objects.get(pk=delayed.id).not_before == later
    assert list(manual.dispatcher.queue) == []
    due = jobs.sync_store.enqueue("A")
    manual.dispatcher.drain()
    assert jobs.sync_store.get_result(due.id).status == TaskResultStatus.SUCCESSFUL
    fetched = jobs.sync_store.get_result(delayed.id)
    assert fetched.status == TaskResultStatus.READY and fetched.task.run_after == later
    Run.objects.filter(pk=delayed.id).update(
        not_before=F("not_before") - timedelta(hours=2), wake_at=F("wake_at") - timedelta(hours=2)
    )  # two hours pass for the delayed run
    manual.tick()
    manual.dispatcher.drain()
    assert jobs.sync_store.get_result(delayed.id).status == TaskResultStatus.SUCCESSFUL
    with pytest.raises(InvalidTask, match="aware"):
        jobs.sync_store.using(run_after=timezone.now().replace(tzinfo=None))
