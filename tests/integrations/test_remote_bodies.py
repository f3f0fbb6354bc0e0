"""Remote bodies (SPEC section 2, ``register_remote``): two services, each with
its own settings module, Celery app and real worker process, sharing one
database and one broker. The test project declares ``remote-sync`` remote on
queue ``remote``; only ``testproject.remote_service``'s worker has its body.
No tick runs, so every admission after a release and the parent's wake-up
come from the release push (S7, D7)."""

from __future__ import annotations

import itertools
import time

import pytest
from django.db import transaction

from durable_singleton.admission import ACTIVE_STATUSES
from durable_singleton.definitions import registry
from durable_singleton.dispatch import CeleryDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.stores.django import DjangoStore
from tests.celery_workers import CeleryWorkers, celery_stack_missing, celery_workers, worker_env

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BODY_SECONDS = 0.6


def _wait_until(predicate: object, workers: CeleryWorkers, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:.0f} s\n{workers.logs()}"
        assert all(w.alive() for w in workers.workers), "a worker died\n" + workers.logs()
        time.sleep(0.05)


def test_remote_body_runs_only_in_the_other_service_gated_cancellable_and_pushed_back(
    celery_workers: CeleryWorkers,
) -> None:
    """Section 2, S5, S7, S9, D6, D7: runs of a remote workflow started here run
    their body only in the other service's worker (its pool processes, its
    settings), one at a time per key in creation order (the same claim); a
    waiter cancelled while it waits for admission never runs; each release in
    the other service admits the next waiter, and a parent waiting here on a
    remote child is woken here by the child's release, all with no tick."""
    if reason := celery_stack_missing(("postgresql", "mysql")):
        pytest.skip(reason)
    (home,) = celery_workers.start(1, concurrency=2)
    (remote,) = celery_workers.start(
        1,
        concurrency=2,
        app="testproject.remote_service.celery:app",
        queues="remote",
        env=worker_env(DJANGO_SETTINGS_MODULE="testproject.remote_service.settings"),
    )
    store = DjangoStore()
    engine = Engine(store, CeleryDispatcher(store), registry=registry)
    engine.dispatcher.bind(engine)
    queued = [f"remote-R-{n}" for n in range(1, 5)]
    with transaction.atomic():
        for run_id in queued:
            engine.start("remote-sync", {"store_id": "R", "duration": BODY_SECONDS}, run_id=run_id)
        engine.start("remote-parent", {"store_id": "P", "duration": 0.1}, run_id="parent-P")

    _wait_until(lambda: engine.get("remote-R-1").admitted, celery_workers, "remote-R-1 admitted")
    cancelled = engine.cancel("remote-R-3")  # still waiting for admission (D6)
    assert cancelled.status == "cancelled"

    every = [*queued, "parent-P", "parent-P:child:0"]
    _wait_until(
        lambda: not Run.objects.filter(run_id__in=every, status__in=ACTIVE_STATUSES).exists(),
        celery_workers,
        "every run settled",
    )
    runs = {r.run_id: engine.get(r.run_id) for r in Run.objects.filter(run_id__in=every)}
    assert {k: r.status for k, r in runs.items()} == {
        "remote-R-1": "completed",
        "remote-R-2": "completed",
        "remote-R-3": "cancelled",
        "remote-R-4": "completed",
        "parent-P": "completed",
        "parent-P:child:0": "completed",
    }, celery_workers.logs()
    assert runs["remote-R-3"].output is None, "a run cancelled while waiting never ran its body"

    remote_pool, home_pool = set(remote.children()), set(home.children())
    bodies = [runs[run_id].output for run_id in ("remote-R-1", "remote-R-2", "remote-R-4")]
    assert {b["service"] for b in bodies} == {"remote"}
    assert {b["pid"] for b in bodies} <= remote_pool, (bodies, remote_pool)
    for earlier, later in itertools.pairwise(bodies):
        assert earlier["exited"] <= later["entered"], "two bodies of one key overlapped (S9)"
    gaps = [later["entered"] - earlier["exited"] for earlier, later in itertools.pairwise(bodies)]
    # A parked waiter's own timer needs a tick; none ran, so the push admitted them (S7).
    assert max(gaps) < 5.0, gaps

    parent = runs["parent-P"].output
    assert parent["child"]["service"] == "remote" and parent["child"]["pid"] in remote_pool
    assert parent["parent_pid"] in home_pool, "the parent ran in the first service's worker"
    print(f"\nremote handoffs (exit -> next entry): {[round(g * 1000) for g in gaps]} ms")
