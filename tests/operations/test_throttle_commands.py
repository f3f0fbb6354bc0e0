"""The throttle keys in the commands (SPEC X6, K2, K3, O3; issue #33 item 4): ``manage.py
durable_queues`` lists the throttle keys with waiters (the rate, its use in the current
window, the waiters over the rate and the next admission, as text and JSON), and
``manage.py durable_keys`` pauses and overrides a throttle key, addressed as the workflow
``throttle:<name>``. On the DATABASE_URL database with its own claims; every time is the
database's clock (R5)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.management import call_command

from durable_singleton import Throttle
from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as declared
from durable_singleton.engine import Engine
from durable_singleton.testing import make_engine
from tests.helpers import drain

pytestmark = pytest.mark.django_db(transaction=True)

ERP = Throttle("erp-rate", key=lambda i: i["tenant"], limit=1, period=600.0)


@pytest.fixture
def throttled(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """``sync`` carries ``erp-rate`` (1 per 10 min): A of tenant t1 is admitted and
    completes; B and C of t1 are parked over the rate until the window opens."""
    engine = make_engine("django", registry=registry)
    registry.add("sync", "1", lambda ctx, i: None, throttles=[ERP])
    monkeypatch.setitem(declared.throttles, "erp-rate", ERP)  # the commands read the process's declarations
    for run_id in ("A", "B", "C"):
        engine.start("sync", {"tenant": "t1"}, run_id=run_id)
    drain(engine)
    assert [engine.get(r).status for r in ("A", "B", "C")] == ["completed", "suspended", "suspended"]
    return engine


def test_durable_queues_lists_a_throttle_key_with_its_throttled_waiters(
    throttled: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """X6, K3, O3: the throttle key erp-rate · t1 is listed (it was missing: a throttle-only
    workflow's waiters showed nowhere): 1 admission of 1 in the window, 2 waiters, both
    over the rate, the next admission at B's not_before (the window's opening); --workflow
    throttle:erp-rate keeps it, another workflow drops it, --only full keeps it."""
    call_command("durable_queues")
    text = capsys.readouterr().out
    assert "1 throttle key with waiters" in text and "throttle:erp-rate" in text and "1/1" in text, text
    call_command("durable_queues", "--json", "--workflow", "throttle:erp-rate", "--only", "full")
    [row] = json.loads(capsys.readouterr().out)["throttles"]
    opening = throttled.get("B").not_before
    assert opening is not None
    assert (row["throttle"], row["key"], row["limit"], row["period"]) == ("erp-rate", "t1", 1, 600.0)
    assert (row["admitted_in_window"], row["waiting"], row["throttled"]) == (1, 2, 2)
    assert row["next_admission_at"] == opening.isoformat()
    call_command("durable_queues", "--json", "--workflow", "sync")
    assert json.loads(capsys.readouterr().out)["throttles"] == []


def test_durable_keys_pauses_and_overrides_a_throttle_key(
    throttled: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """K2, X6: ``durable_keys limit throttle:erp-rate --key t1 --limit 3`` raises the key's
    limit in force (declared 1) and is recorded; the next claims admit B and C within the
    same window; ``pause`` and ``show`` address the same key."""
    call_command("durable_keys", "limit", "throttle:erp-rate", "--key", "t1", "--limit", "3", "--by", "ops")
    assert "throttle:erp-rate t1: admitting, limit 3 (declared 1, override 3)" in capsys.readouterr().out
    for run_id in ("B", "C"):
        throttled.execute(run_id)
    drain(throttled)
    assert [throttled.get(r).status for r in ("B", "C")] == ["completed", "completed"]
    call_command("durable_keys", "pause", "throttle:erp-rate", "--key", "t1", "--by", "ops")
    call_command("durable_keys", "show", "throttle:erp-rate", "--key", "t1", "--json")
    shown: dict[str, Any] = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert shown["controls"]["paused"] is True and shown["controls"]["limit"] == 3
    assert [h["field"] for h in shown["history"]] == ["paused", "limit_override"]
