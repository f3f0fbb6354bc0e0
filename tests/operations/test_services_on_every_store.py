"""The slot audit, ``durable_health`` and the metrics read through the store
(issue 32, item 5), so they give the same answers on the in-memory store
(``durable_singleton.testing``) as on the Django store for the same scenario
(K4, O3, O4, K2, K3, X3j, X6). Before, the audit of the in-memory store was
empty, its health report skipped every check and its gauges read nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from durable_singleton import Quota, Throttle
from durable_singleton.audit import audit_slots
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.health import check_health
from durable_singleton.heartbeat import record_tick
from durable_singleton.stores.memory import MemoryStore

from ..helpers import claim, plant_run_fields


def _make_holder(engine: Engine, run_id: str) -> None:
    """Mark ``run_id`` as a holder behind the claim's back (a fault the audit reports)."""
    if isinstance(engine.store, MemoryStore):
        plant_run_fields(engine.store, run_id, admitted=True)
    else:
        plant_run_fields(engine.store, run_id, singleton_slot="holder")


def _record_admissions(engine: Engine, throttle: str, key: str, at: datetime, count: int) -> None:
    """Record ``count`` admissions of a throttle key at ``at``, behind the claim's back."""
    store = engine.store
    if isinstance(store, MemoryStore):
        with store._critical():
            store._throttle_admissions.setdefault((throttle, key), []).extend([at] * count)
    else:
        from durable_singleton.models import ThrottleAdmission

        ThrottleAdmission.objects.bulk_create(
            [ThrottleAdmission(throttle=throttle, key=key, run_id=f"R{n}", admitted_at=at) for n in range(count)]
        )


@pytest.fixture
def scenario(make: Callable[..., Engine], registry: Registry) -> Engine:
    """One scenario, built through the engine and the store on either store.

    Key A: holder H, waiters W1 and W2. Key B: waiter S, never sent a turn.
    Key C: E running, its lease expired 600 s ago and not re-driven. Key D: D1
    admitted and D2 marked holder behind its back (over-admitted). Key F: two
    holders admitted under an override of 2, then lowered to 1 (K2: not a
    finding). Quota ``qs`` (limit 1): Q1 holds, Q2 waits. Throttle ``tr`` key
    ``x`` (limit 1 per 7200 s): two admissions recorded. A tick's heartbeat."""
    registry.add("par", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"], "limit": 1})
    registry.add("qq", "1", lambda ctx, i: None, quotas=[Quota("qs", limit=1)])
    registry.add(
        "tt", "1", lambda ctx, i: None, throttles=[Throttle("tr", key=lambda i: i["k"], limit=1, period=7200.0)]
    )
    engine = make(REDELIVERY_SECONDS=600.0, TICK_SECONDS=1.0)
    lease = engine.settings.LEASE_SECONDS

    def start(run_id: str, key: str, workflow: str = "par") -> None:
        engine.start(workflow, {"k": key}, run_id=run_id)

    for run_id in ("H", "W1", "W2"):
        start(run_id, "A")
    assert claim(engine, "H", lease_seconds=lease).state.value == "run"
    assert [claim(engine, w, lease_seconds=lease).state.value for w in ("W1", "W2")] == ["parked", "parked"]
    start("S", "B")
    start("E", "C")
    assert claim(engine, "E", lease_seconds=lease).state.value == "run"
    expired = engine.store.now() - timedelta(seconds=600)
    plant_run_fields(engine.store, "E", lease_expires_at=expired, wake_at=None)
    start("D1", "D")
    start("D2", "D")
    assert claim(engine, "D1", lease_seconds=lease).state.value == "run"
    _make_holder(engine, "D2")
    engine.override_limit("par", "F", 2)
    start("F1", "F")
    start("F2", "F")
    assert [claim(engine, f, lease_seconds=lease).state.value for f in ("F1", "F2")] == ["run", "run"]
    engine.override_limit("par", "F", 1)
    start("Q1", "-", "qq")
    start("Q2", "-", "qq")
    assert [claim(engine, q, lease_seconds=lease).state.value for q in ("Q1", "Q2")] == ["run", "parked"]
    _record_admissions(engine, "tr", "x", engine.store.now(), 2)
    record_tick(engine, engine.now())
    return engine


Row = tuple[str, str, str | None, str | None, bool]


def _findings(report: Any) -> list[Row]:
    return sorted((str(f.kind), f.workflow, f.key, f.run_id, f.repaired) for f in report.findings)


def test_the_slot_audit_gives_the_same_findings_on_every_store(scenario: Engine) -> None:
    """K4, K2, X3j, X6: now, the over-admitted key D and throttle key, and E's lease
    expired 600 s ago; an hour later, every lease expired and S stalled behind
    key B's free slot too. The lowered override of key F and the full quota are
    not findings. Repair wakes S and re-drives the leases (R5a, R8); then none is
    left to repair. The same on the in-memory and the Django store."""
    engine = scenario
    over: list[Row] = [
        ("over_admitted", "par", "D", None, False),
        ("over_admitted", "throttle:tr", "x", None, False),
    ]
    assert _findings(audit_slots(engine)) == sorted([("expired_lease", "par", "C", "E", False), *over])
    later = engine.store.now() + timedelta(seconds=3600)
    expired: list[Row] = [("expired_lease", w, k, r, False) for w, k, r in [("par", "A", "H"), ("par", "C", "E")]]
    expired += [("expired_lease", "par", "D", "D1", False), ("expired_lease", "par", "F", "F1", False)]
    expired += [("expired_lease", "par", "F", "F2", False), ("expired_lease", "qq", None, "Q1", False)]
    stalled: list[Row] = [("stalled_waiter", "par", "B", "S", False)]
    assert _findings(audit_slots(engine, now=later)) == sorted([*expired, *over, *stalled])
    repaired = _findings(audit_slots(engine, now=later, repair=True))
    assert repaired == sorted([*((*f[:4], True) for f in expired + stalled), *over])
    woken = engine.get("S").wake_at
    assert woken is not None and woken <= engine.store.now()
    assert set(engine.dispatcher.sent) >= {"S", "E", "H"}  # type: ignore[attr-defined]


def test_health_gives_the_same_report_on_every_store(scenario: Engine) -> None:
    """O3, K3, K4: now, three waiters, no backlog, E's unrenewed lease warned
    about, the audit's findings as problems; an hour later, the stale tick and D2
    (pending, never started, not a waiter) as backlog too. The same on the
    in-memory and the Django store."""
    engine = scenario
    report = check_health(engine, stale_seconds=3600, backlog_seconds=3600)
    assert (report.waiting, report.backlog, report.unrenewed_leases) == (3, 0, 1)
    assert sorted(p.kind for p in report.problems) == ["expired_lease", "over_admitted", "over_admitted"]
    assert [w.detail.split(":")[0] for w in report.warnings] == ["run E of par (key 'C')"]
    later = engine.store.now() + timedelta(seconds=3600)
    report = check_health(engine, stale_seconds=60, backlog_seconds=60, now=later)
    assert (report.waiting, report.backlog, report.healthy) == (3, 1, False)
    kinds = sorted({p.kind for p in report.problems})
    assert kinds == ["backlog", "expired_lease", "over_admitted", "stale_tick", "stalled_waiter"]


def test_the_metrics_give_the_same_gauges_on_every_store(scenario: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """O4, X3j, K3, K4: holders, waiters, oldest wait, audit findings and
    unrenewed leases by workflow (a quota as ``quota:<name>``), read through the
    engine's store: the same on the in-memory and the Django store."""
    pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
    from durable_singleton import runtime
    from durable_singleton.metrics import DatabaseCollector

    monkeypatch.setattr(runtime, "get_engine", lambda: scenario)
    families = {f.name: f.samples for f in DatabaseCollector().collect()}

    def values(name: str, **labels: str) -> dict[str, float]:
        return {
            s.labels["workflow"]: s.value
            for s in families[name]
            if s.value and all(s.labels.get(k) == v for k, v in labels.items())
        }

    assert values("durable_singleton_holders") == {"par": 6, "quota:qs": 1}
    assert values("durable_singleton_waiters") == {"par": 3, "quota:qs": 1}
    assert set(values("durable_singleton_oldest_wait_seconds")) <= {"par", "quota:qs"}
    assert {s.labels["workflow"] for s in families["durable_singleton_oldest_wait_seconds"]} == {"par", "quota:qs"}
    assert all(s.value >= 0 for s in families["durable_singleton_oldest_wait_seconds"])
    assert values("durable_singleton_unrenewed_leases") == {"par": 1}
    assert values("durable_singleton_audit_findings", kind="over_admitted") == {"par": 1, "throttle:tr": 1}
    assert values("durable_singleton_audit_findings", kind="expired_lease") == {"par": 1}
