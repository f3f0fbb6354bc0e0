"""A soak's history written by hand for the soak checker's tests (soak/check.py):
the audit, the events and the final rows (tests/model/test_soak_check*.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_history(
    folder: Path,
    audit: list[dict[str, Any]],
    events: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    keys: list[dict[str, Any]] | None = None,
    *,
    memberships: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``audit.jsonl``, ``events.jsonl`` and ``final.json`` into ``folder`` and
    return it. The key rows' counters default to the highest token each key's
    bodies entered with (quota keys' too, and their memberships' tokens);
    ``memberships`` None writes none (a history before quotas); ``extra``: more
    entries of the dump (``throttle_admissions``)."""
    (folder / "audit.jsonl").write_text("".join(json.dumps(a) + "\n" for a in audit))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if keys is None:
        tokens: dict[tuple[str, str], int] = {}
        for a in audit:
            if a["e"] == "enter":
                if a["key"] is not None:
                    tokens[(a["wf"], a["key"])] = max(tokens.get((a["wf"], a["key"]), 0), a["token"])
                for name, qtoken in a.get("qtokens", {}).items():
                    row = (f"quota:{name}", a["quotas"][name])
                    tokens[row] = max(tokens.get(row, 0), qtoken)
        for m in memberships or []:
            row = (f"quota:{m['quota']}", m["key"])
            tokens[row] = max(tokens.get(row, 0), m["fencing_token"] or 0)
        keys = [{"workflow_name": wf, "key": k, "last_token": t} for (wf, k), t in tokens.items()]
    final: dict[str, Any] = {"runs": runs, "steps": [], "keys": keys}
    if memberships is not None:
        final["memberships"] = memberships
    final.update(extra or {})
    (folder / "final.json").write_text(json.dumps(final))
    return folder
