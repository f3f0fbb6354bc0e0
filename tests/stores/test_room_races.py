"""The rooms under real races (SQLite's raw statements, MariaDB's procedures, the ORM path
on PostgreSQL): several processes with engines of their own start, claim and settle runs
of one key with a limit of 2 on the test database (a SQLite file shared by the processes),
one of them killed with ``kill -9`` while it works, one with its own clock an hour ahead.

Checked: never more than 2 bodies of the key at once (S1, S9; a killed body counted until
its kill), every run completed exactly once (R6, D4), the fencing tokens of the key unique
and increasing in admission order (K1), no run left open (K4, S10: the killed process's
runs recovered by the others' ticks), and the skewed clock decides nothing (R5, R5a).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from durable_singleton.models import Run, SingletonKey
from durable_singleton.statuses import RunStatus

from ..celery_workers import REPO
from ..worker_processes import test_database_url, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _child(log: Path, count: int, skew: float) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "tests.stores.room_race_child", str(log), str(count), str(skew)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_racing_processes_never_pass_the_limit_and_run_each_run_once(tmp_path: Path) -> None:
    """S1, S9, K1, R5, R5a, R6, D4, K4: four processes of three threads each race on one key (limit 2), one killed
    with kill -9 mid-way, one with its clock an hour ahead; at most 2 bodies at once, every
    run completed once, the key's tokens unique and increasing with admission, none open."""
    log = tmp_path / "bodies.log"
    log.touch()
    children = [_child(log, 5, 3600.0 if n == 1 else 0.0) for n in range(4)]
    victim = children[3]
    wait_for(lambda: log.read_text().count("enter") >= 10, 120, "bodies running")
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(60)
    with open(f"{log}.lock", "a+") as lock:  # the bodies' lock: the kill in the log's order
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(log, "a") as record:
            record.write(f"kill - {victim.pid} -\n")
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs: list[str] = []
    for child in children:
        raw, _ = child.communicate(timeout=300)
        outputs.append(raw.decode(errors="replace"))
    for child, out in zip(children[:3], outputs[:3], strict=True):
        assert child.returncode == 0, out[-3000:]
    # The killed child's unstarted runs never existed; every run that did completes.
    wait_for(
        lambda: not Run.objects.filter(workflow_name="race").exclude(status=RunStatus.COMPLETED).exists(),
        60,
        "every run completed",
    )
    lines = [line.split() for line in log.read_text().splitlines()]
    inside: set[tuple[str, str]] = set()
    most = 0
    for kind, run_id, pid, _ in lines:
        if kind == "enter":
            inside.add((run_id, pid))
        elif kind == "exit":
            inside.discard((run_id, pid))
        else:  # the killed process's bodies end with it (S10)
            inside = {(r, p) for r, p in inside if p != pid}
        most = max(most, len(inside))
    assert most <= 2, f"{most} bodies at once for a limit of 2 (S1)"
    runs = list(Run.objects.filter(workflow_name="race"))
    exits: dict[str, list[int]] = {}
    for kind, run_id, pid, _ in lines:
        if kind == "exit":
            exits.setdefault(run_id, []).append(int(pid))
    assert len(runs) >= 45
    assert all(exits.get(r.run_id) for r in runs), "a run completed without its body (R6)"
    # A body the kill caught after its end may run again (D4); never twice elsewhere (R6).
    twice = {i: p for i, p in exits.items() if len([x for x in p if x != victim.pid]) > 1}
    assert not twice, f"run twice: {twice}"
    assert all(r.fencing_token is not None for r in runs), "a run completed without a token (K1)"
    by_token = sorted(runs, key=lambda r: r.fencing_token or 0)
    tokens = [r.fencing_token or 0 for r in by_token]
    assert len(set(tokens)) == len(tokens), tokens  # K1: unique
    # K1: increasing with admission. The grants of one transaction are stamped statement by
    # statement (the claimant's own admission last), so only admissions further apart than
    # one transaction's span are compared, and a recovered holder keeps its first admission's
    # time while its recovery may hand it the key's next token.
    span = timedelta(milliseconds=50)
    backwards = [
        (a.fencing_token, b.fencing_token)
        for i, a in enumerate(by_token)
        for b in by_token[i + 1 :]
        if a.admitted_at is not None
        and b.admitted_at is not None
        and a.admitted_at > b.admitted_at + span
        and not (a.recoveries or b.recoveries)
    ]
    assert not backwards, backwards
    counter = SingletonKey.objects.get(workflow_name="race", key="hot").last_token
    assert counter >= tokens[-1], (counter, tokens[-1])  # K1: never handed out again
