"""Workers without Celery, as real processes (O1): ``manage.py durable_worker``
killed with SIGKILL and restarted, its database connections terminated, its
database server restarted, two of them on one SQLite file, and ``runserver``
starting the embedded worker by itself.

Workers open the test database by ``DATABASE_URL`` (the SQLite file, or the
PostgreSQL/MariaDB test database) and run the test project's ``fault-hold``
workflow: one step that records its entry and exit in ``BodyAudit`` and holds
the key for a given time.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.testing import make_engine
from testproject.inventory.models import BodyAudit
from tests.celery_workers import REPO
from tests.helpers import fault_bodies
from tests.worker_processes import DurableWorkers, wait_for, workers

__all__ = ["workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "fault-hold"


@pytest.fixture
def starter() -> Engine:
    """An engine of the test process that only writes runs: its dispatcher is
    never drained, and a new run is due at once, so only the worker
    processes execute them (their tick finds them)."""
    return make_engine("django", REDELIVERY_SECONDS=0.0)


def burst(engine: Engine, keys: int, per_key: int, seconds: float, tag: str = "b") -> list[str]:
    """Start ``per_key`` runs on each of ``keys`` keys; return their ids."""
    ids = []
    for n in range(per_key):
        for k in range(keys):
            run = engine.start(WORKFLOW, {"store_id": f"{tag}{k}", "seconds": seconds}, run_id=f"{tag}-{k}-{n}")
            ids.append(run.run_id)
    return ids


def statuses(ids: list[str]) -> dict[str, str]:
    return dict(Run.objects.filter(pk__in=ids).values_list("run_id", "status"))


def all_completed(ids: list[str]) -> bool:
    return set(statuses(ids).values()) == {"completed"}


def assert_no_overlap(killed_at: datetime | None = None) -> None:
    """No two bodies of one key overlapped (S9): a body that never recorded
    its exit was killed, and counts as running until ``killed_at``."""
    by_key: dict[str, list[tuple[datetime, datetime]]] = {}
    for row in BodyAudit.objects.order_by("entered_at"):
        end = row.exited_at or killed_at
        assert end is not None, f"body {row.run_id} never left and nothing was killed"
        by_key.setdefault(row.key, []).append((row.entered_at, end))
    for key, spans in by_key.items():
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"two bodies of {key} overlapped: one ended {end}, the next began {start}"


def first_entry_after(moment: datetime) -> datetime | None:
    row = BodyAudit.objects.filter(entered_at__gte=moment).order_by("entered_at").first()
    return row.entered_at if row is not None else None


def test_burst_completes_after_the_worker_is_killed_and_restarted(workers: DurableWorkers, starter: Engine) -> None:
    """O1, D4, S9, S10: a burst on three keys; the worker is SIGKILLed mid-burst
    (holders stranded with live leases, waiters parked); a restarted worker
    resumes the stranded, due and parked runs with no new dispatch, and every
    run completes with never two bodies of one key at once.

    Prints the time from the restart to the first resumed body.
    """
    ids = burst(starter, keys=3, per_key=4, seconds=0.4)
    first = workers.start()
    wait_for(lambda: list(statuses(ids).values()).count("completed") >= 3, 120, "3 runs done", workers.logs)
    first.kill(signal.SIGKILL)
    first.proc.wait(10)
    killed_at = timezone.now()
    assert not all_completed(ids), "the burst finished before the kill: nothing to resume"
    # Let the killed holders' 2 s leases expire, so the figure below is the
    # worker's own start-up, not the lease (R5).
    wait_for(
        lambda: not Run.objects.filter(status="running", lease_expires_at__gt=timezone.now()).exists(),
        60,
        "the killed worker's leases expired",
    )
    restarted_at = timezone.now()
    second = workers.start(wait=False)
    # Generous: a loaded 2-core machine can take many seconds to start Django (issue #19).
    wait_for(lambda: all_completed(ids), 180, "every run completed after the restart", workers.logs)
    resumed = first_entry_after(restarted_at)
    assert resumed is not None
    # A figure, not a bound: the restart's speed is not what this test checks.
    print(f"\nrestart to first resumed body: {(resumed - restarted_at).total_seconds():.2f} s ({connection.vendor})")
    assert second.alive()
    assert_no_overlap(killed_at)


def test_sigterm_finishes_the_turns_in_hand(workers: DurableWorkers, starter: Engine) -> None:
    """O1: SIGTERM lets the bodies in hand finish (within the grace time) and
    exits 0; nothing is left running with a lease, so nothing waits a lease."""
    ids = burst(starter, keys=2, per_key=1, seconds=1.0, tag="t")
    worker = workers.start()
    wait_for(lambda: fault_bodies(WORKFLOW) == 2, 120, "both bodies entered", workers.logs)
    worker.kill(signal.SIGTERM)
    assert worker.proc.wait(120) == 0, workers.logs()
    assert all_completed(ids), statuses(ids)
    assert "0 turns handed back" in worker.log()


def test_sigterm_hands_back_a_turn_that_outlives_the_grace(workers: DurableWorkers, starter: Engine) -> None:
    """O1, R5: a body still running when the grace time ends is handed back:
    its lease is expired at once, so the next worker re-drives it at its first
    tick instead of after LEASE_SECONDS (30 s here)."""
    (run_id,) = burst(starter, keys=1, per_key=1, seconds=60, tag="g")
    env = workers.env(DURABLE_LEASE_SECONDS="30", DURABLE_LEASE_RENEW_SECONDS="5")
    worker = workers.start(env=env, args=("--grace=0.5",))
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 120, "the body entered", workers.logs)
    worker.kill(signal.SIGTERM)
    assert worker.proc.wait(120) == 0, workers.logs()
    run = Run.objects.get(pk=run_id)
    assert run.status == "running" and run.lease_expires_at <= timezone.now(), (run.status, run.lease_expires_at)
    assert "1 turns handed back" in worker.log()
    # Issue #19 point 7: the stop line says how long the stop took and, apart, the uptime.
    assert re.search(
        rf"durable_worker pid {worker.pid}: stopped \d+\.\d s after SIGTERM \(up \d+\.\d s\); 1 turns handed back\.",
        worker.log(),
    ), worker.log()
    workers.start(env=env)
    wait_for(lambda: fault_bodies(WORKFLOW) == 2, 120, "the run re-driven", workers.logs)


def test_a_second_sigterm_hands_back_at_once(workers: DurableWorkers, starter: Engine) -> None:
    """O1: a second SIGTERM during the grace time stops waiting: the turn in
    hand is handed back and the worker exits long before --grace (600 s) and
    its body (600 s) end."""
    (run_id,) = burst(starter, keys=1, per_key=1, seconds=600, tag="h")
    worker = workers.start(
        env=workers.env(DURABLE_LEASE_SECONDS="30", DURABLE_LEASE_RENEW_SECONDS="5"), args=("--grace=600",)
    )
    wait_for(lambda: fault_bodies(WORKFLOW) == 1, 120, "the body entered", workers.logs)
    worker.kill(signal.SIGTERM)
    time.sleep(0.5)
    assert worker.alive(), workers.logs()
    worker.kill(signal.SIGTERM)
    assert worker.proc.wait(120) == 0, workers.logs()
    assert "1 turns handed back" in worker.log()
    run = Run.objects.get(pk=run_id)
    assert run.status == "running" and run.lease_expires_at <= timezone.now()


def test_sigterm_while_bodies_and_the_tick_run_exits_within_a_bound_even_if_the_database_waits(
    workers: DurableWorkers, starter: Engine
) -> None:
    """O1, R5, issue #19 point 7: SIGTERM while two bodies (600 s each) and
    the tick (every 0.2 s) run, with the runs' rows locked by this test (a
    transaction holding them, as a slow or stuck database would): the worker
    waits --grace (1 s) for the bodies, then tries to hand them back, and
    gives up on the hand-back after HAND_BACK_SECONDS (10 s) instead of
    waiting on the lock. It exits 0, says the turns are left to their leases,
    and its start and stop lines give threads, tick, store, database and
    times. (Before, the hand-back waited on the lock: on PostgreSQL without
    end, on SQLite until "database is locked" failed the command.)"""
    ids = burst(starter, keys=2, per_key=1, seconds=600, tag="x")
    env = workers.env(DURABLE_LEASE_SECONDS="30", DURABLE_LEASE_RENEW_SECONDS="5")
    worker = workers.start(threads=2, env=env, args=("--grace=1",))
    wait_for(lambda: fault_bodies(WORKFLOW) == 2, 120, "both bodies entered", workers.logs)
    with transaction.atomic():
        assert Run.objects.filter(pk__in=ids).update(attempts=F("attempts")) == 2  # locks both rows
        worker.kill(signal.SIGTERM)
        try:
            code = worker.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within 120 s of SIGTERM\n{workers.logs()}")
    assert code == 0, workers.logs()
    log = worker.log()
    vendor = connection.vendor
    assert (
        f"durable_worker pid {worker.pid}: 2 threads, tick every 0.2 s, store DjangoStore, "
        f"database 'default' ({vendor}), dispatch thread; ready." in log
    ), log
    assert f"embedded worker stopped in pid {worker.pid} (up " in log and "2 turns still in hand" in log, log
    assert re.search(r"stopped \d+\.\d s after SIGTERM \(up \d+\.\d s\); 2 turns left to their leases", log), log
    assert "Traceback" not in log, log


def test_two_worker_processes_share_one_sqlite_file(workers: DurableWorkers, starter: Engine) -> None:
    """O1, S9, S13: two worker processes on one SQLite file drain a burst on
    three keys; every run completes and no key ever has two bodies at once."""
    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: two processes sharing one database file")
    ids = burst(starter, keys=3, per_key=4, seconds=0.2, tag="s")
    workers.start(threads=3)
    workers.start(threads=3)
    wait_for(lambda: all_completed(ids), 180, "every run completed", workers.logs)
    assert_no_overlap()
    for worker in workers.processes:
        assert worker.alive(), workers.logs()
        assert "Traceback" not in worker.log(), worker.log()


def _terminate_other_backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def test_worker_reopens_connections_terminated_by_the_server(workers: DurableWorkers, starter: Engine) -> None:
    """O1: pg_terminate_backend of every worker connection (kept open with
    CONN_MAX_AGE=600) is survived: the worker reopens them and runs new work."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: pg_terminate_backend")
    env = workers.env(DATABASE_CONN_MAX_AGE="600")
    worker = workers.start(env=env)
    ids = burst(starter, keys=2, per_key=2, seconds=0.1, tag="p")
    wait_for(lambda: all_completed(ids), 120, "first burst completed", workers.logs)
    assert _terminate_other_backends() >= 1, "the worker kept no connection open"
    later = burst(starter, keys=2, per_key=2, seconds=0.1, tag="q")
    wait_for(lambda: all_completed(later), 120, "a burst after the terminate completed", workers.logs)
    assert worker.alive(), workers.logs()


def _manage(db_url: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings", "DATABASE_URL": db_url}
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


START_SCRIPT = """
from durable_singleton.testing import make_engine
engine = make_engine("django", REDELIVERY_SECONDS=0.0)
for n in range({n}):
    engine.start("fault-hold", {{"store_id": "r%d" % (n % 2), "seconds": 0.1}}, run_id="{tag}-%d" % n)
"""


def _completed(url: str, tag: str) -> int:
    """Count the completed runs ``tag-*`` on the server at ``url``, in one
    short connection of the test process (0 while the server is away)."""
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=10) as conn:
            row = conn.execute(
                "SELECT count(*) FROM durable_singleton_run WHERE run_id LIKE %s AND status = 'completed'",
                (f"{tag}-%",),
            ).fetchone()
    except psycopg.OperationalError:
        return 0
    return int(row[0]) if row else 0


def test_worker_survives_a_database_server_restart(workers: DurableWorkers) -> None:
    """O1: the PostgreSQL server is restarted under a running worker; the
    worker logs the failed ticks, reconnects, and completes runs started after
    the restart.

    The completions are polled with a generous bound (a loaded 2-core machine
    took more than 60 s once, issue #19), by a direct query rather than a
    ``manage.py shell`` per poll (a Django start-up of its own each time)."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: restarts a private PostgreSQL server")
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import services
    finally:
        sys.path.pop(0)
    # Not under tmp_path: the server runs as the postgres user, who must traverse it.
    root = Path(tempfile.mkdtemp(prefix="ds-pg-restart-"))
    root.chmod(0o755)
    server = services.start_postgres(root)
    try:
        url = server.url
        _manage(url, "migrate", "--verbosity=0")
        worker = workers.start(env=workers.env(db_url=url, DATABASE_CONN_MAX_AGE="600"))
        _manage(url, "shell", "-c", START_SCRIPT.format(n=4, tag="before"))
        wait_for(lambda: _completed(url, "before") == 4, 180, "runs before the restart", workers.logs)
        server.restart()
        _manage(url, "shell", "-c", START_SCRIPT.format(n=4, tag="after"))
        wait_for(lambda: _completed(url, "after") == 4, 300, "runs after the restart", workers.logs)
        assert worker.alive(), workers.logs()
    finally:
        workers.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_runserver_starts_the_embedded_worker_without_a_request(workers: DurableWorkers, starter: Engine) -> None:
    """O1: with DISPATCH "thread", ``runserver`` starts its worker and tick
    when it starts serving: a run that is already due completes though no
    request and no dispatch reach the server. Its log says when the embedded
    worker started (threads, tick, store, database) and, at Ctrl-C, that it
    stopped."""
    ids = burst(starter, keys=1, per_key=2, seconds=0.1, tag="w")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # PYTHONFAULTHANDLER: a server that does not exit is aborted below and its log shows every thread's stack.
    env = workers.env(PYTHONFAULTHANDLER="1")
    server = workers.start(command=("runserver", "--noreload", f"127.0.0.1:{port}"), wait=False, env=env)
    wait_for(lambda: all_completed(ids), 180, "the due runs completed", workers.logs)
    # Issue #19 point 7: one line when the embedded worker starts, one when the process stops it.
    started = f"embedded worker started in pid {server.pid}: 4 threads, tick every 1 s, store DjangoStore, "
    assert f"{started}database 'default' ({connection.vendor})" in server.log(), server.log()
    server.kill(signal.SIGINT)  # Ctrl-C
    try:
        code = server.proc.wait(120)
    except subprocess.TimeoutExpired:
        server.kill(signal.SIGABRT)  # the fault handler writes each thread's stack to the log
        server.proc.wait(30)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        parent = f"this process's SIGINT: {signal.getsignal(signal.SIGINT)!r}, blocked {blocked!r}"
        pytest.fail(f"runserver did not exit within 120 s of SIGINT ({parent})\n{server.log()}")
    assert code == 0, server.log()
    assert f"embedded worker stopped in pid {server.pid} (up " in server.log(), server.log()


def test_uvicorn_starts_the_embedded_worker_when_it_loads_the_app(workers: DurableWorkers, starter: Engine) -> None:
    """O1: ``uvicorn testproject.asgi:application`` loads asgi.py, which starts
    the embedded worker: already-due runs complete with no request."""
    pytest.importorskip("uvicorn", reason="uvicorn is in the test requirements")
    ids = burst(starter, keys=1, per_key=2, seconds=0.1, tag="u")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers.start(argv=("-m", "uvicorn", "testproject.asgi:application", "--port", str(port)), wait=False)
    wait_for(lambda: all_completed(ids), 180, "the due runs completed", workers.logs)
