"""The core: starts runs, executes one turn at a time through the store's
claim, settles and hands freed slots off, cancels, retries, signals, emits,
and runs the tick's own jobs.

The core knows the store seam (:class:`~durable_singleton.stores.base.BaseStore`)
and the dispatcher seam (:class:`~durable_singleton.dispatcher.Dispatcher`),
not the ORM, and nothing of Celery. The features above it (key controls,
explain, audit, schedules, retention, the heartbeat, the async twins) take a
:class:`Core` and join the façade :class:`~durable_singleton.engine.Engine`
by attribute; nothing here imports them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, ClassVar

from . import signals, tracing
from .admission import (
    QUOTA_PREFIX,
    RESERVED_TAGS,
    check_not_before,
    check_priority,
    compute_debounce_key,
    compute_quota_key,
    compute_singleton_key,
    quota_lock_name,
)
from .conf import Settings, get_settings
from .context import Interrupted, Suspend, WorkflowCtx
from .definitions import Registry, Singleton, WorkflowDefinition, registry
from .dispatcher import Dispatcher
from .exceptions import (
    InvalidInputError,
    InvalidNotBeforeError,
    InvalidRunIdError,
    LeaseLostError,
    QuotaQueueFullError,
    RunCancelledError,
    RunIdInUseError,
    RunNotFoundError,
    SingletonBusyError,
    SingletonQueueFullError,
    UnknownWorkflowError,
    UnsupportedByStoreError,
    ValidationError,
)
from .identity import process_name
from .leases import renewer
from .statuses import OnBusy, Outcome, ParkReason, RunStatus, SlotState, Verdict
from .stores.base import (
    TIMEOUT_ERROR,
    BaseStore,
    Finish,
    RetryPolicy,
    RunRecord,
    StepRecord,
    TurnState,
    cancel_error,
    warn_fallback,
)
from .values import check_text, derived_id, printable, to_json_value

__all__ = ["ERROR_TEXT_CHARS", "RUN_ID_MAX_LENGTH", "Core", "StoreClock", "TickJob", "TickReport"]

logger = logging.getLogger("durable_singleton")

RUN_ID_MAX_LENGTH = 191

#: The park reason of a run handed back after an interrupted turn, followed by
#: the number of interruptions in a row.
INTERRUPTED_REASON = ParkReason.INTERRUPTED.value

#: Most characters of a body's exception message, and of its traceback, kept
#: in a failed run's ``error`` (the rest is cut, with a marker), so the error
#: always fits a row on every database (MySQL/MariaDB's ``max_allowed_packet``).
ERROR_TEXT_CHARS = 10_000

#: The park reason of a run handed back because its worker was shutting down (R7).
_CUT = "\n[... cut at ERROR_TEXT_CHARS]"


def _bounded(text: str) -> str:
    text = printable(text)
    return text if len(text) <= ERROR_TEXT_CHARS else text[: ERROR_TEXT_CHARS - len(_CUT)] + _CUT


@dataclass
class TickReport:
    """What one tick did, batch by batch (S8b)."""

    dispatched: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    #: Waiters ended by their key's ``queue_ttl`` (X2).
    expired: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    caught_up: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


#: One job of the tick: a name (for the log and ``TickReport.errors``) and a
#: callable that does one bounded batch and records what it did in the report.
TickJob = tuple[str, Callable[[TickReport], None]]


def _delayed(run: RunRecord) -> bool:
    """Tell whether a new run's start is delayed past its creation (X5): no turn
    is sent for it; its ``wake_at`` is its ``not_before``, when the tick sends it."""
    return run.not_before is not None and run.not_before > run.created_at


#: A step back this much beyond the last round trip is a clock step, not a
#: correction's jitter (:meth:`StoreClock.__call__`).
_STEP_TOLERANCE = timedelta(milliseconds=1)


class StoreClock:
    """This process's clock, corrected to the store's clock (R5, R8).

    Times the engine computes (``created_at``, deadlines, sleep targets) use
    it, so a process whose own clock is off still writes times on the store's
    clock; the offset is measured again every ``refresh_seconds``, and by
    :meth:`correct`, which a start calls first so that a clock stepped since
    the last measurement never orders runs (R8).
    """

    def __init__(self, store: BaseStore, refresh_seconds: float = 300.0) -> None:
        from django.utils import timezone

        self._store = store
        self._local = timezone.now
        self._refresh = refresh_seconds
        self._offset = timedelta(0)
        self._rtt = timedelta(0)
        self._measured: float | None = None
        self._last: datetime | None = None
        self._last_rtt = timedelta(0)  # the round trip of the correction ``_last`` was computed with

    def __call__(self) -> datetime:
        if self._measured is None or time.monotonic() - self._measured > self._refresh:
            self.correct()
        # Each correction measures the offset within half its round trip: two
        # times computed with two corrections can come out of order by up to
        # half of each one's round trip (a thread paused during one read of
        # the store's clock makes that round trip long). A time up to both
        # round trips before one already returned is held at it, so two starts
        # of this process keep their order (S5). A larger step back is the
        # process clock stepping (NTP, a resumed VM), and a held time would be
        # wrong for as long as the step (R8). A naive clock (USE_TZ = False,
        # refused by check E012) is never compared with an aware one.
        now = self._local() + self._offset
        last = self._last
        if (
            last is not None
            and (last.tzinfo is None) == (now.tzinfo is None)
            and last - self._rtt - self._last_rtt - _STEP_TOLERANCE <= now < last
        ):
            now = last  # held: its uncertainty stays that of the correction it came from
        else:
            self._last_rtt = self._rtt
        self._last = now
        return now

    def correct(self) -> None:
        """Measure the offset to the store's clock now (one read of it)."""
        self._measured = time.monotonic()
        try:
            before = self._local()
            remote = self._store.now()
            after = self._local()
            rtt = after - before
            offset = remote - (before + rtt / 2)
            self._offset, self._rtt = offset, rtt
        except Exception:  # the store is unreachable: keep the last offset, try later
            logger.warning("could not read the store's clock; keeping offset %s", self._offset, exc_info=True)


class Core:
    """Runs durable workflows over a store and a dispatcher: the turn protocol.

    The public class is the façade :class:`~durable_singleton.engine.Engine`,
    which adds the features; a :class:`Core` is what those features are given.

    ``store``: a :class:`~durable_singleton.stores.base.BaseStore`.
    ``dispatcher``: sends turns (Celery, the embedded worker, or manual).
    ``namespace``/``scope_reads``: D10; admission stays global (S11).
    ``settings``: a :class:`~durable_singleton.conf.Settings` (default: Django settings).
    ``clock``: returns the current aware datetime (default: the store's clock, R5).
    """

    #: The ``sender`` of the lifecycle signals (:mod:`durable_singleton.signals`):
    #: the façade class, :class:`~durable_singleton.engine.Engine`.
    signal_sender: ClassVar[type] = object

    def __init__(
        self,
        store: BaseStore,
        dispatcher: Dispatcher,
        *,
        registry: Registry = registry,
        namespace: str | None = None,
        scope_reads: bool | None = None,
        settings: Settings | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        self.store: BaseStore = store
        self.dispatcher = dispatcher
        self.registry = registry
        self.settings = settings or get_settings()
        self.namespace = namespace if namespace is not None else self.settings.NAMESPACE
        self.scope_reads = scope_reads if scope_reads is not None else self.settings.SCOPE_READS
        self.now: Callable[[], datetime] = clock or StoreClock(store)
        #: The default clock, corrected at each start; None when the caller gave ``clock``.
        self._store_clock = self.now if isinstance(self.now, StoreClock) else None
        self._warned_fallback = False
        self._warned_queue_ttl = False
        self._local = threading.local()

    def corrected_now(self) -> datetime:
        """Return the current time with the process clock corrected first (R8).

        On the default clock (:class:`StoreClock`) this is one read of the
        store's clock; an injected ``clock`` is used as it is.
        """
        if isinstance(self.now, StoreClock):
            self.now.correct()
        return self.now()

    def caller_now(self) -> datetime | None:
        """Return the time a write the store can time itself is given (R8).

        None on the default clock (:class:`StoreClock`): the store writes its
        own clock's time at the moment of the write (a run's ``finished_at``,
        a schedule's windows). An injected ``clock`` is the clock of
        everything, and its time is returned.
        """
        return None if isinstance(self.now, StoreClock) else self.now()

    # -- declaring ---------------------------------------------------------
    def register(
        self,
        name: str,
        version: str,
        fn: Callable[[WorkflowCtx, Any], Any],
        *,
        singleton: Singleton | Mapping[str, Any] | None = None,
        timeout: float | None = None,
        steps: Iterable[str] = (),
        queue: str | None = None,
        on_dead: Callable[[RunRecord], None] | None = None,
    ) -> WorkflowDefinition:
        """Register plain function ``fn(ctx, input)`` as workflow ``name``@``version``.

        ``timeout`` is the execution timeout in seconds (D5). Raises
        :class:`InvalidWorkflowError` naming the workflow and the field.
        """
        return self.registry.add(
            name, version, fn, singleton=singleton, timeout=timeout, steps=steps, queue=queue, on_dead=on_dead
        )

    def register_remote(
        self,
        name: str,
        version: str,
        *,
        queue: str,
        singleton: Singleton | Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> WorkflowDefinition:
        """Declare a workflow whose body runs in another service's Celery worker.

        Turns are sent to Celery queue ``queue``, where a worker of the other
        service (sharing the database, with the body registered under the same
        name and version) executes them; admission is the same claim (S13).
        """
        return self.registry.add(
            name,
            version,
            None,
            singleton=singleton,
            timeout=timeout,
            queue=queue,
            remote=True,
            origin=f"remote:{queue}",
        )

    # -- the rules the engine owns -------------------------------------------
    def limits(self) -> dict[str, int]:
        """Return the declared limit of every singleton workflow, by name (S2),
        and of every quota, by its key-table name ``quota:<name>`` (X3b).

        The latest registered version's limit holds for every version; the
        store applies a runtime override on top (K2, :func:`effective_limit`).
        """
        limits = {d.name: d.singleton.limit for d in list(self.registry.latest.values()) if d.singleton is not None}
        limits.update(self.registry.quota_limits())
        limits.update(self.registry.throttle_limits())
        return limits

    def queue_ttls(self) -> dict[str, float]:
        """Return the declared ``queue_ttl`` in seconds of every singleton workflow
        that has one, by name (X2); the latest registered version's holds for
        every version, as its limit does (:meth:`limits`):
        :meth:`Registry.queue_ttls <durable_singleton.definitions.Registry.queue_ttls>`."""
        return self.registry.queue_ttls()

    def _retry_policy(self) -> RetryPolicy:
        settings = self.settings
        return RetryPolicy(
            settings.ADMISSION_RETRY_SECONDS, settings.ADMISSION_RETRY_JITTER_SECONDS, settings.BACKLOG_RETRY_SECONDS
        )

    def queue_of(self, run: RunRecord | str) -> str | None:
        """Return the Celery queue of ``run``'s workflow (or workflow name ``run``); None: the default."""
        name = run if isinstance(run, str) else run.workflow_name
        try:
            return self.registry.get(name).queue
        except UnknownWorkflowError:
            return None

    # -- starting ----------------------------------------------------------
    def _new_run(
        self,
        name: str,
        input: Any,
        *,
        run_id: str | None,
        tags: Iterable[str],
        version: str | None,
        parent_run_id: str | None,
        namespace: str | None,
        not_before: datetime | float | None = None,
        priority: int = 0,
    ) -> tuple[RunRecord, WorkflowDefinition, int | None]:
        """Validate a start and build its run; return (run, definition, cap). Writes nothing.

        A delayed start (``not_before`` in the future, X5) gets ``wake_at`` =
        ``not_before``: the tick sends its first turn when it is due.
        """
        priority = check_priority(priority)
        if namespace is not None:
            check_text(namespace, "namespace")
        definition = self.registry.get(name, version)
        if definition.quotas and not self.store.admits_quotas:
            raise UnsupportedByStoreError(
                f"workflow {definition.name!r} declares quotas: store {type(self.store).__name__} "
                "cannot admit under them (it needs supports_quotas and supports_atomic_admission) (X3)"
            )
        if definition.throttles and not (self.store.supports_throttles and self.store.admits_quotas):
            raise UnsupportedByStoreError(
                f"workflow {definition.name!r} declares throttles: store {type(self.store).__name__} "
                "cannot admit under them (it needs supports_throttles, supports_quotas and"
                " supports_atomic_admission) (X6)"
            )
        input = self._check_input(input, "input")
        user_tags = self._check_tags(tags)
        single = definition.singleton
        key = compute_singleton_key(definition.name, single.key, input) if single is not None else None
        if key is not None:
            try:
                check_text(key, "singleton key", len(key))
            except ValidationError as exc:
                from .exceptions import SingletonKeyError

                raise SingletonKeyError(definition.name, str(exc)) from None
        quota_keys = tuple(
            (q.name, compute_quota_key(definition.name, q.name, q.key, input)) for q in definition.quotas
        )
        # The sub-key (tenant) of each fair quota, with its weight (X4).
        shares = []
        for q in definition.quotas:
            if q.fair_key is not None:
                sub = compute_quota_key(definition.name, q.name, q.fair_key, input, "fair_key")
                try:
                    check_text(sub, "fair_key", len(sub))
                except ValidationError as exc:
                    from .exceptions import SingletonKeyError

                    raise SingletonKeyError(definition.name, str(exc), f"quota {q.name!r}") from None
                shares.append((q.name, sub, q.weight(sub)))
        quota_shares = tuple(shares)
        for name, quota_key in quota_keys:
            try:
                check_text(quota_key, "key", len(quota_key))
            except ValidationError as exc:
                from .exceptions import SingletonKeyError

                raise SingletonKeyError(definition.name, str(exc), f"quota {name!r}") from None
        throttle_keys = tuple(
            (t.name, compute_quota_key(definition.name, t.name, t.key, input, kind="throttle"), t.limit, t.period)
            for t in definition.throttles
        )
        for name, throttle_key, _limit, _period in throttle_keys:
            try:
                check_text(throttle_key, "key", len(throttle_key))
            except ValidationError as exc:
                from .exceptions import SingletonKeyError

                raise SingletonKeyError(definition.name, str(exc), f"throttle {name!r}") from None
        now = self.now()
        due_at = check_not_before(not_before, now)
        # The execution timeout (D5) counts from when the run may start (X5).
        begins = max(now, due_at) if due_at is not None else now
        run = RunRecord(
            run_id=run_id or uuid.uuid4().hex,
            workflow_name=definition.name,
            workflow_version=definition.version,
            namespace=namespace or self.namespace,
            status=RunStatus.PENDING,
            input=input,
            created_at=now,
            updated_at=now,
            user_tags=tuple(user_tags),
            singleton_key=key,
            singleton_limit=single.limit if single else None,
            tracked=single is not None,
            wake_at=now + timedelta(seconds=self.settings.REDELIVERY_SECONDS),
            deadline_at=begins + timedelta(seconds=definition.timeout) if definition.timeout else None,
            parent_run_id=parent_run_id,
            not_before=due_at,
            quota_keys=quota_keys,
            # A throttle carrier waits as a quota carrier: only its own claim admits it (X6, X3h).
            quota_slot=SlotState.WAITER if quota_keys or throttle_keys else None,
            throttle_keys=throttle_keys,
            quota_shares=quota_shares,
            quota_caps=tuple(
                (q.name, q.limit, q.max_queue_depth) for q in definition.quotas if q.max_queue_depth is not None
            ),
            trace_parent=tracing.traceparent(),
            priority=priority,
        )
        if due_at is not None and due_at > now:
            run = run.evolve(wake_at=due_at)
        return run, definition, single.cap if single is not None else None

    @tracing.started()
    def start(
        self,
        name: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        parent_run_id: str | None = None,
        namespace: str | None = None,
        not_before: datetime | float | None = None,
        priority: int = 0,
    ) -> RunRecord:
        """Create a run and dispatch its first turn after commit; never blocks (S3).

        The Celery dispatcher holds the turn back at most
        ``DISPATCH_COALESCE_SECONDS`` seconds to send it in one message with
        the other starts of this process (:meth:`Dispatcher.dispatch_soon
        <durable_singleton.dispatcher.Dispatcher.dispatch_soon>`); a lost send
        is made good by the tick after ``REDELIVERY_SECONDS`` (S8, F4).

        ``run_id``: a str of at most 191 characters with a non-space character
        and no control characters, or None for a generated one. If a run with
        that id exists it is returned as stored and nothing is created (R3,
        S16), unless it is in another namespace and this engine has
        ``scope_reads`` or the start names its ``namespace``: then
        :class:`RunIdInUseError` (D10, :meth:`_found`).
        ``input``: JSON-serializable, at most ``MAX_INPUT_BYTES`` bytes encoded.
        ``namespace`` defaults to the engine's (children pass their parent's, D7).
        ``not_before``: a delayed start (X5): an aware datetime, or seconds
        from now (int or float >= 0, on the engine's clock corrected to the
        store's, R8); None (the default) starts at once. The run is in its
        key's line from its creation, in its creation place, but is neither
        claimed nor admitted before ``not_before`` by the store's clock (the
        database's, R5), and blocks none of the due waiters behind it; no turn
        is sent before then: the tick sends it when it is due (S8).
        ``priority``: an int from -100 to 100 (default 0): among its key's due
        waiters a higher priority is admitted first, oldest first within a
        priority; a holder is never preempted (X8, docs/priority.rst). A
        run found by its ``run_id`` keeps the priority it was started with.

        Raises :class:`InvalidRunIdError`, :class:`UnknownWorkflowError`,
        :class:`InvalidInputError`, :class:`InvalidNotBeforeError` (X5),
        :class:`InvalidPriorityError` (X8),
        :class:`SingletonKeyError`, :class:`SingletonQueueFullError` (S15; its
        subclass :class:`QuotaQueueFullError` for a quota key's cap, X3j),
        :class:`SingletonBusyError` (a workflow declared ``on_busy="skip"``
        whose key has no free slot, X1), :class:`UnsupportedByStoreError` (a
        workflow declared ``on_busy="replace_queued"`` or ``"cancel_in_progress"``
        on a store without ``supports_on_busy``) or :class:`RunIdInUseError`
        (D10); each writes nothing. With ``"replace_queued"`` or
        ``"cancel_in_progress"`` the start also ends or stops the key's other
        runs, under the key's lock with its insert (X1; docs/on_busy.rst).
        """
        check_priority(priority)
        if run_id is not None:
            self._check_run_id(run_id)
            existing = self.store.get_run(run_id)
            if existing is not None:
                return self._found(existing, namespace)
        single = self.registry.get(name, version).singleton
        if self.registry.get(name, version).debounce is not None:
            return self._start_debounced(
                name,
                input,
                run_id=run_id,
                tags=tags,
                version=version,
                parent_run_id=parent_run_id,
                namespace=namespace,
                not_before=not_before,
                priority=priority,
            )
        supersedes = single is not None and single.supersedes
        # On the default clock a store that stamps starts writes created_at by its
        # own clock (R8): no read of that clock before the insert, unless the start
        # is delayed: its not_before, and the wake and deadline counted from it, are
        # the engine's times, so on a clock corrected first and not stamped again by the
        # store (R8, X5: its wake_at is its not_before). A superseding start takes the
        # ORM path, which does not stamp (X1).
        stamp = self._store_clock is not None and self.store.stamps_starts and not supersedes and not_before is None
        if not stamp:
            self._correct_clock()
        record, definition, cap = self._new_run(
            name,
            input,
            run_id=run_id,
            tags=tags,
            version=version,
            parent_run_id=parent_run_id,
            namespace=namespace,
            not_before=not_before,
            priority=priority,
        )
        delayed = _delayed(record)
        # Behind `limit` holders and `limit` waiters the run is created parked and
        # waits for the handoff or the tick's catch-up instead of a turn that
        # could only park (S8a). Keeps bursts off the broker queue. A delayed
        # start is parked until its not_before (X5).
        # A dispatcher that writes its turn in the database (DISPATCH "worker") writes
        # it in the start's own transaction: the run and its notice commit together,
        # and a rolled-back start leaves neither (O1a, O7).
        in_start = self.dispatcher.dispatches_in_transaction and not supersedes

        starting: dict[str, Any] = {
            "cap": cap,
            "cap_namespace": self.namespace if self.scope_reads else None,
            "deep_limit": definition.singleton.limit if definition.singleton is not None and not delayed else None,
            "backlog_wake_at": record.created_at + timedelta(seconds=self.settings.BACKLOG_RETRY_SECONDS),
            "stamp": stamp,
        }

        def insert() -> tuple[RunRecord, bool]:
            if in_start and not delayed and self.store.writes_turn_notices:
                # The store writes the notice with the run (one statement on PostgreSQL).
                started, was_created = self.store.start_run_with_notice(record, queue=definition.queue, **starting)
                if was_created and self._first_turn_due(started):
                    self.dispatcher.notice_written()
                return started, was_created
            started, was_created = self.store.start_run(record, **starting)
            if in_start and was_created and self._first_turn_due(started):
                self.dispatcher.dispatch_soon(started.run_id, definition.queue)
            return started, was_created

        if supersedes:
            run, created = self._start_superseding(record, definition)
        else:
            try:
                notices_in_store = in_start and not delayed and self.store.writes_turn_notices
                run, created = self.store.in_transaction(insert) if in_start and not notices_in_store else insert()
            except SingletonQueueFullError as exc:
                raise self._refused(definition, exc) from None
        if not created:  # a racing start of the same id created it first (R3)
            return self._found(run, namespace)
        self.dispatcher.on_commit(lambda: signals.run_created.send_robust(sender=self.signal_sender, run=run))
        if not in_start and self._first_turn_due(run):
            self.dispatcher.dispatch_soon(run.run_id, definition.queue)
        return run

    def _start_debounced(
        self,
        name: str,
        input: Any,
        *,
        run_id: str | None,
        tags: Iterable[str],
        version: str | None,
        parent_run_id: str | None,
        namespace: str | None,
        not_before: datetime | float | None,
        priority: int,
    ) -> RunRecord:
        """:meth:`start` of a workflow declared with ``debounce`` (X7): the store folds
        the start into its debounce key's open run or inserts a new delayed run, under
        the debounce key's lock (:meth:`BaseStore.start_debounced
        <durable_singleton.stores.base.BaseStore.start_debounced>`). No turn is sent
        now: the run starts at its ``not_before`` (X5), when the tick sends it.

        Raises what :meth:`start` raises, each writing nothing; a ``not_before``
        (the debounce sets the start time) raises :class:`InvalidNotBeforeError`;
        a debounce key function that raises or returns anything but a non-empty
        str raises :class:`SingletonKeyError` naming the debounce key; a store
        without ``supports_debounce`` raises :class:`UnsupportedByStoreError`.
        """
        if not_before is not None:
            raise InvalidNotBeforeError(
                f"workflow {name!r} is debounced: its runs start when their burst ends (X7), not at not_before"
            )
        if not self.store.supports_debounce:
            raise UnsupportedByStoreError(
                f"workflow {name!r} declares debounce: store {type(self.store).__name__} cannot debounce"
                " starts (supports_debounce is False) (X7)"
            )
        # No clock correction first: the store writes the run's times from its own clock (R5, X7b).
        record, definition, cap = self._new_run(
            name,
            input,
            run_id=run_id,
            tags=tags,
            version=version,
            parent_run_id=parent_run_id,
            namespace=namespace,
            priority=priority,
        )
        debounce = definition.debounce
        assert debounce is not None
        key = compute_debounce_key(definition.name, debounce.key, record.input)
        try:
            check_text(key, "debounce key", len(key))
        except ValidationError as exc:
            from .exceptions import SingletonKeyError

            raise SingletonKeyError(definition.name, str(exc), "debounce key") from None
        try:
            started = self.store.start_debounced(
                record.evolve(debounce_key=key),
                seconds=float(debounce.seconds),
                max_seconds=float(debounce.max_seconds),
                timeout=definition.timeout,
                cap=cap,
                cap_namespace=self.namespace if self.scope_reads else None,
                explicit_id=run_id is not None,
            )
        except SingletonQueueFullError as exc:
            raise self._refused(definition, exc) from None
        run = started.run
        if started.created:
            self.dispatcher.on_commit(lambda: signals.run_created.send_robust(sender=self.signal_sender, run=run))
            return run
        if started.folded:
            logger.debug("start folded into run %s (X7)", run.run_id)
            self.dispatcher.on_commit(lambda: signals.run_debounced.send_robust(sender=self.signal_sender, run=run))
            return run
        return self._found(run, namespace)

    @staticmethod
    def _first_turn_due(run: RunRecord) -> bool:
        """Tell whether a run just created gets its first turn now: not when
        delayed (X5) nor when created parked behind a deep queue (S8a)."""
        return not _delayed(run) and not ParkReason.SINGLETON.matches(run.park_reason)

    @staticmethod
    def _refused(definition: WorkflowDefinition, exc: SingletonQueueFullError) -> SingletonQueueFullError:
        """Name a start the queue cap refused: under ``on_busy="skip"`` the cap is
        ``limit`` (:attr:`Singleton.cap`), and its refusal is a
        :class:`SingletonBusyError` (X1, S15). The store's count decided; this only names it."""
        single = definition.singleton
        if (
            single is not None
            and single.on_busy == OnBusy.SKIP
            and not isinstance(exc, (SingletonBusyError, QuotaQueueFullError))  # a quota's cap names itself (X3j)
        ):
            return SingletonBusyError(exc.workflow, exc.key)
        return exc

    def _start_superseding(self, record: RunRecord, definition: WorkflowDefinition) -> tuple[RunRecord, bool]:
        """Start ``record`` through the store's superseding start (X1) and follow up
        what it changed, after it committed: a replaced waiter or a cancelled
        parked holder is settled (its signals, its children cancelled, its
        parent woken: D6, D7); a running holder asked to stop has its children
        cancelled and a turn sent, which settles it if its worker is gone (D6).
        Returns (the run as stored, created). Raises
        :class:`UnsupportedByStoreError` before anything is written on a store
        without ``supports_on_busy``."""
        single = definition.singleton
        assert single is not None
        if not self.store.supports_on_busy:
            raise UnsupportedByStoreError(
                f"workflow {definition.name!r} declares on_busy={str(single.on_busy)!r}: store "
                f"{type(self.store).__name__} cannot start so (supports_on_busy is False)"
            )
        started = self.store.start_superseding(
            record,
            on_busy=single.on_busy,
            limits=self.limits(),
            cap_namespace=self.namespace if self.scope_reads else None,
        )
        if started.created:
            for run in (*started.replaced, *started.cancelled):
                logger.info("run %s: %s by the start of run %s (X1)", run.run_id, run.error, record.run_id)
                self._after_settle(run)
                if run.quota_keys:
                    self.release(run)  # the quota waiters it held back get their turn (X3g)
            for run in started.stopping:
                logger.info("run %s: cancel requested by the start of run %s (X1, D6)", run.run_id, record.run_id)
                self._cancel_children(run.run_id)
                self.dispatcher.dispatch(run.run_id, self.queue_of(run))
        return started.run, started.created

    def _found(self, run: RunRecord, namespace: str | None) -> RunRecord:
        """Return ``run``, which a start in ``namespace`` (None: the engine's)
        found under its run id (R3); raise :class:`RunIdInUseError` if the run is
        in another namespace and this engine has ``scope_reads`` or the start
        names its namespace, as a child's does (D10, D7): a scoped engine never
        returns another namespace's run, and a child always lives in its parent's."""
        if run.namespace != (namespace or self.namespace) and (self.scope_reads or namespace is not None):
            raise RunIdInUseError(run.run_id)
        return run

    @tracing.started(many=True)
    def start_many(
        self,
        name: str,
        inputs: Sequence[Any],
        *,
        run_ids: Sequence[str | None] | None = None,
        not_before: datetime | float | None = None,
        priority: int = 0,
    ) -> list[RunRecord | SingletonQueueFullError | RunIdInUseError]:
        """Start one run per input of workflow ``name``: one INSERT per batch where the
        store supports it (``supports_bulk_start``), and with the Celery dispatcher one
        message per ``DISPATCH_BATCH`` runs (``execute_runs``).

        Same rules as :meth:`start`: each ``run_ids`` entry dedupes its start
        (R3) and gets the run as stored; a run rejected by its queue cap is
        returned as its :class:`SingletonQueueFullError` in its place (S15),
        an id that another namespace's run holds, on an engine with
        ``scope_reads``, as its :class:`RunIdInUseError` (D10); under
        ``on_busy="skip"`` a refused run is its :class:`SingletonBusyError`
        (X1). ``not_before`` delays every run of the batch as :meth:`start`
        does (X5); ``priority`` is every run's priority inside its key, as
        :meth:`start`'s (X8; :class:`InvalidPriorityError`). A workflow declared ``on_busy="replace_queued"`` or
        ``"cancel_in_progress"`` starts its runs one by one, in order, each
        superseding the ones before it (X1). Any other
        invalid input raises before anything is written.
        """
        check_priority(priority)
        ids = list(run_ids) if run_ids is not None else [None] * len(inputs)
        if len(ids) != len(inputs):
            raise ValidationError("run_ids must have one entry per input")
        records: list[RunRecord] = []
        caps: dict[str, int | None] = {}
        definition = self.registry.get(name)
        if definition.debounce is not None:
            return self._start_many_debounced(name, inputs, ids, not_before, priority)
        self._correct_clock()
        for input, run_id in zip(inputs, ids, strict=True):
            if run_id is not None:
                self._check_run_id(run_id)
            record, definition, cap = self._new_run(
                name,
                input,
                run_id=run_id,
                tags=(),
                version=None,
                parent_run_id=None,
                namespace=None,
                not_before=not_before,
                priority=priority,
            )
            caps[definition.name] = cap
            records.append(record)
        results: list[tuple[RunRecord, bool] | BaseException]
        supersedes = definition.singleton is not None and definition.singleton.supersedes
        # With DISPATCH "worker" the notices go in the batch's own transaction (O1a, O7).
        in_start = self.dispatcher.dispatches_in_transaction and not supersedes
        if supersedes:
            results = []
            # One caller's transaction holds every start's locks: all taken first, in the one order (X3e).
            self.store.lock_superseding_batch(records)
            for record in records:
                try:
                    results.append(self._start_superseding(record, definition))
                except QuotaQueueFullError as exc:  # a capped quota refused it, in its place (X3j, S15)
                    results.append(exc)
        else:

            def insert() -> list[tuple[RunRecord, bool] | BaseException]:
                inserted = self.store.create_runs(
                    records, caps=caps, cap_namespace=self.namespace if self.scope_reads else None
                )
                if in_start:
                    due = [r[0].run_id for r in inserted if isinstance(r, tuple) and r[1] and not _delayed(r[0])]
                    self.dispatcher.dispatch_many(due, self.queue_of(name))
                return inserted

            results = self.store.in_transaction(insert) if in_start else insert()
        out: list[RunRecord | SingletonQueueFullError | RunIdInUseError] = []
        created: list[RunRecord] = []
        for result in results:
            if isinstance(result, SingletonQueueFullError):
                out.append(self._refused(definition, result))
            elif isinstance(result, BaseException):
                raise result
            elif result[1]:
                out.append(result[0])
                created.append(result[0])
            else:
                try:
                    out.append(self._found(result[0], None))
                except RunIdInUseError as exc:
                    out.append(exc)
        queue = self.queue_of(name)
        for run in created:
            self.dispatcher.on_commit(functools.partial(signals.run_created.send, sender=self.signal_sender, run=run))
        if not in_start:
            self.dispatcher.dispatch_many([r.run_id for r in created if not _delayed(r)], queue)
        return out

    def _start_many_debounced(
        self,
        name: str,
        inputs: Sequence[Any],
        ids: Sequence[str | None],
        not_before: datetime | float | None,
        priority: int,
    ) -> list[RunRecord | SingletonQueueFullError | RunIdInUseError]:
        """:meth:`start_many` of a debounced workflow (X7): each input checked first
        (nothing is written if one is invalid), then started in order, one by one,
        each folded or created as :meth:`start` does."""
        definition = self.registry.get(name)
        debounce = definition.debounce
        assert debounce is not None
        for input, run_id in zip(inputs, ids, strict=True):
            if run_id is not None:
                self._check_run_id(run_id)
            record, _, _ = self._new_run(
                name, input, run_id=run_id, tags=(), version=None, parent_run_id=None, namespace=None
            )
            compute_debounce_key(definition.name, debounce.key, record.input)
        out: list[RunRecord | SingletonQueueFullError | RunIdInUseError] = []
        for input, run_id in zip(inputs, ids, strict=True):
            try:
                out.append(self.start(name, input, run_id=run_id, not_before=not_before, priority=priority))
            except (SingletonQueueFullError, RunIdInUseError) as exc:  # in its place, as a batch reports them
                out.append(exc)
        return out

    def _correct_clock(self) -> None:
        """Correct the default clock before a start: ``created_at`` orders runs,
        so it is on the store's clock even if this process's clock stepped since
        the last correction (R8). A clock given by the caller is used as it is."""
        if self._store_clock is not None:
            self._store_clock.correct()

    @staticmethod
    def _check_run_id(run_id: object) -> None:
        try:
            check_text(run_id, "run_id", RUN_ID_MAX_LENGTH)
        except ValidationError as exc:
            raise InvalidRunIdError(str(exc)) from None

    def _check_input(self, value: Any, what: str) -> Any:
        value = to_json_value(value, what)
        limit = self.settings.MAX_INPUT_BYTES
        if limit is not None:
            size = len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
            if size > limit:
                raise InvalidInputError(
                    f"{what} is {size} bytes encoded; at most MAX_INPUT_BYTES = {limit} are allowed"
                )
        return value

    def _check_tags(self, tags: Iterable[str]) -> list[str]:
        """Return the caller's tags, de-duplicated in order, reserved markers
        and tags spelled as a quota key's ``quota:...`` dropped (S12, X3b); at most ``MAX_TAGS`` distinct ones, else
        :class:`InvalidInputError` (section 7)."""
        if isinstance(tags, str) or tags is None:
            raise ValidationError("tags must be an iterable of str")
        limit = self.settings.MAX_TAGS
        seen: dict[str, None] = {}  # ordered and O(1) per tag: the de-duplication is linear
        for tag in tags:
            check_text(tag, "each tag")
            if tag not in RESERVED_TAGS and not tag.startswith(QUOTA_PREFIX) and tag not in seen:
                seen[tag] = None
                if len(seen) > limit:
                    raise InvalidInputError(f"a run has at most MAX_TAGS = {limit} distinct tags")
        return list(seen)

    def get(self, run_id: str) -> RunRecord:
        """Return run ``run_id``; raise :class:`RunNotFoundError`.

        An id that could not name a run (not a valid run id) is not found
        either. With ``scope_reads`` on, a run of another namespace is not found (D10).
        """
        try:
            self._check_run_id(run_id)
        except InvalidRunIdError:
            raise RunNotFoundError(f"no run {run_id!r:.80}") from None
        run = self.store.get_run(run_id)
        if run is None or (self.scope_reads and run.namespace != self.namespace):
            raise RunNotFoundError(f"no run {run_id!r}")
        return run

    # -- executing ---------------------------------------------------------
    def execute(self, run_id: str, *, known: RunRecord | None = None) -> str:
        """Execute one turn of ``run_id``: claim, gate, body until it finishes or parks.

        Safe to call twice at once for the same run: one caller wins the
        conditional claim, the others return ``"skipped"`` (R6). ``known`` is
        the run as this process just granted it (a handoff, S7). Returns an
        :class:`~durable_singleton.statuses.Outcome` value. With
        ``opentelemetry-api`` installed the turn is the span ``durable.turn``,
        a child of the context stored at the run's start (O8).
        """
        with tracing.turn(run_id) as span:
            outcome = self._execute(run_id, known, span)
            span.outcome(outcome)
            return outcome

    def _execute(self, run_id: str, known: RunRecord | None, span: Any) -> str:
        owner = f"{process_name()}:{uuid.uuid4().hex[:12]}"  # "host:pid:token:turn" (O6)
        settings = self.settings
        self.store.discard_broken_connection()  # a turn after a failed one reconnects (F7)
        if not self.store.supports_atomic_admission and not self._warned_fallback:
            self._warned_fallback = True
            warn_fallback(self.store)
        try:
            turn = self.store.begin_turn(
                run_id,
                owner,
                lease_seconds=settings.LEASE_SECONDS,
                limits=self.limits(),
                max_recoveries=settings.MAX_RECOVERIES,
                retry=self._retry_policy(),
                known=known,
                ttls=self.queue_ttls(),
            )
        except Exception as exc:
            if not self.store.is_unreachable(exc):
                raise
            self._claim_interrupted(run_id, owner, exc)
            return Outcome.INTERRUPTED
        span.claimed(turn.run)  # before the handoff below: its span is a child of this turn's
        if turn.state is TurnState.RUN:
            # This thread runs a body next: the waiters the claim granted are
            # announced as every grant is, and go to workers now (S7).
            self.announce_admitted(turn.granted)
            for granted in turn.granted:
                self.dispatcher.dispatch(granted.run_id, self.queue_of(granted))
        else:
            self.hand_off(turn.granted)
        run = turn.run
        if turn.state is TurnState.SKIPPED or run is None:
            return Outcome.SKIPPED
        if turn.state is TurnState.SETTLED:
            self._after_settle(run)
            return run.status
        if turn.state is TurnState.PARKED:
            # ``throttle``: the throttle whose full window parked it, or None (X6; the metrics count it).
            reason = ParkReason.SINGLETON.value if turn.throttled is None else ParkReason.THROTTLED.of(turn.throttled)
            signals.run_parked.send_robust(sender=self.signal_sender, run=run, reason=reason, throttle=turn.throttled)
            return Outcome.PARKED
        try:
            definition = self.registry.get(run.workflow_name, run.workflow_version)
        except UnknownWorkflowError as exc:
            return self._finish(run, owner, RunStatus.FAILED, error={"code": "unknown_workflow", "message": str(exc)})
        if definition.body is None:
            # A remote workflow reached this worker: hand the turn back to its queue.
            if self.store.park(run_id, owner, RunStatus.PENDING, wake_at=self.corrected_now()) == Verdict.PARKED:
                self.dispatcher.dispatch(run_id, definition.queue)
            return Outcome.PARKED
        if turn.admitted:
            signals.run_admitted.send_robust(sender=self.signal_sender, run=run)
        if definition.debounce is not None and run.step_count == 0:
            # A start folded in between this claim's read and its compare-and-set gave the run
            # its input (X7d): no fold changes a run once claimed, so this read is the last word.
            fresh = self.store.get_run(run_id)
            if fresh is not None:
                run = run.evolve(input=fresh.input)
        return self._run_body(definition, run, owner, turn.steps)

    def execute_chain(self, run_id: str, *, max_turns: int = 200, max_seconds: float = 2.0) -> str:
        """Execute a turn, then the turns of the waiters its handoffs granted, on this thread.

        The oldest waiter granted a slot by a settle runs next here instead of
        going through the broker (the handoff skips a round trip, S7); at most
        ``max_turns`` turns or ``max_seconds`` seconds, then the rest are sent
        as usual. A granted waiter carries a ``wake_at`` one redelivery window
        ahead, so if this process dies the tick sends it (S8). Returns the
        first turn's outcome.
        """
        follow_ups: list[RunRecord] = []
        self._local.follow_ups = follow_ups
        try:
            outcome = self.execute(run_id)
            deadline = time.monotonic() + max_seconds
            turns = 1
            while follow_ups and turns < max_turns and time.monotonic() < deadline:
                granted = follow_ups.pop(0)
                self.dispatcher.turn_taken(granted.run_id)  # in hand now, for a stop's hand-back (O6)
                self.execute(granted.run_id, known=granted)
                turns += 1
        finally:
            self._local.follow_ups = None
        for left in follow_ups:
            self.dispatcher.dispatch(left.run_id, self.queue_of(left))
        return outcome

    def execute_batch(self, run_ids: Sequence[str], queue: str | None = None, *, max_seconds: float = 2.0) -> list[str]:
        """Execute the turns of ``run_ids`` one after the other on this thread,
        each with :meth:`execute_chain`; return their outcomes, in order.

        One Celery message carries them (``execute_runs``, sent by
        ``start_many`` and by coalesced starts). ``max_seconds`` seconds after
        the batch began, the turns not begun yet are sent on to ``queue``
        (None: the default) in two messages, so that two workers share them:
        by a timer, even while a turn of the batch still runs (a long body
        holds back none of the rest past ``max_seconds``), and each turn is
        either begun here or sent on, never both. A batch behind long bodies
        gets its parallelism back in a few hops, with few messages. A turn
        delayed past its redelivery window meanwhile is sent again by the tick
        (S8), and the turn that comes second is skipped (R6). A turn that
        raises an ``Exception`` is logged and the batch goes on; anything else
        (a worker shutting down, R7) ends the batch, whose turns the tick sends
        again.
        """
        pending = list(run_ids)
        lock = threading.Lock()

        def send_on() -> None:  # on the timer's thread
            with lock:
                rest = pending[:]
                pending.clear()
            if not rest:
                return
            try:
                half = (len(rest) + 1) // 2
                self.dispatcher.dispatch_many(rest[:half], queue)
                if rest[half:]:
                    self.dispatcher.dispatch_many(rest[half:], queue)
            except Exception:  # the runs keep their wake_at: the tick sends them (S8)
                logger.exception("could not send on %d turns of a batch; the tick will send them", len(rest))
            finally:
                self.dispatcher.close_thread_resources()

        timer = threading.Timer(max_seconds, send_on) if len(pending) > 1 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        deadline = time.monotonic() + max_seconds
        outcomes: list[str] = []
        try:
            while True:
                with lock:
                    if not pending:
                        break
                    run_id = pending.pop(0)
                try:
                    outcomes.append(self.execute_chain(run_id, max_seconds=max(deadline - time.monotonic(), 0.0)))
                except Exception:
                    logger.exception("turn of run %s failed; the batch goes on", run_id)
                    outcomes.append(Outcome.INTERRUPTED)
        finally:
            if timer is not None:
                timer.cancel()
        return outcomes

    def hand_off(self, granted: Sequence[RunRecord]) -> None:
        """Send the turns of waiters just granted a slot (S7): the first runs next
        on this thread when inside :meth:`execute_chain`, the rest go to workers."""
        follow_ups = getattr(self._local, "follow_ups", None)
        with tracing.handoff(granted):
            self.announce_admitted(granted)
            for n, run in enumerate(granted):
                queue = self.queue_of(run)
                if n == 0 and follow_ups is not None and queue is None:
                    follow_ups.append(run)  # this worker runs it next: no broker hop
                else:
                    self.dispatcher.dispatch(run.run_id, queue)

    def announce_admitted(self, granted: Sequence[RunRecord]) -> None:
        """Send ``run_admitted`` for each run of ``granted`` that a grant admitted
        to its key's slot (S5, S7): the one path of every grant's announcement
        (a settle's, a release's, the tick's catch-up, and a claim's grants of
        other waiters), which the admissions metric and the admission log
        count. A run still waiting in its quotas is sent a turn only (X3h)."""
        for run in granted:
            if run.quota_slot != SlotState.WAITER:
                signals.run_admitted.send_robust(sender=self.signal_sender, run=run)

    def _cancel_error(self, run: RunRecord) -> dict[str, str]:
        """The error of a run stopped by a cancel: ``execution_timeout`` if its
        deadline passed, by the store's clock read now (R5, R8: a process whose
        clock stepped ahead never calls a plain cancel a timeout, D5, D6)."""
        return cancel_error(run.deadline_at, self.corrected_now())

    def _run_body(
        self, definition: WorkflowDefinition, run: RunRecord, owner: str, steps: Mapping[int, StepRecord] | None = None
    ) -> str:
        try:
            return self._run_body_and_settle(definition, run, owner, steps)
        except Exception as exc:
            # The store became unreachable around the body: reading its steps, or
            # parking or settling after it. The turn ends as an interrupted store
            # call inside it does, not left running for its lease (R4, D4, S6). A
            # park or settle that committed before its reply was lost is terminal
            # or parked, so the hand-back's compare-and-set changes nothing (R5a).
            if not self.store.is_unreachable(exc):
                raise
            interrupted = Interrupted(f"the store failed around the body: {exc!r}")
            interrupted.__cause__ = exc
            self._resume_interrupted(run, owner, interrupted)
            return Outcome.INTERRUPTED

    def _run_body_and_settle(
        self, definition: WorkflowDefinition, run: RunRecord, owner: str, known: Mapping[int, StepRecord] | None
    ) -> str:
        assert definition.body is not None
        # Read after the claim, never skipped on a step count read before it: a
        # frozen holder's step may commit between that read and the claim. The
        # claim's own write may know them (``Turn.steps``): no step under this lease (R4).
        steps = dict(known) if known is not None else self.store.load_steps(run.run_id)
        ctx = WorkflowCtx(self, run, owner, steps)
        try:
            with renewer().hold(
                self.store,
                run.run_id,
                owner,
                lease_seconds=self.settings.LEASE_SECONDS,
                renew_seconds=self.settings.LEASE_RENEW_SECONDS,
                close=self.close_thread_resources,
            ) as lease:
                ctx.lease = lease
                output = definition.body(ctx, run.input)
            if ctx.stopped_by is not None:  # the body swallowed its stop and returned: re-raise it
                raise ctx.stopped_by(f"run {run.run_id!r}: the body returned after its boundary stopped it")
            output = to_json_value(output, "workflow output", max_bytes=self.settings.MAX_RESULT_BYTES)
        except Suspend as parked:
            verdict = self.store.park(run.run_id, owner, parked.status, wake_at=parked.wake_at, reason=parked.reason)
            if verdict == Verdict.CANCELLED:
                # A cancel landed before the park: it is never parked over (D6).
                return self._finish(run, owner, RunStatus.CANCELLED, error=self._cancel_error(run))
            if verdict != Verdict.PARKED:
                return Outcome.FENCED
            signals.run_parked.send_robust(sender=self.signal_sender, run=run, reason=parked.reason)
            if parked.recheck is not None and self._arrived_meanwhile(run, parked.recheck):
                self.dispatcher.dispatch(run.run_id, definition.queue)
            return parked.status
        except LeaseLostError:
            logger.warning("run %s: lease lost; this turn's writes are fenced", run.run_id)
            return Outcome.FENCED
        except Interrupted as interrupted:
            self._resume_interrupted(run, owner, interrupted)
            return Outcome.INTERRUPTED
        except RunCancelledError:
            return self._finish(run, owner, RunStatus.CANCELLED, error=self._cancel_error(run))
        except BaseException as exc:  # the body may raise anything, BaseException included: it fails the run (R7)
            if not isinstance(exc, Exception) and self.dispatcher.shutting_down():
                # This worker is shutting down (its own flag says so, not the
                # exception's type): the run goes back with its slot, and the
                # exception goes on to stop the process (R7).
                self._hand_back(run, owner, exc)
                raise
            if ctx.stopped_by is RunCancelledError:  # ... unless it was stopped by a cancel first (D6)
                return self._finish(run, owner, RunStatus.CANCELLED, error=self._cancel_error(run))
            if ctx.stopped_by is LeaseLostError:
                return Outcome.FENCED
            if not isinstance(exc, Exception):
                # SystemExit, KeyboardInterrupt raised by the body's own code: it
                # ends the turn like any exception; the thread goes on (R7).
                logger.warning("run %s: the body raised %s; the run fails (R7)", run.run_id, type(exc).__qualname__)
            error = {
                "code": "exception",
                "type": type(exc).__qualname__,
                "message": _bounded(str(exc)),
                "traceback": _bounded(traceback.format_exc(limit=20)),
            }
            # The body's own query may have met (and left) a dead connection: settle on a new one.
            self.store.discard_broken_connection()
            return self._finish(run, owner, RunStatus.FAILED, error=error)
        return self._finish(run, owner, RunStatus.COMPLETED, output=output)

    def _hand_back(self, run: RunRecord, owner: str, exc: BaseException) -> None:
        """Give a run back with its slot because this worker is shutting down (R7).

        The run is parked ``pending`` with its ``wake_at`` now, so the tick of
        any live worker sends it at once; it keeps its slot (S6) and its stored
        steps replay (R4). A cancel that landed meanwhile is settled instead
        (D6). Nothing here may keep the shutdown from going on: a store that
        does not answer leaves the run to its lease (D4).
        """
        logger.warning(
            "run %s: the worker is shutting down (%s); the run is handed back with its slot",
            run.run_id,
            type(exc).__qualname__,
        )
        count = self._in_a_row(run, ParkReason.SHUTDOWN)
        if count > self.settings.MAX_RECOVERIES:
            # A pool child killed every time (a hard time limit terminates it the
            # way a shutdown does) must not loop: the lease's recoveries count (D4).
            logger.warning("run %s: handed back %d times in a row; it resumes after its lease (D4)", run.run_id, count)
            return
        try:
            verdict = self.store.park(
                run.run_id, owner, RunStatus.PENDING, wake_at=self.corrected_now(), reason=ParkReason.SHUTDOWN.of(count)
            )
            if verdict == Verdict.CANCELLED:
                self._finish(run, owner, RunStatus.CANCELLED, error=self._cancel_error(run))
        except Exception:
            logger.warning("run %s: could not hand the run back; it resumes after its lease", run.run_id, exc_info=True)

    @staticmethod
    def _in_a_row(run: RunRecord, reason: ParkReason) -> int:
        """Return how many hand-backs for ``reason`` this one makes in a row:
        one more than the count its last park recorded (``<reason><count>``),
        1 after any other park (D4)."""
        detail = reason.detail(run.park_reason) if reason.matches(run.park_reason) else ""
        return int(detail) + 1 if detail.isdigit() else 1

    @staticmethod
    def _arrived_meanwhile(run: RunRecord, recheck: Callable[[], bool]) -> bool:
        """Tell whether what a parked run waits for arrived before its park
        committed; True when the store cannot tell (a spare turn is harmless,
        R6; a missed one would wait for the fallback ``wake_at``, D2, D7)."""
        try:
            return recheck()
        except Exception:
            logger.warning("run %s: the re-check after its park failed; sending its turn", run.run_id, exc_info=True)
            return True

    def _claim_interrupted(self, run_id: str, owner: str, exc: Exception) -> None:
        """End a turn whose claim met an unreachable store. The claim may have
        committed before its reply was lost: if the run is leased to this
        turn's owner, hand it back as an interrupted body is (R5a, D4, S6);
        otherwise nothing was taken, or the store is still away and the lease
        expires as after a crash."""
        try:
            self.store.discard_broken_connection()
            run = self.store.get_run(run_id)
        except Exception:
            logger.warning("run %s: its claim failed (%r) and the store is still away", run_id, exc)
            return
        if run is not None and run.status == RunStatus.RUNNING and run.lease_owner == owner:
            interrupted = Interrupted(f"begin_turn failed: {exc!r}")
            interrupted.__cause__ = exc
            self._resume_interrupted(run, owner, interrupted)

    def _resume_interrupted(self, run: RunRecord, owner: str, interrupted: Interrupted) -> None:
        """End a turn whose store call failed under the body, without failing the run.

        The run keeps its slot (S6). It is handed back as ``pending`` with a
        ``wake_at`` ``ADMISSION_RETRY_SECONDS`` ahead, which the tick sends
        (so a store failing every time costs one turn per interval, never a
        busy loop); if the store does not answer, its lease expires and the
        tick re-drives it (D4). Its stored steps are replayed; the step whose
        result was not stored runs again (R4). A cancel that landed meanwhile
        is settled now, which hands the slot off (D6, S7).

        The hand-back's park reason counts the interruptions in a row
        (``interrupted:N``; any other park resets it). Past ``MAX_RECOVERIES``
        of them the run is no longer handed back but left to its lease, whose
        recoveries are counted: a store that refuses the same write every time
        by dropping the connection ends the run ``dead`` (D4) instead of
        running its body, and the step whose write fails, without end.
        """
        logger.warning("run %s: %s; the turn ends and the run resumes", run.run_id, interrupted)
        count = self._in_a_row(run, ParkReason.INTERRUPTED)
        if count > self.settings.MAX_RECOVERIES:
            logger.warning("run %s: interrupted %d times in a row; it resumes after its lease (D4)", run.run_id, count)
            return
        try:
            self.store.discard_broken_connection()
            wake_at = self.corrected_now() + timedelta(seconds=self.settings.ADMISSION_RETRY_SECONDS)
            reason = f"{INTERRUPTED_REASON}{count}"
            if (
                self.store.park(run.run_id, owner, RunStatus.PENDING, wake_at=wake_at, reason=reason)
                == Verdict.CANCELLED
            ):
                self._finish(run, owner, RunStatus.CANCELLED, error=self._cancel_error(run))
        except Exception:  # the store is still away: recovery after the lease takes over (D4)
            logger.warning("run %s: could not hand the run back; it resumes after its lease", run.run_id)

    def _finish(self, run: RunRecord, owner: str, status: str, *, output: Any = None, error: Any = None) -> str:
        """Settle ``run`` by compare-and-set and hand its slot off (R2, R5a, S7)."""
        done = self.store.finish(
            run,
            owner,
            status,
            output=output,
            error=error,
            limits=self.limits(),
            # On the default clock the store writes its own clock's time (R8).
            finished_at=self.caller_now(),
            ttls=self.queue_ttls(),
        )
        if not done.settled:
            return Outcome.FENCED
        self._settled(done)
        return status

    def _settled(self, done: Finish) -> None:
        """Everything that follows a settle, wherever it happened: the handoff,
        the signals, the dead-letter hook, the children, the parent (S7, D4, D6, D7)."""
        if done.run is not None:
            self._after_settle(done.run)
        self.hand_off(done.granted)

    def _after_settle(self, run: RunRecord) -> None:
        if run.status == RunStatus.DEAD:
            self._on_dead(run)
        self.dispatcher.on_commit(lambda: signals.run_finished.send_robust(sender=self.signal_sender, run=run))
        if run.status == RunStatus.CANCELLED:
            self._cancel_children(run.run_id)
            if run.throttle_keys:
                self._wake_throttled_behind(run)
        if run.parent_run_id:
            self._wake_parent(run.parent_run_id)

    def _wake_throttled_behind(self, run: RunRecord) -> None:
        """X6d: a throttle carrier cancelled (a cancel, its ``queue_ttl``, a superseding
        start) may leave a place in its throttle keys' queues that an older waiter's
        admission was counted on: the waiters behind it were parked until the window's
        opening as if that waiter took the room first. The first waiter of each of its
        throttle keys parked over the rate is made due now and sent its turn, whose claim
        counts the window again (admitted if the room is its, else parked until the
        opening). One turn per key, however the run ended: a claim that finds no room
        costs a park. A failure (the store away) is logged: the waiter keeps its opening."""
        woken: list[RunRecord] = []
        try:
            for name, key, *_rest in run.throttle_keys:
                woken.extend(self.store.wake_throttled(name, key, 1, retrying=False))
        except Exception:
            logger.warning("run %s: waking its throttle keys' waiters failed (X6d)", run.run_id, exc_info=True)
        self.hand_off(woken)  # waiters still: a turn each, no admission announced (X3h)

    def _cancel_children(self, run_id: str) -> None:
        """Cancel the active children of run ``run_id``, cancelled or being
        cancelled (D6). A failure (the store away) is logged, never raised: the
        tick's ``cascade`` job finishes the cascade of a cancelled run."""
        try:
            for child_id in self.store.children(run_id):
                with contextlib.suppress(RunNotFoundError):  # it ended meanwhile
                    self._cancel_run(child_id)
        except Exception:
            logger.warning(
                "run %s: cancelling its children failed; the tick finishes the cascade (D6)", run_id, exc_info=True
            )

    def _wake_parent(self, parent_run_id: str) -> None:
        """Dispatch a parent parked on this child (D7); a parent still running
        re-checks after it parks, so the wake-up is never lost."""

        def wake() -> None:
            try:
                parent = self.store.get_run(parent_run_id)
            except Exception:
                # Cannot tell whether it waits: send its turn anyway (a spare turn is
                # harmless, R6; a remote parent's turn is passed on to its queue).
                logger.warning("run %s: reading the parent failed; sending its turn", parent_run_id, exc_info=True)
                self.dispatcher.dispatch(parent_run_id, None)
                return
            if parent is not None and parent.is_parked and ParkReason.CHILD.matches(parent.park_reason):
                self.dispatcher.dispatch(parent_run_id, self.queue_of(parent))

        self.dispatcher.on_commit(wake)

    def _on_dead(self, run: RunRecord) -> None:
        signals.run_dead.send_robust(sender=self.signal_sender, run=run)
        try:
            definition = self.registry.get(run.workflow_name, run.workflow_version)
        except UnknownWorkflowError:
            return
        if definition.on_dead is not None:
            try:
                definition.on_dead(run)
            except Exception:  # a hook's failure must not undo the dead-letter
                logger.exception("on_dead hook of %s failed for run %s", definition.label, run.run_id)

    def release(self, run: RunRecord) -> list[str]:
        """Grant the free slots of ``run``'s key to its oldest waiters and send them (S7),
        and send a turn to the waiters within the free slots of each quota key it
        carries (X3g, X3h).

        For a slot freed or a queue place left outside a settle (a deleted row,
        F12; a waiter replaced by ``on_busy``, X1). Returns their ids.
        """
        limits, ttls = self.limits(), self.queue_ttls()
        granted: list[RunRecord] = []
        if run.singleton_key is not None:
            granted.extend(self.store.release(run.workflow_name, run.singleton_key, limits=limits, ttls=ttls))
        for name, key in sorted(run.quota_keys):
            seen = {r.run_id for r in granted}
            more = self.store.release(quota_lock_name(name), key, limits=limits, ttls=ttls)
            granted.extend(r for r in more if r.run_id not in seen)
        self.hand_off(granted)
        return [r.run_id for r in granted]

    # -- operator actions ----------------------------------------------------
    def cancel(self, run_id: str) -> RunRecord:
        """Cancel a run and its active children (D6).

        A parked run is cancelled at once and its slot handed off (S7); a
        running body stops at its next step boundary. Raises
        :class:`RunNotFoundError`. A terminal run is returned unchanged; a
        cancelled one has its active children cancelled again, so calling
        ``cancel`` again completes a cascade that a store failure cut short
        (as the tick's ``cascade`` job does by itself).
        """
        self.get(run_id)
        return self._cancel_run(run_id)

    def _cancel_run(self, run_id: str) -> RunRecord:
        """Cancel run ``run_id`` and its active children, whatever its namespace (D6)."""
        result = self.store.request_cancel(run_id, limits=self.limits(), ttls=self.queue_ttls())
        if result is None:
            raise RunNotFoundError(f"no run {run_id!r}")
        if isinstance(result, Finish):
            assert result.run is not None
            self._settled(result)
            return result.run
        if result.status == RunStatus.RUNNING:
            self._cancel_children(run_id)
            # The holder may be dead: this turn re-drives it once its lease expires.
            self.dispatcher.dispatch(run_id, self.queue_of(result))
        elif result.status == RunStatus.CANCELLED:
            self._cancel_children(run_id)
        return result

    def retry(self, run_id: str) -> RunRecord:
        """Send a failed or dead run back through admission with its stored key (D9).

        Raises :class:`RunNotFoundError`, or :class:`ValidationError` if the
        run is not failed or dead.
        """
        previous = self.get(run_id)
        try:
            timeout = self.registry.get(previous.workflow_name).timeout
        except UnknownWorkflowError:
            timeout = None
        # A retry gets a fresh timeout (D5), from the store's clock read now (R8).
        deadline = self.corrected_now() + timedelta(seconds=timeout) if timeout else None
        run = self.store.reset_for_retry(run_id, self.settings.REDELIVERY_SECONDS, deadline)
        if run is None:
            raise ValidationError(f"run {run_id!r} is not failed or dead; only those can be retried")
        self.dispatcher.dispatch(run_id, self.queue_of(run))
        return run

    def wake(self, run_id: str) -> RunRecord:
        """Send a parked run's turn now. Raises :class:`RunNotFoundError`."""
        run = self.get(run_id)
        if run.is_parked:
            self.dispatcher.dispatch(run_id, self.queue_of(run))
        return run

    def signal(self, run_id: str, name: str, payload: Any = None, *, signal_id: str | None = None) -> RunRecord:
        """Buffer signal ``name`` for an active run and wake it if it waits (D2).

        ``signal_id``: the caller's id of this signal (a str of at most 191
        characters), so a retry after a lost reply stores nothing again: a
        signal of the run with that id already stored, by any process, is
        kept and the run is returned, even if it finished since; the first
        signal sent with an id wins (a retry with another name or payload
        changes nothing). Without it every call stores a signal.

        Raises :class:`RunNotFoundError` if the run does not exist or is
        terminal (a retry of a stored ``signal_id`` excepted), and
        :class:`ValidationError` for a bad name or ``signal_id``, and
        :class:`InvalidInputError` for a non-JSON or oversize payload.
        """
        payload = self._check_input(payload, "signal payload")
        check_text(name, "signal name")
        if signal_id is not None:
            check_text(signal_id, "signal_id", RUN_ID_MAX_LENGTH)
        self.get(run_id)
        if signal_id is None:
            run = self.store.add_signal(run_id, name, payload)
        else:
            run = self.store.add_signal(run_id, name, payload, signal_id=signal_id)
        if run is None:
            raise RunNotFoundError(f"no active run {run_id!r} to signal")
        if run.is_parked and ParkReason.SIGNAL.matches(run.park_reason):
            self.dispatcher.dispatch(run_id, self.queue_of(run))
        return run

    def signal_with_start(
        self,
        name: str,
        input: Any,
        *,
        run_id: str,
        signal: str,
        payload: Any = None,
        tags: Iterable[str] = (),
        signal_id: str | None = None,
        priority: int = 0,
    ) -> RunRecord:
        """Start (idempotent by ``run_id``), then signal the run (S18).

        On a busy key the run queues like any other, in the place its
        ``priority`` gives it (X8, as :meth:`start`'s); the signal is buffered
        and seen by the body only once admitted. ``signal_id`` dedupes the
        signal as :meth:`signal`'s does, so a retried call starts once and
        signals once (D2). Raises what :meth:`start` raises, before anything
        is written.
        """
        check_priority(priority)
        payload = self._check_input(payload, "signal payload")
        check_text(signal, "signal name")
        if signal_id is not None:
            check_text(signal_id, "signal_id", RUN_ID_MAX_LENGTH)
        run = self.start(name, input, run_id=run_id, tags=tags, priority=priority)
        return self.signal(run.run_id, signal, payload, signal_id=signal_id)

    def emit(self, event: str, payload: Any = None, *, event_id: str | None = None) -> list[RunRecord]:
        """Start every workflow subscribed to ``event`` with ``payload`` as input (D8).

        With ``event_id``, each run id is ``event:<event_id>:<workflow>``
        (past 191 characters, shortened with a hash suffix by
        :func:`~durable_singleton.values.derived_id`), so emitting the same
        event twice starts nothing new (R3). Every subscriber's start is
        validated before any is made: an emit that raises (a key function
        that refuses the payload, :class:`InvalidInputError`) started nothing.
        A subscriber whose key queue is full is skipped and logged (S16);
        returns the runs started or found. The derived run ids are global: on
        an engine with ``scope_reads``, an ``event_id`` whose run ids another
        namespace's emit used raises :class:`RunIdInUseError` before any start
        (D10); give tenants' events ids of their own (a tenant prefix).
        """
        check_text(event, "event")
        if event_id is not None:
            check_text(event_id, "event_id", 120)
        payload = self._check_input(payload, "event payload")
        planned = []
        for definition in self.registry.subscribers(event):
            run_id = derived_id(f"event:{event_id}:{definition.name}") if event_id else None
            # Every subscriber's start is validated before any is made, so an
            # emit that raises has started nothing (section 7).
            self._new_run(
                definition.name, payload, run_id=run_id, tags=(), version=None, parent_run_id=None, namespace=None
            )
            if run_id is not None and self.scope_reads and (found := self.store.get_run(run_id)) is not None:
                self._found(found, None)  # another namespace's run: refused before any start (D10)
            planned.append((definition, run_id))
        runs = []
        for definition, run_id in planned:
            try:
                runs.append(self.start(definition.name, payload, run_id=run_id))
            except SingletonQueueFullError as exc:
                logger.warning("event %s: %s", event, exc)
        return runs

    # -- the tick ------------------------------------------------------------
    def tick(self, holding: Callable[[], bool] | None = None) -> TickReport:
        """Run one tick (S8, S8a, S8b, D4, D5). Safe on several machines at once.

        Each job has its own bounded batch (``TICK_BATCH``), oldest first, and
        an error in one is logged and skipped without stopping the others: the
        jobs of :meth:`tick_jobs` (on the engine: execution timeouts, waiters
        past their queue TTL (X2), the cancel cascades left unfinished, the
        per-key catch-up, due wakes, recovery of expired leases, schedules,
        retention); then :meth:`after_tick` (on the engine: the heartbeat the
        health command reads). ``holding``: called before each job after the
        first by a tick that holds the tick's lease (O1b), True while it still
        holds it (renewed); False ends the tick there, its other jobs left to the
        lease's new holder, so two processes tick at once for one job at most.
        """
        report = TickReport()
        started = time.monotonic()  # the tick's duration: an interval, never compared with a stored time
        for n, (name, job) in enumerate(self.tick_jobs()):
            if n and holding is not None and not holding():
                logger.warning("tick: the tick's lease ended before job %s; the next holder runs the rest (O1b)", name)
                break
            try:
                # A job that failed on a dropped connection must not fail the next ones with it.
                self.store.discard_broken_connection()
                job(report)
            except Exception:  # one failing job must not starve the others (S8b)
                logger.exception("tick job %s failed", name)
                report.errors.append(name)
        self.after_tick(time.monotonic() - started)
        return report

    def tick_jobs(self) -> list[TickJob]:
        """Return the tick's jobs, in order: the core's (execution timeouts,
        waiters past their queue TTL (X2), the cancel cascades left unfinished,
        the per-key catch-up, due wakes, recovery of expired leases); the
        façade appends its features' (schedules, retention)."""
        return [
            ("timeouts", self._tick_timeouts),
            ("queue-ttl", self._tick_queue_ttl),
            ("cascade", self._tick_cascade),
            ("catch-up", self._tick_catch_up),
            ("due", self._tick_due),
            ("recovery", self._tick_recovery),
            ("throttle", self._tick_throttle),
        ]

    def after_tick(self, seconds: float) -> None:
        """Called after every tick's jobs, with how long they took (``seconds``);
        the façade records the heartbeat and the duration here. Must not raise."""
        return None

    def _tick_timeouts(self, report: TickReport) -> None:
        """D5: a parked overdue run is settled by compare-and-set on its parked
        status and its slot handed off; a running one is asked to stop at its
        next step boundary, so two bodies never overlap (R5a, S9)."""
        for run in self.store.overdue_runs(self.settings.TICK_BATCH):
            try:
                if run.status == RunStatus.RUNNING:
                    if not run.cancel_requested and self.store.request_timeout_cancel(run.run_id):
                        report.timed_out.append(run.run_id)
                    continue
                done = self.store.finish(
                    run,
                    None,
                    RunStatus.CANCELLED,
                    error=dict(TIMEOUT_ERROR),
                    limits=self.limits(),
                    expect=(run.status,),
                    ttls=self.queue_ttls(),
                )
                if done.settled:
                    report.timed_out.append(run.run_id)
                    self._settled(done)
            except Exception:
                logger.exception("tick: timeout of run %s failed", run.run_id)

    def _tick_throttle(self, report: TickReport) -> None:
        """X6: delete up to ``TICK_BATCH`` recorded throttle admissions that no
        window counts any more (older than their throttle's ``period`` on the
        store's clock). An over-rate waiter needs nothing of this job: its
        ``wake_at`` is its window's opening, which the due wakes serve (S8)."""
        periods = self.registry.throttle_periods()
        if periods:
            self.store.prune_throttle_admissions(periods, self.settings.TICK_BATCH)

    def _tick_queue_ttl(self, report: TickReport) -> None:
        """X2: end the waiters that outlived their key's ``queue_ttl``, up to
        ``TICK_BATCH``, oldest first, each ``cancelled`` with code
        ``queue_ttl_expired`` by a compare-and-set on the store's clock that
        refuses a run admitted since the read (R5, R5a); the slots its key has
        free go to the waiters behind it (S7), and the run's signals, children
        and parent follow as for any settle (D6, D7)."""
        ttls = self.queue_ttls()
        if not ttls:
            return
        if not self.store.supports_queue_ttl:
            if not self._warned_queue_ttl:
                self._warned_queue_ttl = True
                logger.warning("store %s ends no waiter by its queue_ttl (X2)", type(self.store).__name__)
            return
        for run in self.store.expired_waiters(ttls, self.settings.TICK_BATCH):
            try:
                done = self.store.expire_waiter(run, ttls[run.workflow_name], limits=self.limits(), ttls=ttls)
                if done.settled:
                    report.expired.append(run.run_id)
                    self._settled(done)
            except Exception:
                logger.exception("tick: queue_ttl of run %s failed", run.run_id)

    def _tick_cascade(self, report: TickReport) -> None:
        """D6: cancel the active children of cancelled runs, up to ``TICK_BATCH``
        of them, oldest first. A cascade that a store failure cut short (a
        parent ended by its execution timeout, or cancelled, while the store
        was away) is finished here instead of waiting for a second ``cancel``;
        a running child marked for cancellation is left to stop at its next
        boundary."""
        for child_id in self.store.children_of_cancelled(self.settings.TICK_BATCH):
            try:
                self._cancel_run(child_id)
                report.cancelled.append(child_id)
            except RunNotFoundError:  # deleted meanwhile
                continue

    def _tick_catch_up(self, report: TickReport) -> None:
        granted = self.store.catch_up(limits=self.limits(), batch=self.settings.TICK_BATCH, ttls=self.queue_ttls())
        report.caught_up.extend(r.run_id for r in granted)
        # As a settle's or a release's grants: run_admitted for each run admitted, then the
        # turns (S7, O4).
        self.hand_off(granted)

    def dispatch_due(self) -> list[str]:
        """Send the parked runs whose ``wake_at`` came (the tick's due job alone, S8):
        taken as the tick takes them (``TICK_BATCH`` at most, each one's ``wake_at``
        pushed by ``REDELIVERY_SECONDS``), so a tick beside it sends none twice.
        Returns their run ids. The workers' wake timer calls it at the earliest
        ``wake_at`` between ticks (a throttle's opening, X6d)."""
        report = TickReport()
        self._tick_due(report)
        return report.dispatched

    def seconds_to_next_wake(self, horizon: float) -> float | None:
        """Return the seconds to the earliest ``wake_at`` of a parked run within
        ``horizon`` seconds, on the store's clock, or None (the store's
        :meth:`~durable_singleton.stores.base.BaseStore.seconds_to_next_wake`, S8)."""
        return self.store.seconds_to_next_wake(horizon)

    def _tick_due(self, report: TickReport) -> None:
        due = self.store.due_runs(redelivery_seconds=self.settings.REDELIVERY_SECONDS, batch=self.settings.TICK_BATCH)
        for run_id, workflow_name in due:
            self.dispatcher.dispatch(run_id, self.queue_of(workflow_name))
            report.dispatched.append(run_id)

    def _tick_recovery(self, report: TickReport) -> None:
        expired = self.store.expired_leases(
            redelivery_seconds=self.settings.REDELIVERY_SECONDS, batch=self.settings.TICK_BATCH
        )
        for run_id, workflow_name in expired:
            self.dispatcher.dispatch(run_id, self.queue_of(workflow_name))
            report.recovered.append(run_id)
            report.dispatched.append(run_id)

    def close_thread_resources(self) -> None:
        """Release per-thread resources (database connections) of a helper thread."""
        self.dispatcher.close_thread_resources()


Core.signal_sender = Core
