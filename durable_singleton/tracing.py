"""OpenTelemetry spans of runs (O8), when ``opentelemetry-api`` is installed
(the ``otel`` extra); off and free when it is not.

Spans, all with the attributes ``durable.workflow``, ``durable.key`` (a run
without a key has none) and ``durable.run_id``:

* ``durable.start <workflow>`` (kind PRODUCER) around :meth:`Engine.start`
  (``durable.start_many <workflow>`` around ``start_many``, with
  ``durable.runs``). The run stores the W3C ``traceparent`` of the context
  current at its start (this span's) in ``Run.trace_parent``;
* ``durable.turn <workflow>`` (kind CONSUMER) for each turn, from the moment
  the worker called :meth:`Engine.execute` to the turn's outcome
  (``durable.outcome``), with ``durable.worker`` (``host:pid:token``). It is a
  child of the context stored at the start, so a run's turns continue the
  trace of the request that started it, in whichever process they run; the
  context current in the worker (a Celery task's span, say) is a link;
* ``durable.wait <workflow>`` when a run takes a slot of its key: from its
  creation (or its ``not_before``) to its admission (S5);
* ``durable.step <step>`` for each step a body runs (a replayed step has none),
  a child of its turn, with ``durable.step``;
* ``durable.handoff <workflow>`` when a settle grants the slot to waiters (S7),
  a child of the releasing turn, with ``durable.granted`` (their run ids).

The spans go to the tracer provider the process configured
(``opentelemetry.trace.set_tracer_provider``, or an SDK's auto-instrumentation);
without one they are the API's no-op spans. Without ``opentelemetry-api`` no
module of it is imported and each helper returns at once.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import Any, TypeVar

from .identity import process_name
from .records import RunRecord

__all__ = ["connect", "enabled", "handoff", "started", "step", "traceparent", "turn", "waited"]

F = TypeVar("F", bound=Callable[..., Any])

#: The OpenTelemetry API once looked for: None before, False when it is absent.
_api: Any = None


class _Api:
    """What the helpers use of ``opentelemetry-api``, imported once."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.context = context
        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.tracer = trace.get_tracer("durable_singleton")


def _otel() -> _Api | None:
    """Return the API, importing it at the first call; None when it is not installed."""
    global _api
    if _api is None:
        try:
            _api = _Api()
        except ImportError:
            _api = False
    return _api or None


def enabled() -> bool:
    """Tell whether ``opentelemetry-api`` is installed (spans are made)."""
    return _otel() is not None


def _attributes(run: RunRecord) -> dict[str, str]:
    found = {"durable.workflow": run.workflow_name, "durable.run_id": run.run_id}
    if run.singleton_key is not None:
        found["durable.key"] = run.singleton_key
    return found


def _parent(api: _Api, run: RunRecord | None) -> Any:
    """The context stored with ``run`` at its start, or None."""
    if run is None or not run.trace_parent:
        return None
    return api.propagator.extract({"traceparent": run.trace_parent})


def _ns(when: datetime | None) -> int | None:
    return int(when.timestamp() * 1e9) if when is not None else None


def traceparent() -> str | None:
    """Return the W3C ``traceparent`` of the current context, or None (no
    span, or no ``opentelemetry-api``): what a start stores with its run."""
    api = _otel()
    if api is None:
        return None
    carrier: dict[str, str] = {}
    api.propagator.inject(carrier)
    return carrier.get("traceparent")


def started(many: bool = False) -> Callable[[F], F]:
    """Decorate :meth:`Core.start` (``many``: ``start_many``), whose first
    argument after ``self`` is the workflow name: run it inside the span
    ``durable.start <workflow>`` (``durable.start_many``), current while the
    run is built, so the run stores that span's ``traceparent``."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def traced(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
            api = _otel()
            if api is None:
                return fn(self, name, *args, **kwargs)
            what = "durable.start_many" if many else "durable.start"
            kind = api.trace.SpanKind.PRODUCER
            with api.tracer.start_as_current_span(f"{what} {name}", kind=kind) as span:
                span.set_attribute("durable.workflow", name)
                result = fn(self, name, *args, **kwargs)
                if isinstance(result, RunRecord):
                    span.set_attributes(_attributes(result))
                elif isinstance(result, list):
                    span.set_attribute("durable.runs", len(result))
                return result

        return traced  # type: ignore[return-value]

    return decorate


class _Turn:
    """One turn's span, made once the claim read the run (its stored context is the parent)."""

    def __init__(self, api: _Api, run_id: str) -> None:
        self.api = api
        self.run_id = run_id
        self.begun = time.time_ns()
        self.span: Any = None
        self.token: Any = None

    def claimed(self, run: RunRecord | None) -> None:
        """Open the span, a child of ``run``'s stored context, and make it current."""
        api = self.api
        links = []
        here = api.trace.get_current_span().get_span_context()
        if here.is_valid:
            links.append(api.trace.Link(here))
        attributes = _attributes(run) if run is not None else {"durable.run_id": self.run_id}
        attributes["durable.worker"] = process_name()
        self.span = api.tracer.start_span(
            f"durable.turn {run.workflow_name if run is not None else ''}".rstrip(),
            context=_parent(api, run),
            kind=api.trace.SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
            start_time=self.begun,
        )
        self.token = api.context.attach(api.trace.set_span_in_context(self.span))

    def outcome(self, outcome: str) -> None:
        """Record the turn's outcome."""
        if self.span is None:
            self.claimed(None)
        self.span.set_attribute("durable.outcome", str(outcome))

    def end(self, exc: BaseException | None) -> None:
        if self.span is None:
            self.claimed(None)
        if exc is not None:
            self.span.record_exception(exc)
            self.span.set_status(self.api.trace.Status(self.api.trace.StatusCode.ERROR, type(exc).__qualname__))
        self.api.context.detach(self.token)
        self.span.end()


class _NoTurn:
    """The turn of a process without ``opentelemetry-api``: does nothing."""

    def claimed(self, run: RunRecord | None) -> None:
        pass

    def outcome(self, outcome: str) -> None:
        pass


_NO_TURN = _NoTurn()


@contextlib.contextmanager
def turn(run_id: str) -> Iterator[_Turn | _NoTurn]:
    """Time one turn of ``run_id``; the caller calls ``claimed(run)`` when its
    claim read the run, and ``outcome(value)`` at the end (see the module)."""
    api = _otel()
    if api is None:
        yield _NO_TURN
        return
    span = _Turn(api, run_id)
    try:
        yield span
    except BaseException as exc:
        span.end(exc)
        raise
    span.end(None)


@contextlib.contextmanager
def step(run: RunRecord, name: str) -> Iterator[None]:
    """Run a step's handler inside the span ``durable.step <name>``."""
    api = _otel()
    if api is None:
        yield
        return
    with api.tracer.start_as_current_span(f"durable.step {name}") as span:
        span.set_attributes({**_attributes(run), "durable.step": name})
        yield


def handoff(granted: Sequence[RunRecord]) -> contextlib.AbstractContextManager[Any]:
    """Return the span ``durable.handoff <workflow>`` of a settle that granted
    ``granted`` (their first one's workflow and key), or a null context."""
    api = _otel()
    if api is None or not granted:
        return contextlib.nullcontext()
    first = granted[0]
    attributes: dict[str, Any] = {**_attributes(first), "durable.granted": [r.run_id for r in granted]}
    del attributes["durable.run_id"]
    return api.tracer.start_as_current_span(f"durable.handoff {first.workflow_name}", attributes=attributes)


def waited(sender: Any, run: RunRecord, **kwargs: Any) -> None:
    """Receiver of ``run_admitted``: the span ``durable.wait <workflow>`` of
    ``run``, a child of its stored context, from its creation (or its
    ``not_before``) to its admission (``admitted_at``, else now)."""
    api = _otel()
    if api is None:
        return
    begun = max(run.created_at, run.not_before) if run.not_before is not None else run.created_at
    span = api.tracer.start_span(
        f"durable.wait {run.workflow_name}",
        context=_parent(api, run),
        attributes=_attributes(run),
        start_time=_ns(begun),
    )
    span.end(end_time=_ns(run.admitted_at) or time.time_ns())


def connect() -> None:
    """Connect :func:`waited` to ``run_admitted`` when ``opentelemetry-api``
    is installed (looked up, not imported)."""
    from importlib.util import find_spec

    if find_spec("opentelemetry") is None:
        return
    from .signals import run_admitted

    run_admitted.connect(waited, dispatch_uid="durable_singleton.tracing.waited")
