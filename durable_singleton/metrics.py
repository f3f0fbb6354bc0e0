"""Prometheus metrics (O4), with the optional extra ``durable-singleton[prometheus]``.

Every metric is labelled by ``workflow`` (and ``kind`` for audit findings),
never by key: keys are unbounded. A shared quota (X3) is labelled as the
workflow ``quota:<name>``, a throttle (X6) as ``throttle:<name>``, as the key
controls and the audit name them: their holders, waiters and oldest wait are
over all their keys (a throttle has no holders: it bounds admissions).

Read from the engine's store at each scrape, so they are the same whichever
process is scraped: the holders, waiters and oldest wait
(:meth:`~durable_singleton.stores.base.BaseStore.slot_counts`; on the Django
store one grouped query over the runs and one over the quota memberships),
the unrenewed leases
(:meth:`~durable_singleton.stores.base.BaseStore.unrenewed_leases`, one
grouped query after a read of the store's clock), the audit's findings in the
several reads of a full slot audit
(:func:`~durable_singleton.audit.audit_slots`, K4); ages are on the store's
clock:

* ``durable_singleton_holders{workflow}``: active runs holding a slot;
* ``durable_singleton_waiters{workflow}``: active runs waiting for a slot;
* ``durable_singleton_oldest_wait_seconds{workflow}``: age of the oldest waiter;
* ``durable_singleton_audit_findings{workflow,kind}``: findings of the slot
  audit (K4, not repaired by the scrape);
* ``durable_singleton_unrenewed_leases{workflow}``: running runs whose lease
  was not renewed for longer than the renewal interval, on the database's
  clock (:func:`~durable_singleton.renewals.unrenewed_q`, K3): their workers
  were killed, are frozen or are cut off;
* ``durable_singleton_throttled_waiters{workflow}``: the waiters of a
  throttle (X6, labelled ``throttle:<name>``, over all its keys) parked over
  its rate until its window opens (their ``not_before`` later than the
  store's now); the throttle's waiters and oldest wait are in
  ``durable_singleton_waiters`` and ``durable_singleton_oldest_wait_seconds``
  under the same label
  (:meth:`~durable_singleton.stores.base.BaseStore.throttle_waiter_counts`;
  on the Django store one grouped query over the throttle memberships).

Counted in the process that sees the event (per process, like any
prometheus_client counter without multiprocess mode):

* ``durable_singleton_admissions_total{workflow}``: runs admitted to a slot
  (the ``run_admitted`` signal);
* ``durable_singleton_debounced_starts_total{workflow}``: starts folded into
  their debounce key's open run (the ``run_debounced`` signal, X7);
* ``durable_singleton_handoff_seconds{workflow}`` (histogram): from a
  holder's end to the admission of the next run of its key, when both happen
  in this process (the embedded worker; Celery's ``execute_chain`` handoff);
* ``durable_singleton_tick_seconds`` (histogram): duration of each tick.

Serve them with :func:`metrics_view` (``path("metrics", metrics_view)``), or
add :data:`REGISTRY`'s collectors to your own exposition.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .admission import quota_lock_name, throttle_lock_name

__all__ = [
    "ADMISSIONS",
    "DEBOUNCED",
    "HANDOFF",
    "REGISTRY",
    "THROTTLED",
    "TICK",
    "DatabaseCollector",
    "connect",
    "metrics_view",
    "observe_tick",
]

#: The registry of this app's metrics (served by :func:`metrics_view`).
REGISTRY = CollectorRegistry(auto_describe=True)

ADMISSIONS = Counter(
    "durable_singleton_admissions", "Runs admitted to a slot of their key.", ["workflow"], registry=REGISTRY
)
DEBOUNCED = Counter(
    "durable_singleton_debounced_starts",
    "Starts folded into their debounce key's open run (X7).",
    ["workflow"],
    registry=REGISTRY,
)
HANDOFF = Histogram(
    "durable_singleton_handoff_seconds",
    "Seconds from a holder's end to the admission of the next run of its key (same process).",
    ["workflow"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=REGISTRY,
)
THROTTLED = Counter(
    "durable_singleton_throttled_parks",
    "Claims that parked a run over a throttle's rate until its window opens (X6).",
    ["throttle"],
    registry=REGISTRY,
)
TICK = Histogram(
    "durable_singleton_tick_seconds",
    "Duration of one tick.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)

# (workflow, key) -> monotonic time its last holder ended, in this process.
# Bounded: entries are taken by the next admission, and dropped past _MAX_PENDING.
_released: dict[tuple[str, str], float] = {}
_released_lock = threading.Lock()
_MAX_PENDING = 10_000


def observe_tick(seconds: float) -> None:
    """Record one tick's duration, in seconds."""
    TICK.observe(seconds)


def _on_tick(sender: Any, seconds: float, **kwargs: Any) -> None:
    observe_tick(seconds)


def _on_finished(sender: Any, run: Any, **kwargs: Any) -> None:
    if run.singleton_key is None:
        return
    with _released_lock:
        if len(_released) >= _MAX_PENDING:
            _released.clear()
        _released[(run.workflow_name, run.singleton_key)] = time.monotonic()


def _on_parked(sender: Any, run: Any, throttle: str | None = None, **kwargs: Any) -> None:
    if throttle:
        THROTTLED.labels(throttle=throttle).inc()


def _on_admitted(sender: Any, run: Any, **kwargs: Any) -> None:
    ADMISSIONS.labels(workflow=run.workflow_name).inc()
    if run.singleton_key is None:
        return
    with _released_lock:
        ended = _released.pop((run.workflow_name, run.singleton_key), None)
    if ended is not None:
        HANDOFF.labels(workflow=run.workflow_name).observe(time.monotonic() - ended)


def _on_debounced(sender: Any, run: Any, **kwargs: Any) -> None:
    DEBOUNCED.labels(workflow=run.workflow_name).inc()


class DatabaseCollector(Collector):
    """Holders, waiters, oldest wait and audit findings per workflow, read at each scrape."""

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Name the metrics without reading the database (called at registration)."""
        yield from self._families()

    @staticmethod
    def _families() -> tuple[
        GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily
    ]:
        return (
            GaugeMetricFamily("durable_singleton_holders", "Active runs holding a slot.", labels=["workflow"]),
            GaugeMetricFamily("durable_singleton_waiters", "Active runs waiting for a slot.", labels=["workflow"]),
            GaugeMetricFamily(
                "durable_singleton_oldest_wait_seconds", "Age of the oldest waiter, in seconds.", labels=["workflow"]
            ),
            GaugeMetricFamily(
                "durable_singleton_audit_findings", "Slot audit findings (K4).", labels=["workflow", "kind"]
            ),
            GaugeMetricFamily(
                "durable_singleton_unrenewed_leases",
                "Running runs whose lease was not renewed for longer than the renewal interval (K3).",
                labels=["workflow"],
            ),
            GaugeMetricFamily(
                "durable_singleton_throttled_waiters",
                "Waiters of a throttle parked over its rate until its window opens (X6).",
                labels=["workflow"],
            ),
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from .audit import FindingKind, audit_slots
        from .runtime import get_engine

        engine = get_engine()
        store = engine.store
        holders, waiters, oldest, findings, unrenewed, throttled = self._families()
        workflows = sorted(d.name for d in list(engine.registry.latest.values()) if d.singleton is not None)
        workflows += sorted(quota_lock_name(name) for name in list(engine.registry.quotas))
        seen: dict[str, dict[str, float]] = {"holder": {}, "waiter": {}}
        # Ages and leases on the store's clock, read once (R5).
        now = store.now()
        # The workflows, and the quotas (X3j) labelled as the key table and the controls name them: quota:<name>.
        for count in store.slot_counts():
            seen["holder"][count.name] = count.holders
            seen["waiter"][count.name] = count.waiters
            if count.waiters and count.oldest_waiter_at is not None:
                oldest.add_metric([count.name], (now - count.oldest_waiter_at).total_seconds())
        # The throttles (X6), labelled throttle:<name>: their waiters, and those over the rate.
        over_rate = {name: 0 for name in map(throttle_lock_name, list(engine.registry.throttles))}
        for wait in store.throttle_waiter_counts():
            seen["waiter"][wait.name] = wait.waiters
            over_rate[wait.name] = wait.over_rate
            if wait.waiters and wait.oldest_waiter_at is not None:
                oldest.add_metric([wait.name], (now - wait.oldest_waiter_at).total_seconds())
        for name in sorted(over_rate):
            throttled.add_metric([name], over_rate[name])
            seen["waiter"].setdefault(name, 0)
        counts = audit_slots(engine).by_workflow()
        names = sorted({*workflows, *(workflow for workflow, _ in counts)})
        for workflow in names:
            for kind in FindingKind:
                findings.add_metric([workflow, str(kind)], counts.get((workflow, str(kind)), 0))
        stale, _ = store.unrenewed_leases(settings=engine.settings, now=now, limit=0)
        for workflow in sorted({*workflows, *stale}):
            unrenewed.add_metric([workflow], stale.get(workflow, 0))
        for workflow in sorted({*workflows, *seen["holder"], *seen["waiter"]}):
            holders.add_metric([workflow], seen["holder"].get(workflow, 0))
            waiters.add_metric([workflow], seen["waiter"].get(workflow, 0))
        yield holders
        yield waiters
        yield oldest
        yield findings
        yield unrenewed
        yield throttled


REGISTRY.register(DatabaseCollector())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve :data:`REGISTRY` in the Prometheus text format (protect it like any internal URL)."""
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)


def connect() -> None:
    """Connect the receivers that count admissions, handoffs, folded starts and throttled parks (idempotent)."""
    from . import signals

    signals.run_finished.connect(_on_finished, dispatch_uid="durable_singleton.metrics_finished")
    signals.run_admitted.connect(_on_admitted, dispatch_uid="durable_singleton.metrics_admitted")
    signals.tick_finished.connect(_on_tick, dispatch_uid="durable_singleton.metrics_tick")
    signals.run_debounced.connect(_on_debounced, dispatch_uid="durable_singleton.metrics_debounced")
    signals.run_parked.connect(_on_parked, dispatch_uid="durable_singleton.metrics_parked")
