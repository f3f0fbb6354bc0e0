"""Workflow and step declarations, and the registry that holds them.

A workflow is declared once, by the :func:`~durable_singleton.workflows.workflow`
decorator on a :class:`~durable_singleton.workflows.BaseWorkflow` subclass (or
on a plain function), by a ``workflow`` class attribute, or by
:meth:`Engine.register <durable_singleton.engine.Engine.register>`; each
fills a :class:`Registry`. Every declaration is checked
when it is registered; an invalid one raises
:class:`~durable_singleton.exceptions.InvalidWorkflowError` naming the
workflow and the field (SPEC section 7).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .admission import (
    MAX_WEIGHT,
    QUOTA_KEY_MAX_LENGTH,
    QUOTA_NAME_MAX_LENGTH,
    QUOTA_PREFIX,
    THROTTLE_PREFIX,
    queue_cap,
    throttle_lock_name,
)
from .exceptions import (
    DuplicateWorkflowError,
    InvalidWorkflowError,
    UnknownStepError,
    UnknownWorkflowError,
    ValidationError,
)
from .records import RunRecord
from .schedule_specs import Schedule, coerce_schedules
from .statuses import SUPERSEDING, OnBusy
from .values import MAX_LIMIT, check_seconds, check_text

__all__ = [
    "MIN_THROTTLE_PERIOD",
    "Debounce",
    "Quota",
    "Registry",
    "Singleton",
    "Throttle",
    "WorkflowDefinition",
    "WorkflowOptions",
    "registry",
    "step",
]

NAME_MAX_LENGTH = 191
VERSION_MAX_LENGTH = 64

#: A workflow body: ``fn(ctx, input)``, ``ctx`` a :class:`~durable_singleton.context.WorkflowCtx`.
Body = Callable[[Any, Any], Any]
StepHandler = Callable[[Any], Any]


@dataclass(frozen=True)
class Singleton:
    """Serialize a workflow's runs per key (SPEC section 2).

    ``key``: callable taking the run input and returning a non-empty ``str``.
    ``limit``: slots per key, an ``int`` from 1 to
    :data:`~durable_singleton.values.MAX_LIMIT` (default 1).
    ``max_queue_depth``: waiters allowed beyond ``limit`` (``int`` >= 0, with
    ``limit + max_queue_depth`` at most ``MAX_LIMIT``), or ``None`` for an
    unbounded queue (S15).
    ``queue_ttl``: seconds (``int`` or ``float``, finite, > 0, at most
    :data:`~durable_singleton.values.MAX_SECONDS`, 100 years) a waiter may
    wait from its creation, a delayed start's (X5) included; one not admitted
    by then is ended ``cancelled`` with error code ``queue_ttl_expired`` by
    the tick, on the database's clock (X2, R5). ``None`` (the default): no limit.
    ``on_busy``: what a start does on a key with no free slot (X1), an
    :class:`~durable_singleton.statuses.OnBusy` or its value: ``"queue"``
    (the default: it waits, oldest first, S3, S5); ``"skip"`` (it creates
    nothing and raises :class:`~durable_singleton.exceptions.SingletonBusyError`:
    the queue cap at depth 0); ``"replace_queued"`` (it cancels the waiters
    queued behind the holders, which end ``cancelled`` with code ``replaced``);
    ``"cancel_in_progress"`` (it also asks the holders to stop at their next
    step boundary, D6, and is admitted when they settle). Each decision is
    made under the key's lock with the start's insert (docs/on_busy.rst).
    Any strategy but ``"queue"`` takes no ``max_queue_depth`` (it fixes the
    queue's depth itself), and ``"cancel_in_progress"`` takes only
    ``limit=1``; an unknown strategy or such a combination raises
    :class:`~durable_singleton.exceptions.InvalidWorkflowError` at registration.

    Raises :class:`InvalidWorkflowError` (from :meth:`coerce`, at
    registration) naming the workflow and the field.
    """

    key: Callable[[Any], str]
    limit: int = 1
    max_queue_depth: int | None = None
    queue_ttl: float | None = None
    on_busy: OnBusy | str = OnBusy.QUEUE

    @property
    def queue_depth(self) -> int | None:
        """Return the waiters allowed beyond ``limit``: ``max_queue_depth``, 0 for
        ``"skip"`` (X1: the cap at depth 0), None for an unbounded queue (S15)."""
        return 0 if self.on_busy == OnBusy.SKIP else self.max_queue_depth

    @property
    def cap(self) -> int | None:
        """Return the count of the key's active runs at which a start is refused
        (S15): ``limit + queue_depth``, or None without a cap."""
        return queue_cap(self.limit, self.queue_depth)

    @property
    def supersedes(self) -> bool:
        """Tell whether a start changes the key's other runs: ``"replace_queued"``
        and ``"cancel_in_progress"`` (X1)."""
        return self.on_busy in SUPERSEDING

    @classmethod
    def coerce(cls, workflow: str, value: Singleton | Mapping[str, Any] | None) -> Singleton | None:
        """Return a validated :class:`Singleton` from an instance, a mapping or None.

        Raises :class:`InvalidWorkflowError` naming ``workflow`` and the field.
        """
        if value is None:
            return None
        if isinstance(value, Mapping):
            unknown = set(value) - {"key", "limit", "max_queue_depth", "queue_ttl", "on_busy"}
            if unknown:
                raise InvalidWorkflowError(workflow, "singleton", f"unknown fields {sorted(unknown)}")
            if "key" not in value:
                raise InvalidWorkflowError(workflow, "singleton.key", "is required")
            value = cls(**value)
        if not isinstance(value, cls):
            raise InvalidWorkflowError(
                workflow, "singleton", f"expected Singleton or a mapping, got {type(value).__name__}"
            )
        if not callable(value.key):
            raise InvalidWorkflowError(workflow, "singleton.key", "must be callable (input -> str)")
        if isinstance(value.limit, bool) or not isinstance(value.limit, int) or not 1 <= value.limit <= MAX_LIMIT:
            raise InvalidWorkflowError(
                workflow, "singleton.limit", f"must be an int from 1 to {MAX_LIMIT}, got {value.limit!r:.80}"
            )
        _depth(workflow, "singleton.max_queue_depth", value.limit, value.max_queue_depth)
        if value.queue_ttl is not None:
            _seconds(workflow, "singleton.queue_ttl", value.queue_ttl)
        return _with_on_busy(workflow, value)


def _with_on_busy(workflow: str, value: Singleton) -> Singleton:
    """Return ``value`` with its ``on_busy`` as an :class:`OnBusy`; refuse an
    unknown strategy and the combinations that make no sense (X1)."""
    try:
        on_busy = OnBusy(value.on_busy) if isinstance(value.on_busy, str) else None
    except ValueError:
        on_busy = None
    if on_busy is None:
        choices = ", ".join(repr(str(o)) for o in OnBusy)
        raise InvalidWorkflowError(workflow, "singleton.on_busy", f"must be one of {choices}, got {value.on_busy!r}")
    if on_busy != OnBusy.QUEUE and value.max_queue_depth is not None:
        raise InvalidWorkflowError(
            workflow,
            "singleton.max_queue_depth",
            f"must be None with on_busy={str(on_busy)!r}, which fixes the queue's depth itself",
        )
    if on_busy == OnBusy.CANCEL_IN_PROGRESS and value.limit != 1:
        raise InvalidWorkflowError(
            workflow,
            "singleton.limit",
            f"must be 1 with on_busy={str(on_busy)!r}: it cancels every holder to admit one run",
        )
    return value if value.on_busy is on_busy else replace(value, on_busy=on_busy)


#: The shortest throttle ``period`` in seconds (X6a): every store counts a window's
#: admissions in microseconds, so a shorter window never holds one.
MIN_THROTTLE_PERIOD = 0.001


def _seconds(workflow: str, where: str, value: object) -> float:
    """Return ``value``, a duration in seconds of a declaration (a queue TTL, an
    execution timeout), as a float; raise :class:`InvalidWorkflowError` naming
    ``workflow`` and the field ``where`` unless it is an int or float (not a
    bool), finite, > 0 and at most :data:`~durable_singleton.values.MAX_SECONDS`
    (100 years), the bound of every duration the package takes, so that a time
    computed from it stays within every database's datetime range (X2, D5, section 7)."""
    try:
        return check_seconds(value, where, low=0.0, strict=True)
    except ValidationError as exc:
        raise InvalidWorkflowError(workflow, where, str(exc).removeprefix(f"{where} ")) from None


def _depth(workflow: str, where: str, limit: int, depth: object) -> int | None:
    """Return ``depth``, the waiters a declaration allows beyond ``limit`` (S15,
    X3j), or None; raise :class:`InvalidWorkflowError` unless it is None or an
    int (not a bool) >= 0 with ``limit + depth`` at most
    :data:`~durable_singleton.values.MAX_LIMIT`, the largest count every
    database compares (section 7)."""
    if depth is None:
        return None
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_LIMIT - limit:
        raise InvalidWorkflowError(
            workflow,
            where,
            f"must be None or an int from 0 to {MAX_LIMIT} - limit ({MAX_LIMIT - limit}), got {depth!r:.80}",
        )
    return depth


def _same_function(a: Callable[..., Any] | None, b: Callable[..., Any] | None) -> bool:
    """Whether two key functions are one declaration (X3a): the same object, or
    the same module, qualified name, code (its bytecode, constants and names),
    defaults and closure values, as a module executed again (a reload, a second
    import) defines it. Two lambdas of one line that read different fields
    (``i["account"]``, ``i["tenant"]``) differ in their constants; two made by
    one factory with different fields, in their closures."""
    if a is b:
        return True
    if a is None or b is None:
        return False

    def signature(f: Callable[..., Any]) -> tuple[Any, ...] | None:
        code = getattr(f, "__code__", None)
        if code is None:
            return None
        cells = tuple(cell.cell_contents for cell in getattr(f, "__closure__", None) or ())
        return (
            getattr(f, "__module__", None),
            getattr(f, "__qualname__", None),
            code.co_code,
            code.co_consts,
            code.co_names,
            getattr(f, "__defaults__", None),
            getattr(f, "__kwdefaults__", None),
            cells,
        )

    try:
        first = signature(a)
        return first is not None and bool(first == signature(b))
    except Exception:  # a closure value that cannot be compared, or an empty cell: not shown to be one
        return False


@dataclass(frozen=True)
class Quota:
    """A limit shared across workflows (X3, X3a): at most ``limit`` runs per
    quota key hold a slot at a time, whatever workflow started them.

    Declare it once, at module level, and name it in ``quotas=[...]`` of every
    workflow it limits, beside or instead of ``singleton``.
    ``name``: a non-empty ``str`` of at most 64 characters without ``:``.
    ``key``: callable taking the run input and returning a non-empty ``str``
    of at most 127 characters, computed once at start (X3a, S1); the default
    gives every run the one key ``"*"`` (a global limit).
    ``limit``: slots per quota key, an ``int`` from 1 to
    :data:`~durable_singleton.values.MAX_LIMIT`.
    ``fair_key``: None (the default: oldest first), or a callable taking the
    run input and returning its sub-key (a tenant), a non-empty ``str`` of at
    most 127 characters computed once at start: the quota key's free slots
    then go round-robin across sub-keys (X4, :func:`~durable_singleton.admission.fair_tag`).
    ``weights``: with ``fair_key``, a mapping from sub-key to an ``int`` >= 1,
    the slots that sub-key gets per round (default 1).
    ``max_queue_depth``: waiters allowed beyond ``limit`` per quota key (an
    ``int`` >= 0, with ``limit + max_queue_depth`` at most ``MAX_LIMIT``), or
    None (the default: unbounded). A start that finds the quota key with
    ``limit + max_queue_depth`` active members (holders and waiters, the
    key's runtime limit override in force, K2) raises
    :class:`~durable_singleton.exceptions.QuotaQueueFullError` and writes
    nothing (S15 for a quota key, X3j).

    A run is admitted only when each of its limits (its singleton key, if any,
    and each quota key) has room for it, oldest first by (``created_at``,
    ``run_id``) in each (X3d); its slots are freed together when it settles
    (X3g). Raises :class:`InvalidWorkflowError` at registration (X3a).
    """

    name: str
    key: Callable[[Any], str] = field(default=lambda _input: "*")
    limit: int = 1
    fair_key: Callable[[Any], str] | None = None
    weights: Mapping[str, int] | None = field(default=None, hash=False)
    max_queue_depth: int | None = None

    def check(self, workflow: str) -> Quota:
        """Return this quota, validated; raise :class:`InvalidWorkflowError`
        naming ``workflow`` and the field (X3a)."""
        name = self.name
        valid = isinstance(name, str) and ":" not in name
        try:
            check_text(name, "quotas.name", QUOTA_NAME_MAX_LENGTH)
        except ValidationError:
            valid = False
        if not valid:
            raise InvalidWorkflowError(
                workflow,
                "quotas.name",
                f"must be a str of at most {QUOTA_NAME_MAX_LENGTH} characters with a non-space one, without ':',"
                f" a control character or a lone surrogate, got {name!r:.80}",
            )
        if not callable(self.key):
            raise InvalidWorkflowError(workflow, "quotas.key", f"of quota {name!r} must be callable (input -> str)")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_LIMIT:
            raise InvalidWorkflowError(
                workflow, "quotas.limit", f"of quota {name!r} must be an int from 1 to {MAX_LIMIT}"
            )
        _depth(workflow, "quotas.max_queue_depth", self.limit, self.max_queue_depth)
        if self.fair_key is not None and not callable(self.fair_key):
            raise InvalidWorkflowError(workflow, "quotas.fair_key", f"of quota {name!r} must be callable or None")
        if self.weights is not None:
            if self.fair_key is None or not isinstance(self.weights, Mapping):
                raise InvalidWorkflowError(
                    workflow, "quotas.weights", f"of quota {name!r} must be a mapping, beside a fair_key"
                )
            for sub, weight in self.weights.items():
                try:
                    check_text(sub, "a sub-key", QUOTA_KEY_MAX_LENGTH)
                except ValidationError:
                    raise InvalidWorkflowError(
                        workflow, "quotas.weights", f"of quota {name!r}: a sub-key must be a non-empty str"
                    ) from None
                if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT:
                    raise InvalidWorkflowError(
                        workflow, "quotas.weights", f"of quota {name!r}: a weight must be an int from 1 to {MAX_WEIGHT}"
                    )
        return self

    def weight(self, sub_key: str) -> int:
        """Return the slots per round of ``sub_key`` (X4): its weight, else 1."""
        return int((self.weights or {}).get(sub_key, 1))

    @property
    def cap(self) -> int | None:
        """Return the active members of a quota key at which a start is refused,
        ``limit + max_queue_depth``, or None (unbounded) (S15, X3j)."""
        return queue_cap(self.limit, self.max_queue_depth)


@dataclass(frozen=True)
class Debounce:
    """Fold a burst of starts into one run (X7): ``debounce=Debounce(...)`` on a workflow.

    ``key``: callable taking the run input and returning a non-empty ``str``
    of at most 191 characters, computed once at each start (a key function
    that raises or returns anything else makes the start raise
    :class:`~durable_singleton.exceptions.SingletonKeyError` naming the
    debounce key, and write nothing).
    ``seconds``: the quiet period, in seconds (``int`` or ``float``, finite,
    > 0, at most :data:`~durable_singleton.values.MAX_SECONDS`): a debounced
    run starts ``seconds`` after the last start of its burst, on the
    database's clock.
    ``max_seconds``: the longest a burst may hold its run back, in seconds
    from the burst's first start (same type and bounds, >= ``seconds``):
    required, so that a burst that never pauses still runs.

    A start whose debounce key has an open run (X7a: pending, holding no
    slot, no lease, its start time still later than the database's now)
    creates nothing: that run takes the start's input (the newest wins) and
    its start time moves to ``seconds`` after this start, never past
    ``max_seconds`` after the burst's first start; the start returns that
    run (docs/debounce.rst). Raises :class:`InvalidWorkflowError` at
    registration (from :meth:`check`).
    """

    key: Callable[[Any], str]
    seconds: float
    max_seconds: float

    def check(self, workflow: str) -> Debounce:
        """Return this declaration, validated; raise :class:`InvalidWorkflowError`
        naming ``workflow`` and the field (X7)."""
        if not callable(self.key):
            raise InvalidWorkflowError(workflow, "debounce.key", "must be callable (input -> str)")
        seconds = _seconds(workflow, "debounce.seconds", self.seconds)
        most = _seconds(workflow, "debounce.max_seconds", self.max_seconds)
        if most < seconds:
            raise InvalidWorkflowError(
                workflow,
                "debounce.max_seconds",
                f"must be at least seconds ({seconds!r}), got {self.max_seconds!r:.80}",
            )
        return self


@dataclass(frozen=True)
class Throttle:
    """A rate limit shared across workflows (X6): at most ``limit`` runs per throttle
    key are admitted within any interval of ``period`` seconds, on the database's clock.

    Declare it once, at module level, and name it in ``throttles=[...]`` of every
    workflow it limits, beside or instead of ``singleton`` and ``quotas``.
    ``name``: a non-empty ``str`` of at most 64 characters without ``:``.
    ``key``: callable taking the run input and returning a non-empty ``str`` of at
    most 127 characters, computed once at start (S1); the default gives every run
    the one key ``"*"`` (a global rate).
    ``limit``: admissions per window, an ``int`` from 1 to
    :data:`~durable_singleton.values.MAX_LIMIT`.
    ``period``: the window in seconds, an ``int`` or ``float``, finite, at least
    :data:`MIN_THROTTLE_PERIOD` (a millisecond) and at most
    :data:`~durable_singleton.values.MAX_SECONDS`.

    Admissions are counted, not starts: a run counts when it is admitted (it takes
    its slot in every limit it carries, X3d), and an admission that later fails
    still counts. A run over the rate is parked with its ``wake_at`` at the window's
    opening (:func:`~durable_singleton.admission.throttle_room`); it is one more
    limit of X3 (docs/throttle.rst). Raises :class:`InvalidWorkflowError` at
    registration (:meth:`check`).
    """

    name: str
    key: Callable[[Any], str] = field(default=lambda _input: "*")
    limit: int = 1
    period: float = 1.0

    def check(self, workflow: str) -> Throttle:
        """Return this throttle, validated; raise :class:`InvalidWorkflowError`
        naming ``workflow`` and the field (X6)."""
        name = self.name
        valid = isinstance(name, str) and ":" not in name
        try:
            check_text(name, "throttles.name", QUOTA_NAME_MAX_LENGTH)
        except ValidationError:
            valid = False
        if not valid:
            raise InvalidWorkflowError(
                workflow,
                "throttles.name",
                f"must be a str of at most {QUOTA_NAME_MAX_LENGTH} characters with a non-space one, without ':',"
                f" a control character or a lone surrogate, got {name!r:.80}",
            )
        if not callable(self.key):
            raise InvalidWorkflowError(
                workflow, "throttles.key", f"of throttle {name!r} must be callable (input -> str)"
            )
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or not 1 <= self.limit <= MAX_LIMIT:
            raise InvalidWorkflowError(
                workflow,
                "throttles.limit",
                f"of throttle {name!r} must be an int from 1 to {MAX_LIMIT}, got {self.limit!r:.80}",
            )
        try:
            _seconds(workflow, "throttles.period", self.period)
        except InvalidWorkflowError as exc:
            # Name the throttle, as the limit's and the key's messages do.
            problem = str(exc).removeprefix(f"workflow {workflow!r}: throttles.period: ")
            raise InvalidWorkflowError(workflow, "throttles.period", f"of throttle {name!r} {problem}") from None
        if float(self.period) < MIN_THROTTLE_PERIOD:
            # The stores count a window in microseconds: a shorter one never holds an admission.
            raise InvalidWorkflowError(
                workflow,
                "throttles.period",
                f"of throttle {name!r} must be at least {MIN_THROTTLE_PERIOD} s, got {self.period!r:.80}",
            )
        return self

    @property
    def lock_name(self) -> str:
        """Return the key table's name of this throttle, ``throttle:<name>`` (X6, K2)."""
        return throttle_lock_name(self.name)


@dataclass(frozen=True)
class WorkflowOptions:
    """Typed workflow options, accepted wherever a ``workflow = {...}`` mapping is.

    ``timeout`` is the execution timeout in seconds (D5); ``steps`` optionally
    lists the step names the body calls, checked at registration; ``queue``
    is the Celery queue its turns are sent to (None: the default queue).
    """

    name: str
    version: str = "1"
    singleton: Singleton | Mapping[str, Any] | None = None
    timeout: float | None = None
    steps: tuple[str, ...] = ()
    queue: str | None = None
    on_dead: Callable[[RunRecord], None] | None = None
    events: tuple[str, ...] = ()
    schedules: tuple[Schedule, ...] = ()
    quotas: tuple[Quota, ...] = ()
    debounce: Debounce | None = None
    throttles: tuple[Throttle, ...] = ()


@dataclass(frozen=True)
class WorkflowDefinition:
    """A registered workflow: its identity, its body and its options."""

    name: str
    version: str
    body: Body | None
    singleton: Singleton | None = None
    timeout: float | None = None
    steps: tuple[str, ...] = ()
    queue: str | None = None
    on_dead: Callable[[RunRecord], None] | None = None
    origin: str = ""
    remote: bool = False
    events: tuple[str, ...] = ()
    schedules: tuple[Schedule, ...] = ()
    #: The shared quotas the workflow's runs carry, sorted by name (X3).
    quotas: tuple[Quota, ...] = ()
    #: The workflow's debounce (X7), or None.
    debounce: Debounce | None = None
    #: The shared throttles the workflow's runs carry, sorted by name (X6).
    throttles: tuple[Throttle, ...] = ()

    @property
    def label(self) -> str:
        """Return ``name@version``."""
        return f"{self.name}@{self.version}"


def origin_of(obj: object) -> str:
    """Name where ``obj`` was defined, so re-registering the same body is a no-op."""
    code = getattr(obj, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}{line}"


@dataclass
class Registry:
    """Workflows by (name, version) and step handlers by name."""

    workflows: dict[tuple[str, str], WorkflowDefinition] = field(default_factory=dict)
    latest: dict[str, WorkflowDefinition] = field(default_factory=dict)
    steps: dict[str, StepHandler] = field(default_factory=dict)
    resolvers: list[Callable[[Registry, str], bool]] = field(default_factory=list)
    #: Every quota a registered workflow names, by name (X3a).
    quotas: dict[str, Quota] = field(default_factory=dict)
    #: Every throttle a registered workflow names, by name (X6).
    throttles: dict[str, Throttle] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def add_resolver(self, resolver: Callable[[Registry, str], bool]) -> None:
        """Add ``resolver(registry, name)``, asked by :meth:`get` for a name it does not know.

        A resolver registers the workflow ``name`` (e.g. by importing its
        module) and returns True, or returns False. The django.tasks backend
        uses one, so a worker process learns a task's workflow from its name.
        Adding the same resolver twice is a no-op.
        """
        with self._lock:
            if resolver not in self.resolvers:
                self.resolvers.append(resolver)

    def add_step(self, name: str, handler: StepHandler) -> None:
        """Register a step handler under ``name``.

        Raises :class:`InvalidWorkflowError` for an empty name, a non-callable
        handler, or a name taken by another handler.
        """
        if not isinstance(name, str) or not name:
            raise InvalidWorkflowError(str(name), "step", "a step name must be a non-empty string")
        if not callable(handler):
            raise InvalidWorkflowError(name, "step", "a step handler must be callable")
        with self._lock:
            existing = self.steps.get(name)
            if existing is not None and origin_of(existing) != origin_of(handler):
                raise InvalidWorkflowError(name, "step", f"already registered by {origin_of(existing)}")
            self.steps[name] = handler

    def get_step(self, name: str) -> StepHandler:
        """Return the handler of step ``name``; raise :class:`UnknownStepError`."""
        try:
            return self.steps[name]
        except KeyError:
            raise UnknownStepError(f"no step named {name!r} is registered (use @step({name!r}))") from None

    def add(
        self,
        name: str,
        version: str,
        body: Body | None,
        *,
        singleton: Singleton | Mapping[str, Any] | None = None,
        timeout: float | None = None,
        steps: Iterable[str] = (),
        queue: str | None = None,
        on_dead: Callable[[RunRecord], None] | None = None,
        origin: str | None = None,
        remote: bool = False,
        events: Iterable[str] = (),
        schedules: Iterable[Schedule] = (),
        quotas: Iterable[Quota] = (),
        debounce: Debounce | None = None,
        throttles: Iterable[Throttle] = (),
    ) -> WorkflowDefinition:
        """Validate and register a workflow; return its definition.

        ``debounce``: a :class:`Debounce` (X7), or None; it takes no
        ``on_busy`` that ends other runs (``"replace_queued"``,
        ``"cancel_in_progress"``), and a ``queue_ttl`` must be longer than its
        ``max_seconds`` (a burst would else expire its own run).

        ``quotas``: the shared :class:`Quota` limits its runs carry (X3); a
        name of the form ``quota:...``, a quota named twice, or a quota whose
        name another registered workflow declares with another limit or key
        function raises :class:`InvalidWorkflowError` (X3a).
        ``throttles``: the shared :class:`Throttle` limits its runs carry (X6),
        checked as ``quotas`` are (a name ``throttle:...``, a throttle named twice,
        or one name declared with another limit, period or key function raise
        :class:`InvalidWorkflowError`).

        Raises :class:`InvalidWorkflowError` (naming the workflow and field) or
        :class:`DuplicateWorkflowError` if (name, version) is already taken by
        another body. Registering the same body twice is a no-op.
        """
        if not isinstance(name, str) or not name or len(name) > NAME_MAX_LENGTH:
            raise InvalidWorkflowError(str(name), "name", f"must be a non-empty str of at most {NAME_MAX_LENGTH}")
        if not isinstance(version, str) or not version or len(version) > VERSION_MAX_LENGTH:
            raise InvalidWorkflowError(name, "version", f"must be a non-empty str of at most {VERSION_MAX_LENGTH}")
        if not remote and not callable(body):
            raise InvalidWorkflowError(name, "body", "must be callable (ctx, input) -> output")
        single = Singleton.coerce(name, singleton)
        quota_specs = self._check_quotas(name, quotas)
        throttle_specs = self._check_throttles(name, throttles)
        fair = [q.name for q in quota_specs if q.fair_key is not None]
        if fair and (single is not None or len(quota_specs) > 1 or throttle_specs):
            raise InvalidWorkflowError(
                name,
                "quotas",
                f"the fair quota {fair[0]!r} must be the workflow's only limit (no singleton key, no other"
                " quota): its order by sub-key and another limit's oldest-first order could each hold back"
                " the run the other admits next, and no run would be admitted (X4d)",
            )
        if timeout is not None:
            timeout = _seconds(name, "timeout", timeout)
        debounced = self._check_debounce(name, debounce, single)
        step_names = tuple(steps)
        for step_name in step_names:
            if step_name not in self.steps:
                raise InvalidWorkflowError(name, "steps", f"unknown step {step_name!r}")
        if on_dead is not None and not callable(on_dead):
            raise InvalidWorkflowError(name, "on_dead", "must be callable (run) -> None")
        event_names = tuple(events)
        if isinstance(events, str) or any(not isinstance(e, str) or not e for e in event_names):
            raise InvalidWorkflowError(name, "events", "must be a sequence of non-empty event names")
        schedule_specs = coerce_schedules(name, tuple(schedules))
        definition = WorkflowDefinition(
            name=name,
            version=version,
            body=body,
            singleton=single,
            timeout=float(timeout) if timeout is not None else None,
            steps=step_names,
            queue=queue,
            on_dead=on_dead,
            origin=origin or origin_of(body),
            remote=remote,
            events=event_names,
            schedules=schedule_specs,
            quotas=quota_specs,
            debounce=debounced,
            throttles=throttle_specs,
        )
        with self._lock:
            existing = self.workflows.get((name, version))
            if existing is not None and existing.origin != definition.origin:
                raise DuplicateWorkflowError(name, "version", f"{version!r} is already registered by {existing.origin}")
            for quota in quota_specs:
                known = self.quotas.get(quota.name)
                if known is not None and (
                    known.limit != quota.limit
                    or not _same_function(known.key, quota.key)
                    or not _same_function(known.fair_key, quota.fair_key)
                    or dict(known.weights or {}) != dict(quota.weights or {})
                    or known.max_queue_depth != quota.max_queue_depth
                ):
                    first = next(
                        (d.name for d in self.latest.values() if quota.name in {q.name for q in d.quotas}), "?"
                    )
                    raise InvalidWorkflowError(
                        name,
                        "quotas",
                        f"quota {quota.name!r} is declared by workflow {first!r} with another limit, key,"
                        " fair_key, weights or max_queue_depth: declare it once and name that one object",
                    )
            for throttle in throttle_specs:
                seen = self.throttles.get(throttle.name)
                if seen is not None and (
                    seen.limit != throttle.limit
                    or float(seen.period) != float(throttle.period)
                    or not _same_function(seen.key, throttle.key)
                ):
                    first = next(
                        (d.name for d in self.latest.values() if throttle.name in {t.name for t in d.throttles}), "?"
                    )
                    raise InvalidWorkflowError(
                        name,
                        "throttles",
                        f"throttle {throttle.name!r} is declared by workflow {first!r} with another limit, period"
                        " or key: declare it once and name that one object",
                    )
            self.quotas.update((q.name, q) for q in quota_specs)
            self.throttles.update((t.name, t) for t in throttle_specs)
            self.workflows[(name, version)] = definition
            self.latest[name] = definition
        return definition

    @staticmethod
    def _check_debounce(name: str, debounce: object, single: Singleton | None) -> Debounce | None:
        """Return the workflow's :class:`Debounce` validated, or None (X7, X7e)."""
        if debounce is None:
            return None
        if not isinstance(debounce, Debounce):
            raise InvalidWorkflowError(name, "debounce", f"expected Debounce or None, got {type(debounce).__name__}")
        debounce.check(name)
        if single is not None and single.supersedes:
            raise InvalidWorkflowError(
                name,
                "debounce",
                f"takes no on_busy={str(single.on_busy)!r}: a debounced start folds into its run, it ends no"
                " other run (X7e)",
            )
        if single is not None and single.queue_ttl is not None and single.queue_ttl <= debounce.max_seconds:
            raise InvalidWorkflowError(
                name,
                "singleton.queue_ttl",
                f"must be longer than debounce.max_seconds ({debounce.max_seconds!r}): a burst would expire its"
                " own run before it starts (X7e)",
            )
        return debounce

    @staticmethod
    def _check_quotas(name: str, quotas: Iterable[Quota]) -> tuple[Quota, ...]:
        """Return the workflow's quotas validated and sorted by name (X3a, X3e)."""
        if name.startswith(QUOTA_PREFIX):
            raise InvalidWorkflowError(name, "name", f"{QUOTA_PREFIX!r} is the prefix of quota keys (X3b)")
        if isinstance(quotas, (str, Quota)) or quotas is None:
            raise InvalidWorkflowError(name, "quotas", "must be a sequence of Quota")
        specs = tuple(quotas)
        for quota in specs:
            if not isinstance(quota, Quota):
                raise InvalidWorkflowError(name, "quotas", f"expected Quota, got {type(quota).__name__}")
            quota.check(name)
        names = [q.name for q in specs]
        if len(set(names)) != len(names):
            raise InvalidWorkflowError(name, "quotas", f"names a quota twice: {sorted(names)}")
        return tuple(sorted(specs, key=lambda q: q.name))

    @staticmethod
    def _check_throttles(name: str, throttles: Iterable[Throttle]) -> tuple[Throttle, ...]:
        """Return the workflow's throttles validated and sorted by name (X6)."""
        if name.startswith(THROTTLE_PREFIX):
            raise InvalidWorkflowError(name, "name", f"{THROTTLE_PREFIX!r} is the prefix of throttle keys (X6)")
        if isinstance(throttles, (str, Throttle)) or throttles is None:
            raise InvalidWorkflowError(name, "throttles", "must be a sequence of Throttle")
        specs = tuple(throttles)
        for throttle in specs:
            if not isinstance(throttle, Throttle):
                raise InvalidWorkflowError(name, "throttles", f"expected Throttle, got {type(throttle).__name__}")
            throttle.check(name)
        names = [t.name for t in specs]
        if len(set(names)) != len(names):
            raise InvalidWorkflowError(name, "throttles", f"names a throttle twice: {sorted(names)}")
        return tuple(sorted(specs, key=lambda t: t.name))

    def throttle_limits(self) -> dict[str, int]:
        """Return the declared limit of every throttle, by its key-table name
        ``throttle:<name>`` (X6): passed to a claim beside the quotas' limits."""
        with self._lock:
            return {throttle_lock_name(t.name): t.limit for t in self.throttles.values()}

    def throttle_periods(self) -> dict[str, float]:
        """Return the declared ``period`` in seconds of every throttle, by name (X6):
        what the retention keeps of its admissions."""
        with self._lock:
            return {t.name: float(t.period) for t in self.throttles.values()}

    def quota_limits(self) -> dict[str, int]:
        """Return the declared limit of every quota, by its key-table name
        ``quota:<name>`` (X3b): the limits a claim passes its store beside the
        workflows' (:meth:`Core.limits <durable_singleton.core.Core.limits>`)."""
        with self._lock:
            return {f"{QUOTA_PREFIX}{q.name}": q.limit for q in self.quotas.values()}

    def queue_ttls(self) -> dict[str, float]:
        """Return the ``queue_ttl`` in seconds of every workflow whose latest
        registered version declares one, by name (X2): the one place that says
        which TTL a workflow's waiters have, whatever version started them."""
        with self._lock:
            return {
                d.name: float(d.singleton.queue_ttl)
                for d in self.latest.values()
                if d.singleton is not None and d.singleton.queue_ttl is not None
            }

    def subscribers(self, event: str) -> list[WorkflowDefinition]:
        """Return the latest definition of every workflow subscribed to ``event`` (D8)."""
        with self._lock:
            return [d for d in self.latest.values() if event in d.events]

    def get(self, name: str, version: str | None = None) -> WorkflowDefinition:
        """Return the definition of ``name`` (latest registered version by default).

        Raises :class:`UnknownWorkflowError`.
        """
        found = self._find(name, version)
        if found is None and any(resolve(self, name) for resolve in list(self.resolvers)):
            found = self._find(name, version)
        if found is None:
            raise UnknownWorkflowError(f"no workflow named {name!r}" + (f" version {version!r}" if version else ""))
        return found

    def _find(self, name: str, version: str | None) -> WorkflowDefinition | None:
        with self._lock:
            return self.latest.get(name) if version is None else self.workflows.get((name, version))


#: The process-wide registry that the decorators fill and the default engine reads.
registry = Registry()


def step(name: str, *, registry: Registry = registry) -> Callable[[StepHandler], StepHandler]:
    """Register the decorated function as step ``name`` (R4).

    The handler takes the step input and returns a JSON-serializable result,
    which is stored and returned on every replay instead of calling it again.
    """

    def decorate(handler: StepHandler) -> StepHandler:
        registry.add_step(name, handler)
        return handler

    return decorate
