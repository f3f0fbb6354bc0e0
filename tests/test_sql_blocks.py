"""The named SQL blocks of the PostgreSQL room (issue 32 item 4): each statement
loaded by name carries its ``/* durable_singleton:<name> */`` comment, the
fragments agree with the Python spellings of the same rule (the run's columns,
X5's due, the statuses and slot markers), and the fast path sends the blocks'
text under their names (R1, R5a, S7, X5)."""

from __future__ import annotations

import re

import pytest

from durable_singleton import sql
from durable_singleton.admission import is_due_sql_text
from durable_singleton.statuses import PARKED_STATUSES, RunStatus, SlotState
from durable_singleton.stores import pg

pytestmark = pytest.mark.vendor_agnostic


def _words(text: str) -> str:
    """``text`` without comments, its whitespace as single spaces."""
    text = re.sub(r"--[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))
    return " ".join(text.split())


def test_each_statement_starts_with_its_name_for_the_query_log() -> None:
    """Every statement of the room's files comes with the comment that names its block."""
    found = sql.statements()
    assert {
        "read",
        "take",
        "take_quota",
        "claim_take",
        "settle",
        "get",
        "create_key",
        "lock_key",
        "lock_run",
        "create_key_if",
        "create_quota_keys",
        "lock_quota_keys",
        "claim_create_key",
        "claim_lock_key",
        "claim_create_quota_keys",
        "claim_lock_quota_keys",
    } <= set(found)
    for name, text in found.items():
        assert text.startswith(f"/* durable_singleton:{name} */\n"), name
        assert "{{" not in text and "}}" not in text, name


def test_the_fast_path_sends_the_blocks_under_their_names() -> None:
    """A prepared statement's name starts with its block's name, and its text is the block's."""
    messages = [getattr(pg, n) for n in dir(pg) if n.endswith("_MESSAGE")]
    sent = {st.name.rsplit("_", 1)[0].removeprefix("ds_"): st.sql for m in messages for st in m.statements}
    for name, text in sql.statements().items():
        assert sent.get(name) == text, name


def test_the_run_columns_fragment_lists_the_record_columns_in_order() -> None:
    """R1: the fragment every statement returns is ``pg.COLUMNS`` on ``r``, in order."""
    assert _words(sql.fragment("run_columns")) == ", ".join(f"r.{c}" for c in pg.COLUMNS)


def test_the_due_fragment_is_the_admission_rule() -> None:
    """X5: the block's due condition is :func:`admission.is_due_sql_text` on ``r``."""
    assert _words(sql.fragment("is_due")) == is_due_sql_text("r", pg.NOW)


def test_the_blocks_name_only_known_statuses_and_slot_markers() -> None:
    """R2, S5: every quoted word in the blocks is a run status or a slot marker."""
    known = {s.value for s in RunStatus} | {s.value for s in SlotState}
    for name, text in sql.statements().items():
        assert set(re.findall(r"'(\w+)'", _words(text))) <= known, name
    parked = re.search(r"r\.status IN \(([^)]*)\)", _words(sql.statement("claim_take")))
    assert parked is not None
    assert {w.strip(" '") for w in parked[1].split(",")} == set(PARKED_STATUSES)


def test_a_block_psycopg_would_misread_or_a_message_join_would_cut_is_refused() -> None:
    """The loader refuses a stray ``%`` (psycopg reads it as a placeholder), a block
    that ends on a ``--`` comment (the ``;`` of a message would be commented out),
    a name used twice; an unknown name is a ``KeyError``."""
    good = "-- name: one\n-- One.\nSELECT %(a)s\n"
    assert sql.parse(good) == {"one": ("name", "SELECT %(a)s")}
    for bad in (
        "-- name: one\n-- One.\nSELECT 5 % 2\n",
        "-- name: one\n-- One.\nSELECT 1 -- a comment\n",
        good + good,
    ):
        with pytest.raises(ValueError):
            sql.parse(bad)
    with pytest.raises(KeyError):
        sql.statement("no_such_block")


def test_the_lock_blocks_use_the_names_the_admissions_read() -> None:
    """S13, X3e: the claim's lock statements record their locks in the session
    settings the admissions built in stores/pg.py read, and name a quota key's row
    with the quota prefix the ORM path uses."""
    from durable_singleton.admission import QUOTA_PREFIX

    assert f"set_config('{pg.CLAIM_LOCKED}'," in sql.statement("claim_lock_key")
    assert f"'{pg.CLAIM_QUOTA_LOCKED}'," in sql.statement("claim_lock_quota_keys")
    assert f"SELECT '{QUOTA_PREFIX}' || m0.quota AS wf" in sql.fragment("member_quota_keys")
    for name in ("keyed_candidate", "quota_candidate"):
        parked = re.search(r"r\.status IN \(([^)]*)\)", _words(sql.fragment(name)))
        assert parked is not None and {w.strip(" '") for w in parked[1].split(",")} == set(PARKED_STATUSES), name
