"""Adversarial: ``DISPATCH = "worker"`` and worker liveness (O1, O1a, O1b, O6, O6a, O7).

Faults found and fixed, each with the test that failed before its fix:

* a stopping ``durable_worker`` handed its turns back with an expiry and a
  ``wake_at`` from its own clock: stepped an hour ahead since its last
  correction, the runs stayed stranded an hour (R5, R8, O1);
* the worker's periods had no upper bound: a ``WORKER_POLL_SECONDS``,
  ``WORKER_HEARTBEAT_SECONDS`` or ``WORKER_DEAD_SECONDS`` the checks passed
  killed the fetch, heartbeat or tick thread at its first use (section 7);
* two tick holders at once (a slow tick outliving its lease) both took the
  same dead worker's runs back and logged each twice: the second read the
  lease the first had just ended as alive, its ``now`` being older (O6a, R5a).

The other tests are attacks that held; they guard the behaviour. Each runs
in-process on the test database (SQLite, PostgreSQL or MariaDB).
"""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from durable_singleton.checks import check_settings
from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.identity import process_name
from durable_singleton.models import Run, TurnNotice, WorkerProcess
from durable_singleton.runtime import build_engine
from durable_singleton.stores.turns import (
    add_notices,
    hold_tick_lease,
    register_worker,
    release_dead_workers,
    take_notices,
)
from durable_singleton.testing import make_engine
from durable_singleton.worker import expire_own_leases
from testproject.inventory.models import BodyAudit
from tests.conftest import run_threads
from tests.core.test_database_clock import step_clock
from tests.factories import WorkerProcessFactory
from tests.helpers import fault_bodies, running_run
from tests.worker_processes import DurableWorkers, wait_for, workers

__all__ = ["workers"]  # the fixture, imported for this module's tests

WORKFLOW = "fault-hold"
STEP = timedelta(hours=1)


def _running(run_id: str, owner: str, expires_in: float, engine: Engine) -> None:
    running_run(run_id, WORKFLOW, owner, engine.store.now(), expires_in)


@pytest.mark.django_db(transaction=True)
def test_a_hand_back_on_a_process_stepped_ahead_ends_the_lease_now() -> None:
    """R5, R8, O1: a durable_worker that stops with a turn still in hand hands
    it back: the lease ends now and the run is due now, so the next worker
    re-drives it at once. The process's clock stepped an hour ahead since its
    last correction (NTP, a resumed VM); the hand-back must still write the
    database's now, not a time an hour ahead that strands the run (its
    registry row is gone at a clean stop, so no dead-worker take-back
    rescues it)."""
    engine = make_engine("django", registry=Registry())
    step_clock(engine, STEP)
    _running("hb-1", f"{process_name()}:abc", 300, engine)
    assert expire_own_leases(engine, ["hb-1"]) == 1
    run = Run.objects.get(pk="hb-1")
    after = engine.store.now()
    assert run.lease_expires_at is not None and run.wake_at is not None
    assert run.lease_expires_at <= after, run.lease_expires_at - after
    assert run.wake_at <= after, run.wake_at - after


@pytest.mark.parametrize(
    "value",
    [
        {"WORKER_POLL_SECONDS": 1e10},
        {"WORKER_HEARTBEAT_SECONDS": 1e10, "WORKER_DEAD_SECONDS": 3e10},
        {"WORKER_DEAD_SECONDS": 1e12},
    ],
    ids=["poll", "heartbeat", "dead"],
)
def test_a_worker_period_it_cannot_use_is_reported_by_the_checks(value: dict[str, float]) -> None:
    """Section 7, O1, O6: a WORKER_POLL_SECONDS, WORKER_HEARTBEAT_SECONDS or
    WORKER_DEAD_SECONDS the worker cannot use (a wait past threading's
    TIMEOUT_MAX, a silence that overflows the database's clock) passed the
    checks and killed the fetch, heartbeat or tick thread at its first use:
    such a worker never took a notice or never ticked. The checks report it
    (E001) and the settings refuse it."""
    from durable_singleton.exceptions import ConfigurationError

    with override_settings(DURABLE_SINGLETON=value):
        errors = [e for e in check_settings() if e.id == "durable_singleton.E001"]
        assert errors and all("<=" in e.msg for e in errors), [e.msg for e in errors]
    with pytest.raises(ConfigurationError):
        Settings.from_mapping(value)


def test_the_largest_worker_periods_are_usable() -> None:
    """Section 7, O6: the bounds are usable values: a worker waits them and
    the tick subtracts WORKER_DEAD_SECONDS from the database's clock."""
    settings = Settings.from_mapping(
        {"WORKER_POLL_SECONDS": 60.0, "WORKER_HEARTBEAT_SECONDS": 3600.0, "WORKER_DEAD_SECONDS": 86400.0}
    )
    event = threading.Event()
    for seconds in (settings.WORKER_POLL_SECONDS, settings.WORKER_HEARTBEAT_SECONDS):
        assert not event.wait(0) and seconds <= threading.TIMEOUT_MAX
    from django.utils import timezone

    assert timezone.now() - timedelta(seconds=settings.WORKER_DEAD_SECONDS) < timezone.now()


@pytest.mark.django_db(transaction=True)
def test_many_fetchers_take_each_notice_once() -> None:
    """O1a, S5: eight threads fetch the same 60 notices at once (SKIP LOCKED
    on PostgreSQL and MariaDB, SQLite's write lock): each notice is taken by
    exactly one fetcher and none is left."""
    add_notices("default", [f"n-{i}" for i in range(60)], None)
    taken: list[str] = []
    lock = threading.Lock()

    def fetch(i: int) -> None:
        while True:
            got = take_notices("default", 3)
            if not got:
                return
            with lock:
                taken.extend(got)

    errors = [r for r in run_threads(8, fetch, timeout=120) if isinstance(r, BaseException)]
    locked = [e for e in errors if "locked" in str(e)]
    assert not [e for e in errors if e not in locked], errors
    if locked:  # SQLite may refuse a fetcher its write lock; the others take every notice
        taken.extend(take_notices("default", 100))
    assert sorted(taken) == sorted(f"n-{i}" for i in range(60))
    assert not TurnNotice.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_fetch_on_postgresql_is_one_statement_that_takes_its_queues_oldest_notices() -> None:
    """O7, S5: on PostgreSQL a durable_worker's fetch takes and deletes the
    oldest notices of its queues in one statement, one round trip and one
    commit (it was a read, then BEGIN, a SELECT ... FOR UPDATE SKIP LOCKED, a
    DELETE and COMMIT: five round trips per fetch, most of a worker's per turn
    when runs come one by one); a fetch that finds none is the same one
    statement. The notices of other queues, and those past ``count``, stay."""
    if connection.vendor != "postgresql":
        pytest.skip("the one-statement fetch is PostgreSQL's; elsewhere the ORM's transaction")
    add_notices("default", ["a-1", "a-2", "a-3"], "a")
    add_notices("default", ["b-1"], "b")
    assert take_notices("default", 2, ["none"]) == {}  # its statement prepared once per connection
    with CaptureQueriesContext(connection) as seen:
        got = take_notices("default", 2, ["a"])
    assert got == {"a-1": "a", "a-2": "a"}
    assert len(seen.captured_queries) == 1, [q["sql"][:80] for q in seen.captured_queries]
    assert sorted(TurnNotice.objects.values_list("run_id", flat=True)) == ["a-3", "b-1"]
    with CaptureQueriesContext(connection) as seen:
        assert take_notices("default", 2, ["c"]) == {}
    assert len(seen.captured_queries) == 1, [q["sql"][:80] for q in seen.captured_queries]
    assert take_notices("default", 5) == {"a-3": "a", "b-1": "b"}
    assert not TurnNotice.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_fetchs_commit_without_a_flush_ends_with_the_fetch() -> None:
    """O7, R5, S5: on PostgreSQL a fetch outside a transaction commits without
    waiting for its WAL flush (a notice's delete lost in a crash gives its run
    one more turn, which its claim decides), and only the fetch: the next
    statement on the connection, and a caller's transaction around a fetch,
    keep synchronous_commit as configured."""
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")

    def setting() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('synchronous_commit')")
            return str(cursor.fetchone()[0])

    with connection.cursor() as cursor:  # the tests' servers run without it: as a deployment's
        cursor.execute("SET synchronous_commit TO on")
    try:
        add_notices("default", ["s-1", "s-2"], None)
        assert take_notices("default", 1) == {"s-1": "default"}
        assert setting() == "on"
        with transaction.atomic():
            assert take_notices("default", 1) == {"s-2": "default"}
            assert setting() == "on"
        assert setting() == "on"
        assert not TurnNotice.objects.exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET synchronous_commit")


@pytest.mark.django_db(transaction=True)
def test_a_notice_of_a_finished_or_cancelled_run_runs_no_body() -> None:
    """O1a, R2, R6: a notice names a run id, the claim decides: the notices of
    a run that completed and of one cancelled meanwhile are taken and run no
    body, and the runs keep their terminal status."""
    engine = build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}))
    done = engine.start(WORKFLOW, {"store_id": "fin", "seconds": 0}, run_id="fin-1")
    (run_id, _queue) = next(iter(take_notices("default", 10).items()))
    assert run_id == done.run_id
    engine.execute_chain(run_id)
    assert Run.objects.get(pk=run_id).status == "completed"
    cancelled = engine.start(WORKFLOW, {"store_id": "can", "seconds": 0}, run_id="can-1")
    engine.cancel(cancelled.run_id)
    add_notices("default", [run_id], None)  # a second notice of the completed run (a signal, a wake)
    before = fault_bodies(WORKFLOW)
    for taken in take_notices("default", 10):
        engine.execute_chain(taken)
    assert fault_bodies(WORKFLOW) == before
    assert Run.objects.get(pk="fin-1").status == "completed"
    assert Run.objects.get(pk="can-1").status == "cancelled"
    assert not TurnNotice.objects.exists()
    engine.close_thread_resources()


@pytest.mark.django_db(transaction=True)
def test_two_recoverers_of_one_dead_worker_take_each_run_back_once(caplog: pytest.LogCaptureFixture) -> None:
    """O6a, R5a: two tick holders (a slow tick outliving its lease and the
    next holder) take back the same dead worker's runs at once: each run's
    lease is ended once and logged once, and a run the dead worker's owner
    name matches but that another process took meanwhile is left alone."""
    engine = make_engine("django", registry=Registry())
    now = engine.store.now()
    WorkerProcessFactory(host="gone", pid=7, threads=2, started_at=now, last_seen_at=now - timedelta(seconds=60))
    for n in range(4):
        _running(f"dead-{n}", f"gone:7:lease{n}", 300, engine)
    _running("taken", "alive:8:lease", 300, engine)
    with caplog.at_level("WARNING", logger="durable_singleton.worker"):
        results = run_threads(2, lambda i: release_dead_workers("default", 10.0, alive="me:1"))
    outcomes = [r for r in results if not isinstance(r, Exception)]
    assert outcomes, results
    released = sorted(run for found in outcomes for dead in found for run in dead.runs)
    assert released == [f"dead-{n}" for n in range(4)], results
    lines = [r.getMessage() for r in caplog.records if "dead worker gone:7" in r.getMessage()]
    assert len(lines) == 4, lines
    assert Run.objects.get(pk="taken").lease_expires_at > engine.store.now()
    assert not WorkerProcess.objects.filter(name="gone:7").exists()


@pytest.mark.django_db(transaction=True)
def test_a_worker_seen_again_keeps_its_row_and_its_runs() -> None:
    """O6a, R5a: a worker whose row was refreshed (it was only slow) is not
    taken for dead: its row and its runs' leases are kept."""
    engine = make_engine("django", registry=Registry())
    now = engine.store.now()
    WorkerProcessFactory(host="slow", pid=9, started_at=now)
    register_worker("default", name="slow:9", host="slow", pid=9, mode="worker", threads=1, queues="")
    _running("slow-run", "slow:9:lease", 300, engine)
    assert release_dead_workers("default", 10.0, alive="me:1") == []
    assert WorkerProcess.objects.filter(name="slow:9").exists()
    assert Run.objects.get(pk="slow-run").lease_expires_at > engine.store.now()


@pytest.mark.django_db(transaction=True)
def test_the_tick_lease_is_held_on_the_databases_clock() -> None:
    """O1b, R5: the tick's lease ends on the database's clock: a lease
    written to end in the past by the database's clock is taken over at once
    whatever a process's clock says, and one that ends in the future is never
    taken by another owner."""
    from durable_singleton.models import Heartbeat
    from durable_singleton.stores.turns import TICK_LEASE

    engine = make_engine("django", registry=Registry())
    step_clock(engine, -STEP)  # the process believes it is an hour earlier
    db_now = engine.store.now()
    Heartbeat.objects.create(name=TICK_LEASE, at=db_now - timedelta(seconds=1), owner="old:1")
    assert hold_tick_lease("default", "new:2", 3.0)
    assert not hold_tick_lease("default", "old:1", 3.0)
    lease = Heartbeat.objects.get(name=TICK_LEASE)
    assert lease.owner == "new:2"
    assert timedelta(0) < lease.at - db_now < timedelta(seconds=60), lease.at - db_now


# -- real durable_worker processes ------------------------------------------------


def _env(workers: DurableWorkers, **overrides: str) -> dict[str, str]:
    return workers.env(
        DURABLE_DISPATCH="worker",
        DURABLE_REDELIVERY_SECONDS="600",
        DURABLE_WORKER_HEARTBEAT_SECONDS="0.5",
        DURABLE_WORKER_DEAD_SECONDS="2",
        **overrides,
    )


@pytest.fixture
def web() -> Engine:
    return build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_runs_written_while_no_worker_runs_complete_once_one_starts(workers: DurableWorkers, web: Engine) -> None:
    """O1 (a rolling deploy): a web process writes runs while no worker runs
    (their notices wait in the table, the redelivery is 10 minutes away); a
    worker started later runs every one of them and leaves no notice."""
    ids = [web.start(WORKFLOW, {"store_id": f"rd{n}", "seconds": 0}, run_id=f"rd-{n}").run_id for n in range(5)]
    assert TurnNotice.objects.count() == 5
    workers.start(env=_env(workers))
    wait_for(lambda: Run.objects.filter(pk__in=ids, status="completed").count() == 5, 60, "every run", workers.logs)
    assert not TurnNotice.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("dispatch", ["worker", "thread"])
def test_a_worker_stopped_and_continued_still_obeys_sigterm(workers: DurableWorkers, dispatch: str) -> None:
    """O1, R7: a durable_worker stopped (SIGSTOP: a paused container, a
    debugger) and continued (SIGCONT) stops cleanly at SIGTERM and exits 0.
    Its main thread waited for the stop without a bound; the kernel delivered
    the SIGTERM to another thread, Python's handler never ran, and the worker
    ignored every SIGTERM until it was killed."""
    env = {**_env(workers), "DURABLE_DISPATCH": dispatch}
    worker = workers.start(threads=1, env=env)
    worker.kill(signal.SIGSTOP)
    try:
        threading.Event().wait(3.0)  # stopped for a while, as a paused container is
    finally:
        worker.kill(signal.SIGCONT)
    worker.kill(signal.SIGTERM)
    assert worker.exit_code(60) == 0, workers.logs()
    assert "received SIGTERM: stopping" in worker.log(), worker.log()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_stopped_worker_whose_run_was_taken_back_is_fenced(workers: DurableWorkers, web: Engine) -> None:
    """O6, R5, R5a: a worker holding a run (lease 300 s) is stopped with
    SIGSTOP; another worker takes the run back once the stopped one is silent
    past WORKER_DEAD_SECONDS and runs the body again. When the stopped worker
    continues (SIGCONT), its body's writes are refused by the lease: the run
    completes once, by the second worker, and the first never settles it."""
    env = _env(workers, DURABLE_LEASE_SECONDS="300", DURABLE_LEASE_RENEW_SECONDS="0.5")
    first = workers.start(threads=1, env=env, args=("--grace=0.5",))
    web.start(WORKFLOW, {"store_id": "stop", "seconds": 4, "seconds_after_recovery": 0}, run_id="stop-1")
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 60, "the body entered", workers.logs)
    first.pause()
    try:
        second = workers.start(threads=1, env=env, args=("--grace=0.5",))
        wait_for(lambda: Run.objects.get(pk="stop-1").status == "completed", 60, "the run taken back", workers.logs)
        assert f":{first.pid}" in "".join(line for line in second.log().splitlines() if "dead worker" in line), (
            second.log()
        )
    finally:
        first.kill(signal.SIGCONT)
    run = Run.objects.get(pk="stop-1")
    # The resumed worker's body ends its hold and tries to write; then it stops
    # (SIGTERM): every write it would make is made or refused by now.
    first.kill(signal.SIGTERM)
    assert first.proc.wait(60) == 0, workers.logs()
    after = Run.objects.get(pk="stop-1")
    assert after.status == "completed" and after.finished_at == run.finished_at, workers.logs()
    assert after.output == run.output and after.output["pid"] == second.pid, after.output
    assert sorted(BodyAudit.objects.values_list("pid", flat=True)) == sorted([first.pid, second.pid]), (
        list(BodyAudit.objects.values_list("run_id", "pid", "entered_at", "exited_at")),
        workers.logs(),
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_listen_connection_killed_by_the_server_is_reopened(workers: DurableWorkers, web: Engine) -> None:
    """O1: a dropped database connection is reopened, never fatal. On
    PostgreSQL every connection of a running worker, its LISTEN connection
    included, is ended by pg_terminate_backend; the worker says LISTEN was
    lost and is back, and a run started afterwards is completed through its
    notice (the redelivery is 10 minutes away)."""
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    worker = workers.start(env=_env(workers))
    web.start(WORKFLOW, {"store_id": "pre", "seconds": 0}, run_id="pre-1")
    wait_for(lambda: Run.objects.get(pk="pre-1").status == "completed", 60, "the first run", workers.logs)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    wait_for(lambda: "LISTEN connection back" in worker.log(), 60, "LISTEN back", workers.logs)
    web.start(WORKFLOW, {"store_id": "post", "seconds": 0}, run_id="post-1")
    wait_for(lambda: Run.objects.get(pk="post-1").status == "completed", 60, "the run after", workers.logs)
    assert worker.alive()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads=0"], "--threads"),
        (["--threads=-3"], "--threads"),
        (["--poll-seconds=-1"], "--poll-seconds"),
        (["--poll-seconds=inf"], "--poll-seconds"),
        (["--tick-seconds=-1"], "--tick-seconds"),
        (["--queues=a,,b"], "--queues must be comma-separated queue names"),
        (["--queues=bad\x07name"], "--queues must be comma-separated queue names"),
    ],
)
@pytest.mark.django_db(transaction=True)
def test_bad_worker_options_are_refused_and_nothing_registers(args: list[str], message: str, settings: Any) -> None:
    """Section 7, O1, O6: durable_worker refuses a thread count of 0 or
    below, a negative or infinite poll or tick, an empty or unprintable
    queue name, with a message naming the option, before any thread starts
    or any registry row is written."""
    import re

    from django.core.management import CommandError, call_command

    settings.DURABLE_SINGLETON = {"DISPATCH": "worker"}
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("durable_worker", *args)
    assert not WorkerProcess.objects.exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_sigusr1_prints_every_threads_stack_and_the_worker_runs_on(workers: DurableWorkers) -> None:
    """O1, O6: SIGUSR1 makes a durable_worker print the stack of each of its threads to
    its stderr (as a Celery worker does) and changes nothing: it still stops cleanly at
    SIGTERM. What a worker that does not stop is waiting for can then be read from its log
    (the tests send it before they give up on a worker's exit)."""
    worker = workers.start(threads=1, env=_env(workers))
    worker.kill(signal.SIGUSR1)
    wait_for(lambda: "most recent call first" in worker.log(), 60, "the threads' stacks in the log", worker.log)
    assert worker.alive(), worker.log()
    worker.kill(signal.SIGTERM)
    assert worker.exit_code(60) == 0, workers.logs()
    assert "received SIGTERM: stopping" in worker.log(), worker.log()


@pytest.mark.django_db(transaction=True)
def test_a_sigterm_handled_inside_the_workers_wait_never_waits_for_its_own_lock() -> None:
    """O1, O6: Python runs a signal handler on the main thread between two bytecodes, and
    there it can interrupt ``ForegroundWorker.run``'s ``stopping.wait`` just after the wait
    took the event's lock back. The handler the command installs (``handle_signal``) is
    called here the same way, on a thread holding that lock: it must return, and ``run``
    must then stop within its poll. Before, the handler set ``stopping`` itself and waited
    for that lock forever: the worker ignored every later SIGTERM (CI, pair X:
    ``test_a_worker_stopped_and_continued_still_obeys_sigterm``, whose SIGUSR1 dump showed
    the handler in ``Event.set`` under ``Event.wait``)."""
    from durable_singleton.dispatch import ThreadDispatcher
    from durable_singleton.worker import ForegroundWorker

    built = make_engine("django", registry=Registry())
    dispatcher = ThreadDispatcher(built.store, threads=1, tick_seconds=60)
    engine = Engine(built.store, dispatcher, registry=built.registry, settings=built.settings)
    dispatcher.bind(engine)
    worker = ForegroundWorker(engine=engine, grace_seconds=5)
    returned = threading.Event()

    def interrupted_wait() -> None:
        with worker.stopping._cond:  # type: ignore[attr-defined]  # as inside Event.wait, after it woke
            worker.handle_signal(signal.SIGTERM)
            returned.set()

    waiter = threading.Thread(target=interrupted_wait, daemon=True)
    waiter.start()
    assert returned.wait(10), "the SIGTERM handler waited for the lock its own thread holds"
    ran = threading.Thread(target=worker.run, daemon=True)
    ran.start()
    ran.join(30)
    assert not ran.is_alive(), "the worker did not act on the recorded SIGTERM"
    assert worker.stop_reason == "SIGTERM" and worker.stopping.is_set()


def test_the_sigusr1_dump_names_every_threads_frames_from_python(capfd: pytest.CaptureFixture[str]) -> None:
    """O1, O6: ``ForegroundWorker.dump_stacks``, the handler ``durable_worker`` installs
    for SIGUSR1, writes each thread's stack to file descriptor 2, most recent call first,
    the frames read by Python under the interpreter's lock: a thread waiting in a function
    of its own shows that function. Before, ``faulthandler`` read the other threads' frames
    from the C signal handler while they ran and once crashed the worker (SIGSEGV) in the
    middle of a dump."""
    from durable_singleton.worker import ForegroundWorker

    release = threading.Event()

    def parked_in_a_known_place() -> None:
        release.wait(30)

    thread = threading.Thread(target=parked_in_a_known_place, daemon=True)
    thread.start()
    try:
        ForegroundWorker.dump_stacks(signal.SIGUSR1, None)
    finally:
        release.set()
        thread.join(30)
    err = capfd.readouterr().err
    assert f"Thread 0x{thread.ident:016x} (most recent call first):" in err, err
    assert "in parked_in_a_known_place" in err and "test_the_sigusr1_dump_names" in err, err


@pytest.mark.django_db(transaction=True)
def test_a_second_sigterm_before_the_worker_acted_on_the_first_still_hurries_the_stop() -> None:
    """O1: two SIGTERMs in quick succession (an operator's double Ctrl-C, a supervisor's
    TERM then TERM) are two stop requests: the second hurries the stop (the turns in hand
    are handed back at once), even when both arrive before ``run``'s wait acted on the
    first (within ``STOP_POLL_SECONDS``). Before, the handler recorded the second over the
    first and the worker then waited the whole grace time for the turns in hand."""
    from durable_singleton.dispatch import ThreadDispatcher
    from durable_singleton.worker import ForegroundWorker

    built = make_engine("django", registry=Registry())
    dispatcher = ThreadDispatcher(built.store, threads=1, tick_seconds=60)
    engine = Engine(built.store, dispatcher, registry=built.registry, settings=built.settings)
    dispatcher.bind(engine)
    worker = ForegroundWorker(engine=engine, grace_seconds=5)
    worker.handle_signal(signal.SIGTERM)
    worker.handle_signal(signal.SIGTERM)  # before run's wait saw the first
    assert worker.hurry.is_set(), "the second SIGTERM was lost"
    ran = threading.Thread(target=worker.run, daemon=True)
    ran.start()
    ran.join(30)
    assert not ran.is_alive(), "the worker did not act on the recorded SIGTERMs"
    assert worker.stop_reason == "SIGTERM" and worker.stopping.is_set()


@pytest.mark.django_db(transaction=True)
def test_a_stop_hands_back_the_turn_a_handoff_ran_next_on_the_thread() -> None:
    """O1, O6, S7: a worker thread runs A's turn; A's settle admits the waiter B, whose turn
    runs next on the same thread (``execute_chain``). Stopped while B's body runs, the
    worker hands back B (its lease expired at once, so another worker takes it now). Before,
    the thread still named A as its turn in hand: the stop handed back nothing, and B was
    re-entered only when its lease expired, ``LEASE_SECONDS`` later (found by a tester,
    on every database: 28 s instead of 0.1 s)."""
    from durable_singleton.worker import ForegroundWorker, hand_back

    engine = build_engine(Settings.from_mapping({"DISPATCH": "worker", "REDELIVERY_SECONDS": 600.0}))
    first = engine.start(WORKFLOW, {"store_id": "chained", "seconds": 0}, run_id="chain-A").run_id
    second = engine.start(WORKFLOW, {"store_id": "chained", "seconds": 2}, run_id="chain-B").run_id
    worker = ForegroundWorker(engine=engine, threads=1, tick_seconds=60, grace_seconds=0, poll_seconds=0.05)
    dispatcher = worker.dispatcher
    dispatcher.start()
    try:
        wait_for(
            lambda: BodyAudit.objects.filter(workflow_name=WORKFLOW, key="store:chained").count() == 2,
            60,
            "B's body entered after A's, on the same thread",
            lambda: str(list(Run.objects.values_list("run_id", "status"))),
        )
        assert Run.objects.get(pk=first).status == "completed"
        assert sorted(dispatcher.in_hand.values()) == [second], dispatcher.in_hand
    finally:
        left = dispatcher.stop(timeout=0.1)
    assert left == [second], left
    assert hand_back(engine, left) == 1
    handed = Run.objects.get(pk=second)
    assert handed.status == "running" and handed.lease_expires_at is not None
    assert handed.lease_expires_at <= engine.store.now(), "B keeps its lease: no other worker takes it"
    for thread in dispatcher._ending:  # B's body ends its step, fenced (R5a), before the test's teardown
        thread.join(30)
    dispatcher.close_thread_resources()


@pytest.mark.django_db(transaction=True)
def test_a_tick_that_outlasts_its_lease_stops_before_its_next_job(caplog: pytest.LogCaptureFixture) -> None:
    """O1b ("one tick at a time"): a tick slower than the tick's lease (a paused VM, a slow
    database) lets another process take the lease and tick. The first tick checks its lease
    before each job (renewing it) and stops at the first job after another took it: the
    two ticks overlap for one job at most. Before, it ran all its jobs inside the next
    holder's tick (found by a tester, with a tick slowed to 5 s: TICK OVERLAP on every
    database)."""
    import time

    from durable_singleton.models import Heartbeat
    from durable_singleton.stores.turns import TICK_LEASE, tick_lease_keeper

    engine = make_engine("django", registry=Registry())
    db = engine.store.database
    assert db is not None
    assert hold_tick_lease(db, "slow", 0.003)
    holding = tick_lease_keeper(db, "slow", 0.003)
    ran: list[str] = []

    def job(name: str) -> Any:
        def run(report: Any) -> None:
            ran.append(name)
            if name == "first":  # meanwhile the lease ends and another process takes it
                Heartbeat.objects.filter(name=TICK_LEASE).update(at=engine.store.now() - timedelta(seconds=1))
                assert hold_tick_lease(db, "next", 30.0)
                time.sleep(0.01)

        return run

    jobs = [("first", job("first")), ("second", job("second")), ("third", job("third"))]
    engine.tick_jobs = lambda: jobs  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="durable_singleton"):
        engine.tick(holding=holding)
    assert ran == ["first"], ran
    assert "the tick's lease ended before job second" in caplog.text
    ran.clear()
    engine.tick()  # a tick without a lease to keep (a store without a database, a test) runs every job
    assert ran == ["first", "second", "third"]
