"""One failed lease renewal never stops the renewals of a body that runs on.

Found by the breaker of issue #12: the lease keeper (the thread that renews a
running body's lease every ``LEASE_RENEW_SECONDS``, R5) caught only Django's
``DatabaseError``. Django's ``InterfaceError`` is not one (the drivers raise it
for a connection already closed), and a store other than the Django one
raises its own errors (``ConnectionError`` for a lost socket). One such
failure ended the keeper's thread silently: the lease then ran out under a
live, healthy body, the tick handed the run to another worker (a second body
of the key beside the first until its next boundary, S9) and the first body
was fenced at its next step.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.db import InterfaceError

from durable_singleton.definitions import Registry
from durable_singleton.statuses import Outcome
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine


class _FailOnce:
    """A store whose first ``renew_lease`` raises ``error``, as a dropped connection does."""

    error: BaseException

    def renew_lease(self, *args: Any, **kwargs: Any) -> bool:
        error, self.error = self.error, None  # type: ignore[assignment]
        if error is not None:
            self.renewal_failed = True
            raise error
        return super().renew_lease(*args, **kwargs)  # type: ignore[misc, no-any-return]


class FlakyRenewalMemoryStore(_FailOnce, MemoryStore):
    error = ConnectionError("connection reset by peer")


class FlakyRenewalDjangoStore(_FailOnce, DjangoStore):
    error = InterfaceError("connection already closed")


@pytest.mark.parametrize(
    "store_kind", ["memory", pytest.param("django", marks=pytest.mark.django_db(transaction=True))]
)
def test_a_failed_renewal_is_retried_and_the_body_keeps_its_lease(store_kind: str) -> None:
    """R5, S9: the first renewal fails (``ConnectionError`` / Django's
    ``InterfaceError``); the next ones succeed, so a step longer than the lease
    ends with the lease still held and the run completes, never fenced."""
    store: Any = FlakyRenewalMemoryStore() if store_kind == "memory" else FlakyRenewalDjangoStore()
    engine = make_engine(store, registry=Registry(), LEASE_SECONDS=1.0, LEASE_RENEW_SECONDS=0.2)
    engine.registry.add_step("renewal:long", lambda seconds: time.sleep(seconds) or seconds)

    def body(ctx: Any, input: Any) -> str:
        ctx.step("renewal:long", 1.6)  # longer than the lease: only the renewals keep it
        ctx.step("renewal:long", 0)  # its boundary checks the lease
        return "done"

    engine.registry.add("renewal", "1", body, singleton={"key": lambda i: "k", "limit": 1})
    run = engine.start("renewal", None, run_id="renewal-1")
    outcome = engine.execute(run.run_id)
    assert store.renewal_failed, "the first renewal did fail"
    assert outcome == Outcome.COMPLETED, f"the body lost its lease after one failed renewal: {outcome}"
    assert engine.get(run.run_id).output == "done"
