"""``DISPATCH = "worker"`` with real ``manage.py durable_worker`` processes (O1, O6, O7).

The test process only writes runs, on an engine built as a web process's
would be (``DISPATCH = "worker"``, a redelivery window of 10 minutes, so only
the turn notice can bring a run to a worker within the tests' bounds). The
workers open the test database by ``DATABASE_URL`` and run the test
project's ``fault-hold`` workflow (limit 1 per key, its body audited in
``BodyAudit``). Every wait polls its condition with a bound; nothing asserts
on elapsed time.
"""

from __future__ import annotations

import re
import signal
import socket

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction

from durable_singleton.conf import Settings
from durable_singleton.engine import Engine
from durable_singleton.health import check_health
from durable_singleton.models import Run, TurnNotice, WorkerProcess
from durable_singleton.runtime import build_engine
from durable_singleton.stores.turns import Listener
from testproject.inventory.models import BodyAudit
from tests.factories import WorkerProcessFactory
from tests.helpers import fault_bodies, running_run
from tests.worker_processes import DurableWorkers, wait_for, workers
from tests.workers.test_worker_process import all_completed, assert_no_overlap, burst

__all__ = ["workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "fault-hold"
#: Far beyond every bound below: a run reaches a worker by its notice, never by the tick's redelivery.
REDELIVERY = 600.0


def worker_env(workers: DurableWorkers, **overrides: str) -> dict[str, str]:
    return workers.env(
        DURABLE_DISPATCH="worker",
        DURABLE_REDELIVERY_SECONDS=str(REDELIVERY),
        DURABLE_WORKER_HEARTBEAT_SECONDS="0.5",
        DURABLE_WORKER_DEAD_SECONDS="3",
        **overrides,
    )


@pytest.fixture
def web() -> Engine:
    """The engine of a process that only writes runs (a view, a shell): DISPATCH 'worker'."""
    return build_engine(
        Settings.from_mapping(
            {
                "DISPATCH": "worker",
                "REDELIVERY_SECONDS": REDELIVERY,
                "WORKER_HEARTBEAT_SECONDS": 0.5,
                "WORKER_DEAD_SECONDS": 3.0,
            }
        )
    )


def test_a_run_started_in_another_process_is_taken_by_a_worker_at_once(workers: DurableWorkers, web: Engine) -> None:
    """O1, O7: a run started in a process that runs no body (this one) on a
    free key is executed by a durable_worker through its turn notice
    (LISTEN/NOTIFY on PostgreSQL, the poll elsewhere), long before the tick's
    redelivery (10 minutes here) could send it; the start process wrote the
    run and its notice and ran no body."""
    worker = workers.start(env=worker_env(workers))
    assert "durable_worker started" in worker.log() or "ready." in worker.log()
    (run_id,) = burst(web, keys=1, per_key=1, seconds=0, tag="o7")
    wait_for(lambda: all_completed([run_id]), 60, "the run completed by the worker", workers.logs)
    (entry,) = BodyAudit.objects.all()
    assert entry.pid == worker.pid
    assert not TurnNotice.objects.exists()


def test_the_worker_says_how_it_is_woken(workers: DurableWorkers) -> None:
    """O1, section 7: at its start a worker says whether the database wakes
    it (LISTEN/NOTIFY on PostgreSQL) or whether it polls, and how often."""
    worker = workers.start(env=worker_env(workers), args=("--poll-seconds=0.3",))
    if connection.vendor == "postgresql":
        assert "woken by LISTEN/NOTIFY" in worker.log(), worker.log()
    else:
        assert "the database cannot notify: polling every 0.3 s" in worker.log(), worker.log()


def test_a_rolled_back_start_writes_no_notice_and_notifies_nobody(web: Engine) -> None:
    """O1, O7: the notice is written in the start's transaction, so a start
    rolled back leaves neither a run nor a notice, and on PostgreSQL no
    NOTIFY reaches a listener; the same start committed notifies it."""
    listener = Listener("default") if connection.vendor == "postgresql" else None
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            web.start(WORKFLOW, {"store_id": "rb", "seconds": 0}, run_id="rolled-back")
            assert TurnNotice.objects.filter(run_id="rolled-back").exists()
            raise RuntimeError("the view failed")
        assert not Run.objects.filter(pk="rolled-back").exists()
        assert not TurnNotice.objects.exists()
        if listener is not None:
            assert not listener.wait(1.0), "a rolled-back start notified"
        web.start(WORKFLOW, {"store_id": "rb", "seconds": 0}, run_id="committed")
        assert list(TurnNotice.objects.values_list("run_id", flat=True)) == ["committed"]
        if listener is not None:
            assert listener.wait(10.0), "a committed start did not notify"
    finally:
        if listener is not None:
            listener.close()


def test_several_workers_never_exceed_a_keys_limit(workers: DurableWorkers, web: Engine) -> None:
    """O1, S5, S9: three durable_worker processes of four threads take a burst
    on two keys of limit 1 from the database; every run completes and no two
    bodies of one key ever overlap (the fetch picks run ids, the claim admits)."""
    env = worker_env(workers)
    for _ in range(3):
        workers.start(env=env, wait=False)
    for worker in workers.processes:
        worker.wait_ready()
    ids = burst(web, keys=2, per_key=6, seconds=0.2, tag="lim")
    wait_for(lambda: all_completed(ids), 180, "every run completed", workers.logs)
    assert_no_overlap()
    assert BodyAudit.objects.values("pid").distinct().count() >= 1


def test_a_killed_workers_run_is_taken_back_and_the_log_names_the_dead_owner(
    workers: DurableWorkers, web: Engine
) -> None:
    """O6, R5, D4: a worker holding a run (lease 300 s) is killed with SIGKILL;
    another worker finds the dead process's registry row silent past
    WORKER_DEAD_SECONDS (3 s), ends the run's lease by compare-and-set, logs
    one line naming the run and the dead owner, and the run's body is entered
    again long before its lease would have expired."""
    env = worker_env(workers, DURABLE_LEASE_SECONDS="300", DURABLE_LEASE_RENEW_SECONDS="5")
    first = workers.start(threads=1, env=env, args=("--grace=0.5",))
    (run_id,) = [
        web.start(WORKFLOW, {"store_id": "dead", "seconds": 600, "seconds_after_recovery": 0}, run_id="dead-1").run_id
    ]
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 60, "the body entered", workers.logs)
    assert WorkerProcess.objects.filter(pid=first.pid).exists()
    first.kill(signal.SIGKILL)
    first.proc.wait(10)
    second = workers.start(threads=1, env=env, args=("--grace=0.5",))
    wait_for(lambda: all_completed([run_id]), 120, "the run re-entered and completed", workers.logs)
    dead = f"{socket.gethostname()}:{first.pid}"
    lines = [line for line in second.log().splitlines() if run_id in line and "dead worker" in line]
    assert len(lines) == 1 and dead in lines[0], second.log()
    assert not WorkerProcess.objects.filter(pid=first.pid).exists()
    assert fault_bodies(WORKFLOW) == 2


def test_health_names_a_missing_worker_and_the_registry_drops_a_clean_stop(
    workers: DurableWorkers, web: Engine
) -> None:
    """O6, O3: with no worker registered, health says 'no worker seen'; a
    running worker is listed by ``durable_workers`` and clears the finding;
    its clean stop (SIGTERM) deletes its row, and health names the missing
    worker again."""

    def no_worker() -> list[str]:
        report = check_health(web, stale_seconds=3600, backlog_seconds=3600)
        return [p.detail for p in report.problems if p.kind == "no_worker"]

    assert no_worker() == [
        "no worker seen: no durable_worker process is registered on this database; "
        "start one: python manage.py durable_worker"
    ]
    worker = workers.start(env=worker_env(workers))
    assert no_worker() == []
    out = __import__("io").StringIO()
    call_command("durable_workers", stdout=out)
    listed = rf":{worker.pid}:[0-9a-f]{{8}}\s+mode worker, 4 threads, queues all, .*: alive"
    assert re.search(listed, out.getvalue()), out.getvalue()
    worker.kill(signal.SIGTERM)
    assert worker.proc.wait(120) == 0, workers.logs()
    # Its stop line names what it is: a pull worker (it said "embedded worker", the thread mode's name).
    assert f"pull worker stopped in pid {worker.pid} (up " in worker.log(), worker.log()
    assert not WorkerProcess.objects.exists()
    assert no_worker() == [
        "no worker seen: no durable_worker process is registered on this database; "
        "start one: python manage.py durable_worker"
    ]


def test_health_says_how_long_no_worker_was_seen(web: Engine) -> None:
    """O6: a registry row silent past WORKER_DEAD_SECONDS reads 'no worker
    seen for N s' with the last worker's name."""
    from datetime import timedelta

    now = web.store.now()
    WorkerProcessFactory(host="gone", pid=1, threads=4, started_at=now, last_seen_at=now - timedelta(seconds=42))
    report = check_health(web, stale_seconds=3600, backlog_seconds=3600)
    (detail,) = [p.detail for p in report.problems if p.kind == "no_worker"]
    assert re.fullmatch(
        r"no worker seen for 4[23] s \(limit WORKER_DEAD_SECONDS 3 s\); the last was gone:1; "
        r"start one: python manage.py durable_worker",
        detail,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--queues=,"], "--queues must be comma-separated queue names"),
        (["--queues=" + "q" * 192], "--queues must be comma-separated queue names"),
        (["--poll-seconds=0"], "--poll-seconds"),
        (["--poll-seconds=nan"], "--poll-seconds"),
        (["--poll-seconds=61"], "--poll-seconds"),
    ],
)
def test_bad_worker_options_are_refused_before_anything_runs(args: list[str], message: str, settings: object) -> None:
    """Section 7, O1: durable_worker's fetch options are checked and refused
    with a message naming the option; no worker registers."""
    settings.DURABLE_SINGLETON = {"DISPATCH": "worker"}  # type: ignore[attr-defined]
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("durable_worker", *args)
    assert not WorkerProcess.objects.exists()


def test_fetch_options_need_the_worker_mode(settings: object) -> None:
    """Section 7: --queues and --poll-seconds mean nothing to another DISPATCH and are refused."""
    settings.DURABLE_SINGLETON = {"DISPATCH": "thread"}  # type: ignore[attr-defined]
    with pytest.raises(CommandError, match="--queues need DISPATCH 'worker'"):
        call_command("durable_worker", "--queues=a")


def test_the_new_settings_are_checked() -> None:
    """Section 7, O1, O6: DISPATCH 'worker' on the memory store (E007), a
    registry that would call a live worker dead (E008), and a poll of 0 (E001)."""
    from django.test import override_settings

    from durable_singleton.checks import check_settings

    for value, code in [
        ({"DISPATCH": "worker", "STORE": "memory"}, "durable_singleton.E007"),
        ({"WORKER_HEARTBEAT_SECONDS": 6.0, "WORKER_DEAD_SECONDS": 10.0}, "durable_singleton.E008"),
        ({"WORKER_POLL_SECONDS": 0}, "durable_singleton.E001"),
    ]:
        with override_settings(DURABLE_SINGLETON=value):
            assert code in [e.id for e in check_settings()], value


def test_the_ticks_redelivery_adds_no_second_notice_to_a_run_that_has_one() -> None:
    """S8, O7: a run still waiting for a free worker thread (its notice not
    taken) is due again after REDELIVERY_SECONDS; the tick's redelivery, run
    on a worker's tick thread, writes no second notice beside the pending
    one, so a saturated deployment does not pile notices up; a run whose
    notice was taken (and lost) gets a new one."""
    import threading

    from durable_singleton.dispatch import TICK_THREAD

    engine = build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 0.0}))
    engine.start(WORKFLOW, {"store_id": "dup", "seconds": 0}, run_id="dup-1")
    assert TurnNotice.objects.filter(run_id="dup-1").count() == 1

    def tick() -> None:
        engine.tick()
        engine.close_thread_resources()

    for _ in range(2):
        thread = threading.Thread(target=tick, name=TICK_THREAD)
        thread.start()
        thread.join(60)
    assert TurnNotice.objects.filter(run_id="dup-1").count() == 1
    TurnNotice.objects.all().delete()  # taken by a worker that died
    thread = threading.Thread(target=tick, name=TICK_THREAD)
    thread.start()
    thread.join(60)
    assert TurnNotice.objects.filter(run_id="dup-1").count() == 1


def test_a_worker_never_takes_back_its_own_runs(web: Engine) -> None:
    """O6, R5: the ticking worker's own registry row, late because its
    heartbeat thread was held up, is never taken for dead: its runs keep
    their leases; another silent worker's runs are taken back."""
    from datetime import timedelta

    from durable_singleton.stores.turns import release_dead_workers

    now = web.store.now()
    for name in ("me:1", "gone:2"):
        WorkerProcessFactory(
            name=name, host=name[:-2], pid=int(name[-1]), started_at=now, last_seen_at=now - timedelta(seconds=60)
        )
        running_run(f"held-{name}", WORKFLOW, f"{name}:abc", now, 300)
    (dead,) = release_dead_workers("default", 10.0, alive="me:1")
    assert dead.name == "gone:2" and dead.runs == ("held-gone:2",)
    assert Run.objects.get(pk="held-me:1").lease_expires_at > web.store.now()
    assert Run.objects.get(pk="held-gone:2").lease_expires_at <= web.store.now()
    assert list(WorkerProcess.objects.values_list("name", flat=True)) == ["me:1"]


def test_a_worker_takes_only_the_queues_it_names(workers: DurableWorkers, web: Engine) -> None:
    """O1: ``durable_worker --queues ds-faults`` takes the turns of workflows
    declared with that queue and leaves the default queue's: a run of the
    default queue started first is still pending with its notice when the
    later ds-faults run has completed (the fetch is oldest first, so a worker
    that ignored --queues would have taken it first)."""
    worker = workers.start(env=worker_env(workers), args=("--queues=ds-faults",))
    assert WorkerProcess.objects.get(pid=worker.pid).queues == "ds-faults"
    default = web.start(WORKFLOW, {"store_id": "qd", "seconds": 0}, run_id="q-default")
    isolated = web.start("fault-hold-isolated", {"store_id": "qi", "seconds": 0}, run_id="q-isolated")
    wait_for(lambda: all_completed([isolated.run_id]), 60, "the ds-faults run completed", workers.logs)
    assert Run.objects.get(pk=default.run_id).status == "pending"
    assert list(TurnNotice.objects.values_list("run_id", "queue")) == [("q-default", "default")]


def test_a_worker_names_the_queues_no_workflow_sends_turns_to(workers: DurableWorkers) -> None:
    """Section 7, O1: ``--queues`` with a name no registered workflow uses (a typo) is said
    at start, on stderr, naming it alone; the worker still runs (something else, a
    django.tasks task's queue, may send turns there). Before, it started silently and a
    misspelled queue's runs waited for a worker that never came."""
    from durable_singleton.checks import unrouted_queues

    worker = workers.start(env=worker_env(workers), args=("--queues=ds-faults,default,ds-fautls",))
    log = worker.log()
    assert "no registered workflow sends its turns to queue(s) ds-fautls (" in log, log
    assert worker.alive(), log
    assert unrouted_queues(["default", "ds-faults", "ds-fautls"]) == ["ds-fautls"]


def test_one_process_at_a_time_holds_the_ticks_lease() -> None:
    """O1b: the tick's lease is held by one owner at a time, by
    compare-and-set on the database's clock: a second worker cannot take it
    while it runs, takes it once it ended (its holder died), and at once
    after a clean stop released it."""
    from durable_singleton.stores.turns import hold_tick_lease, release_tick_lease

    assert hold_tick_lease("default", "a:1", 60.0)
    assert hold_tick_lease("default", "a:1", 60.0)  # its holder keeps it
    assert not hold_tick_lease("default", "b:2", 60.0)
    release_tick_lease("default", "a:1")
    assert hold_tick_lease("default", "b:2", 0.2)
    assert not hold_tick_lease("default", "a:1", 60.0)
    wait_for(lambda: hold_tick_lease("default", "a:1", 60.0), 30, "the lease taken over once it ended")
    assert not hold_tick_lease("default", "b:2", 60.0)
