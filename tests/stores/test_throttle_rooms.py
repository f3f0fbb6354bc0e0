"""Throttles in the rooms (#33, X6): a run that carries a throttle is started,
claimed and settled by its database's room, not the ORM path, so a throttle
costs about what a run without one costs.

On PostgreSQL the start writes the throttle memberships in the run's INSERT, the
claim message locks the throttle keys first (X6c), counts each key's window,
records the admission or parks the run until the window's opening (X6d), and the
settle is the fast path's. The conformance suite
(``tests/stores/test_conformance.py``) holds each path to the same decisions.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection

from durable_singleton import Throttle
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import ThrottleAdmission, ThrottleMembership
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.base import TurnState
from tests.helpers import room_engine
from tests.helpers import round_trips as _round_trips

pytestmark = pytest.mark.django_db(transaction=True)

postgresql_only = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path")


def _registry() -> Registry:
    registry = Registry()
    rate = Throttle("tr-rate", key=lambda i: i["t"], limit=2, period=3600)
    registry.add("tr-keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]}, throttles=[rate])
    registry.add("tr-only", "1", lambda ctx, i: None, throttles=[rate])
    return registry


@pytest.fixture
def engine() -> Engine:
    return room_engine(_registry())  # its clock read once here, not counted below


@postgresql_only
@pytest.mark.parametrize("workflow", ["tr-keyed", "tr-only"])
def test_a_run_with_a_throttle_costs_three_round_trips_on_postgresql(engine: Engine, workflow: str) -> None:
    """X6b, X6c, X3i, R5a: on an idle key a run that carries a throttle (with or
    without a singleton key) costs its start (the run and its throttle membership
    in one INSERT), its claim message (its throttle key, then its singleton key
    and its row locked in the lock order, its window counted and its admission
    recorded, X3e) and its settle: three round trips, as a run without one. The
    ORM path took 27 and 20."""
    started: list[str] = []

    def one() -> None:
        started.append(engine.start(workflow, {"k": "K", "t": "T"}).run_id)
        engine.dispatcher.drain()  # type: ignore[attr-defined]

    sql = _round_trips(one)
    run = engine.get(started[0])
    assert run.status == RunStatus.COMPLETED
    assert len(sql) == 3, sql
    assert "start" in sql[0] and "claim_lock_throttle_keys" in sql[1] and "claim_quota_admit" in sql[1], sql
    assert not any(s.strip().upper() in ("BEGIN", "COMMIT") for s in sql), sql
    assert ThrottleMembership.objects.filter(run_id=run.run_id, throttle="tr-rate", key="T").count() == 1
    [admission] = ThrottleAdmission.objects.filter(run_id=run.run_id)
    assert (admission.throttle, admission.key, admission.admitted_at) == ("tr-rate", "T", run.admitted_at)


@postgresql_only
def test_the_claim_message_parks_an_over_rate_run_until_the_window_opens(engine: Engine) -> None:
    """X6d, X5, R5: the third run of a throttle key of 2 an hour is parked by the
    claim message itself (one round trip, the turn names the throttle), with its
    wake_at and not_before at the window's opening: the older admission's time
    plus the period, on the database's clock; no admission is recorded for it."""
    for run_id in ("A", "B", "C"):
        engine.start("tr-only", {"t": "T"}, run_id=run_id)
    limits = engine.limits()

    def turn(run_id: str) -> Any:
        return engine.store.begin_turn(
            run_id, "w", lease_seconds=30, limits=limits, max_recoveries=3, retry=engine._retry_policy()
        )

    assert turn("A").state is TurnState.RUN and turn("B").state is TurnState.RUN
    parked: list[Any] = []
    sql = _round_trips(lambda: parked.append(turn("C")))
    assert len(sql) == 1 and "claim_quota_admit" in sql[0], sql
    assert parked[0].state is TurnState.PARKED and parked[0].throttled == "tr-rate", parked[0]
    c, a = engine.get("C"), engine.get("A")
    assert c.wake_at == c.not_before and a.admitted_at is not None
    assert (c.not_before - a.admitted_at).total_seconds() == 3600, (c.not_before, a.admitted_at)
    assert not ThrottleAdmission.objects.filter(run_id="C").exists()
