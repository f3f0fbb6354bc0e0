"""Scenario 7: the peers on the same PostgreSQL, the same Redis audit and the same workloads.

* dj-queue: ``manage.py dj_queue`` (fork mode) with ``processes`` worker
  processes of ``threads`` threads; the task has ``concurrency(key=..., limit=1,
  on_conflict="block")``.
* procrastinate: ``manage.py procrastinate worker`` processes with
  ``--concurrency``; jobs are deferred with ``lock=key``.

Worker slots match the Celery side's (processes x concurrency). Each peer
runs with its workers alone on the machine (ours are stopped first).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from . import audit
from .procs import Procs, django_admin_argv, wait_until
from .scenarios import concurrency_report, last_exit, new_tag, sequence_handoffs

Enqueue = Callable[[str, str, str, bool], None]


def _djq_enqueue(tag: str, key: str, run: str, hold: bool) -> None:
    from .peer_tasks import djq_body

    djq_body.enqueue(tag=tag, key=key, run=run, hold=hold)


def _pc_enqueue(tag: str, key: str, run: str, hold: bool) -> None:
    from .peer_tasks import pc_body

    pc_body.configure(lock=key).defer(tag=tag, key=key, run=run, hold=hold)


def _hot_key(enqueue: Enqueue, name: str, runs: int) -> dict[str, Any]:
    tag = new_tag(name)
    key = tag
    enqueue(tag, key, "holder", True)
    wait_until(lambda: len(audit.events(tag)) >= 1, 120, f"{name}'s holder body", every=0.01)
    queued_at = time.time()
    for n in range(runs):
        enqueue(tag, key, f"r{n}", False)
    started_seconds = time.time() - queued_at
    time.sleep(1.0)  # let the workers see the queue before the holder leaves
    released_at = audit.release(tag)
    wait_until(lambda: audit.done_count(tag) >= runs + 1, 900, f"{name}: {runs} runs to drain", every=0.02)
    end = last_exit(tag)
    return {
        "runs": runs,
        "start_seconds": started_seconds,
        "drain_seconds": end - released_at,
        "runs_per_s": runs / (end - released_at),
        "handoff": sequence_handoffs(audit.events(tag)),
        "concurrency": concurrency_report(tag, 1),
    }


def _many_keys(enqueue: Enqueue, name: str, runs: int, keys: int) -> dict[str, Any]:
    tag = new_tag(name)
    started_at = time.time()
    for n in range(runs):
        enqueue(tag, f"{tag}:{n % keys}", f"r{n}", False)
    sent_at = time.time()
    wait_until(lambda: audit.done_count(tag) >= runs, 900, f"{name}: {runs} runs over {keys} keys", every=0.02)
    seconds = last_exit(tag) - started_at
    return {
        "runs": runs,
        "keys": keys,
        "start_seconds": sent_at - started_at,
        "seconds": seconds,
        "runs_per_s": runs / seconds,
        "concurrency": concurrency_report(tag, 1),
    }


def _warm(enqueue: Enqueue, name: str) -> None:
    tag = new_tag(f"{name}-warm")
    for n in range(8):
        enqueue(tag, f"{tag}:{n}", uuid.uuid4().hex, False)
    wait_until(lambda: audit.done_count(tag) >= 8, 120, f"{name}'s workers to start", every=0.05)


def dj_queue(procs: Procs, processes: int, threads: int, poll: float, hot: int, many: int, keys: int) -> dict[str, Any]:
    """Run the hot-key drain and many-keys workloads on dj-queue."""
    env = {"BENCH_DJQ_PROCESSES": str(processes), "BENCH_DJQ_THREADS": str(threads), "BENCH_DJQ_POLL": str(poll)}
    runtime = procs.start("dj_queue", django_admin_argv("dj_queue", "--skip-recurring"), env)
    try:
        _warm(_djq_enqueue, "djq")
        return {
            "version": version("dj-queue"),
            "config": {"processes": processes, "threads": threads, "polling_interval": poll, "listen_notify": True},
            "hot_key": _hot_key(_djq_enqueue, "djq-hot", hot),
            "many_keys": _many_keys(_djq_enqueue, "djq-many", many, keys),
        }
    finally:
        procs.stop([runtime])


def procrastinate(
    procs: Procs, processes: int, concurrency: int, poll: float, hot: int, many: int, keys: int
) -> dict[str, Any]:
    """Run the hot-key drain and many-keys workloads on procrastinate (jobs sharing a lock)."""
    workers = [
        procs.start(
            f"procrastinate-{n}",
            django_admin_argv(
                "procrastinate",
                "worker",
                "--concurrency",
                str(concurrency),
                "--fetch-job-polling-interval",
                str(poll),
            ),
        )
        for n in range(processes)
    ]
    try:
        _warm(_pc_enqueue, "pc")
        return {
            "version": version("procrastinate"),
            "config": {"processes": processes, "concurrency": concurrency, "fetch_job_polling_interval": poll},
            "hot_key": _hot_key(_pc_enqueue, "pc-hot", hot),
            "many_keys": _many_keys(_pc_enqueue, "pc-many", many, keys),
        }
    finally:
        procs.stop(workers)
