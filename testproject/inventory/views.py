"""A view that dispatches sync-inventory, as a user's view would."""

from __future__ import annotations

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from durable_singleton.exceptions import RunNotFoundError, SingletonQueueFullError, ValidationError
from durable_singleton.runtime import get_engine

from .workflows import SyncInventory


@csrf_exempt  # an API endpoint called by machines, not a form
@require_POST
def sync_inventory(request: HttpRequest, store_id: str) -> JsonResponse:
    """Start a sync of ``store_id``: 202 with the run id, or 429 with Retry-After when the key's queue is full."""
    run_id = request.headers.get("Idempotency-Key") or None
    try:
        body = json.loads(request.body or b"{}")
        run = SyncInventory.dispatch({"store_id": store_id, "duration": float(body.get("duration", 0))}, run_id=run_id)
    except SingletonQueueFullError as exc:
        response = JsonResponse({"error": "queue_full", "detail": str(exc)}, status=429)
        response["Retry-After"] = "5"
        return response
    except (ValidationError, ValueError, TypeError) as exc:
        return JsonResponse({"error": "invalid", "detail": str(exc)}, status=400)
    return JsonResponse({"run_id": run.run_id, "status": run.status}, status=202)


@require_GET
def run_status(request: HttpRequest, run_id: str) -> JsonResponse:
    """Return a run's status and output."""
    try:
        run = get_engine().get(run_id)
    except RunNotFoundError:
        return JsonResponse({"error": "not_found"}, status=404)
    return JsonResponse({"run_id": run.run_id, "status": run.status, "output": run.output, "tags": run.tags})
