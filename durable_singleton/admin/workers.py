"""The worker registry in the admin (O6): read-only, written by the workers."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from ..models import WorkerProcess
from .bounded import StorableInputMixin


@admin.register(WorkerProcess)
class WorkerProcessAdmin(StorableInputMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """Each live ``durable_worker`` process: host, pid, mode, threads, queues,
    started and last seen (the database's clock). A row not seen for
    ``WORKER_DEAD_SECONDS`` is a dead process whose runs the tick takes back."""

    list_display = ("name", "host", "pid", "mode", "threads", "queues", "started_at", "last_seen_at")
    list_filter = ("host", "mode")
    search_fields = ("name", "host")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: WorkerProcess | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: WorkerProcess | None = None) -> bool:
        return False
