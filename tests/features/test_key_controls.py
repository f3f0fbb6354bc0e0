"""Runtime key controls (K2): pause, resume and limit overrides per key and per
workflow, applied at the next claim, recorded with who/when/old/new/why; racing
claims against control changes never over-admit. In memory and on the
DATABASE_URL database."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import SingletonQueueFullError, UnknownWorkflowError, ValidationError
from tests.conftest import Monitor, run_threads
from tests.helpers import admitted, audited, claim, settle


def _holders(engine: Engine, key: str = "key:K") -> list[str]:
    return sorted(r.run_id for r in engine.store.active_runs_for_key("wf", key) if r.admitted)


def _start(engine: Engine, *names: str, key: str = "K") -> None:
    for name in names:
        engine.start("wf", {"k": key}, run_id=name)
    engine.dispatcher.queue.clear()


def test_paused_key_admits_nothing_keeps_order_and_accepts_starts(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K2, S15: a paused key admits no one, not even into a free slot; its queue
    keeps its order and still accepts starts up to the cap; resuming wakes the
    oldest waiter at once (S7)."""
    audited(registry, monitor, max_queue_depth=2)
    _start(engine, "A", "B")
    state = engine.pause_key("wf", "key:K", by="ops", reason="maintenance")
    assert (state.paused, state.limit) == (True, 1)
    assert admitted(claim(engine, "A")) == "parked" and admitted(claim(engine, "B")) == "parked"
    _start(engine, "C")
    with pytest.raises(SingletonQueueFullError):
        engine.start("wf", {"k": "K"}, run_id="D")
    engine.resume_key("wf", "key:K", by="ops")
    assert _holders(engine) == ["A"], "resuming granted the free slot to the oldest waiter"
    assert "A" in engine.dispatcher.queue
    engine.dispatcher.drain()
    assert [engine.get(n).status for n in "ABC"] == ["completed"] * 3
    assert monitor.entered == ["A", "B", "C"] and monitor.highest["K"] == 1


def test_lowering_the_limit_never_evicts_and_raising_wakes_waiters_at_once(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K2: overriding limit 3 down to 1 leaves the three holders in place and admits
    nobody until they drop below 1; raising it to 4 grants the newly free slots to
    the oldest waiters at once; clearing the override restores the declared limit."""
    audited(registry, monitor, limit=3)
    _start(engine, "A", "B", "C", "D", "E", "F")
    for name in "ABC":
        assert admitted(claim(engine, name)) == "admitted"
    engine.override_limit("wf", "key:K", 1, by="ops", reason="backend struggling")
    assert _holders(engine) == ["A", "B", "C"]
    assert admitted(claim(engine, "D")) == "parked"
    settle(engine, "A", "completed")
    settle(engine, "B", "completed")
    assert _holders(engine) == ["C"] and admitted(claim(engine, "D")) == "parked"
    engine.dispatcher.queue.clear()
    state = engine.override_limit("wf", "key:K", 4, by="ops")
    assert (state.limit_override, state.limit, state.declared_limit) == (4, 4, 3)
    assert _holders(engine) == ["C", "D", "E", "F"]
    assert sorted(engine.dispatcher.queue) == ["D", "E", "F"]
    assert engine.override_limit("wf", "key:K", None).limit == 3


def test_every_change_is_recorded_with_who_when_old_new_and_why(engine: Engine, registry: Registry) -> None:
    """K2: each change records who, when, the old and new value and the reason,
    newest first; a change that changes nothing records nothing; invalid input
    raises a typed error and writes nothing."""
    audited(registry, Monitor())
    engine.pause_key("wf", "key:K", by="alice", reason="incident 42")
    engine.pause_key("wf", "key:K", by="alice")  # already paused: nothing to record
    engine.override_limit("wf", "key:K", 2, by="bob")
    engine.resume_key("wf", "key:K", by="carol", reason="fixed")
    history = engine.control_history("wf", "key:K")
    assert [(h.field, h.old, h.new, h.by, h.reason) for h in history] == [
        ("paused", True, False, "carol", "fixed"),
        ("limit_override", None, 2, "bob", ""),
        ("paused", False, True, "alice", "incident 42"),
    ]
    assert history[0].at >= history[-1].at
    for bad in (
        lambda: engine.override_limit("wf", "key:K", 0),
        lambda: engine.override_limit("wf", "key:K", True),  # type: ignore[arg-type]
        lambda: engine.pause_key("wf", ""),
        lambda: engine.pause_key("wf", "key:K", reason="x" * 1001),
    ):
        with pytest.raises(ValidationError):
            bad()
    with pytest.raises(UnknownWorkflowError):
        engine.pause_key("nope", "key:K")
    assert len(engine.control_history("wf", "key:K")) == 3


def test_workflow_wide_controls_apply_to_every_key(engine: Engine, registry: Registry, monitor: Monitor) -> None:
    """K2: pausing a workflow pauses every key it has; one record counts the keys."""
    audited(registry, monitor)
    for key in ("K1", "K2"):
        _start(engine, f"{key}-a", f"{key}-b", key=key)
        assert admitted(claim(engine, f"{key}-a")) == "admitted"
    states = engine.pause_workflow("wf", by="ops", reason="deploy")
    assert sorted((s.key, s.paused) for s in states) == [("key:K1", True), ("key:K2", True)]
    settle(engine, "K1-a", "completed")
    assert admitted(claim(engine, "K1-b")) == "parked"
    (record,) = engine.control_history("wf")
    assert (record.key, record.keys, record.field, record.new) == ("", 2, "paused", True)
    engine.resume_workflow("wf", by="ops")
    assert _holders(engine, "key:K1") == ["K1-b"]


@pytest.mark.races
def test_racing_claims_and_control_changes_never_over_admit(
    make: Callable[..., Engine], registry: Registry, monitor: Monitor
) -> None:
    """K2, S9: eight threads claim sixteen runs of one key (limit 3) while a ninth
    lowers the limit to 1 and pauses the key (own connections, real commits).
    No run settles, so the holders present when the pause returned are the
    holders at the end: nothing is admitted after a pause, and never more than
    the declared limit before it."""
    engine = make()
    audited(registry, monitor, limit=3)
    names = [f"r{n:02d}" for n in range(16)]
    _start(engine, *names)
    at_pause: list[list[str]] = []

    def racer(i: int) -> None:
        if i == 0:
            time.sleep(0.01)
            engine.override_limit("wf", "key:K", 1, by="race")
            engine.pause_key("wf", "key:K", by="race")
            at_pause.append(_holders(engine))
            return
        for name in names[(i - 1) * 2 : (i - 1) * 2 + 2]:
            claim(engine, name)

    errors = [e for e in run_threads(9, racer) if isinstance(e, BaseException)]
    assert not errors, errors
    holders = _holders(engine)
    assert holders == at_pause[0], f"admitted after the pause returned: {set(holders) - set(at_pause[0])}"
    assert len(holders) <= 3, holders
    for name in holders:
        settle(engine, name, "completed")
    engine.resume_key("wf", "key:K", by="race")
    assert len(_holders(engine)) == 1, "after resuming, the override of 1 holds"


@pytest.mark.django_db(transaction=True)
def test_command_changes_and_shows_controls() -> None:
    """K2, O3: ``manage.py durable_keys`` pauses, overrides, clears and resumes a key,
    recording the user, and shows the state with its history."""
    out = io.StringIO()
    call_command(
        "durable_keys", "pause", "sync-inventory", "--key", "store:CLI", "--by", "ann", "--reason", "why", stdout=out
    )
    call_command("durable_keys", "limit", "sync-inventory", "--key", "store:CLI", "--limit", "3", stdout=out)
    assert out.getvalue().splitlines() == [
        "sync-inventory store:CLI: paused, limit 1 (declared 1, no override)",
        "sync-inventory store:CLI: paused, limit 3 (declared 1, override 3)",
    ]
    shown = io.StringIO()
    call_command("durable_keys", "show", "sync-inventory", "--key", "store:CLI", stdout=shown)
    lines = shown.getvalue().splitlines()
    assert lines[0] == "sync-inventory store:CLI: paused, limit 3 (declared 1, override 3)"
    assert "ann: store:CLI paused False -> True - why" in lines[2]
    with pytest.raises(CommandError, match=r"needs --limit"):
        call_command("durable_keys", "limit", "sync-inventory", "--key", "store:CLI", stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"not a singleton workflow|no workflow"):
        call_command("durable_keys", "pause", "no-such-workflow", stdout=io.StringIO())


@pytest.mark.django_db(transaction=True)
def test_key_page_shows_controls_and_changes_them_with_the_change_permission(admin_client: Any, settings: Any) -> None:
    """K2: the key page shows the key's state and history; its form pauses the key
    and overrides the limit, recording the admin user; a bad limit is refused."""
    from django.urls import reverse

    from durable_singleton.models import KeyControlChange

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    page_url = reverse("admin:durable_singleton_run_queue_key") + "?workflow=sync-inventory&key=store:ADM"
    page = admin_client.get(page_url).content.decode()
    assert 'id="ds-controls"' in page and "Admitting." in page and "No control was ever changed" in page
    apply = reverse("admin:durable_singleton_keycontrol_apply")
    form = {"workflow": "sync-inventory", "key": "store:ADM", "reason": "smoke"}
    assert admin_client.post(apply, {**form, "control": "pause"}).status_code == 302
    assert admin_client.post(apply, {**form, "control": "limit", "limit": "2"}).status_code == 302
    refused = admin_client.post(apply, {**form, "control": "limit", "limit": "zero"}, follow=True).content.decode()
    assert "whole number" in refused
    page = admin_client.get(page_url).content.decode()
    assert "Paused" in page and "overridden to 2" in page and "smoke" in page
    assert 'id="ds-paused"' in page, "the summary says the key is paused"
    from durable_singleton.runtime import get_engine

    get_engine().start("sync-inventory", {"store_id": "ADM"}, run_id="adm-1")
    queues_page = admin_client.get(reverse("admin:durable_singleton_run_queues")).content.decode()
    row = queues_page[queues_page.index('data-key="store:ADM"') :][:1500]
    assert "paused" in row and "override 2" in row, row
    assert '<strong id="ds-limit">2</strong>' in page, "the summary shows the limit in force"
    assert list(KeyControlChange.objects.values_list("field", "changed_by")) == [
        ("limit_override", "admin"),
        ("paused", "admin"),
    ]
