"""Fewer Celery messages (issue #17; S8, F4, R6, S9): real Redis, real workers.

``start_many`` sends its runs in messages of ``DISPATCH_BATCH`` runs (the task
``durable_singleton.execute_runs``), and ``start`` coalesces the first turns
of a process within ``DISPATCH_COALESCE_SECONDS``. Delivery stays at least
once: a lost batch message is made good by the tick, run by run, like a lost
single turn; every turn executes its body once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import current_app

from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from testproject.inventory.models import BodyAudit
from tests.celery_workers import CeleryWorkers, celery_stack_missing, celery_workers, worker_env

__all__ = ["celery_workers"]  # the fixture

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "fault-hold-isolated"  # its turns go to Celery queue QUEUE, this module's workers only
QUEUE = "ds-faults"
REDELIVERY = 5.0  # DURABLE_SINGLETON["REDELIVERY_SECONDS"], the default
SLACK = 60.0  # broker delivery and scheduling on a loaded 2-core machine


def _received(workers: CeleryWorkers, task: str) -> int:
    return len(re.findall(rf"Task {re.escape(task)}\[[0-9a-f-]+\] received", workers.logs()))


def _engine(**dispatcher: Any) -> Engine:
    store = DjangoStore()
    engine = Engine(store, CeleryDispatcher(store, **dispatcher))
    engine.dispatcher.bind(engine)
    return engine


@pytest.fixture
def workers(celery_workers: CeleryWorkers) -> Iterator[CeleryWorkers]:
    if reason := celery_stack_missing(("postgresql", "mysql")):
        pytest.skip(reason)
    yield celery_workers


def _wait(
    what: str, done: Callable[[], bool], workers: CeleryWorkers, timeout: float, tick: Engine | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{workers.logs()}"
        if tick is not None:
            tick.tick()
        time.sleep(0.2)


def _settled(run_ids: list[str]) -> bool:
    return Run.objects.filter(pk__in=run_ids, status=RunStatus.COMPLETED).count() == len(run_ids)


def _each_body_once(run_ids: list[str]) -> None:
    entries = list(BodyAudit.objects.filter(run_id__regex=r"#").values_list("run_id", flat=True))
    per_run = {run_id: sum(1 for e in entries if e.startswith(f"{run_id}#")) for run_id in run_ids}
    assert set(per_run.values()) == {1}, per_run


def test_start_many_sends_one_message_per_batch(workers: CeleryWorkers) -> None:
    """S3, R6 (#17): ``start_many`` of 60 runs over 60 keys with
    ``DISPATCH_BATCH`` = 25 sends three ``execute_runs`` messages (25, 25, 10
    runs); two pool processes of one worker execute them (a batch past its
    2 s passes the rest on in two messages, so a loaded machine sees a few
    more), every run completes, and each body ran once. Before, 60 messages."""
    workers.start(1, concurrency=2, queues=QUEUE, env=worker_env())
    engine = _engine(batch=25, coalesce_seconds=0.005)
    runs = engine.start_many(WORKFLOW, [{"store_id": f"bulk-{n}", "seconds": 0.01} for n in range(60)])
    run_ids = [r.run_id for r in runs]  # type: ignore[union-attr]
    _wait("every run completed", lambda: _settled(run_ids), workers, SLACK)
    batches = _received(workers, "durable_singleton.execute_runs")
    singles = _received(workers, "durable_singleton.execute_run")
    assert batches >= 3 and batches + singles <= 20, (batches, singles)
    _each_body_once(run_ids)


def test_starts_in_a_burst_are_coalesced_into_few_messages(workers: CeleryWorkers) -> None:
    """S3, R6 (#17): 40 starts in a row on 40 keys, with a coalescing window of
    200 ms, reach the worker in fewer messages than runs (``execute_runs``),
    every run completes and each body ran once. With the window at 0 the same
    starts send one ``execute_run`` each."""
    workers.start(1, concurrency=2, queues=QUEUE, env=worker_env())
    coalesced = _engine(batch=25, coalesce_seconds=0.2)
    first = [coalesced.start(WORKFLOW, {"store_id": f"co-{n}", "seconds": 0.01}).run_id for n in range(40)]
    _wait("every coalesced run completed", lambda: _settled(first), workers, SLACK)
    batches = _received(workers, "durable_singleton.execute_runs")
    singles = _received(workers, "durable_singleton.execute_run")
    assert batches >= 1 and batches + singles < 20, (batches, singles)
    plain = _engine(batch=25, coalesce_seconds=0)
    second = [plain.start(WORKFLOW, {"store_id": f"plain-{n}", "seconds": 0.01}).run_id for n in range(10)]
    _wait("every plain run completed", lambda: _settled(second), workers, SLACK)
    assert _received(workers, "durable_singleton.execute_runs") == batches
    assert _received(workers, "durable_singleton.execute_run") == singles + 10
    _each_body_once(first + second)


def test_a_lost_batch_message_is_caught_up_by_the_tick(workers: CeleryWorkers) -> None:
    """S8, F4, R6 (#17): ``start_many`` sends two batch messages while no
    worker consumes the queue, and the broker loses them (the queue purged).
    The tick sends each run again on its own once its redelivery window has
    passed; a worker started then executes them: every run completes, each
    body once, within the redelivery window plus slack."""
    engine = _engine(batch=25, coalesce_seconds=0.005)
    started = time.monotonic()
    runs = engine.start_many(WORKFLOW, [{"store_id": f"lost-{n}", "seconds": 0.01} for n in range(30)])
    run_ids = [r.run_id for r in runs]  # type: ignore[union-attr]
    with current_app.connection_for_write() as conn:
        purged = conn.default_channel.queue_purge(QUEUE)
    assert purged == 2, f"two batch messages were waiting, found {purged}"
    workers.start(1, concurrency=2, queues=QUEUE, env=worker_env())
    _wait("every lost run completed", lambda: _settled(run_ids), workers, REDELIVERY + SLACK, tick=engine)
    assert time.monotonic() - started >= REDELIVERY, "nothing could run them before their redelivery window"
    assert _received(workers, "durable_singleton.execute_runs") == 0, "the tick sends each run on its own"
    _each_body_once(run_ids)
