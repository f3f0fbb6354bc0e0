"""The verdict of ``tools/test`` (issue #19 point 1): ``tools/summary.py``
reads the JUnit reports of real pytest runs, the soaks' ``summary.json`` and
the checks' exit statuses, prints one table, the failing tests by name, and
ends on the line a harness reads; it exits 1 iff anything failed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.celery_workers import REPO

pytestmark = pytest.mark.vendor_agnostic

sys.path.insert(0, str(REPO / "tools"))
try:
    import summary
finally:
    sys.path.pop(0)

#: The closing line a CI harness reads: "N passed, N failed" (", N skipped"), one word and a colon before.
VERDICT = re.compile(r"^\w+: \d+ passed, \d+ failed(, \d+ skipped)?$")

SAMPLE = """
import pytest

def test_passes():
    pass

def test_fails():
    assert sum([1, 1]) == 3, "this sample test fails on purpose"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_xfails():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_errors_in_setup(broken):
    pass

class TestGroup:
    @pytest.mark.parametrize("n", [1, 2])
    def test_param(self, n):
        assert n == 1
"""


def pytest_pass(tmp_path: Path, name: str, source: str = SAMPLE) -> dict[str, Any]:
    """Run a real pytest on ``source`` as tools/suites.sh runs a pass; return its results line.

    The sample needs no plugin: PYTEST_DISABLE_PLUGIN_AUTOLOAD keeps pytest from
    importing every installed one (Django, hypothesis, Playwright, ...), which took
    most of each run (27 s of 28 on a loaded machine)."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "test_sample.py").write_text(source)
    junit = folder / "report.xml"
    started = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django", str(folder),
         f"--junitxml={junit}", "-o", "junit_family=xunit1", "-c", os.devnull, f"--rootdir={folder}"],
        cwd=folder, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return {"kind": "pytest", "name": name, "rc": done.returncode, "ok_rcs": [0], "started": started,
            "seconds": 90.0, "junit": str(junit)}  # fmt: skip


def soak(tmp_path: Path, db: str, rc: int = 0, violations: int = 0) -> dict[str, Any]:
    started = time.time() - 1
    path = tmp_path / f"soak-{db}" / "summary.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"runs": 3210, "faults_total": 48, "violations_by_rule": {"S9": violations}}))
    return {"kind": "soak", "name": db, "rc": rc, "started": started, "seconds": 270.0, "summary": str(path)}


@pytest.fixture(scope="module")
def passes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Two real pytest runs, made once: the sample (every outcome) and an all-green one."""
    root = tmp_path_factory.mktemp("passes")
    return {
        "sample": pytest_pass(root, "sqlite"),
        "green": pytest_pass(root, "postgresql", "def test_a():\n    pass\n\ndef test_b():\n    pass\n"),
    }


def test_inherited_tests_of_two_classes_are_two_tests(tmp_path: Path) -> None:
    """A test inherited by two classes from a base in another file (the
    store conformance suite's shape) is two tests with two ids, not one: the
    first table counted 48 fewer tests than pytest did."""
    folder = tmp_path / "inherit"
    folder.mkdir()
    (folder / "base_checks.py").write_text("class Base:\n    def test_shared(self):\n        assert self.ok\n")
    entry = pytest_pass(
        tmp_path,
        "inherit",
        "from base_checks import Base\n\nclass TestA(Base):\n    ok = True\n\nclass TestB(Base):\n    ok = False\n",
    )
    counts = summary.read_junit(Path(entry["junit"]))
    assert (counts.passed, counts.failed) == (1, 1)
    assert counts.failing == ["test_sample.py::TestB::test_shared"]


def check(name: str, rc: int = 0) -> dict[str, Any]:
    return {"kind": "check", "name": name, "rc": rc, "started": time.time(), "seconds": 30.0}


def test_a_real_report_is_counted_and_its_failing_tests_named(
    tmp_path: Path, passes: dict[str, dict[str, Any]]
) -> None:
    """Passed, failed (a failure, a setup error, a strict xfail that passed
    is not here), skipped and xfailed are counted per test id, with the
    failing ones named as pytest names them."""
    entry = passes["sample"]
    counts = summary.read_junit(Path(entry["junit"]))
    assert (counts.passed, counts.failed, counts.skipped, counts.xfailed) == (2, 3, 1, 1)
    assert sorted(counts.failing) == [
        "test_sample.py::TestGroup::test_param[2]",
        "test_sample.py::test_errors_in_setup",
        "test_sample.py::test_fails",
    ]
    text, failures = summary.render([entry, check("ruff"), soak(tmp_path, "postgresql")])
    lines = text.splitlines()
    assert failures == 3
    assert lines[-1] == "total: 2 passed, 3 failed, 1 skipped"
    assert VERDICT.match(lines[-1])
    row = next(line for line in lines if line.startswith("sqlite "))
    assert row.split() == ["sqlite", "2", "3", "1", "1", "1.5", "FAILED", "(exit", "1)"]
    assert "  [sqlite] test_sample.py::test_fails" in lines
    soak_row = next(line for line in lines if line.startswith("chaos soak on postgresql"))
    assert soak_row.split()[-5:] == ["3,210", "48", "0", "4.5", "ok"]
    assert next(line for line in lines if line.startswith("ruff")).split() == ["ruff", "0.5", "ok"]


def test_all_green_exits_0_and_ends_on_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], passes: dict[str, dict[str, Any]]
) -> None:
    """Nothing failed: exit 0, and the last line is the plain verdict."""
    entry = passes["green"]
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(e) for e in [entry, check("mypy"), soak(tmp_path, "mariadb")]) + "\n")
    assert summary.main([str(results)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "total: 2 passed, 0 failed, 0 skipped"
    assert "failing tests" not in out and "other failures" not in out


@pytest.mark.parametrize(
    "bad",
    ["check", "soak exit", "soak violations", "soak stale", "no report", "exit without failure", "nothing ran"],
)
def test_anything_that_failed_counts_in_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], passes: dict[str, dict[str, Any]], bad: str
) -> None:
    """A failed check, a failed soak (its exit status; a summary.json older
    than the soak, left by an earlier run), a pass that wrote no report or
    exited non-zero with no failing test: each is one failure in the verdict
    and named under "other failures"; exit 1."""
    good = {**passes["green"], "name": "mariadb"}
    entries = [good]
    if bad == "check":
        entries.append(check("sphinx", rc=1))
    elif bad == "soak exit":
        entries.append(soak(tmp_path, "postgresql", rc=1))
    elif bad == "soak violations":
        entries.append(soak(tmp_path, "postgresql", rc=1, violations=2))
    elif bad == "soak stale":
        stale = soak(tmp_path, "postgresql")
        stale["started"] = time.time() + 60
        entries.append(stale)
    elif bad == "no report":
        entries.append({**good, "name": "sqlite", "junit": str(tmp_path / "missing.xml"), "rc": 2})
    elif bad == "exit without failure":
        entries.append({**good, "name": "sqlite", "rc": 3})
    else:
        entries = []
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert summary.main([str(results)]) == 1
    lines = capsys.readouterr().out.splitlines()
    passed = 0 if bad == "nothing ran" else 4 if bad == "exit without failure" else 2
    assert lines[-1] == f"total: {passed} passed, 1 failed, 0 skipped"
    assert VERDICT.match(lines[-1])
    if bad != "nothing ran":
        assert "other failures:" in lines
