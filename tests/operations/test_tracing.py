"""OpenTelemetry spans of runs (O8), read with the SDK's in-memory exporter,
on the in-memory store and the Django store (the ``engine`` fixture runs each
test on both; the Django one on the DATABASE_URL database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from durable_singleton import Singleton
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from tests.celery_workers import REPO, CeleryWorkers, celery_stack_missing, celery_workers, worker_env
from tests.helpers import drain, holding_body

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="needs the otel extra and opentelemetry-sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

EXPORTER = InMemorySpanExporter()
_PROVIDER: list[TracerProvider] = []


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (an SDK one, set once) and its exporter, emptied."""
    if not _PROVIDER:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
        _PROVIDER.append(provider)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def _named(finished: Any, prefix: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name.startswith(prefix)]


def _keyed(registry: Registry, name: str = "traced") -> None:
    registry.add_step("traced:work", lambda x: x)

    def body(ctx: Any, input: dict[str, Any]) -> str:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        ctx.step("traced:work", {"n": 1})
        ctx.step("traced:work", {"n": 2})
        return str(ctx.run_id)

    registry.add(name, "1", body, singleton=Singleton(key=lambda i: f"key:{i['k']}", limit=1))


def test_a_runs_turns_continue_the_trace_of_the_request_that_started_it(
    engine: Engine, registry: Registry, spans: InMemorySpanExporter
) -> None:
    """O8: a start is the span ``durable.start`` in the caller's trace; the
    run stores its traceparent; the run's turn, in whichever thread runs it
    later, is ``durable.turn``, a child of the start, and each step a
    ``durable.step`` child of the turn; all carry workflow, key and run id."""
    _keyed(registry)
    tracer = trace.get_tracer("a web request")
    with tracer.start_as_current_span("POST /sync") as request:
        run = engine.start("traced", {"k": "A"})
    stored = engine.get(run.run_id).trace_parent
    trace_id = request.get_span_context().trace_id
    (start,) = _named(spans.get_finished_spans(), "durable.start")
    assert start.parent is not None and start.parent.span_id == request.get_span_context().span_id
    assert stored == f"00-{trace_id:032x}-{start.context.span_id:016x}-{start.context.trace_flags:02x}"
    spans.clear()
    drain(engine)
    finished = spans.get_finished_spans()
    (turn,) = _named(finished, "durable.turn")
    assert turn.context.trace_id == trace_id
    assert turn.parent is not None and turn.parent.span_id == start.context.span_id
    assert turn.attributes is not None
    assert dict(turn.attributes) == {
        "durable.workflow": "traced",
        "durable.key": "key:A",
        "durable.run_id": run.run_id,
        "durable.worker": turn.attributes["durable.worker"],
        "durable.outcome": "completed",
    }
    assert ":" in str(turn.attributes["durable.worker"])
    steps = _named(finished, "durable.step")
    assert [s.name for s in steps] == ["durable.step traced:work"] * 2
    assert all(s.parent is not None and s.parent.span_id == turn.context.span_id for s in steps)
    assert all(s.attributes and s.attributes["durable.run_id"] == run.run_id for s in steps)


def test_the_wait_for_a_slot_and_the_handoff_are_spans(
    engine: Engine, registry: Registry, spans: InMemorySpanExporter
) -> None:
    """O8, S5, S7: a waiter admitted by the holder's settle has the span
    ``durable.wait`` from its creation to its admission, in its own start's
    trace; the settle that granted it the slot is ``durable.handoff``, a child
    of the holder's turn, naming the waiter; the waiter's own turns continue
    its start's trace, not the holder's."""
    log: list[str] = []
    registry.add("held", "1", holding_body(log), singleton=Singleton(key=lambda i: "one", limit=1))
    tracer = trace.get_tracer("a web request")
    with tracer.start_as_current_span("first request"):
        holder = engine.start("held", {"hold": True})
    drain(engine)
    with tracer.start_as_current_span("second request") as second:
        waiter = engine.start("held", {})
    drain(engine)
    assert log == []
    spans.clear()
    engine.signal(holder.run_id, "go")
    drain(engine)
    assert log == [holder.run_id, waiter.run_id]
    finished = spans.get_finished_spans()
    (handoff,) = _named(finished, "durable.handoff")
    assert handoff.attributes is not None and list(handoff.attributes["durable.granted"]) == [waiter.run_id]  # type: ignore[arg-type]
    holder_turns = [s for s in _named(finished, "durable.turn") if s.attributes["durable.run_id"] == holder.run_id]  # type: ignore[index]
    assert handoff.parent is not None and handoff.parent.span_id in {t.context.span_id for t in holder_turns}
    (wait,) = _named(finished, "durable.wait")
    assert wait.attributes is not None and wait.attributes["durable.run_id"] == waiter.run_id
    assert wait.attributes["durable.key"] == "one"
    assert wait.context.trace_id == second.get_span_context().trace_id
    assert wait.start_time is not None and wait.end_time is not None and wait.start_time <= wait.end_time
    waiter_turns = [s for s in _named(finished, "durable.turn") if s.attributes["durable.run_id"] == waiter.run_id]  # type: ignore[index]
    assert waiter_turns and all(t.context.trace_id == second.get_span_context().trace_id for t in waiter_turns)


def test_a_start_outside_any_trace_roots_one_and_stores_it(
    engine: Engine, registry: Registry, spans: InMemorySpanExporter
) -> None:
    """O8: a start with no current span (a shell, the tick) opens a trace of
    its own: its ``durable.start`` span is a root, and the run stores that."""
    _keyed(registry)
    run = engine.start("traced", {"k": "B"})
    (start,) = _named(spans.get_finished_spans(), "durable.start")
    assert start.parent is None
    context = start.context
    assert (
        engine.get(run.run_id).trace_parent
        == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )


def test_without_opentelemetry_nothing_is_imported_and_runs_work() -> None:
    """O8: off and free without the package: a process where ``opentelemetry``
    cannot be imported starts and drains a run with steps as before, stores
    no trace, and never imports it."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if not installed: its import raises ImportError
import django
django.setup()
from durable_singleton import Singleton
from durable_singleton.definitions import Registry
from durable_singleton.testing import make_engine
registry = Registry()
registry.add_step("s", lambda x: x)
registry.add("w", "1", lambda ctx, i: ctx.step("s", 1), singleton=Singleton(key=lambda i: "k", limit=1))
engine = make_engine("memory", registry=registry)
run = engine.start("w", {})
engine.dispatcher.drain()
done = engine.get(run.run_id)
assert done.status == "completed" and done.trace_parent is None, done
from durable_singleton import tracing
assert not tracing.enabled()
assert [m for m in sys.modules if m.startswith("opentelemetry.")] == [], sorted(sys.modules)
print("ok")
"""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings", "DATABASE_URL": ""}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_turn_in_a_celery_worker_continues_the_trace_of_the_request(
    celery_workers: CeleryWorkers, spans: InMemorySpanExporter, tmp_path: Any
) -> None:
    """O8: a run started inside a request's span in this process runs its turn
    in a real Celery worker process (which exports its spans to a file): that
    turn's span is in the request's trace, a child of the start's span, and
    the body's step a child of the turn."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    from durable_singleton.dispatch import CeleryDispatcher
    from durable_singleton.models import Run
    from durable_singleton.stores.django import DjangoStore

    out = tmp_path / "spans.jsonl"
    celery_workers.start(1, concurrency=1, env=worker_env(DURABLE_OTEL_SPANS=str(out)))
    store = DjangoStore()
    engine = Engine(store, CeleryDispatcher(store))
    engine.dispatcher.bind(engine)
    with trace.get_tracer("a web request").start_as_current_span("POST /sync") as request:
        run = engine.start("fault-hold", {"store_id": f"otel-{uuid.uuid4().hex[:8]}", "seconds": 0})
    (start,) = _named(spans.get_finished_spans(), "durable.start")
    deadline = time.monotonic() + 120
    while Run.objects.get(pk=run.run_id).status != "completed":
        assert time.monotonic() < deadline, celery_workers.logs()
        time.sleep(0.2)
    exported = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    mine = [s for s in exported if s["attributes"].get("durable.run_id") == run.run_id]
    (turn,) = [s for s in mine if s["name"] == "durable.turn fault-hold"]
    (step,) = [s for s in mine if s["name"] == "durable.step fault:hold"]
    assert turn["context"]["trace_id"] == f"0x{request.get_span_context().trace_id:032x}"
    assert turn["parent_id"] == f"0x{start.context.span_id:016x}"
    assert step["parent_id"] == turn["context"]["span_id"]
    assert turn["attributes"]["durable.key"] == run.singleton_key
    assert turn["attributes"]["durable.outcome"] == "completed"
