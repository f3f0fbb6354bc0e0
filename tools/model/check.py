#!/usr/bin/env python3
"""Model-check the turn protocol (tools/model/admission.pml) and the admission
under several limits (tools/model/quotas.pml, SPEC X3) with spin.

Each configuration below is one exhaustive check: spin generates the
verifier, gcc compiles it, and it explores every reachable state of the
model under that configuration (bounds and fault budgets as cpp macros).

Command line::

    python tools/model/check.py            # the configurations the test suite runs
    python tools/model/check.py --all      # every configuration in CONFIGS
    python tools/model/check.py NAME ...   # the named ones
    python tools/model/check.py --list

Exit status 0 when every safety/liveness configuration holds and every
broken variant yields a counterexample.  Needs ``spin`` and ``gcc``
(Debian: ``apt-get install spin``; tools/services.py installs it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MODEL = Path(__file__).with_name("admission.pml")
MEMORY_LIMIT_MB = 1024
STATUS_NAMES = {
    "0": "none",
    "1": "pending",
    "2": "running",
    "3": "suspended",
    "4": "completed",
    "5": "cancelled",
    "6": "dead",
    "7": "refused",
}


@dataclass(frozen=True)
class Config:
    """One check: ``macros`` configure the model; ``liveness`` checks the
    LTL property ``live`` under weak fairness instead of the invariants;
    ``expect_violation`` marks a deliberately broken variant; ``ci`` ones
    run in the test suite (about 90 s together), the others only with
    ``--all`` (about 8 minutes more)."""

    name: str
    doc: str
    macros: dict[str, int | str] = field(default_factory=dict)
    liveness: bool = False
    expect_violation: bool = False
    ci: bool = True
    #: The model file beside this script: the turn protocol, or the admission under
    #: several limits (quotas.pml, SPEC X3).
    model: str = "admission.pml"


NO_FAULTS = {"MAXCRASH": 0, "MAXPAUSE": 0, "MAXLOST": 0, "MAXDUP": 0, "MAXCANCEL": 0, "TO_RUN": 9}

CONFIGS = [
    Config(
        "crash",
        "3 runs, one key, limit 1, 2 workers: a worker crash at any point, a worker frozen past its lease",
        {**NO_FAULTS, "MAXCRASH": 1, "MAXPAUSE": 1},
    ),
    Config(
        "cancel-timeout",
        "3 runs, one key, limit 1, 2 workers: a cancel of any run at any point, an execution timeout of run 0",
        {**NO_FAULTS, "MAXCANCEL": 1, "TO_RUN": 0},
        ci=False,
    ),
    Config(
        "messages",
        "3 runs, one key, limit 1, 2 workers: a lost send and a duplicate delivery at any point",
        {**NO_FAULTS, "MAXLOST": 1, "MAXDUP": 1},
    ),
    Config(
        "timeout-crash",
        "3 runs, one key, limit 1, 2 workers: run 0 times out while its worker may crash",
        {**NO_FAULTS, "TO_RUN": 0, "MAXCRASH": 1},
    ),
    Config(
        "two-keys",
        "4 runs, key 0 limit 2 (runs 0-2, queue cap 3), key 1 limit 1 (run 3), 2 workers: a worker crash",
        {**NO_FAULTS, "NR": 4, "KEY1": 8, "LIM0": 2, "LIM1": 1, "CAP0": 3, "MAXCRASH": 1},
        ci=False,
    ),
    Config(
        "three-workers",
        "3 runs, one key, limit 2, 3 workers",
        {**NO_FAULTS, "NW": 3, "LIM0": 2},
        ci=False,
    ),
    Config(
        "late-commit",
        "3 runs, one key, limit 2, 2 workers: the oldest run commits at any moment, after younger ones ran (F3); "
        "a frozen worker",
        {**NO_FAULTS, "LIM0": 2, "LATE": 0, "MAXPAUSE": 1},
        ci=False,
    ),
    Config(
        "liveness",
        "every run ends (each waiter is admitted once its holders finish), weak fairness: "
        "3 runs, limit 1, 2 workers, a worker crash",
        {**NO_FAULTS, "MAXCRASH": 1, "FAIR_TIME": 1},
        liveness=True,
    ),
    Config(
        "liveness-lost",
        "the same with a crash and a lost send",
        {**NO_FAULTS, "MAXCRASH": 1, "MAXLOST": 1, "FAIR_TIME": 1},
        liveness=True,
        ci=False,
    ),
    Config(
        "broken-timeout",
        "the old unfenced timeout settle (read parked, settle without CAS) must overlap two bodies",
        {**NO_FAULTS, "TO_RUN": 0, "BROKEN_TIMEOUT": 1, "CHECK_OVERLAP_ONLY": 1},
        expect_violation=True,
    ),
    Config(
        "quota-admission",
        "4 runs over a singleton key (cap 1) and two quotas (caps 2, 1), needing {key, q1} x2, {q1, q2}, {q2}: "
        "no limit over its cap, no deadlock, no waiter left without a turn (X3d, X3e, X3g)",
        {},
        model="quotas.pml",
    ),
    Config(
        "quota-mixed",
        "the same with the last run needing {key, q2}",
        {"NEED3": 5},
        model="quotas.pml",
    ),
    Config(
        "quota-fair",
        "3 runs needing {key, q1} x2, {q1, q2}, ordered as a fair quota's tags order them (run 2 first, X4)",
        {"FAIR": 1, "NR": 3},
        model="quotas.pml",
    ),
    Config(
        "quota-throttle",
        "3 runs over a singleton key (cap 1), two quotas (caps 2, 1) and a throttle key (1 admission per window), "
        "needing {key, q1, t}, {key, t}, {q2, t}: the window's admissions never over the throttle's "
        "limit, no limit over its cap, no deadlock, no waiter left without a turn (X6b, X6c, X6d)",
        {"THROTTLE": 1, "NR": 3, "NEED0": 11, "NEED1": 9, "NEED2": 12},
        model="quotas.pml",
    ),
    Config(
        "broken-quota-throttle-handoff",
        "a settle admits a throttle carrier as a quota carrier, without its throttle key's lock: "
        "over-admission in the window must be found (X6c)",
        {"THROTTLE": 1, "BROKEN_THROTTLE_HANDOFF": 1, "NR": 3, "NEED0": 11, "NEED1": 9, "NEED2": 12},
        model="quotas.pml",
        expect_violation=True,
    ),
    Config(
        "broken-quota-order",
        "odd runs lock their key rows in descending order: a deadlock must be found",
        {"BROKEN_ORDER": 1},
        model="quotas.pml",
        expect_violation=True,
    ),
    Config(
        "broken-quota-no-wake",
        "a settle sends no turn: a waiter left without one must be found",
        {"BROKEN_NO_WAKE": 1},
        model="quotas.pml",
        expect_violation=True,
    ),
    Config(
        "broken-quota-first-only",
        "a claim checks only its lowest limit: over-admission must be found",
        {"BROKEN_FIRST_ONLY": 1, "NEED3": 5},
        model="quotas.pml",
        expect_violation=True,
    ),
    Config(
        "broken-quota-handoff",
        "a settle admits a waiter that shares one of its limits but carries another it does not hold: "
        "over-admission must be found (X3h)",
        {"BROKEN_HANDOFF": 1},
        model="quotas.pml",
        expect_violation=True,
    ),
    Config(
        "broken-no-wake",
        "without the handoff and the catch-up a parked waiter is never admitted: liveness must fail",
        {**NO_FAULTS, "FAIR_TIME": 1, "BROKEN_NO_WAKE": 1},
        liveness=True,
        expect_violation=True,
    ),
]


@dataclass
class Result:
    """What one check found: states stored, transitions, errors, seconds, the trail if any."""

    config: Config
    states: int
    transitions: int
    errors: int
    seconds: float
    output: str
    trail: str = ""

    @property
    def ok(self) -> bool:
        """True when the check met its expectation."""
        return (self.errors > 0) if self.config.expect_violation else (self.errors == 0 and self.states > 0)


def spin_available() -> bool:
    """True when spin and a C compiler are on PATH."""
    return shutil.which("spin") is not None and shutil.which("gcc") is not None


def run(config: Config, *, timeout: float = 300.0) -> Result:
    """Generate, compile and run the verifier for ``config``; raise on a tool failure."""
    model = MODEL.with_name(config.model)
    with tempfile.TemporaryDirectory(prefix="ds-spin-") as tmp:
        work = Path(tmp)
        shutil.copy(model, work / model.name)
        defines = [f"-D{k}={v}" for k, v in config.macros.items()]
        started = time.monotonic()
        subprocess.run(["spin", *defines, "-a", model.name], cwd=work, check=True, capture_output=True, text=True)
        cflags = ["-O0", "-w", f"-DMEMLIM={MEMORY_LIMIT_MB}", "-DCOLLAPSE"]
        if config.expect_violation and not config.liveness:
            cflags += ["-DBFS"]  # the shortest counterexample
        if config.liveness:
            cflags += ["-DNFAIR=3"]
        else:
            cflags += ["-DSAFETY", "-DNOCLAIM"]
        subprocess.run(["gcc", *cflags, "-o", "pan", "pan.c"], cwd=work, check=True, capture_output=True, text=True)
        args = ["./pan", "-m200000", "-w22"]
        if config.liveness:
            args += ["-a", "-f", "-N", "live"]
        proc = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=timeout, check=False)
        seconds = time.monotonic() - started
        out = proc.stdout + proc.stderr
        if "error: max search depth too small" in out:
            raise RuntimeError(f"{config.name}: search depth too small\n{out}")
        if "pan: reached -DMEMLIM bound" in out or "out of memory" in out:
            raise RuntimeError(f"{config.name}: out of memory\n{out}")
        states = _number(r"([\d.e+]+) states, stored", out)
        transitions = _number(r"([\d.e+]+) transitions \(= (?:stored|visited)\+matched\)", out)
        errors = int(_number(r"errors: (\d+)", out))
        trail = ""
        if errors and (work / f"{model.name}.trail").exists():
            replay = subprocess.run(
                ["spin", *defines, "-t", model.name],
                cwd=work,
                capture_output=True,
                text=True,
                check=False,
            )
            trail = replay.stdout
        return Result(config, int(states), int(transitions), errors, seconds, out, trail)


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def summarize_trail(trail: str) -> list[str]:
    """The events of a counterexample (the model's printf lines), one per line."""
    events = []
    for line in trail.splitlines():
        if re.match(r"^\s*\w+(\[\d+\])? = ", line):
            break  # the final values of the variables follow
        if line.strip() and not line.startswith(("spin:", "ltl ", "#")):
            events.append(re.sub(r"\(status (now )?(\d)\)", _status_name, line.strip()))
    return events


def _status_name(match: re.Match[str]) -> str:
    return f"({match.group(1) or ''}{STATUS_NAMES[match.group(2)]})"


def violation(output: str) -> str:
    """The line of pan's output naming the violated assertion or property."""
    for line in output.splitlines():
        if "assertion violated" in line or "acceptance cycle" in line or "invalid end state" in line:
            return line.strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="configurations to check (default: the CI ones)")
    parser.add_argument("--all", action="store_true", help="every configuration, the long ones too")
    parser.add_argument("--list", action="store_true", help="list the configurations")
    parser.add_argument("--trail", action="store_true", help="print the counterexample of a violation")
    args = parser.parse_args(argv)
    if args.list:
        for config in CONFIGS:
            print(f"{config.name:16} {config.doc}")
        return 0
    if not spin_available():
        print("spin or gcc missing: apt-get install spin gcc", file=sys.stderr)
        return 2
    chosen = [c for c in CONFIGS if ((c.name in args.names) if args.names else (args.all or c.ci))]
    failed = 0
    for config in chosen:
        result = run(config)
        verdict = "ok" if result.ok else "FAILED"
        kind = "counterexample found" if result.errors else "no violation"
        print(
            f"{config.name:16} {verdict:6} {result.states:>11,} states {result.transitions:>12,} transitions "
            f"{result.seconds:6.1f} s  {kind}",
            flush=True,
        )
        if not result.ok:
            failed += 1
            print(result.output[-3000:])
        if result.errors and (args.trail or not result.ok):
            print("  " + violation(result.output))
            print("\n".join("    " + event for event in summarize_trail(result.trail)))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("LC_ALL", "C")
    sys.exit(main())
