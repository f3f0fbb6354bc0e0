"""The context a workflow body sees: memoized steps, sleeps, signals, blocking.

A body is re-run from the top after every suspension and recovery; each
``ctx`` call takes the next position, and a position already stored returns
its stored result instead of running again (R4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, Protocol

from . import tracing
from .conf import Settings
from .definitions import Registry
from .exceptions import (
    ChildWorkflowError,
    DurableSingletonError,
    LeaseLostError,
    RunCancelledError,
    RunIdInUseError,
    SignalTimeoutError,
    SingletonQueueFullError,
    StepInTransactionError,
)
from .leases import Lease
from .statuses import ParkReason, RunStatus, Verdict
from .stores.base import BaseStore, RunRecord, StepRecord
from .values import MAX_JSON_DEPTH, check_seconds, check_text, derived_id, printable, to_json_value


class TurnHost(Protocol):
    """What a body's context uses of the core that runs its turn
    (:class:`~durable_singleton.core.Core`): its store, settings, registry
    and clock, and :meth:`start` for child workflows (D7)."""

    store: BaseStore
    settings: Settings
    registry: Registry
    now: Callable[[], datetime]

    def corrected_now(self) -> datetime:
        """The current time, the process clock corrected to the store's first (R8)."""
        ...

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
        """Start a run (see :meth:`durable_singleton.engine.Engine.start`)."""
        ...


__all__ = ["MAX_JSON_DEPTH", "Suspend", "TurnHost", "WorkflowCtx", "check_text", "printable", "to_json_value"]

_SLEEP = "durable:sleep"
_WAIT = "durable:wait"
_SIGNAL = "durable:signal"
_CHILD = "durable:child"
#: The step a parent stores when ``call_child`` first sees its child's outcome (D7, O2).
_CHILD_OUTCOME = "durable:child-outcome"


@dataclass(frozen=True)
class Suspend(BaseException):
    """Raised inside a body to park the run; caught by the engine.

    A ``BaseException`` so a body's ``except Exception`` cannot swallow it.
    """

    status: str
    wake_at: datetime | None
    reason: str
    # Called after the park is written: True means what the body waits for
    # arrived in between, and the run must be dispatched again (no lost wake-up).
    recheck: Callable[[], bool] | None = None


class Interrupted(BaseException):
    """Raised inside a body when a store call failed (the database or the
    network went away, a connection was killed); caught by the engine.

    The failure is the infrastructure's, not the workflow's: the engine ends
    the turn without failing the run, which keeps its slot and resumes from
    its stored steps (R4, S6, D4). A ``BaseException`` so a body's ``except
    Exception`` cannot swallow it. ``__cause__`` is the store's exception.
    """


class _GuardedStore:
    """The engine's store as a body's context calls it: an exception by which
    the store says it is unreachable (:meth:`BaseStore.is_unreachable`)
    becomes :class:`Interrupted`; any other propagates (and fails the run)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return guarded(self._store, method, *args, **kwargs)

        return call


def guarded(store: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; raise :class:`Interrupted` from an exception ``store``
    classes as the store being unreachable, re-raise any other."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if isinstance(exc, DurableSingletonError) or not store.is_unreachable(exc):
            raise
        raise Interrupted(f"{getattr(fn, '__name__', fn)!s} failed: {exc!r}") from exc


class WorkflowCtx:
    """What a running body may do. Created by the engine for one turn;
    ``engine`` is the :class:`TurnHost` that runs it."""

    def __init__(self, engine: TurnHost, run: RunRecord, owner: str, steps: dict[int, StepRecord]) -> None:
        self.engine = engine
        self.run = run
        self.owner = owner
        self._steps = steps
        self._position = 0
        self._clock_corrected = False
        self._store = _GuardedStore(engine.store)
        #: Set when a boundary raised :class:`RunCancelledError` or
        #: :class:`LeaseLostError`: a body that swallows either still ends
        #: cancelled, or fenced, however it returns (D6, R5).
        self.stopped_by: type[Exception] | None = None
        #: The store's transaction depth when the turn began: deeper at a
        #: ``ctx`` write means the body opened a transaction around it.
        self._depth = engine.store.transaction_depth()
        #: This turn's lease at the process's renewer, set while the body runs:
        #: once a renewal found it taken over, the next boundary stops the body
        #: without asking the store again (R5).
        self.lease: Lease | None = None

    @property
    def run_id(self) -> str:
        """Return the id of the run this body executes."""
        return self.run.run_id

    @property
    def steps(self) -> Mapping[int, StepRecord]:
        """Return the run's stored steps by position (read only): those replayed and those this turn stored."""
        return MappingProxyType(self._steps)

    @property
    def fencing_token(self) -> int | None:
        """Return this run's fencing token (K1): a per-key number that strictly
        increases across the key's admissions; None for a run without a key.

        Pass it to an external system that keeps the highest token it has seen
        and refuses writes with a lower one: a holder whose lease was taken
        over then cannot overwrite its successor's work.
        """
        return self.run.fencing_token

    @property
    def quota_tokens(self) -> dict[str, int]:
        """Return this run's fencing token in each shared quota it holds a slot
        of, by quota name (X3f, K1): per quota key, strictly increasing across
        its admissions and takeovers; empty for a run without quotas. Fixed by
        the claim that started this turn, as :attr:`fencing_token` is: a stalled
        executor whose lease was taken over keeps its older tokens."""
        return dict(self.run.quota_tokens)

    def _next(self) -> tuple[int, StepRecord | None]:
        position = self._position
        self._position += 1
        return position, self._steps.get(position)

    def _outside_transaction(self) -> None:
        """Refuse a ``ctx`` write inside a transaction the body opened on the
        store's database: the write would hold the run's row lock until the
        body's transaction ends (R5). Raises :class:`StepInTransactionError`."""
        depth = self.engine.store.transaction_depth()
        if depth > self._depth:
            raise StepInTransactionError(
                f"run {self.run.run_id!r}: a ctx call that writes (step, sleep, signal wait, child) inside "
                f"transaction.atomic() on the store's database ({depth - self._depth} open since the turn began); "
                "its write would hold the run's row lock until that transaction ends, so the lease renewal would "
                "wait for the body. Open the transaction inside the step's handler instead"
            )

    def _boundary(self) -> None:
        """Stop at a step boundary if the run was cancelled or taken over (D6, R5),
        or refuse the boundary inside a transaction the body opened (R5)."""
        self._outside_transaction()
        if self.lease is not None and self.lease.fenced.is_set():
            self.stopped_by = LeaseLostError
            raise LeaseLostError(f"run {self.run.run_id!r}: lease lost by {self.owner}")
        verdict = self._store.check_boundary(self.run.run_id, self.owner, self.engine.settings.LEASE_SECONDS)
        if verdict == Verdict.CANCELLED:
            self.stopped_by = RunCancelledError
            raise RunCancelledError(f"run {self.run.run_id!r} was cancelled")
        if verdict != Verdict.OK:
            self.stopped_by = LeaseLostError
            raise LeaseLostError(f"run {self.run.run_id!r}: lease lost by {self.owner}")

    def _record(self, position: int, name: str, result: Any, started_at: datetime, max_bytes: int | None = None) -> Any:
        self._outside_transaction()
        result = to_json_value(result, f"result of step {name!r}", max_bytes=max_bytes)
        record = StepRecord(position, name, result, started_at, self.engine.now())
        if not self._store.save_step(self.run.run_id, self.owner, record):
            self._boundary()  # raises: cancelled or fenced
            self.stopped_by = LeaseLostError
            raise LeaseLostError(f"run {self.run.run_id!r}: step {position} was stored by another executor")
        self._steps[position] = record
        return result

    def step(self, name: str, input: Any = None) -> Any:
        """Run step ``name`` once for this run and position; return its JSON result (R4).

        Raises :class:`UnknownStepError` for an unregistered name,
        :class:`StepInTransactionError` when called inside a
        ``transaction.atomic()`` the body opened on the store's database
        (nothing is run or written; uncaught, the run fails with it),
        :class:`InvalidInputError` for a result that is not JSON or is larger
        than ``MAX_RESULT_BYTES`` (it is not stored: the run fails unless the
        body handles it), :class:`RunCancelledError` if the run was cancelled,
        and :class:`LeaseLostError` if another executor took the run over.
        """
        handler = self.engine.registry.get_step(name)
        position, stored = self._next()
        if stored is not None:
            return stored.result
        self._boundary()
        started = self.engine.now()
        with tracing.step(self.run, name):
            result = handler(to_json_value(input, f"input of step {name!r}"))
            return self._record(position, name, result, started, self.engine.settings.MAX_RESULT_BYTES)

    def _now(self) -> datetime:
        """The time a wake, a deadline or a poll is computed from (R8, D1, D2).

        The first use in a turn corrects the process clock to the store's (one
        read of the store's clock), so a clock stepped since the engine's last
        correction never moves a ``wake_at`` or a deadline; later uses in the
        same turn reuse that correction.
        """
        if self._clock_corrected:
            return self.engine.now()
        self._clock_corrected = True
        return self.engine.corrected_now()

    def sleep(self, seconds: float) -> None:
        """Park the run for ``seconds`` (an int or float, finite, from 0 to
        :data:`~durable_singleton.values.MAX_SECONDS`, 100 years); a holder keeps
        its slot (D1, S6). Raises :class:`ValidationError` for any other value
        (nothing is written; uncaught, the run fails with it)."""
        seconds = check_seconds(seconds, "ctx.sleep seconds")
        self.sleep_until(self._now() + timedelta(seconds=seconds))

    def sleep_until(self, when: datetime) -> None:
        """Park the run until ``when`` (an aware datetime); a holder keeps its slot (D1)."""
        position, stored = self._next()
        if stored is None:
            self._boundary()
            self._record(position, _SLEEP, when.isoformat(), self.engine.now())
            target = when
        else:
            target = datetime.fromisoformat(stored.result)
        if self._now() < target:
            raise Suspend(RunStatus.SUSPENDED, target, ParkReason.SLEEP)

    def wait_for_signal(self, name: str, timeout: float | None = None) -> Any:
        """Return the payload of the next signal ``name``, parking until it arrives (D2).

        Signals sent before the wait are buffered, in order. ``timeout`` is in
        seconds (None: no timeout, or an int or float, finite, from 0 to
        :data:`~durable_singleton.values.MAX_SECONDS`, else :class:`ValidationError`
        before anything is written); when it passes, :class:`SignalTimeoutError`
        is raised here.
        """
        if timeout is not None:
            timeout = check_seconds(timeout, "wait_for_signal timeout")
        start_position, started = self._next()
        if started is None:
            self._boundary()
            deadline = self._now() + timedelta(seconds=timeout) if timeout is not None else None
            started_rec = {"deadline": deadline.isoformat() if deadline else None}
            self._record(start_position, _WAIT, started_rec, self.engine.now())
        else:
            started_rec = started.result
        position, stored = self._next()
        if stored is not None:
            if stored.result.get("timeout"):
                raise SignalTimeoutError(f"signal {name!r} did not arrive within {timeout} s")
            return stored.result["payload"]
        consumed = {s.result.get("seq") for s in self._steps.values() if s.name == _SIGNAL}
        for signal in self._store.load_signals(self.run.run_id):
            if signal.name == name and signal.seq not in consumed:
                self._record(position, _SIGNAL, {"seq": signal.seq, "payload": signal.payload}, self.engine.now())
                return signal.payload
        now = self._now()
        stored_deadline = started_rec.get("deadline")
        deadline = datetime.fromisoformat(stored_deadline) if stored_deadline else None
        if deadline is not None and now >= deadline:
            self._record(position, _SIGNAL, {"timeout": True}, now)
            raise SignalTimeoutError(f"signal {name!r} did not arrive within {timeout} s")
        fallback = now + timedelta(seconds=self.engine.settings.SIGNAL_FALLBACK_SECONDS)

        def arrived() -> bool:
            return any(
                s.name == name and s.seq not in consumed for s in self.engine.store.load_signals(self.run.run_id)
            )

        raise Suspend(
            RunStatus.SUSPENDED, min(deadline, fallback) if deadline else fallback, ParkReason.SIGNAL.of(name), arrived
        )

    def start_child(self, name: str, input: Any = None, *, run_id: str | None = None, tags: Iterable[str] = ()) -> str:
        """Start child workflow ``name`` once; return its run id (D7).

        The child id is deterministic (``<parent>:child:<position>`` unless
        given; past 191 characters, shortened with a hash suffix by
        :func:`~durable_singleton.values.derived_id`) and the child inherits
        the namespace. A child rejected by its
        queue cap (S16), or whose id a run of another namespace holds (D10),
        raises :class:`ChildWorkflowError` here, on every replay.
        """
        position, stored = self._next()
        if stored is not None:
            result = stored.result
        else:
            self._boundary()
            child_id = run_id or derived_id(f"{self.run.run_id}:child:{position}")
            try:
                guarded(
                    self.engine.store,
                    self.engine.start,
                    name,
                    input,
                    run_id=child_id,
                    tags=tags,
                    parent_run_id=self.run.run_id,
                    namespace=self.run.namespace,
                )
                result = {"run_id": child_id}
            except (SingletonQueueFullError, RunIdInUseError) as exc:
                # A full queue (S16), or an id another namespace's run holds: a
                # child lives in its parent's namespace (D7, D10).
                result = {"run_id": child_id, "rejected": str(exc)}
            self._record(position, _CHILD, result, self.engine.now())
        if "rejected" in result:
            raise ChildWorkflowError(result["run_id"], "rejected", result["rejected"])
        return str(result["run_id"])

    def call_child(self, name: str, input: Any = None, *, run_id: str | None = None) -> Any:
        """Start child workflow ``name`` once and return its output when it completes (D7).

        Parks the parent until the child is terminal. The outcome the parent
        first sees (the child's status, output and error) is stored as the
        parent's own next step (R4), so every replay returns or raises it
        again from there, even after retention, ``durable_purge`` or the admin
        deleted the child (O2). Raises :class:`ChildWorkflowError` if the child
        failed, was cancelled, died, was rejected by its queue cap (S16), or
        no longer exists when the parent first looks for its outcome
        (status ``"missing"``).
        """
        child_id = self.start_child(name, input, run_id=run_id)
        stored = self._steps.get(self._position)
        if stored is not None and stored.name == _CHILD_OUTCOME:
            self._position += 1
            return self._child_outcome(child_id, stored.result)
        child = self._store.get_run(child_id)
        if stored is not None:
            # A parent of an older release, which kept no outcome: its next call
            # is stored here, and the child's row is the only outcome it has.
            if child is None:
                raise ChildWorkflowError(child_id, "missing", "the child run no longer exists")
            return self._child_outcome(child_id, {"status": child.status, "output": child.output, "error": child.error})
        if child is None or child.is_terminal:
            outcome = (
                {"status": child.status, "output": child.output, "error": child.error}
                if child is not None
                else {"status": "missing", "output": None, "error": "the child run no longer exists"}
            )
            position, _ = self._next()
            self._boundary()
            self._record(position, _CHILD_OUTCOME, outcome, self.engine.now())
            return self._child_outcome(child_id, outcome)

        def finished() -> bool:
            latest = self.engine.store.get_run(child_id)
            return latest is None or latest.is_terminal

        wake = self._now() + timedelta(seconds=self.engine.settings.SIGNAL_FALLBACK_SECONDS)
        raise Suspend(RunStatus.SUSPENDED, wake, ParkReason.CHILD.of(child_id), finished)

    @staticmethod
    def _child_outcome(child_id: str, outcome: Mapping[str, Any]) -> Any:
        """Return a child's output, or raise :class:`ChildWorkflowError` for any other end (D7)."""
        if outcome["status"] == RunStatus.COMPLETED:
            return outcome["output"]
        raise ChildWorkflowError(child_id, outcome["status"], outcome["error"])

    def block(self, reason: str, poll_seconds: float = 5.0) -> None:
        """Park the run ``blocked`` with ``reason``; the tick re-drives it after
        ``poll_seconds`` and the body runs again from the top (D3)."""
        raise Suspend(
            RunStatus.BLOCKED, self._now() + timedelta(seconds=poll_seconds), reason or RunStatus.BLOCKED.value
        )
