"""Workflows used by the tests, registered into a test's own registry."""

from __future__ import annotations

import threading
from typing import Any

from durable_singleton import Singleton
from durable_singleton.definitions import Registry, WorkflowDefinition

from .conftest import Monitor


def audited(
    registry: Registry,
    monitor: Monitor,
    *,
    name: str = "wf",
    limit: int = 1,
    max_queue_depth: int | None = None,
    hold: threading.Event | None = None,
    steps: int = 1,
) -> WorkflowDefinition:
    """Register a singleton workflow keyed by ``input['k']`` whose body records
    entry and exit in ``monitor`` and, if ``hold`` is given, waits for it."""
    step_name = f"{name}:work"
    if step_name not in registry.steps:
        registry.add_step(step_name, lambda x: x)

    def body(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
        key = input["k"]
        monitor.enter(key, ctx.run_id)
        try:
            if hold is not None:
                assert hold.wait(30), "hold was never released"
            for n in range(steps):
                ctx.step(step_name, {"n": n})
            return {"done": ctx.run_id}
        finally:
            monitor.exit(key)

    return registry.add(
        name,
        "1",
        body,
        singleton=Singleton(key=lambda i: f"key:{i['k']}", limit=limit, max_queue_depth=max_queue_depth),
    )
