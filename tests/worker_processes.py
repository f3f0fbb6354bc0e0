"""Real ``manage.py durable_worker`` (and ``runserver``) processes for tests.

``DurableWorkers.start()`` runs the command as a subprocess on a database URL
(the test database by default), waits until it prints that it is ready, and
``stop()`` ends it by PID (SIGTERM, then SIGKILL of its own process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from testproject.demo.live import database_url

from .celery_workers import REPO, WorkerProcess

__all__ = ["DurableWorkers", "start_at_once", "test_database_url", "wait_for", "workers"]


def test_database_url(settings_dict: Mapping[str, Any] | None = None) -> str:
    """Return a ``DATABASE_URL`` that opens the test database (SQLite file included)."""
    settings_dict = settings_dict or connection.settings_dict
    if settings_dict["ENGINE"].endswith("sqlite3"):
        name = str(settings_dict["NAME"])
        assert name and ":memory:" not in name and "mode=memory" not in name, "worker processes need a file"
        return f"sqlite:///{name}"
    return database_url(settings_dict)


test_database_url.__test__ = False  # type: ignore[attr-defined]  # not a test, despite its name


def wait_for(condition: Callable[[], Any], timeout: float, what: str, log: Callable[[], str] = str) -> Any:
    """Poll ``condition`` every 50 ms until it returns a true value; return it.

    Raises AssertionError naming ``what`` (with ``log()``) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s\n{log()}")
        time.sleep(0.05)


def start_at_once(tmp_path: Path, module: str, *args: str, processes: int = 4, timeout: float = 180.0) -> list[str]:
    """Run ``processes`` copies of ``python -m module GO_FILE args...`` on the test
    database and return each one's output, after every one has exited 0.

    Each copy is given the path of a go file as its first argument, prints
    ``ready`` when it has set up, and waits for the file; the file is written
    once every copy is ready, so their work starts at once. ``timeout`` (seconds)
    bounds the wait for ``ready`` and for each exit. Skips the test on an
    in-memory SQLite database; raises AssertionError (with the outputs) if a copy
    is not ready in time or exits non-zero.
    """
    if connection.vendor == "sqlite" and "memory" in str(connection.settings_dict["NAME"]):
        pytest.skip("processes need a database file or server")
    go = tmp_path / "go"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": test_database_url(),
        "DURABLE_DISPATCH": "worker",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    logs = [tmp_path / f"p{n}.log" for n in range(processes)]
    procs = []
    for log in logs:
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, str(go), *args],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        wait_for(lambda: all("ready" in log.read_text() for log in logs), timeout, "every process ready")
        go.write_text("go")
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0] * processes, texts
    return texts


def _default_signals() -> None:
    """In a started child, before its program: SIGINT and SIGTERM at their defaults."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class DurableWorkers:
    """Starts and stops ``durable_worker`` processes for one test; logs go to ``log_dir``."""

    log_dir: Path
    processes: list[WorkerProcess] = field(default_factory=list)
    started_at: dict[int, datetime] = field(default_factory=dict)

    def env(self, db_url: str | None = None, **overrides: str) -> dict[str, str]:
        """The environment of a worker: this one's, the test database, ``DISPATCH`` thread,
        a 2 s lease renewed every 0.5 s (so a killed holder is recovered quickly)."""
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="testproject.settings",
            DATABASE_URL=db_url or test_database_url(),
            DURABLE_DISPATCH="thread",
            DURABLE_LEASE_SECONDS="2",
            DURABLE_LEASE_RENEW_SECONDS="0.5",
            DURABLE_LOG_LEVEL="INFO",
            PYTHONDONTWRITEBYTECODE="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(overrides)
        return env

    def start(
        self,
        *,
        threads: int = 4,
        tick_seconds: float = 0.2,
        env: Mapping[str, str] | None = None,
        args: tuple[str, ...] = (),
        command: tuple[str, ...] = ("durable_worker",),
        wait: bool = True,
        argv: tuple[str, ...] = (),
    ) -> WorkerProcess:
        """Start one ``manage.py durable_worker`` (or ``manage.py COMMAND``, or
        ``python ARGV``) and wait until it says it is ready."""
        from django.utils import timezone

        name = f"dw{len(self.processes)}-{os.getpid()}"
        log_path = self.log_dir / f"{name}.log"
        if argv:
            full = [sys.executable, *argv]
        else:
            full = [sys.executable, "manage.py", *command]
            if command == ("durable_worker",):
                full += [f"--threads={threads}", f"--tick-seconds={tick_seconds}"]
        full += list(args)
        started = timezone.now()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                full,
                cwd=REPO,
                env=dict(env) if env is not None else self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # As from a shell: SIGINT and SIGTERM at their defaults. A child inherits an
                # ignored signal, and a library in this pytest process may have left SIGINT
                # ignored (CI: runserver never saw its Ctrl-C; this process's SIGINT was SIG_IGN).
                preexec_fn=_default_signals,
            )
        worker = WorkerProcess(name, proc, log_path)
        self.processes.append(worker)
        self.started_at[worker.pid] = started
        if wait:
            worker.wait_ready()
        return worker

    def stop(self) -> None:
        """Stop every process by PID (SIGTERM, then SIGKILL of its group)."""
        for worker in self.processes:
            if worker.alive():
                worker.kill(signal.SIGTERM)
        for worker in self.processes:
            worker.stop(term=False)

    def logs(self) -> str:
        """Return every process's log, each under a header."""
        return "\n".join(f"--- {w.name} (pid {w.pid}) ---\n{w.log()}" for w in self.processes)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[DurableWorkers]:
    """Yield a :class:`DurableWorkers` logging under ``tmp_path``; every process it started is stopped afterwards."""
    procs = DurableWorkers(tmp_path)
    try:
        yield procs
    finally:
        procs.stop()
