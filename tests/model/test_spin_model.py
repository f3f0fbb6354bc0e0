"""The model check of the turn protocol (tools/model/admission.pml) with spin.

Each configuration explores every reachable state of the model for its
bounds and faults; docs/model.rst maps the model's transactions to the code.
The model does not touch a database, so it is vendor-agnostic: it runs on
the SQLite pass of the suite (the PostgreSQL and MariaDB passes deselect it).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ds_model_check", ROOT / "tools" / "model" / "check.py")
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
sys.modules["ds_model_check"] = check
_spec.loader.exec_module(check)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not check.spin_available(), reason="spin or gcc not installed (tools/services.py install)"),
    pytest.mark.vendor_agnostic,
]

PROTOCOL = [c for c in check.CONFIGS if c.model == "admission.pml"]
SAFE = [c for c in PROTOCOL if c.ci and not c.expect_violation]
BROKEN = [c for c in PROTOCOL if c.ci and c.expect_violation]
QUOTAS = [c for c in check.CONFIGS if c.model == "quotas.pml" and c.ci]


@pytest.mark.parametrize("config", SAFE, ids=[c.name for c in SAFE])
def test_protocol_holds(config: check.Config) -> None:
    """S5, S6, S9, R2, R5, R5a, R6, D4-D6, K1 (safety: never more executing
    bodies than the limit, a lease holder really holds its lease, a stored
    cancel is never undone, a stored step is never executed again, tokens
    increase) and S7, S8, S8a (liveness: every run ends) over every state."""
    result = check.run(config, timeout=240)
    assert result.errors == 0, result.output[-4000:] + "\n" + "\n".join(check.summarize_trail(result.trail))
    assert result.states > 1000, result.output[-2000:]


@pytest.mark.parametrize("config", BROKEN, ids=[c.name for c in BROKEN])
def test_broken_variant_has_a_counterexample(config: check.Config) -> None:
    """R5a, D5 (issue 8 defect 1): the old timeout settle without a compare-
    and-set overlaps two bodies on a limit-1 key; without the handoff and the
    catch-up a waiter is never admitted (S7, S8a). The checker must say so,
    or it proves nothing."""
    result = check.run(config, timeout=240)
    assert result.errors > 0, result.output[-2000:]
    events = check.summarize_trail(result.trail)
    if not config.liveness:
        assert "VIOLATION: more bodies executing under unexpired leases than the key's limit" in events
        assert any("timeout sweep settles run 0 (now running)" in e for e in events), events


@pytest.mark.parametrize("config", QUOTAS, ids=[c.name for c in QUOTAS])
def test_quota_admission(config: check.Config) -> None:
    """X3d, X3e, X3g, X3h (tools/model/quotas.pml): over every interleaving of
    claims and settles under a singleton key and two quotas, no limit has more
    holders than its cap, no claim deadlocks and every waiter gets the turn
    that admits it, a handoff admitting at once the waiters whose every limit
    it holds; each broken variant (locks out of order, no turn sent, one limit
    checked, a handoff admitting a waiter with a limit it does not hold) has its
    counterexample. With a throttle key (X6c, X6d) the window's admissions never
    exceed its limit, and a handoff that admits a throttle carrier over-admits."""
    result = check.run(config, timeout=240)
    if config.expect_violation:
        assert result.errors > 0, result.output[-2000:]
        over_admits = any(m in str(config.macros) for m in ("FIRST_ONLY", "BROKEN_HANDOFF", "THROTTLE_HANDOFF"))
        expected = "assertion violated" if over_admits else "invalid end state"
        assert expected in check.violation(result.output), result.output[-2000:]
    else:
        assert result.errors == 0, result.output[-4000:] + "\n" + "\n".join(check.summarize_trail(result.trail))
        assert result.states > 100_000, result.output[-2000:]
