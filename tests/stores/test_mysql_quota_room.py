"""The MariaDB/MySQL room's shared quotas (durable_singleton/sql/mysql/quota.sql): a quota
waiter's claim, a quota holder's confirmation and the settle of a run that carries quotas
are one CALL each, with the ORM path's rules (X3c-X3i, S5, S7, S13, R5a, K1), on a real
server. The rules themselves are checked on every path by tests/quotas/ and the
conformance suite; these tests guard the round trips and what each CALL returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection

from durable_singleton import Quota
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import QuotaMembership, Run
from durable_singleton.statuses import RunStatus, SlotState
from durable_singleton.stores.base import TurnState
from durable_singleton.testing import make_engine

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "mysql", reason="the MySQL/MariaDB room's stored procedures"),
]

POOL = Quota("room-pool", key=lambda i: i["p"], limit=1)


def _hold(ctx: Any, input: dict[str, Any]) -> None:
    if input.get("park"):
        ctx.wait_for_signal("go")


@pytest.fixture
def engine() -> Engine:
    registry = Registry()
    registry.add("room-quota-keyed", "1", _hold, singleton={"key": lambda i: i["k"]}, quotas=[POOL])
    registry.add("room-quota-plain", "1", _hold, quotas=[POOL])
    built = make_engine("django", registry=registry)
    assert built.store._mysql_room() is not None  # type: ignore[attr-defined]  # migration 0022 ran
    built.now()  # the engine's clock reads the database's now and then, not per run
    return built


def _drain(engine: Engine) -> None:
    queued = engine.dispatcher.queue  # type: ignore[attr-defined]
    while queued:
        engine.execute_chain(queued.popleft())


def _round_trips(fn: Callable[[], Any]) -> int:
    """The round trips ``fn`` made on this thread's connection, the driver's own
    ``SET autocommit`` and ``COMMIT`` included (``bench.roundtrips``)."""
    from bench.roundtrips import RoundTrips

    with RoundTrips(connection) as trips:
        fn()
    return trips.total


def _tokens(run_id: str) -> dict[str, int | None]:
    return dict(QuotaMembership.objects.filter(run_id=run_id).values_list("quota", "fencing_token"))


def test_a_quota_waiters_claim_and_settle_are_one_call_each(engine: Engine) -> None:
    """X3c, X3f, X3g, S5, K1, #32: a run with a singleton key and a quota, on an idle key and
    an idle quota key, is admitted by one CALL (``ds_claim``, which calls
    ``ds_admit_quota``) with its token in each limit, and settled with its slots freed by
    one CALL (``ds_settle_quotas``): at most 8 round trips start to settle (the start's
    6, its memberships and the driver's ``SET autocommit`` included); 33 on the ORM path
    before."""
    run_ids: list[str] = []

    def one_run() -> None:
        run_ids.append(engine.start("room-quota-keyed", {"k": "a", "p": "a"}).run_id)
        _drain(engine)

    trips = _round_trips(one_run)
    stored = Run.objects.get(pk=run_ids[0])
    assert stored.status == RunStatus.COMPLETED and stored.fencing_token == 1, stored
    assert stored.quota_slot is None and _tokens(run_ids[0]) == {"room-pool": 1}
    assert set(QuotaMembership.objects.filter(run_id=run_ids[0]).values_list("slot", flat=True)) == {None}  # X3g
    assert trips <= 8, trips


def test_a_quota_claim_returns_the_tokens_it_took(engine: Engine) -> None:
    """X3f, K1, R5a: the turn of a quota waiter the procedure admits carries the token it
    took in each quota key, the one stored on its membership, and the key's counter moved
    past it; a second run of the same quota key, parked behind it (X3c, X3d), is admitted
    by the first's settle with the next token, in the same CALL (X3h)."""
    store = engine.store
    policy = engine._retry_policy()
    limits = engine.limits()
    first = engine.start("room-quota-plain", {"p": "tok", "park": True}).run_id
    second = engine.start("room-quota-plain", {"p": "tok"}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # the turns taken by hand below
    claims: list[Any] = []
    trips = _round_trips(
        lambda: claims.append(
            store.begin_turn(first, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy)
        )
    )
    turn = claims[0]
    assert turn.state == TurnState.RUN and turn.run.quota_tokens == (("room-pool", 1),), turn
    assert _tokens(first) == {"room-pool": 1} and trips == 1, trips
    parked = store.begin_turn(second, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy)
    assert parked.state == TurnState.PARKED and Run.objects.get(pk=second).quota_slot == SlotState.WAITER, parked
    done: list[Any] = []
    settle = _round_trips(lambda: done.append(store.finish(turn.run, "tester", RunStatus.COMPLETED, limits=limits)))
    assert done[0].settled and settle == 1, (done[0], settle)
    assert [(g.run_id, g.quota_slot, g.quota_tokens) for g in done[0].granted] == [
        (second, SlotState.HOLDER, (("room-pool", 2),))
    ], done[0].granted
    assert _tokens(second) == {"room-pool": 2}


def test_a_quota_holders_confirmation_is_one_call(engine: Engine) -> None:
    """S6, X3f, R5a, #32: a run with a key and a quota that its predecessor's handoff
    admitted confirms its lease in one CALL (``ds_take_quota_lease``), its tokens read in
    it; a confirmation of a run changed under the turn writes nothing."""
    store = engine.store
    policy = engine._retry_policy()
    limits = engine.limits()
    holder = engine.start("room-quota-keyed", {"k": "c", "p": "c", "park": True}).run_id
    _drain(engine)
    waiter = engine.start("room-quota-keyed", {"k": "c", "p": "c"}).run_id
    _drain(engine)
    engine.signal(holder, "go")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    claimed = store.begin_turn(holder, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy)
    assert claimed.state == TurnState.RUN and claimed.run is not None, claimed
    done = store.finish(claimed.run, "tester", RunStatus.COMPLETED, limits=limits)
    granted = done.granted[0]
    assert granted.run_id == waiter and granted.admitted and granted.quota_slot == SlotState.HOLDER, done
    assert granted.fencing_token == 2 and granted.quota_tokens == (("room-pool", 2),), granted
    stale = granted.evolve(attempts=granted.attempts + 5)  # as read before a change: the compare refuses it
    refused = store.begin_turn(
        waiter, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy, known=stale
    )
    assert refused.state == TurnState.SKIPPED and Run.objects.get(pk=waiter).status != RunStatus.RUNNING
    turns: list[Any] = []
    confirm = _round_trips(
        lambda: turns.append(
            store.begin_turn(
                waiter, "tester", lease_seconds=30, limits=limits, max_recoveries=3, retry=policy, known=granted
            )
        )
    )
    turn = turns[0]
    assert turn.state == TurnState.RUN and turn.run.quota_tokens == (("room-pool", 2),), turn
    assert Run.objects.get(pk=waiter).lease_owner == "tester" and confirm == 1, confirm
