"""Async views over the engine's async API, as an ASGI project would write them.

Every engine call is awaited (``adispatch``, ``aget``, ``asignal``,
``acancel``), so the event loop keeps serving other requests while a start
waits on the database.
"""

from __future__ import annotations

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from durable_singleton.exceptions import RunNotFoundError, SingletonQueueFullError, ValidationError
from durable_singleton.runtime import get_engine
from durable_singleton.stores.base import RunRecord

from .workflows import SyncInventory


def _run(run: RunRecord, status: int = 200) -> JsonResponse:
    return JsonResponse({"run_id": run.run_id, "status": run.status, "output": run.output}, status=status)


@csrf_exempt  # an API endpoint called by machines, not a form
@require_POST
async def sync_inventory(request: HttpRequest, store_id: str) -> JsonResponse:
    """Start a sync of ``store_id``: 202 with the run id, or 429 when the key's queue is full (S15)."""
    try:
        body = json.loads(request.body or b"{}")
        run = await SyncInventory.adispatch(
            {"store_id": store_id, "duration": float(body.get("duration", 0))},
            run_id=request.headers.get("Idempotency-Key") or None,
        )
    except SingletonQueueFullError as exc:
        response = JsonResponse({"error": "queue_full", "detail": str(exc)}, status=429)
        response["Retry-After"] = "5"
        return response
    except (ValidationError, ValueError, TypeError) as exc:
        return JsonResponse({"error": "invalid", "detail": str(exc)}, status=400)
    return _run(run, 202)


@require_GET
async def run_status(request: HttpRequest, run_id: str) -> JsonResponse:
    """Return a run's status and output, or 404."""
    try:
        return _run(await get_engine().aget(run_id))
    except RunNotFoundError:
        return JsonResponse({"error": "not_found"}, status=404)


@csrf_exempt
@require_POST
async def signal_run(request: HttpRequest, run_id: str, name: str) -> JsonResponse:
    """Send signal ``name`` with the JSON body as payload to an active run (D2), or 404."""
    try:
        return _run(await get_engine().asignal(run_id, name, json.loads(request.body or b"null")))
    except RunNotFoundError:
        return JsonResponse({"error": "not_found"}, status=404)


@csrf_exempt
@require_POST
async def cancel_run(request: HttpRequest, run_id: str) -> JsonResponse:
    """Cancel a run (D6), or 404."""
    try:
        return _run(await get_engine().acancel(run_id))
    except RunNotFoundError:
        return JsonResponse({"error": "not_found"}, status=404)


async def ping(request: HttpRequest) -> JsonResponse:
    """Answer at once: the probe that shows the event loop is free."""
    return JsonResponse({"ok": True})
