"""The SQLite room of the Django store: the hot transactions as a few raw statements.

The decisions are the ORM path's (:mod:`durable_singleton.stores.django`); this
room carries some of them out in fewer statements and with less Python work,
each a named block of ``durable_singleton/sql/sqlite/*.sql``
(:func:`durable_singleton.sql.statement`, vendor ``"sqlite"``), sent through
one cursor of the store's connection:

* the start of a run without quotas (:meth:`Room.start`): one ``INSERT ...
  SELECT ... ON CONFLICT DO NOTHING RETURNING`` with its key's backlog check
  folded in (R3, S8a, S16);
* the first claim of a turn (:meth:`Room.claim`), without a read first: one
  ``UPDATE ... FROM ... RETURNING`` that takes the lease of a run without a
  key, or admits a waiter within its key's free slots with the next token and
  grants the other waiters within them, or parks it with its retry delay
  (S4, S5, S9, K1, X5); the run is read only when the statement was not for
  it (a holder's confirmation, a cancel, a recovery, ...);
* the confirmation claim of a holder or the claim of a run without a key the
  ORM path read (:meth:`Room.take`): one ``UPDATE ... RETURNING``, a
  compare-and-set on the run as its turn read it (S6, R5a, R6);
* the settle of a run without quotas (:meth:`Room.finish`): one
  ``UPDATE ... FROM ... RETURNING`` that settles it on its owner's unexpired
  lease and grants its key's freed slots to the oldest waiters (S5, S7, S12,
  K2, X2);
* the claim of a waiter that carries one throttle and no quota, with or
  without a singleton key (:meth:`Room.claim_throttled`, X6), after the plain
  claim wrote nothing, or at once for the turn a handoff sent it and for a run the
  room saw start or park as a throttle carrier (:meth:`Room.expect_throttled`): in one
  transaction, ``claim_throttled`` (``sql/sqlite/throttle.sql``)
  counts its throttle key's window at one reading of the clock and admits it
  (its ``admitted_at`` that reading, the singleton key's grants and the next
  token as the plain claim's), or parks it until the window's opening (park
  reason ``throttled:<name>``) or with its retry delay; then, on its admission,
  ``record_throttle_admission`` writes its ``ThrottleAdmission`` row at its
  ``admitted_at`` and ``bump_token`` moves the key's counter, before ``COMMIT``
  (X6b, X6c, X6d, X3d, K1, K2, S13).

A claim or a handoff that handed out tokens moves the key's counter past them
with the next statement (``bump_token``), its own transaction: no
``BEGIN``/``COMMIT`` round trips (the throttled claim's, in its transaction,
needs them for the admission's record anyway). A token is never handed out twice (K1):
every statement of the room that hands out tokens first checks that no holder
of the key has a token past its counter, and writes nothing if one has (a
bump on its way, or one lost to a crash between the two statements); the ORM
path then decides, and its key lock (``lock_key``) moves the counter past
every holder's token before it reads it.

SQLite has no row locks: a write statement outside a transaction takes the
database's write lock before it reads (as ``BEGIN IMMEDIATE`` does, check
E010), so each statement reads and writes under the lock, in the lock order of
every path (S13); the throttled claim's first statement, a write inside its
``BEGIN``, takes it so, and its transaction keeps it to its ``COMMIT``. The clock is
the store's (:func:`~durable_singleton.querysets.sqlite_now`,
what :class:`~durable_singleton.querysets.DbNow` binds on the ORM path), read
through the SQL function ``ds_now(seconds)`` as the statement runs, after the
write lock (R5, R5a, R8). The throttled claim calls it once, and computes every
time it writes or compares from that reading in SQL, in whole microseconds: a
Python SQL function called for each row would wait for Python's lock of the
process's other threads while the statement holds the write lock.

The store takes the ORM path where the room writes nothing: a run with quotas
(X3i) or with more than one throttle, a cancel, a recovery, a delayed start
before its time, a workflow this process does not declare, a key's free slots
that reach a waiter with quotas (X3h; the throttled claim sends such a waiter a
turn, as the ORM path does), a key's counter behind, a settle whose
compare-and-set lost (the ORM path reports it), a capped start (S15), the start
and the settle of a run that carries a throttle, a throttled claim inside a
transaction the caller opened, and a connection's first throttled claim (the
compile of ``claim_throttled``, about 20 ms, costs more than the ORM path's
claim: a connection that serves one turn never pays it).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections

from .. import sql
from ..admission import queue_place
from ..querysets import sqlite_now
from ..records import RunRecord, StepRecord
from ..statuses import ParkReason, RunStatus, SlotState
from .base import Finish, Limits, QueueTtls, Turn, TurnState, handed_off
from .rows import COLUMNS, json_param, run_record, start_params

__all__ = ["Room", "ds_now", "ds_time", "keep_temp_in_memory", "lock_key", "record", "room_of"]

START = sql.statement("start", "sqlite")
GET = sql.statement("get", "sqlite")
CLAIM = sql.statement("claim", "sqlite")
TAKE = sql.statement("take", "sqlite")
SETTLE = sql.statement("settle", "sqlite")
FINISH = sql.statement("finish", "sqlite")
BUMP_TOKEN = sql.statement("bump_token", "sqlite")
LOCK_KEY = sql.statement("lock_key", "sqlite")
CLAIM_THROTTLED = sql.statement("claim_throttled", "sqlite")
RECORD_THROTTLE_ADMISSION = sql.statement("record_throttle_admission", "sqlite")

_MICROSECOND = timedelta(microseconds=1)

logger = logging.getLogger(__name__)


def _us(seconds: float) -> int:
    """``seconds`` in whole microseconds, rounded as ``timedelta`` rounds them (the ORM path's times)."""
    return timedelta(seconds=seconds) // _MICROSECOND


#: The time columns, by their place in COLUMNS.
_TIMES = frozenset(
    COLUMNS.index(name)
    for name in (
        "created_at",
        "updated_at",
        "wake_at",
        "lease_expires_at",
        "started_at",
        "finished_at",
        "admitted_at",
        "deadline_at",
        "not_before",
        "debounce_until",
    )
)


def ds_now(seconds: float | None) -> str | None:
    """The SQL function ``ds_now(seconds)``: the store's clock plus ``seconds`` (None: NULL),
    as Django writes a time on SQLite (naive UTC, microseconds; R5, R8)."""
    if seconds is None:
        return None
    moment = sqlite_now() + timedelta(seconds=seconds)
    return moment.replace(tzinfo=None).isoformat(" ", timespec="microseconds")


def _time(value: Any) -> datetime | None:
    if value is None:
        return None
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def record(row: Sequence[Any]) -> RunRecord:
    """Return the :class:`RunRecord` of a row of the ``run_columns`` fragment
    (``stores.rows.COLUMNS``' order): SQLite returns
    its times as text, decoded here; the rest is ``stores.rows.run_record``."""
    values = [_time(x) if i in _TIMES else x for i, x in enumerate(row[: len(COLUMNS)])]
    return run_record(values, json_text=True)


class Room:
    """The raw statements of one SQLite database (``using``, a Django alias);
    ``redelivery_seconds``: how long a granted waiter's turn is left to arrive
    before the tick sends it again (S7a)."""

    #: How many runs the room remembers as throttle carriers (:meth:`expects_throttled`), the newest kept.
    THROTTLE_HINTS = 4096

    def __init__(self, using: str, redelivery_seconds: float) -> None:
        self.using = using
        self.redelivery_seconds = redelivery_seconds
        self._throttled: OrderedDict[str, None] = OrderedDict()  # run ids, oldest first
        self._throttled_lock = threading.Lock()

    def expect_throttled(self, run_id: str) -> None:
        """Remember that run ``run_id`` waits as a throttle carrier (its start or its park by
        :meth:`claim_throttled`, X6): its next claim tries :meth:`claim_throttled` before
        :meth:`claim`, whose statement writes nothing for it. A hint only: a wrong one costs a
        statement that writes nothing, and the plain claim follows."""
        with self._throttled_lock:
            self._throttled[run_id] = None
            self._throttled.move_to_end(run_id)
            while len(self._throttled) > self.THROTTLE_HINTS:
                self._throttled.popitem(last=False)

    def expects_throttled(self, run_id: str) -> bool:
        """Whether :meth:`expect_throttled` named ``run_id`` since its last admission."""
        with self._throttled_lock:
            return run_id in self._throttled

    def forget_throttled(self, run_id: str) -> None:
        """Forget the hint of ``run_id`` (admitted, or not a throttle carrier after all)."""
        with self._throttled_lock:
            self._throttled.pop(run_id, None)

    def _cursor(self) -> Any:
        """A cursor of this thread's connection, prepared for the room once per connection:
        ``ds_now`` defined on it, and its temporary store in memory (:func:`keep_temp_in_memory`,
        at its first statement outside a transaction)."""
        connection = connections[self.using]
        connection.ensure_connection()
        raw = connection.connection
        if getattr(connection, "_ds_now_of", None) is not raw:
            raw.create_function("ds_now", 1, ds_now)
            connection._ds_now_of = raw  # type: ignore[attr-defined]
        if getattr(connection, "_ds_temp_of", None) is not raw and not raw.in_transaction:
            keep_temp_in_memory(raw)
            connection._ds_temp_of = raw  # type: ignore[attr-defined]
        return connection.cursor()

    def take(self, run: RunRecord, owner: str, lease_seconds: float, *, recovered: bool, holder: bool) -> Turn:
        """Take the lease of a run without a key or of a holder (``holder``): one
        compare-and-set on ``run`` as its turn read it (S6, R5, R5a, R6); the turn's
        ``steps`` is ``{}`` when the claim's own write returned no stored step (R4).
        SKIPPED with ``run`` if the run changed under the turn (nothing written)."""
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
            cursor.execute(TAKE, params)
            rows = cursor.fetchall()
        if not rows:
            return Turn(TurnState.SKIPPED, run)
        taken = record(rows[0])
        return Turn(TurnState.RUN, taken, recovered=recovered, steps={} if taken.step_count == 0 else None)

    def finish(
        self,
        run: RunRecord,
        owner: str,
        status: str,
        output: Any,
        error: Any,
        declared: int | None,
        finished_at: datetime | None,
        ttl: float | None,
    ) -> Finish | None:
        """Settle ``run`` (without quotas) by compare-and-set on ``owner``'s unexpired lease
        and hand its key's freed slots to the oldest waiters (S7, S12, R5a, K1, K2);
        ``declared``: the workflow's declared limit; ``ttl``: its ``queue_ttl`` in seconds
        (None: none), the waiters past it get no slot (X2). None: nothing was written
        (the compare-and-set lost, or a waiter within the free slots carries quotas):
        the ORM path decides. The caller then calls :meth:`bump` with the grants (K1)."""
        params: dict[str, Any] = {
            "run_id": run.run_id,
            "owner": owner,
            "final": status,
            "output": json_param(output),
            "error": json_param(error),
            "finished_at": None if finished_at is None else ds_time(finished_at),
        }
        if run.singleton_key is None:
            with self._cursor() as cursor:
                cursor.execute(SETTLE, params)
                rows = cursor.fetchall()
            return Finish(record(rows[0])) if rows else None
        params.update(
            wf=run.workflow_name,
            key=run.singleton_key,
            declared=declared,
            ttl=None if ttl is None else float(ttl),
            redelivery=float(self.redelivery_seconds),
        )
        with self._cursor() as cursor:
            cursor.execute(FINISH, params)
            written = [record(r) for r in cursor.fetchall()]
            granted = [g for g in written if g.run_id != run.run_id]
        settled = [w for w in written if w.run_id == run.run_id]
        if not settled:
            return None
        return Finish(settled[0], handed_off(granted, ()))

    def bump(self, workflow_name: str, key: str, runs: Sequence[RunRecord]) -> None:
        """Move the key's token counter past the tokens of ``runs`` (K1), if any: the statement
        after a claim's or a handoff's (:meth:`claim`, :meth:`finish`), its own transaction.
        Until it runs the room writes nothing on the key and the ORM path moves the counter."""
        tokens = [r.fencing_token for r in runs if r.fencing_token is not None]
        if tokens:
            with self._cursor() as cursor:
                params = {"now": ds_now(0), "wf": workflow_name, "key": key, "token": max(tokens)}
                cursor.execute(BUMP_TOKEN, params)

    def start(
        self, run: RunRecord, deep_limit: int | None, backlog_wake_at: datetime | None
    ) -> tuple[RunRecord, bool] | None:
        """Insert ``run`` (without quotas) in one statement, parked at creation behind a deep
        queue when ``deep_limit`` (its declared limit) is given (S8a, K2); return (the run as
        stored, whether this statement inserted it) (R3, S16). None: the id's row was deleted
        between the conflict and its read; the caller starts again."""
        keyed = run.singleton_key is not None and deep_limit is not None
        params = start_params(run, _maybe_time)
        params.update(
            backlog_wake_at=_maybe_time(backlog_wake_at),
            deep_limit=int(deep_limit) if keyed and deep_limit is not None else None,
            now=ds_now(0),
        )
        with self._cursor() as cursor:
            cursor.execute(START, params)
            row = cursor.fetchone()
            if row is not None:
                return record(row), True
            cursor.execute(GET, {"run_id": run.run_id})
            row = cursor.fetchone()
        return (record(row), False) if row is not None else None

    def claim(
        self,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        delays: tuple[float, float],
        ttls: QueueTtls,
    ) -> Turn | None:
        """A turn's claim without a read first (S4, S5, S9, K1, X5): the lease of a parked,
        due run without a key or quotas, or a tracked waiter's admission within its key's
        free slots (the other waiters within them granted theirs) or its parking with its
        retry delay. ``delays``: the retry delays in seconds of a parked claimant among the
        first ``limit`` waiters and of one further back (S5 step 5, S8a); ``ttls``: the
        ``queue_ttl`` seconds of the workflows that declare one (X2). None: nothing was
        written (the run was none of these, or the room leaves it to the ORM path)."""
        params = {
            "run_id": run_id,
            "owner": owner,
            "lease": float(lease_seconds),
            "limits": json.dumps({name: int(limit) for name, limit in limits.items() if limit is not None}),
            "ttls": json.dumps({name: float(ttl) for name, ttl in ttls.items() if ttl is not None}),
            "redelivery": float(self.redelivery_seconds),
            "front": float(delays[0]),
            "backlog": float(delays[1]),
        }
        with self._cursor() as cursor:
            cursor.execute(CLAIM, params)
            written = [record(r) for r in cursor.fetchall()]
            mine = [w for w in written if w.run_id == run_id]
            if not mine:
                return None
            granted = sorted((w for w in written if w.run_id != run_id), key=lambda g: g.fencing_token or 0)
            run = mine[0]
        if run.status == RunStatus.RUNNING:
            steps: dict[int, StepRecord] | None = {} if run.step_count == 0 else None
            admitted = run.singleton_key is not None
            return Turn(TurnState.RUN, run, granted=tuple(granted), admitted=admitted, steps=steps)
        return Turn(TurnState.PARKED, run, granted=tuple(granted))

    def claim_throttled(
        self,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        delays: tuple[float, float],
        ttls: QueueTtls,
    ) -> Turn | None:
        """A turn's claim of a parked, due waiter that carries one throttle and no quota
        (X6b, X6c, X6d, X3d, S5, K1, K2, R5, R5a), with or without a singleton key: in one
        transaction, ``claim_throttled`` (a write, so the write lock before it reads, S13; its
        throttle key's window counted at one reading of the clock; admitted with its
        admitted_at at that reading, or parked until the window's opening with the park reason
        ``throttled:<name>``, or with its retry delay), then on its admission
        ``record_throttle_admission`` (one ``ThrottleAdmission`` row at its admitted_at) and the
        key's ``bump_token`` (K1). ``limits``: the declared
        limits by workflow and by ``throttle:<name>``; ``delays``, ``ttls``: as :meth:`claim`.
        The turn's ``granted``: the singleton key's waiters granted a slot, and the waiters of
        either key sent a turn (they carry limits: their own claims decide, X3h, X6c). None:
        nothing was written (another run, a workflow this process does not declare, a key's
        counter behind, the connection inside a transaction, or its first throttled claim, whose
        compile of the statement would cost more than the ORM path): the ORM path decides."""
        connection = connections[self.using]
        if connection.in_atomic_block or not connection.get_autocommit():
            return None  # the caller's transaction: the ORM path's savepoint decides
        params = {
            "run_id": run_id,
            "owner": owner,
            "limits": json.dumps({name: int(limit) for name, limit in limits.items() if limit is not None}),
            "ttl_us": json.dumps({name: _us(ttl) for name, ttl in ttls.items() if ttl is not None}),
            "lease_us": _us(lease_seconds),
            "redelivery_us": _us(self.redelivery_seconds),
            "front_us": _us(delays[0]),
            "backlog_us": _us(delays[1]),
        }
        with self._cursor() as cursor:
            raw: Any = connection.connection  # the sqlite3 connection the cursor opened
            rollback = raw.rollback
            if raw.in_transaction:
                return None
            if getattr(connection, "_ds_throttled_of", None) is not raw:
                # This connection's first throttled claim: the ORM path's. The room's statement is
                # compiled once per connection (about 20 ms), more than the ORM path's claim costs;
                # a connection that serves one turn (CONN_MAX_AGE = 0) never pays it.
                connection._ds_throttled_of = raw  # type: ignore[attr-defined]
                return None
            # A deferred BEGIN: claim_throttled, a write, takes the write lock before it reads, after
            # its text is compiled (S13); the transaction keeps the lock to its COMMIT.
            cursor.execute("BEGIN")
            try:
                cursor.execute(CLAIM_THROTTLED, params)
                written = [record(r) for r in cursor.fetchall()]
                mine = [w for w in written if w.run_id == run_id]
                if not mine:
                    cursor.execute("ROLLBACK")
                    return None
                run = mine[0]
                others = [w for w in written if w.run_id != run_id]
                if run.status == RunStatus.RUNNING:
                    cursor.execute(RECORD_THROTTLE_ADMISSION, {"run_id": run_id})
                # The claimant's token and the grants' (a turn is a waiter that carries limits, K1).
                tokens = [w.fencing_token for w in (run, *others) if w.admitted and w.quota_slot != SlotState.WAITER]
                if run.singleton_key is not None and any(t is not None for t in tokens):
                    token = max(t for t in tokens if t is not None)
                    bump = {"now": ds_now(0), "wf": run.workflow_name, "key": run.singleton_key, "token": token}
                    cursor.execute(BUMP_TOKEN, bump)
                cursor.execute("COMMIT")
            except BaseException:
                rollback()
                raise
        # The grants by their tokens, then the turns in the queue order (X8a).
        grants = sorted((g for g in others if g.quota_slot != SlotState.WAITER), key=lambda g: g.fencing_token or 0)
        turns = sorted((g for g in others if g.quota_slot == SlotState.WAITER), key=_queue_place)
        granted = (*grants, *turns)
        if run.status == RunStatus.RUNNING:
            self.forget_throttled(run_id)
            steps: dict[int, StepRecord] | None = {} if run.step_count == 0 else None
            return Turn(TurnState.RUN, run, granted=granted, admitted=True, steps=steps)
        self.expect_throttled(run_id)  # parked: its next claim is a throttle carrier's again
        reason = run.park_reason or ""
        throttled = reason[len(ParkReason.THROTTLED.value) :] if reason.startswith(ParkReason.THROTTLED.value) else None
        return Turn(TurnState.PARKED, run, granted=granted, throttled=throttled)


def keep_temp_in_memory(raw: Any) -> None:
    """Keep the temporary store of the sqlite3 connection ``raw`` in memory (``PRAGMA
    temp_store = MEMORY``) unless the project chose one (``temp_store`` not 0, the default:
    Django's ``init_command`` option sets it). Each statement of the room materializes a
    dozen small ephemeral tables (its ``MATERIALIZED`` CTEs, automatic indexes, sorts); with
    the temporary store in files, ``claim_throttled`` took about 2.6 times as long once the
    process had run the plain ``claim`` (0.76 against 0.29 ms, ``python -m bench.throttle``'s
    claim), the heap growing and shrinking at every statement. Called outside a transaction
    only; SQLite refuses the change while the connection's temporary tables are in use, and
    then the store stays as it was. A temporary table of the connection, if any, is dropped
    by the change (SQLite's rule): it is made before the room's first statement outside a
    transaction on the connection and never again."""
    if raw.execute("PRAGMA temp_store").fetchone()[0] != 0:
        return
    try:
        raw.execute("PRAGMA temp_store = MEMORY")
    except sqlite3.OperationalError:  # its temporary tables in use: keep the store as it is
        logger.debug("temp_store left as it was on %r", raw, exc_info=True)


def _queue_place(run: RunRecord) -> tuple[int, datetime, str]:
    """A waiter's place in its queue (``admission.queue_place``, X8a)."""
    return queue_place(run.priority, run.created_at, run.run_id)


def _maybe_time(moment: datetime | None) -> str | None:
    return None if moment is None else ds_time(moment)


def ds_time(moment: datetime) -> str:
    """``moment`` as Django writes a time on SQLite (naive UTC, microseconds)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    return moment.isoformat(" ", timespec="microseconds")


def lock_key(using: str, workflow_name: str, key: str) -> dict[str, Any]:
    """The ORM path's key lock on SQLite database ``using`` (``DjangoStore.lock_key``, S13a):
    one upsert that takes the write lock, creates the row if missing, moves its token counter
    past every holder's token (K1: a claim or a handoff of the room that has not bumped it
    yet) and returns the row's ``pk``, ``last_token``, ``paused`` and ``limit_override``."""
    params = {"now": ds_now(0), "wf": workflow_name, "key": key}
    with connections[using].cursor() as cursor:
        cursor.execute(LOCK_KEY, params)
        pk, last_token, paused, override = cursor.fetchone()
    return {"pk": pk, "last_token": last_token, "paused": bool(paused), "limit_override": override}


def room_of(using: str, redelivery_seconds: float) -> Room | None:
    """Return the room of SQLite database ``using``, or None (another database, or an
    SQLite library without ``RETURNING``, before 3.35: the ORM path serves)."""
    connection = connections[using]
    if connection.vendor != "sqlite" or not connection.features.can_return_columns_from_insert:
        return None
    return Room(using, redelivery_seconds)
