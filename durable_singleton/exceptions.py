"""Typed exceptions raised by durable_singleton.

Every invalid declaration or call raises a subclass of
:class:`DurableSingletonError` and writes nothing (SPEC section 7).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AmbiguousRunIdError",
    "ChildWorkflowError",
    "ConfigurationError",
    "DuplicateWorkflowError",
    "DurableSingletonError",
    "InvalidInputError",
    "InvalidInputTypeError",
    "InvalidNotBeforeError",
    "InvalidPriorityError",
    "InvalidRunIdError",
    "InvalidWorkflowError",
    "LeaseLostError",
    "QuotaQueueFullError",
    "RunCancelledError",
    "RunIdInUseError",
    "RunNotFoundError",
    "SignalTimeoutError",
    "SingletonBusyError",
    "SingletonFallbackWarning",
    "SingletonKeyError",
    "SingletonQueueFullError",
    "StepInTransactionError",
    "UnknownStepError",
    "UnknownWorkflowError",
    "UnsupportedByStoreError",
    "ValidationError",
]


class DurableSingletonError(Exception):
    """Base class of every error raised by durable_singleton.

    Every one pickles and unpickles with its message and its attributes,
    whatever its ``__init__`` takes (a Celery result backend or a
    multiprocessing pool may send it to another process)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """Rebuild an unpickled :class:`DurableSingletonError` without calling its ``__init__``."""
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class ConfigurationError(DurableSingletonError):
    """The ``DURABLE_SINGLETON`` settings are invalid."""


class InvalidWorkflowError(DurableSingletonError):
    """A workflow declaration is invalid; the message names the workflow and the field."""

    def __init__(self, workflow: str, field: str, problem: str) -> None:
        self.workflow = workflow
        self.field = field
        super().__init__(f"workflow {workflow!r}: {field}: {problem}")


class DuplicateWorkflowError(InvalidWorkflowError):
    """A workflow name and version is registered twice with different bodies."""


class UnknownWorkflowError(DurableSingletonError):
    """No workflow with that name (and version) is registered."""


class UnknownStepError(DurableSingletonError):
    """``ctx.step`` named a step that no ``@step`` handler registered."""


class ValidationError(DurableSingletonError):
    """A call's argument is invalid; nothing was written."""


class InvalidRunIdError(ValidationError):
    """A run id is empty, not a string, or longer than the column allows (R1)."""


class InvalidInputError(ValidationError):
    """A run input (or signal payload, or step result) is not JSON-serializable."""


class InvalidInputTypeError(InvalidInputError, TypeError):
    """A value holds an object of a type JSON cannot (a set, a datetime, an
    instance): an :class:`InvalidInputError` that is also the ``TypeError``
    which ``json.dumps`` and Django's task API raise for it (section 7)."""


class InvalidNotBeforeError(ValidationError):
    """A delayed start's ``not_before`` is neither None, an aware datetime nor a
    finite number of seconds >= 0, or is farther than ``MAX_SECONDS`` (100 years)
    from now (X5); nothing was written."""


class InvalidPriorityError(ValidationError):
    """A start's ``priority`` is not an int (a bool is refused too) from -100 to 100
    (X8); nothing was written."""


class SingletonKeyError(ValidationError):
    """A singleton key function raised, or returned something other than a
    non-empty string within the key column length (S1); or a quota's key or
    fair_key function did (X3a, X4).

    ``subject`` names the key in the message: ``"singleton key"`` (the
    default) or ``"quota 'name'"``. Attributes: ``workflow`` (str).
    """

    def __init__(self, workflow: str, problem: str, subject: str = "singleton key") -> None:
        self.workflow = workflow
        super().__init__(f"workflow {workflow!r}: {subject}: {problem}")


class SingletonQueueFullError(DurableSingletonError):
    """The key's backlog reached ``limit + max_queue_depth``; nothing was written (S15).

    Attributes: ``workflow`` (str), ``key`` (str), ``max_queue_depth`` (int).
    """

    def __init__(self, workflow: str, key: str, max_queue_depth: int) -> None:
        self.workflow = workflow
        self.key = key
        self.max_queue_depth = max_queue_depth
        super().__init__(
            f"singleton queue full for workflow {workflow!r}, key {key!r}: "
            f"its active runs reached limit + max_queue_depth (max_queue_depth={max_queue_depth})"
        )


class SingletonBusyError(SingletonQueueFullError):
    """A start with ``on_busy="skip"`` found no free slot for its key; nothing was written (X1).

    "skip" is the queue cap at ``max_queue_depth=0`` (S15), named: the same
    count under the key's lock refuses the start, so this is a
    :class:`SingletonQueueFullError` (and a :class:`DurableSingletonError`),
    and every path that reports a refused start (``start_many``, a child's
    start, a schedule's window, S16) reports it. Attributes: ``workflow``
    (str), ``key`` (str), ``max_queue_depth`` (0).
    """

    def __init__(self, workflow: str, key: str) -> None:
        self.workflow = workflow
        self.key = key
        self.max_queue_depth = 0
        # The base's message speaks of a queue; this start queues nothing.
        DurableSingletonError.__init__(
            self, f"singleton key busy for workflow {workflow!r}, key {key!r}: on_busy='skip' and no free slot"
        )


class QuotaQueueFullError(SingletonQueueFullError):
    """A quota key's backlog reached its quota's ``limit + max_queue_depth``;
    nothing was written (S15 for a quota key, X3j).

    The queue cap of a quota key, counted as a singleton key's is: so this is a
    :class:`SingletonQueueFullError`, and every path that reports a refused
    start (``start_many``, a child's start, a schedule's window, S16) reports
    it. Attributes: ``workflow`` (str, the workflow started), ``quota`` (str,
    the quota's name), ``key`` (str, the quota key), ``max_queue_depth`` (int).
    """

    def __init__(self, workflow: str, quota: str, key: str, max_queue_depth: int) -> None:
        self.workflow = workflow
        self.quota = quota
        self.key = key
        self.max_queue_depth = max_queue_depth
        DurableSingletonError.__init__(
            self,
            f"quota queue full for quota {quota!r}, key {key!r} (a start of workflow {workflow!r}): "
            f"its active members reached limit + max_queue_depth (max_queue_depth={max_queue_depth})",
        )


class UnsupportedByStoreError(DurableSingletonError):
    """The configured store does not offer this feature; its capability flag
    (``BaseStore.supports_key_controls``, ...) says so before the call."""


class RunNotFoundError(DurableSingletonError):
    """No run has that run id."""


class AmbiguousRunIdError(RunNotFoundError):
    """A run id prefix (``durable_explain 69b0836c``) names no run exactly and begins
    more than one run's id, or none.

    Attributes: ``prefix`` (str) and ``candidates`` (list of str: the first run
    ids that begin with it, in order; empty when none does). The message lists them.
    """

    def __init__(self, prefix: str, candidates: list[str], more: bool = False) -> None:
        self.prefix = prefix
        self.candidates = candidates
        if not candidates:
            text = f"no run {prefix!r:.80}, and no run id begins with it"
        else:
            listed = ", ".join(candidates) + (", ..." if more else "")
            text = f"run id prefix {prefix!r:.80} is ambiguous; candidates: {listed} (give more characters)"
        super().__init__(text)


class RunIdInUseError(DurableSingletonError):
    """A start's ``run_id`` is taken by a run of another namespace (D10).

    A run id names one run, in one namespace. Raised by a start of an engine
    with ``scope_reads`` (and by a child's start on any engine: a child lives
    in its parent's namespace, D7) instead of returning that run; nothing is
    written. The message names the id only, never the other run's namespace
    or data. Attribute: ``run_id`` (str).
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"run id {run_id!r} is in use in another namespace; choose another run id")


class LeaseLostError(DurableSingletonError):
    """This process's lease on the run was taken over; its writes are fenced (R5)."""


class RunCancelledError(DurableSingletonError):
    """The run was cancelled; raised inside a body at its next step boundary (D6)."""


class SignalTimeoutError(DurableSingletonError):
    """``ctx.wait_for_signal`` timed out before the signal arrived (D2)."""


class StepInTransactionError(DurableSingletonError):
    """A body called ``ctx.step`` (or another ``ctx`` call that writes: a sleep,
    a signal wait, a child) inside a transaction it opened on the store's
    database (``transaction.atomic()``). The step's write would hold the run's
    row lock until that transaction ends, so the lease renewal and every
    other writer of the run would wait for the body (R5); nothing is written.
    Open the transaction inside the step's handler instead (docs/durability.rst)."""


class ChildWorkflowError(DurableSingletonError):
    """A child run failed, was cancelled, or could not be started (D7, S16)."""

    def __init__(self, child_run_id: str, status: str, error: object) -> None:
        self.child_run_id = child_run_id
        self.status = status
        self.error = error
        super().__init__(f"child run {child_run_id!r} ended {status}: {error}")


class SingletonFallbackWarning(UserWarning):
    """A store has no atomic admission in ``begin_turn``: admission falls back to a racy scan (S14).

    Issued (warnings.warn) by an engine at its first turn on a store whose
    ``supports_atomic_admission`` is False.
    """
