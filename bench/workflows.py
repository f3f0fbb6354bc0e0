"""durable_singleton's side of the benchmark: one workflow, limit 1 per key, and a debounced one (X7)."""

from __future__ import annotations

from typing import Any

from durable_singleton import BaseWorkflow, Debounce, Singleton, WorkflowCtx, workflow

from . import audit

WORKFLOW = "bench-singleton"
DEBOUNCED = "bench-debounced"


def bench_key(input: dict[str, Any]) -> str:
    """Key each run by its ``key`` input."""
    return str(input["key"])


@workflow(name=WORKFLOW, version="1", singleton=Singleton(key=bench_key, limit=1))
class BenchSingleton(BaseWorkflow):
    """A near-empty body under the audit.

    ``hold``: the body blocks its worker until the runner releases the
    scenario (a holder doing long work). ``park``: the body first waits for
    the signal ``release``, parked durably with its slot and no worker (a
    long holder that costs nothing while it waits, D2, S6).
    """

    def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> None:
        if input.get("park"):
            ctx.wait_for_signal("release")
        audit.body(input["tag"], input["key"], ctx.run_id, holds=bool(input.get("hold")))


@workflow(
    name=DEBOUNCED,
    version="1",
    singleton=Singleton(key=bench_key, limit=1),
    debounce=Debounce(key=bench_key, seconds=3600, max_seconds=7200),
)
class BenchDebounced(BaseWorkflow):
    """A debounced workflow (X7): a burst of starts on one key is one run. The
    scenario cancels its run before its hour of quiet is up; the body never runs."""

    def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> None:
        audit.body(input["tag"], input["key"], ctx.run_id, holds=False)
