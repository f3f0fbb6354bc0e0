"""Retention of finished runs (O2): the tick's bounded batch and
``manage.py durable_purge`` (O3), on the DATABASE_URL database."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run, Signal, Step
from durable_singleton.retention import purge_finished
from durable_singleton.testing import make_engine
from tests.helpers import HandClock as Clock

pytestmark = pytest.mark.django_db(transaction=True)


def _register(registry: Registry) -> None:
    registry.add_step("r:work", lambda x: x)

    def body(ctx: Any, input: dict[str, Any]) -> Any:
        ctx.step("r:work", input)
        if input.get("fail"):
            raise RuntimeError("boom")
        return input

    registry.add("keep", "1", body, singleton={"key": lambda i: f"k{i['k']}"})
    registry.add("other", "1", body)


def _finish(engine: Engine, n: int, workflow: str = "keep", **extra: Any) -> list[str]:
    ids = [engine.start(workflow, {"k": i % 3, **extra}).run_id for i in range(n)]
    engine.dispatcher.drain()  # type: ignore[attr-defined]
    return ids


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def engine(registry: Registry, clock: Clock) -> Engine:
    _register(registry)
    return make_engine("django", registry=registry, clock=clock, RETENTION_SECONDS=60.0, RETENTION_BATCH=1000)


def test_tick_deletes_finished_runs_past_retention_with_their_rows(engine: Engine, clock: Clock) -> None:
    """O2: the tick deletes finished runs older than RETENTION_SECONDS with
    their steps and signals; younger finished runs and active runs (however
    old) stay."""
    old = _finish(engine, 4) + _finish(engine, 2, fail=True)
    active = engine.start("keep", {"k": 9}).run_id  # pending, never executed
    engine.signal(active, "hello", {"x": 1})
    clock.advance(120)
    young = _finish(engine, 3)
    assert Step.objects.filter(run_id__in=old).count() == 6
    engine.tick()
    assert not Run.objects.filter(pk__in=old).exists()
    assert not Step.objects.filter(run_id__in=old).exists()
    assert set(Run.objects.values_list("run_id", flat=True)) == {*young, active}
    assert Signal.objects.filter(run_id=active).count() == 1


def test_retention_keeps_the_table_bounded(engine: Engine, clock: Clock) -> None:
    """O2: 10 runs finishing every 30 s with 60 s retention (the batch runs at
    most every 60 s): after 8 rounds (80 runs) the table never held more than
    the last 3 rounds."""
    sizes = []
    for _ in range(8):
        _finish(engine, 10)
        clock.advance(30)
        engine.tick()
        sizes.append(Run.objects.count())
    assert max(sizes) <= 30 and min(sizes[3:]) >= 20, sizes


def test_retention_none_keeps_everything(registry: Registry, clock: Clock) -> None:
    """O2: RETENTION_SECONDS None keeps every finished run."""
    _register(registry)
    engine = make_engine("django", registry=registry, clock=clock, RETENTION_SECONDS=None)
    ids = _finish(engine, 3)
    clock.advance(10 * 365 * 86400)
    engine.tick()
    assert Run.objects.filter(pk__in=ids).count() == 3


def test_tick_batch_is_bounded_and_resumes_at_the_next_tick(registry: Registry, clock: Clock) -> None:
    """O2, S8b: one tick deletes at most RETENTION_BATCH runs; a full batch
    makes the next tick delete the next batch."""
    _register(registry)
    engine = make_engine("django", registry=registry, clock=clock, RETENTION_SECONDS=1.0, RETENTION_BATCH=4)
    _finish(engine, 10)
    clock.advance(5)
    counts = []
    for _ in range(3):
        engine.tick()
        counts.append(Run.objects.count())
    assert counts == [6, 2, 0]


def test_purge_refuses_active_statuses(engine: Engine) -> None:
    """O2, section 7: asking to purge an active status is a typed error."""
    from durable_singleton.exceptions import ValidationError

    with pytest.raises(ValidationError):
        purge_finished(engine, before=timezone.now(), statuses=["pending"])


def _purge(*args: str) -> str:
    out = StringIO()
    call_command("durable_purge", *args, stdout=out)
    return out.getvalue()


def test_purge_command_filters_and_dry_run(engine: Engine, clock: Clock, settings: Any) -> None:
    """O2, O3: ``durable_purge`` by workflow, status and age, with --dry-run
    and --json; active runs are never deleted."""
    keep_ok = _finish(engine, 3)
    keep_failed = _finish(engine, 2, fail=True)
    other = _finish(engine, 2, workflow="other")
    active = engine.start("keep", {"k": 7}).run_id
    Run.objects.update(finished_at=timezone.now() - timedelta(hours=3))
    Run.objects.filter(pk=active).update(finished_at=None)
    dry = json.loads(_purge("--older-than=1h", "--dry-run", "--json"))
    assert dry["runs"] == 7 and dry["dry_run"] and Run.objects.count() == 8
    assert dry["by_status"] == {"completed": 5, "failed": 2}
    report = json.loads(_purge("--older-than=1h", "--workflow=keep", "--status=failed", "--json"))
    assert report["runs"] == 2 and report["steps"] == 2
    assert not Run.objects.filter(pk__in=keep_failed).exists()
    assert "would delete 0 runs" in _purge("--older-than=4h", "--dry-run")
    text = _purge("--older-than=2h")
    assert text.startswith("deleted 5 runs")
    assert list(Run.objects.values_list("run_id", flat=True)) == [active]
    assert not set(keep_ok + other) & set(Run.objects.values_list("run_id", flat=True))


def test_purge_command_rejects_bad_arguments(engine: Engine) -> None:
    with pytest.raises(CommandError):
        _purge("--older-than=soon")
    with pytest.raises(CommandError):
        _purge("--status=running")
    with pytest.raises(CommandError):
        _purge("--limit=0")
