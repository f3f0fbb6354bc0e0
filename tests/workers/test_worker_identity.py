"""Two ``durable_worker`` processes with one host name and one pid (O6, R5).

Containers sharing a host name (host networking), each with pid 1, or a pid
reused after a restart on the same host: each process still has a name of
its own (``host:pid:token``) for its registry row, its lease owners, its
hand-back, its tick lease and the recovery of its runs. The workers here
are real processes whose startup code makes ``socket.gethostname()`` and
``os.getpid()`` answer the same for both. Every wait polls its condition
with a bound; nothing asserts on elapsed time.
"""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest

from durable_singleton.conf import Settings
from durable_singleton.engine import Engine
from durable_singleton.identity import owns, process_name
from durable_singleton.models import Run, WorkerProcess
from durable_singleton.runtime import build_engine
from durable_singleton.stores.turns import release_dead_workers
from tests.celery_workers import WorkerProcess as Proc
from tests.helpers import fault_bodies, running_run
from tests.worker_processes import DurableWorkers, wait_for, workers

__all__ = ["workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "fault-hold"
HOST = "shared-box"
PID = 4242
#: The startup code of a worker that takes HOST and PID for its own.
SAME_LABEL = f"""
import os, runpy, socket, sys
os.getpid = lambda: {PID}
socket.gethostname = lambda: {HOST!r}
sys.argv = ["manage.py", *sys.argv[1:]]
runpy.run_path("manage.py", run_name="__main__")
"""


@pytest.fixture
def web() -> Engine:
    return build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}))


def start_twin(workers: DurableWorkers, **env: str) -> Proc:
    """A one-thread durable_worker named after HOST and PID, whatever its real ones."""
    full = workers.env(DURABLE_DISPATCH="worker", DURABLE_REDELIVERY_SECONDS="600", **env)
    argv = ("-c", SAME_LABEL, "durable_worker", "--threads=1", "--tick-seconds=0.2", "--grace=0.5")
    return workers.start(env=full, argv=argv)


def hold(web: Engine, run_id: str, seconds: float = 600) -> str:
    web.start(WORKFLOW, {"store_id": run_id, "seconds": seconds, "seconds_after_recovery": seconds}, run_id=run_id)
    return run_id


def owner_of(run_id: str) -> str:
    return str(Run.objects.get(pk=run_id).lease_owner or "")


def test_a_killed_worker_is_seen_dead_while_its_namesake_lives(workers: DurableWorkers, web: Engine) -> None:
    """O6, R5, D4: two workers labelled with one host and one pid each hold
    a run (lease 300 s). The second is killed with SIGKILL: its registry row
    goes silent although the first keeps its own fresh, so the first takes
    the dead one's run back (one log line naming it) long before its lease
    would end, and leaves its own run's lease alone. Before the fix both
    shared the row ``host:pid``, which the survivor kept fresh: the dead
    one's run waited out its 300 s lease."""
    env = {
        "DURABLE_LEASE_SECONDS": "300",
        "DURABLE_LEASE_RENEW_SECONDS": "5",
        "DURABLE_WORKER_HEARTBEAT_SECONDS": "0.5",
        "DURABLE_WORKER_DEAD_SECONDS": "3",
    }
    first = start_twin(workers, **env)
    hold(web, "twin-a")
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 60, "the first worker's body entered", workers.logs)
    start_twin(workers, **env)
    hold(web, "twin-b")  # the first worker's one thread is busy: the second takes it
    wait_for(lambda: fault_bodies(WORKFLOW) == 2, 60, "the second worker's body entered", workers.logs)
    names = set(WorkerProcess.objects.values_list("name", flat=True))
    assert len(names) == 2 and all(n.startswith(f"{HOST}:{PID}:") for n in names), names
    kept, dead = owner_of("twin-a"), owner_of("twin-b")
    (survivor,) = [n for n in names if owns(n, kept)]
    (gone,) = names - {survivor}
    assert owns(gone, dead)
    workers.processes[1].kill(signal.SIGKILL)
    workers.processes[1].proc.wait(10)

    def taken_back() -> bool:
        b = Run.objects.get(pk="twin-b")
        return b.lease_owner != dead or b.lease_expires_at is None or b.lease_expires_at <= web.store.now()

    wait_for(taken_back, 90, "the dead worker's run taken back", workers.logs)
    lines = [line for line in first.log().splitlines() if "twin-b" in line and "dead worker" in line]
    assert len(lines) == 1 and gone in lines[0] and f"host {HOST}, pid {PID}" in lines[0], first.log()
    a = Run.objects.get(pk="twin-a")
    assert a.status == "running" and a.lease_owner == kept and a.recoveries == 0
    assert a.lease_expires_at is not None and a.lease_expires_at > web.store.now()
    assert list(WorkerProcess.objects.values_list("name", flat=True)) == [survivor]


def test_a_clean_stop_hands_back_and_unregisters_only_its_own(workers: DurableWorkers, web: Engine) -> None:
    """O6, R5, D4: two workers labelled with one host and one pid. The second
    holds a run and is paused (SIGSTOP) until its 2 s lease ends; the first
    takes the run over (tick recovery) and holds it. The second is then
    stopped cleanly (SIGTERM, grace 0.5 s) with its old turn still in hand:
    its hand-back touches nothing of the first's (the run keeps the first's
    lease), and its registry row goes while the first's stays. Before the
    fix the hand-back matched the shared prefix ``host:pid:`` and ended the
    first's lease (fencing its body), and the delete of ``host:pid`` removed
    the first's row too."""
    env = {"DURABLE_WORKER_HEARTBEAT_SECONDS": "30", "DURABLE_WORKER_DEAD_SECONDS": "120"}
    second = start_twin(workers, **env)
    hold(web, "twin-x")
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 60, "the body entered in the second worker", workers.logs)
    first = start_twin(workers, **env)
    held_by_second = owner_of("twin-x")
    second.pause()
    try:
        wait_for(lambda: fault_bodies(WORKFLOW) == 2, 90, "the first worker took the run over", workers.logs)
        wait_for(lambda: owner_of("twin-x") != held_by_second, 30, "the first worker's lease", workers.logs)
        held_by_first = owner_of("twin-x")
        names = set(WorkerProcess.objects.values_list("name", flat=True))
        assert len(names) == 2, names
        (first_name,) = [n for n in names if owns(n, held_by_first)]
        second.kill(signal.SIGTERM)
    finally:
        second.kill(signal.SIGCONT)
    assert second.proc.wait(120) == 0, workers.logs()
    assert "1 turns still running after 0.5 s; 0 handed back to the tick" in second.log(), second.log()
    x = Run.objects.get(pk="twin-x")
    assert x.status == "running" and x.lease_owner == held_by_first
    assert x.lease_expires_at is not None and x.lease_expires_at > web.store.now()
    assert list(WorkerProcess.objects.values_list("name", flat=True)) == [first_name]
    assert first.alive()


def test_a_previous_release_row_takes_back_only_its_own_turns(web: Engine) -> None:
    """O6, R5 (a rolling deploy): a dead worker of the previous release,
    named ``host:pid`` with lease owners ``host:pid:turn``, is taken back;
    a current process that reuses its host and pid (``host:pid:token``,
    owners ``host:pid:token:turn``) keeps its run."""
    now = web.store.now()
    old, new = f"{HOST}:{PID}", f"{HOST}:{PID}:0123abcd"
    for name, seen in ((old, now - timedelta(seconds=60)), (new, now)):
        WorkerProcess.objects.create(
            name=name, host=HOST, pid=PID, mode="worker", threads=1, started_at=now, last_seen_at=seen
        )
    for run_id, owner in (("old-turn", f"{old}:0123456789ab"), ("new-turn", f"{new}:0123456789ab")):
        running_run(run_id, WORKFLOW, owner, now, 300)
    (dead,) = release_dead_workers("default", 10.0, alive=process_name())
    assert dead.name == old and dead.runs == ("old-turn",)
    kept = Run.objects.get(pk="new-turn").lease_expires_at
    assert kept is not None and kept > web.store.now()
    assert list(WorkerProcess.objects.values_list("name", flat=True)) == [new]


def test_the_process_name_carries_host_pid_and_a_token() -> None:
    """O6: ``host:pid:token`` (8 hex digits), the same for the whole process."""
    import os
    import socket

    host, pid, token = process_name().split(":")
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())
    assert len(token) == 8 and int(token, 16) >= 0
    assert process_name() == process_name()
