"""Targets, ratios, the printed table (rich) and the JSON file of a benchmark run."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .procs import ROOT


@dataclass
class Target:
    """One target of the issue: a measured ratio (or figure) against its bound."""

    name: str
    figure: str
    value: float
    reference: str
    ratio: float
    bound: str
    ok: bool

    def as_dict(self) -> dict[str, Any]:
        """Return the target as plain JSON data."""
        return {
            "name": self.name,
            "figure": self.figure,
            "value": _num(self.value),
            "reference": self.reference,
            "ratio": _num(self.ratio),
            "bound": self.bound,
            "ok": self.ok,
        }


def _num(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else round(value, 4)


def _get(raw: dict[str, Any], *path: str) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return math.nan
        node = node[part]
    return node


def _div(a: float, b: float) -> float:
    try:
        return a / b
    except (TypeError, ZeroDivisionError):
        return math.nan


def _concurrency_ok(raw: dict[str, Any]) -> tuple[int, int, bool]:
    """Return (workloads audited, highest concurrency seen, every key within its limit)."""
    rows = concurrency_rows(raw)
    top = max((int(r["max_seen"]) for _, r in rows), default=0)
    return len(rows), top, bool(rows) and all(r["ok"] for _, r in rows)


def targets(raw: dict[str, Any]) -> list[Target]:
    """Compute each target of issue #17 from the raw figures of one run (ratios of that run)."""
    out = []
    rt = _get(raw, "baseline", "round_trip", "p50_ms")
    hp50 = _get(raw, "handoff", "handoff", "terminal_to_entry", "p50_ms")
    hp99 = _get(raw, "handoff", "handoff", "terminal_to_entry", "p99_ms")
    ratio = _div(hp50, rt)
    out.append(Target("handoff p50", "ms", hp50, f"Celery round trip p50 {rt:.2f} ms", ratio, "<= 0.7x", ratio <= 0.7))
    out.append(Target("handoff p99", "ms", hp99, "absolute", math.nan, "< 10 ms", hp99 < 10))
    drain = _get(raw, "drain", "runs_per_s")
    djq = _get(raw, "peers", "dj_queue", "hot_key", "runs_per_s")
    pc = _get(raw, "peers", "procrastinate", "hot_key", "runs_per_s")
    ratio = _div(drain, djq)
    out.append(
        Target("hot-key drain vs dj-queue", "runs/s", drain, f"dj-queue {djq:.1f} runs/s", ratio, ">= 3x", ratio >= 3)
    )
    ratio = _div(drain, pc)
    out.append(
        Target(
            "hot-key drain vs procrastinate",
            "runs/s",
            drain,
            f"procrastinate {pc:.1f} runs/s",
            ratio,
            ">= 4x",
            ratio >= 4,
        )
    )
    tasks = _get(raw, "baseline", "independent", "tasks_per_s")
    bulk = _get(raw, "many_keys_bulk", "runs_per_s")
    ratio = _div(bulk, tasks)
    out.append(
        Target(
            "many keys, start_many", "runs/s", bulk, f"Celery {tasks:.0f} no-op tasks/s", ratio, ">= 0.7x", ratio >= 0.7
        )
    )
    for peer in ("dj_queue", "procrastinate"):
        out.append(_many_keys_target(raw, peer))
    vendor = _get(raw, "statements", "database")
    for kind, bound in (("handoff-admitted", 3), ("idle key", 4)):
        trips = _get(raw, "statements", kind, "round_trips")
        out.append(
            Target(
                f"round trips per run, {kind}",
                "count",
                trips,
                f"bench.statements on {vendor if isinstance(vendor, str) else 'n/a'}",
                math.nan,
                f"<= {bound}",
                trips <= bound,
            )
        )
    for vendor, label, bound in (("mysql", "MariaDB", 0.8), ("sqlite", "SQLite", 0.9)):
        ratio = _get(raw, "rooms", "databases", vendor, "drain_ratio_to_postgresql")
        if isinstance(ratio, (int, float)) and not math.isnan(ratio):
            rate = _get(raw, "rooms", "databases", vendor, "drain_runs_per_second")
            base = _get(raw, "rooms", "databases", "postgresql", "drain_runs_per_second")
            out.append(
                Target(
                    f"hot-key drain in process, {label} vs PostgreSQL",
                    "runs/s",
                    rate,
                    f"PostgreSQL {base:.1f} runs/s (bench.rooms)",
                    ratio,
                    f">= {bound}x",
                    ratio >= bound,
                )
            )
    depth = _get(raw, "depth", "databases")
    if isinstance(depth, dict):
        labels = {"postgresql": "PostgreSQL", "mysql": "MariaDB", "sqlite": "SQLite"}
        for vendor, figures in depth.items():
            ms = figures["ms"]
            small, big = min(ms, key=int), max(ms, key=int)
            for step in ("claim", "handoff"):
                ratio = figures["ratio_largest_to_smallest"][step]
                out.append(
                    Target(
                        f"{step} at {big} waiters, {labels.get(vendor, vendor)} (bench.depth)",
                        "ms p50",
                        ms[big][step],
                        f"{ms[small][step]:.2f} ms at {small}",
                        ratio,
                        "<= 1.2x",
                        ratio <= 1.2,
                    )
                )
    claims = _get(raw, "claims")
    if isinstance(claims, dict) and claims:
        sizes = sorted(claims, key=int)
        small, big = claims[sizes[0]], claims[sizes[-1]]
        ratio = _div(big["p50_ms"], small["p50_ms"])
        out.append(
            Target(
                f"claim latency at {sizes[-1]} waiters",
                "ms p50",
                big["p50_ms"],
                f"{small['p50_ms']:.2f} ms at {sizes[0]}",
                ratio,
                "<= 1.2x",
                ratio <= 1.2,
            )
        )
        counts = {s: claims[s]["statements"] for s in sizes}
        out.append(
            Target(
                "round trips per claim",
                "count",
                float(big["statements"]),
                ", ".join(f"{c} at {s}" for s, c in counts.items()),
                math.nan,
                "same at every size",
                len(set(counts.values())) == 1,
            )
        )
    killed = _get(raw, "pull", "killed")
    if isinstance(killed, dict):
        seconds = killed["reentry_s"]
        out.append(
            Target(
                "kill -9 of a durable_worker: its run's body entered again",
                "s",
                seconds,
                f"WORKER_DEAD_SECONDS {killed['worker_dead_seconds']:g} s; logged {killed['logged']} line(s)",
                math.nan,
                "<= 15 s, logged",
                seconds <= 15 and killed["logged"] == 1,
            )
        )
    rate = _get(raw, "backlog", "statements_per_s")
    waiters = _get(raw, "backlog", "waiters")
    out.append(
        Target(f"parked backlog ({waiters} waiters)", "stmt/s", rate, "absolute", math.nan, "<= 50/s", rate <= 50)
    )
    idle = _get(raw, "lane", "idle", "p99_ms")
    busy = _get(raw, "lane", "during_burst", "p99_ms")
    out.append(
        Target(
            "key B p99 start delay in A's burst",
            "ms",
            busy,
            f"idle p99 {idle:.1f} ms",
            busy - idle,
            "<= idle + 100 ms",
            busy - idle <= 100,
        )
    )
    audited, top, ok = _concurrency_ok(raw)
    out.append(
        Target(
            "max concurrency per key",
            "bodies",
            float(top) if audited else math.nan,
            f"{audited} workloads audited, every deployment",
            math.nan,
            "never above the limit",
            ok,
        )
    )
    return out


#: The deployments whose "many keys one by one" figure a run may hold: the path of the
#: figure and the deployment's name (its ``DISPATCH``; issue #31).
MANY_KEYS_DEPLOYMENTS = (
    (("many_keys", "runs_per_s"), 'DISPATCH "celery"'),
    (("pull", "many_keys", "runs_per_s"), 'DISPATCH "worker" (durable_worker)'),
    (("worker", "many_keys", "runs_per_s"), 'DISPATCH "thread" (durable_worker)'),
    (("embedded", "many_keys", "runs_per_s"), 'DISPATCH "thread" (one process starts and runs)'),
)


def _many_keys_target(raw: dict[str, Any], peer: str) -> Target:
    """Many keys one by one against ``peer``, in every deployment the run measured
    (:data:`MANY_KEYS_DEPLOYMENTS`), each as its ratio to the peer's figure of the
    same run: met when one deployment reaches 1.0x (issue #31: "in at least one
    deployment, name it"). The measured figure and ratio are the best deployment's;
    the reference names each deployment with its ratio, and the one that meets it."""
    theirs = _get(raw, "peers", peer, "many_keys", "runs_per_s")
    measured = []
    for path, name in MANY_KEYS_DEPLOYMENTS:
        ours = _get(raw, *path)
        if isinstance(ours, (int, float)) and not math.isnan(ours):
            measured.append((name, float(ours), _div(ours, theirs)))
    parts = [f"{name} {ours:.0f} ({ratio:.2f}x)" for name, ours, ratio in measured]
    best = max(measured, key=lambda m: m[1], default=("", math.nan, math.nan))
    ok = not math.isnan(best[2]) and best[2] >= 1.0
    reference = f"{peer} {theirs:.0f} runs/s; " + (", ".join(parts) or "no deployment measured")
    if ok:
        reference += f"; met by {best[0]}"
    return Target(
        f"many keys one by one vs {peer}", "runs/s", best[1], reference, best[2], ">= 1x in one deployment", ok
    )


#: The durable_worker deployments measured beside Celery: the key of their figures and their title.
DEPLOYMENTS = {
    "worker": "The embedded worker (manage.py durable_worker, DISPATCH thread, no Celery) beside Celery, same run",
    "pull": "durable_worker with DISPATCH worker (turns taken from the database, no Celery) beside Celery, same run",
}


def deployment_rows(raw: dict[str, Any], deployment: str = "worker") -> list[tuple[str, str, str, str]]:
    """Return (figure, on Celery, on durable_worker, durable_worker / Celery) of
    the run of ``deployment`` (a key of :data:`DEPLOYMENTS`)."""
    rows = []
    for label, path, fmt in (
        ("idle key, start to body p50 ms", ("lane", "idle", "p50_ms"), "{:.2f}"),
        ("idle key, start to body p99 ms", ("lane", "idle", "p99_ms"), "{:.2f}"),
        ("handoff p50 ms", ("handoff", "handoff", "terminal_to_entry", "p50_ms"), "{:.2f}"),
        ("handoff p99 ms", ("handoff", "handoff", "terminal_to_entry", "p99_ms"), "{:.2f}"),
        ("hot-key drain runs/s", ("drain", "runs_per_s"), "{:.0f}"),
        ("many keys one by one runs/s", ("many_keys", "runs_per_s"), "{:.0f}"),
        ("many keys one by one: first body after s", ("many_keys", "first_entry_seconds"), "{:.2f}"),
        ("many keys start_many runs/s", ("many_keys_bulk", "runs_per_s"), "{:.0f}"),
        ("many keys start_many: first body after s", ("many_keys_bulk", "first_entry_seconds"), "{:.2f}"),
    ):
        celery, worker = _get(raw, *path), _get(raw, deployment, *path)
        if not isinstance(worker, (int, float)) or math.isnan(worker):
            continue
        celery = celery if isinstance(celery, (int, float)) else math.nan
        ratio = _div(worker, celery)
        rows.append(
            (
                label,
                "n/a" if math.isnan(celery) else fmt.format(celery),
                fmt.format(worker),
                "" if math.isnan(ratio) else f"{ratio:.2f}",
            )
        )
    return rows


def concurrency_rows(raw: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Return (scenario, concurrency report) for every audited workload of the run, every deployment."""
    rows = []
    for label, path in (
        ("2 handoff", ("handoff", "concurrency")),
        ("3 hot-key drain", ("drain", "concurrency")),
        ("4 many keys", ("many_keys", "concurrency")),
        ("4 many keys, start_many", ("many_keys_bulk", "concurrency")),
        ("6 key B idle", ("lane", "idle", "concurrency")),
        ("6 key B in burst", ("lane", "during_burst", "concurrency")),
        ("8 durable_worker handoff", ("worker", "handoff", "concurrency")),
        ("8 durable_worker hot-key drain", ("worker", "drain", "concurrency")),
        ("8 durable_worker many keys", ("worker", "many_keys", "concurrency")),
        ("8 durable_worker many keys, start_many", ("worker", "many_keys_bulk", "concurrency")),
        ("9 durable_worker (worker) handoff", ("pull", "handoff", "concurrency")),
        ("9 durable_worker (worker) hot-key drain", ("pull", "drain", "concurrency")),
        ("9 durable_worker (worker) many keys", ("pull", "many_keys", "concurrency")),
        ("9 durable_worker (worker) many keys, start_many", ("pull", "many_keys_bulk", "concurrency")),
        ("9 durable_worker (worker) idle key", ("pull", "lane", "idle", "concurrency")),
        ("11 DISPATCH thread, one process: many keys", ("embedded", "many_keys", "concurrency")),
        ("11 DISPATCH thread, one process: idle key", ("embedded", "lane", "idle", "concurrency")),
        ("7 dj-queue hot key", ("peers", "dj_queue", "hot_key", "concurrency")),
        ("7 dj-queue many keys", ("peers", "dj_queue", "many_keys", "concurrency")),
        ("7 procrastinate hot key", ("peers", "procrastinate", "hot_key", "concurrency")),
        ("7 procrastinate many keys", ("peers", "procrastinate", "many_keys", "concurrency")),
    ):
        report = _get(raw, *path)
        if isinstance(report, dict):
            rows.append((label, report))
    return rows


def figure_rows(raw: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Return (scenario, figure, value) rows of the raw figures worth printing."""
    rows: list[tuple[str, str, str]] = []

    def add(label: str, figure: str, *path: str, fmt: str = "{:.2f}") -> None:
        value = _get(raw, *path)
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            rows.append((label, figure, fmt.format(value)))

    pg = _get(raw, "servers", "postgresql")
    if isinstance(pg, dict):
        rows.append(
            (
                "0 PostgreSQL server",
                "fsync / synchronous_commit / full_page_writes",
                " / ".join(str(pg.get(k, "?")) for k in ("fsync", "synchronous_commit", "full_page_writes")),
            )
        )
    for kind in ("plain", "idle key", "handoff-admitted"):
        trips = _get(raw, "statements", kind, "round_trips")
        control = _get(raw, "statements", kind, "transaction_control")
        if isinstance(trips, (int, float)) and not math.isnan(trips):
            rows.append(
                (
                    f"0 round trips per run ({_get(raw, 'statements', 'database')})",
                    f"{kind}: total (of which BEGIN/COMMIT)",
                    f"{trips:g} ({control:g})",
                )
            )
    rooms = _get(raw, "rooms", "databases")
    if isinstance(rooms, dict):
        for vendor, figures in rooms.items():
            rows.append(
                (
                    f"0 rooms ({vendor})",
                    "drain / idle runs/s in process (ratio to PostgreSQL)",
                    f"{figures['drain_runs_per_second']:.1f} ({figures.get('drain_ratio_to_postgresql', 'n/a')}x) / "
                    f"{figures['idle_runs_per_second']:.1f} ({figures.get('idle_ratio_to_postgresql', 'n/a')}x)",
                )
            )
    for which in ("baseline", "baseline_end"):
        label = "1 Celery" if which == "baseline" else "1 Celery (again, at the end)"
        add(label, "round trip p50 / p99 ms", which, "round_trip", "p50_ms")
        if rows and rows[-1][0] == label:
            rows[-1] = (label, rows[-1][1], f"{rows[-1][2]} / {_get(raw, which, 'round_trip', 'p99_ms'):.2f}")
        add(label, "serial chain links/s", which, "chain", "links_per_s", fmt="{:.0f}")
        add(label, "independent no-ops tasks/s", which, "independent", "tasks_per_s", fmt="{:.0f}")
    for label, key in (("2 handoff (ours)", "handoff"), ("3 hot-key drain (ours)", "drain")):
        for kind in ("terminal_to_entry", "exit_to_entry"):
            p50 = _get(raw, key, "handoff", kind, "p50_ms")
            p99 = _get(raw, key, "handoff", kind, "p99_ms")
            if not math.isnan(p50):
                rows.append((label, f"handoff {kind.replace('_', ' ')} p50 / p99 ms", f"{p50:.2f} / {p99:.2f}"))
        add(label, "runs/s", key, "runs_per_s", fmt="{:.0f}")
    add("4 many keys (ours)", "runs/s", "many_keys", "runs_per_s", fmt="{:.0f}")
    add("4 many keys, start_many (ours)", "runs/s", "many_keys_bulk", "runs_per_s", fmt="{:.0f}")
    label = "11 DISPATCH thread, one process starts and runs"
    add(label, "many keys one by one runs/s", "embedded", "many_keys", "runs_per_s", fmt="{:.0f}")
    add(label, "idle key start to body p50 ms", "embedded", "lane", "idle", "p50_ms")
    label = "9 tick, every worker slot busy (O5)"
    add(label, "tick period p50 s", "tick_under_load", "period_p50_s", fmt="{:.3f}")
    add(label, "tick period p99 s", "tick_under_load", "period_p99_s", fmt="{:.3f}")
    add(label, "tick period p99 / TICK_SECONDS (target <= 2)", "tick_under_load", "p99_ratio", fmt="{:.2f}")
    for size in sorted(_get(raw, "claims") if isinstance(_get(raw, "claims"), dict) else {}, key=int):
        p50 = _get(raw, "claims", size, "p50_ms")
        p99 = _get(raw, "claims", size, "p99_ms")
        n = _get(raw, "claims", size, "statements")
        rows.append(("5 claim (ours)", f"{size} waiters: p50 / p99 ms, round trips", f"{p50:.2f} / {p99:.2f}, {n}"))
        explain = _get(raw, "claims", size, "explain")
        if isinstance(explain, dict):
            rows.append(
                (
                    "5 claim (ours)",
                    f"{size} waiters: auto_explain statements, server ms",
                    f"{explain['statements']}, {explain['duration_ms']:.3f}",
                )
            )
    add("5 parked backlog (ours)", "statements/s (pg_stat_statements)", "backlog", "statements_per_s")
    add(
        "5 parked backlog (ours)",
        "statements/s without BEGIN/COMMIT",
        "backlog",
        "statements_per_s_without_begin_commit",
    )
    add("5 parked backlog (ours)", "transactions/s (pg_stat_database)", "backlog", "transactions_per_s")
    for which, label in (("idle", "idle"), ("during_burst", "during A's burst")):
        p50 = _get(raw, "lane", which, "p50_ms")
        p99 = _get(raw, "lane", which, "p99_ms")
        n = _get(raw, "lane", which, "n")
        if not math.isnan(p50):
            rows.append(("6 key B start delay (ours)", f"{label}: p50 / p99 ms (n)", f"{p50:.1f} / {p99:.1f} ({n})"))
    add("6 burst on key A", "starts/s while landing", "lane", "burst", "starts_per_s", fmt="{:.0f}")
    add("6 burst on key A", "seconds until every turn parked", "lane", "burst", "settle_seconds", fmt="{:.1f}")
    for peer, label in (("dj_queue", "7 dj-queue"), ("procrastinate", "7 procrastinate")):
        ver = _get(raw, "peers", peer, "version")
        if isinstance(ver, str):
            label = f"{label} {ver}"
        add(label, "hot-key drain runs/s", "peers", peer, "hot_key", "runs_per_s", fmt="{:.1f}")
        p50 = _get(raw, "peers", peer, "hot_key", "handoff", "exit_to_entry", "p50_ms")
        p99 = _get(raw, "peers", peer, "hot_key", "handoff", "exit_to_entry", "p99_ms")
        if not math.isnan(p50):
            rows.append((label, "handoff exit to entry p50 / p99 ms", f"{p50:.1f} / {p99:.1f}"))
        add(label, "many keys runs/s", "peers", peer, "many_keys", "runs_per_s", fmt="{:.0f}")
    return rows


def render(raw: dict[str, Any], found: list[Target], console: Console | None = None) -> None:
    """Print the figures, the targets and the concurrency audit as tables."""
    console = console or Console(width=160)
    table = Table(title="Figures (one run)")
    for column in ("scenario", "figure", "value"):
        table.add_column(column)
    for row in figure_rows(raw):
        table.add_row(*row)
    console.print(table)
    table = Table(title="Targets (ratios to figures of the same run)")
    for column in ("target", "measured", "reference", "ratio", "bound", "met"):
        table.add_column(column)
    for t in found:
        measured = "n/a" if math.isnan(t.value) else f"{t.value:.2f} {t.figure}"
        ratio = "" if math.isnan(t.ratio) else f"{t.ratio:.2f}"
        table.add_row(t.name, measured, t.reference, ratio, t.bound, "yes" if t.ok else "NO")
    console.print(table)
    for deployment, title in DEPLOYMENTS.items():
        deployments = deployment_rows(raw, deployment)
        if deployments:
            table = Table(title=title)
            for column in ("figure", "Celery workers", "durable_worker", "ratio"):
                table.add_column(column)
            for row in deployments:
                table.add_row(*row)
            console.print(table)
    table = Table(title="Highest concurrency seen per key (audit of body entry and exit)")
    for column in ("workload", "keys", "max seen", "limit", "ok"):
        table.add_column(column)
    for label, report in concurrency_rows(raw):
        table.add_row(
            label, str(report["keys"]), str(report["max_seen"]), str(report["limit"]), "yes" if report["ok"] else "NO"
        )
    console.print(table)
    for name, error in raw.get("errors", {}).items():
        console.print(f"[red]{name} failed:[/red] {error}")


def versions(pg_version: str, redis_version: str) -> dict[str, str]:
    """Return the versions of everything measured."""
    out = {"python": platform.python_version(), "postgresql": pg_version, "redis": redis_version}
    for package in ("django", "celery", "kombu", "redis", "psycopg", "dj-queue", "procrastinate", "durable-singleton"):
        try:
            out[package if package != "redis" else "redis-py"] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "durable_singleton"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        out["durable_singleton_commit"] = commit + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        out["durable_singleton_commit"] = "unknown"
    return out


def machine() -> dict[str, Any]:
    """Return the machine's core count, load and platform."""
    return {
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def _clean(node: Any) -> Any:
    """Return ``node`` with NaN and infinities as None (strict JSON)."""
    if isinstance(node, float):
        return node if math.isfinite(node) else None
    if isinstance(node, dict):
        return {str(k): _clean(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_clean(v) for v in node]
    return node


def write(raw: dict[str, Any], found: list[Target], out_dir: Path, stamp: str) -> Path:
    """Write the run's JSON to ``out_dir/bench-<stamp>.json`` (and ``latest.json``); return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = _clean({**raw, "targets": [t.as_dict() for t in found]})
    text = json.dumps(doc, indent=2, default=str, allow_nan=False)
    path = out_dir / f"bench-{stamp}.json"
    path.write_text(text)
    (out_dir / "latest.json").write_text(text)
    return path


def _rst_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    rule = "  ".join("=" * w for w in widths)
    lines = [rule, "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), rule]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(rule)
    return "\n".join(line.rstrip() for line in lines)


def rst(doc: dict[str, Any]) -> str:
    """Return the tables of a results file as reStructuredText (for docs/benchmarks.rst): figures,
    targets, the embedded worker beside Celery (when measured), concurrency audit."""
    found = targets(doc)
    parts = [_rst_table(("scenario", "figure", "value"), figure_rows(doc))]
    rows = []
    for t in found:
        measured = "n/a" if math.isnan(t.value) else f"{t.value:.2f} {t.figure}"
        ratio = "" if math.isnan(t.ratio) else f"{t.ratio:.2f}"
        rows.append((t.name, measured, t.reference, ratio or "-", t.bound, "yes" if t.ok else "**no**"))
    parts.append(_rst_table(("target", "measured", "reference", "ratio", "bound", "met"), rows))
    for deployment in DEPLOYMENTS:
        deployments = deployment_rows(doc, deployment)
        if deployments:
            parts.append(_rst_table(("figure", "Celery workers", "durable_worker", "ratio"), deployments))
    rows = [
        (label, str(r["keys"]), str(r["max_seen"]), str(r["limit"]), "yes" if r["ok"] else "**no**")
        for label, r in concurrency_rows(doc)
    ]
    parts.append(_rst_table(("workload", "keys", "max seen", "limit", "ok"), rows))
    return "\n\n".join(parts)


def _restore_nan(node: Any) -> Any:
    if node is None:
        return math.nan
    if isinstance(node, dict):
        return {k: _restore_nan(v) if k not in ("keys_over_limit",) else v for k, v in node.items()}
    if isinstance(node, list):
        return [_restore_nan(v) for v in node]
    return node


if __name__ == "__main__":  # python -m bench.report bench/results/latest.json
    print(rst(_restore_nan(json.loads(Path(sys.argv[1]).read_text()))))
