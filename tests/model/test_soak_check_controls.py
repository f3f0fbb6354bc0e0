"""The soak's checker judges the flow controls of issue #33 (soak/check.py): throttles
(X6), priority inside a key (X8) and debounces (X7).

Each rule of the ``controls`` feature is shown to fire on a small hand-written
history that breaks it, and to stay quiet on the same history without the break.
Files only: no database, no workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from soak.check import DEBOUNCE_MAX_SECONDS, DEBOUNCE_SECONDS, THROTTLE_OF, check, render
from tests.model.soak_history import write_history

pytestmark = pytest.mark.vendor_agnostic

T0 = 1_800_000_000.0
RATE = "soak-rate"


def _run(run_id: str, created: float, *, wf: str, key: str | None = None, admitted: float | None = None,
         token: int | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"run_id": run_id, "workflow_name": wf, "singleton_key": key, "status": "completed", "error": None,
            "created_at": T0 + created, "parent_run_id": None, "recoveries": 0, "fencing_token": token,
            "admitted_at": None if admitted is None else T0 + admitted, "finished_at": None, **extra}  # fmt: skip


def _body(run: str, pid: int, enter: float, leave: float, *, wf: str, key: str | None = None,
          token: int | None = None, n: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """One body: enter (with its token, and its input's number ``n``), exit, its accepted settle."""
    numbered = {} if n is None else {"n": n}
    return [
        {"e": "enter", "t": T0 + enter, "pid": pid, "run": run, "key": key, "wf": wf, "token": token,
         "attempts": 1, "recoveries": 0, **numbered},
        {"e": "exit", "t": T0 + leave, "pid": pid, "run": run, "token": token, "how": "return"},
        {"e": "settled", "t": T0 + leave + 0.001, "pid": pid, "run": run, "status": "completed"},
    ]  # fmt: skip


def _rules(folder: Path) -> set[str]:
    return {v["rule"] for v in check(folder)["violations"]}


# -- throttle (X6b) ------------------------------------------------------------------------
def _throttled(admitted: list[float], rows: list[float] | None = None) -> tuple[list[dict[str, Any]], ...]:
    """Runs of throttle key th-k0 admitted at ``admitted`` (seconds after T0), and admission
    rows at ``rows`` of runs whose own rows are gone."""
    throttle_keys = [[RATE, "th-k0", *THROTTLE_OF[RATE]]]
    runs = [
        _run(f"th{i}", at - 0.01, wf="soak-th", admitted=at, throttle_keys=throttle_keys)
        for i, at in enumerate(admitted)
    ]
    kept = [
        {"throttle": RATE, "key": "th-k0", "run_id": f"gone{i}", "admitted_at": T0 + at}
        for i, at in enumerate(rows or [])
    ]
    return runs, kept


@pytest.mark.parametrize(
    ("admitted", "rows", "over"),
    [
        ([0.0, 0.2, 0.4, 1.0, 1.2, 1.45], [], False),  # 3 per second: [t, t + 1) holds 3 at most
        ([0.0, 0.2, 0.4, 0.99], [], True),  # a fourth admission within the second
        ([0.0, 0.2, 1.5], [0.5], False),
        ([0.0, 0.2], [0.5, 0.7], True),  # the admission rows count too (a run deleted since)
    ],
)
def test_the_checker_finds_admissions_over_the_rate(
    tmp_path: Path, admitted: list[float], rows: list[float], over: bool
) -> None:
    """X6b: throttle_over_rate fires when a throttle key's admissions, on the database's
    clock, hold more than its limit (3) in a half-open interval of its period (1 s)."""
    runs, kept = _throttled(admitted, rows)
    folder = write_history(tmp_path, [], [], runs, extra={"throttle_admissions": kept})
    report = check(folder)
    assert {v["rule"] for v in report["violations"]} == ({"throttle_over_rate"} if over else set())
    assert report["features"]["throttle_admissions_judged"] == len(admitted) + len(rows)
    assert "most in one window" in render({"db": "?", "seed": 0, **report})


# -- priority inside a key (X8) ------------------------------------------------------------
def _queue(order: list[str], priorities: dict[str, int]) -> tuple[list[dict[str, Any]], ...]:
    """Three runs a, b, c of soak-pr key pr-k0 (limit 1), created and committed at 0.0, 0.1
    and 0.2, with ``priorities``; the first admitted at 0.3 (all three in line), the others
    one after the other, in ``order``."""
    created = {"a": 0.0, "b": 0.1, "c": 0.2}
    audit: list[dict[str, Any]] = []
    runs = []
    for token, run in enumerate(order, start=1):
        enter = 0.3 + (token - 1) * 0.5
        audit += _body(run, 10 + token, enter, enter + 0.2, wf="soak-pr", key="pr-k0", token=token)
        runs.append(_run(run, created[run], wf="soak-pr", key="pr-k0", admitted=enter - 0.01, token=token,
                         priority=priorities[run]))  # fmt: skip
    events = [
        {"e": "start", "t": T0 + created[r] + 0.005, "t_req": T0 + created[r], "run": r, "wf": "soak-pr",
         "key": "pr-k0", "plan": [], "ns": "default", "priority": priorities[r]}
        for r in "abc"
    ]  # fmt: skip
    return audit, events, runs


@pytest.mark.parametrize(
    ("order", "priorities", "found"),
    [
        (["a", "b", "c"], {"a": 0, "b": 0, "c": 0}, set()),
        (["a", "c", "b"], {"a": 0, "b": 0, "c": 0}, {"fifo"}),
        (["b", "a", "c"], {"a": 0, "b": 5, "c": 0}, set()),  # the higher priority first
        (["a", "b", "c"], {"a": 0, "b": 5, "c": 0}, {"priority_order"}),
        (["c", "a", "b"], {"a": 0, "b": 0, "c": 5}, set()),
        (["c", "b", "a"], {"a": 0, "b": 0, "c": 5}, {"fifo"}),  # FIFO within priority 0
        (["a", "b", "c"], {"a": -5, "b": 0, "c": 0}, {"priority_order"}),
    ],
)
def test_the_checker_finds_admissions_out_of_the_priority_order(
    tmp_path: Path, order: list[str], priorities: dict[str, int], found: set[str]
) -> None:
    """X8, S5: in a key's queue the higher priority is admitted first, FIFO within a
    priority: ``fifo`` fires on a run that passed an older one of its priority,
    ``priority_order`` on one that passed a higher priority, both in line then."""
    folder = write_history(tmp_path, *_queue(order, priorities))
    report = check(folder)
    assert {v["rule"] for v in report["violations"]} == found
    assert sum(report["fifo_runs_by_priority"].values()) == 3


# -- debounce (X7) -------------------------------------------------------------------------
def _debounced(
    *, split: bool = False, entered: float = 0.6, n: int = 3, late_fold: bool = False
) -> tuple[list[dict[str, Any]], ...]:
    """A burst of three starts of debounce key db-k0 at 0.0, 0.1 and 0.2: the first makes
    run d1, the next two fold into it (or, with ``split``, the second makes a run of its
    own, d2); d1's body enters at ``entered`` with input ``n``; with ``late_fold``, a
    fourth start at 2.0 folds into d1 after its body entered."""

    def start(run: str, t_req: float, k: int, into: str | None = None) -> dict[str, Any]:
        line = {"t": T0 + t_req + 0.005, "t_req": T0 + t_req, "run": run, "wf": "soak-db", "dkey": "db-k0", "n": k}
        if into is None:
            return {"e": "start", **line, "key": "db", "plan": [], "ns": "default", "priority": 0}
        return {"e": "debounce_fold", **line, "into": into}

    events = [start("d1", 0.0, 1), start("d2", 0.1, 2, None if split else "d1"), start("d3", 0.2, 3, "d1")]
    if late_fold:
        events.append(start("d4", 2.0, 4, "d1"))
    runs = [_run("d1", 0.001, wf="soak-db", admitted=entered - 0.01, debounce_key="db-k0")]
    audit = _body("d1", 20, entered, entered + 0.1, wf="soak-db", n=n)
    if split:
        runs.append(_run("d2", 0.101, wf="soak-db", admitted=0.45, debounce_key="db-k0"))
        audit += _body("d2", 21, 0.46, 0.5, wf="soak-db", n=2)
    return audit, events, runs


@pytest.mark.parametrize(
    ("change", "found"),
    [
        ({}, set()),
        ({"split": True}, {"debounce_split"}),
        ({"n": 2}, {"debounce_input"}),
        ({"entered": 0.3}, {"debounce_early"}),  # before 0.1 + 0.3 s, the quiet period after the second start
        ({"entered": 0.45}, set()),  # the newest start may fold in as the claim takes the run (X7d)
        ({"late_fold": True}, {"debounce_fold_closed", "debounce_input", "debounce_early"}),
    ],
)
def test_the_checker_finds_a_burst_that_is_not_one_run_with_its_newest_input(
    tmp_path: Path, change: dict[str, Any], found: set[str]
) -> None:
    """X7, X7a, X7d: one run per burst: debounce_split fires on a start that made a second
    run while the first was open; debounce_fold_closed on a start that went into a run
    whose body had entered; debounce_input on a body that entered with an older input;
    debounce_early on one that entered before its start time."""
    assert (DEBOUNCE_SECONDS, DEBOUNCE_MAX_SECONDS) == (0.3, 1.0)
    folder = write_history(tmp_path, *_debounced(**change))
    report = check(folder)
    assert {v["rule"] for v in report["violations"]} == found
    assert report["features"]["debounce_starts"] == 3 + bool(change.get("late_fold"))


def test_a_debounced_body_may_carry_the_input_of_a_start_whose_line_never_came(tmp_path: Path) -> None:
    """X7: a start that failed on a fault may have committed its fold: its input, newer
    than the newest start line's, is no debounce_input."""
    audit, events, runs = _debounced(n=4)
    events.append({"e": "start_failed", "t": T0 + 0.3, "t_req": T0 + 0.25, "run": "d4", "error": "x",
                   "dkey": "db-k0", "n": 4})  # fmt: skip
    assert _rules(write_history(tmp_path, audit, events, runs)) == set()
