"""R7 on real worker processes (#18 item 5): ``manage.py durable_worker`` and a
Celery prefork worker.

A body of the test project's ``fault-exit`` workflow raises ``SystemExit`` or
``KeyboardInterrupt`` after its step; ``fault-hold`` holds its key inside a
step for a given time. Before: each raising body killed a worker thread (with
4 threads, 4 such runs left a ``durable_worker`` that ran nothing and still
exited 0 on SIGTERM), and its run stayed ``running`` until its lease, whose
retry killed the next thread. Now the run fails with the exception's class and
the thread or pool process lives on; a real shutdown of the worker hands the
run in hand back with its slot.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
from django.utils import timezone

from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine
from testproject.inventory.models import BodyAudit
from tests.celery_workers import CeleryWorkers, celery_stack_missing, celery_workers, worker_env
from tests.worker_processes import DurableWorkers, wait_for, workers

__all__ = ["celery_workers", "workers"]  # the fixtures, imported for this module's tests

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: Generous bounds for a loaded 2-core machine; nothing asserts on elapsed time.
WAIT = 120.0


def _run(run_id: str) -> Run:
    return Run.objects.get(pk=run_id)


def _statuses(ids: list[str]) -> dict[str, str]:
    return dict(Run.objects.filter(pk__in=ids).values_list("run_id", "status"))


def _entered(run_id: str) -> bool:
    return BodyAudit.objects.filter(run_id__startswith=f"{run_id}#").exists()


def _start(engine: Engine, workflow: str, run_id: str, store_id: str, **input: Any) -> str:
    return engine.start(workflow, {"store_id": store_id, "seconds": 0, **input}, run_id=run_id).run_id


def test_durable_worker_threads_live_on_after_bodies_exit_and_sigterm_hands_the_holder_back(
    workers: DurableWorkers,
) -> None:
    """R7, O1, S6: four bodies raise (``sys.exit()`` and KeyboardInterrupt) on a
    four-thread ``durable_worker``: each run fails with its class and every
    thread lives on (eight ordinary runs complete after them). Then SIGTERM
    while a holder is inside its step: the worker exits 0 and hands the holder
    back with its slot (its waiter is not admitted), and a new worker resumes
    it, then admits the waiter."""
    starter = make_engine("django", REDELIVERY_SECONDS=0.0)
    raisers = [
        _start(starter, "fault-exit", f"r7-raise-{n}", f"r7-raise-{n}", **{"raise": "exit" if n % 2 else "interrupt"})
        for n in range(4)
    ]
    first = workers.start(threads=4, args=("--grace=0.5",))
    wait_for(lambda: set(_statuses(raisers).values()) == {"failed"}, WAIT, "the raising runs failed", workers.logs)
    for run_id in raisers:
        error = _run(run_id).error
        assert error["type"] == ("SystemExit" if int(run_id[-1]) % 2 else "KeyboardInterrupt"), error
        assert error["message"] == f"fault-exit {run_id}"
    after = [_start(starter, "fault-hold", f"r7-after-{n}", f"r7-after-{n}") for n in range(8)]
    wait_for(lambda: set(_statuses(after).values()) == {"completed"}, WAIT, "8 runs after them", workers.logs)

    holder = _start(starter, "fault-hold", "r7-holder", "r7-held", seconds=600, seconds_after_recovery=0)
    waiter = _start(starter, "fault-hold", "r7-waiter", "r7-held")
    wait_for(lambda: _entered(holder), WAIT, "the holder entered its step", workers.logs)
    first.kill(signal.SIGTERM)
    assert first.proc.wait(WAIT) == 0, first.log()
    assert "1 turns handed back" in first.log(), first.log()
    held = _run(holder)
    assert held.status == "running" and held.singleton_slot == "holder"
    assert held.lease_expires_at is not None and held.lease_expires_at <= timezone.now()
    assert _run(waiter).singleton_slot == "waiter"

    workers.start(threads=4)
    wait_for(lambda: _statuses([holder, waiter]) == {holder: "completed", waiter: "completed"}, WAIT, "resumed")
    assert _run(holder).finished_at <= _run(waiter).admitted_at


@pytest.mark.celery
def test_a_celery_pool_process_lives_on_after_a_body_exits_and_a_cold_shutdown_hands_the_holder_back(
    celery_workers: CeleryWorkers,
) -> None:
    """R7, S6: on a Celery prefork worker with one pool process, a body's
    ``sys.exit()`` fails its run and the same pool process runs the next turn.
    A cold shutdown (SIGQUIT to the worker) terminates the pool process with
    SIGTERM, whose handler (billiard's) raises ``SystemExit`` in the running
    body; the worker's own flag says it is a shutdown, so the run is handed
    back ``pending`` with its slot instead of failing, and the next worker
    resumes it from its stored steps before admitting the waiter."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    store = DjangoStore()
    engine = Engine(store, CeleryDispatcher(store))
    engine.dispatcher.bind(engine)
    env = worker_env(DURABLE_LEASE_SECONDS="3", DURABLE_LEASE_RENEW_SECONDS="1")
    (worker,) = celery_workers.start(1, concurrency=1, env=env, extra_args=("--disable-prefetch",))
    (child,) = worker.children()

    raiser = _start(engine, "fault-exit", "r7c-raise", "r7c-raise", **{"raise": "exit"})
    wait_for(lambda: _run(raiser).status == "failed", WAIT, "the exiting run failed", celery_workers.logs)
    assert _run(raiser).error["type"] == "SystemExit"
    ordinary = _start(engine, "fault-hold", "r7c-after", "r7c-after")
    wait_for(lambda: _run(ordinary).status == "completed", WAIT, "the next run completed", celery_workers.logs)
    assert worker.children() == [child], "the pool process was replaced"
    assert {row.pid for row in BodyAudit.objects.filter(run_id__startswith="r7c-")} == {child}

    holder = _start(engine, "fault-hold", "r7c-holder", "r7c-held", seconds=600)
    waiter = _start(engine, "fault-hold", "r7c-waiter", "r7c-held")
    wait_for(lambda: _entered(holder), WAIT, "the holder entered its step", celery_workers.logs)
    worker.kill(signal.SIGQUIT)
    worker.proc.wait(WAIT)
    held = _run(holder)
    assert (held.status, held.park_reason, held.singleton_slot) == ("pending", "shutdown:1", "holder"), (
        celery_workers.logs()
    )
    assert _run(waiter).singleton_slot == "waiter"
    assert "handed back with its slot" in worker.log()

    # A hand-back is no recovery (fault-hold's seconds_after_recovery does not
    # apply): the resumed body is told to hold no longer.
    Run.objects.filter(pk=holder).update(input={"store_id": "r7c-held", "seconds": 0})
    celery_workers.start(1, concurrency=1, env=env)
    engine.tick()  # the beat's tick sends the due hand-back
    wait_for(lambda: _statuses([holder, waiter]) == {holder: "completed", waiter: "completed"}, WAIT, "resumed")
    assert _run(holder).finished_at <= _run(waiter).admitted_at
