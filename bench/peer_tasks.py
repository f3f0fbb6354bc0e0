"""The peers' side: the same audited body as a dj-queue task and a procrastinate task.

dj-queue: a Django Tasks task with a per-key concurrency limit of 1 that
blocks conflicting jobs. procrastinate: a task whose jobs share a lock named
by the key (jobs with one lock run one at a time, in order).
"""

from __future__ import annotations

from dj_queue.api import concurrency
from django.tasks import task
from procrastinate.contrib.django import app

from . import audit


@task
@concurrency(key="{key}", limit=1, duration=900, on_conflict="block")
def djq_body(tag: str, key: str, run: str, hold: bool = False) -> None:
    """The audited body under dj-queue."""
    audit.body(tag, key, run, holds=hold)


@app.task(name="bench.procrastinate_body")
def pc_body(tag: str, key: str, run: str, hold: bool = False) -> None:
    """The audited body under procrastinate (deferred with ``lock=key``)."""
    audit.body(tag, key, run, holds=hold)
