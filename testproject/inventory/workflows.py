"""The reference text's sync-inventory workflow, and the demo's variant.

Discovered automatically: durable_singleton imports every installed app's
``workflows`` module at startup.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from durable_singleton import BaseWorkflow, Schedule, Singleton, WorkflowCtx, step, workflow

from . import crash_hooks
from .models import BodyAudit


@step("inventory:fetch")
def fetch(store: dict[str, Any]) -> list[dict[str, Any]]:
    """Record the body's entry, pretend to fetch the store's items for ``duration`` seconds."""
    # One upsert (INSERT ... ON CONFLICT / ON DUPLICATE KEY UPDATE): update_or_create's
    # SELECT ... FOR UPDATE of a missing row takes a gap lock on MariaDB, and two
    # bodies inserting at once deadlocked (1213), failing a run in a soak.
    audit = BodyAudit(
        run_id=store["run_id"],
        workflow_name=store["workflow"],
        key=f"store:{store['store_id']}",
        entered_at=timezone.now(),
        pid=os.getpid(),
    )
    BodyAudit.objects.bulk_create(
        [audit],
        update_conflicts=True,
        unique_fields=None if connection.vendor == "mysql" else ["run_id"],  # MySQL: ON DUPLICATE KEY
        update_fields=["workflow_name", "key", "entered_at", "pid"],
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


#: The stores synced on a schedule, every SYNC_EVERY_MINUTES minutes each
#: (the tests start runs on other stores, so a window never joins their queues).
SCHEDULED_STORES = ("north", "south")
SYNC_EVERY_MINUTES = int(os.environ.get("INVENTORY_SYNC_EVERY_MINUTES", "15"))


@workflow(
    name="sync-inventory",
    version="1",
    singleton=Singleton(key=store_key, limit=1, max_queue_depth=2),
    steps=("inventory:fetch", "inventory:reconcile"),
    # One sync per store every N minutes; the key serializes a store's syncs,
    # and a window whose previous sync still runs is skipped (S17).
    schedules=[
        Schedule(f"sync-store-{store}", every=SYNC_EVERY_MINUTES * 60, input={"store_id": store}, overlap="skip")
        for store in SCHEDULED_STORES
    ],
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


# -- fault tests (tests/workers/test_celery_faults.py) ---------------------------------

fault_logger = logging.getLogger("testproject.inventory")


@step("fault:hold")
def hold(args: dict[str, Any]) -> dict[str, Any]:
    """Record one body entry (a row per claim of the run), hold for ``seconds``, record the exit.

    A worker killed or paused inside this step leaves its row without an exit
    (or with a late one); the step result is stored only if the holder still
    has its lease (R4, R5).
    """
    row = BodyAudit.objects.create(
        run_id=args["entry"],
        workflow_name=args["workflow"],
        key=args["key"],
        entered_at=timezone.now(),
        pid=os.getpid(),
    )
    time.sleep(float(args.get("seconds", 0)))
    BodyAudit.objects.filter(pk=row.pk).update(exited_at=timezone.now())
    return {"pid": os.getpid()}


def _fault_body(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold for ``input["seconds"]`` (``input["seconds_after_recovery"]`` once
    the run was recovered from an expired lease, if given)."""
    seconds = input.get("seconds", 0)
    if ctx.run.recoveries:
        seconds = input.get("seconds_after_recovery", seconds)
    # The audit row is named after the claim (attempts grows with every claim),
    # so a re-driven run leaves one row per body entry.
    args = {
        "entry": f"{ctx.run_id}#{ctx.run.attempts}",
        "workflow": ctx.run.workflow_name,
        "key": ctx.run.singleton_key,
        "seconds": seconds,
    }
    result = ctx.step("fault:hold", args)
    return {"store_id": input["store_id"], "pid": result["pid"]}


def _log_dead(run: Any) -> None:
    """The fault workflows' on_dead hook: say so in the worker's log (D4)."""
    fault_logger.warning("on_dead hook: run %s is dead (%s)", run.run_id, (run.error or {}).get("code"))


@workflow(
    name="fault-hold",
    version="1",
    singleton=Singleton(key=store_key, limit=1),
    steps=("fault:hold",),
    on_dead=_log_dead,
)
def fault_hold(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold key ``store:<store_id>`` for ``seconds`` inside one step (fault tests)."""
    return _fault_body(ctx, input)


@workflow(
    name="fault-hold-isolated",
    version="1",
    singleton=Singleton(key=store_key, limit=1),
    steps=("fault:hold",),
    queue="ds-faults",
    on_dead=_log_dead,
)
def fault_hold_isolated(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """The same, with turns sent to Celery queue ``ds-faults`` (a test's own worker)."""
    return _fault_body(ctx, input)


@workflow(
    name="fault-hold-ttl",
    version="1",
    singleton=Singleton(key=store_key, limit=1, queue_ttl=8.0),
    steps=("fault:hold",),
    on_dead=_log_dead,
)
def fault_hold_ttl(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """The same, on a key whose waiters leave after 8 s (``queue_ttl``, X2): a
    timer only the tick fires (tests/workers/test_tick_period.py, O5)."""
    return _fault_body(ctx, input)


@workflow(
    name="fault-exit",
    version="1",
    singleton=Singleton(key=store_key, limit=1),
    steps=("fault:hold",),
    on_dead=_log_dead,
)
def fault_exit(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold as ``fault-hold`` does, then raise what ``input["raise"]`` names:
    ``"exit"`` calls ``sys.exit()``, ``"interrupt"`` raises KeyboardInterrupt
    (tests/core/test_body_base_exceptions_processes.py, R7); else return."""
    output = _fault_body(ctx, input)
    if input.get("raise") == "exit":
        sys.exit(f"fault-exit {ctx.run_id}")
    if input.get("raise") == "interrupt":
        raise KeyboardInterrupt(f"fault-exit {ctx.run_id}")
    return output


# -- handoff crash test (tests/core/test_handoff_crash_windows.py) ---------------------------

#: How long a body waits at its gate at most, in seconds.
HANDOFF_GATE_SECONDS = 60.0


@step("handoff:hold")
def handoff_hold(args: dict[str, Any]) -> dict[str, Any]:
    """Record one body entry (a ``BodyAudit`` row ``<run_id>#<attempts>``), wait
    until the file ``args["gate"]`` exists if given (else ``args["seconds"]``),
    record the exit."""
    row = BodyAudit.objects.create(
        run_id=args["entry"],
        workflow_name=args["workflow"],
        key=args["key"],
        entered_at=timezone.now(),
        pid=os.getpid(),
    )
    if args.get("gate"):
        deadline = time.monotonic() + HANDOFF_GATE_SECONDS
        while not os.path.exists(args["gate"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        time.sleep(float(args.get("seconds", 0)))
    BodyAudit.objects.filter(pk=row.pk).update(exited_at=timezone.now())
    return {"pid": os.getpid()}


@workflow(name="handoff-kill", version="1", singleton=Singleton(key=store_key, limit=1), steps=("handoff:hold",))
def handoff_kill(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold key ``store:<store_id>`` until ``input["gate"]`` exists (or for
    ``input["seconds"]``); return the process and the fencing token the body
    ran with. Its first statement is the ``body`` crash point of
    :mod:`testproject.inventory.crash_hooks`: the claim committed, nothing of
    the body done. No queue of its own, so a handoff runs the granted waiter's
    turn on the releasing worker (``execute_chain``)."""
    crash_hooks.maybe_kill("body", ctx.run)
    args = {
        "entry": f"{ctx.run_id}#{ctx.run.attempts}",
        "workflow": ctx.run.workflow_name,
        "key": ctx.run.singleton_key,
        "gate": input.get("gate"),
        "seconds": input.get("seconds", 0),
    }
    result = ctx.step("handoff:hold", args)
    return {"store_id": input["store_id"], "pid": result["pid"], "token": ctx.fencing_token}


#: ``remote-sync``, whose body runs in another service, is declared by the app
#: testproject.remote_client, installed where turns go through Celery (E005).


@workflow(name="remote-parent", version="1")
def remote_parent(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Call ``remote-sync`` as a child and return its output with this process's id (D7)."""
    child = ctx.call_child("remote-sync", input)
    return {"child": child, "parent_pid": os.getpid()}


# -- network partition test (tests/workers/test_network_partition.py) --------------------------

#: The environment variable that gives a worker the fencing store's address as
#: that worker reaches it (the test sets it per worker: the host end of the
#: veth pair inside a network namespace, 127.0.0.1 outside).
PARTITION_FENCE_URL_ENV = "DS_PARTITION_FENCE_URL"
PARTITION_QUEUE = "ds-partition"
#: How long a body waits at the test's gate at most, in seconds.
PARTITION_GATE_SECONDS = 60.0


def _fence_call(path: str, payload: dict[str, Any] | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """POST ``payload`` (GET without one) to the fencing store; return its JSON
    answer (a refusal, HTTP 409, included). Raises OSError when unreachable."""
    url = os.environ[PARTITION_FENCE_URL_ENV] + path
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except urllib.error.HTTPError as refused:
        with refused:
            answer = json.loads(refused.read())
    return answer


def _partition_effect(args: dict[str, Any]) -> dict[str, Any]:
    """Wait until the test opens the gate for ``args["entry"]`` if ``args["wait"]``
    (asking every 0.1 s; a request that cannot get through is asked again), then do the side effect: a write
    to the fencing store carrying the fencing token, which it refuses if it has
    seen a higher token for the key (K1)."""
    if args["wait"]:
        deadline = time.monotonic() + PARTITION_GATE_SECONDS
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if _fence_call(f"/gate?entry={quote(args['entry'], safe='')}", timeout=0.5).get("open"):
                    break
            time.sleep(0.1)
    answer = _fence_call("/write", {"key": args["key"], "token": args["token"], "entry": args["entry"]})
    return {"pid": os.getpid(), "token": args["token"], "accepted": answer["accepted"]}


@step("partition:effect")
def partition_effect(args: dict[str, Any]) -> dict[str, Any]:
    """The side effect as a step: its result is stored only if the turn still holds its lease (R4, R5a)."""
    return _partition_effect(args)


@workflow(
    name="partition-fenced",
    version="1",
    singleton=Singleton(key=store_key, limit=1),
    steps=("partition:effect",),
    queue=PARTITION_QUEUE,
)
def partition_fenced(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    """Hold ``store:<store_id>`` and write to the fencing store with the run's token (K1).

    Each body entry writes a ``BodyAudit`` row ``<run_id>#<attempts>`` stamped
    with the database's clock, tells the fencing store its token ("begin"),
    then does the side effect: inside step ``partition:effect``
    (``input["effect_in"] == "step"``, the default) or in the body itself
    (``"body"``, so the late write is the settle). With ``input["gate"]`` each
    body entry waits until the test opens the gate for it before the side
    effect; the test partitions the worker meanwhile.
    """
    entry = f"{ctx.run_id}#{ctx.run.attempts}"
    key = ctx.run.singleton_key
    BodyAudit.objects.create(
        run_id=entry, workflow_name=ctx.run.workflow_name, key=key, entered_at=Now(), pid=os.getpid()
    )
    token = ctx.fencing_token
    begun = _fence_call("/begin", {"key": key, "token": token, "entry": entry})
    args = {"entry": entry, "key": key, "token": token, "wait": bool(input.get("gate"))}
    in_body = input.get("effect_in", "step") == "body"
    result = _partition_effect(args) if in_body else ctx.step("partition:effect", args)
    BodyAudit.objects.filter(run_id=entry).update(exited_at=Now())
    return {"store_id": input["store_id"], "begun": begun["accepted"], **result}
