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

* a run that carries quotas (X3i): its start with its memberships, a quota
  waiter's admission in the first message of its turn (:data:`CLAIM_QUOTA_ADMIT`:
  its quota keys' rows locked in the one global order, its singleton key's, its
  own, then one statement that decides and writes) and its handoff
  (:data:`QUOTA_FINISH`), one message each;
* a run that carries throttles (X6): its throttle memberships written by its
  start's ``INSERT``, its throttle keys locked first in its claim message
  (``claim_lock_throttle_keys``), its window counted and its admission
  recorded, or the run parked until the window's opening, by
  :data:`CLAIM_QUOTA_ADMIT`; its settle as any run's.

Every statement is a named block of ``durable_singleton/sql/postgresql/*.sql``
(:mod:`durable_singleton.sql`). The rules are written once there, as fragments
the statements splice: who holds a slot, the limit in force and the free
slots (``tests/stores/test_sql_blocks.py`` checks each against its twin in
:mod:`durable_singleton.admission`:
:func:`~durable_singleton.admission.holds_slot_sql_text`,
:func:`~durable_singleton.admission.limit_in_force_sql_text`,
:func:`~durable_singleton.admission.free_slots_sql_text`), the queue order
(:meth:`RunQuerySet.queue_front_sql_text
<durable_singleton.querysets.RunQuerySet.queue_front_sql_text>`), the clock
(:data:`~durable_singleton.querysets.PG_NOW_SQL`). Lock order: the key row,
then run rows (S13). Every write is a compare-and-set on what was read (R5a).

The clock: ``STATEMENT_TIMESTAMP()`` (:data:`NOW`) is the time the message
arrived, for all three statements; it orders and filters (is a run due, the
queue's front), where an index may serve it. Whatever judges or starts a
lease is :data:`WRITTEN`, the database's clock as the row is compared or
written, after the locks (R5, R5a, R8): a settle whose message waited for a
key's lock past its owner's lease is refused, as the ORM path refuses it (its
compare-and-set is a statement of its own, sent after the lock), and a claim
that waited for the lock longer than a lease is not admitted with a lease
already expired, which the tick could recover while the body ran. The same
holds for the other times a statement writes for what happens next (the wake
of a grant or of a parked claimant, ``admitted_at``).
"""

from __future__ import annotations

import hashlib
import json
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import connections

from .. import sql
from ..admission import (
    QUOTA_PREFIX,
    THROTTLE_PREFIX,
    declared_limit,
    quota_lock_name,
)
from ..models import QuotaMembership, Run, SingletonKey
from ..querysets import PG_NOW_SQL
from ..records import RunRecord, StepRecord
from ..statuses import SlotState
from .base import Finish, Limits, Turn, TurnState, handed_off
from .rows import COLUMNS, json_param, json_value, run_record, start_params


class Store(Protocol):
    """What the fast path needs of its :class:`~durable_singleton.stores.django.DjangoStore`."""

    @property
    def db(self) -> str:
        """The database alias."""

    @property
    def redelivery_seconds(self) -> float:
        """How long a granted waiter's turn is left to arrive before the tick sends it (S7a)."""


__all__ = ["Database", "FastPath", "Store", "take_notices", "usable"]

RUN = Run._meta.db_table
KEY = SingletonKey._meta.db_table
MEMBER = QuotaMembership._meta.db_table
NOW = PG_NOW_SQL
#: The database's clock when a row is compared or written (after the locks, unlike :data:`NOW`,
#: the message's arrival): a lease's end judged by a compare-and-set (R5a), the start of a lease,
#: a wake or an admission written by a statement (R5, R8).
WRITTEN = "CLOCK_TIMESTAMP()"


def record(row: Sequence[Any]) -> RunRecord:
    """Return the :class:`RunRecord` of a row of :data:`COLUMNS` as the cursor
    returns it (JSON columns as text): ``stores.rows.run_record``."""
    return run_record(row, json_text=True)


def usable(store: Store) -> bool:
    """Tell whether the store's connection can take the fast path: PostgreSQL
    through psycopg 3 with client-side binding (a message of several statements
    needs the simple query protocol), on a UTF-8 database (the claim message
    locks a run's quota keys in ``COLLATE "C"`` order, which is the code-point
    order the ORM path sorts them in only in UTF-8, X3e)."""
    connection = connections[store.db]
    if connection.vendor != "postgresql":
        return False
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3 or connection.settings_dict.get("OPTIONS", {}).get("server_side_binding") is True:
        return False
    connection.ensure_connection()
    # Reported by the server when the connection opens: no round trip.
    encoding = connection.connection.info.parameter_status("server_encoding")
    return str(encoding or "").upper() in ("UTF8", "UTF-8")


# -- the statements ------------------------------------------------------------------------------
#: Every statement below is a named block of ``sql/postgresql/*.sql`` (issue 32 item 4):
#: runs.sql, locks.sql, start.sql, admission.sql, quota.sql and handoff.sql.
#: One read of a run for its turn, with whether its lease expired and whether it is due
#: (X5) by the database's clock (R5).
READ = sql.statement("read")
#: The confirmation claim of a run without a key (``holder`` false) or of a holder (S6).
TAKE = sql.statement("take")
#: The confirmation claim of a quota holder (X3c, X3f), returning its quota tokens.
TAKE_QUOTA = sql.statement("take_quota")

#: Lock the key's row, creating it if missing (S13); the first two statements of a message.
CREATE_KEY = sql.statement("create_key")
LOCK_KEY = sql.statement("lock_key")
#: Lock the claimant's row in a statement of its own, after its key's (S13), before the
#: statement that writes its lease (R5; the block says why).
LOCK_RUN = sql.statement("lock_run")


#: A settle without a key: the compare-and-set alone (R5a).
SETTLE = sql.statement("settle")


#: The admission of a waiter (S5), admission.sql's ``admit``: under the key's lock, the
#: claimant as read (``claimant``: still a tracked waiter with the status, attempts and
#: cancel flag this turn read; if not, nothing is written and the ORM path decides), the
#: free slots go to the oldest waiters, each with the next token; the claimant takes its
#: lease as a holder if it is among them, else it is parked with its retry ``wake_at`` (the
#: front delay if it is among the first ``limit`` waiters, else the backlog's, S5 step 5, S8a).
ADMIT = sql.statement("admit")

#: A claim's first turn of a waiter without a read before it (:meth:`FastPath.claim`): the
#: run is a candidate when it is a tracked waiter without quotas (X3i), parked (not running, not
#: terminal), not cancelled, due (X5) and of a workflow in the ``limits`` parameter (a JSON object of the
#: declared limits this process knows); its workflow, key, declared limit and TTL come from
#: its own row. Read without a lock: a run's workflow and key never change.
#: The key row's creation and lock below also take a keyed quota waiter's singleton key, after
#: its quota keys (:data:`CLAIM_LOCK_QUOTA_KEYS`, X3e); its admission is :data:`CLAIM_QUOTA_ADMIT`.
CLAIM_CREATE_KEY = sql.statement("claim_create_key")
#: The session setting in which :data:`CLAIM_LOCK_KEY` records the key row it locked, with
#: the transaction that holds the lock.
CLAIM_LOCKED = "durable_singleton.claim_locked"
#: What :data:`CLAIM_LOCK_KEY` records there: its key row's id, ``:``, its transaction's id.
#: Lock the candidate's key row and record that this transaction holds it: each statement
#: of the message takes its own snapshot, so a run that became a candidate after this
#: statement (a retry reset, a row that appeared) is no proof of the lock; the admission
#: below writes only for a key row recorded here (S5, S13). The record is set for locked
#: rows only (the lock is taken in the subquery, before the outer select list).
CLAIM_LOCK_KEY = sql.statement("claim_lock_key")
#: The admission of a candidate whose key row this transaction locked (above), its values
#: read from its row after the lock (the compare-and-set of each write is on that read,
#: R5a); :data:`ADMIT`'s text otherwise.
CLAIM_ADMIT = sql.statement("claim_admit")


#: A claim's first turn of a run without a key and without quotas (X3i), parked (not running,
#: not terminal), not cancelled and due (X5): its lease, one compare-and-set on the row as the
#: update finds it (no key, so no lock and no admission: S4, S6, R5a, R6).
CLAIM_TAKE = sql.statement("claim_take")

#: A start: one INSERT of the run that ignores an existing ``run_id`` (R3, S16) and, for a run
#: with a key, creates it parked when its key's queue is deep (S8a, K2); with quotas, the same
#: statement inserts one membership per quota key, a waiter (X3b). Named blocks of
#: ``sql/postgresql/start.sql``; a fair quota's tag needs reads first, so such a run takes the ORM path.
START_KEYED = sql.statement("start_keyed")
START = sql.statement("start")
START_KEYED_QUOTAS = sql.statement("start_keyed_quotas")
START_QUOTAS = sql.statement("start_quotas")
#: A start under ``DISPATCH = "worker"``: the run's INSERT and, if it inserted the row and did
#: not create it parked behind a deep queue (S8a), its turn notice, in the same statement: one
#: commit, and the notice's trigger NOTIFYs at it (O1a, O7).
START_KEYED_NOTICE = sql.statement("start_keyed_notice")
START_NOTICE = sql.statement("start_notice")
#: The run as stored.
GET = sql.statement("get")
#: A ``durable_worker``'s fetch: take and delete the oldest turn notices nobody else holds, in
#: one statement (notices.sql, O7); :func:`take_notices`.
TAKE_NOTICES = sql.statement("take_notices")
#: Sent before :data:`TAKE_NOTICES` outside a transaction: the fetch's commit waits for no
#: WAL flush (notices.sql says why that loses nothing: S5, R6).
FETCH_WITHOUT_FLUSH = sql.statement("fetch_without_flush")


# -- shared quotas (X3) ---------------------------------------------------------------------------
# A run that carries quotas, on the fast path: its start with its memberships, its admission
# and its handoff, each one message. Its quota keys come as two arrays (``qwf``: the lock
# names ``quota:<name>``, ``qkey``: the keys), sorted by (name, key) as the ORM path's
# ``_lock_quota_keys`` sorts them: the one global lock order, every quota key before the
# singleton key, then the run's row (X3e, S13).
HOLDER, WAITER = SlotState.HOLDER.value, SlotState.WAITER.value
#: Create the run's missing quota key rows, in the lock order.
CREATE_QUOTA_KEYS = sql.statement("create_quota_keys")
#: Lock the run's quota key rows one by one in the lock order (the sort, then the locks, X3e).
LOCK_QUOTA_KEYS = sql.statement("lock_quota_keys")
#: The singleton key's row of a run that has one (the ``key`` parameter NULL: none).
CREATE_KEY_IF = sql.statement("create_key_if")


#: A claim's first turn of a quota waiter without a read before it (:meth:`FastPath.claim`):
#: the run is a candidate when it waits in its quotas, parked (not running, not terminal), not
#: cancelled and due (X5), and, with a singleton key, is its tracked waiter of a workflow in the
#: ``limits`` parameter. Its quota keys are its memberships' (``qu``), numbered in the lock order:
#: by (name, key) in code-point order, as Python sorts them on the ORM path (X3e; a UTF-8
#: database's ``COLLATE "C"`` order is code-point order).
_MEMBER_KEYS = sql.fragment("member_quota_keys")
CLAIM_CREATE_QUOTA_KEYS = sql.statement("claim_create_quota_keys")
#: The session setting in which :data:`CLAIM_LOCK_QUOTA_KEYS` records the quota key rows it
#: locked (their ids in the lock order, ``,``-separated), ``:``, the transaction that holds them.
CLAIM_QUOTA_LOCKED = "durable_singleton.claim_quota_locked"
#: Lock the candidate's quota key rows in the lock order and record them (as
#: :data:`CLAIM_LOCK_KEY` records its key row): the admission below writes only when the
#: record names every quota key of the claimant, locked by this transaction (X3e, S13).
CLAIM_LOCK_QUOTA_KEYS = sql.statement("claim_lock_quota_keys")
#: The admission of a candidate quota waiter whose quota keys (and singleton key, if it has
#: one) this transaction locked and recorded above, its values read from its row after the
#: locks; if it is none, nothing is written and the ORM path decides (X3i).
CLAIM_QUOTA_ADMIT = sql.statement("claim_quota_admit")
#: A claim's candidate that carries throttles: its throttle key rows created if missing and
#: locked in the lock order, first of all its keys, and recorded in
#: :data:`CLAIM_THROTTLE_LOCKED` (their ids, ``:``, the transaction), as its quota keys' are;
#: :data:`CLAIM_QUOTA_ADMIT` then counts each key's window, records the admission or parks the
#: run until the window's opening (X6b, X6c, X6d).
CLAIM_CREATE_THROTTLE_KEYS = sql.statement("claim_create_throttle_keys")
CLAIM_THROTTLE_LOCKED = "durable_singleton.claim_throttle_locked"
CLAIM_LOCK_THROTTLE_KEYS = sql.statement("claim_lock_throttle_keys")


#: The handoff of a run without quotas, and of one that carries them (S7, S12, R5a, K1, X3g,
#: X3h): named blocks of ``sql/postgresql/handoff.sql``.
FINISH = sql.statement("finish")
QUOTA_FINISH = sql.statement("quota_finish")


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
#: The statements whose cached plan the server refused, per psycopg connection: deallocated
#: before their next use (a refusal inside a transaction leaves it aborted until it ends).
_STALE: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
#: The connections whose record above may be wrong (a refused statement, a failed
#: ``PREPARE``): the statements the server holds are read before the next ``PREPARE``.
_UNSURE: weakref.WeakSet[Any] = weakref.WeakSet()
#: SQLSTATE of "prepared statement does not exist" (a pooler's ``DISCARD ALL``, a ``DEALLOCATE``).
_NOT_PREPARED = "26000"
#: SQLSTATE of "prepared statement already exists" (a ``PREPARE`` of this process that the
#: server took though its message failed: a timeout or a cancel in the middle of the message).
_ALREADY_PREPARED = "42P05"
#: SQLSTATE and text of "cached plan must not change result type" (another connection
#: changed a column a prepared statement returns: a later release's migration).
_PLAN_CHANGED = ("0A000", "cached plan must not change result type")

_CREATE_KEY = Statement("create_key", CREATE_KEY)
_LOCK_KEY = Statement("lock_key", LOCK_KEY)
_LOCK_RUN = Statement("lock_run", LOCK_RUN)
TAKE_MESSAGE = Message(_LOCK_RUN, Statement("take", TAKE))
TAKE_QUOTA_MESSAGE = Message(_LOCK_RUN, Statement("take_quota", TAKE_QUOTA))
FINISH_MESSAGE = Message(_CREATE_KEY, _LOCK_KEY, Statement("finish", FINISH))
SETTLE_MESSAGE = Message(Statement("settle", SETTLE))
ADMIT_MESSAGE = Message(_CREATE_KEY, _LOCK_KEY, _LOCK_RUN, Statement("admit", ADMIT))
#: The claim of a turn in one message: a candidate waiter's admission, a run without a key
#: taken (:data:`CLAIM_TAKE`), then the read of the run as this transaction leaves it
#: (:meth:`FastPath.claim`).
CLAIM_MESSAGE = Message(
    Statement("claim_create_throttle_keys", CLAIM_CREATE_THROTTLE_KEYS),
    Statement("claim_lock_throttle_keys", CLAIM_LOCK_THROTTLE_KEYS),
    Statement("claim_create_quota_keys", CLAIM_CREATE_QUOTA_KEYS),
    Statement("claim_lock_quota_keys", CLAIM_LOCK_QUOTA_KEYS),
    Statement("claim_create_key", CLAIM_CREATE_KEY),
    Statement("claim_lock_key", CLAIM_LOCK_KEY),
    _LOCK_RUN,
    Statement("claim_admit", CLAIM_ADMIT),
    Statement("claim_quota_admit", CLAIM_QUOTA_ADMIT),
    Statement("claim_take", CLAIM_TAKE),
    Statement("read", READ),
)
#: The claim message of a process that declares no quota and no throttle (no ``quota:`` or
#: ``throttle:`` name in its limits): :data:`CLAIM_MESSAGE` less the quota and throttle keys'
#: rows and locks and :data:`CLAIM_QUOTA_ADMIT`, five statements that find nothing to do for a
#: run that carries neither. A run that does carry them (started by another release or
#: registry) is no candidate of :data:`CLAIM_ADMIT` or :data:`CLAIM_TAKE` (their
#: ``quota_slot`` test): nothing is written for it, and the caller decides from the read, as
#: for a quota waiter of a workflow this process does not declare (X3i, X6).
CLAIM_PLAIN_MESSAGE = Message(
    *(
        statement
        for statement in CLAIM_MESSAGE.statements
        if statement.sql
        not in (
            CLAIM_CREATE_THROTTLE_KEYS,
            CLAIM_LOCK_THROTTLE_KEYS,
            CLAIM_CREATE_QUOTA_KEYS,
            CLAIM_LOCK_QUOTA_KEYS,
            CLAIM_QUOTA_ADMIT,
        )
    )
)
START_KEYED_MESSAGE = Message(Statement("start_keyed", START_KEYED))
START_MESSAGE = Message(Statement("start", START))
START_KEYED_QUOTAS_MESSAGE = Message(Statement("start_keyed_quotas", START_KEYED_QUOTAS))
START_QUOTAS_MESSAGE = Message(Statement("start_quotas", START_QUOTAS))
START_KEYED_NOTICE_MESSAGE = Message(Statement("start_keyed_notice", START_KEYED_NOTICE))
START_NOTICE_MESSAGE = Message(Statement("start_notice", START_NOTICE))
_QUOTA_LOCKS = (
    Statement("create_quota_keys", CREATE_QUOTA_KEYS),
    Statement("lock_quota_keys", LOCK_QUOTA_KEYS),
    Statement("create_key_if", CREATE_KEY_IF),
    _LOCK_KEY,
)
QUOTA_FINISH_MESSAGE = Message(*_QUOTA_LOCKS, Statement("quota_finish", QUOTA_FINISH))
GET_MESSAGE = Message(Statement("get", GET))
_TAKE_NOTICES = Statement("take_notices", TAKE_NOTICES)
TAKE_NOTICES_MESSAGE = Message(_TAKE_NOTICES)
FETCH_MESSAGE = Message(Statement("fetch_without_flush", FETCH_WITHOUT_FLUSH), _TAKE_NOTICES)


def _ttls_param(ttls: Mapping[str, float | None]) -> str:
    """The ``ttls`` parameter of a statement: a JSON object of the ``queue_ttl`` seconds
    by workflow name, of the workflows that declare one (X2)."""
    return json.dumps({name: float(ttl) for name, ttl in ttls.items() if ttl is not None})


def _refusal(exc: BaseException) -> str | None:
    """Why the server refused a prepared statement in ``exc``: ``"missing"`` (it does
    not exist), ``"exists"`` (already prepared) or ``"changed"`` (its cached plan's
    result type changed); None: another error."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    state = getattr(cause, "sqlstate", None)
    if state == _NOT_PREPARED:
        return "missing"
    if state == _ALREADY_PREPARED:
        return "exists"
    if state == _PLAN_CHANGED[0] and _PLAN_CHANGED[1] in str(cause):
        return "changed"
    return None


class _PrepareError(Exception):
    """A ``PREPARE`` message failed (a timeout, a cancel, a lost connection, a
    refusal): nothing of the statements it prepares has run."""


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
    granted += _in_place(rows, 3)  # the waiters that carry quotas, sent a turn as they are (X3h)
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


def _quota_admitted(run: RunRecord, rows: Sequence[Sequence[Any]]) -> Turn | None:
    """The turn of a quota admission's rows (:data:`CLAIM_QUOTA_ADMIT`): the claimant's lease
    with its quota tokens (tag 0), the other grants (1), the claimant parked (2, with the
    throttle whose window parked it, X6d), the waiters sent a turn as they are (3). None:
    nothing was written."""
    granted = sorted((record(r[1:]) for r in rows if r[0] == 1), key=lambda g: g.fencing_token or 0)
    turns = tuple(granted + _in_place(rows, 3))
    for row in rows:
        if row[0] == 0:
            tokens = json_value(row[len(COLUMNS) + 1]) or {}
            taken = record(row[1:]).evolve(quota_tokens=tuple(sorted((q, int(t)) for q, t in tokens.items())))
            return Turn(TurnState.RUN, taken, granted=turns, admitted=True, steps=_known_steps(taken))
    parked = [r for r in rows if r[0] == 2]
    if parked:
        named = json_value(parked[0][len(COLUMNS) + 1])  # [the throttle's name], or None
        throttled = str(named[0]) if named else None
        return Turn(TurnState.PARKED, record(parked[0][1:]), granted=turns, throttled=throttled)
    return Turn(TurnState.SKIPPED, run, granted=turns) if turns else None


def _in_place(rows: Sequence[Sequence[Any]], tag: int) -> list[RunRecord]:
    """The runs of the rows tagged ``tag`` (waiters sent a turn), in their place: the last
    two columns of each row (:data:`_TURN_ORDER`)."""
    return [record(r[1:]) for r in sorted((r for r in rows if r[0] == tag), key=lambda r: (r[-2], r[-1]))]


@dataclass(frozen=True)
class Database:
    """A database alias as the fast path's :class:`Store`, for the statements that
    belong to no store (a ``durable_worker``'s fetch): ``db``, the alias."""

    db: str
    redelivery_seconds: float = 0.0


def take_notices(db: str, count: int, queues: Sequence[str]) -> list[tuple[int, str, str]] | None:
    """Take and delete up to ``count`` turn notices of ``queues`` (all: empty) on
    database ``db``, oldest first, in one prepared statement (:data:`TAKE_NOTICES`:
    one round trip, one commit; no fetcher waits on another's rows, O7). Outside a
    transaction that commit waits for no WAL flush (:data:`FETCH_WITHOUT_FLUSH`): a
    notice's delete lost in a server crash gives its run one more turn, which its
    claim decides (S5, R6). Returns (id, run id, queue) of each, oldest first; None
    when ``db`` cannot take the fast path (:func:`usable`): the caller takes the ORM path."""
    database = Database(db)
    if not usable(database):
        return None
    params = {
        "count": int(count),
        "queues": list(queues) or None,
        "flush_setting": "synchronous_commit",
        "flush_value": "off",
    }
    # Inside a caller's transaction the setting would hold for all of it: sent alone then.
    message = TAKE_NOTICES_MESSAGE if connections[db].in_atomic_block else FETCH_MESSAGE
    fast = FastPath(database)
    with fast._cursor() as cursor:
        fast._send(cursor, message, params)
        rows = fast._last_result(cursor, message)
    return sorted((int(pk), str(run_id), str(queue)) for pk, run_id, queue in rows)


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
        prepared first, after a read of the ones the server holds, in two more
        round trips, once per connection (``PREPARE`` is not undone by a
        rollback). A connection opened with ``"prepare_threshold": None`` in
        its ``OPTIONS`` (psycopg's switch for a pooler in transaction mode) gets
        the plain text.

        A refused prepared statement never poisons the connection: one dropped
        behind this process's back (a pooler's ``DISCARD ALL``, a
        ``DEALLOCATE``: "does not exist"), one the server holds though this
        process did not record it (a timeout or a cancel in the middle of the
        ``PREPARE`` message: "already exists") and one whose cached plan the
        server refuses (another connection changed a column: "cached plan must
        not change result type", deallocated and prepared again) are put right
        and the message is sent again, once. A ``PREPARE`` message that failed
        (a timeout, a lost connection: the connection is opened again) is sent
        again too, once: none of the message's statements ran. A retry happens
        only outside a transaction (where the failed message's writes were rolled
        back whole); inside one the error is raised, and the next message on the
        connection puts the record right first. Raises the database's error
        when the retry fails too, or for any other error."""
        wrapper = connections[self.store.db]
        raw = wrapper.connection
        if raw is None or getattr(raw, "prepare_threshold", 5) is None:
            cursor.execute(message.plain, params)
            return
        for attempt in (1, 2):
            try:
                self._prepare(cursor, raw, message)
                cursor.execute(message.prepared, params)
                return
            except _PrepareError as failed:
                exc: BaseException = failed.__cause__ or failed
                if attempt == 2 or wrapper.in_atomic_block:
                    raise exc from None
                if not wrapper.is_usable():
                    # The connection was lost while preparing: nothing ran; open another.
                    wrapper.close()
                    wrapper.ensure_connection()
                    raw = wrapper.connection
                    cursor.cursor = wrapper.create_cursor()
            except Exception as exc:
                refusal = _refusal(exc)
                if refusal is None:
                    raise
                _UNSURE.add(raw)  # read again from the server before the next PREPARE
                if refusal == "changed":
                    _STALE.setdefault(raw, set()).update(st.name for st in message.statements)
                if attempt == 2 or wrapper.in_atomic_block:
                    raise

    @staticmethod
    def _prepare(cursor: Any, raw: Any, message: Message) -> None:
        """Prepare the statements of ``message`` the connection ``raw`` lacks (one
        round trip, once per connection), after reading the ones the server holds
        when this process's record may be wrong (one more) and deallocating the
        ones whose cached plan the server refused. Raises :class:`_PrepareError`
        (from the database's error) if any of that fails; the record is then read
        again before the next ``PREPARE``."""
        prepared = _PREPARED.setdefault(raw, set())
        stale = _STALE.setdefault(raw, set())
        names = {st.name for st in message.statements}
        if names <= prepared and not (raw in _UNSURE or names & stale):
            return
        try:
            if raw in _UNSURE or names & stale:
                cursor.execute("SELECT name FROM pg_prepared_statements")
                held = {row[0] for row in cursor.fetchall()}
                drop = sorted(held & stale & names)
                if drop:
                    cursor.execute("; ".join(f"DEALLOCATE {name}" for name in drop))
                    held.difference_update(drop)
                stale.difference_update(names)
                prepared.clear()
                prepared.update(held)
                _UNSURE.discard(raw)
            missing = [st for st in message.statements if st.name not in prepared]
            if missing:
                cursor.execute("; ".join(st.prepare for st in missing))
                prepared.update(st.name for st in missing)
        except Exception as exc:
            _UNSURE.add(raw)
            raise _PrepareError(str(exc)) from exc

    def _last_result(self, cursor: Any, message: Message) -> list[tuple[Any, ...]]:
        """Return the rows of the last result of ``message``."""
        for _ in range(message.results - 1):
            cursor.nextset()
        return list(cursor.fetchall())

    # -- a start ---------------------------------------------------------------------------------
    def start(
        self,
        run: RunRecord,
        deep_limit: int | None,
        backlog_wake_at: Any,
        *,
        stamp: bool = False,
        notice_queue: str | None = None,
    ) -> tuple[RunRecord, bool] | None:
        """Insert ``run`` in one statement, parked at creation behind a deep queue
        (S8a); return (the run as stored, whether this statement inserted it)
        (R3, S16). With ``stamp``, ``created_at`` is the database's now and the
        run's other times keep their distance to it (R8). With ``notice_queue``
        (a run without quotas), the same statement writes the run's turn notice
        for that queue if it inserted the run unparked (O1a). None: the id's row was
        deleted between the conflict and its read; the caller starts again."""
        params = start_params(run, lambda moment: moment)
        params["backlog_wake_at"] = backlog_wake_at
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
        if run.quota_keys or run.throttle_keys:
            # Its quota memberships from the arrays, its throttle memberships from its
            # throttle_keys column as inserted (X3b, X6c).
            assert not run.quota_shares, "a fair quota's tag is read first: the ORM path"
            params.update(mquota=[name for name, _ in run.quota_keys], mkey=[key for _, key in run.quota_keys])
            message = START_KEYED_QUOTAS_MESSAGE if keyed else START_QUOTAS_MESSAGE
        elif notice_queue is not None:
            params.update(notice_queue=notice_queue)
            message = START_KEYED_NOTICE_MESSAGE if keyed else START_NOTICE_MESSAGE
        else:
            message = START_KEYED_MESSAGE if keyed else START_MESSAGE
        with self._cursor() as cursor:
            self._send(cursor, message, params)
            row = cursor.fetchone()
            if row is not None:
                return record(row), True
            self._send(cursor, GET_MESSAGE, {"run_id": run.run_id})
            row = cursor.fetchone()
        return (record(row), False) if row is not None else None

    # -- a turn -----------------------------------------------------------------------------
    def take(
        self, run: RunRecord, owner: str, lease_seconds: float, *, recovered: bool, holder: bool, quotas: bool = False
    ) -> Turn:
        """Take the lease of a run without a key or of a holder: one compare-and-set on
        ``run`` as read (S6, R5a, R6). The turn's ``steps`` is ``{}`` when the claim's
        own write returned no stored step: nobody else can store one under this lease (R4).
        With ``quotas``, ``run`` is a quota holder's confirmation (:data:`TAKE_QUOTA`): the
        turn's run carries its quota tokens (X3f)."""
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
        message = TAKE_QUOTA_MESSAGE if quotas else TAKE_MESSAGE
        with self._cursor() as cursor:
            self._send(cursor, message, params)
            rows = self._last_result(cursor, message)
        row = rows[0] if rows else None
        if row is None:
            return Turn(TurnState.SKIPPED, run)
        taken = record(row)
        if quotas:
            tokens = json_value(row[len(COLUMNS)]) or {}
            taken = taken.evolve(quota_tokens=tuple(sorted((q, int(t)) for q, t in tokens.items())))
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
            "declared": declared_limit(limits, run.workflow_name),
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

    @staticmethod
    def _quota_keys(run: RunRecord, limits: Limits) -> dict[str, Any]:
        """The parameters of a run's quota keys: ``qwf`` (lock names) and ``qkey``
        in the lock order, sorted by (name, key) (X3e), and ``limits``, the
        declared limit of each quota (JSON, by lock name)."""
        ordered = sorted(set(run.quota_keys))
        declared = {quota_lock_name(name): declared_limit(limits, quota_lock_name(name)) for name, _ in ordered}
        return {
            "qwf": [quota_lock_name(name) for name, _ in ordered],
            "qkey": [key for _, key in ordered],
            "limits": json.dumps({name: int(limit) for name, limit in declared.items() if limit is not None}),
        }

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
        holder's confirmation, a run without a key, a cancel, a recovery). When
        ``limits`` names no quota and no throttle, the message is
        :data:`CLAIM_PLAIN_MESSAGE`: a quota or throttle carrier is then admitted
        by the caller from the read (X3i).
        ``delays`` as for :meth:`admit`; ``ttls``: the ``queue_ttl`` seconds of
        the workflows that declare one."""
        params = {
            "run_id": run_id,
            "limits": json.dumps({name: int(limit) for name, limit in limits.items() if limit is not None}),
            "ttls": _ttls_param(ttls),
            **self._admission(owner, lease_seconds, delays),
        }
        # Limits that name a quota or a throttle: some run may carry one (X3, X6).
        carriers = any(name.startswith((QUOTA_PREFIX, THROTTLE_PREFIX)) for name in limits)
        message = CLAIM_MESSAGE if carriers else CLAIM_PLAIN_MESSAGE
        quota_rows: list[Any] = []
        with self._cursor() as cursor:
            self._send(cursor, message, params)
            for _ in range(message.results - (4 if carriers else 3)):  # to claim_admit's result
                cursor.nextset()
            rows = list(cursor.fetchall())
            if carriers:
                cursor.nextset()
                quota_rows = list(cursor.fetchall())
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
        turn = _admitted(run, rows) if rows else _quota_admitted(run, quota_rows) if quota_rows else None
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
        ttls: Mapping[str, float] | None = None,
    ) -> Finish:
        """Settle ``run`` by compare-and-set on ``owner``'s unexpired lease and hand
        its slot off, in one message (S7, S12, R5a, K1); ``ttl``: the workflow's
        ``queue_ttl`` in seconds (None: none), the waiters past it get no slot (X2);
        ``ttls``: every workflow's, by name, for the waiters of its quota keys (X2)."""
        params: dict[str, Any] = {
            "run_id": run.run_id,
            "owner": owner,
            "final": status,
            "output": json_param(output),
            "error": json_param(error),
            "finished_at": finished_at,
        }
        with self._cursor() as cursor:
            if run.singleton_key is None and not run.quota_keys:
                self._send(cursor, SETTLE_MESSAGE, params)
                rows = list(cursor.fetchall())
            else:
                params.update(
                    wf=run.workflow_name,
                    key=run.singleton_key,
                    declared=declared_limit(limits, run.workflow_name),
                    redelivery=float(self.store.redelivery_seconds),
                    ttl=None if ttl is None else float(ttl),
                )
                message = FINISH_MESSAGE
                if run.quota_keys:
                    params.update(self._quota_keys(run, limits), ttls=_ttls_param(ttls or {}))
                    message = QUOTA_FINISH_MESSAGE
                self._send(cursor, message, params)
                rows = self._last_result(cursor, message)
        settled = [record(r[1:]) for r in rows if r[0] == 0]
        if not settled:
            return Finish(None)
        # A quota run's handoff also sends a turn to the waiters it no longer blocks (X3h).
        return Finish(settled[0], handed_off([record(r[1:]) for r in rows if r[0] == 1], _in_place(rows, 2)))
