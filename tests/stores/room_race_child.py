"""A child process of tests/stores/test_room_races.py: one engine of its own on the
test database (``DATABASE_URL``), racing its siblings on one key.

``python -m tests.stores.room_race_child LOG N SKEW``: three threads, each with an engine
(and a database connection) of its own, start ``N`` runs of ``race`` each (key "hot",
limit 2) and drive every turn they are sent, ticking, until no run of the key is left
open. Each body takes an exclusive ``flock`` of LOG's ``.lock`` file,
appends ``enter <run_id> <pid> <n>`` (``n``: bodies inside, a killed process's
included), sleeps a little and appends ``exit <run_id> <pid> <n>``. ``SKEW``: seconds added to this process's own
clock (the engine's and Django's ``timezone.now``): the process clock must never
decide a lease (R5, R5a).
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from datetime import datetime, timedelta
from typing import Any


def main(log: str, count: int, skew: float) -> None:
    import django

    django.setup()
    from django.db import connections
    from django.utils import timezone

    from durable_singleton.definitions import Registry
    from durable_singleton.models import Run
    from durable_singleton.statuses import TERMINAL_STATUSES
    from durable_singleton.testing import make_engine

    if skew:
        real = timezone.now
        timezone.now = lambda: real() + timedelta(seconds=skew)

    def inside(delta: int, run_id: str) -> None:
        with open(log + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lock.seek(0)
            n = int(lock.read() or 0) + delta
            lock.seek(0)
            lock.truncate()
            lock.write(str(n))
            lock.flush()
            with open(log, "a") as out:
                out.write(f"{'enter' if delta > 0 else 'exit'} {run_id} {os.getpid()} {n}\n")
            fcntl.flock(lock, fcntl.LOCK_UN)

    def body(ctx: Any, i: dict[str, Any]) -> None:
        inside(1, ctx.run_id)
        time.sleep(0.05)
        inside(-1, ctx.run_id)

    registry = Registry()
    registry.add("race", "1", body, singleton={"key": lambda i: "hot", "limit": 2})
    clock = (lambda: datetime.now().astimezone() + timedelta(seconds=skew)) if skew else None
    failures: list[BaseException] = []

    def drive() -> None:
        try:
            engine = make_engine("django", registry=registry, clock=clock, LEASE_SECONDS=3)
            queue = engine.dispatcher.queue  # type: ignore[attr-defined]
            for _ in range(count):
                engine.start("race", {})
                while queue:
                    engine.execute_chain(queue.popleft())
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                engine.tick()
                while queue:
                    engine.execute_chain(queue.popleft())
                if not Run.objects.filter(workflow_name="race").exclude(status__in=TERMINAL_STATUSES).exists():
                    return
                time.sleep(0.05)
            raise AssertionError("runs left open")
        except BaseException as exc:
            failures.append(exc)
            raise
        finally:
            connections.close_all()

    threads = [threading.Thread(target=drive) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        sys.exit(repr(failures))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
