"""Operations (O3, K4): the slot audit finds and repairs each planted fault;
``durable_health`` exits 1 on each and 0 on a healthy system;
``durable_runs`` lists, cancels, retries and wakes runs by filters."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, transaction
from django.utils import timezone

from durable_singleton import heartbeat
from durable_singleton.audit import FindingKind
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.heartbeat import record_tick
from durable_singleton.models import Heartbeat, Run
from durable_singleton.runtime import get_engine
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine(registry: Registry) -> Engine:
    registry.add("audited", "1", lambda ctx, i: i, singleton={"key": lambda i: f"k{i['k']}", "limit": 1})
    return make_engine("django", registry=registry, TICK_SECONDS=1.0)


def _old(seconds: float = 60) -> Any:
    return timezone.now() - timedelta(seconds=seconds)


def _kinds(engine: Engine, repair: bool = False) -> list[str]:
    return sorted(str(f.kind) for f in engine.audit_slots(repair=repair).findings)


def test_audit_of_a_drained_system_finds_nothing(engine: Engine) -> None:
    """K4: holders and waiters in order, nothing stranded: no finding."""
    for _ in range(3):
        engine.start("audited", {"k": 1})
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert _kinds(engine) == []


def test_audit_finds_and_repairs_an_expired_lease_nobody_re_drove(engine: Engine) -> None:
    """K4, D4: a running run whose lease expired more than two ticks ago is
    found; repair makes it due and dispatches it, and the turn completes it."""
    run = engine.start("audited", {"k": 1})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk=run.run_id).update(
        status="running", lease_owner="dead-host:1:x", lease_expires_at=_old(), wake_at=None, attempts=1
    )
    assert _kinds(engine) == ["expired_lease"]
    report = engine.audit_slots(repair=True)
    assert [f.repaired for f in report.findings] == [True]
    assert engine.dispatcher.sent[-1] == run.run_id  # type: ignore[attr-defined]
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get(run.run_id).status == "completed"
    assert _kinds(engine) == []


def test_audit_finds_and_repairs_a_waiter_stalled_behind_a_free_slot(engine: Engine) -> None:
    """K4, S8: a key with no holder whose front waiter has been due for longer
    than two ticks (no worker took its turn) is found; repair wakes it. A
    waiter due for less than two ticks is not a finding."""
    run = engine.start("audited", {"k": 2})
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    Run.objects.filter(pk=run.run_id).update(status="suspended", park_reason="singleton", wake_at=_old(1))
    assert _kinds(engine) == []
    Run.objects.filter(pk=run.run_id).update(wake_at=_old())
    report = engine.audit_slots()
    assert [(str(f.kind), f.run_id, f.key) for f in report.findings] == [("stalled_waiter", run.run_id, "k2")]
    assert engine.audit_slots(repair=True).findings[0].repaired
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    assert engine.get(run.run_id).status == "completed"


def test_audit_reports_over_admission_and_does_not_repair_it(engine: Engine) -> None:
    """K4, S9: two holders on a key of limit 1 are reported, never evicted."""
    a, b = engine.start("audited", {"k": 3}), engine.start("audited", {"k": 3})
    lease = timezone.now() + timedelta(minutes=5)
    Run.objects.filter(pk__in=[a.run_id, b.run_id]).update(
        status="running", singleton_slot="holder", lease_owner="h:1:x", lease_expires_at=lease
    )
    report = engine.audit_slots(repair=True)
    assert [(f.kind, f.repaired) for f in report.findings] == [(FindingKind.OVER_ADMITTED, False)]
    assert Run.objects.filter(singleton_slot="holder").count() == 2


def test_an_inactive_holder_cannot_be_planted(engine: Engine) -> None:
    """K4, S12: "every holder is an active run" is held by the database
    (constraint ds_run_slot_only_active): planting the fault fails."""
    run = engine.start("audited", {"k": 4})
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    with pytest.raises(IntegrityError), transaction.atomic():
        Run.objects.filter(pk=run.run_id).update(singleton_slot="holder")
    assert _kinds(engine) == []


def _health(*args: str) -> tuple[int, dict[str, Any]]:
    out = StringIO()
    try:
        call_command("durable_health", "--json", *args, stdout=out)
        code = 0
    except CommandError as exc:
        code = exc.returncode
    return code, json.loads(out.getvalue())


@pytest.fixture
def manual(settings: Any) -> Engine:
    """The default engine of the commands, on the manual dispatcher."""
    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    # The engine outlives the test database: forget its last heartbeat write.
    heartbeat._written.pop(engine, None)
    return engine


def test_health_is_zero_when_healthy_and_one_on_each_planted_fault(manual: Engine) -> None:
    """O3, K4: exit 0 after a tick with nothing wrong; exit 1 with the kind
    named for a stale tick, an expired lease, a stalled waiter and a backlog."""
    code, report = _health()
    assert code == 1 and [p["kind"] for p in report["problems"]] == ["stale_tick"]  # no tick ever
    manual.tick()
    code, report = _health()
    assert code == 0 and report["healthy"], report

    Heartbeat.objects.update(at=_old(600))
    code, report = _health()
    assert code == 1 and [p["kind"] for p in report["problems"]] == ["stale_tick"]
    assert _health("--stale-seconds=1h")[0] == 0

    run = manual.start("fault-hold", {"store_id": "h1", "seconds": 0}, run_id="h-lease")
    Run.objects.filter(pk=run.run_id).update(
        status="running", lease_owner="x:1:y", lease_expires_at=_old(), wake_at=None, attempts=1
    )
    code, report = _health("--stale-seconds=1h")
    assert code == 1 and [p["kind"] for p in report["problems"]] == ["expired_lease"]
    code, report = _health("--stale-seconds=1h", "--repair")
    assert code == 0 and report["audit"]["findings"][0]["repaired"]
    manual.dispatcher.drain()  # type: ignore[attr-defined]

    run = manual.start("fault-hold", {"store_id": "h2", "seconds": 0}, run_id="h-stalled")
    Run.objects.filter(pk=run.run_id).update(status="suspended", wake_at=_old(), attempts=1)
    code, report = _health("--stale-seconds=1h")
    assert code == 1 and [p["kind"] for p in report["problems"]] == ["stalled_waiter"]
    Run.objects.filter(pk=run.run_id).delete()

    manual.dispatcher.queue.clear()  # type: ignore[attr-defined]
    manual.start("fault-hold", {"store_id": "h3", "seconds": 0}, run_id="h-backlog-keyed")
    Run.objects.filter(pk="h-backlog-keyed").update(singleton_slot="holder", created_at=_old(600))
    code, report = _health("--stale-seconds=1h")
    assert code == 1 and [p["kind"] for p in report["problems"]] == ["backlog"] and report["backlog"] == 1


def test_heartbeat_is_written_at_most_every_few_seconds() -> None:
    """O3: one small write per HEARTBEAT_EVERY_SECONDS per engine, not per tick."""
    manual = make_engine("django")
    now = timezone.now()
    assert record_tick(manual, now) is True
    assert record_tick(manual, now + timedelta(seconds=1)) is False
    assert record_tick(manual, now + timedelta(seconds=6)) is True
    assert Heartbeat.objects.get().at == now + timedelta(seconds=6)


def _runs(*args: str) -> dict[str, Any]:
    out = StringIO()
    call_command("durable_runs", *args, "--json", stdout=out)
    return dict(json.loads(out.getvalue()))


def test_runs_command_lists_the_newest_runs_first(manual: Engine) -> None:
    """O3, issue #19 point 8: ``durable_runs list --limit N`` shows the N newest
    runs, newest first (as git log and Django's admin do); --oldest-first
    shows the N oldest, oldest first."""
    for n in range(4):
        manual.start("fault-hold", {"store_id": "n", "seconds": 0}, run_id=f"n-{n}")
        Run.objects.filter(pk=f"n-{n}").update(created_at=_old(100 - n))
    assert [r["run_id"] for r in _runs("list", "--limit=2")["runs"]] == ["n-3", "n-2"]
    assert [r["run_id"] for r in _runs("list", "--limit=2", "--oldest-first")["runs"]] == ["n-0", "n-1"]
    out = StringIO()
    call_command("durable_runs", "list", "--limit=1", stdout=out)
    assert out.getvalue().splitlines()[0].startswith("n-3  fault-hold  store:n  pending")


def test_runs_command_lists_cancels_retries_and_wakes_by_filters(manual: Engine) -> None:
    """O3, D6, D9: filters by workflow, key, status and age; --dry-run changes
    nothing; cancel, retry and wake go through the engine."""
    for n in range(3):
        manual.start("fault-hold", {"store_id": "c", "seconds": 0}, run_id=f"c-{n}")
    listed = _runs("list", "--workflow=fault-hold", "--key=store:c")
    assert [r["run_id"] for r in listed["runs"]] == ["c-2", "c-1", "c-0"]
    assert _runs("list", "--older-than=1h")["runs"] == []
    dry = _runs("cancel", "--key=store:c", "--dry-run")
    assert len(dry["runs"]) == 3 and set(Run.objects.values_list("status", flat=True)) == {"pending"}
    cancelled = _runs("cancel", "c-1", "c-2")
    assert [r["outcome"] for r in cancelled["runs"]] == ["cancelled", "cancelled"]
    Run.objects.filter(pk="c-1").update(status="failed")
    retried = _runs("retry", "--status=failed")
    assert [(r["run_id"], r["outcome"]) for r in retried["runs"]] == [("c-1", "pending")]
    manual.dispatcher.queue.clear()  # type: ignore[attr-defined]
    woken = _runs("wake", "--status=pending")
    assert sorted(r["run_id"] for r in woken["runs"]) == ["c-0", "c-1"]
    assert sorted(manual.dispatcher.queue) == ["c-0", "c-1"]  # type: ignore[attr-defined]
    with pytest.raises(CommandError, match="needs run ids or a filter"):
        call_command("durable_runs", "cancel", stdout=StringIO())
    with pytest.raises(CommandError):
        call_command("durable_runs", "retry", "c-0", stdout=StringIO())  # pending: not retryable
