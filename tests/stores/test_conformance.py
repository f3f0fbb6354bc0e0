"""The store conformance suite (durable_singleton.testing.conformance) run on
every store path from this one place, as a user runs it on their own store
(S13, S14):

* ``memory``: the in-memory store;
* ``room``: the Django store on the DATABASE_URL database with its room (the
  PostgreSQL fast path, MariaDB's stored procedures where installed, SQLite's
  raw statements);
* ``orm``: the Django store forced onto the ORM path (``raw_sql=False``), the
  path every room falls back to;
* ``fallback``: a store without an atomic claim, admitted by the base class's
  scan (S14).

The memory and fallback cases touch no database: they are vendor-agnostic and
run in the SQLite passes only (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from durable_singleton.stores.base import BaseStore
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing.conformance import StoreConformance


class ScanOnlyStore(MemoryStore):
    """A store without an atomic claim: leases only; the base class's scan admits (S14)."""

    supports_atomic_admission = False
    begin_turn = BaseStore.begin_turn


#: The tests the S14 fallback is not held to, with the reason: it is a read
#: then a decision, keeps no durable holder marker and grants nothing on release.
_NO_MARKER = "the S14 fallback keeps no durable holder marker"
_NO_GRANT = "the S14 fallback grants nothing on release: waiters retry on their timer"
FALLBACK_GAPS = {
    "test_racing_claims_admit_one": "the S14 fallback is a read then a decision: racing claims can briefly over-admit",
    "test_claim_admits_at_most_limit_holders": _NO_MARKER,
    "test_release_grants_the_oldest_waiter_with_a_larger_token": _NO_GRANT,
    "test_waiters_are_admitted_oldest_first": _NO_GRANT,
    "test_an_expired_holder_is_redriven_and_keeps_its_slot": _NO_MARKER,
    "test_a_holder_is_never_preempted_and_the_handoff_grants_the_highest_priority": (
        "the S14 fallback keeps no durable holder marker and grants nothing on release"
    ),
}

STORE_PATHS: dict[str, Callable[[], BaseStore]] = {
    "memory": MemoryStore,
    "room": DjangoStore,
    "orm": lambda: DjangoStore(raw_sql=False),
    "fallback": ScanOnlyStore,
}
_DATABASE = pytest.mark.django_db(transaction=True)
_NO_DATABASE = pytest.mark.vendor_agnostic
_FALLBACK_WARNS = pytest.mark.filterwarnings("ignore::durable_singleton.exceptions.SingletonFallbackWarning")


@pytest.mark.parametrize(
    "store_path",
    [
        pytest.param("memory", marks=_NO_DATABASE),
        pytest.param("room", marks=_DATABASE),
        pytest.param("orm", marks=_DATABASE),
        pytest.param("fallback", marks=[_NO_DATABASE, _FALLBACK_WARNS]),
    ],
)
class TestStorePaths(StoreConformance):
    @pytest.fixture
    def store(self, store_path: str, request: pytest.FixtureRequest) -> BaseStore:
        gap = FALLBACK_GAPS.get(request.node.originalname) if store_path == "fallback" else None
        if gap:
            pytest.skip(gap)
        return STORE_PATHS[store_path]()
