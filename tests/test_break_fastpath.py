"""Breaking the fast path of issue #17 (the PostgreSQL raw statements, the
stamped start, the deep-queue start): each test is a break found by reading
the new code against the SPEC, and fails on the commit before its fix.

* A claim whose message waited for its key's lock took a lease measured from
  the message's arrival (``STATEMENT_TIMESTAMP()``), not from its write: a wait
  longer than ``LEASE_SECONDS`` admitted the run with a lease already expired,
  so the tick could recover it while its body ran (R5, R8, S9).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import pytest
from django.db import connections, transaction

from durable_singleton.definitions import Registry
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine


@pytest.mark.django_db(transaction=True)
def test_a_claim_that_waited_for_its_key_lock_takes_a_whole_lease(registry: Registry) -> None:
    """R5, R8, S9: W's claim waits for its key's lock (held by another
    transaction for longer than ``LEASE_SECONDS``); once admitted, its body
    starts with a lease of about ``LEASE_SECONDS`` from then, by the database's
    clock, and its settle is accepted. Before the fix, on PostgreSQL, the
    admission message measured the lease from its arrival: the body started
    with its lease expired (a tick could recover the run and run a second body
    beside it) and its settle was refused (fenced)."""
    lease = 2.0
    seen: list[tuple[datetime | None, datetime]] = []

    def body(ctx: Any, input: Any) -> None:
        seen.append((Run.objects.get(pk=ctx.run_id).lease_expires_at, engine.store.now()))

    registry.add("lock-wait", "1", body, singleton={"key": lambda i: "K"})
    engine = make_engine(DjangoStore(), registry=registry, LEASE_SECONDS=lease, LEASE_RENEW_SECONDS=lease / 2)
    engine.start("lock-wait", {}, run_id="W")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    locked = threading.Event()

    def hold_the_key() -> None:
        try:
            with transaction.atomic():
                engine.store.lock_key("lock-wait", "K")  # type: ignore[attr-defined]
                locked.set()
                time.sleep(lease + 1.0)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_the_key, daemon=True)
    holder.start()
    assert locked.wait(10), "the key's lock was not taken"
    outcome = engine.execute("W")
    holder.join(30)
    assert len(seen) == 1, seen
    expires, now = seen[0]
    assert expires is not None and (expires - now).total_seconds() > lease / 2, (
        f"the body began with {(expires - now).total_seconds() if expires else None} s of its {lease} s lease"
    )
    assert outcome == RunStatus.COMPLETED and engine.get("W").status == RunStatus.COMPLETED
