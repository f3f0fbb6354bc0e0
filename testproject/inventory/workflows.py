"""The reference text's sync-inventory workflow, and the demo's variant.

Discovered automatically: durable_singleton imports every installed app's
``workflows`` module at startup.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.utils import timezone

from durable_singleton import BaseWorkflow, Singleton, WorkflowCtx, step, workflow

from .models import BodyAudit


@step("inventory:fetch")
def fetch(store: dict[str, Any]) -> list[dict[str, Any]]:
    """Record the body's entry, pretend to fetch the store's items for ``duration`` seconds."""
    BodyAudit.objects.update_or_create(
        run_id=store["run_id"],
        defaults={
            "workflow_name": store["workflow"],
            "key": f"store:{store['store_id']}",
            "entered_at": timezone.now(),
            "pid": os.getpid(),
        },
    )
    time.sleep(float(store.get("duration", 0)))
    return [{"sku": f"{store['store_id']}-{n}", "qty": n} for n in range(3)]


@step("inventory:reconcile")
def reconcile(payload: dict[str, Any]) -> int:
    """Pretend to reconcile, then record the body's exit."""
    time.sleep(float(payload.get("duration", 0)))
    BodyAudit.objects.filter(run_id=payload["run_id"]).update(exited_at=timezone.now())
    return len(payload["items"])


def _body(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    half = float(input.get("duration", 0)) / 2
    args = {**input, "run_id": ctx.run_id, "workflow": ctx.run.workflow_name, "duration": half}
    items = ctx.step("inventory:fetch", args)
    count = ctx.step("inventory:reconcile", {"run_id": ctx.run_id, "items": items, "duration": half})
    return {"store_id": input["store_id"], "reconciled": count}


def store_key(input: dict[str, Any]) -> str:
    """Key each run by its store: one sync per store at a time."""
    return f"store:{input['store_id']}"


@workflow(
    name="sync-inventory",
    version="1",
    singleton=Singleton(key=store_key, limit=1, max_queue_depth=2),
    steps=("inventory:fetch", "inventory:reconcile"),
)
class SyncInventory(BaseWorkflow):
    """One inventory sync per store (the reference text's example)."""

    def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
        return _body(ctx, input)


class DemoSyncInventory(BaseWorkflow):
    """The demo's sync: no queue cap, ``limit`` from ``DURABLE_DEMO_LIMIT`` (default 1)."""

    workflow = {
        "name": "demo-sync-inventory",
        "version": "1",
        "singleton": {"key": store_key, "limit": int(os.environ.get("DURABLE_DEMO_LIMIT", "1"))},
    }

    def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
        return _body(ctx, input)


def _limit_two_key(input: dict[str, Any]) -> str:
    return f"store:{input['store_id']}"


@workflow(name="sync-inventory-wide", version="1", singleton=Singleton(key=_limit_two_key, limit=2))
class SyncInventoryWide(BaseWorkflow):
    """Two syncs per store at a time (used by the end-to-end test's third key)."""

    def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
        return _body(ctx, input)
