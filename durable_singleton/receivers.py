"""Signal receivers: deleting a run's row locks its key's row first (the lock
order of every path) and frees its slot (F12); the first request of a process
starts the embedded worker (O1)."""

from __future__ import annotations

from typing import Any

from django.db.models.signals import post_delete, post_migrate, pre_delete

from .statuses import ACTIVE_STATUSES

__all__ = ["connect"]


def _lock_key_of_deleted_run(sender: Any, instance: Any, using: str, **kwargs: Any) -> None:
    """Lock a deleted active singleton run's key row before its row is deleted.

    The lock order of every path is the key's row, then run rows (docs/design.rst);
    the release below locks the key after the DELETE locked the run's row, so a
    claim of the key, which locks the key then updates its runs, could deadlock
    with the admin's delete (#16). Runs inside the deleting transaction.
    """
    from .admission import quota_keys_of

    quota_keys = quota_keys_of(instance.quota_keys)
    if (instance.singleton_key is None and not quota_keys) or instance.status not in ACTIVE_STATUSES:
        return
    from .stores.django import DjangoStore

    store = DjangoStore(using=using)
    store._lock_quota_keys(quota_keys)  # the quota keys first, sorted (X3e)
    if instance.singleton_key is not None:
        store.lock_key(instance.workflow_name, instance.singleton_key)


def _release_deleted_run(sender: Any, instance: Any, using: str, **kwargs: Any) -> None:
    """Grant the slot of a deleted active singleton run to its key's oldest waiters (S7, F12),
    and send the waiters at the front of its quota keys their turns (X3g)."""
    from .stores.django import record_of

    run = record_of(instance)
    if (run.singleton_key is None and not run.quota_keys) or instance.status not in ACTIVE_STATUSES:
        return
    from .runtime import get_engine

    get_engine().release(run)


def connect() -> None:
    """Connect the receivers (idempotent): the release of a deleted run, the
    start of the embedded worker at a process's first request (O1), the
    metrics' counters when prometheus_client is installed (O4), the
    wait spans when opentelemetry-api is installed (O8), and, after a
    ``migrate`` or a ``flush``, the key rows the store knew to exist forgotten."""
    from . import tracing, worker
    from .models import Run

    worker.connect()
    tracing.connect()
    try:
        from . import metrics
    except ImportError:  # the optional extra durable-singleton[prometheus] is not installed
        pass
    else:
        metrics.connect()
    pre_delete.connect(_lock_key_of_deleted_run, sender=Run, dispatch_uid="durable_singleton.lock_key_of_deleted_run")
    post_delete.connect(_release_deleted_run, sender=Run, dispatch_uid="durable_singleton.release_deleted_run")
    post_migrate.connect(_forget_key_rows, dispatch_uid="durable_singleton.forget_key_rows")


def _forget_key_rows(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """After ``migrate`` or ``flush`` on ``using``: its key rows may be gone, so the store's
    next lock of each takes the upsert again (:meth:`DjangoStore.lock_key`, S13a)."""
    from .stores.django import forget_key_rows

    forget_key_rows(using)
