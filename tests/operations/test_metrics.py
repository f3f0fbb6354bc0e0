"""Prometheus metrics (O4): the test project's /metrics endpoint is scraped
and shows holders, waiters, oldest wait, admissions, handoff latency, tick
duration and audit findings, labelled by workflow and never by key."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine

prometheus_client = pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.django_db(transaction=True)


def _scrape() -> dict[str, list[Any]]:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.content.decode())}


def _value(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
def manual(settings: Any) -> Engine:
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    return get_engine()


def test_metrics_endpoint_shows_the_figures_by_workflow(manual: Engine) -> None:
    """O4: a key with a holder and two waiters, a handoff, a tick and a
    planted expired lease, as scraped from /metrics."""
    before = _scrape()
    admissions0 = _value(
        before["durable_singleton_admissions"], "durable_singleton_admissions_total", workflow="fault-hold"
    )
    handoffs0 = _value(
        before["durable_singleton_handoff_seconds"], "durable_singleton_handoff_seconds_count", workflow="fault-hold"
    )
    ticks0 = _value(before["durable_singleton_tick_seconds"], "durable_singleton_tick_seconds_count")

    runs = [manual.start("fault-hold", {"store_id": "m", "seconds": 0}, run_id=f"m-{n}") for n in range(3)]
    manual.dispatcher.drain()  # type: ignore[attr-defined]  # all three run, one after the other
    assert {manual.get(r.run_id).status for r in runs} == {"completed"}
    holder = manual.start("fault-hold", {"store_id": "n", "seconds": 0}, run_id="n-0")
    for n in (1, 2):
        manual.start("fault-hold", {"store_id": "n", "seconds": 0}, run_id=f"n-{n}")
    Run.objects.filter(pk=holder.run_id).update(
        status="running",
        singleton_slot="holder",
        lease_owner="x:1:y",
        lease_expires_at=timezone.now() - timedelta(minutes=5),
    )
    Run.objects.filter(pk__in=["n-1", "n-2"]).update(created_at=timezone.now() - timedelta(seconds=90))
    manual.dispatcher.queue.clear()  # type: ignore[attr-defined]
    manual.tick()
    manual.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk=holder.run_id).update(wake_at=None)  # the tick's re-drive was never taken

    after = _scrape()
    assert _value(after["durable_singleton_holders"], "durable_singleton_holders", workflow="fault-hold") == 1
    assert _value(after["durable_singleton_waiters"], "durable_singleton_waiters", workflow="fault-hold") == 2
    oldest = _value(
        after["durable_singleton_oldest_wait_seconds"], "durable_singleton_oldest_wait_seconds", workflow="fault-hold"
    )
    assert 80 < oldest < 600
    admissions = _value(
        after["durable_singleton_admissions"], "durable_singleton_admissions_total", workflow="fault-hold"
    )
    assert admissions - admissions0 == 3
    handoffs = _value(
        after["durable_singleton_handoff_seconds"], "durable_singleton_handoff_seconds_count", workflow="fault-hold"
    )
    assert handoffs - handoffs0 == 2  # m-1 and m-2 took the slot m-0 and m-1 released, in this process
    assert _value(after["durable_singleton_tick_seconds"], "durable_singleton_tick_seconds_count") - ticks0 >= 1
    findings = after["durable_singleton_audit_findings"]
    assert _value(findings, "durable_singleton_audit_findings", workflow="fault-hold", kind="expired_lease") == 1
    for samples in after.values():
        for sample in samples:
            assert "key" not in sample.labels, sample


def test_log_records_carry_structured_fields_and_no_input(manual: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """O4: lifecycle log records carry run_id, workflow and key as fields;
    no record at INFO or above contains the run's input or output."""
    secret = "do-not-log-this-input"
    with caplog.at_level(logging.DEBUG, logger="durable_singleton"):
        run = manual.start("fault-hold", {"store_id": "s", "seconds": 0, "note": secret}, run_id="log-0")
        manual.dispatcher.drain()  # type: ignore[attr-defined]
    ended = [r for r in caplog.records if getattr(r, "run_id", None) == run.run_id and "ended" in r.getMessage()]
    assert ended and ended[0].workflow == "fault-hold" and ended[0].key == "store:s"  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and secret in r.getMessage()]


def test_a_throttles_waiters_and_those_over_its_rate_are_gauged(manual: Engine) -> None:
    """O4, X6: B and C, parked over the rate of ``erp-rate`` (1 per 10 min), are scraped as
    2 waiters and 2 throttled waiters under ``throttle:erp-rate`` (no gauge said so: a
    throttle's waiters were in no figure), never labelled by key."""
    from durable_singleton import Throttle
    from durable_singleton.definitions import Registry
    from durable_singleton.testing import make_engine
    from tests.helpers import drain

    registry = Registry()
    registry.add("sync", "1", lambda ctx, i: None, throttles=[Throttle("erp-rate", key=lambda i: i["t"], period=600.0)])
    engine = make_engine("django", registry=registry)
    for run_id in ("A", "B", "C"):
        engine.start("sync", {"t": "t1"}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["completed", "suspended", "suspended"]
    after = _scrape()
    label = {"workflow": "throttle:erp-rate"}
    assert _value(after["durable_singleton_waiters"], "durable_singleton_waiters", **label) == 2
    assert _value(after["durable_singleton_throttled_waiters"], "durable_singleton_throttled_waiters", **label) == 2
    assert any(s.labels == label for s in after["durable_singleton_oldest_wait_seconds"])
    for samples in after.values():
        for sample in samples:
            assert "key" not in sample.labels, sample
