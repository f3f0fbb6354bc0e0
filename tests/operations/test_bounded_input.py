"""Bounded input at the operations commands (section 7, O3, O1; #18 item 4):
every bad option of ``durable_keys``, ``durable_purge``, ``durable_runs``, ``durable_queues``
and ``durable_worker`` is a :class:`CommandError` naming what is wrong, and
writes nothing. Huge limits, huge ages, NUL and lone surrogates (which a
shell passes for bytes that are not UTF-8) gave database errors,
``OverflowError`` or a traceback; ``durable_worker --tick-seconds inf`` was
accepted and its tick thread died, ``nan`` made it spin."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable_singleton.models import KeyControlChange, Run, SingletonKey
from durable_singleton.runtime import get_engine

pytestmark = pytest.mark.django_db(transaction=True)

HUGE = str(10**30)
AGES = ["9" * 400, "9" * 20 + "d"]
TEXTS = ["\x00", "a\x00b", "\udcff", "k\ud800", "\x1b", "x" * 400]


@pytest.fixture
def runs() -> list[str]:
    """Two finished runs and one waiting, for the commands to (not) touch."""
    engine = get_engine()
    ids = []
    for n in range(3):
        run = engine.start("sync-inventory", {"store_id": "BOUND"}, run_id=f"bounded-{n}")
        ids.append(run.run_id)
    Run.objects.filter(pk__in=ids[:2]).update(status="completed", singleton_slot=None, finished_at=engine.now())
    return ids


def _state() -> tuple[Any, ...]:
    return (
        sorted(Run.objects.values_list("run_id", "status", "updated_at")),
        sorted(SingletonKey.objects.values_list("workflow_name", "key", "paused", "limit_override")),
        KeyControlChange.objects.count(),
    )


def _refused(*args: str, match: str | None = None) -> str:
    before = _state()
    with pytest.raises(CommandError, match=match) as raised:
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    assert _state() == before, f"{args!r} wrote something"
    assert "Traceback" not in str(raised.value)
    return str(raised.value)


@pytest.mark.parametrize(
    "args",
    [
        ("limit", "sync-inventory", "--key", "store:BOUND", "--limit", HUGE),
        ("limit", "sync-inventory", "--key", "store:BOUND", "--limit", "0"),
        ("limit", "sync-inventory", "--limit", str(2**31)),
        *(("pause", "sync-inventory", "--key", text) for text in TEXTS),
        *(("show", "sync-inventory", "--key", text) for text in TEXTS),
        *(("pause", "sync-inventory", "--key", "store:BOUND", "--reason", text) for text in TEXTS[:5]),
        *(("resume", "sync-inventory", "--by", text) for text in TEXTS[:5]),
        ("pause", "sync\x00inventory"),
        ("pause", "sync-\udcffinventory", "--key", "store:BOUND"),
    ],
    ids=repr,
)
def test_durable_keys_refuses_bad_options(runs: list[str], args: tuple[str, ...]) -> None:
    """Section 7, K2, O3: each bad option of ``durable_keys`` is a CommandError; nothing is written."""
    _refused("durable_keys", *args)


@pytest.mark.parametrize(
    "args",
    [
        *(("--older-than", age) for age in AGES),
        ("--limit", HUGE),
        ("--limit", "0"),
        *(("--older-than", "0", "--workflow", text) for text in TEXTS),
        *(("--older-than", "0", "--key", text) for text in TEXTS),
    ],
    ids=repr,
)
def test_durable_purge_refuses_bad_options(runs: list[str], args: tuple[str, ...]) -> None:
    """Section 7, O2, O3: each bad option of ``durable_purge`` is a CommandError; nothing is deleted."""
    _refused("durable_purge", *args)


@pytest.mark.parametrize(
    "args",
    [
        ("list", "--limit", HUGE),
        ("list", "--limit", "0"),
        *(("list", "--older-than", age) for age in AGES),
        *(("cancel", "--older-than", age) for age in AGES),
        *(("list", text) for text in TEXTS),
        *(("cancel", "bounded-2", text) for text in TEXTS),
        *(("list", "--workflow", text) for text in TEXTS),
        *(("cancel", "--key", text) for text in TEXTS),
    ],
    ids=repr,
)
def test_durable_runs_refuses_bad_options(runs: list[str], args: tuple[str, ...]) -> None:
    """Section 7, O3: each bad option or run id of ``durable_runs`` is a
    CommandError; nothing is cancelled, retried or woken."""
    _refused("durable_runs", *args)


@pytest.mark.parametrize(
    "args",
    [
        ("--limit", HUGE),
        ("--limit", "-1"),
        ("--runs", "--runs-per-key", HUGE),
        ("--runs", "--runs-per-key", "0"),
        *(("--workflow", text) for text in TEXTS),
        *(("--key", text) for text in TEXTS),
    ],
    ids=repr,
)
def test_durable_queues_refuses_bad_options(runs: list[str], args: tuple[str, ...]) -> None:
    """Section 7, O3: each bad option of ``durable_queues`` is a CommandError
    (NUL was a DataError on PostgreSQL, a huge --limit a bigint overflow)."""
    _refused("durable_queues", *args)


@pytest.mark.parametrize("batch", [HUGE, "0", "-1"])
def test_durable_reencode_refuses_a_batch_out_of_range(batch: str) -> None:
    """Section 7, S13: ``--batch`` is 1 to 100,000."""
    assert "--batch" in _refused("durable_reencode", "--batch", batch)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("--tick-seconds", "inf"), "--tick-seconds"),
        (("--tick-seconds", "nan"), "--tick-seconds"),
        (("--tick-seconds", "-1"), "--tick-seconds"),
        (("--tick-seconds", "0"), "--tick-seconds"),
        (("--tick-seconds", "1e12"), "--tick-seconds"),
        (("--grace", "inf"), "--grace"),
        (("--grace", "nan"), "--grace"),
        (("--grace", "-1"), "--grace"),
        (("--threads", "0"), "--threads"),
        (("--threads", str(10**6)), "--threads"),
    ],
    ids=repr,
)
def test_durable_worker_refuses_a_period_or_count_out_of_range(args: tuple[str, ...], flag: str) -> None:
    """Section 7, O1, S8: ``--tick-seconds`` is finite, > 0 and at most 3600,
    ``--grace`` finite from 0 to 86400, ``--threads`` from 1 to 1024; anything
    else is a CommandError naming the option before any thread starts."""
    assert flag in _refused("durable_worker", *args)


def test_the_runs_a_refusal_left_alone_are_still_there(runs: list[str]) -> None:
    """Section 7: the good options still work after the bad ones (a control
    check of this module's fixtures)."""
    out = io.StringIO()
    call_command("durable_runs", "list", "--workflow", "sync-inventory", "--key", "store:BOUND", stdout=out)
    assert "list: 3 runs" in out.getvalue()
    call_command("durable_purge", "--older-than", "0", "--key", "store:BOUND", "--limit", "1", stdout=out)
    assert Run.objects.filter(pk__in=runs).count() == 2
