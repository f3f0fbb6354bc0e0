"""The baseline: plain Celery tasks on the same broker and workers."""

from __future__ import annotations

import time

from celery import shared_task

from . import audit


@shared_task(name="bench.noop", ignore_result=False)
def noop() -> float:
    """Do nothing; return when it ran (the round trip reads the result back)."""
    return time.time()


@shared_task(name="bench.link", ignore_result=True)
def link(left: int, tag: str) -> None:
    """One link of a serial chain: send the next link, or record the chain's end."""
    if left > 0:
        link.delay(left - 1, tag)
    else:
        audit.client().rpush(f"bench:{tag}:done", f"{time.time():.6f}")


@shared_task(name="bench.count", ignore_result=True)
def count(tag: str) -> None:
    """One of many independent no-op tasks: count it and record when it ran."""
    r = audit.client()
    with r.pipeline(transaction=False) as p:
        p.incr(f"bench:{tag}:count")
        p.set(f"bench:{tag}:last", f"{time.time():.6f}")
        p.execute()
