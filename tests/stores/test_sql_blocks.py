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
from durable_singleton.statuses import PARKED_STATUSES, ParkReason, RunStatus, SlotState
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
        "start",
        "start_keyed",
        "start_quotas",
        "start_keyed_quotas",
        "admit",
        "claim_admit",
        "claim_quota_admit",
        "finish",
        "quota_finish",
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
    """R2, S5, S8a: every quoted word in the blocks is a run status, a slot marker or a park reason."""
    known = {s.value for s in RunStatus} | {s.value for s in SlotState} | {r.value for r in ParkReason}
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


def _top_level(text: str) -> list[str]:
    """``text`` split at its commas outside parentheses, each part in :func:`_words`."""
    parts, depth, current = [], 0, ""
    for char in _words(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def test_the_start_fragments_are_the_queue_and_limit_rules() -> None:
    """S5, S8a, K2, X5: the start's backlog check reads the queue front in the queue's
    order (``RunQuerySet.queue_front_sql_text``) and the limit in force
    (:func:`admission.limit_in_force_sql_text`) the ORM path and the admissions use."""
    from durable_singleton.admission import limit_in_force_sql_text
    from durable_singleton.querysets import RunQuerySet

    where, order = RunQuerySet.queue_front_sql_text("q0")
    assert _words(sql.fragment("queue_front")) == where
    assert _words(sql.fragment("queue_order")) == order
    override = (
        "(SELECT d0.limit_override FROM durable_singleton_singletonkey d0"
        " WHERE d0.workflow_name = %(workflow_name)s::varchar AND d0.key = %(singleton_key)s::varchar)"
    )
    assert _words(sql.fragment("started_key_limit")).replace("( ", "(").replace(" )", ")") == _words(
        limit_in_force_sql_text("%(deep_limit)s::integer", override)
    )


def test_each_start_writes_every_record_column_from_its_own_parameter() -> None:
    """R1, R3, R8: the starts' INSERT names each of ``pg.COLUMNS`` once, and each value
    is that column's parameter (a time: as given or its ``_in`` seconds from the
    database's now); the start with a key parks on a deep queue (S8a)."""
    columns = [*_top_level(sql.fragment("start_columns")), "wake_at", "park_reason"]
    assert sorted(columns) == sorted(pg.COLUMNS) and len(set(columns)) == len(columns)
    for name in ("start", "start_keyed"):
        text = _words(sql.statement(name))
        listed = re.search(r"INSERT INTO durable_singleton_run AS r \((.*?)\) VALUES", text)
        assert listed is not None and _top_level(listed[1]) == columns, name
        values = _top_level(text[text.index("VALUES (") + len("VALUES (") : text.index(") ON CONFLICT (run_id)")])
        assert len(values) == len(columns), name
        for column, value in zip(columns, values, strict=True):
            if column == "park_reason" and name == "start_keyed":
                assert value.endswith("THEN 'singleton' ELSE %(park_reason)s END"), value
            elif column == "wake_at" and name == "start_keyed":
                stamped = "COALESCE(%(wake_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(wake_at_in)s::float8))"
                assert "THEN COALESCE(%(backlog_wake_at)s," in value and value.endswith(f"ELSE {stamped} END"), value
            elif column in ("created_at", "updated_at", "deadline_at", "wake_at"):
                assert value == (
                    f"COALESCE(%({column})s, STATEMENT_TIMESTAMP() + make_interval(secs => %({column}_in)s::float8))"
                ), column
            else:
                assert value in (f"%({column})s", f"%({column})s::jsonb"), column
    for name in ("start_quotas", "start_keyed_quotas"):
        assert "ON CONFLICT (run_id) DO NOTHING" in sql.statement(name)
        assert _words(sql.statement(name)).endswith(f"SELECT {_words(sql.fragment('run_columns'))} FROM inserted r")


def test_the_admission_fragments_are_the_python_rules() -> None:
    """S5, S12, K2, X2: the admission blocks' rule fragments are the SQL text of
    :mod:`durable_singleton.admission` (which the conformance suite checks against the
    Python rule and the ORM twin), for any arguments."""
    from durable_singleton import admission

    assert _words(sql.fragment("limit_in_force", declared="D", override="O")) == (
        admission.limit_in_force_sql_text("D", "O")
    )
    assert _words(sql.fragment("free_slots", lim="L", holders="H", paused="P")) == (
        admission.free_slots_sql_text("L", "H", "P")
    )
    assert _words(sql.fragment("holds_slot", run="q0")) == admission.holds_slot_sql_text("q0")
    assert _words(sql.fragment("legacy_holder", run="l0")) == admission.legacy_holder_sql_text("l0")
    assert _words(sql.fragment("queue_ttl_expired", run="q0", ttl="T")) == (
        admission.queue_ttl_expired_sql_text("q0", "T::float8", pg.WRITTEN)
    )


def test_the_fast_path_statements_are_the_blocks_not_python_strings() -> None:
    """Issue 32 item 4: every moved statement pg.py sends is its named block's text, and
    each block's name is in its text's leading comment."""
    moved = {
        "START": "start",
        "START_KEYED": "start_keyed",
        "START_QUOTAS": "start_quotas",
        "START_KEYED_QUOTAS": "start_keyed_quotas",
        "ADMIT": "admit",
        "CLAIM_ADMIT": "claim_admit",
        "CLAIM_QUOTA_ADMIT": "claim_quota_admit",
        "FINISH": "finish",
        "QUOTA_FINISH": "quota_finish",
    }
    for attribute, name in moved.items():
        text = getattr(pg, attribute)
        assert text == sql.statement(name), attribute
        assert text.splitlines()[0] == f"/* durable_singleton:{name} */", attribute


def test_a_splice_with_arguments_puts_each_argument_in_and_nests() -> None:
    """The loader's fragment arguments: ``{{name: arg = SQL; ...}}`` binds each argument
    (an empty one puts nothing), an argument may splice, and a splice without ``=`` is refused."""
    text = (
        "-- fragment: pair\n-- Two.\n({{a}}, {{b}})\n"
        "-- fragment: one\n-- One.\n{{x}}\n"
        "-- name: both\n-- Both.\nSELECT {{pair: a = %(p)s; b = {{one: x = 2}}}}\n"
    )
    assert sql.parse(text)["both"] == ("name", "SELECT {{pair: a = %(p)s; b = {{one: x = 2}}}}")
    assert sql._splice("SELECT {{limit_in_force: declared = 3; override = }}", "postgresql") == (
        "SELECT (CASE WHEN COALESCE(, 3, 1) < 1 THEN 1 ELSE COALESCE(, 3, 1) END)"
    )
    with pytest.raises(ValueError):
        sql._splice("SELECT {{limit_in_force: declared}}", "postgresql")
    with pytest.raises(KeyError):
        sql._splice("SELECT {{limit_in_force}}", "postgresql")


def test_the_quota_fragments_are_the_python_rules() -> None:
    """X3b, X3c, X3d, X3g, X2, X5: the quota blocks' rule fragments are the SQL text and
    the order of :mod:`durable_singleton.admission`."""
    from durable_singleton import admission

    assert _words(sql.fragment("holds_quota_slot")) == admission.holds_quota_slot_sql_text("m", "mr")
    assert _words(sql.fragment("quota_waiter")) == (
        admission.quota_waiter_sql_text("m", "mr", pg.NOW, "%(ttls)s::jsonb")
    )
    assert _words(sql.fragment("quota_order")) == admission.order_sql_text(admission.QUOTA_ORDER, "m")
    assert _words(sql.fragment("quota_name")) == f"substr(k0.workflow_name, {len(admission.QUOTA_PREFIX) + 1})"


def test_no_statement_is_assembled_in_pg_py() -> None:
    """Issue 32 item 4: stores/pg.py builds no SQL text: every statement it sends is
    a named block, so no f-string there writes a clause of one."""
    import inspect

    source = inspect.getsource(pg)
    assert not re.search(r"f\"[^\"]*\b(SELECT|UPDATE|INSERT|WITH|WHERE|FROM)\b", source)
    messages = [getattr(pg, n) for n in dir(pg) if n.endswith("_MESSAGE")]
    names = set(sql.statements())
    for message in messages:
        for statement in message.statements:
            assert statement.name.rsplit("_", 1)[0].removeprefix("ds_") in names, statement.name


def test_the_sqlite_blocks_are_the_rules_and_name_their_statements() -> None:
    """R1, S5, S12, K2, X2 on SQLite (#32 item 2): every statement of the SQLite room carries
    the comment that names its block; its rule fragments are the SQL text of
    :mod:`durable_singleton.admission`; its columns are ``pg.COLUMNS`` in order; its quoted
    words are run statuses, slot markers, park reasons, the claim's kinds of write or SQLite's
    ``unixepoch`` time modifier."""
    from durable_singleton import admission
    from durable_singleton.stores import sqlite

    found = sql.statements("sqlite")
    assert {
        "start",
        "get",
        "claim",
        "take",
        "settle",
        "finish",
        "bump_token",
        "lock_key",
        "claim_throttled",
        "record_throttle_admission",
    } <= set(found)
    for name, text in found.items():
        assert text.startswith(f"/* durable_singleton:{name} */\n"), name
        assert "{{" not in text and "}}" not in text, name
    assert _words(sql.fragment("run_columns", "sqlite")) == ", ".join(f"r.{c}" for c in pg.COLUMNS)
    assert _words(sql.fragment("returned_columns", "sqlite")) == ", ".join(pg.COLUMNS)
    assert _words(sql.fragment("limit_in_force", "sqlite", declared="D", override="O")) == (
        admission.limit_in_force_sql_text("D", "O")
    )
    assert _words(sql.fragment("free_slots", "sqlite", lim="L", holders="H", paused="P")) == (
        admission.free_slots_sql_text("L", "H", "P")
    )
    assert _words(sql.fragment("holds_slot", "sqlite", run="q0")) == admission.holds_slot_sql_text("q0")
    assert _words(sql.fragment("legacy_holder", "sqlite", run="l0")) == admission.legacy_holder_sql_text("l0")
    known = {s.value for s in RunStatus} | {s.value for s in SlotState} | {r.value for r in ParkReason}
    kinds = {"take", "admit", "grant", "park_front", "park_backlog", "park_throttled", "turn", "unixepoch"}
    for name, text in found.items():
        assert set(re.findall(r"'(\w+)'", _words(text))) <= known | kinds, name
    assert sql.statement("claim", "sqlite") == sqlite.CLAIM and sql.statement("finish", "sqlite") == sqlite.FINISH
    assert sql.statement("claim_throttled", "sqlite") == sqlite.CLAIM_THROTTLED
