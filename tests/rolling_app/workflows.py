"""The rolling deploy's workflows: one body that logs each entry and exit.

Each body entry writes a ``BodyAudit`` row named after the claim
(``<run id>#<attempts>``, so a re-driven run leaves one row per entry), with
the release that ran it (``ROLLING_RELEASE``, in ``workflow_name``), the key
it was admitted on and its process id; it sleeps ``input["seconds"]`` (or
``input["seconds_after_recovery"]`` once the run was recovered) and writes
its exit time. The test reads the rows to judge S1 and exactly-once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from django.utils import timezone

import durable_singleton
from durable_singleton import Quota, Singleton, workflow
from testproject.inventory.models import BodyAudit

RELEASE = os.environ.get("ROLLING_RELEASE", "?")
#: The release's source folder: this process must run that release's code.
SOURCE = os.environ.get("ROLLING_SOURCE")
if SOURCE and not Path(durable_singleton.__file__).resolve().is_relative_to(Path(SOURCE).resolve()):
    raise RuntimeError(f"release {RELEASE} imported durable_singleton from {durable_singleton.__file__}, not {SOURCE}")


def _key(input: dict[str, Any]) -> str:
    return str(input["key"])


#: Two slots per quota key, whatever starts the runs (X3).
SHARED = Quota("rolling", key=_key, limit=2)


def _body(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    seconds = float(input.get("seconds", 0))
    if ctx.run.recoveries:
        seconds = float(input.get("seconds_after_recovery", seconds))
    row = BodyAudit.objects.create(
        run_id=f"{ctx.run_id}#{ctx.run.attempts}",
        workflow_name=RELEASE,
        key=input["key"],
        entered_at=timezone.now(),
        pid=os.getpid(),
    )
    time.sleep(seconds)
    BodyAudit.objects.filter(pk=row.pk).update(exited_at=timezone.now())
    return {"pid": os.getpid(), "release": RELEASE}


@workflow(name="rolling-one", version="1", singleton=Singleton(key=_key, limit=1))
def rolling_one(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """One run per key at a time."""
    return _body(ctx, input)


@workflow(name="rolling-two", version="1", singleton=Singleton(key=_key, limit=2))
def rolling_two(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """Two runs per key at a time."""
    return _body(ctx, input)


@workflow(name="rolling-quota", version="1", quotas=[SHARED])
def rolling_quota(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """No singleton: two runs per quota key at a time (X3)."""
    return _body(ctx, input)


# One run per key at a time, turns sent to the Celery queue of one release's
# workers only: a run's holder is known to run in that release.
@workflow(name="rolling-on-old", version="1", singleton=Singleton(key=_key, limit=1), queue="rolling-old")
def rolling_on_old(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """Runs in the older release's workers (queue ``rolling-old``)."""
    return _body(ctx, input)


@workflow(name="rolling-on-new", version="1", singleton=Singleton(key=_key, limit=1), queue="rolling-new")
def rolling_on_new(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
    """Runs in this release's workers (queue ``rolling-new``)."""
    return _body(ctx, input)
