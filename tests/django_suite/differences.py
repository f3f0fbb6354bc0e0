"""The documented differences: the only tests of Django's tests/tasks suite allowed to fail.

Each entry is ``test id: (reason, strict)``. A strict entry must fail (the
runner reports one that passes, so the list stays exact); a non-strict one
may pass. docs/django_tasks.rst lists the same differences for users.
"""

from __future__ import annotations

_IMMEDIATE = "tasks.test_immediate_backend.ImmediateBackendTestCase."
_DUMMY = "tasks.test_dummy_backend.DummyBackendTestCase."
_TASKS = "tasks.test_tasks.TaskTestCase."

_GET_RESULT = (
    "the test checks that the immediate backend cannot read results back; the durable backend can "
    "(supports_get_result): a result is a stored run, read from any process"
)
_SYNC_IN_ASYNC = (
    "a coroutine calls a synchronous method that reads the database (get_result, refresh, or the "
    "stand-in's results); Django refuses database access from an event loop (SynchronousOnlyOperation). "
    "The async twins (aget_result, arefresh) work"
)
_RUN_AFTER = (
    "the durable backend supports run_after (supports_defer, a delayed start: SPEC X5); the immediate "
    "backend's stand-in is the durable backend, so it does not refuse it"
)
_R7 = (
    "Django's immediate backend lets a task's KeyboardInterrupt leave enqueue() (\"if the user tried to "
    "terminate, let them\"); here a body's KeyboardInterrupt is its own code's unless the worker's own "
    "shutdown flag is set (SPEC R7): the run fails with KeyboardInterrupt and the worker goes on"
)

DIFFERENCES: dict[str, tuple[str, bool]] = {
    _IMMEDIATE + "test_cannot_get_result": (_GET_RESULT, True),
    _IMMEDIATE + "test_cannot_refresh_result": (_GET_RESULT, True),
    "tasks.test_immediate_backend.ImmediateBackendTransactionTestCase."
    "test_doesnt_wait_until_transaction_commit_by_default": (
        "a task's first turn is sent when the enqueuing transaction commits (S3), so inside "
        "transaction.atomic() it has not run yet",
        True,
    ),
    _IMMEDIATE + "test_throws_keyboard_interrupt": (_R7, True),
    _DUMMY + "test_refresh_result": (
        "the test changes the status of the dummy backend's in-memory result and expects refresh() to "
        "read it; a durable result is read from its stored run, which the test does not change",
        True,
    ),
    _DUMMY + "test_refresh_result_async": (
        "as test_refresh_result; and the stand-in's results read the database from the coroutine",
        True,
    ),
    _DUMMY + "test_enqueue_task_async": (_SYNC_IN_ASYNC, True),
    _DUMMY + "test_get_missing_result": (_SYNC_IN_ASYNC, True),
    _TASKS + "test_enqueue_task_async": (_SYNC_IN_ASYNC, True),
    _TASKS + "test_get_missing_result": (_SYNC_IN_ASYNC, True),
    _TASKS + "test_refresh_result": (_SYNC_IN_ASYNC, True),
    _IMMEDIATE + "test_cannot_pass_run_after": (_RUN_AFTER, True),
}
