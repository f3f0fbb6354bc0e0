"""The verdict of ``tools/test``: one table for every pass, soak and check.

``tools/suites.sh`` appends one JSON object a line to ``RESULTS`` (default
``artifacts/tests/results.jsonl``) for each thing it ran:

* ``{"kind": "pytest", "name": "postgresql", "rc": 0, "ok_rcs": [0],
  "started": 1764620000.0, "seconds": 312.4, "junit": "artifacts/tests/postgresql.xml"}``:
  a pytest pass and its JUnit report (``--junitxml``, ``junit_family=xunit1``);
* ``{"kind": "soak", "name": "postgresql", "rc": 0, "started": ..., "seconds": ...,
  "summary": "artifacts/soak-ci-postgresql/summary.json"}``: a chaos soak;
* ``{"kind": "check", "name": "ruff", "rc": 0, "started": ..., "seconds": ...}``:
  a check (ruff, mypy, sphinx) or a step that could not run (``rc`` not 0).

``python tools/summary.py [RESULTS]`` prints the passes (passed, failed,
skipped, xfailed, minutes), the soaks (runs, faults, violations, minutes),
the checks (ok or failed), the failing tests by name, and last a line that
harnesses read::

    total: 1234 passed, 0 failed, 56 skipped

``failed`` counts the failing tests (failures and errors) plus every other
thing that failed: a check, a soak, a pass that exited non-zero with no
failing test in its report or wrote no report. Exits 1 if that is not 0,
else 0. Standard library only.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PassCounts", "main", "read_junit", "render"]

DEFAULT_RESULTS = Path("artifacts/tests/results.jsonl")


@dataclass
class PassCounts:
    """Outcomes of one pytest pass, one per test id (the worst, if a test appears twice)."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    xfailed: int = 0
    failing: list[str] = field(default_factory=list)


_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2}


def _test_id(case: ElementTree.Element) -> str:
    """Return pytest's node id of a ``<testcase>``, from its ``classname``.

    ``classname`` is the dotted module path, then the classes: the longest
    prefix that is a file from the current directory is the module (a test
    inherited from a base class in another file has that other file as its
    ``file`` attribute, so ``file`` cannot tell two subclasses' tests apart);
    without such a file, the classes are the parts that start with a capital.
    """
    name = case.get("name", "?")
    parts = [part for part in case.get("classname", "").split(".") if part]
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if Path(path).is_file():
            return "::".join([path, *parts[cut:], name])
    cut = next((n for n, part in enumerate(parts) if part[:1].isupper()), len(parts))
    module = "/".join(parts[:cut]) + ".py" if cut else case.get("file", "")
    return "::".join(part for part in (module, *parts[cut:], name) if part)


def _outcome(case: ElementTree.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    skipped = case.find("skipped")
    if skipped is not None:
        return "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return "passed"


def read_junit(path: Path) -> PassCounts:
    """Count the outcomes in a pytest JUnit XML report.

    A test with a ``<failure>`` or ``<error>`` (a failed call, setup or
    teardown) is failed; ``<skipped type="pytest.xfail">`` is xfailed; another
    ``<skipped>`` is skipped; the rest passed. Raises ``OSError`` or
    ``ElementTree.ParseError`` for a missing or broken report.
    """
    worst: dict[str, str] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test_id, outcome = _test_id(case), _outcome(case)
        if _RANK[outcome] >= _RANK[worst.get(test_id, "passed")]:
            worst[test_id] = outcome
    counts = PassCounts()
    for test_id, outcome in worst.items():
        setattr(counts, outcome, getattr(counts, outcome) + 1)
        if outcome == "failed":
            counts.failing.append(test_id)
    return counts


def _minutes(entry: dict[str, Any]) -> str:
    return f"{float(entry.get('seconds', 0)) / 60:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _soak_figures(entry: dict[str, Any]) -> tuple[list[str], str | None]:
    """Return (runs, faults, violations) as text and why the summary is unusable, if it is."""
    path = Path(entry.get("summary", ""))
    try:
        if path.stat().st_mtime < float(entry.get("started", 0)):
            return ["—", "—", "—"], f"{path} is older than this soak (it wrote none)"
        summary = json.loads(path.read_text())
        violations = sum(summary.get("violations_by_rule", {}).values())
        return [f"{summary['runs']:,}", f"{summary['faults_total']:,}", str(violations)], None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return ["—", "—", "—"], f"no usable {path}: {exc}"


def render(entries: list[dict[str, Any]]) -> tuple[str, int]:
    """Return the summary text of ``entries`` (see the module) and the number of failures."""
    ordered = sorted(entries, key=lambda e: float(e.get("started", 0)))
    lines = ["", "=" * 30 + " summary " + "=" * 30]
    failing: list[str] = []
    other_failures: list[str] = []
    total = PassCounts()
    rows = []
    for entry in (e for e in ordered if e.get("kind") == "pytest"):
        name, rc = str(entry["name"]), int(entry.get("rc", 1))
        try:
            counts = read_junit(Path(entry.get("junit", "")))
        except (OSError, ElementTree.ParseError):
            rows.append([name, "—", "—", "—", "—", _minutes(entry), f"no report (exit {rc})"])
            other_failures.append(f"pytest on {name}: no JUnit report (exit {rc})")
            continue
        verdict = "ok" if not counts.failed and rc in entry.get("ok_rcs", [0]) else f"FAILED (exit {rc})"
        if not counts.failed and verdict != "ok":
            other_failures.append(f"pytest on {name}: exit {rc} with no failing test in its report")
        rows.append(
            [
                name,
                *(str(getattr(counts, k)) for k in ("passed", "failed", "skipped", "xfailed")),
                _minutes(entry),
                verdict,
            ]
        )
        for k in ("passed", "failed", "skipped", "xfailed"):
            setattr(total, k, getattr(total, k) + getattr(counts, k))
        failing += [f"[{name}] {test_id}" for test_id in counts.failing]
    if rows:
        lines += _table(["pytest pass", "passed", "failed", "skipped", "xfailed", "min", ""], rows)
    soaks = []
    for entry in (e for e in ordered if e.get("kind") == "soak"):
        figures, problem = _soak_figures(entry)
        ok = int(entry.get("rc", 1)) == 0 and problem is None
        soaks.append([f"chaos soak on {entry['name']}", *figures, _minutes(entry), "ok" if ok else "FAILED"])
        if not ok:
            other_failures.append(
                f"chaos soak on {entry['name']}: exit {entry.get('rc')}" + (f"; {problem}" if problem else "")
            )
    if soaks:
        lines += ["", *_table(["soak", "runs", "faults", "violations", "min", ""], soaks)]
    checks = []
    for entry in (e for e in ordered if e.get("kind") == "check"):
        ok = int(entry.get("rc", 1)) == 0
        checks.append([str(entry["name"]), _minutes(entry), "ok" if ok else "failed"])
        if not ok:
            other_failures.append(f"{entry['name']}: failed (exit {entry.get('rc')})")
    if checks:
        lines += ["", *_table(["check", "min", ""], checks)]
    if failing:
        lines += ["", f"failing tests ({len(failing)}):", *(f"  {f}" for f in failing)]
    if other_failures:
        lines += ["", "other failures:", *(f"  {f}" for f in other_failures)]
    if not entries:
        other_failures.append("nothing ran")
        lines += ["nothing ran: no results"]
    failures = total.failed + len(other_failures)
    lines += ["", f"total: {total.passed} passed, {failures} failed, {total.skipped} skipped"]
    return "\n".join(lines) + "\n", failures


def main(argv: list[str]) -> int:
    """Print the summary of the results file ``argv[0]`` (default ``artifacts/tests/results.jsonl``)."""
    path = Path(argv[0]) if argv else DEFAULT_RESULTS
    try:
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        print(f"summary: cannot read {path}: {exc}")
        entries = []
    text, failures = render(entries)
    sys.stdout.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
