"""The live demo (``manage.py durable_demo``) and the verdict it prints."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dj_database_url
import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings

import durable_singleton
from durable_singleton.definitions import Registry, Singleton
from durable_singleton.models import Run
from testproject.demo.live import (
    BodyRecord,
    Lane,
    database_url,
    handoffs,
    judge,
    lane_line,
    peak_concurrency,
    records_from_rows,
    render_lanes,
    with_limit,
)
from testproject.inventory.models import BodyAudit
from tests.celery_workers import REPO, celery_stack_missing
from tests.worker_processes import test_database_url

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DEMO = "demo-sync-inventory"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def body(run_id: str, created: float, entered: float | None, exited: float | None, **kw: str) -> BodyRecord:
    """A run of key ``store:A`` created, entered and exited at these offsets in seconds."""
    return BodyRecord(
        run_id=run_id,
        key=kw.get("key", "store:A"),
        created_at=at(created),
        status=kw.get("status", "completed"),
        entered_at=at(entered) if entered is not None else None,
        exited_at=at(exited) if exited is not None else None,
    )


# -- the verdict, fed by hand ------------------------------------------------------
def test_back_to_back_bodies_in_creation_order_pass() -> None:
    """One body after the other, oldest first, all completed: PASS (S5, S9)."""
    verdict = judge([body("A1", 0, 0, 1), body("A2", 0.1, 1, 2), body("A3", 0.2, 2.01, 3)], {"store:A": 1})
    assert verdict.ok, verdict.problems
    (key,) = verdict.keys
    assert key.peak == 1
    assert key.admission_order == key.creation_order == ["A1", "A2", "A3"]
    assert key.handoffs == pytest.approx([0.0, 0.01])
    assert verdict.lines()[-1].startswith("PASS")


def test_overlapping_bodies_fail_the_verdict() -> None:
    """Two bodies of one limit-1 key inside their intervals at once: FAIL (S9)."""
    verdict = judge([body("A1", 0, 0, 1), body("A2", 0.1, 0.5, 1.5)], {"store:A": 1})
    assert not verdict.ok
    assert verdict.keys[0].peak == 2
    assert verdict.problems == ["store:A: 2 bodies at once, limit 1"]
    assert verdict.lines()[-1].startswith("FAIL: store:A: 2 bodies at once")


def test_overlap_within_the_limit_passes_and_beyond_it_fails() -> None:
    """Limit 2: two bodies at once pass, three fail (S9)."""
    two = [body("A1", 0, 0, 1), body("A2", 0.1, 0.2, 1.2), body("A3", 0.2, 1.1, 2)]
    assert judge(two, {"store:A": 2}).ok
    three = [body("A1", 0, 0, 1), body("A2", 0.1, 0.2, 1.2), body("A3", 0.2, 0.3, 2)]
    verdict = judge(three, {"store:A": 2})
    assert verdict.problems == ["store:A: 3 bodies at once, limit 2"]


def test_a_younger_run_entering_first_fails_limit_one() -> None:
    """Limit 1: a younger run admitted before an older waiter breaks FIFO
    even without overlap (S5 step 3)."""
    verdict = judge([body("A1", 0, 1, 2), body("A2", 0.1, 0, 1)], {"store:A": 1})
    assert not verdict.ok
    assert verdict.keys[0].admission_order == ["A2", "A1"]
    assert "admitted ahead of 1 older waiting run(s)" in verdict.problems[0]


def test_limit_two_allows_one_older_admitted_run_to_enter_a_moment_later() -> None:
    """Limit 2: two runs admitted together may enter in either order; a run
    entering ahead of two older ones was admitted while an older one waited."""
    swapped = [body("A1", 0, 0.01, 1), body("A2", 0.1, 0, 1), body("A3", 0.2, 1, 2)]
    assert judge(swapped, {"store:A": 2}).ok
    jumped = [body("A1", 0, 1, 2), body("A2", 0.1, 1.1, 2), body("A3", 0.2, 0, 0.5)]
    verdict = judge(jumped, {"store:A": 2})
    assert "admitted ahead of 2 older waiting run(s)" in verdict.problems[0]


def test_unfinished_runs_and_missing_audits_fail() -> None:
    """A run that is not completed, or whose body never exited, fails the verdict."""
    verdict = judge([body("A1", 0, 0, 1), body("A2", 0.1, 1, None, status="suspended")], {"store:A": 1})
    assert verdict.problems == [
        "store:A: 1 run(s) not completed: A2",
        "store:A: 1 body audit(s) missing an entry or exit",
    ]
    assert not judge([], {"store:A": 1}).ok


def test_a_body_that_never_exited_counts_as_running_to_the_end() -> None:
    assert peak_concurrency([body("A1", 0, 0, None), body("A2", 0.1, 5, 6)]) == 2
    assert handoffs([body("A1", 0, 0, None), body("A2", 0.1, 5, 6)]) == []


def test_records_join_run_rows_with_audit_rows() -> None:
    runs = [
        {"run_id": "r1", "singleton_key": "store:A", "created_at": at(0), "status": "completed", "attempts": 2},
        {"run_id": "r2", "singleton_key": "store:B", "created_at": at(1), "status": "pending", "attempts": 0},
    ]
    audits = [{"run_id": "r1", "entered_at": at(2), "exited_at": at(3)}]
    r1, r2 = records_from_rows(runs, audits)
    assert (r1.key, r1.entered_at, r1.exited_at, r1.turns) == ("store:A", at(2), at(3), 2)
    assert (r2.key, r2.entered_at, r2.status) == ("store:B", None, "pending")


def test_with_limit_returns_a_variant_and_leaves_the_registry_alone() -> None:
    base = Registry()
    base.add("wf", "1", lambda ctx, i: None, singleton=Singleton(key=lambda i: "k", limit=1))
    variant = with_limit(base, "wf", 3)
    assert variant.get("wf").singleton.limit == 3  # type: ignore[union-attr]
    assert base.get("wf").singleton.limit == 1  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="no singleton workflow named 'other'"):
        with_limit(base, "other", 2)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        with_limit(base, "wf", 0)


def test_database_url_reaches_the_same_database() -> None:
    """Worker processes get a DATABASE_URL that parses back to the same settings."""
    entry = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "test_durable",
        "USER": "durable",
        "PASSWORD": "p@ss/w:rd",
        "HOST": "127.0.0.1",
        "PORT": 5433,
    }
    parsed = dj_database_url.parse(database_url(entry))
    assert {k: parsed[k] for k in ("NAME", "USER", "PASSWORD", "HOST")} == {
        k: entry[k] for k in ("NAME", "USER", "PASSWORD", "HOST")
    }
    assert int(parsed["PORT"]) == 5433
    assert parsed["ENGINE"] == entry["ENGINE"]
    with pytest.raises(ValueError):
        database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "x"})


# -- the command, on real runs ---------------------------------------------------
def demo(*args: str) -> str:
    out = io.StringIO()
    try:
        call_command("durable_demo", "--duration", "0.1", "--timeout", "60", *args, stdout=out)
    finally:
        print(out.getvalue())
    return out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_demo_passes_with_a_verdict_computed_from_the_stored_runs() -> None:
    """The embedded demo on the configured database: a burst of 4 on store:A,
    one run on B and C, one slot each. The printed verdict is PASS and agrees
    with a verdict recomputed here from the rows the bodies wrote (S5, S7, S9)."""
    text = demo("--mode", "embedded", "--burst", "4", "--runs-per-key", "1")

    runs = Run.objects.filter(workflow_name=DEMO)
    assert runs.count() == 6
    assert set(runs.values_list("status", flat=True)) == {"completed"}
    audits = BodyAudit.objects.filter(workflow_name=DEMO)
    assert audits.count() == 6 and not audits.filter(exited_at=None).exists()
    verdict = judge(
        records_from_rows(
            runs.values("run_id", "singleton_key", "created_at", "status", "attempts"),
            audits.values("run_id", "entered_at", "exited_at"),
        ),
        dict.fromkeys(("store:A", "store:B", "store:C"), 1),
    )
    assert verdict.ok, verdict.problems
    a = verdict.keys[0]
    assert (a.key, a.runs, a.peak) == ("store:A", 4, 1)
    assert a.admission_order == a.creation_order
    assert "store:A: limit 1, 4/4 completed, at most 1 body at once" in text
    assert "entered A1 A2 A3 A4: creation order" in text
    assert text.rstrip().splitlines()[-1].startswith("PASS: never more bodies than the limit per key")


@pytest.mark.django_db(transaction=True)
def test_piped_demo_prints_each_change_of_a_lane_as_a_line() -> None:
    """Issue #19 item 5: off a terminal (a pipe, a log, here a StringIO) the demo prints one line
    per change of a lane, not only the last frame: the burst's holders follow one another in
    creation order (S5, S7), each line shows who holds and who waits, and no line is longer
    than 80 characters."""
    text = demo("--mode", "embedded", "--burst", "4", "--runs-per-key", "1", "--duration", "0.3")
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    a = [line for line in lines if re.match(r"\s*\d+\.\d s store:A ", line)]
    holders = [m[1] for line in a if (m := re.search(r"holding (A\d)", line))]
    # A lane's line is printed again when only its done count changes under the same holder.
    holders = [h for i, h in enumerate(holders) if i == 0 or holders[i - 1] != h]
    assert holders == sorted(set(holders), key=holders.index), "each holder appears once, in turn"
    assert holders == ["A1", "A2", "A3", "A4"], a
    # The first line names every later run as not holding: waiting for its key, or (under load,
    # when the first snapshot comes after a turn was queued) ready, waiting for a worker.
    first = re.search(r"holding (\S+), (.*), done", a[0])
    assert first is not None and first[1] in ("-", "A1"), a
    assert re.fullmatch(r"(ready|waiting) A\d( A\d)*(, (ready|waiting) A\d( A\d)*)*", first[2]), a
    assert all(f"A{n}" in first[2] for n in (2, 3, 4)), a
    assert re.search(r"store:A 0/1 holding -, done 4$", a[-1]), a
    assert any(re.match(r"\s*\d+\.\d s store:B 1/1 holding B1", line) for line in lines), lines
    assert "┏" not in text, "no table drawn off a terminal"


def test_lanes_fit_an_80_column_console() -> None:
    """Issue #19 item 5: at 80 columns the lanes table keeps every column, the done count of each
    key included, wrapping the waiters instead of cutting them; a lane line stays within its width
    and counts the waiters it cannot name."""
    from rich.console import Console

    waiters = [f"run-{n:03d}" for n in range(30)]
    lanes = [
        Lane("store:north-east", 1, ["run-100"], waiters, completed=12, other_terminal=1),
        Lane("store:B", 1, ["B1"], [], completed=3, other_terminal=0),
    ]
    console = Console(width=80, record=True, file=io.StringIO(), emoji=False, highlight=False)
    console.print(render_lanes(lanes, title="burst of 30 on store:north-east", caption="1.0 s"))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "done" in text and "12 (+1" in text and re.search(r"│ store:B +│ +1/1 │ B1 .*│ +3 │", text), text
    assert all(w in text for w in waiters), "every waiter is shown, wrapped"
    line = lane_line(lanes[0], width=100)
    assert len(line) <= 100 and line.startswith("store:north-east 1/1 holding run-100, waiting run-000 "), line
    assert re.search(r" run-00\d \+2\d, done 12 \(\+1 not completed\)$", line), line
    assert lane_line(lanes[0], width=60).endswith("holding run-100, waiting +30, done 12 (+1 not completed)")
    assert lane_line(lanes[1]) == "store:B 1/1 holding B1, done 3"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_demo_in_an_80_column_terminal() -> None:
    """Issue #19 item 5: ``manage.py durable_demo`` in a real terminal 80 columns wide (a pty)
    redraws a table that fits it, every column shown, and ends on PASS."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "DURABLE_DISPATCH": "thread",
        "TERM": "xterm-256color",
        "COLUMNS": "",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("COLUMNS")
    command = [sys.executable, "manage.py", "durable_demo", "--mode", "embedded", "--burst", "4"]
    proc = subprocess.Popen(
        [*command, "--runs-per-key", "1", "--duration", "0.3", "--timeout", "90"],
        cwd=REPO,
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        start_new_session=True,
    )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 150
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the command exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    # What the terminal shows, line by line: a cursor movement or an erase ends a line, colours go.
    raw = b"".join(chunks).decode(errors="replace")
    screen = re.sub(r"\x1b\[[0-9;?]*[ABCDEFGHJK]", "\n", raw.replace("\r", "\n"))
    screen = re.sub(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07)", "", screen)
    lines = [line for line in screen.splitlines() if line.strip()]
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert any("┃ key" in line and line.rstrip().endswith("┃ done ┃") for line in lines), screen
    assert any(re.search(r"│ store:A │ +\d/1 │.*│ +\d │$", line) for line in lines), screen
    assert lines[-1].startswith("PASS") or any(line.startswith("PASS") for line in lines[-3:]), screen


@pytest.mark.django_db(transaction=True)
def test_demo_limit_reaches_the_runs_it_starts() -> None:
    """--limit 2 starts runs whose stored limit is 2, and the verdict judges against 2."""
    text = demo("--mode", "embedded", "--limit", "2", "--burst", "5", "--runs-per-key", "1", "--workers", "3")
    assert set(Run.objects.filter(workflow_name=DEMO).values_list("singleton_limit", flat=True)) == {2}
    assert "store:A: limit 2, 5/5 completed" in text
    assert "PASS" in text


@pytest.mark.django_db(transaction=True)
def test_demo_fails_when_its_runs_do_not_finish() -> None:
    """A timeout shorter than the bodies leaves runs unfinished: FAIL and a non-zero exit."""
    with pytest.raises(CommandError, match="verdict is FAIL"):
        demo("--mode", "embedded", "--burst", "3", "--runs-per-key", "0", "--duration", "1.0", "--timeout", "0.2")
    assert Run.objects.filter(workflow_name=DEMO).exclude(status="completed").exists()


@pytest.mark.django_db
def test_distributed_mode_is_refused_without_a_redis_broker() -> None:
    with override_settings(CELERY_BROKER_URL="memory://"), pytest.raises(CommandError, match="distributed mode needs"):
        call_command("durable_demo", "--mode", "distributed", stdout=io.StringIO())


@pytest.mark.celery
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_distributed_demo_runs_bodies_in_separate_worker_processes() -> None:
    """Distributed mode: the command starts two Celery worker processes on the
    test database and broker, and the verdict passes on what they stored (S9)."""
    if reason := celery_stack_missing():
        pytest.skip(reason)
    text = demo("--mode", "distributed", "--workers", "2", "--burst", "4", "--runs-per-key", "1", "--duration", "0.2")
    assert "2 Celery workers" in text
    assert "PASS" in text
    pids = set(BodyAudit.objects.filter(workflow_name=DEMO).values_list("pid", flat=True))
    assert pids and os.getpid() not in pids


def test_demo_command_belongs_to_the_test_project_not_the_installed_app() -> None:
    """Users' projects do not list ``durable_demo``: it ships in ``testproject.demo`` only."""
    from django.core.management import get_commands

    assert get_commands()["durable_demo"] == "testproject.demo"
    assert not (Path(durable_singleton.__file__).parent / "management" / "commands" / "durable_demo.py").exists()
