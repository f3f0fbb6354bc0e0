"""A holder's worker killed with SIGKILL (K3, R5, D4, issue #19 item 3): a real
``manage.py durable_worker`` holds key ``store:kill`` with a slow body and is killed;
until its lease expires nothing is recovered, and every page and command must say so
instead of reassuring: ``durable_explain`` on the holder and on its waiter,
``durable_health``, and the admin's key and run pages. A second worker then recovers
the holder at its lease's expiry, and the waiter is admitted no sooner, as its estimate said.

The workers and this process share the lease settings: a 20 s lease renewed every
second, so the kill shows within a few seconds and leaves a long window before the
recovery.
"""

from __future__ import annotations

import io
import json
import re
import signal
import time
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import reverse

from durable_singleton import heartbeat
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.runtime import get_engine
from testproject.inventory.models import BodyAudit
from tests.worker_processes import DurableWorkers, wait_for, workers

__all__ = ["workers"]  # the fixture, imported for this module's tests

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "fault-hold"
KEY = "store:kill"
LEASE = 20.0
RENEW = 1.0


@pytest.fixture
def engine(settings: Any) -> Engine:
    """The default engine of the commands and the admin, with the workers' lease settings;
    it only writes runs (manual dispatcher, never drained): a new run is due at once, so the
    worker processes' tick executes it."""
    settings.DURABLE_SINGLETON = {
        **settings.DURABLE_SINGLETON,
        "DISPATCH": "manual",
        "LEASE_SECONDS": LEASE,
        "LEASE_RENEW_SECONDS": RENEW,
        "REDELIVERY_SECONDS": 0.0,
    }
    engine = get_engine()
    heartbeat._written.pop(engine, None)  # the engine outlives the test database
    return engine


def _start(engine: Engine, run_id: str, seconds: float, **more: float) -> None:
    engine.start(WORKFLOW, {"store_id": "kill", "seconds": seconds, **more}, run_id=run_id)


def _status(run_id: str) -> str:
    return str(Run.objects.values_list("status", flat=True).get(pk=run_id))


def test_a_killed_holder_is_said_to_be_unrenewed_everywhere_until_its_recovery(
    workers: DurableWorkers, engine: Engine, admin_client: Any
) -> None:
    """K3, R5, D4, O3: after SIGKILL of the worker running a holder,

    * ``durable_explain`` on the holder says its lease was "not renewed for N s" and when it
      is recovered (its lease's expiry), not "it is running (lease held by ...)";
    * on its waiter, the estimated wait is at least the time until that recovery (not about
      0 s, though the key's last run took 0.2 s);
    * ``durable_health`` warns about the holder and exits 0 (the tick will recover it);
    * the admin's key page marks the holder's row with the same words, shows the waiter's
      past retry as a wait for the holder's lease to expire (not "overdue since"), and the
      waiter's page is titled as its status reads;

    then a second worker recovers the holder at its lease's expiry (recoveries 1) and the
    waiter is admitted no sooner.
    """
    env = workers.env(DURABLE_LEASE_SECONDS=str(LEASE), DURABLE_LEASE_RENEW_SECONDS=str(RENEW))
    _start(engine, "first", 0.2)  # a recent duration for the key (the median the estimate uses)
    first = workers.start(env=env)
    wait_for(lambda: _status("first") == "completed", 120, "the first run completed", workers.logs)
    _start(engine, "holder", 120.0, seconds_after_recovery=0.2)
    wait_for(lambda: BodyAudit.objects.filter(run_id__startswith="holder#").exists(), 120, "the holder's body began")
    _start(engine, "waiter", 0.2)
    wait_for(
        lambda: Run.objects.filter(pk="waiter", singleton_slot="waiter", attempts__gte=1).exists(),
        120,
        "the waiter was parked in line",
        workers.logs,
    )
    first.kill(signal.SIGKILL)
    first.proc.wait(10)

    # The holder: no renewal for longer than RENEW, so no longer "running" (K3).
    killed = time.monotonic()

    def unrenewed() -> str | None:
        said = engine.explain("holder").sentence
        return said if "not renewed for" in said else None

    sentence = wait_for(
        unrenewed,
        60,
        "explain says the killed holder's lease was not renewed",
        lambda: engine.explain("holder").sentence,
    )
    seen_after = time.monotonic() - killed
    holder = Run.objects.get(pk="holder")
    assert holder.status == "running" and holder.lease_expires_at is not None
    recovery = holder.lease_expires_at  # the tick recovers it from its lease's expiry (D4)
    stamp = f"{recovery:%Y-%m-%d %H:%M:%S} UTC"
    assert "it is running (lease held by" not in sentence
    assert f"its lease (held by {holder.lease_owner}) was not renewed for " in sentence
    assert f"(renewed every {RENEW:.1f} s)" in sentence and stamp in sentence, sentence
    out = io.StringIO()
    call_command("durable_explain", "holder", stdout=out)
    assert "not renewed for" in out.getvalue() and stamp in out.getvalue()

    # The waiter: its estimate includes the time to the holder's recovery.
    waiter = engine.explain("waiter")
    to_recovery = (recovery - engine.store.now()).total_seconds()
    assert waiter.estimated_wait_seconds is not None, waiter.sentence
    assert waiter.estimated_wait_seconds >= to_recovery - 0.5, (to_recovery, waiter.sentence)
    assert "after the recovery of holder" in waiter.sentence and "lease not renewed for" in waiter.sentence

    # Health: a warning naming the holder, exit status 0 (raises CommandError otherwise).
    out = io.StringIO()
    call_command("durable_health", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["unrenewed_leases"] == 1, report
    assert report["warnings"][0]["detail"].startswith(f"run holder of {WORKFLOW} (key '{KEY}'): lease of ")
    assert stamp in report["warnings"][0]["detail"]

    # The admin: the same words; a past retry reads as what it is, a wait for the holder's
    # lease to expire (a normal recovery, D4), neither a past "next attempt" nor red "overdue".
    key_page = admin_client.get(
        reverse("admin:durable_singleton_run_queue_key") + f"?workflow={WORKFLOW}&key={KEY}"
    ).content.decode()
    holder_row = re.search(r'<tr class="ds-holder([^"]*)" data-run-id="holder">(.*?)</tr>', key_page, re.S)
    assert holder_row is not None and "ds-unrenewed" in holder_row[1], key_page
    assert "lease not renewed for " in holder_row[2] and 'data-cause="unrenewed">not renewed<' in holder_row[2]
    waiter_row = re.search(r'<tr class="ds-waiter" data-run-id="waiter".*?</tr>', key_page, re.S)
    assert waiter_row is not None and "overdue since" not in waiter_row[0], waiter_row
    assert "s lease to expire at" in waiter_row[0] or "s lease expired at" in waiter_row[0], waiter_row
    waiter_page = admin_client.get(reverse("admin:durable_singleton_run_change", args=["waiter"])).content.decode()
    assert f"{WORKFLOW} waiter (waiting)" in waiter_page and "(pending)" not in waiter_page
    assert "parked, next turn" not in waiter_page

    # A second worker recovers the holder at its lease's expiry; the waiter is admitted after.
    workers.start(env=env)
    wait_for(lambda: _status("waiter") == "completed", 180, "the waiter completed after the recovery", workers.logs)
    holder.refresh_from_db()
    admitted_at = Run.objects.values_list("admitted_at", flat=True).get(pk="waiter")
    assert holder.status == "completed" and holder.recoveries == 1
    assert admitted_at is not None and admitted_at >= recovery, (admitted_at, recovery)
    # Figures, not bounds: how soon the kill showed, and how long the waiter was told to wait.
    print(f"\nkill shown after {seen_after:.1f} s; waiter's estimate {waiter.estimated_wait_seconds:.1f} s")
