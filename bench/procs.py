"""Worker processes of the benchmark: Celery workers and beat, the dj-queue and procrastinate workers.

Every process is started in its own session with its output in the run's
log folder, and stopped by its PID (SIGTERM to its group, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@dataclass
class Proc:
    """A started worker process and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        """Tell whether the process is still running."""
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, wait ``timeout`` seconds, then SIGKILL it."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


def _processes() -> Iterator[tuple[int, list[str]]]:
    """Each live process's pid and the fields of its ``/proc/<pid>/stat`` after the command
    name (0: state, 1: ppid, 2: pgrp, 11 to 14: utime, stime, cutime, cstime). Linux only."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue


def _cpu_seconds(fields: list[str]) -> float:
    """A process's CPU seconds so far, user and system, with its reaped children's."""
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """The CPU seconds (user and system) used so far by process ``pid``, every thread of it,
    with the reaped children it has waited for."""
    return _cpu_seconds((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split())


def group_cpu_seconds(pgid: int) -> float:
    """The CPU seconds (user and system) used so far by the live processes of the process
    group ``pgid``, with the reaped children each of them has waited for."""
    return sum(_cpu_seconds(fields) for _pid, fields in _processes() if int(fields[2]) == pgid)


def children_cpu_seconds(pid: int) -> float:
    """The CPU seconds (user and system) used so far by ``pid`` and its live children
    (a PostgreSQL server's postmaster and its backends, each in a session of its own),
    with the reaped children each has waited for."""
    return sum(_cpu_seconds(fields) for other, fields in _processes() if pid in (other, int(fields[1])))


def parent_of(pid: int) -> int:
    """The parent process of ``pid`` (a PostgreSQL backend's: its server's postmaster)."""
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


class Procs:
    """Starts processes with the benchmark's environment; stops them all on exit."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.started: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], extra_env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` as ``name`` (its output goes to ``<log_dir>/<name>.log``)."""
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env={**self.env, **(extra_env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, process, log)
        self.started.append(proc)
        return proc

    def stop(self, procs: Sequence[Proc]) -> None:
        """Stop ``procs`` (in reverse order)."""
        for proc in reversed(list(procs)):
            proc.stop()
            if proc in self.started:
                self.started.remove(proc)

    def stop_all(self) -> None:
        """Stop every process still running."""
        self.stop(list(self.started))

    @contextlib.contextmanager
    def running(self) -> Iterator[Procs]:
        """Stop every started process when the block ends, whatever happens."""
        try:
            yield self
        finally:
            self.stop_all()


def celery_worker_argv(name: str, concurrency: int, pool: str) -> list[str]:
    """Return the command line of one Celery worker process (shared by the baseline and ours)."""
    return [
        str(VENV_BIN / "celery"),
        "-A",
        "bench.celery_app:app",
        "worker",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "-O",
        "fair",
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "WARNING",
    ]


TICK_LINE = re.compile(
    r"^\[(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/[\w-]+\] (?:"
    r"Task durable_singleton\.tick\[[0-9a-f-]+\] succeeded in (?P<took>[0-9.e-]+)s: (?P<result>-?\d+)"
    r"|durable tick by (?P<owner>\S+): \d+ turns dispatched in (?P<seconds>[0-9.]+) s)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class TickLine:
    """One tick a Celery worker's log reports: when it ended (seconds since
    the epoch, from the local time logged), how long it took (seconds), and
    who ran it (the tick thread's lease owner, ``celery:<host>:<pid>``, or
    ``"task"`` for beat's tick task)."""

    ended: float
    seconds: float
    owner: str


def tick_lines(log: str) -> list[TickLine]:
    """Return the ticks that ran in a Celery worker's ``log``: the lines of
    the tick thread of its main process (logger ``durable_singleton.tick`` at
    INFO) and of beat's tick task (worker at INFO), leaving out the tick
    tasks that did nothing because the tick's lease was held (result -1, O5)."""
    from datetime import datetime

    found = []
    for m in TICK_LINE.finditer(log):
        if m["result"] is not None and int(m["result"]) < 0:
            continue
        ended = datetime.strptime(m["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        found.append(TickLine(ended, float(m["took"] or m["seconds"]), m["owner"] or "task"))
    return found


def tick_times(*logs: str) -> list[float]:
    """Return the sorted end times of the ticks that ran in ``logs`` (see :func:`tick_lines`)."""
    return sorted(t.ended for log in logs for t in tick_lines(log))


def celery_beat_argv(schedule_file: Path) -> list[str]:
    """Return the command line of the Celery beat that sends the durable tick."""
    return [
        str(VENV_BIN / "celery"),
        "-A",
        "bench.celery_app:app",
        "beat",
        "-s",
        str(schedule_file),
        "--max-interval",
        "1",
        "-l",
        "WARNING",
    ]


def django_admin_argv(*args: str) -> list[str]:
    """Return a ``django-admin`` command line on the bench settings."""
    return [sys.executable, "-m", "django", *args]


def wait_until(check: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> float:
    """Poll ``check`` every ``every`` seconds until it is true; return the seconds waited.

    Raises :class:`TimeoutError` naming ``what`` after ``timeout`` seconds.
    """
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def durable_worker_argv(threads: int, tick_seconds: float) -> list[str]:
    """Return the command line of one ``manage.py durable_worker`` process (the embedded worker, no Celery)."""
    return django_admin_argv("durable_worker", "--threads", str(threads), "--tick-seconds", str(tick_seconds))
