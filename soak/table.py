"""``python -m soak.table FOLDER...``: the figures of several soaks as one
reStructuredText table (docs/reliability.rst), one column per soak."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Return (figure, value) pairs of one soak's ``summary.json``."""
    args = summary.get("args", {})
    faults = summary["faults"]
    return [
        ("database", summary["db"]),
        ("load / drain", f"{float(summary['load_seconds']):.0f} s / {float(summary['drain_seconds']):.0f} s"),
        ("runs (started by the driver)", f"{summary['runs']:,} ({summary['runs_started_by_driver']:,})"),
        ("completed / cancelled / other", "{:,} / {:,} / {:,}".format(
            summary["statuses"].get("completed", 0), summary["statuses"].get("cancelled", 0),
            summary["runs"] - summary["statuses"].get("completed", 0) - summary["statuses"].get("cancelled", 0))),
        ("bodies entered / taken over", f"{summary['bodies_entered']:,} / {summary['takeovers_seen']:,}"),
        ("fenced bodies / stale bodies", f"{summary['fenced_bodies']:,} / {summary.get('stale_bodies', 0):,}"),
        ("step executions", f"{summary['step_executions']:,}"),
        ("late, refused by token", f"{summary['late_executions_refused_by_token']:,}"),
        ("highest holders (limit 1 / 2 / 3)", " / ".join(
            str(summary["max_holders_by_limit"].get(k, "-")) for k in ("1", "2", "3"))),
        ("runs checked for FIFO", f"{summary['fifo_runs_checked']:,}"),
        ("cancels / retries / signals", f"{summary['cancels']:,} / {summary['retries']:,} / {summary['signals']:,}"),
        ("duplicate deliveries", f"{summary['duplicate_deliveries']:,}"),
        ("faults injected", f"{summary['faults_total']:,}"),
        ("worker groups that exited by themselves", str(summary.get("driver", {}).get("worker_exits_by_itself", 0))),
        *((f"faults: {kind}", str(n)) for kind, n in sorted(faults.items())),
        *_feature_rows(summary),
        ("violations", str(sum(summary["violations_by_rule"].values()))),
        ("seed", str(args.get("seed", summary.get("seed")))),
        ("commit", str(summary.get("commit") or "-")),
        ("load average (min / median / max)", _load(summary)),
    ]  # fmt: skip


def _load(summary: dict[str, Any]) -> str:
    load = summary.get("load_average")
    if not load:
        return "-"
    return f"{load['min']:.1f} / {load['median']:.1f} / {load['max']:.1f} ({summary.get('cores', '?')} cores)"


def _feature_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The figures of ``--features`` (#18), "-" for a soak without them."""
    f = summary.get("features") or {}
    args = summary.get("args", {})
    if not f:
        return [(name, "-") for name in FEATURE_ROWS]
    probes = f["namespace_probes"]
    purged = f["children_purged"]
    return list(zip(FEATURE_ROWS, [
        str(args.get("features", "-")).replace("'", "").strip("()").replace(" ", "") or "none",
        f"{f['tenant_runs']:,} / {probes.get('other namespace', 0):,} / {probes.get('own reads', 0):,}",
        f"{f['times_checked']:,} ({f['stepped_starts']:,})",
        f"{sum(f['clock_steps'].values()):,}",
        f"{f['schedule_windows_judged']:,} / {f['schedule_windows_fired']:,} / {f['schedule_windows_missed']:,}",
        f"{f['retain_parents']:,} / {sum(purged.values()):,} / {f['parents_replayed_after_purge']:,}",
    ], strict=True))  # fmt: skip


#: The names of the rows :func:`_feature_rows` returns.
FEATURE_ROWS = (
    "features",
    "tenant runs / cross-namespace probes / own reads",
    "runs timed (started on a stepped clock)",
    "clock steps",
    "schedule windows judged / fired / missed",
    "retain parents / children purged / replayed after",
)


def table(summaries: list[dict[str, Any]]) -> str:
    """Return an RST simple table with one column per summary."""
    kinds = sorted({k for s in summaries for k in s["faults"]})
    for s in summaries:  # every fault kind on every column, 0 where it was not injected
        s["faults"] = {k: s["faults"].get(k, 0) for k in kinds}
    columns = [rows(s) for s in summaries]
    names = [name for name, _ in columns[0]]
    widths = [max(len(n) for n in names)] + [max(len(v) for _, v in col) for col in columns]
    rule = "  ".join("=" * w for w in widths)
    out = [rule]
    for i, name in enumerate(names):
        cells = [name.ljust(widths[0])] + [col[i][1].ljust(widths[j + 1]) for j, col in enumerate(columns)]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append(rule)
    out.append(rule)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        print("usage: python -m soak.table FOLDER...", file=sys.stderr)
        return 2
    print(table([json.loads((Path(f) / "summary.json").read_text()) for f in folders]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
