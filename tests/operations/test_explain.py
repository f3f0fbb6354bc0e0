"""Why is it waiting (K3): engine.explain on the in-memory store and on the
DATABASE_URL database, the durable_explain command, and the admin's run and
key pages."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import RunNotFoundError
from durable_singleton.explain import ExplainState, estimate_wait
from tests.conftest import Monitor
from tests.helpers import admitted, audited, claim


def _hold(engine: Engine, run_id: str, key: str = "key:K") -> None:
    """Make ``run_id`` a holder through the store's claim without running its body."""
    assert admitted(claim(engine, run_id, "w")) == "admitted"


def _queue(engine: Engine, registry: Registry, monitor: Monitor, *names: str) -> None:
    audited(registry, monitor)
    for name in names:
        engine.start("wf", {"k": "K"}, run_id=name)
    _hold(engine, names[0])
    for name in reversed(names[1:]):
        assert engine.execute(name) == "parked"
    engine.dispatcher.queue.clear()


def test_holder_is_explained_with_its_slot_since_and_state(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3, K1: a holder's explanation says it holds a slot of its key, since when, with
    which fencing token, and what it is doing."""
    _queue(engine, registry, monitor, "A", "B")
    found = engine.explain("A")
    assert found.state is ExplainState.HOLDER and found.key == "key:K" and found.limit == 1
    assert found.holder_since is not None and found.holder_count == 1 and found.depth == 1
    assert found.sentence.startswith("Run A holds a slot of key 'key:K' of wf since ")
    assert found.fencing_token == engine.get("A").fencing_token and found.fencing_token is not None
    assert f"fencing token {found.fencing_token}" in found.sentence
    assert "it is running (lease held by w)" in found.sentence


def test_waiter_explanation_names_the_keys_pause_and_override(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3, K2: behind a paused key with an overridden limit, the waiter's explanation
    says the key is paused and which limit is in force, and gives no estimate."""
    _queue(engine, registry, monitor, "A", "B")
    engine.pause_key("wf", "key:K", by="ops")
    engine.override_limit("wf", "key:K", 2, by="ops")  # paused: the new slot is not granted
    found = engine.explain("B")
    assert found.state is ExplainState.WAITER and found.paused and found.limit_override == 2 and found.limit == 2
    assert "the key is paused: no run is admitted until it is resumed" in found.sentence
    assert "limit 2 (overridden from 1)" in found.sentence and found.estimated_wait_seconds is None


def test_waiter_is_explained_with_position_holders_depth_and_limit(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3, S5: a waiter's explanation gives its position in admission order, the
    named holders with their hold times, the queue depth and the limit."""
    _queue(engine, registry, monitor, "A", "B", "C", "D")
    found = engine.explain("C")
    assert found.state is ExplainState.WAITER
    assert (found.position, found.depth, found.limit, found.paused) == (2, 3, 1, False)
    assert [h.run_id for h in found.holders] == ["A"] and found.holders[0].held_seconds is not None
    assert found.sentence.startswith(
        "Run C is waiting: position 2 of 3 in line for key 'key:K' of wf, behind A (running, holding for "
    )
    assert "(limit 1)" in found.sentence
    assert found.estimated_wait_seconds is None  # no completed run yet to estimate from
    document = found.as_dict()
    assert json.loads(json.dumps(document))["holders"][0]["run_id"] == "A"


def test_waiter_gets_an_estimated_wait_from_the_keys_recent_durations(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3: once runs of the key completed, a waiter gets an estimated wait."""
    audited(registry, monitor)
    for n in range(3):
        engine.start("wf", {"k": "K"}, run_id=f"done-{n}")
    engine.dispatcher.drain()
    for name in ("A", "B", "C"):
        engine.start("wf", {"k": "K"}, run_id=name)
    _hold(engine, "A")
    assert engine.execute("C") == "parked" and engine.execute("B") == "parked"
    found = engine.explain("C")
    assert found.recent_durations == 3 and found.estimated_wait_seconds is not None
    assert "estimated wait about" in found.sentence and "median of the last 3 runs" in found.sentence


def test_waiter_with_a_free_slot_is_runnable_and_says_since_when(
    engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """K3, S8: when the holder finished but no worker took the first waiter's turn
    (the push was lost), the waiter could run now and the explanation says so."""
    _queue(engine, registry, monitor, "A", "B", "C")
    holder = engine.get("A")
    done = engine.store.finish(holder, holder.lease_owner, "completed", limits=engine.limits())
    assert done.settled and [r.run_id for r in done.granted] == ["B"]  # B holds the slot; its turn is never sent
    found = engine.explain("B")
    assert found.state is ExplainState.RUNNABLE and found.idle_since is not None and found.fencing_token == 2
    assert "could run now" in found.sentence and "no worker has taken its turn since" in found.sentence
    assert engine.explain("C").state is ExplainState.WAITER


def test_runs_without_a_key_and_finished_runs_are_explained(engine: Engine, registry: Registry) -> None:
    """K3: a pending run without a key could run now; a finished run waits for
    nothing; an unknown run id is a typed error."""
    registry.add("plain", "1", lambda c, i: "ok")
    engine.start("plain", run_id="P")
    pending = engine.explain("P")
    assert pending.state is ExplainState.RUNNABLE and "no worker has taken its turn since" in pending.sentence
    engine.dispatcher.drain()
    done = engine.explain("P")
    assert done.state is ExplainState.TERMINAL and done.sentence.startswith("Run P is completed")
    with pytest.raises(RunNotFoundError):
        engine.explain("nope")


def test_estimated_wait_models_each_slot_freeing_in_turn() -> None:
    """K3: the estimate frees each holder's slot after the typical duration less
    what it already held, then gives each waiter ahead a typical duration."""
    assert estimate_wait(1, 1, [10.0], 30.0) == 20.0
    assert estimate_wait(3, 1, [10.0], 30.0) == 80.0
    assert estimate_wait(3, 2, [10.0, 25.0], 30.0) == 35.0  # slots free at 5 and 20; then 5+30
    assert estimate_wait(1, 2, [10.0], 30.0) == 0.0  # a free slot
    assert estimate_wait(1, 1, [90.0], 30.0) == 0.0  # overdue holder: any moment


@pytest.mark.django_db(transaction=True)
def test_command_and_admin_pages_show_the_explanation(admin_client: Any, settings: Any) -> None:
    """K3, O3: ``manage.py durable_explain`` prints the sentence (or JSON) and the
    admin's run page answers "why is my run waiting, and behind whom?" at the
    top; the key page explains its first waiter."""
    from django.urls import reverse

    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    for name in ("X1", "X2", "X3"):
        engine.start("sync-inventory-wide", {"store_id": "EX"}, run_id=name)
    for name in ("X1", "X2"):
        assert admitted(claim(engine, name, "w")) == "admitted"
    assert engine.execute("X3") == "parked"
    engine.dispatcher.queue.clear()

    out = io.StringIO()
    call_command("durable_explain", "X3", stdout=out)
    text = out.getvalue()
    assert text.startswith("Run X3 is waiting: position 1 of 1 in line for key 'store:EX' of sync-inventory-wide")
    assert "behind X1 (running, holding for" in text and "X2 (running" in text and "(limit 2)" in text
    out = io.StringIO()
    call_command("durable_explain", "X1", "--json", stdout=out)
    assert json.loads(out.getvalue())["state"] == "holder"
    with pytest.raises(CommandError, match="no run 'nope'"):
        call_command("durable_explain", "nope", stdout=io.StringIO())

    page = admin_client.get(reverse("admin:durable_singleton_run_change", args=["X3"])).content.decode()
    assert page.index('id="ds-explain"') < page.index("<fieldset"), "the sentence comes before the fields"
    assert "Run X3 is waiting: position 1 of 1" in page
    key_page = admin_client.get(
        reverse("admin:durable_singleton_run_queue_key") + "?workflow=sync-inventory-wide&key=store:EX"
    ).content.decode()
    assert "First in line:" in key_page and "Run X3 is waiting" in key_page
    engine.dispatcher.queue.clear()


@pytest.mark.django_db(transaction=True)
def test_the_command_takes_an_unambiguous_run_id_prefix_as_git_does(settings: Any) -> None:
    """K3, O3, section 7: ``durable_explain 69b0836c`` explains the one run whose id begins
    so; an ambiguous prefix is an :class:`AmbiguousRunIdError` listing the candidates and an
    unknown one lists none, each a CommandError (exit status 1), as git answers a short hash."""
    from durable_singleton.exceptions import AmbiguousRunIdError
    from durable_singleton.management.commands._options import resolve_run_id
    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    ids = ["69b0836c" + "0" * 24, "69b0836d" + "1" * 24, "69b0836d" + "2" * 24]
    for run_id in ids:
        engine.start("sync-inventory-wide", {"store_id": "PFX"}, run_id=run_id)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

    out = io.StringIO()
    call_command("durable_explain", "69b0836c", stdout=out)
    assert out.getvalue().startswith(f"Run {ids[0]} ")
    assert resolve_run_id(engine, ids[1]) == ids[1]  # a whole id is itself
    with pytest.raises(AmbiguousRunIdError) as ambiguous:
        resolve_run_id(engine, "69b0836d")
    assert ambiguous.value.candidates == ids[1:]
    with pytest.raises(CommandError, match=f"ambiguous; candidates: {ids[0]}, {ids[1]}, {ids[2]} "):
        call_command("durable_explain", "69b0836", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no run id begins with it"):
        call_command("durable_explain", "ffff", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no run '100%'"):
        call_command("durable_explain", "100%", stdout=io.StringIO())
