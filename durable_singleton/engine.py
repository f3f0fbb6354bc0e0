"""The engine: starts runs, executes one turn at a time, gates singleton
runs through the store's claim, pushes releases, and drives the tick.

The engine knows the store protocol, not the ORM, and nothing of Celery: a
dispatcher (see :mod:`durable_singleton.dispatch`) sends turns.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from . import heartbeat, retention, schedules, signals
from .admission import (
    ACTIVE_STATUSES,
    RESERVED_TAGS,
    compute_singleton_key,
    retry_delay,
)
from .aio import AsyncEngineMixin
from .conf import Settings, get_settings
from .context import Suspend, WorkflowCtx, check_text, printable, to_json_value
from .definitions import Registry, Singleton, WorkflowDefinition, registry
from .exceptions import (
    InvalidRunIdError,
    LeaseLostError,
    RunCancelledError,
    RunNotFoundError,
    SingletonFallbackWarning,
    SingletonQueueFullError,
    UnknownWorkflowError,
    ValidationError,
)
from .explain import ExplainMixin
from .stores.base import AdmissionResult, RunRecord

__all__ = ["RUN_ID_MAX_LENGTH", "Dispatcher", "Engine", "TickReport", "get_engine"]

logger = logging.getLogger("durable_singleton")

RUN_ID_MAX_LENGTH = 191


class Dispatcher(Protocol):
    """Sends a run's next turn to a worker, after the current transaction commits."""

    def dispatch(self, run_id: str, queue: str | None = None) -> None:
        """Send one turn of ``run_id``; never raise for a lost send (the tick re-sends)."""
        ...

    def on_commit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` after the current transaction commits (at once outside one)."""
        ...


@dataclass
class TickReport:
    """What one tick did: runs dispatched, timed out, and made due by the catch-up."""

    dispatched: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    caught_up: list[str] = field(default_factory=list)


def _owner_prefix() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _LeaseKeeper:
    """Renews a turn's lease every ``every`` seconds while the body runs (R5)."""

    def __init__(self, engine: Engine, run_id: str, owner: str) -> None:
        self.engine = engine
        self.run_id = run_id
        self.owner = owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease:{run_id}", daemon=True)

    def __enter__(self) -> _LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from django.db import DatabaseError

        every = self.engine.settings.LEASE_RENEW_SECONDS
        try:
            while not self._stop.wait(every):
                try:
                    renewed = self.engine.store.renew_lease(
                        self.run_id, self.owner, self.engine.settings.LEASE_SECONDS, self.engine.now()
                    )
                except DatabaseError:
                    # A dropped connection (server restart, pg_terminate_backend):
                    # close it and renew on a new one next time (O1).
                    logger.warning("run %s: lease renewal failed; retrying", self.run_id, exc_info=True)
                    self.engine.close_thread_resources()
                    continue
                if not renewed:
                    return  # fenced: the body stops at its next step boundary
        finally:
            self.engine.close_thread_resources()


class Engine(AsyncEngineMixin, ExplainMixin):
    """Runs durable workflows over a store and a dispatcher.

    ``store``: a :class:`~durable_singleton.stores.base.StateStore`.
    ``dispatcher``: sends turns (Celery, the embedded worker, or manual).
    ``namespace``/``scope_reads``: D10; admission stays global (S11).
    ``settings``: a :class:`~durable_singleton.conf.Settings` (default: Django settings).
    ``clock``: returns the current aware datetime.
    """

    def __init__(
        self,
        store: Any,
        dispatcher: Dispatcher,
        *,
        registry: Registry = registry,
        namespace: str | None = None,
        scope_reads: bool | None = None,
        settings: Settings | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        from django.utils import timezone

        self.store = store
        self.dispatcher = dispatcher
        self.registry = registry
        self.settings = settings or get_settings()
        self.namespace = namespace if namespace is not None else self.settings.NAMESPACE
        self.scope_reads = scope_reads if scope_reads is not None else self.settings.SCOPE_READS
        self.now: Callable[[], datetime] = clock or timezone.now
        self._warned_fallback = False
        self._owner_prefix = _owner_prefix()
        self._local = threading.local()

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

        Raises :class:`InvalidWorkflowError` naming the workflow and the field.
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

    # -- starting ----------------------------------------------------------
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
    ) -> RunRecord:
        """Create a run and dispatch its first turn after commit; never blocks (S3).

        ``run_id``: a non-empty str of at most 191 characters, or None for a
        generated one. If a run with that id exists it is returned and nothing
        is created, before any other check (R3, S16). ``namespace`` defaults
        to the engine's (children pass their parent's, D7).

        Raises :class:`InvalidRunIdError`, :class:`UnknownWorkflowError`,
        :class:`InvalidInputError`, :class:`SingletonKeyError`, or
        :class:`SingletonQueueFullError` (S15); each writes nothing.
        """
        if namespace is not None:
            check_text(namespace, "namespace")
        if run_id is not None:
            self._check_run_id(run_id)
            existing = self.store.get_run(run_id)
            if existing is not None:
                return existing
        definition = self.registry.get(name, version)
        input = to_json_value(input, "input")
        user_tags = self._check_tags(tags)
        key = None
        single = definition.singleton
        if single is not None:
            key = compute_singleton_key(definition.name, single.key, input)
        now = self.now()
        record = RunRecord(
            run_id=run_id or uuid.uuid4().hex,
            workflow_name=definition.name,
            workflow_version=definition.version,
            namespace=namespace or self.namespace,
            status="pending",
            input=input,
            created_at=now,
            updated_at=now,
            user_tags=tuple(user_tags),
            singleton_key=key,
            singleton_limit=single.limit if single else None,
            tracked=single is not None,
            wake_at=now + timedelta(seconds=self.settings.REDELIVERY_SECONDS),
            deadline_at=now + timedelta(seconds=definition.timeout) if definition.timeout else None,
            parent_run_id=parent_run_id,
        )
        cap = None
        deep = False
        if single is not None:
            if single.max_queue_depth is not None:
                cap = single.limit + single.max_queue_depth
            assert key is not None
            deep_check = getattr(self.store, "queue_is_deep", None)
            deep = deep_check is not None and deep_check(definition.name, key, single.limit)
        if deep:
            # Behind `limit` holders and `limit` waiters: park at creation and
            # wait for the push or the tick's catch-up instead of sending a turn
            # that could only park (S8a). Keeps bursts off the broker queue.
            record = record.evolve(
                wake_at=now + timedelta(seconds=self.settings.BACKLOG_RETRY_SECONDS), park_reason="singleton"
            )
        run, created = self.store.create_run(
            record, cap=cap, cap_namespace=self.namespace if self.scope_reads else None
        )
        if created:
            signals.run_created.send(sender=Engine, run=run)
            if not deep:
                self.dispatcher.dispatch(run.run_id, definition.queue)
        return run

    @staticmethod
    def _check_run_id(run_id: object) -> None:
        try:
            check_text(run_id, "run_id", RUN_ID_MAX_LENGTH)
        except ValidationError as exc:
            raise InvalidRunIdError(str(exc)) from None

    @staticmethod
    def _check_tags(tags: Iterable[str]) -> list[str]:
        if isinstance(tags, str) or tags is None:
            raise ValidationError("tags must be an iterable of str")
        out = []
        for tag in tags:
            check_text(tag, "each tag")
            if tag not in RESERVED_TAGS and tag not in out:
                out.append(tag)
        return out

    def get(self, run_id: str) -> RunRecord:
        """Return run ``run_id``; raise :class:`RunNotFoundError`.

        With ``scope_reads`` on, a run of another namespace is not found (D10).
        """
        if not isinstance(run_id, str) or "\x00" in run_id:
            raise RunNotFoundError(f"no run {run_id!r:.80}")
        run = self.store.get_run(run_id)
        if run is None or (self.scope_reads and run.namespace != self.namespace):
            raise RunNotFoundError(f"no run {run_id!r}")
        return run

    # -- executing ---------------------------------------------------------
    def execute(self, run_id: str) -> str:
        """Execute one turn of ``run_id``: claim, gate, body until it finishes or parks.

        Safe to call twice at once for the same run: one caller wins the
        conditional claim, the others return ``"skipped"`` (R6). Returns one of
        ``skipped``, ``parked``, ``gone``, ``suspended``, ``blocked``,
        ``completed``, ``failed``, ``cancelled``, ``dead`` or ``fenced``.
        """
        owner = f"{self._owner_prefix}:{uuid.uuid4().hex[:12]}"
        settings = self.settings
        claim = self.store.claim_run(run_id, owner, settings.LEASE_SECONDS, self.now())
        run = claim.run
        if run is None:
            return "skipped"
        if run.cancel_requested:
            return self._finish(run, owner, "cancelled", error=self._cancel_error(run))
        if claim.recovered and run.recoveries > settings.MAX_RECOVERIES:
            return self._finish(
                run, owner, "dead", error={"code": "max_recoveries", "message": f"lease expired {run.recoveries} times"}
            )
        try:
            definition = self.registry.get(run.workflow_name, run.workflow_version)
        except UnknownWorkflowError as exc:
            return self._finish(run, owner, "failed", error={"code": "unknown_workflow", "message": str(exc)})
        if definition.body is None:
            # A remote workflow reached this worker: hand the turn back to its queue.
            self.store.park(run_id, owner, "pending", self.now(), wake_at=self.now())
            self.dispatcher.dispatch(run_id, definition.queue)
            return "parked"
        if run.singleton_key is not None and not run.admitted:
            verdict = self._admit(run, owner, self._limit_of(run))
            if verdict is AdmissionResult.PARKED:
                signals.run_parked.send(sender=Engine, run=run, reason="singleton")
                return "parked"
            if verdict is AdmissionResult.GONE:
                latest = self.store.get_run(run.run_id)
                if latest is not None and latest.status == "running" and latest.lease_owner == owner:
                    return self._finish(run, owner, "cancelled", error=self._cancel_error(run))
                return "gone"
            run = run.evolve(admitted=True)
            signals.run_admitted.send(sender=Engine, run=run)
        return self._run_body(definition, run, owner)

    def execute_chain(self, run_id: str, *, max_turns: int = 200, max_seconds: float = 2.0) -> str:
        """Execute a turn, then the turns of the waiters its releases woke, on this thread.

        The oldest waiter woken by a release runs next here instead of going
        through the broker (the handoff skips a round trip, S7); at most
        ``max_turns`` turns or ``max_seconds`` seconds, then the rest are sent
        as usual. A woken waiter's ``wake_at`` is stamped before it runs, so if
        this process dies the tick sends it (S8). Returns the first turn's outcome.
        """
        follow_ups: list[str] = []
        self._local.follow_ups = follow_ups
        try:
            outcome = self.execute(run_id)
            deadline = time.monotonic() + max_seconds
            turns = 1
            while follow_ups and turns < max_turns and time.monotonic() < deadline:
                self.execute(follow_ups.pop(0))
                turns += 1
        finally:
            self._local.follow_ups = None
        for left in follow_ups:
            self.dispatcher.dispatch(left, None)
        return outcome

    def _limit_of(self, run: RunRecord) -> int:
        """The key's limit: the latest registered version's, for every version (S2)."""
        try:
            single = self.registry.get(run.workflow_name).singleton
        except UnknownWorkflowError:
            single = None
        return single.limit if single is not None else (run.singleton_limit or 1)

    def _cancel_error(self, run: RunRecord) -> dict[str, str]:
        if run.deadline_at is not None and self.now() >= run.deadline_at:
            return {"code": "execution_timeout", "message": "execution timeout passed"}
        return {"code": "cancelled", "message": "cancelled"}

    def _admit(self, run: RunRecord, owner: str, limit: int) -> AdmissionResult:
        assert run.singleton_key is not None
        claim = getattr(self.store, "try_admit_singleton", None)
        if claim is not None:
            return claim(run.run_id, owner, limit, self.now(), workflow_name=run.workflow_name, key=run.singleton_key)
        return self._fallback_admit(run, owner, limit)

    def _fallback_admit(self, run: RunRecord, owner: str, limit: int) -> AdmissionResult:
        """Admission for a store without ``try_admit_singleton`` (S14): a read
        followed by a decision, not a claim; it can briefly over-admit."""
        if not self._warned_fallback:
            self._warned_fallback = True
            message = (
                f"store {type(self.store).__name__} has no try_admit_singleton; singleton admission "
                "falls back to a scan that can briefly over-admit"
            )
            logger.warning(message)
            warnings.warn(message, SingletonFallbackWarning, stacklevel=3)
        assert run.singleton_key is not None
        key_runs = self.store.active_runs_for_key(run.workflow_name, run.singleton_key)
        oldest = sorted(
            (r for r in key_runs if r.status in ("running", "suspended")), key=lambda r: (r.created_at, r.run_id)
        )
        if any(r.run_id == run.run_id for r in oldest[:limit]):
            return AdmissionResult.ADMITTED
        wake = self.now() + timedelta(
            seconds=retry_delay(self.settings.ADMISSION_RETRY_SECONDS, self.settings.ADMISSION_RETRY_JITTER_SECONDS)
        )
        if self.store.park(run.run_id, owner, "suspended", self.now(), wake_at=wake, reason="singleton"):
            return AdmissionResult.PARKED
        return AdmissionResult.GONE

    def _run_body(self, definition: WorkflowDefinition, run: RunRecord, owner: str) -> str:
        assert definition.body is not None
        ctx = WorkflowCtx(self, run, owner, self.store.load_steps(run.run_id))
        try:
            with _LeaseKeeper(self, run.run_id, owner):
                output = definition.body(ctx, run.input)
            output = to_json_value(output, "workflow output")
        except Suspend as parked:
            if not self.store.park(
                run.run_id, owner, parked.status, self.now(), wake_at=parked.wake_at, reason=parked.reason
            ):
                return "fenced"
            signals.run_parked.send(sender=Engine, run=run, reason=parked.reason)
            if parked.recheck is not None and parked.recheck():
                self.dispatcher.dispatch(run.run_id, definition.queue)
            return parked.status
        except LeaseLostError:
            logger.warning("run %s: lease lost; this turn's writes are fenced", run.run_id)
            return "fenced"
        except RunCancelledError:
            return self._finish(run, owner, "cancelled", error=self._cancel_error(run))
        except Exception as exc:  # the body may raise anything: it fails the run
            error = {
                "code": "exception",
                "type": type(exc).__qualname__,
                "message": printable(str(exc)),
                "traceback": printable(traceback.format_exc(limit=20)),
            }
            return self._finish(run, owner, "failed", error=error)
        return self._finish(run, owner, "completed", output=output)

    def _finish(self, run: RunRecord, owner: str | None, status: str, *, output: Any = None, error: Any = None) -> str:
        """Settle ``run`` by compare-and-set, then push the release (R2, S7)."""
        if not self.store.settle(run.run_id, owner, status, self.now(), output=output, error=error):
            return "fenced"
        final = run.evolve(status=status, output=output, error=error, admitted=False, tracked=False)
        if status == "dead":
            self._on_dead(final)
        signals.run_finished.send(sender=Engine, run=final)
        self.release(final)
        if final.parent_run_id:
            self._wake_parent(final.parent_run_id)
        return status

    def _wake_parent(self, parent_run_id: str) -> None:
        """Dispatch a parent parked on this child (D7); a parent still running
        re-checks after it parks, so the wake-up is never lost."""

        def wake() -> None:
            parent = self.store.get_run(parent_run_id)
            if parent is not None and parent.status == "suspended" and parent.park_reason.startswith("child:"):
                self.dispatcher.dispatch(parent_run_id, self._queue_of(parent))

        self.dispatcher.on_commit(wake)

    def _on_dead(self, run: RunRecord) -> None:
        signals.run_dead.send(sender=Engine, run=run)
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
        """Push the release of a terminal singleton run (S7).

        After the commit, make the oldest ``limit`` waiters of its key due and
        dispatch them; each claims through the store. Returns their ids.
        """
        if run.singleton_key is None:
            return []
        key = run.singleton_key
        limit = self._limit_of(run)
        queue = self._queue_of(run)
        woken: list[str] = []

        def push() -> None:
            woken.extend(self.store.wake_singleton_waiters(run.workflow_name, key, limit, self.now()))
            follow_ups = getattr(self._local, "follow_ups", None)
            for n, run_id in enumerate(woken):
                if n == 0 and follow_ups is not None and queue is None:
                    follow_ups.append(run_id)  # this worker runs it next: no broker hop
                else:
                    self.dispatcher.dispatch(run_id, queue)

        self.dispatcher.on_commit(push)
        return woken

    # -- operator actions ----------------------------------------------------
    def cancel(self, run_id: str) -> RunRecord:
        """Cancel a run (D6): pending, suspended and blocked runs at once; a
        running body at its next step boundary. Releases the slot (S7).

        Raises :class:`RunNotFoundError`. A terminal run is returned unchanged.
        """
        self.get(run_id)
        run = self.store.request_cancel(run_id, self.now())
        if run is None:
            raise RunNotFoundError(f"no run {run_id!r}")
        if run.status == "cancelled" and run.finished_at is not None:
            signals.run_finished.send(sender=Engine, run=run)
            self.release(run)
        elif run.status == "running":
            self.dispatcher.dispatch(run_id, self._queue_of(run))
        return run

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
        now = self.now()
        deadline = now + timedelta(seconds=timeout) if timeout else None  # a retry gets a fresh timeout (D5)
        run = self.store.reset_for_retry(run_id, now, self.settings.REDELIVERY_SECONDS, deadline)
        if run is None:
            raise ValidationError(f"run {run_id!r} is not failed or dead; only those can be retried")
        self.dispatcher.dispatch(run_id, self._queue_of(run))
        return run

    def wake(self, run_id: str) -> RunRecord:
        """Make a parked run due now and dispatch its turn. Raises :class:`RunNotFoundError`."""
        run = self.get(run_id)
        if run.status in ("pending", "suspended", "blocked"):
            self.dispatcher.dispatch(run_id, self._queue_of(run))
        return run

    def signal(self, run_id: str, name: str, payload: Any = None) -> RunRecord:
        """Buffer signal ``name`` for an active run and wake it if it waits (D2).

        Raises :class:`RunNotFoundError` if the run does not exist or is
        terminal, and :class:`InvalidInputError` for a non-JSON payload.
        """
        payload = to_json_value(payload, "signal payload")
        check_text(name, "signal name")
        self.get(run_id)
        run = self.store.add_signal(run_id, name, payload, self.now())
        if run is None:
            raise RunNotFoundError(f"no active run {run_id!r} to signal")
        if run.status in ("suspended", "blocked") and run.park_reason.startswith("signal:"):
            self.dispatcher.dispatch(run_id, self._queue_of(run))
        return run

    def signal_with_start(
        self, name: str, input: Any, *, run_id: str, signal: str, payload: Any = None, tags: Iterable[str] = ()
    ) -> RunRecord:
        """Start (idempotent by ``run_id``), then signal the run (S18).

        On a busy key the run queues like any other; the signal is buffered
        and seen by the body only once admitted.
        """
        payload = to_json_value(payload, "signal payload")
        check_text(signal, "signal name")
        run = self.start(name, input, run_id=run_id, tags=tags)
        return self.signal(run.run_id, signal, payload)

    def emit(self, event: str, payload: Any = None, *, event_id: str | None = None) -> list[RunRecord]:
        """Start every workflow subscribed to ``event`` with ``payload`` as input (D8).

        With ``event_id``, each run id is ``event:<event_id>:<workflow>``, so
        emitting the same event twice starts nothing new (R3). A subscriber
        whose key queue is full is skipped and logged (S16); returns the runs
        started or found.
        """
        check_text(event, "event")
        if event_id is not None:
            check_text(event_id, "event_id", 120)
        payload = to_json_value(payload, "event payload")
        runs = []
        for definition in self.registry.subscribers(event):
            run_id = f"event:{event_id}:{definition.name}" if event_id else None
            try:
                runs.append(self.start(definition.name, payload, run_id=run_id))
            except SingletonQueueFullError as exc:
                logger.warning("event %s: %s", event, exc)
        return runs

    def _queue_of(self, run: RunRecord) -> str | None:
        try:
            return self.registry.get(run.workflow_name).queue
        except UnknownWorkflowError:
            return None

    # -- the tick ------------------------------------------------------------
    def tick(self) -> TickReport:
        """Run one tick (S8, S8a, D4, D5): settle overdue runs as cancelled with
        code ``execution_timeout``, make due the oldest waiters of keys with a
        free slot, and dispatch due runs and runs whose lease expired. Safe to
        run on several machines at once."""
        settings = self.settings
        report = TickReport()
        now = self.now()
        for run_id in self.store.overdue_runs(now, settings.TICK_BATCH):
            run = self.store.get_run(run_id)
            if run is None or run.status not in ACTIVE_STATUSES:
                continue
            if run.status == "running" and run.lease_expires_at is not None and run.lease_expires_at > now:
                # The body is still running under a live lease: stop it at its
                # next step boundary; the slot is released when it settles, so
                # two bodies never overlap (D5, S9).
                if not run.cancel_requested:
                    self.store.request_cancel(run_id, now)
                    report.timed_out.append(run_id)
                continue
            error = {"code": "execution_timeout", "message": "execution timeout passed"}
            if self.store.settle(run_id, None, "cancelled", now, error=error):
                report.timed_out.append(run_id)
                final = run.evolve(status="cancelled", error=error, admitted=False, tracked=False)
                signals.run_finished.send(sender=Engine, run=final)
                self.release(final)
        limits = {d.name: d.singleton.limit for d in list(self.registry.latest.values()) if d.singleton is not None}
        if limits:
            report.caught_up = self.store.singleton_catch_up(now, limits)
        schedules.fire_due_schedules(self, now, settings.TICK_BATCH)  # its own bounded batch (S17, S8b)
        retention.retention_batch(self, now)  # finished runs past RETENTION_SECONDS, bounded (O2, S8b)
        for run_id, workflow_name in self.store.due_runs(now, settings.REDELIVERY_SECONDS, settings.TICK_BATCH):
            try:
                queue = self.registry.get(workflow_name).queue
            except UnknownWorkflowError:
                queue = None
            self.dispatcher.dispatch(run_id, queue)
            report.dispatched.append(run_id)
        heartbeat.record_tick(self, now)  # for manage.py durable_health (O3)
        return report

    def audit_slots(self, repair: bool = False) -> Any:
        """Check the slot invariants (K4), repairing the safe findings if ``repair``: :mod:`durable_singleton.audit`."""
        from .audit import audit_slots

        return audit_slots(self, repair=repair)

    def close_thread_resources(self) -> None:
        """Release per-thread resources (database connections) of a helper thread."""
        closer = getattr(self.dispatcher, "close_thread_resources", None)
        if closer is not None:
            closer()


_engines: dict[Settings, Engine] = {}
_engines_lock = threading.Lock()


def build_store(settings: Settings) -> Any:
    """Return the store named by ``settings.STORE`` ("django" or "memory").

    Raises :class:`~durable_singleton.exceptions.ConfigurationError`.
    """
    from .exceptions import ConfigurationError

    options = {
        "admission_retry_seconds": settings.ADMISSION_RETRY_SECONDS,
        "admission_retry_jitter": settings.ADMISSION_RETRY_JITTER_SECONDS,
        "backlog_retry_seconds": settings.BACKLOG_RETRY_SECONDS,
    }
    if settings.STORE == "django":
        from .stores.django import DjangoStore

        return DjangoStore(settings.DATABASE, claim_retries=settings.CLAIM_RETRIES, **options)
    if settings.STORE == "memory":
        from .stores.memory import MemoryStore

        return MemoryStore(**options)
    raise ConfigurationError(f"DURABLE_SINGLETON['STORE'] must be 'django' or 'memory', got {settings.STORE!r}")


def build_engine(settings: Settings) -> Engine:
    """Build an engine from ``settings``: its store and its dispatcher."""
    from .dispatch import build_dispatcher

    store = build_store(settings)
    engine = Engine(store, build_dispatcher(settings, store), settings=settings)
    engine.dispatcher.bind(engine)
    return engine


def get_engine() -> Engine:
    """Return the default engine for the current Django settings (built once per settings)."""
    settings = get_settings()
    with _engines_lock:
        engine = _engines.get(settings)
        if engine is None:
            engine = _engines[settings] = build_engine(settings)
        return engine
