"""A waiter a handoff admitted confirms its slot from the record the grant sent (S6, S7,
R5a, issue 32: the Python work per drained run on MariaDB and SQLite).

In a drain each settle grants the next waiter its slot and the same thread runs it next
(``execute_chain``, with the granted record as ``known``). Its claim is one compare-and-set
on that record on every database: PostgreSQL's fast path (``FastPath.take``), the SQLite
room's ``take``, MariaDB's ``ds_take_lease``. Before, on SQLite and MariaDB the claim built
a ``Run`` model from the record, a record from the model again, and Django expressions for
the lease, before the same statement: about 0.15 ms of a drained run's 3 ms on MariaDB.
"""

from __future__ import annotations

from typing import Any

import pytest

from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.base import TurnState
from durable_singleton.testing import make_engine
from tests.helpers import drain_chains, keyed_registry

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine() -> Engine:
    built = make_engine("django", registry=keyed_registry("confirm-keyed"))
    built.now()
    return built


def test_a_granted_waiter_confirms_from_its_record_without_a_model(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = engine.start("confirm-keyed", {"k": "hot", "park": True}).run_id
    drain_chains(engine)
    waiters = [engine.start("confirm-keyed", {"k": "hot"}).run_id for _ in range(4)]
    drain_chains(engine)  # each denied: parked behind the holder (S5)

    store: Any = engine.store
    claim = store.begin_turn
    confirmations: list[tuple[Any, int]] = []  # (turn, models built during its claim)
    built = [0]
    model_init = Run.__init__

    def counted_init(self: Run, *args: Any, **kwargs: Any) -> None:
        built[0] += 1
        model_init(self, *args, **kwargs)

    def begin_turn(run_id: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("known") is None:
            return claim(run_id, *args, **kwargs)
        before = built[0]
        turn = claim(run_id, *args, **kwargs)
        confirmations.append((turn, built[0] - before))
        return turn

    monkeypatch.setattr(Run, "__init__", counted_init)
    monkeypatch.setattr(store, "begin_turn", begin_turn)
    engine.signal(holder, "go")
    drain_chains(engine)

    assert len(confirmations) == len(waiters), confirmations
    for turn, models in confirmations:
        assert turn.state is TurnState.RUN, turn
        run = turn.run
        assert run.status == RunStatus.RUNNING and run.admitted and run.lease_owner, run
        assert models == 0, f"{run.run_id}: the confirmation built {models} Run models"
    runs = [engine.get(r) for r in [holder, *waiters]]
    assert all(r is not None and r.status == RunStatus.COMPLETED for r in runs), runs
    tokens = [r.fencing_token or 0 for r in runs if r is not None]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
