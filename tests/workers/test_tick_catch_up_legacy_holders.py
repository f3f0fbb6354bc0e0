"""The tick's catch-up counts older-release holders as the grant does (S8a, S8b, S12), issue #18 item 7."""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_singleton.definitions import Registry
from durable_singleton.models import SingletonKey
from durable_singleton.testing import make_engine
from tests.factories import T0, bulk_queue


@pytest.mark.django_db
def test_keys_held_by_older_release_runs_do_not_starve_a_lost_push() -> None:
    """S8a, S8b, S12 (#18 item 7): more than TICK_BATCH keys are each held by an
    untracked run of an older release and have a waiter; a later key's waiter
    lost its push. The catch-up's key query must count the untracked holders
    (admission.holds_slot_q) as the grant does, so those keys are not picked by
    every tick for nothing and the lost waiter is granted within two ticks."""
    registry = Registry()
    registry.add("wf", "1", lambda c, i: None, singleton={"key": lambda i: i["k"]})
    engine = make_engine("django", registry=registry, TICK_BATCH=3)
    held = [f"H{n}" for n in range(8)]
    bulk_queue(held, holders=0, waiters=1, finished=0, legacy_holders=1)
    bulk_queue(["Z"], holders=0, waiters=1, finished=0, start=T0 + timedelta(hours=1))
    for key in [*held, "Z"]:
        SingletonKey.objects.get_or_create(workflow_name="wf", key=key)
    caught: list[str] = []
    for _ in range(2):
        caught.extend(engine.tick().caught_up)
    assert caught == ["wf-Z-0"]
