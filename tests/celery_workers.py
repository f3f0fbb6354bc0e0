"""Real Celery worker processes for tests.

``celery_workers`` (a fixture) starts ``celery -A testproject worker``
subprocesses on the test database and the test broker, waits until each logs
that it is ready, and in teardown stops them by PID (SIGTERM, then SIGKILL of
the worker's own process group). Each worker's log is kept in the test's
``tmp_path`` and can be read while the test runs (``workers.logs()``), e.g.
to show in an assertion message.

Use in a test module::

    from .celery_workers import celery_stack_missing, celery_workers  # noqa: F401 (fixture)

    @pytest.mark.celery
    @pytest.mark.django_db(transaction=True)  # workers must see committed rows
    def test_something(celery_workers):
        if reason := celery_stack_missing():
            pytest.skip(reason)
        (worker,) = celery_workers.start(1, concurrency=2)
        ...
        worker.kill()                         # SIGKILL the main process by PID
        worker.kill_children()                # or only its prefork children

Worker processes open the database by ``DATABASE_URL`` built from the test
connection's settings, so they use pytest-django's test database
(``test_<name>``) rather than the configured one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from testproject.demo.live import database_url

__all__ = [
    "CeleryWorkers",
    "WorkerProcess",
    "celery_stack_missing",
    "celery_workers",
    "database_in_use",
    "worker_env",
]

REPO = Path(__file__).resolve().parent.parent
READY_MARK = b" ready."
BEAT_READY_MARK = b"beat: Starting..."
READY_TIMEOUT = 180.0  # a loaded 2-core machine starts Django and Celery slowly (#19)
STOP_TIMEOUT = 15.0


def celery_stack_missing(vendors: tuple[str, ...] = ("postgresql",)) -> str | None:
    """Return why real workers cannot run here, or None: the test database must
    be one of ``vendors`` and ``CELERY_BROKER_URL`` a ``redis://`` URL."""
    broker = str(getattr(settings, "CELERY_BROKER_URL", "") or "")
    if connection.vendor not in vendors:
        return f"needs DATABASE_URL on {' or '.join(vendors)} (this run uses {connection.vendor})"
    if not broker.startswith(("redis://", "rediss://")):
        return f"needs CELERY_BROKER_URL=redis://... (this run uses {broker or 'no broker'})"
    return None


def database_in_use() -> bool:
    """Tell whether a session other than this process's holds a write lock or
    an open transaction on the test database: on SQLite, whether a write
    transaction cannot begin at once; on PostgreSQL, whether another session
    of this database is idle inside a transaction; on MariaDB, whether InnoDB
    lists another connection's transaction with no statement running."""
    if connection.vendor == "sqlite":
        import sqlite3

        probe = sqlite3.connect(str(connection.settings_dict["NAME"]), timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            probe.close()
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%%'"
            )
        else:
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_trx"
                " WHERE trx_mysql_thread_id <> CONNECTION_ID() AND trx_query IS NULL"
            )
        return bool(cursor.fetchone()[0])


def worker_env(**overrides: str) -> dict[str, str]:
    """Return the environment of a worker process: this one's, with the test
    database, the test broker and ``DURABLE_DISPATCH=celery``; ``overrides`` last."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="testproject.settings",
        # An overriding DATABASE_URL is used as given (a SQLite file has no database_url form).
        DATABASE_URL=overrides.get("DATABASE_URL") or database_url(connection.settings_dict),
        CELERY_BROKER_URL=str(settings.CELERY_BROKER_URL),
        DURABLE_DISPATCH="celery",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(overrides)
    return env


def _children(pid: int) -> list[int]:
    """Return the PIDs of ``pid``'s direct children, from each process's
    ``/proc/<pid>/stat`` (its fourth field is the parent's PID)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)


@dataclass
class WorkerProcess:
    """One ``celery worker`` process (with its prefork children) and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_mark: bytes = READY_MARK

    @property
    def pid(self) -> int:
        """Return the main process's PID (also its process group id)."""
        return self.proc.pid

    def alive(self) -> bool:
        """Tell whether the main process is still running."""
        return self.proc.poll() is None

    def log(self) -> str:
        """Return the worker's log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def children(self) -> list[int]:
        """Return the PIDs of the worker's pool processes."""
        return _children(self.pid)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to the main process, by PID."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def exit_code(self, timeout: float = 60.0) -> int:
        """Wait at most ``timeout`` seconds for the main process to exit; return its code.
        A process still running then is asked for every thread's stack (SIGUSR1: Celery's
        and durable_worker's dump) and AssertionError is raised with its log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(f"{self.name} still running {timeout:.0f} s later; its log:\n{self.log()}") from None

    def pause(self, timeout: float = 60.0) -> None:
        """Stop the main process (SIGSTOP) at a moment it holds no database lock.

        A process stopped inside a write holds its lock for as long as it is
        stopped: on SQLite the database's one write lock (every other process
        then reads ``database is locked``), on PostgreSQL and MariaDB the rows
        it wrote. A paused container or a debugger stops a process at any
        instruction, but a test that means "silent, holding its lease" must
        not also mean "holding the database": this stops the process, and
        continues it and tries again (a bounded number of times, within
        ``timeout`` seconds) while ``database_in_use()`` says another session
        holds a lock. Raises AssertionError when no such moment comes."""
        deadline = time.monotonic() + timeout
        while True:
            self.kill(signal.SIGSTOP)
            time.sleep(0.01)  # the stop takes effect; a write in flight settles or stays open
            if not database_in_use():
                return
            self.kill(signal.SIGCONT)
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} held the database at every stop for {timeout:.0f} s")
            time.sleep(0.02)

    def kill_children(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to each pool process, by PID; return their PIDs."""
        pids = self.children()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until the worker logs that it is ready (``ready_mark``).

        Raises :class:`RuntimeError` (with the log) if it exits or times out.
        """
        deadline = time.monotonic() + timeout
        while not (self.log_path.exists() and self.ready_mark in self.log_path.read_bytes()):
            if not self.alive():
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} not ready within {timeout:.0f} s:\n{self.log()}")
            time.sleep(0.05)

    def stop(self, timeout: float = STOP_TIMEOUT, *, term: bool = True) -> None:
        """Warm-stop by PID (SIGTERM, unless ``term`` is false because it was
        sent already); SIGKILL the worker's process group if it lingers or left
        orphaned pool processes behind."""
        if term and self.alive():
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # The group is this worker's own (start_new_session): it holds only
        # the worker and its pool processes, e.g. children left by a SIGKILL.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)


@dataclass
class CeleryWorkers:
    """Starts and stops worker processes for one test; logs go to ``log_dir``."""

    log_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def start(
        self,
        count: int = 1,
        *,
        concurrency: int = 1,
        pool: str = "prefork",
        queues: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        wait: bool = True,
        app: str = "testproject",
        prefix: Sequence[str] = (),
        cwd: Path = REPO,
    ) -> list[WorkerProcess]:
        """Start ``count`` workers with ``concurrency`` pool processes each and
        wait until all are ready (unless ``wait`` is false).

        ``env`` defaults to :func:`worker_env`; ``queues`` is passed as ``-Q``;
        ``app`` is the Celery app (``-A``), another service's for a remote body.
        ``prefix`` is a command the worker runs under that execs it in place (so
        the PID stays the worker's), e.g. ``("ip", "netns", "exec", name)``.
        ``cwd``: the worker's directory, first on its ``sys.path`` (``python -m``
        puts it there): another release's source for a rolling deploy.
        """
        env = dict(env) if env is not None else worker_env()
        started = []
        for _ in range(count):
            name = f"w{len(self.workers)}-{os.getpid()}"
            log_path = self.log_dir / f"{name}.log"
            args = [
                *prefix, sys.executable, "-m", "celery", "-A", app, "worker",
                "--loglevel=INFO", f"--pool={pool}", f"--concurrency={concurrency}", "-n", f"{name}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ]  # fmt: skip
            if queues:
                args += ["-Q", queues]
            args += list(extra_args)
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            worker = WorkerProcess(name, proc, log_path)
            self.workers.append(worker)
            started.append(worker)
        if wait:
            for worker in started:
                worker.wait_ready()
        return started

    def start_beat(
        self, *, env: Mapping[str, str] | None = None, app: str = "testproject", wait: bool = True
    ) -> WorkerProcess:
        """Start one ``celery beat`` of ``app`` (its schedule file in ``log_dir``)
        and wait until it logs that it starts (unless ``wait`` is false); it is
        stopped with the workers."""
        env = dict(env) if env is not None else worker_env()
        name = f"beat{len(self.workers)}-{os.getpid()}"
        log_path = self.log_dir / f"{name}.log"
        args = [
            sys.executable, "-m", "celery", "-A", app, "beat", "--loglevel=INFO",
            "-s", str(self.log_dir / f"{name}-schedule"), "--max-interval", "1",
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        beat = WorkerProcess(name, proc, log_path, ready_mark=BEAT_READY_MARK)
        self.workers.append(beat)
        if wait:
            beat.wait_ready()
        return beat

    def stop(self) -> None:
        """Stop every worker (see :meth:`WorkerProcess.stop`)."""
        for worker in self.workers:
            if worker.alive():
                worker.kill(signal.SIGTERM)
        for worker in self.workers:
            worker.stop(term=False)

    def logs(self) -> str:
        """Return every worker's log, each under a header."""
        return "\n".join(f"--- {w.name} (pid {w.pid}) ---\n{w.log()}" for w in self.workers)


@pytest.fixture
def celery_workers(tmp_path: Path) -> Iterator[CeleryWorkers]:
    """Yield a :class:`CeleryWorkers`; every worker it started is stopped afterwards."""
    log_dir = tmp_path / "celery-workers"
    log_dir.mkdir()
    workers = CeleryWorkers(log_dir)
    try:
        yield workers
    finally:
        workers.stop()
