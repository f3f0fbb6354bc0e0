"""A holder whose lease is no longer renewed (K3, R5, issue #19 item 3): the one rule
(durable_singleton.renewals) and what explain, durable_health, the metrics and the admin's
pages say with it, on the in-memory store and the DATABASE_URL database.

A lease claimed for ``LEASE_SECONDS - s`` reads, on the database's clock, as last
renewed ``s`` seconds ago (its expiry minus ``LEASE_SECONDS``): these tests plant an
unrenewed lease that way, without waiting. tests/core/test_unrenewed_lease_process_killed.py kills a
real worker with SIGKILL.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from durable_singleton import heartbeat
from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.explain import ExplainState, estimate_wait
from durable_singleton.renewals import lease_state, renewal_slack, unrenewed_q
from durable_singleton.runtime import get_engine
from tests.conftest import Monitor
from tests.helpers import admitted, audited, claim, running_run

#: Seconds since the planted lease's last renewal: longer than the 10 s interval.
SILENT = 15.0


def _hold(engine: Engine, run_id: str, *, silent: float = 0.0, owner: str = "vm:16319:dead") -> None:
    """Make ``run_id`` a holder through the store's claim, its lease last renewed ``silent`` s ago."""
    turn = claim(engine, run_id, owner, lease_seconds=engine.settings.LEASE_SECONDS - silent)
    assert admitted(turn) == "admitted"


def _queue(engine: Engine, registry: Registry, monitor: Monitor, *names: str, silent: float = SILENT) -> None:
    """Start ``names`` on key K: the first holds with an unrenewed lease, the others wait in line."""
    audited(registry, monitor)
    for name in names:
        engine.start("wf", {"k": "K"}, run_id=name)
    _hold(engine, names[0], silent=silent)
    for name in reversed(names[1:]):
        assert engine.execute(name) == "parked"
    engine.dispatcher.queue.clear()


def test_the_rule_reads_the_last_renewal_from_the_expiry_and_judges_on_the_given_clock() -> None:
    """K3, R5: the last renewal is ``lease_expires_at - LEASE_SECONDS``; a lease is unrenewed
    once silent for longer than LEASE_RENEW_SECONDS plus the slack (half of it, at most 1 s),
    or expired; only a running run has one; recovery is at the expiry."""
    settings = Settings.from_mapping({"LEASE_SECONDS": 30.0, "LEASE_RENEW_SECONDS": 10.0})
    now = datetime(2026, 1, 1, 19, 25, 40, tzinfo=UTC)
    assert renewal_slack(10.0) == 1.0 and renewal_slack(0.5) == 0.25

    def at(silent: float, status: str = "running") -> Any:
        return lease_state(status, "w", now + timedelta(seconds=30 - silent), settings=settings, now=now)

    assert at(10.9).unrenewed is False and at(11.1).unrenewed is True
    assert at(11.1).not_renewed_seconds == pytest.approx(11.1)
    assert at(11.1).recovery_at == now + timedelta(seconds=18.9) and not at(11.1).expired
    assert at(11.1).seconds_to_recovery(now) == pytest.approx(18.9)
    assert at(31).expired and at(31).unrenewed and at(31).seconds_to_recovery(now) == 0.0
    assert at(-5).not_renewed_seconds == 0.0 and not at(-5).unrenewed  # renewed "in the future": never stale
    assert at(20, "suspended") is None
    assert lease_state("running", "w", None, settings=settings, now=now) is None
    # A lease shorter than the interval plus its slack is unrenewed once expired.
    short = Settings.from_mapping({"LEASE_SECONDS": 2.0, "LEASE_RENEW_SECONDS": 1.9})
    late = lease_state("running", "w", now - timedelta(seconds=0.1), settings=short, now=now)
    assert late is not None and late.expired and late.unrenewed


@pytest.mark.django_db
def test_the_sql_twin_agrees_with_the_rule_on_the_databases_clock() -> None:
    """K3, R5: :func:`unrenewed_q` selects exactly the rows :func:`lease_state` calls
    unrenewed, on a value read from the database's clock."""
    from durable_singleton.models import Run
    from durable_singleton.stores.django import DjangoStore

    settings = Settings.from_mapping({"LEASE_SECONDS": 30.0, "LEASE_RENEW_SECONDS": 10.0})
    now = DjangoStore().now()
    cases = {
        "fresh": ("running", 1.0),
        "late-within-slack": ("running", 10.5),
        "unrenewed": ("running", 12.0),
        "expired": ("running", 45.0),
        "parked": ("suspended", 45.0),
    }
    for run_id, (status, silent) in cases.items():
        running_run(run_id, "wf", "w", now, 30 - silent, status=status)
    rows = Run.objects.values_list("run_id", "status", "lease_owner", "lease_expires_at")
    by_rule = {
        run_id
        for run_id, status, owner, expires in rows
        if (lease := lease_state(status, owner, expires, settings=settings, now=now)) and lease.unrenewed
    }
    by_sql = set(Run.objects.filter(unrenewed_q(settings=settings, now=now)).values_list("run_id", flat=True))
    assert by_rule == by_sql == {"unrenewed", "expired"}


def test_an_unrenewed_holder_is_explained_as_such_with_its_recovery(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3: a holder whose lease was not renewed for longer than LEASE_RENEW_SECONDS is not
    said to be running: "not renewed for N s (renewed every 10 s); recovered at T", T its
    lease's expiry; the data carries both. A freshly renewed holder reads as running."""
    _queue(engine, registry, monitor, "A", "B")
    found = engine.explain("A")
    expiry = engine.get("A").lease_expires_at
    assert found.state is ExplainState.HOLDER and expiry is not None
    assert "it is running (lease held by" not in found.sentence
    assert "its lease (held by vm:16319:dead) was not renewed for 15 s (renewed every 10 s)" in found.sentence
    assert f"recovered at {expiry:%Y-%m-%d %H:%M:%S} UTC" in found.sentence
    assert found.recovery_at == expiry and found.not_renewed_seconds == pytest.approx(SILENT, abs=5)
    assert found.as_dict()["recovery_at"] == expiry.isoformat()

    engine.start("wf", {"k": "L"}, run_id="F")
    _hold(engine, "F")
    fresh = engine.explain("F")
    assert "it is running (lease held by vm:16319:dead)" in fresh.sentence
    assert fresh.not_renewed_seconds is None and fresh.recovery_at is None


def test_a_waiter_behind_an_unrenewed_holder_waits_at_least_until_its_recovery(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3: with no completed run to estimate from, the waiter's estimate is the time until
    the holder's recovery, said as a lower bound ("at least"), never "about 0.0 s"; the
    holder is named with its unrenewed lease."""
    _queue(engine, registry, monitor, "A", "B", "C")
    lease = engine.get("A").lease_expires_at
    assert lease is not None
    found = engine.explain("B")
    to_recovery = (lease - engine.store.now()).total_seconds()
    assert found.state is ExplainState.WAITER and found.estimate_is_lower_bound
    assert found.estimated_wait_seconds is not None
    assert to_recovery - 1 <= found.estimated_wait_seconds <= to_recovery + 1
    assert "estimated wait at least 1" in found.sentence and "until the recovery of A" in found.sentence
    assert "behind A (running, holding for " in found.sentence and "lease not renewed for 1" in found.sentence
    assert found.holders[0].recovery_at == lease
    later = engine.explain("C")
    assert later.estimated_wait_seconds is not None and later.estimated_wait_seconds >= to_recovery - 1


def test_with_recent_runs_the_estimate_adds_the_recovery_to_the_typical_duration(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3: the median of the key's recent runs is counted after the unrenewed holder's
    recovery: the estimate is at least the time to recovery, said with "after the recovery of"."""
    audited(registry, monitor)
    for n in range(3):
        engine.start("wf", {"k": "K"}, run_id=f"done-{n}")
        engine.dispatcher.drain()  # type: ignore[attr-defined]
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    _hold(engine, "A", silent=SILENT)
    assert engine.execute("B") == "parked"
    engine.dispatcher.queue.clear()
    lease = engine.get("A").lease_expires_at
    assert lease is not None
    found = engine.explain("B")
    assert found.recent_durations == 3 and not found.estimate_is_lower_bound
    assert found.estimated_wait_seconds is not None
    assert found.estimated_wait_seconds >= (lease - engine.store.now()).total_seconds() - 1
    assert "(median of the last 3 runs, after the recovery of A)" in found.sentence


def test_estimate_waits_for_an_unrenewed_holders_recovery_then_a_whole_run() -> None:
    """K3: an unrenewed holder frees its slot after its recovery plus a typical run (its body
    runs again), whatever it already held; a live one as before."""
    assert estimate_wait(1, 1, [90.0], 30.0, [12.0]) == 42.0
    assert estimate_wait(2, 1, [90.0], 30.0, [12.0]) == 72.0
    assert estimate_wait(1, 2, [5.0, 90.0], 30.0, [None, 12.0]) == 25.0  # the live one frees first
    assert estimate_wait(1, 1, [90.0], 0.0, [12.0]) == 12.0  # no typical run: the recovery alone
    assert estimate_wait(1, 1, [10.0], 30.0) == 20.0  # no recovery given: unchanged


@pytest.fixture
def manual(settings: Any) -> Engine:
    """The default engine (commands, admin), on the manual dispatcher."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    heartbeat._written.pop(engine, None)  # the engine outlives the test database
    return engine


def _health(*args: str) -> tuple[int, dict[str, Any], str]:
    out = io.StringIO()
    try:
        call_command("durable_health", *args, stdout=out)
        code = 0
    except CommandError as exc:
        code = exc.returncode
    return code, (json.loads(out.getvalue()) if "--json" in args else {}), out.getvalue()


def _key_queue(engine: Engine, silent: float = SILENT) -> None:
    """On the test project's sync-inventory (limit 1): W1 holds key store:D with an unrenewed
    lease (a live one when ``silent`` is 0); W2 waits in line, its retry due in about a second."""
    for name in ("W1", "W2"):
        engine.start("sync-inventory", {"store_id": "D"}, run_id=name)
    _hold(engine, "W1", silent=silent)
    assert engine.execute("W2") == "parked"
    engine.dispatcher.queue.clear()


@pytest.mark.django_db(transaction=True)
def test_health_warns_about_an_unrenewed_lease_and_stays_healthy(manual: Engine) -> None:
    """K3, O3: ``durable_health`` names the unrenewed holder ("not renewed for N s ...;
    recovered at T") as a warning; it exits 0 while the tick will recover it (a lease still
    not re-driven two ticks after its expiry is the expired_lease problem, K4). A live
    holder gives no warning."""
    manual.tick()
    _key_queue(manual, silent=0.0)
    code, report, _ = _health("--json")
    assert code == 0 and report["warnings"] == [] and report["unrenewed_leases"] == 0, report
    manual.store.renew_lease("W1", "vm:16319:dead", manual.settings.LEASE_SECONDS - SILENT)
    code, report, _ = _health("--json")
    assert code == 0 and report["healthy"] and report["unrenewed_leases"] == 1, report
    [warning] = report["warnings"]
    assert warning["kind"] == "unrenewed_lease"
    assert warning["detail"].startswith("run W1 of sync-inventory (key 'store:D'): lease of vm:16319:dead not renewed")
    assert "(renewed every 10 s); recovered at " in warning["detail"]
    code, _, text = _health()
    assert code == 0 and "warning unrenewed_lease: run W1" in text
    assert text.rstrip().endswith("healthy with warnings: 1 unrenewed lease(s)")


@pytest.mark.django_db(transaction=True)
def test_metrics_count_unrenewed_leases_per_workflow(manual: Engine) -> None:
    """K3, O4: the gauge durable_singleton_unrenewed_leases counts them by the same rule."""
    pytest.importorskip("prometheus_client")
    from durable_singleton.metrics import REGISTRY

    _key_queue(manual)
    value = REGISTRY.get_sample_value("durable_singleton_unrenewed_leases", {"workflow": "sync-inventory"})
    assert value == 1.0


@pytest.mark.django_db(transaction=True)
def test_admin_pages_say_the_same_about_an_unrenewed_holder_and_an_overdue_waiter(
    manual: Engine, admin_client: Any
) -> None:
    """K3, R5, D4: the key page marks the holder's row unrenewed with the same words as explain;
    the waiter's past retry reads, in neutral words, "waiting for the holder's lease to expire
    at T" (a normal recovery: never a red "overdue since", issue #34 item 7); the
    waiter's page is titled "(waiting)" as its status reads, and its "doing" is its place in
    line, never "parked, next turn in ..." beside an estimate; the holder's page says its lease
    was not renewed."""
    import time

    from django.urls import reverse

    _key_queue(manual)
    wake = manual.get("W2").wake_at
    assert wake is not None
    time.sleep(max(0.0, (wake - manual.store.now()).total_seconds()) + 0.2)  # the retry is due, nobody takes it
    key_page = admin_client.get(
        reverse("admin:durable_singleton_run_queue_key") + "?workflow=sync-inventory&key=store:D"
    ).content.decode()
    holder_row = re.search(r'<tr class="ds-holder([^"]*)" data-run-id="W1">(.*?)</tr>', key_page, re.S)
    assert holder_row is not None and "ds-unrenewed" in holder_row[1]
    assert "lease not renewed for 1" in holder_row[2] and "(renewed every 10 s); recovered at " in holder_row[2]
    assert '<td class="ds-cause" data-cause="unrenewed">not renewed</td>' in holder_row[2]
    waiter_row = re.search(r'<tr class="ds-waiter" data-run-id="W2".*?</tr>', key_page, re.S)
    assert waiter_row is not None and "overdue" not in waiter_row[0], waiter_row
    expires = manual.get("W1").lease_expires_at
    assert expires is not None
    clock = timezone.localtime(expires).strftime("%H:%M:%S")
    assert re.search(rf"waiting for the holder(&#x27;|')s lease to expire at <time[^>]*>{clock}</time>", waiter_row[0])
    assert "First in line:" in key_page and "until the recovery of W1" in key_page

    waiter_page = admin_client.get(reverse("admin:durable_singleton_run_change", args=["W2"])).content.decode()
    assert "sync-inventory W2 (waiting)" in waiter_page and "(pending)" not in waiter_page
    assert "parked, next turn" not in waiter_page and "in line for a slot" in waiter_page
    assert "overdue since" not in waiter_page and "lease to expire at" in waiter_page

    holder_page = admin_client.get(reverse("admin:durable_singleton_run_change", args=["W1"])).content.decode()
    assert "lease not renewed for 1" in holder_page and "it is not known to be running" in holder_page
    assert "(renewed every 10 s); recovered at " in holder_page


@pytest.mark.django_db(transaction=True)
def test_the_lanes_mark_an_unrenewed_holders_bar(manual: Engine, admin_client: Any) -> None:
    """K3: on the lanes page, the bar of a holder whose lease was not renewed is marked
    (``data-unrenewed``) and its tooltip says so in the same words; a live holder's is not."""
    from django.urls import reverse

    from durable_singleton.lanes import workflow_lanes

    _key_queue(manual)
    manual.start("sync-inventory", {"store_id": "E"}, run_id="LIVE")
    _hold(manual, "LIVE")
    lanes = workflow_lanes("sync-inventory", now=manual.store.now(), settings=manual.settings)
    held = {h.run_id: h.unrenewed for lane in lanes.lanes for h in lane.holds}
    assert held["W1"] is not None and held["W1"].unrenewed and held["LIVE"] is None
    page = admin_client.get(reverse("admin:durable_singleton_run_lanes") + "?workflow=sync-inventory").content.decode()
    bar = re.search(r'<rect class="[^"]*ds-hold-unrenewed[^"]*" data-run-id="([^"]+)"[^>]*>\s*<title>([^<]*)', page)
    assert bar is not None and bar[1] == "W1", page
    assert "lease not renewed for 1" in bar[2] and "(renewed every 10 s); recovered at " in bar[2]
    assert page.count('data-unrenewed="1"') == 1
