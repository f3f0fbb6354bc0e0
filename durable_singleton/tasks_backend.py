"""A django.tasks backend (Django 6.0+): each enqueued task is a durable run.

A function decorated with Django's ``@task`` becomes the body of the workflow
``task:<module path>`` (registered on first use, and at startup for the tasks
listed in ``SINGLETONS``). ``enqueue`` starts a run of it through the default
engine and returns a :class:`~django.tasks.TaskResult` whose id is the run id;
``get_result`` reads the run back. So a task gets what every run has:
durable dispatch after commit, recovery of a crashed worker, the admin, and,
when listed in ``SINGLETONS``, the per-key gate (S1-S16)::

    TASKS = {
        "default": {
            "BACKEND": "durable_singleton.tasks_backend.DurableSingletonBackend",
            "OPTIONS": {
                "SINGLETONS": {
                    # task path: Singleton fields; key is called with the task's arguments
                    "inventory.tasks.sync_store": {
                        "key": "inventory.tasks.store_key",  # or a callable
                        "limit": 1,
                        "max_queue_depth": 2,
                    },
                },
            },
        },
    }

Turns run where the engine's ``DISPATCH`` setting sends them (Celery, the
embedded worker, or a test's manual dispatcher). A task's body runs at least
once per enqueue: a worker that dies mid-call is recovered and the function
called again (D4), as with any task queue.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from django.apps import apps
from django.core import checks
from django.tasks import DEFAULT_TASK_QUEUE_NAME, Task, TaskContext, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued, task_finished, task_started
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from . import signals
from .definitions import Registry, Singleton, WorkflowDefinition, registry
from .exceptions import ConfigurationError, InvalidInputError, InvalidInputTypeError, RunNotFoundError
from .statuses import RunStatus
from .stores.base import RunRecord, StepRecord

__all__ = ["TASK_WORKFLOW_PREFIX", "DurableSingletonBackend", "register_configured_tasks", "task_workflow_name"]

logger = logging.getLogger("durable_singleton")

#: Workflows of django.tasks tasks are named ``task:<module path of the task>``.
TASK_WORKFLOW_PREFIX = "task:"
TASK_WORKFLOW_VERSION = "1"
#: The step each execution of a task records first: ``{"worker": "<host>:<pid>:<token>",
#: "turn": "<lease owner>"}``, so ``TaskResult.worker_ids`` names every attempt's worker.
WORKER_STEP = "django.tasks:worker"

_OPTION_NAMES = frozenset({"SINGLETONS"})
_SINGLETON_FIELDS = frozenset({"key", "limit", "max_queue_depth"})

_STATUSES = {
    "pending": TaskResultStatus.READY,
    "suspended": TaskResultStatus.READY,
    "blocked": TaskResultStatus.READY,
    "running": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
    "dead": TaskResultStatus.FAILED,
}
#: The exception class a run that ended without an exception of its own reports.
_NO_EXCEPTION = {
    "cancelled": "durable_singleton.exceptions.RunCancelledError",
    "dead": "durable_singleton.exceptions.LeaseLostError",
}
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::|$)")


def task_workflow_name(task: Task[..., Any]) -> str:
    """Return the workflow name of ``task``: ``task:<module path>``."""
    return f"{TASK_WORKFLOW_PREFIX}{task.module_path}"


class DurableSingletonBackend(BaseTaskBackend):
    """Run django.tasks tasks as durable runs of the default engine, singleton per key when configured.

    ``OPTIONS["SINGLETONS"]``: ``{task module path: {"key": callable or dotted
    path, "limit": int >= 1, "max_queue_depth": int >= 0 or None}}``; the key
    callable receives the task's positional and keyword arguments and returns
    a non-empty str (S1). Supports async task functions, result retrieval
    from any process and ``run_after``, a delayed start of the run
    (``not_before``, X5: not run before it by the database's clock, and no
    blocker of the due tasks behind it on its key) and priorities: a task's
    ``priority`` (-100 to 100, checked by Django) is its run's priority inside
    its key (X8: among the key's waiters the higher is admitted first, oldest
    first within one; a holder is never preempted). A task's ``queue_name``
    (one of ``QUEUES``, checked by Django) is kept with its run and read back
    by :meth:`get_result`; it does not route turns, which go to the engine's
    dispatcher.
    """

    supports_async_task = True
    supports_get_result = True
    supports_defer = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.singletons: Mapping[str, Mapping[str, Any]] = self.options.get("SINGLETONS", {}) or {}

    # -- enqueueing ------------------------------------------------------------
    def enqueue[**P, R](self, task: Task[P, R], args: list[Any], kwargs: dict[str, Any]) -> TaskResult[P, R]:
        """Start a durable run of ``task`` with ``args``/``kwargs``; return its result (status READY).

        The run is created now and its first turn dispatched after the current
        transaction commits (S3); with the task's ``run_after`` (an aware
        datetime, checked by Django) the run's ``not_before`` is that time and
        the tick sends its first turn when it is due (X5); the task's ``priority`` is the run's
        (X8). Arguments are normalized as Django's
        ``TaskResult`` does (tuples become lists). Raises
        :class:`~django.tasks.exceptions.InvalidTask` for a task this backend
        cannot run, :class:`~durable_singleton.exceptions.InvalidInputTypeError`
        (an ``InvalidInputError`` and a ``TypeError``, as Django's contract has
        it) for arguments of a type JSON cannot hold,
        :class:`~durable_singleton.exceptions.InvalidInputError` for other
        arguments that cannot be stored (NUL, too large),
        :class:`~durable_singleton.exceptions.SingletonKeyError` when the key
        callable fails, and :class:`~durable_singleton.SingletonQueueFullError`
        when the key's queue is at its cap (S15); each writes nothing.
        """
        from .runtime import get_engine

        self.validate_task(task)
        try:
            input: dict[str, Any] = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        except TypeError as exc:
            raise InvalidInputTypeError(f"task arguments are not JSON serializable: {exc}") from None
        except ValueError as exc:
            raise InvalidInputError(f"task arguments are not JSON serializable: {exc}") from None
        if task.queue_name != DEFAULT_TASK_QUEUE_NAME:
            input["queue_name"] = task.queue_name
        engine = get_engine()
        definition = self.definition_for(task, engine.registry)
        run = engine.start(
            definition.name, input, version=definition.version, not_before=task.run_after, priority=task.priority
        )
        result = self._result(task, run, [])
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        """Return the result of run ``result_id`` as it is stored now.

        Raises :class:`~django.tasks.exceptions.TaskResultDoesNotExist` when no
        run has that id or the run is not a task's.
        """
        from .runtime import get_engine

        engine = get_engine()
        try:
            run = engine.get(result_id)
        except RunNotFoundError:
            raise TaskResultDoesNotExist(result_id) from None
        task = _task_of(run.workflow_name)
        if task is None:
            raise TaskResultDoesNotExist(result_id)
        return self._result(task, run, engine.store.load_steps(run.run_id))

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Report unknown options (E030), unusable ``SINGLETONS`` entries (E031),
        and durable_singleton missing from ``INSTALLED_APPS`` (E032): its runs
        live in the app's models and its workers are the app's."""
        messages: list[checks.CheckMessage] = []
        if not apps.is_installed("durable_singleton"):
            messages.append(
                checks.Error(
                    f"Task backend {self.alias!r} is {type(self).__name__}, but durable_singleton "
                    "is not in INSTALLED_APPS.",
                    hint="Add 'durable_singleton' to INSTALLED_APPS and run migrate.",
                    id="durable_singleton.E032",
                )
            )
        unknown = set(self.options) - _OPTION_NAMES
        if unknown:
            messages.append(
                checks.Error(
                    f"Task backend {self.alias!r} has unknown OPTIONS {sorted(unknown)}.",
                    hint=f"Known options: {', '.join(sorted(_OPTION_NAMES))}.",
                    id="durable_singleton.E030",
                )
            )
        for path in self.singletons:
            try:
                self.singleton_for(path)
                _import_task(path)
            except ConfigurationError as exc:
                messages.append(checks.Error(str(exc), hint="Fix OPTIONS['SINGLETONS'].", id="durable_singleton.E031"))
        return messages

    # -- workflows ---------------------------------------------------------------
    def singleton_for(self, path: str) -> Singleton | None:
        """Return the :class:`Singleton` configured for task ``path``, or None.

        Raises :class:`ConfigurationError` for unknown fields or a key that is
        neither callable nor an importable dotted path; the limits are checked
        when the workflow is registered (InvalidWorkflowError).
        """
        options = self.singletons.get(path)
        if options is None:
            return None
        if not isinstance(options, Mapping) or set(options) - _SINGLETON_FIELDS or "key" not in options:
            raise ConfigurationError(
                f"task backend {self.alias!r}: SINGLETONS[{path!r}] must be a mapping with 'key' and "
                f"optionally 'limit' and 'max_queue_depth', got {options!r}"
            )
        key = options["key"]
        if isinstance(key, str):
            try:
                key = import_string(key)
            except ImportError as exc:
                raise ConfigurationError(
                    f"task backend {self.alias!r}: SINGLETONS[{path!r}]['key']: cannot import {key!r}: {exc}"
                ) from None
        if not callable(key):
            raise ConfigurationError(f"task backend {self.alias!r}: SINGLETONS[{path!r}]['key'] is not callable")
        return Singleton(
            key=_ArgumentsKey(key),
            limit=options.get("limit", 1),
            max_queue_depth=options.get("max_queue_depth"),
        )

    def definition_for(self, task: Task[..., Any], target: Registry = registry) -> WorkflowDefinition:
        """Return the workflow of ``task`` in ``target``, registering it on first use.

        Raises :class:`ConfigurationError` or
        :class:`~durable_singleton.exceptions.InvalidWorkflowError` for bad
        ``SINGLETONS`` options.
        """
        name = task_workflow_name(task)
        found = target.workflows.get((name, TASK_WORKFLOW_VERSION))
        if found is not None:
            return found
        target.add_step(WORKER_STEP, _worker_step)
        return target.add(
            name,
            TASK_WORKFLOW_VERSION,
            _TaskBody(task.module_path),
            singleton=self.singleton_for(task.module_path),
            origin=f"django.tasks:{task.module_path}",
        )

    def _result[**P, R](
        self, task: Task[P, R], run: RunRecord, attempts: Mapping[int, StepRecord] | list[StepRecord]
    ) -> TaskResult[P, R]:
        """Build the TaskResult of ``run``: ``attempts`` are its steps (or the
        attempt records alone), from which the worker of each execution is read."""
        input = run.input if isinstance(run.input, dict) else {}
        records = _attempt_records(attempts)
        if task.backend != self.alias:
            task = task.using(backend=self.alias)
        queue_name = input.get("queue_name")
        if isinstance(queue_name, str) and queue_name != task.queue_name:
            with contextlib.suppress(InvalidTask):  # QUEUES no longer lists it: the task's own
                task = task.using(queue_name=queue_name)
        if run.not_before is not None and task.run_after != run.not_before:
            task = task.using(run_after=run.not_before)  # the task as enqueued (X5)
        if task.priority != run.priority:
            task = task.using(priority=run.priority)  # the task as enqueued (X8)
        result: TaskResult[P, R] = TaskResult(
            task=task,
            id=run.run_id,
            status=_STATUSES[run.status],
            enqueued_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            # The first attempt starts the run; a later one is its step's start.
            last_attempted_at=records[-1].started_at if len(records) > 1 else run.started_at,
            args=list(input.get("args", [])),
            kwargs=dict(input.get("kwargs", {})),
            backend=self.alias,
            errors=_errors(run),
            worker_ids=[str(r.result["worker"]) for r in records],
        )
        object.__setattr__(result, "_return_value", run.output)
        return result


class _ArgumentsKey:
    """The singleton key of a task run: the configured callable applied to the task's arguments."""

    def __init__(self, key: Callable[..., Any]) -> None:
        self.key = key

    def __call__(self, input: dict[str, Any]) -> Any:
        return self.key(*input.get("args", []), **input.get("kwargs", {}))


def _worker_step(value: Any) -> Any:
    """The handler of :data:`WORKER_STEP`: the record is its input."""
    return value


def _attempt_records(steps: Mapping[int, StepRecord] | list[StepRecord]) -> list[StepRecord]:
    """Return the attempt records among a run's steps, oldest first."""
    found = steps.values() if isinstance(steps, Mapping) else steps
    return sorted((s for s in found if s.name == WORKER_STEP and isinstance(s.result, dict)), key=lambda s: s.position)


def _record_attempt(ctx: Any) -> list[StepRecord]:
    """Record this execution's worker as the next attempt step (R4: earlier
    attempts replay as stored); return every attempt record, this one last."""
    worker = ctx.owner.rpartition(":")[0] or ctx.owner  # the process's name of "<host>:<pid>:<token>:<turn>"
    while True:
        record = ctx.step(WORKER_STEP, {"worker": worker, "turn": ctx.owner})
        if isinstance(record, dict) and record.get("turn") == ctx.owner:
            return _attempt_records(ctx.steps)


class _TaskBody:
    """The body of a task's workflow: call the task function with the run's arguments.

    Sends ``task_started``; ``task_finished`` is sent once the run has settled,
    with the status it settled with (:func:`_task_finished`).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, ctx: Any, input: dict[str, Any]) -> Any:
        task = _import_task(self.path)
        backend = _backend_of(task)
        attempts = _record_attempt(ctx)
        result = backend._result(task, ctx.run, attempts) if backend is not None else None
        if result is not None:
            object.__setattr__(result, "status", TaskResultStatus.RUNNING)
            task_started.send(type(backend), task_result=result)
        args, kwargs = input.get("args", []), input.get("kwargs", {})
        if task.takes_context:
            if result is None:
                raise ConfigurationError(f"task {self.path} takes a context but no task backend is durable")
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        # As Django's own backends do: a value JSON cannot hold fails the task with
        # TypeError, in the words of json's own ("... is not JSON serializable").
        try:
            return normalize_json(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"the return value of task {self.path} is not JSON serializable: {exc}") from None


def _task_finished(sender: Any, run: RunRecord, **kwargs: Any) -> None:
    """Receiver of ``run_finished``: send ``task_finished`` for a task's run with
    the result as it settled (FAILED for a run that failed, whatever its body
    returned). Sent where the run settled, inside the handler of the body's
    exception when it failed there, so Django's log receiver logs it."""
    task = _task_of(run.workflow_name)
    backend = _backend_of(task) if task is not None else None
    if task is None or backend is None:
        return
    from .runtime import get_engine

    store = get_engine().store
    try:
        # As stored: the record a settle returns carries this process's time, the row the database's (R8).
        run = store.get_run(run.run_id) or run
        result = backend._result(task, run, store.load_steps(run.run_id))
    except Exception:
        logger.warning("run %s: could not build its task result for task_finished", run.run_id, exc_info=True)
        return
    for receiver, response in task_finished.send_robust(type(backend), task_result=result):
        if isinstance(response, Exception):
            logger.error("task_finished receiver %r failed for run %s", receiver, run.run_id, exc_info=response)


def _backend_of(task: Task[..., Any]) -> DurableSingletonBackend | None:
    """Return the durable backend that reports ``task``'s results: its own, or the first configured."""
    backend = task.get_backend()
    if isinstance(backend, DurableSingletonBackend):
        return backend
    durable = _durable_backends()
    return durable[0] if durable else None


def _import_task(path: str) -> Task[..., Any]:
    """Return the :class:`Task` at dotted ``path``; raise :class:`ConfigurationError`."""
    try:
        task = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import task {path!r}: {exc}") from None
    if not isinstance(task, Task):
        raise ConfigurationError(f"{path!r} is {type(task).__name__}, not a django.tasks Task (decorate it with @task)")
    return task


def _task_of(workflow_name: str) -> Task[..., Any] | None:
    if not workflow_name.startswith(TASK_WORKFLOW_PREFIX):
        return None
    try:
        return _import_task(workflow_name.removeprefix(TASK_WORKFLOW_PREFIX))
    except ConfigurationError:
        return None


def _errors(run: RunRecord) -> list[TaskError]:
    if run.status not in (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD) or not isinstance(run.error, dict):
        return []
    error = run.error
    trace = str(error.get("traceback") or f"{error.get('code', run.status)}: {error.get('message', '')}")
    path = _NO_EXCEPTION.get(run.status, "durable_singleton.exceptions.DurableSingletonError")
    if error.get("code") == "exception":
        # The engine stores the exception's qualified name; the traceback's last
        # line names its module too ("package.module.Class: message").
        path = str(error.get("type", path))
        for line in reversed(trace.strip().splitlines()):
            match = _EXCEPTION_LINE.match(line)
            if match and match.group(1).endswith(path):
                path = match.group(1)
                break
        if "." not in path:
            path = f"builtins.{path}"
    return [TaskError(exception_class_path=path, traceback=trace)]


def _resolve(target: Registry, name: str) -> bool:
    """Registry resolver: register the workflow of the task named by ``name`` (a worker learns it here)."""
    task = _task_of(name)
    backend = _backend_of(task) if task is not None else None
    if task is None or backend is None:
        return False
    backend.definition_for(task, target)
    return True


def _durable_backends() -> list[DurableSingletonBackend]:
    """Return the configured task backends of this class (others are not built)."""
    from django.tasks import task_backends

    found = []
    for alias, params in task_backends.settings.items():
        try:
            backend_class = import_string(params["BACKEND"])
        except (ImportError, KeyError):
            continue  # Django's own check reports it
        if isinstance(backend_class, type) and issubclass(backend_class, DurableSingletonBackend):
            backend = task_backends[alias]
            if isinstance(backend, DurableSingletonBackend):
                found.append(backend)
    return found


def register_configured_tasks(target: Registry = registry) -> list[WorkflowDefinition]:
    """Register the workflows of every task listed in ``SINGLETONS`` of a durable task backend.

    Called at startup (``AppConfig.ready``) so every process, the tick's
    included, knows each singleton task's limit before its first enqueue
    (S8a catch-up, the admin's queue pages). Also installs the resolver that
    registers any other task's workflow on first sight, and connects the
    receiver that sends ``task_finished`` when a task's run settles. Entries
    that cannot be imported are left to the system check (E031).
    """
    target.add_resolver(_resolve)
    signals.run_finished.connect(_task_finished, dispatch_uid="durable_singleton.task_finished")
    done = []
    for backend in _durable_backends():
        for path in backend.singletons:
            try:
                done.append(backend.definition_for(_import_task(path), target))
            except ConfigurationError:
                continue
    return done
