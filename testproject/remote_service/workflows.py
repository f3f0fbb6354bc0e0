"""The body of ``remote-sync``: registered under the same name, version,
queue and singleton as the test project's ``register_remote`` declaration,
and run only by this service's workers (SPEC section 2)."""

from __future__ import annotations

import os
import time
from typing import Any

from django.conf import settings

from durable_singleton import Singleton, WorkflowCtx, workflow

REMOTE_QUEUE = "remote"


def store_key(input: dict[str, Any]) -> str:
    """The same key function as the declaring service's (S1: that one computes the stored key)."""
    return f"store:{input['store_id']}"


@workflow(name="remote-sync", version="1", queue=REMOTE_QUEUE, singleton=Singleton(key=store_key, limit=1))
def remote_sync(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold the key for ``duration`` seconds; report which service and process ran the body, and when."""
    entered = time.time()
    time.sleep(float(input.get("duration", 0)))
    return {"service": settings.SERVICE_NAME, "pid": os.getpid(), "entered": entered, "exited": time.time()}
