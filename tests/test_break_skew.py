"""Adversarial: times the engine computes come from the process's clock (R5, D1, D5).

``Engine(clock=...)`` is how the suite models a process whose clock is off
(tests/test_protocol.py, defects 1 and 2). Every comparison with "now" is made
on the database's clock, but the absolute times a start or a sleep writes
(``deadline_at``, a sleep's ``wake_at``) are computed from the process's clock,
so its skew moves them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_singleton.definitions import Registry
from durable_singleton.testing import make_engine

SKEW = timedelta(hours=1)
REASON = (
    "deadline_at and a sleep's wake_at are computed from Engine(clock=...), not corrected "
    "to the database clock; see the report of the break session"
)


@pytest.mark.django_db(transaction=True)
@pytest.mark.xfail(strict=True, reason=REASON)
def test_a_start_on_a_process_behind_does_not_time_a_holder_out_early() -> None:
    """R5, D5, S6: a process whose clock is an hour behind starts a run with a
    ten-minute timeout; the run is admitted and parks in a 30 s sleep. The next
    tick (on a process with a correct clock) must leave the holder alone: its
    deadline is ten minutes away on the database's clock. It cancels it with
    ``execution_timeout`` and frees its slot at once."""
    registry = Registry()
    registry.add("wf", "1", lambda ctx, i: ctx.sleep(30), singleton={"key": lambda i: "K"}, timeout=600)
    behind = make_engine("django", registry=registry, clock=lambda: timezone.now() - SKEW)
    honest = make_engine("django", registry=registry)
    behind.start("wf", {}, run_id="A")
    behind.dispatcher.drain()
    assert honest.get("A").status == "suspended" and honest.get("A").admitted
    honest.tick()
    assert honest.get("A").status == "suspended", honest.get("A").error


@pytest.mark.django_db(transaction=True)
@pytest.mark.xfail(strict=True, reason=REASON)
def test_a_sleep_on_a_process_ahead_is_not_stretched_by_its_skew() -> None:
    """R5, D1: a holder that sleeps 2 s on a process whose clock is an hour ahead
    must be due about 2 s later on the database's clock, not an hour and 2 s."""
    registry = Registry()
    registry.add("wf", "1", lambda ctx, i: ctx.sleep(2), singleton={"key": lambda i: "K"})
    ahead = make_engine("django", registry=registry, clock=lambda: timezone.now() + SKEW)
    ahead.start("wf", {}, run_id="A")
    ahead.dispatcher.drain()
    run: Any = ahead.get("A")
    assert run.status == "suspended"
    assert run.wake_at - ahead.store.now() < timedelta(seconds=10), run.wake_at - ahead.store.now()
