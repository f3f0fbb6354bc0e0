"""The PostgreSQL fast path of the Django store: the hot transactions as raw SQL.

:class:`~durable_singleton.stores.django.DjangoStore` sends these through the
connection's cursor on PostgreSQL (psycopg 3 with client-side binding, Django's
default), and keeps its ORM path for every other database and for the rare
cases named below. Each is one round trip:

* the first message of a turn (:meth:`FastPath.claim`): a waiter's admission
  as below, its values read from its own row after its key's lock, or the
  lease of a run without a key (one compare-and-set), then the
  read of the run (:data:`READ`), with "has its lease expired?" decided by the
  database's clock; a run that was no waiter to admit goes on from that read;
* the confirmation claim of a holder, a run without a key or a run this
  process just granted (:meth:`FastPath.take`): one ``UPDATE ... RETURNING``,
  a compare-and-set on what was read; its ``step_count`` tells the engine
  whether there are steps to load (R4);
* the admission of a waiter (:meth:`FastPath.admit`) and the handoff
  (:meth:`FastPath.finish`): one message of three statements, the key row's
  upsert, its ``SELECT ... FOR UPDATE``, then one statement whose CTEs read
  the holders and the front of the queue, grant the free slots with their
  fencing tokens, take the claimant's lease or park it (or settle the run)
  and bump the key's token. Sent as one simple-protocol message outside a
  transaction, the three run as one transaction; at READ COMMITTED the third
  statement's snapshot is taken after the key's lock, so it reads every
  commit before the lock, as the ORM path's reads after ``lock_key`` do.

The rules are not restated: who holds a slot, the limit in force and the free
slots are :mod:`durable_singleton.admission`'s SQL text
(:func:`~durable_singleton.admission.holds_slot_sql_text`,
:func:`~durable_singleton.admission.limit_in_force_sql_text`,
:func:`~durable_singleton.admission.free_slots_sql_text`), the queue order
:meth:`RunQuerySet.queue_front_sql_text
<durable_singleton.querysets.RunQuerySet.queue_front_sql_text>`, the clock
:data:`~durable_singleton.querysets.PG_NOW_SQL`. Lock order: the key row,
then run rows (S13). Every write is a compare-and-set on what was read (R5a).

The clock: ``STATEMENT_TIMESTAMP()`` is the time the message arrived, for
all three statements. A settle whose message waited for the key's lock is
judged on its owner's lease at that arrival; that is safe because every
takeover of a keyed run takes the same lock first (so it either committed
before, and the compare-and-set on the owner refuses the settle, or it waits
and finds the run settled). The times a statement writes for what happens
next (a lease's expiry, the wake of a grant or of a parked claimant,
``admitted_at``) are :data:`WRITTEN`, the database's clock as the row is
written, after the lock (R5, R8): measured from the arrival, a claim that
waited for the lock longer than its lease was admitted with a lease already
expired, which the tick could recover while the body ran.
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from django.db import connections

from ..admission import (
    free_slots_sql_text,
    holds_slot_sql_text,
    is_due_sql_text,
    legacy_holder_sql_text,
    limit_in_force_sql_text,
    queue_ttl_expired_sql_text,
    quota_tag,
    split_quota_tags,
)
from ..models import Run, SingletonKey
from ..querysets import PG_NOW_SQL, RunQuerySet
from ..records import RunRecord, StepRecord
from ..statuses import PARKED_STATUSES, ParkReason, RunStatus, SlotState
from .base import Finish, Limits, Turn, TurnState


class Store(Protocol):
    """What the fast path needs of its :class:`~durable_singleton.stores.django.DjangoStore`."""

    @property
    def db(self) -> str:
        """The database alias."""

    @property
    def redelivery_seconds(self) -> float:
        """How long a granted waiter's turn is left to arrive before the tick sends it (S7a)."""


__all__ = ["FastPath", "Store", "usable"]

RUN = Run._meta.db_table
KEY = SingletonKey._meta.db_table
NOW = PG_NOW_SQL
#: The database's clock when a row is written (after the key's lock, unlike :data:`NOW`, the
#: message's arrival): the start of a lease, a wake or an admission written by a statement (R5, R8).
WRITTEN = "CLOCK_TIMESTAMP()"

#: The run table's columns a :class:`RunRecord` is built from, in this order.
COLUMNS = (
    "run_id",
    "workflow_name",
    "workflow_version",
    "namespace",
    "status",
    "input",
    "created_at",
    "updated_at",
    "output",
    "error",
    "tags",
    "singleton_key",
    "singleton_limit",
    "singleton_slot",
    "singleton_tracked",
    "wake_at",
    "lease_owner",
    "lease_expires_at",
    "started_at",
    "finished_at",
    "admitted_at",
    "attempts",
    "recoveries",
    "parent_run_id",
    "park_reason",
    "cancel_requested",
    "deadline_at",
    "fencing_token",
    "step_count",
    "not_before",
    "quota_slot",
)


def _cols(table: str) -> str:
    return ", ".join(f"{table}.{c}" for c in COLUMNS)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def record(row: Sequence[Any]) -> RunRecord:
    """Return the :class:`RunRecord` of a row of :data:`COLUMNS`."""
    (
        run_id,
        workflow_name,
        workflow_version,
        namespace,
        status,
        input,
        created_at,
        updated_at,
        output,
        error,
        tags,
        singleton_key,
        singleton_limit,
        singleton_slot,
        singleton_tracked,
        wake_at,
        lease_owner,
        lease_expires_at,
        started_at,
        finished_at,
        admitted_at,
        attempts,
        recoveries,
        parent_run_id,
        park_reason,
        cancel_requested,
        deadline_at,
        fencing_token,
        step_count,
        not_before,
        quota_slot,
    ) = row[: len(COLUMNS)]
    user_tags, quota_keys = split_quota_tags(_json(tags) or ())
    return RunRecord(
        run_id=run_id,
        workflow_name=workflow_name,
        workflow_version=workflow_version,
        namespace=namespace,
        status=status,
        input=_json(input),
        created_at=created_at,
        updated_at=updated_at,
        output=_json(output),
        error=_json(error),
        user_tags=user_tags,
        singleton_key=singleton_key,
        singleton_limit=singleton_limit,
        admitted=singleton_slot == SlotState.HOLDER,
        tracked=singleton_tracked,
        wake_at=wake_at,
        lease_owner=lease_owner,
        lease_expires_at=lease_expires_at,
        started_at=started_at,
        finished_at=finished_at,
        admitted_at=admitted_at,
        attempts=attempts,
        recoveries=recoveries,
        parent_run_id=parent_run_id,
        park_reason=park_reason,
        cancel_requested=cancel_requested,
        deadline_at=deadline_at,
        fencing_token=fencing_token,
        step_count=step_count,
        not_before=not_before,
        quota_keys=quota_keys,
        quota_slot=quota_slot,
    )


def stored_tags(run: RunRecord) -> list[str]:
    """The ``tags`` column of ``run``: the caller's tags, then its quota keys'
    ``quota:<name>:<key>`` tags (X3b); the key tag and markers are columns."""
    return [*run.user_tags, *(quota_tag(name, key) for name, key in run.quota_keys)]


def usable(store: Store) -> bool:
    """Tell whether the store's connection can take the fast path: PostgreSQL
    through psycopg 3 with client-side binding (a message of several statements
    needs the simple query protocol)."""
    connection = connections[store.db]
    if connection.vendor != "postgresql":
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return bool(is_psycopg3) and connection.settings_dict.get("OPTIONS", {}).get("server_side_binding") is not True


def _seconds(name: str) -> str:
    """The database's clock as the row is written plus the ``name`` parameter's seconds (R5, R8)."""
    return f"{WRITTEN} + make_interval(secs => %({name})s::float8)"


# -- the statements ------------------------------------------------------------------------------
FRONT_WHERE, FRONT_ORDER = RunQuerySet.queue_front_sql_text("q0")

#: One read of a run for its turn, with whether its lease expired and whether it is due
#: (its delayed start has come, X5) by the database's clock (R5).
READ = (
    f"SELECT {_cols('r')}, r.lease_expires_at <= {NOW}, {is_due_sql_text('r', NOW)}"
    f" FROM {RUN} r WHERE r.run_id = %(run_id)s"
)

_TAKE_SET = (
    f"status = '{RunStatus.RUNNING.value}', lease_owner = %(owner)s, lease_expires_at = {_seconds('lease')},"
    f" wake_at = NULL, attempts = r.attempts + 1, recoveries = r.recoveries + %(recovered)s,"
    f" started_at = COALESCE(r.started_at, {NOW}), updated_at = {NOW}"
)
#: The compare of a claim on what was read (``DjangoStore._as_read``): status, attempts, the
#: cancel flag, and for a running run its owner and its expired lease (R5a, R6, S9).
_AS_READ = (
    "r.run_id = %(run_id)s AND r.status = %(status)s AND r.attempts = %(attempts)s"
    " AND r.cancel_requested = %(cancel)s"
    f" AND (r.status <> '{RunStatus.RUNNING.value}'"
    f" OR (r.lease_owner IS NOT DISTINCT FROM %(read_owner)s AND r.lease_expires_at <= {NOW}))"
)
#: The confirmation claim of a run without a key (``holder`` false) or of a holder (S6).
TAKE = (
    f"UPDATE {RUN} r SET {_TAKE_SET},"
    f" singleton_slot = CASE WHEN %(holder)s THEN '{SlotState.HOLDER.value}' ELSE r.singleton_slot END,"
    " singleton_tracked = r.singleton_tracked OR %(holder)s"
    f" WHERE {_AS_READ} RETURNING {_cols('r')}"
)

#: Lock the key's row, creating it if missing (S13); the first two statements of a message.
CREATE_KEY = (
    f"INSERT INTO {KEY} (created, modified, workflow_name, key, last_token, paused)"
    f" VALUES ({NOW}, {NOW}, %(wf)s, %(key)s, 0, FALSE) ON CONFLICT (workflow_name, key) DO NOTHING"
)
LOCK_KEY = f"SELECT k.id FROM {KEY} k WHERE k.workflow_name = %(wf)s AND k.key = %(key)s FOR UPDATE"
#: Lock the claimant's row in a statement of its own, after its key's (S13), before the
#: statement that writes its lease (R5): an ``UPDATE`` that waits for a row another
#: transaction only locked (a signal's or a cancel's ``SELECT ... FOR UPDATE``) writes the
#: new row it computed before the wait, so a lease's expiry measured then would come short
#: by the wait; the next statement reads the clock after it.
LOCK_RUN = f"SELECT 1 FROM {RUN} r WHERE r.run_id = %(run_id)s FOR UPDATE"


def _param(name: str) -> str:
    """A value of a statement given as the parameter ``name``."""
    return f"%({name})s"


def _claimed(name: str) -> str:
    """A value of a statement read from the claimant's own row (the ``me`` CTE of :data:`CLAIM_ADMIT`)."""
    return f"(SELECT me.{name} FROM me)"


def _queue(exclude: str, value: Any = _param) -> str:
    """The CTEs every grant reads, under the key's lock: the key (``k``, with
    the limit in force), the untracked holders of an older release (``lg``),
    the holders and the front of the queue (``q``: at most twice the limit
    rows, one read of ``ds_run_queue_idx``), the free slots (``c``) and the
    waiters in admission order (``w``) (S5, S12, K2). A waiter past the
    workflow's ``queue_ttl`` (the ``ttl`` parameter, seconds, NULL when none is
    declared) by the database's clock as the row is read, after the key's
    lock, is left out of ``q``, so of ``w``: no grant reaches it and it takes
    no row of the front's ``LIMIT`` (X2). ``exclude``: a run id parameter left
    out of the reads (the run this statement settles), or ''. ``value``: the
    SQL of the workflow (``wf``), the key (``key``), the declared limit
    (``declared``) and the TTL (``ttl``) by name (:func:`_param`: parameters;
    :func:`_claimed`: the claimant's row)."""
    wf, key = value("wf"), value("key")
    skip = f" AND q0.run_id <> %({exclude})s" if exclude else ""
    expired = queue_ttl_expired_sql_text("q0", f"{value('ttl')}::float8", WRITTEN)
    fresh = f" AND (q0.singleton_slot <> '{SlotState.WAITER.value}' OR NOT {expired})"
    skip_lg = f" AND l0.run_id <> %({exclude})s" if exclude else ""
    limit = limit_in_force_sql_text(value("declared"), "k0.limit_override")
    holders = "(SELECT count(*) FROM q WHERE q.holds) + (SELECT lg.n FROM lg)"
    return (
        f"k AS (SELECT k0.id, k0.last_token, k0.paused, {limit} AS lim FROM {KEY} k0"
        f" WHERE k0.workflow_name = {wf} AND k0.key = {key}),"
        f" lg AS (SELECT count(*) AS n FROM {RUN} l0 WHERE l0.workflow_name = {wf} AND l0.singleton_key = {key}"
        f" AND {legacy_holder_sql_text('l0')}{skip_lg}),"
        f" q AS (SELECT q0.run_id, q0.status, q0.singleton_slot, q0.created_at, {holds_slot_sql_text('q0')} AS holds"
        f" FROM {RUN} q0 WHERE q0.workflow_name = {wf} AND q0.singleton_key = {key} AND {FRONT_WHERE}{skip}{fresh}"
        f" ORDER BY {FRONT_ORDER} LIMIT (SELECT 2 * k.lim FROM k)),"
        f" c AS (SELECT k.id, k.last_token, k.lim, {free_slots_sql_text('k.lim', holders, 'k.paused')} AS free FROM k),"
        " w AS (SELECT q.run_id, q.status, row_number() OVER (ORDER BY q.created_at, q.run_id) AS pos"
        f" FROM q WHERE q.singleton_slot = '{SlotState.WAITER.value}')"
    )


_GRANT_SET = (
    f"singleton_slot = '{SlotState.HOLDER.value}', singleton_tracked = TRUE, fencing_token = g.token,"
    f" admitted_at = {WRITTEN}"
)
#: Each grant is a compare-and-set on the waiter as read (S7, K1).
#: A waiter that carries quotas keeps its place and gets no slot here: its own claim decides
#: on the ORM path, under the locks of all its limits (X3h).
_GRANT_CAS = (
    f"r.run_id = g.run_id AND r.status = g.status AND r.singleton_slot = '{SlotState.WAITER.value}'"
    " AND NOT r.cancel_requested AND r.quota_slot IS NULL"
)
#: The key's token counter moves past every token the grants handed out (K1).
_BUMP = (
    f"t AS (UPDATE {KEY} k1 SET last_token = c.last_token + (SELECT count(*) FROM g) FROM c"
    " WHERE k1.id = c.id AND EXISTS (SELECT 1 FROM g))"
)

#: The owner's compare-and-set of a settle (R5a).
FINISH_OWNED = f"r.status = '{RunStatus.RUNNING.value}' AND r.lease_owner = %(owner)s AND r.lease_expires_at > {NOW}"

#: The handoff: settle the run by compare-and-set on its owner's unexpired lease, dropping
#: its markers in the same write, then grant the freed slots to the oldest waiters (S7, S12, R5a, K1).
FINISH = (
    f"WITH s AS (UPDATE {RUN} r SET status = %(final)s, output = %(output)s::jsonb, error = %(error)s::jsonb,"
    " singleton_slot = NULL, singleton_tracked = FALSE, lease_owner = NULL, lease_expires_at = NULL,"
    f" wake_at = NULL, finished_at = COALESCE(%(finished_at)s, {NOW}), updated_at = {NOW}"
    f" WHERE r.run_id = %(run_id)s AND {FINISH_OWNED} RETURNING {_cols('r')}),"
    f" {_queue('run_id')},"
    " g AS (SELECT w.run_id, w.status, c.last_token + w.pos AS token FROM w, c"
    " WHERE w.pos <= c.free AND EXISTS (SELECT 1 FROM s)),"
    f" u AS (UPDATE {RUN} r SET {_GRANT_SET}, wake_at = {_seconds('redelivery')}, updated_at = {NOW} FROM g"
    f" WHERE {_GRANT_CAS} RETURNING {_cols('r')}),"
    f" {_BUMP}"
    f" SELECT 0, {_cols('s')} FROM s UNION ALL SELECT 1, {_cols('u')} FROM u"
)

#: A settle without a key: the compare-and-set alone (R5a).
SETTLE = (
    f"UPDATE {RUN} r SET status = %(final)s, output = %(output)s::jsonb, error = %(error)s::jsonb,"
    " singleton_slot = NULL, singleton_tracked = FALSE, lease_owner = NULL, lease_expires_at = NULL,"
    f" wake_at = NULL, finished_at = COALESCE(%(finished_at)s, {NOW}), updated_at = {NOW}"
    f" WHERE r.run_id = %(run_id)s AND {FINISH_OWNED} RETURNING 0, {_cols('r')}"
)


def _admit(me: str, value: Any) -> str:
    """The admission statement with the claimant's CTE ``me`` and its values
    (``status``, ``attempts`` and :func:`_queue`'s) from ``value``."""
    status, attempts = value("status"), value("attempts")
    return (
        f"WITH me AS ({me}),"
        f" {_queue('', value)},"
        " g AS (SELECT w.run_id, w.status, c.last_token + w.pos AS token FROM w, c"
        " WHERE w.pos <= c.free AND EXISTS (SELECT 1 FROM me)),"
        f" mine AS (UPDATE {RUN} r SET {_TAKE_SET}, {_GRANT_SET} FROM g"
        f" WHERE g.run_id = %(run_id)s AND {_GRANT_CAS} AND r.attempts = {attempts} RETURNING {_cols('r')}),"
        f" others AS (UPDATE {RUN} r SET {_GRANT_SET}, wake_at = {_seconds('redelivery')}, updated_at = {NOW} FROM g"
        f" WHERE g.run_id <> %(run_id)s AND {_GRANT_CAS} RETURNING {_cols('r')}),"
        f" park AS (UPDATE {RUN} r SET status = '{RunStatus.SUSPENDED.value}', attempts = r.attempts + 1,"
        f" wake_at = {WRITTEN} + make_interval(secs => CASE WHEN EXISTS"
        " (SELECT 1 FROM w, c WHERE w.run_id = %(run_id)s AND w.pos <= c.lim)"
        " THEN %(front)s::float8 ELSE %(backlog)s::float8 END),"
        " lease_owner = NULL, lease_expires_at = NULL,"
        f" park_reason = '{ParkReason.SINGLETON.value}', updated_at = {NOW}"
        f" WHERE r.run_id = %(run_id)s AND r.status = {status} AND r.attempts = {attempts}"
        " AND NOT r.cancel_requested AND EXISTS (SELECT 1 FROM me)"
        " AND NOT EXISTS (SELECT 1 FROM g WHERE g.run_id = %(run_id)s)"
        f" RETURNING {_cols('r')}),"
        f" {_BUMP}"
        f" SELECT 0, {_cols('mine')} FROM mine UNION ALL SELECT 1, {_cols('others')} FROM others"
        f" UNION ALL SELECT 2, {_cols('park')} FROM park"
    )


_PARKED = ", ".join(f"'{st}'" for st in PARKED_STATUSES)
_WAITER = f"r.singleton_slot = '{SlotState.WAITER.value}' AND r.singleton_tracked"

#: The admission of a waiter (S5): under the key's lock, the claimant as read (``me``: still a
#: tracked waiter with the status, attempts and cancel flag this turn read; if not, nothing
#: is written and the ORM path decides), the free slots go to the oldest waiters, each with
#: the next token; the claimant takes its lease as a holder if it is among them, else it is
#: parked with its retry ``wake_at`` (the front delay if it is among the first ``limit``
#: waiters, else the backlog's, S5 step 5, S8a).
ADMIT = _admit(
    f"SELECT r.run_id FROM {RUN} r WHERE r.run_id = %(run_id)s AND r.status = %(status)s"
    f" AND r.attempts = %(attempts)s AND NOT r.cancel_requested AND {_WAITER}",
    _param,
)

#: A claim's first turn of a waiter without a read before it (:meth:`FastPath.claim`): the
#: run is a candidate when it is a tracked waiter without quotas (X3i), parked (not running, not
#: terminal), not cancelled, due (X5) and of a workflow in the ``limits`` parameter (a JSON object of the
#: declared limits this process knows); its workflow, key, declared limit and TTL come from
#: its own row. Read without a lock: a run's workflow and key never change.
_CANDIDATE = (
    f"r.run_id = %(run_id)s AND {_WAITER} AND r.quota_slot IS NULL AND r.status IN ({_PARKED})"
    f" AND NOT r.cancel_requested AND {is_due_sql_text('r', NOW)} AND %(limits)s::jsonb ? r.workflow_name"
)
CLAIM_CREATE_KEY = (
    f"INSERT INTO {KEY} (created, modified, workflow_name, key, last_token, paused)"
    f" SELECT {NOW}, {NOW}, r.workflow_name, r.singleton_key, 0, FALSE FROM {RUN} r WHERE {_CANDIDATE}"
    " ON CONFLICT (workflow_name, key) DO NOTHING"
)
#: The session setting in which :data:`CLAIM_LOCK_KEY` records the key row it locked, with
#: the transaction that holds the lock.
CLAIM_LOCKED = "durable_singleton.claim_locked"
#: Which key row this transaction has locked, as :data:`CLAIM_LOCK_KEY` records it.
_LOCKED_BY_ME = "(k.id::text || ':' || pg_current_xact_id()::text)"
#: What :data:`CLAIM_LOCK_KEY` recorded (NULL: nothing): its key row's id, ``:``, its transaction's id.
_RECORDED = f"current_setting('{CLAIM_LOCKED}', true)"
#: Lock the candidate's key row and record that this transaction holds it: each statement
#: of the message takes its own snapshot, so a run that became a candidate after this
#: statement (a retry reset, a row that appeared) is no proof of the lock; the admission
#: below writes only for a key row recorded here (S5, S13). The record is set for locked
#: rows only (the lock is taken in the subquery, before the outer select list).
CLAIM_LOCK_KEY = (
    f"SELECT set_config('{CLAIM_LOCKED}', l.locked, false) FROM (SELECT {_LOCKED_BY_ME} AS locked"
    f" FROM {KEY} k JOIN {RUN} r ON k.workflow_name = r.workflow_name AND k.key = r.singleton_key"
    f" WHERE {_CANDIDATE} FOR UPDATE OF k) l"
)
#: The admission of a candidate whose key row this transaction locked (above), its values
#: read from its row after the lock (the compare-and-set of each write is on that read,
#: R5a); :data:`ADMIT`'s text otherwise.
CLAIM_ADMIT = _admit(
    "SELECT r.run_id, r.status, r.attempts, r.workflow_name AS wf, r.singleton_key AS key,"
    " (%(limits)s::jsonb ->> r.workflow_name)::integer AS declared,"
    f" (%(ttls)s::jsonb ->> r.workflow_name)::float8 AS ttl FROM {RUN} r WHERE {_CANDIDATE}"
    f" AND EXISTS (SELECT 1 FROM {KEY} k WHERE k.id = NULLIF(split_part({_RECORDED}, ':', 1), '')::bigint"
    " AND k.workflow_name = r.workflow_name AND k.key = r.singleton_key"
    f" AND split_part({_RECORDED}, ':', 2) = pg_current_xact_id()::text)",
    _claimed,
)


#: A claim's first turn of a run without a key and without quotas (X3i), parked (not running,
#: not terminal), not cancelled and due (X5): its lease, one compare-and-set on the row as the
#: update finds it (no key, so no lock and no admission: S4, S6, R5a, R6).
CLAIM_TAKE = (
    f"UPDATE {RUN} r SET {_TAKE_SET} WHERE r.run_id = %(run_id)s AND r.singleton_key IS NULL"
    " AND r.quota_slot IS NULL"
    f" AND r.status IN ({_PARKED}) AND NOT r.cancel_requested AND {is_due_sql_text('r', NOW)}"
    f" RETURNING {_cols('r')}"
)


_JSON_COLUMNS = {"input", "output", "error", "tags"}
#: The limit in force on a started run's key: the key's runtime override, else the declared
#: ``deep_limit`` (K2).
_DEEP_LIMIT = limit_in_force_sql_text(
    "%(deep_limit)s::integer",
    f"(SELECT d0.limit_override FROM {KEY} d0"
    " WHERE d0.workflow_name = %(workflow_name)s::varchar AND d0.key = %(singleton_key)s::varchar)",
)
#: Is the key's queue deep (``queue_is_deep``: ``limit`` holders and ``limit`` waiters in the
#: first ``2 * limit`` rows of the queue, ``limit`` the limit in force, S8a, K2)? FALSE for a run
#: without a key.
_DEEP = (
    f"SELECT count(*) FILTER (WHERE f.singleton_slot = '{SlotState.HOLDER.value}') >= {_DEEP_LIMIT}"
    f" AND count(*) FILTER (WHERE f.singleton_slot = '{SlotState.WAITER.value}') >= {_DEEP_LIMIT}"
    # The casts: the INSERT types these parameters as its columns (varchar) when prepared.
    f" FROM (SELECT q0.singleton_slot FROM {RUN} q0 WHERE q0.workflow_name = %(workflow_name)s::varchar"
    f" AND q0.singleton_key = %(singleton_key)s::varchar AND {FRONT_WHERE} ORDER BY {FRONT_ORDER}"
    f" LIMIT 2 * {_DEEP_LIMIT}) f"
)


def _stamped(name: str) -> str:
    """A time of a start: as given, or (stamped, the given one NULL) the
    database's now plus ``<name>_in`` seconds (R8)."""
    return f"COALESCE(%({name})s, {NOW} + make_interval(secs => %({name}_in)s::float8))"


def _insert(deep: str) -> str:
    inserted = {
        "created_at": _stamped("created_at"),
        "updated_at": _stamped("updated_at"),
        "deadline_at": _stamped("deadline_at"),
        "wake_at": f"CASE WHEN ({deep}) THEN {_stamped('backlog_wake_at')} ELSE {_stamped('wake_at')} END",
        "park_reason": f"CASE WHEN ({deep}) THEN '{ParkReason.SINGLETON.value}' ELSE %(park_reason)s END",
    }
    values = ", ".join(inserted.get(c, f"%({c})s::jsonb" if c in _JSON_COLUMNS else f"%({c})s") for c in COLUMNS)
    return (
        f"INSERT INTO {RUN} ({', '.join(COLUMNS)}) VALUES ({values})"
        f" ON CONFLICT (run_id) DO NOTHING RETURNING {', '.join(COLUMNS)}"
    )


#: A start: one INSERT of the run that ignores an existing ``run_id`` (R3, S16) and, for a run
#: with a key, creates it parked when its key's queue is deep (S8a).
START_KEYED = _insert(_DEEP)
START = _insert("FALSE")
#: The run as stored.
GET = f"SELECT {_cols('r')} FROM {RUN} r WHERE r.run_id = %(run_id)s"


_PARAM = re.compile(r"%\((\w+)\)s")


class Statement:
    """One statement of the fast path as PostgreSQL prepares it (``PREPARE``):
    its ``%(name)s`` placeholders become ``$1``, ``$2``, ... in order of first
    use, typed by PostgreSQL from their context. ``label``: part of the
    prepared name, which also carries a hash of the text (a changed text is a
    new name, never a stale plan)."""

    def __init__(self, label: str, sql: str) -> None:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        body = _PARAM.sub(number, sql)
        self.sql = sql
        self.name = f"ds_{label}_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
        self.prepare = f"PREPARE {self.name} AS {body}"
        args = ", ".join(f"%({n})s" for n in names)
        self.execute = f"EXECUTE {self.name}({args})" if names else f"EXECUTE {self.name}"


class Message:
    """Statements sent as one simple-protocol message: one round trip, and
    outside a transaction one implicit transaction (the ``statements`` run in
    order, all or none)."""

    def __init__(self, *statements: Statement) -> None:
        self.statements = statements
        self.results = len(statements)
        self.prepared = "; ".join(st.execute for st in statements)
        self.plain = "; ".join(st.sql for st in statements)


#: The statements this process prepared, per psycopg connection: a new
#: connection (after a reconnect, in a forked child's own connection) prepares again.
_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
#: SQLSTATE of "prepared statement does not exist" (a pooler's ``DISCARD ALL``, a ``DEALLOCATE``).
_NOT_PREPARED = "26000"

_CREATE_KEY = Statement("create_key", CREATE_KEY)
_LOCK_KEY = Statement("lock_key", LOCK_KEY)
_LOCK_RUN = Statement("lock_run", LOCK_RUN)
TAKE_MESSAGE = Message(_LOCK_RUN, Statement("take", TAKE))
FINISH_MESSAGE = Message(_CREATE_KEY, _LOCK_KEY, Statement("finish", FINISH))
SETTLE_MESSAGE = Message(Statement("settle", SETTLE))
ADMIT_MESSAGE = Message(_CREATE_KEY, _LOCK_KEY, _LOCK_RUN, Statement("admit", ADMIT))
#: The claim of a turn in one message: a candidate waiter's admission, a run without a key
#: taken (:data:`CLAIM_TAKE`), then the read of the run as this transaction leaves it
#: (:meth:`FastPath.claim`).
CLAIM_MESSAGE = Message(
    Statement("claim_create_key", CLAIM_CREATE_KEY),
    Statement("claim_lock_key", CLAIM_LOCK_KEY),
    _LOCK_RUN,
    Statement("claim_admit", CLAIM_ADMIT),
    Statement("claim_take", CLAIM_TAKE),
    Statement("read", READ),
)
START_KEYED_MESSAGE = Message(Statement("start_keyed", START_KEYED))
START_MESSAGE = Message(Statement("start", START))
GET_MESSAGE = Message(Statement("get", GET))


def _not_prepared(exc: BaseException) -> bool:
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return getattr(cause, "sqlstate", None) == _NOT_PREPARED


def _known_steps(taken: RunRecord) -> Mapping[int, StepRecord] | None:
    """The steps of a run as its claim's own write returned it: none when its
    ``step_count`` is 0 (no one else stores a step under the new lease, R4),
    else None (the engine reads them)."""
    return {} if taken.step_count == 0 else None


def _admitted(run: RunRecord, rows: Sequence[Sequence[Any]]) -> Turn | None:
    """The turn of an admission statement's rows (:data:`ADMIT`, :data:`CLAIM_ADMIT`): the
    claimant's lease (tag 0), the other grants (1) or the claimant parked (2). None: nothing
    was written."""
    granted = sorted((record(r[1:]) for r in rows if r[0] == 1), key=lambda g: g.fencing_token or 0)
    mine = [record(r[1:]) for r in rows if r[0] == 0]
    if mine:
        taken = mine[0]
        return Turn(TurnState.RUN, taken, granted=tuple(granted), admitted=True, steps=_known_steps(taken))
    parked = [record(r[1:]) for r in rows if r[0] == 2]
    if parked:
        return Turn(TurnState.PARKED, parked[0], granted=tuple(granted))
    if granted:
        return Turn(TurnState.SKIPPED, run, granted=tuple(granted))
    return None


def _json_param(value: Any) -> str | None:
    return None if value is None else json.dumps(value, allow_nan=False)


class FastPath:
    """The raw statements of one :class:`~durable_singleton.stores.django.DjangoStore` on PostgreSQL.

    ``store``: the Django store whose database (``db``) and redelivery window
    (``redelivery_seconds``) the statements use."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def _cursor(self) -> Any:
        return connections[self.store.db].cursor()

    def _send(self, cursor: Any, message: Message, params: Mapping[str, Any]) -> None:
        """Send ``message`` with ``params`` in one round trip, as prepared
        statements (``EXECUTE``): PostgreSQL plans each statement once per
        connection instead of at every send (planning the handoff took about
        three times its execution). The statements a connection lacks are
        prepared first, in one more round trip, once per connection
        (``PREPARE`` is not undone by a rollback). A connection opened with
        ``"prepare_threshold": None`` in its ``OPTIONS`` (psycopg's switch for a
        pooler in transaction mode) gets the plain text. A prepared statement
        dropped behind this process's back (a pooler's ``DISCARD ALL``, a
        ``DEALLOCATE``) is prepared again and the message sent again, outside a transaction only
        (nothing of the failed message was committed); inside one the error is raised."""
        wrapper = connections[self.store.db]
        raw = wrapper.connection
        if raw is None or getattr(raw, "prepare_threshold", 5) is None:
            cursor.execute(message.plain, params)
            return
        prepared = _PREPARED.setdefault(raw, set())
        for attempt in (1, 2):
            missing = [st for st in message.statements if st.name not in prepared]
            if missing:
                cursor.execute("; ".join(st.prepare for st in missing))
                prepared.update(st.name for st in missing)
            try:
                cursor.execute(message.prepared, params)
                return
            except Exception as exc:
                if attempt == 2 or not _not_prepared(exc) or wrapper.in_atomic_block:
                    raise
                cursor.execute("SELECT name FROM pg_prepared_statements")
                prepared.intersection_update(row[0] for row in cursor.fetchall())

    def _last_result(self, cursor: Any, message: Message) -> list[tuple[Any, ...]]:
        """Return the rows of the last result of ``message``."""
        for _ in range(message.results - 1):
            cursor.nextset()
        return list(cursor.fetchall())

    # -- a start ---------------------------------------------------------------------------------
    def start(
        self, run: RunRecord, deep_limit: int | None, backlog_wake_at: Any, *, stamp: bool = False
    ) -> tuple[RunRecord, bool] | None:
        """Insert ``run`` in one statement, parked at creation behind a deep queue
        (S8a); return (the run as stored, whether this statement inserted it)
        (R3, S16). With ``stamp``, ``created_at`` is the database's now and the
        run's other times keep their distance to it (R8). None: the id's row was
        deleted between the conflict and its read; the caller starts again."""
        params: dict[str, Any] = {
            "run_id": run.run_id,
            "workflow_name": run.workflow_name,
            "workflow_version": run.workflow_version,
            "namespace": run.namespace,
            "status": run.status,
            "input": _json_param(run.input),
            "created_at": run.created_at,
            "updated_at": run.updated_at,
            "output": _json_param(run.output),
            "error": _json_param(run.error),
            "tags": _json_param(stored_tags(run)),
            "singleton_key": run.singleton_key,
            "singleton_limit": run.singleton_limit,
            "singleton_slot": SlotState.WAITER.value if run.singleton_key is not None and run.tracked else None,
            "singleton_tracked": run.tracked,
            "wake_at": run.wake_at,
            "backlog_wake_at": backlog_wake_at,
            "lease_owner": None,
            "lease_expires_at": None,
            "started_at": None,
            "finished_at": None,
            "admitted_at": None,
            "attempts": 0,
            "recoveries": 0,
            "parent_run_id": run.parent_run_id,
            "park_reason": run.park_reason,
            "cancel_requested": False,
            "deadline_at": run.deadline_at,
            "fencing_token": None,
            "step_count": 0,
            "not_before": run.not_before,
            "quota_slot": run.quota_slot,
        }
        times = {"created_at": run.created_at, "updated_at": run.updated_at, "deadline_at": run.deadline_at}
        times.update(wake_at=run.wake_at, backlog_wake_at=backlog_wake_at)
        for name, value in times.items():
            offset = (value - run.created_at).total_seconds() if value is not None else None
            # A delayed start wakes at its not_before and its timeout counts from it (X5): never moved.
            fixed = not stamp or (name in ("wake_at", "deadline_at") and run.not_before is not None)
            params[name], params[f"{name}_in"] = (value, None) if fixed else (None, offset)
        keyed = run.singleton_key is not None and deep_limit is not None
        if keyed:
            params.update(deep_limit=int(deep_limit or 1))
        with self._cursor() as cursor:
            self._send(cursor, START_KEYED_MESSAGE if keyed else START_MESSAGE, params)
            row = cursor.fetchone()
            if row is not None:
                return record(row), True
            self._send(cursor, GET_MESSAGE, {"run_id": run.run_id})
            row = cursor.fetchone()
        return (record(row), False) if row is not None else None

    # -- a turn -----------------------------------------------------------------------------
    def take(self, run: RunRecord, owner: str, lease_seconds: float, *, recovered: bool, holder: bool) -> Turn:
        """Take the lease of a run without a key or of a holder: one compare-and-set on
        ``run`` as read (S6, R5a, R6). The turn's ``steps`` is ``{}`` when the claim's
        own write returned no stored step: nobody else can store one under this lease (R4)."""
        params = {
            "owner": owner,
            "lease": float(lease_seconds),
            "recovered": 1 if recovered else 0,
            "holder": holder,
            "run_id": run.run_id,
            "status": run.status,
            "attempts": run.attempts,
            "cancel": run.cancel_requested,
            "read_owner": run.lease_owner,
        }
        with self._cursor() as cursor:
            self._send(cursor, TAKE_MESSAGE, params)
            rows = self._last_result(cursor, TAKE_MESSAGE)
        row = rows[0] if rows else None
        if row is None:
            return Turn(TurnState.SKIPPED, run)
        taken = record(row)
        return Turn(TurnState.RUN, taken, recovered=recovered, steps=_known_steps(taken))

    def admit(
        self,
        run: RunRecord,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        delays: tuple[float, float],
        ttl: float | None = None,
    ) -> Turn | None:
        """Admit or park a tracked waiter in one message (S5, S9, K1). None: the
        claimant changed since it was read (nothing was written); the caller
        decides on the ORM path. ``delays``: the retry delays in seconds of a
        parked claimant among the first ``limit`` waiters and of one further back
        (S5 step 5, S8a). ``ttl``: the workflow's ``queue_ttl`` in seconds (None:
        none); the waiters past it, the claimant included, get no slot (it is
        parked; the tick ends it, X2)."""
        assert run.singleton_key is not None
        params = {
            "wf": run.workflow_name,
            "key": run.singleton_key,
            "declared": limits.get(run.workflow_name),
            "run_id": run.run_id,
            "status": run.status,
            "attempts": run.attempts,
            "ttl": None if ttl is None else float(ttl),
            **self._admission(owner, lease_seconds, delays),
        }
        with self._cursor() as cursor:
            self._send(cursor, ADMIT_MESSAGE, params)
            rows = self._last_result(cursor, ADMIT_MESSAGE)
        return _admitted(run, rows)

    def _admission(self, owner: str, lease_seconds: float, delays: tuple[float, float]) -> dict[str, Any]:
        """The parameters every admission statement shares: the claimant's lease
        (``owner``, ``lease_seconds``), the grants' redelivery window and the
        retry ``delays`` of a parked claimant, all seconds."""
        return {
            "owner": owner,
            "lease": float(lease_seconds),
            "recovered": 0,
            "redelivery": float(self.store.redelivery_seconds),
            "front": float(delays[0]),
            "backlog": float(delays[1]),
        }

    def claim(
        self,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        delays: tuple[float, float],
        ttls: Mapping[str, float],
    ) -> tuple[Turn | None, tuple[RunRecord | None, bool, bool]]:
        """A turn's claim without a read first, in one message (S4, S5, S9, K1):
        a candidate (a tracked, parked, due waiter, not cancelled, of a workflow
        in ``limits``) is admitted or parked as by :meth:`admit`, on its row as
        read after the key's lock; a parked, due run without a key, not
        cancelled, takes its lease (:data:`CLAIM_TAKE`); then the run is read
        with whether its lease expired and whether it is due (X5), on the
        database's clock.
        Return the admission's turn (None: the run was no candidate, or nothing
        was written) and the read, from which the caller decides the rest (a
        holder's confirmation, a run without a key, a cancel, a recovery).
        ``delays`` as for :meth:`admit`; ``ttls``: the ``queue_ttl`` seconds of
        the workflows that declare one."""
        params = {
            "run_id": run_id,
            "limits": json.dumps({name: int(limit) for name, limit in limits.items() if limit is not None}),
            "ttls": json.dumps({name: float(ttl) for name, ttl in ttls.items() if ttl is not None}),
            **self._admission(owner, lease_seconds, delays),
        }
        with self._cursor() as cursor:
            self._send(cursor, CLAIM_MESSAGE, params)
            for _ in range(CLAIM_MESSAGE.results - 3):
                cursor.nextset()
            rows = list(cursor.fetchall())
            cursor.nextset()
            took = cursor.fetchone()
            cursor.nextset()
            read = cursor.fetchone()
        if read is None:
            return None, (None, False, True)
        run = record(read)
        if took is not None:
            taken = record(took)
            return Turn(TurnState.RUN, taken, steps=_known_steps(taken)), (run, False, True)
        turn = _admitted(run, rows) if rows else None
        return turn, (run, bool(read[len(COLUMNS)]), bool(read[len(COLUMNS) + 1]))

    # -- the handoff ----------------------------------------------------------------------------
    def finish(
        self,
        run: RunRecord,
        owner: str,
        status: str,
        output: Any,
        error: Any,
        limits: Limits,
        finished_at: Any,
        ttl: float | None = None,
    ) -> Finish:
        """Settle ``run`` by compare-and-set on ``owner``'s unexpired lease and hand
        its slot off, in one message (S7, S12, R5a, K1); ``ttl``: the workflow's
        ``queue_ttl`` in seconds (None: none), the waiters past it get no slot (X2)."""
        params: dict[str, Any] = {
            "run_id": run.run_id,
            "owner": owner,
            "final": status,
            "output": _json_param(output),
            "error": _json_param(error),
            "finished_at": finished_at,
        }
        with self._cursor() as cursor:
            if run.singleton_key is None:
                self._send(cursor, SETTLE_MESSAGE, params)
                rows = list(cursor.fetchall())
            else:
                params.update(
                    wf=run.workflow_name,
                    key=run.singleton_key,
                    declared=limits.get(run.workflow_name),
                    redelivery=float(self.store.redelivery_seconds),
                    ttl=None if ttl is None else float(ttl),
                )
                self._send(cursor, FINISH_MESSAGE, params)
                rows = self._last_result(cursor, FINISH_MESSAGE)
        settled = [record(r[1:]) for r in rows if r[0] == 0]
        if not settled:
            return Finish(None)
        granted = sorted((record(r[1:]) for r in rows if r[0] == 1), key=lambda g: g.fencing_token or 0)
        return Finish(settled[0], tuple(granted))
