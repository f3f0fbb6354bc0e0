"""Adversarial: a process clock that steps never moves the times a start or a
sleep writes (R8, R5, D1, D5).

The engine's default clock (:class:`~durable_singleton.engine.StoreClock`) is
the process clock corrected to the database's. These tests correct it, then
step the process clock an hour (NTP, a resumed VM) before the start or the
sleep, as production meets it. They replace two strict xfails that pinned an
injected ``Engine(clock=...)``, which production never uses.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.testing import make_engine
from tests.core.test_database_clock import step_clock

STEP = timedelta(hours=1)


@pytest.mark.django_db(transaction=True)
def test_a_start_on_a_process_stepped_back_does_not_time_a_holder_out_early() -> None:
    """R8, R5, D5, S6: a process whose clock stepped an hour back starts a run
    with a ten-minute timeout; the run is admitted and parks in a 30 s sleep.
    The next tick (on a process with a correct clock) must leave the holder
    alone: its deadline is ten minutes away on the database's clock."""
    registry = Registry()
    registry.add("wf", "1", lambda ctx, i: ctx.sleep(30), singleton={"key": lambda i: "K"}, timeout=600)
    stepped = make_engine("django", registry=registry)
    honest = make_engine("django", registry=registry)
    step_clock(stepped, -STEP)
    stepped.start("wf", {}, run_id="A")
    stepped.dispatcher.drain()
    run: Any = honest.get("A")
    assert run.status == "suspended" and run.admitted
    assert run.deadline_at - honest.store.now() > timedelta(minutes=9), run.deadline_at
    honest.tick()
    assert honest.get("A").status == "suspended", honest.get("A").error


@pytest.mark.django_db(transaction=True)
def test_a_sleep_on_a_process_stepped_ahead_is_not_stretched_by_the_step() -> None:
    """R8, R5, D1: a holder that sleeps 2 s on a process whose clock stepped an
    hour ahead must be due about 2 s later on the database's clock, not an hour
    and 2 s."""
    registry = Registry()
    registry.add("wf", "1", lambda ctx, i: ctx.sleep(2), singleton={"key": lambda i: "K"})
    stepped = make_engine("django", registry=registry)
    stepped.start("wf", {}, run_id="A")
    step_clock(stepped, STEP)  # between the start and the turn that sleeps
    stepped.dispatcher.drain()
    run: Any = stepped.get("A")
    assert run.status == "suspended"
    assert run.wake_at - stepped.store.now() < timedelta(seconds=10), run.wake_at - stepped.store.now()
