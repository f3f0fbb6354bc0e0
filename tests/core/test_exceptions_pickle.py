"""Every typed error pickles (SPEC section 7: typed errors): a Celery
result backend with the pickle serializer, a multiprocessing pool or a
``concurrent.futures`` process pool sends an exception to another process by
pickling it. Exceptions whose ``__init__`` takes several arguments (the queue
caps' S15 / X1 / X3j errors, ``InvalidWorkflowError``, ``ChildWorkflowError``,
``RunIdInUseError``, ``SingletonKeyError``) failed to unpickle with a
``TypeError`` before ``DurableSingletonError.__reduce__``."""

from __future__ import annotations

import pickle

import pytest

from durable_singleton import exceptions as ex

CASES = [
    ex.SingletonQueueFullError("w", "k", 2),
    ex.SingletonBusyError("w", "k"),
    ex.QuotaQueueFullError("w", "stripe-api", "acct-1", 3),
    ex.InvalidWorkflowError("w", "singleton.limit", "must be an int >= 1"),
    ex.DuplicateWorkflowError("w", "version", "'1' is already registered"),
    ex.SingletonKeyError("w", "key function raised KeyError: 'x'", "quota 'q'"),
    ex.RunIdInUseError("r-1"),
    ex.ChildWorkflowError("c-1", "failed", {"type": "ValueError"}),
    ex.RunNotFoundError("no run 'x'"),
    ex.InvalidInputTypeError("input is not JSON"),
]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_a_typed_error_survives_pickling_with_its_message_and_fields(error: ex.DurableSingletonError) -> None:
    """The unpickled error has the same type, message, args and attributes."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error) and copy.args == error.args
    assert vars(copy) == vars(error)
    assert isinstance(copy, ex.DurableSingletonError)
