"""django.tasks tasks run as durable runs by the durable task backend (Django 6.0+).

``settings.TASKS`` lists ``sync_store`` in the backend's ``SINGLETONS``: one
sync per store at a time, at most two more queued (docs/django_tasks.rst).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from django.tasks import TaskContext, task
from django.utils import timezone

from .models import BodyAudit


def store_key(store_id: str, **options: Any) -> str:
    """Key a sync by its store; called with the task's arguments."""
    return f"store:{store_id}"


@task(takes_context=True)
def sync_store(context: TaskContext, store_id: str, duration: float = 0.0) -> dict[str, Any]:
    """Record the body's entry, pretend to sync for ``duration`` seconds, record its exit."""
    run_id = context.task_result.id
    BodyAudit.objects.create(
        run_id=run_id,
        workflow_name="task:sync_store",
        key=store_key(store_id),
        entered_at=timezone.now(),
        pid=os.getpid(),
    )
    time.sleep(duration)
    BodyAudit.objects.filter(run_id=run_id).update(exited_at=timezone.now())
    return {"store_id": store_id, "attempt": context.attempt}


@task
def fail(message: str) -> None:
    """Raise ValueError(``message``): the run fails and its result carries the error."""
    raise ValueError(message)


@task
def exits(code: int | str) -> None:
    """Call ``sys.exit(code)``: the run fails with SystemExit and the worker goes on (R7)."""
    sys.exit(code)


@task
def interrupts(message: str) -> None:
    """Raise KeyboardInterrupt(``message``): the run fails with it and the worker goes on (R7)."""
    raise KeyboardInterrupt(message)


@task
async def double(n: int) -> int:
    """An async task function: Django's Task.call runs it on the worker's thread."""
    await asyncio.sleep(0)
    return n * 2


@task
def returns_set(n: int) -> set[int]:
    """Return a set, which is not JSON: the run fails with TypeError (Django's contract)."""
    return set(range(n))
