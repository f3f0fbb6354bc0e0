"""Signal receivers: deleting a run's row frees its slot (F12); the first
request of a process starts the embedded worker (O1)."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete

__all__ = ["connect"]


def _release_deleted_run(sender: Any, instance: Any, using: str, **kwargs: Any) -> None:
    """Push the release of a deleted active singleton run after commit (S7, F12)."""
    if instance.singleton_key is None or instance.status not in ("pending", "running", "suspended", "blocked"):
        return
    from .runtime import get_engine
    from .stores.django import record_of

    get_engine().release(record_of(instance))


def connect() -> None:
    """Connect the receivers (idempotent): the release of a deleted run, the
    start of the embedded worker at a process's first request (O1), and the
    metrics' counters when prometheus_client is installed (O4)."""
    from . import worker
    from .models import Run

    worker.connect()
    try:
        from . import metrics
    except ImportError:  # the optional extra durable-singleton[prometheus] is not installed
        pass
    else:
        metrics.connect()
    post_delete.connect(_release_deleted_run, sender=Run, dispatch_uid="durable_singleton.release_deleted_run")
