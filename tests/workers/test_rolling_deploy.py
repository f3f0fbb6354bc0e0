"""A rolling deploy: the older release and this one share keys (issue #31).

The older release is commit :data:`OLDER` of this repository (the release
before issue #31's work), extracted with ``git archive`` into the test's
folder. The test database is migrated by this release (the upgrade's first
step, docs/upgrading.rst); then the older release's code runs on the newer
schema beside this release's, as during a rolling upgrade:

- one Celery worker of each release (three pool processes each), each with
  its release's source first on ``sys.path`` and its own test project's
  Celery app and settings (plus the workflows of tests/rolling_app, which
  both releases register the same), on the same database and the same Redis
  broker; this release's worker runs the tick (its main process's tick
  thread), the older one has no tick of its own;
- one ``durable_worker`` of this release under ``DISPATCH = "worker"`` (it
  takes turns from the database, runs a tick too, and takes every queue):
  the pull deployment this release adds, sharing the keys with the older
  release's Celery worker;
- one client process per deployment (``python -m rolling_app.client``): the
  older release's and this release's under ``DISPATCH = "celery"``, this
  release's under ``DISPATCH = "worker"``, starting runs in turn on shared
  keys: a limit-1 key, a limit-2 key and a quota key of limit 2;
- per release, two more limit-1 keys whose turns go to that release's
  Celery queue: on ``pin-`` the holder settles in that release's worker
  while a waiter started by the other release's client waits behind it; on
  ``kill-`` the holder's body process is killed by ``kill -9``, with such a
  waiter too.

Every body logs its entry and exit (``BodyAudit``, with the deployment that
ran it). The test fails if more than ``limit`` bodies of a key run at once
(S1, X3; a killed body counts until its kill), if a run does not complete or
completes more than once (R6, D4), if a younger run of the limit-1 key enters
ahead of an older one (S5), if a killed holder is not re-entered (D4), if a
``pin-`` waiter is not admitted after the other release's holder settles
(S7), or if either release ran no body of a run the other one started.

Runs on PostgreSQL and MariaDB, and on SQLite (one file shared by the
processes, as tests/workers/test_worker_process.py does), with Redis as the broker.
It is skipped when commit :data:`OLDER` is not in the repository (a shallow
clone).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import pytest
from django.db import connection
from django.utils import timezone

from durable_singleton.admission import ACTIVE_STATUSES
from durable_singleton.models import Run
from testproject.demo.live import BodyRecord, overtakes
from testproject.inventory.models import BodyAudit
from tests.celery_workers import REPO, CeleryWorkers, WorkerProcess, celery_stack_missing, celery_workers, worker_env
from tests.worker_processes import DurableWorkers, test_database_url

__all__ = ["celery_workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

#: The older release: the last commit before issue #31's work.
OLDER = "1a27841"
RELEASES = ("old", "new")
#: The clients: each release's under DISPATCH "celery", and this release's
#: under DISPATCH "worker" ("pull"), whose turns a durable_worker takes.
CLIENTS = (*RELEASES, "pull")
RELEASE_OF = {"old": "old", "new": "new", "pull": "new"}
#: Runs each client starts on each shared key.
RUNS_PER_CLIENT = 6
BODY_SECONDS = 0.3
#: The "pin-" holders' body (seconds): their waiters start meanwhile.
PIN_SECONDS = 3.0
#: The killed holders' body (seconds), killed within its first second.
HOLD_SECONDS = 6.0
#: A short lease, so a killed holder's run is recovered within seconds (D4).
LEASE_SECONDS = "3"
#: (workflow, key, limit) of the shared keys, each started from both clients.
SHARED_KEYS = (
    ("rolling-one", "one", 1),
    ("rolling-two", "two", 2),
    ("rolling-quota", "quota", 2),
)
#: Every wait's bound, in seconds (a loaded 2-core machine).
BOUND = 120.0


def older_source(dest: Path) -> Path:
    """Extract the older release's ``durable_singleton`` and ``testproject`` into
    ``dest`` (``git archive``); skip the test when the commit is not here."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the older release comes from git, and {REPO} is not a git checkout here ({exc})")
    known = subprocess.run(["git", "-C", top, "cat-file", "-e", f"{OLDER}^{{commit}}"], capture_output=True)
    if known.returncode:
        pytest.skip(f"commit {OLDER} (the older release) is not in the repository at {top} (a shallow clone?)")
    archive = subprocess.run(
        ["git", "-C", top, "archive", "--format=tar", OLDER, "durable_singleton", "testproject"],
        capture_output=True,
        check=True,
    ).stdout
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


class Client:
    """One release's ``rolling_app.client`` process: starts runs on request."""

    def __init__(self, release: str, source: Path, env: dict[str, str], log_path: Path) -> None:
        self.release = release
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rolling_app.client"],
                cwd=source,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: TextIO) -> None:
        for line in out:
            self.lines.put(line.strip())

    def answer(self) -> str:
        """Return the client's next line; fail after :data:`BOUND` seconds."""
        try:
            return self.lines.get(timeout=BOUND)
        except queue.Empty:
            raise AssertionError(f"client {self.release}: no answer within {BOUND:.0f} s\n{self.log()}") from None

    def send(self, workflow: str, run_id: str, payload: dict[str, Any]) -> None:
        """Ask for one start (its answer is read by :meth:`answer`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{workflow} {run_id} {json.dumps(payload)}\n")
        self.proc.stdin.flush()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """End its input, then stop it by PID if it lingers."""
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)


@dataclass
class Deploy:
    """The processes of both releases, and what the test started."""

    workers: dict[str, WorkerProcess]
    clients: dict[str, Client]
    celery: CeleryWorkers
    #: run id -> (starting release, key, limit)
    runs: dict[str, tuple[str, str, int]] = field(default_factory=dict)

    def start(self, pairs: list[tuple[str, str, str, int, dict[str, Any]]]) -> None:
        """Send each (release, workflow, key, limit, input) start to its client,
        all at once, then check every answer."""
        sent = []
        for release, workflow, key, limit, payload in pairs:
            run_id = f"rd-{release}-{workflow}-{len(self.runs):03d}"
            self.runs[run_id] = (release, key, limit)
            self.clients[release].send(workflow, run_id, {"key": key, **payload})
            sent.append((release, run_id))
        for release, run_id in sent:
            answer = self.clients[release].answer()
            assert answer == f"ok {run_id}", f"client {release}: {answer}\n{self.clients[release].log()}"

    def logs(self) -> str:
        clients = "\n".join(f"--- client {c.release} ---\n{c.log()}" for c in self.clients.values())
        pull = self.workers["pull"]
        return f"{self.celery.logs()}\n--- durable_worker (pid {pull.pid}) ---\n{pull.log()}\n{clients}"


def _wait(deploy: Deploy, what: str, condition: Any, detail: Any = str) -> Any:
    """Poll ``condition`` until true (return it); fail after :data:`BOUND`
    seconds with ``detail()`` and the logs, or as soon as a worker exits."""
    deadline = time.monotonic() + BOUND
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {BOUND:.0f} s: {detail()}\n{deploy.logs()}"
        dead = [r for r, w in deploy.workers.items() if not w.alive()]
        assert not dead, f"the worker of release {dead} exited\n{deploy.logs()}"
        time.sleep(0.1)
    return value


def _dead(pid: int) -> bool:
    """Tell whether process ``pid`` is gone or a zombie (killed, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in {"Z", "X"}
    except (OSError, IndexError):
        return True


def _entries(run_id: str) -> list[BodyAudit]:
    return list(BodyAudit.objects.filter(run_id__startswith=f"{run_id}#").order_by("entered_at"))


@pytest.fixture
def deploy(tmp_path: Path, celery_workers: CeleryWorkers) -> Iterator[Deploy]:
    """The older release's source, both releases' workers and clients, on the
    test database (migrated by this release) and the test broker."""
    if reason := celery_stack_missing(("postgresql", "mysql", "sqlite")):
        pytest.skip(reason)
    sources = {"old": older_source(tmp_path / "older"), "new": REPO, "pull": REPO}
    shared = tmp_path / "shared"
    shutil.copytree(Path(__file__).parent.parent / "rolling_app", shared / "rolling_app")
    db_url = test_database_url(connection.settings_dict)
    envs = {
        release: worker_env(
            PYTHONPATH=os.pathsep.join([str(sources[release]), str(shared)]),
            DJANGO_SETTINGS_MODULE="rolling_app.settings",
            DATABASE_URL=db_url,
            ROLLING_RELEASE=release,
            ROLLING_SOURCE=str(sources[release]),
            DURABLE_LEASE_SECONDS=LEASE_SECONDS,
            DURABLE_LEASE_RENEW_SECONDS="1",
            DURABLE_DISPATCH="worker" if release == "pull" else "celery",
        )
        for release in CLIENTS
    }
    workers = {
        release: celery_workers.start(
            1,
            concurrency=3,
            env=envs[release],
            queues=f"celery,rolling-{release}",
            cwd=sources[release],
            wait=False,
            extra_args=("--disable-prefetch",),
        )[0]
        for release in RELEASES
    }
    pull = DurableWorkers(tmp_path)
    workers["pull"] = pull.start(threads=3, env=envs["pull"], wait=False)
    clients = {
        release: Client(release, sources[release], envs[release], tmp_path / f"client-{release}.log")
        for release in CLIENTS
    }
    try:
        for worker in workers.values():
            worker.wait_ready()
        for client in clients.values():
            ready = client.answer()
            assert ready == "ready", f"client {client.release}: {ready}\n{client.log()}"
        yield Deploy(workers, clients, celery_workers)
    finally:
        for client in clients.values():
            client.stop()
        pull.stop()


def test_two_releases_share_keys_without_overlap_and_hand_off_both_ways(deploy: Deploy) -> None:
    """The rolling-upgrade promise (docs/upgrading.rst): the older release's
    workers and clients and this release's, on one database migrated by this
    release and one broker, never run more than ``limit`` bodies of a key at
    once (S1, S12; X3 for the quota key), complete every run exactly once (R6,
    D4), admit a limit-1 key's runs oldest first whoever started them (S5),
    recover a holder killed by ``kill -9`` in either release (D4, R5), and
    admit a waiter started by one release by the other release's handoff
    (S7); this release's ``durable_worker`` (``DISPATCH = "worker"``) shares
    the keys with the older release's Celery worker."""
    other = {"old": "new", "new": "old"}
    # Two keys per release whose turns go to that release's workers only (their
    # workflow's queue): on "pin-" the holder settles there, on "kill-" its body
    # process is killed. Each holder is started by that release's client.
    holders: dict[tuple[str, str], str] = {}
    for release in RELEASES:
        for kind, payload in (
            ("pin", {"seconds": PIN_SECONDS}),
            ("kill", {"seconds": HOLD_SECONDS, "seconds_after_recovery": BODY_SECONDS}),
        ):
            deploy.start([(release, f"rolling-on-{release}", f"{kind}-{release}", 1, payload)])
            holders[kind, release] = next(reversed(deploy.runs))
    entered = {
        place: _wait(deploy, f"the holder of {place} entered", lambda r=run_id: _entries(r))[0]
        for place, run_id in holders.items()
    }
    # A waiter on each of these keys, started by the other release's client.
    waiters: dict[tuple[str, str], str] = {}
    for kind, release in holders:
        deploy.start([(other[release], f"rolling-on-{release}", f"{kind}-{release}", 1, {"seconds": BODY_SECONDS})])
        waiters[kind, release] = next(reversed(deploy.runs))
    for (_, release), entry in entered.items():
        assert entry.workflow_name == release, f"{entry.run_id} ran in {entry.workflow_name}, not {release}"
        assert entry.pid in deploy.workers[release].children(), f"pid {entry.pid} is not a pool process of {release}"
    # kill -9 each "kill-" holder's body process: one pool process of each release.
    killed: dict[int, datetime] = {}
    for release in RELEASES:
        os.kill(entered["kill", release].pid, signal.SIGKILL)
    for release in RELEASES:
        pid = entered["kill", release].pid
        _wait(deploy, f"pid {pid} dead", lambda pid=pid: _dead(pid))
        killed[pid] = timezone.now()  # the killed body's interval ends no later than this

    # The shared keys: both clients start runs at once, alternately.
    for _ in range(RUNS_PER_CLIENT):
        for workflow, key, limit in SHARED_KEYS:
            deploy.start([(release, workflow, key, limit, {"seconds": BODY_SECONDS}) for release in CLIENTS])

    active = Run.objects.filter(run_id__in=list(deploy.runs), status__in=ACTIVE_STATUSES)
    _wait(
        deploy,
        "every run settled",
        lambda: not active.exists(),
        lambda: f"still active: {list(active.values_list('run_id', 'status', 'singleton_slot', 'park_reason'))}",
    )

    rows = {r["run_id"]: r for r in Run.objects.filter(run_id__in=list(deploy.runs)).values()}
    unfinished = {run_id: (row["status"], row["error"]) for run_id, row in rows.items() if row["status"] != "completed"}
    assert not unfinished, f"runs not completed: {unfinished}\n{deploy.logs()}"
    assert len(rows) == len(deploy.runs)

    # Exactly once: one completed body per run; an entry without an exit only for a killed process.
    audits = list(BodyAudit.objects.filter(run_id__startswith="rd-").order_by("entered_at"))
    by_run: dict[str, list[BodyAudit]] = {}
    for row in audits:
        by_run.setdefault(row.run_id.split("#")[0], []).append(row)
    assert set(by_run) == set(deploy.runs), f"bodies of unknown runs: {set(by_run) - set(deploy.runs)}"
    for run_id, rows_of_run in by_run.items():
        done = [r for r in rows_of_run if r.exited_at is not None]
        cut = [r for r in rows_of_run if r.exited_at is None]
        assert len(done) == 1, f"{run_id}: {len(done)} completed bodies: {[(r.run_id, r.pid) for r in done]}"
        assert all(r.pid in killed for r in cut), f"{run_id}: a body without an exit was not killed: {cut}"

    # S1: per key, never more than its limit of bodies at once (a killed body until its kill).
    limits = {key: limit for _, key, limit in deploy.runs.values()}
    for key, limit in limits.items():
        events: list[tuple[datetime, int]] = []
        for row in audits:
            if row.key == key:
                events.append((row.entered_at, 1))
                events.append((row.exited_at or killed[row.pid], -1))
        current = peak = 0
        for _, delta in sorted(events):
            current += delta
            peak = max(peak, current)
        assert peak <= limit, f"key {key}: {peak} bodies at once, limit {limit} (S1)\n{_timeline(audits, key)}"

    # S5: a limit-1 key's runs enter in creation order, whichever release started them.
    records = [
        BodyRecord(
            run_id=run_id,
            key="one",
            created_at=rows[run_id]["created_at"],
            status="completed",
            entered_at=by_run[run_id][0].entered_at,
        )
        for run_id, (_, key, _) in deploy.runs.items()
        if key == "one"
    ]
    assert overtakes(records) == 0, f"a younger run of key one entered first (S5)\n{_timeline(audits, 'one')}"

    # The killed holders were recovered and re-entered once (D4); on each
    # "pin-" key the holder settled in its release's worker and the waiter,
    # started by the other release and parked behind it, entered after it
    # exited on a later claim than its first: the holder's settle granted it (S7).
    for release in RELEASES:
        killed_holder = by_run[holders["kill", release]]
        assert len(killed_holder) == 2, (
            f"kill-{release}: holder not re-entered once\n{_timeline(audits, f'kill-{release}')}"
        )
        (holder,) = by_run[holders["pin", release]]
        (waiter,) = [r for r in by_run[waiters["pin", release]] if r.exited_at]
        timeline = _timeline(audits, f"pin-{release}")
        assert holder.workflow_name == release and holder.exited_at is not None, timeline
        assert waiter.entered_at >= holder.exited_at and not waiter.run_id.endswith("#1"), timeline

    # Each release ran bodies of runs the other release started, on any key:
    # the "pin-" waiters cross by construction (their holder's settle in one
    # release admits a waiter the other started), the shared keys as the
    # workers' turns fall (on a shared key the durable_worker, which takes
    # every queue, may take all of this release's runs before the older
    # worker sees one, so the shared keys alone do not cross both ways in
    # every run). The durable_worker ran bodies, and the shared keys ran in more
    # than one deployment (which of the shared keys' turns the durable_worker takes
    # is the machine's timing: under load the Celery workers took every one).
    crossed = Counter((deploy.runs[row.run_id.split("#")[0]][0], row.workflow_name) for row in audits)
    shared = Counter(
        (deploy.runs[row.run_id.split("#")[0]][0], row.workflow_name)
        for row in audits
        if row.key in {key for _, key, _ in SHARED_KEYS}
    )
    print(
        f"(started by, ran in): bodies {dict(sorted(crossed.items()))}, on shared keys {dict(sorted(shared.items()))}"
    )
    releases = {(RELEASE_OF[started], RELEASE_OF[ran]) for started, ran in crossed}
    assert {("old", "new"), ("new", "old")} <= releases, f"(started by, ran in): bodies {crossed}"
    assert any(ran == "pull" for _, ran in crossed), f"the durable_worker ran no body: {crossed}"
    assert len({ran for _, ran in shared}) > 1, f"the shared keys ran in one deployment only: {shared}"


def _timeline(audits: list[BodyAudit], key: str) -> str:
    return "\n".join(
        f"  {row.run_id} in {row.workflow_name} (pid {row.pid}): {row.entered_at:%H:%M:%S.%f} .. "
        f"{row.exited_at:%H:%M:%S.%f}"
        if row.exited_at
        else f"  {row.run_id} in {row.workflow_name} (pid {row.pid}): {row.entered_at:%H:%M:%S.%f} .. killed"
        for row in audits
        if row.key == key
    )
