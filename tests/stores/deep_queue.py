"""A key with a parked holder and a deep queue of parked waiters: the set-up the rooms'
depth tests share (S5, S7, S8a, issue 32 item 3). Each database's test measures the same
four steps its own way: PostgreSQL explains its plans (test_depth_independence.py),
MariaDB counts the rows its statements read (test_mysql_depth_independence.py), SQLite
explains its plans and counts instructions (test_sqlite_depth_independence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db import connection

from bench.depth import analyze, copy_runs
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus, SlotState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine

__all__ = ["deep_engine", "many_keys", "measured_steps"]


def deep_engine() -> Engine:
    """An engine on the Django store with one workflow, ``deep``: keyed by its input's
    ``k``, its body parks on the signal ``go``."""
    registry = Registry()
    registry.add("deep", "1", lambda ctx, i: ctx.wait_for_signal("go"), singleton={"key": lambda i: i["k"]})
    made = make_engine(DjangoStore(), registry=registry)
    made.now()
    return made


def many_keys(engine: Engine, count: int) -> None:
    """``count`` keys of one finished run each (ids and keys ``many-<n>``): the statistics
    a busy table has after a many-keys workload."""
    engine.start("deep", {"k": "many"}, run_id="many")
    engine.execute("many")
    engine.signal("many", "go", 1)
    engine.execute("many")
    assert engine.get("many").status == RunStatus.COMPLETED
    copy_runs(connection, "many", count, run_id="many-", key="many-")


def measured_steps[T](engine: Engine, depth: int, measure: Callable[[Callable[[], Any]], T]) -> dict[str, T]:
    """A key (``deep-<depth>``) with a parked holder and ``depth`` parked waiters, then
    ANALYZE; return ``measure(step)`` of each of four steps: ``start`` and ``claim`` of a
    new waiter (parked at the back), the holder's settle and ``handoff``, and the
    ``confirmation`` of the waiter it admitted (the oldest, S5)."""
    key = f"deep-{depth}"
    holder, first, tail = f"{key}-holder", f"{key}-first", f"{key}-tail"
    engine.start("deep", {"k": key}, run_id=holder)
    engine.execute(holder)
    engine.start("deep", {"k": key}, run_id=first)
    engine.execute(first)
    copy_runs(connection, first, depth - 2, run_id=f"{key}-waiter-")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    analyze(connection)
    steps = {
        "start": measure(lambda: engine.start("deep", {"k": key}, run_id=tail)),
        "claim": measure(lambda: engine.execute(tail)),
    }
    assert Run.objects.get(pk=tail).status == RunStatus.SUSPENDED
    assert Run.objects.filter(singleton_key=key, singleton_slot=SlotState.WAITER).count() == depth
    engine.signal(holder, "go", 1)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    steps["handoff"] = measure(lambda: engine.execute(holder))
    assert Run.objects.get(pk=first).singleton_slot == SlotState.HOLDER
    steps["confirmation"] = measure(lambda: engine.execute(first))
    assert Run.objects.get(pk=holder).status == RunStatus.COMPLETED
    assert Run.objects.get(pk=first).status == RunStatus.SUSPENDED  # waiting for its signal, with its slot
    return steps
