"""The Django ORM store: the claim, the handoff and every fenced write.

Runs' locks are taken here; the key controls' (:mod:`.key_controls`, the
claim's own key lock), the schedules' (:mod:`.schedule_state`), the
retention deletes' and the re-encoding's beside it, under stores/
(``tests/docs_and_packaging/test_layers.py`` checks that no module outside stores/ takes a row
lock). Lock order, the same on every path: the key's
row in :class:`~durable_singleton.models.SingletonKey` first, then run rows.
A claim or a handoff locks the key row and reads the key's holders and the
front of its queue through the ``ds_run_queue_idx`` index, so it costs the
same with 10 or 10,000 waiters (S5, S13). On PostgreSQL and MySQL/MariaDB the
lock is ``select_for_update``; on SQLite, which has no row locks, an UPDATE of
the key row takes the database write lock before anything is read. On
MySQL/MariaDB the reads after the lock see the latest commits at REPEATABLE
READ too: the lock is the transaction's first statement, and inside a
caller's transaction the reads are locking reads (S13a).

Every write to a run is a compare-and-set on what was read (R5a); lease
expiry, wake times and deadlines are compared with :class:`DbNow`, the
database's clock (R5).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from operator import attrgetter
from typing import Any, TypeVar

from django.db import (
    DEFAULT_DB_ALIAS,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.models import (
    BooleanField,
    Case,
    Count,
    DateTimeField,
    Exists,
    ExpressionWrapper,
    F,
    Max,
    Min,
    Model,
    OuterRef,
    Q,
    Subquery,
    Value,
    When,
)
from django.db.models.constants import OnConflict
from django.db.models.functions import Coalesce, Least
from django.db.models.sql import InsertQuery
from django.utils import timezone

from ..admission import (
    QUEUE_ORDER,
    QUOTA_ORDER,
    QUOTA_PREFIX,
    THROTTLE_PREFIX,
    ahead_q,
    cap_in_force,
    debounce_fair_shares,
    debounce_lock_name,
    debounce_open_q,
    debounce_throttle_keys,
    declared_limit,
    fair_place,
    free_slots,
    free_slots_sql,
    handoff_admits,
    holds_quota_slot_q,
    holds_slot,
    holds_slot_q,
    is_due_q,
    legacy_holder_q,
    limit_in_force,
    limit_in_force_sql,
    queue_place,
    queue_ttl_expired_q,
    quota_front_reaches,
    quota_keys_of,
    quota_lock_name,
    quota_waiter_q,
    quota_waiting_q,
    retry_delay,
    stored_tags,
    superseded,
    throttle_lock_name,
    throttle_room,
    throttle_waiter_q,
    turn_on_its_way_q,
    turn_rung,
)
from ..codecs import Codec
from ..conf import Settings
from ..exceptions import QuotaQueueFullError, SingletonQueueFullError
from ..models import (
    DebouncedStart,
    Heartbeat,
    QuotaMembership,
    Run,
    Signal,
    SingletonKey,
    Step,
    ThrottleAdmission,
    ThrottleMembership,
    WorkerProcess,
)
from ..querysets import DbNow, RunQuerySet, database_now, db_now_plus
from ..records import (
    Beat,
    KeyCount,
    KeyQueue,
    PurgeReport,
    QueueHolder,
    SlotCount,
    ThrottleWaitCount,
    WorkerRecord,
    since_admitted,
)
from ..statuses import (
    ACTIVE_STATUSES,
    PARKED_STATUSES,
    WAKEABLE_STATUSES,
    ParkReason,
    Rung,
    RunStatus,
    SlotState,
    Verdict,
)
from . import key_controls, mysql, pg, retention, sqlite
from .base import (
    CANCELLED_ERROR,
    QUEUE_TTL_ERROR,
    REPLACED_ERROR,
    BaseStore,
    ControlChange,
    ControlChangeRecord,
    ControlResult,
    Debounced,
    Finish,
    Limits,
    QueueTtls,
    RenewalBusy,
    RetryPolicy,
    RunRecord,
    SignalRecord,
    StepRecord,
    Superseding,
    Turn,
    TurnState,
    cancel_error,
    handed_off,
    stamped,
)
from .rows import COLUMNS, run_record
from .schedule_state import DjangoScheduleStore
from .turns import DEFAULT_QUEUE, add_notices

__all__ = ["DjangoStore", "forget_key_rows", "is_transient_error", "record_of"]

T = TypeVar("T")

_TRANSIENT_SQLSTATES = {"40001", "40P01", "55P03"}  # serialization, deadlock, lock not available
_TRANSIENT_MYSQL_CODES = {1205, 1213}  # lock wait timeout, deadlock
_MYSQL_LOCK_NOWAIT = 3572  # MySQL 8's NOWAIT on a locked row (MariaDB's is 1205)


def is_transient_error(exc: BaseException) -> bool:
    """Tell whether ``exc`` is a transient database error worth retrying (SPEC section 7).

    Named errors only: serialization failure, deadlock, lock timeout, and
    SQLite's "database is locked".
    """
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.__cause__
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if sqlstate in _TRANSIENT_SQLSTATES:
        return True
    args = getattr(cause, "args", None) or exc.args
    if args and isinstance(args[0], int) and args[0] in _TRANSIENT_MYSQL_CODES:
        return True
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def record_of(row: Run) -> RunRecord:
    """Return the :class:`RunRecord` of a model row (``stores.rows.run_record``)."""
    return run_record(_columns(row), quota_keys=_quota_keys_of_row(row))


_columns = attrgetter(*COLUMNS)


def _quota_keys_of_row(row: Run) -> tuple[tuple[str, str], ...]:
    """The quota keys of a row (X3b): its ``quota_keys`` column; for a run that carries
    quotas (``quota_slot`` set) with the column NULL, its memberships. A process of the
    release before migration 0015, still running during a rolling upgrade, inserts its
    quota carriers without the column; their memberships are the keys its start
    recorded, the ones 0015 moves to the column (one read, such rows only)."""
    if row.quota_keys is None and row.quota_slot is not None:
        members = QuotaMembership.objects.using(row._state.db or DEFAULT_DB_ALIAS).filter(run_id=row.run_id)
        return tuple((str(q), str(k)) for q, k in members.order_by("id").values_list("quota", "key"))
    return quota_keys_of(row.quota_keys)


def _aware(value: Any) -> datetime:
    """A time the database returned, as an aware UTC datetime (MySQL's is naive UTC)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value  # type: ignore[no-any-return]


def _terminal_fields(status: str, output: Any, error: Any, finished_at: datetime | None = None) -> dict[str, Any]:
    # One write sets the terminal status and drops the markers (S12).
    return {
        "status": status,
        "output": output,
        "error": error,
        "singleton_slot": None,
        "singleton_tracked": False,
        "quota_slot": None,
        "lease_owner": None,
        "lease_expires_at": None,
        "wake_at": None,
        "finished_at": finished_at or DbNow(),
        "updated_at": DbNow(),
    }


def _settled(run: RunRecord, status: str, output: Any, error: Any) -> RunRecord:
    return run.evolve(
        status=status,
        output=output,
        error=error,
        admitted=False,
        tracked=False,
        quota_slot=None,
        lease_owner=None,
        lease_expires_at=None,
        wake_at=None,
        finished_at=timezone.now(),
    )


def _room_finished(
    run: RunRecord,
    status: str,
    output: Any,
    error: Any,
    finished_at: datetime | None,
    done: tuple[Run | None, list[Run], list[Run]],
) -> Finish:
    """The :class:`Finish` of a MySQL/MariaDB settle procedure's result (the settled row or
    None if its compare failed, the waiters granted or admitted, each with the quota tokens
    the procedure sent, X3f, and the waiters sent a turn as they are; S7, R5a)."""
    settled_row, granted, turns = done
    if settled_row is None:
        return Finish(None)
    admitted = []
    for row in granted:
        record = record_of(row)
        tokens = mysql.tokens_of(row)
        admitted.append(record if tokens is None else record.evolve(quota_tokens=tokens))
    settled = _settled(run, status, output, error)
    return Finish(
        settled.evolve(finished_at=finished_at or settled.finished_at),
        handed_off(admitted, [record_of(t) for t in turns]),
    )


@dataclass(frozen=True)
class _Carrier:
    """A waiter that carries quotas which a handoff admits (X3h): its row as read and its
    place (1-based) in each of its quota keys, (name, key)."""

    row: Run
    places: Mapping[tuple[str, str], int]


class _UnlockedQuotaKeysError(Exception):
    """A superseding start found runs to end that carry quota keys it has not
    locked: it starts its transaction again with them (X3e, X3g)."""

    def __init__(self, quota_keys: set[tuple[str, str]]) -> None:
        super().__init__(sorted(quota_keys))
        self.quota_keys = quota_keys


#: The key rows known to exist, per database alias: (workflow or lock name, key) pairs this
#: process locked (:meth:`DjangoStore.lock_key`). Forgotten whole past this many.
_KNOWN_KEY_ROWS: dict[str, set[tuple[str, str]]] = {}
_KNOWN_KEY_ROWS_MAX = 100_000


def _known_key_rows(db: str) -> set[tuple[str, str]]:
    known = _KNOWN_KEY_ROWS.setdefault(db, set())
    if len(known) > _KNOWN_KEY_ROWS_MAX:
        known.clear()
    return known


def forget_key_rows(db: str) -> None:
    """Forget the key rows known to exist on database alias ``db`` (after a ``migrate``
    or a ``flush``, which may have removed them): their next locks take the upsert."""
    _KNOWN_KEY_ROWS.pop(db, None)


class DjangoStore(BaseStore):
    """Runs in the database through the Django ORM.

    ``using``: the database alias; None asks the router (``db_for_write``).
    ``claim_retries``: bounded retries of a transaction on transient errors.
    ``redelivery_seconds``: how long a sent turn is left to arrive before the
    tick sends it again (S7a, F4).
    ``raw_sql``: send the hot transactions (the turn's read and claim, the
    handoff) as raw SQL, one round trip each (:mod:`durable_singleton.stores.pg`);
    None (the default): on PostgreSQL through psycopg 3 with client-side
    binding, on MySQL/MariaDB the claims the room's stored procedures carry
    (:mod:`durable_singleton.stores.mysql`) where they are installed, on SQLite
    the start, the claim and the settle as the room's raw statements
    (:mod:`durable_singleton.stores.sqlite`); False: always the ORM path.
    """

    supports_atomic_admission = True
    supports_bulk_start = True
    supports_key_controls = True
    supports_on_busy = True
    supports_quotas = True
    supports_debounce = True
    supports_throttles = True
    supports_slot_repairs = True
    supports_schedules = True
    supports_queue_ttl = True

    def __init__(
        self,
        using: str | None = None,
        *,
        claim_retries: int = 5,
        redelivery_seconds: float = 5.0,
        raw_sql: bool | None = None,
    ) -> None:
        self.using = using
        self.raw_sql = raw_sql
        self._fast_paths: dict[str, pg.FastPath | None] = {}
        self._rooms: dict[str, mysql.Room | None] = {}
        self._sqlite_rooms: dict[str, sqlite.Room | None] = {}
        self.claim_retries = claim_retries
        self.redelivery_seconds = redelivery_seconds
        self._schedule_states: dict[Codec | None, DjangoScheduleStore] = {}
        self._schedule_states_lock = threading.Lock()

    def apply_key_controls(
        self,
        workflow: str,
        keys: Sequence[str] | None,
        change: ControlChange,
        *,
        by: str,
        reason: str,
        now: datetime,
    ) -> list[ControlResult]:
        """Apply ``change`` on the keys' lock rows and record it (:mod:`durable_singleton.stores.key_controls`),
        one transaction retried whole on a named transient error (:meth:`_retrying`): a claim
        creating a key row in the gap before a locked key's row may make InnoDB refuse it as a
        deadlock, at either isolation level (S13a)."""
        return self._retrying(lambda: key_controls.apply(self, workflow, keys, change, by=by, reason=reason, now=now))

    def key_control_state(self, workflow: str, key: str) -> tuple[bool, int | None]:
        return key_controls.state(self, workflow, key)

    def key_control_history(self, workflow: str, key: str | None, limit: int) -> list[ControlChangeRecord]:
        return key_controls.history(self, workflow, key, limit)

    def schedule_state(self, codec: Codec | None = None) -> DjangoScheduleStore:
        """Return the schedule state in this store's database (S17), its inputs encoded by ``codec``."""
        with self._schedule_states_lock:
            found = self._schedule_states.get(codec)
            if found is None:
                found = self._schedule_states[codec] = DjangoScheduleStore(self, codec)
            return found

    @property
    def db(self) -> str:
        """Return the database alias writes go to."""
        return self.using or router.db_for_write(Run)

    @property
    def database(self) -> str:
        """Return the database alias writes go to (:attr:`db`)."""
        return self.db

    def _fast(self) -> pg.FastPath | None:
        """Return the raw-SQL fast path of this store's database, or None: the ORM path."""
        db = self.db
        try:
            return self._fast_paths[db]
        except KeyError:
            fast = pg.FastPath(self) if self.raw_sql is not False and pg.usable(self) else None
            self._fast_paths[db] = fast
            return fast

    def _mysql_room(self) -> mysql.Room | None:
        """Return the MySQL/MariaDB room of this store's database (its stored procedures), or
        None: another database, ``raw_sql=False``, or the procedures missing or refused (the ORM path)."""
        db = self.db
        try:
            room = self._rooms[db]
        except KeyError:
            room = self._rooms[db] = mysql.room_of(db) if self.raw_sql is not False else None
        return room if room is not None and room.usable else None

    def _sqlite_room(self) -> sqlite.Room | None:
        """Return the SQLite room of this store's database (its raw statements), or None:
        another database, ``raw_sql=False``, or an SQLite without ``RETURNING`` (the ORM path)."""
        db = self.db
        try:
            return self._sqlite_rooms[db]
        except KeyError:
            room = None if self.raw_sql is False else sqlite.room_of(db, self.redelivery_seconds)
            self._sqlite_rooms[db] = room
            return room

    def _runs(self) -> RunQuerySet:
        return Run.objects.using(self.db)

    @property
    def _vendor(self) -> str:
        return str(connections[self.db].vendor)

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one transaction), retrying named transient errors a bounded number of times."""
        for attempt in range(self.claim_retries + 1):
            try:
                return fn()
            except OperationalError as exc:
                if attempt >= self.claim_retries or not is_transient_error(exc) or connections[self.db].in_atomic_block:
                    raise
                time.sleep(min(0.2, 0.005 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def in_transaction(self, fn: Callable[[], T]) -> T:
        """:meth:`BaseStore.in_transaction`: ``fn`` in ``transaction.atomic`` on
        the store's database, retried whole on a named transient error when the
        caller holds no transaction (:meth:`_retrying`); inside a caller's
        ``atomic`` block (``ATOMIC_REQUESTS``) it is a savepoint of that
        transaction and commits or rolls back with it (O1a)."""

        def once() -> T:
            with transaction.atomic(using=self.db):
                return fn()

        return self._retrying(once)

    # -- the clock -----------------------------------------------------------
    def is_unreachable(self, exc: BaseException) -> bool:
        """Also Django's ``OperationalError`` and ``InterfaceError``: the
        drivers raise them for a lost or refused connection, a server
        shutdown, a lock or statement timeout, a deadlock."""
        return isinstance(exc, (OperationalError, InterfaceError)) or super().is_unreachable(exc)

    def transaction_depth(self) -> int:
        return len(connections[self.db].atomic_blocks)

    def discard_broken_connection(self) -> None:
        """Close this thread's connection if an error left it unusable (outside
        a transaction), so the next query reconnects; Django does this only
        between requests. A healthy connection is kept, whatever its age:
        ``CONN_MAX_AGE`` is applied between tasks (``close_old_connections``),
        not before every tick job and turn."""
        conn = connections[self.db]
        if conn.connection is None or conn.in_atomic_block:
            return
        # With CONN_HEALTH_CHECKS on, the next query first checks the connection,
        # as Django does at each request: one killed while idle is replaced.
        conn.health_check_done = False  # type: ignore[attr-defined]  # not in django-stubs
        if not conn.errors_occurred:
            return
        if conn.is_usable():
            conn.errors_occurred = False
        else:
            conn.close()

    def now(self) -> datetime:
        """Return the database server's time in UTC (R5): on SQLite, its host's
        (``durable_singleton.querysets.database_now``)."""
        return database_now(self.db)

    # -- keys ------------------------------------------------------------------
    def lock_key(self, workflow_name: str, key: str, *, existing: bool = False) -> dict[str, Any]:
        """Lock the key's row, creating it if missing; return its fields.

        Must run inside a transaction. SQLite has no row locks: an UPDATE of
        the row takes the database write lock before anything is read (one
        upsert that returns the row, where SQLite returns rows). On
        MySQL/MariaDB a key this process has not seen yet is locked by an
        upsert, which takes the row's exclusive lock (creating the row if
        missing) without the gap lock a ``SELECT ... FOR UPDATE`` of a missing
        row takes at REPEATABLE READ, which made first claims of a new key
        deadlock with each other (S13a). A key row seen (key rows are never
        deleted by the package), or with ``existing`` (a settle: the key's row
        was created by its run's claim), is locked by ``SELECT ... FOR UPDATE``
        first: the record alone, one statement instead of two, and no next-key
        lock that would block a new key row's insert into the gap before it.
        """
        keys = SingletonKey.objects.using(self.db).filter(workflow_name=workflow_name, key=key)
        fields = ("pk", "last_token", "paused", "limit_override")
        known = _known_key_rows(self.db)
        if self._vendor == "mysql" and (existing or (workflow_name, key) in known):
            # A row that exists: the locking read of one row of the unique index locks that
            # record alone. The upsert's duplicate-key check takes a next-key lock, the gap
            # before the row too, and a transaction waiting for it blocks every insert into
            # that gap: a claim holding this row and creating its next key's row there was
            # refused as a deadlock, again at each retry while others kept waiting (S13a).
            found: dict[str, Any] | None = keys.select_for_update().values(*fields).first()
            if found is not None:
                return found
            known.discard((workflow_name, key))  # deleted by someone else: the upsert creates it
        if self._vendor == "sqlite" and connections[self.db].features.can_return_columns_from_insert:
            return self._upsert_key(workflow_name, key)
        if self._vendor == "mysql":
            connection = connections[self.db]
            table = connection.ops.quote_name(SingletonKey._meta.db_table)
            columns = ", ".join(
                connection.ops.quote_name(c)
                for c in ("created", "modified", "workflow_name", "key", "last_token", "paused")
            )
            token = connection.ops.quote_name("last_token")
            now = timezone.now().replace(tzinfo=None)  # Django stores UTC, naive, on MySQL
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {table} ({columns}) VALUES (%s, %s, %s, %s, 0, 0) "
                    f"ON DUPLICATE KEY UPDATE {token} = {token}",
                    [now, now, workflow_name, key],
                )
            locked_row: dict[str, Any] = keys.select_for_update().values(*fields).get()  # ours already: no wait
            known.add((workflow_name, key))
            return locked_row
        for _ in range(2):
            if self._vendor == "sqlite":
                if keys.update(last_token=F("last_token")):
                    locked: dict[str, Any] = keys.values(*fields).get()
                    return locked
            else:
                row: dict[str, Any] | None = keys.select_for_update().values(*fields).first()
                if row is not None:
                    return row
            SingletonKey.objects.using(self.db).bulk_create(
                [SingletonKey(workflow_name=workflow_name, key=key)], ignore_conflicts=True
            )
        raise OperationalError("database is locked: the key row vanished while being locked")

    def _upsert_key(self, workflow_name: str, key: str) -> dict[str, Any]:
        """SQLite's key lock: one ``INSERT ... ON CONFLICT DO UPDATE ... RETURNING``, which
        takes the database write lock, creates the row if missing and returns it (S13a), its
        token counter moved past every holder's token first (K1, :func:`.sqlite.lock_key`)."""
        return sqlite.lock_key(self.db, workflow_name, key)

    def _locking(self, queryset: Any) -> Any:
        """Read the latest commits after the key's lock, whatever the isolation level (S13a).

        Our own transaction's first statement is the key lock, so its later
        reads see every commit before the lock, at READ COMMITTED and at
        REPEATABLE READ alike (InnoDB takes the snapshot at the first plain
        read). Nested in a caller's transaction on MySQL/MariaDB, an earlier
        read may have fixed the snapshot: there the read is a locking read,
        which always sees the latest commits.
        """
        nested = len(connections[self.db].atomic_blocks) > 1
        return queryset.select_for_update() if nested and self._vendor == "mysql" else queryset

    def _front(self, workflow_name: str, key: str, rows: int, ttl: float | None = None) -> tuple[list[Run], int]:
        """Read the key's holders then its oldest waiters, ``rows`` at most, and
        the number of untracked holders of an older release (S5, S12). With
        ``ttl`` (the workflow's ``queue_ttl`` in seconds), the waiters past it
        by the database's clock are not read: no grant reaches them (X2, R5)."""
        runs = self._runs().for_key(workflow_name, key)
        legacy = (
            runs.filter(RunQuerySet.legacy_q()).order_by().values("singleton_key").annotate(n=Count("pk")).values("n")
        )
        queue = runs.queue_front()
        if ttl is not None:
            queue = queue.exclude(Q(singleton_slot=SlotState.WAITER) & queue_ttl_expired_q(ttl, DbNow()))
        front = list(self._locking(queue.annotate(legacy=Coalesce(Subquery(legacy), 0)))[:rows])
        return front, (front[0].legacy if front else 0)

    @staticmethod
    def _holds_slot(row: Run) -> bool:
        """:func:`~durable_singleton.admission.holds_slot` of a row (S5, S12)."""
        admitted = row.singleton_slot == SlotState.HOLDER
        return holds_slot(row.status, key=row.singleton_key, admitted=admitted, tracked=row.singleton_tracked)

    def _limit(
        self, workflow_name: str, key_row: Mapping[str, Any], limits: Limits, stored: Iterable[int | None] = ()
    ) -> int:
        return limit_in_force(declared_limit(limits, workflow_name, stored), key_row["limit_override"])

    def _grant(
        self,
        workflow_name: str,
        key: str,
        key_row: dict[str, Any],
        limits: Limits,
        *,
        claimant: str | None = None,
        ttls: QueueTtls | None = None,
        carriers: Collection[str] = (),
    ) -> tuple[list[RunRecord], Run | None, int, Run | None]:
        """Give the key's free slots to its oldest waiters, under the key's lock (S5, S7, K1).

        A waiter past its workflow's ``queue_ttl`` in ``ttls`` (seconds by
        workflow name) by the database's clock is skipped, the claimant too:
        it stays a waiter, and the tick ends it (X2).

        Returns the granted waiters (other than ``claimant``); the claimant's
        row if it is at the front of the queue without a free slot (for its
        retry delay); the claimant's token if it was admitted (0 if not); and
        the claimant's row if another claim granted it a slot meanwhile. Each
        grant is a compare-and-set on the waiter as read. A waiter that carries
        quotas within the free slots is returned as it is, not admitted: a turn
        for its own claim (X3h); unless it is one of ``carriers``, the ones a
        handoff admits (:meth:`_handoff_carriers`), which take their quota slot
        with the grant (the caller gives their quota tokens).
        """
        limit = self._limit(workflow_name, key_row, limits)
        front, legacy = self._front(workflow_name, key, 2 * limit, (ttls or {}).get(workflow_name))
        limit = self._limit(workflow_name, key_row, limits, (r.singleton_limit for r in front))
        holders = sum(1 for r in front if self._holds_slot(r)) + legacy
        waiters = [r for r in front if r.singleton_slot == SlotState.WAITER]
        free = free_slots(limit, holders, paused=bool(key_row["paused"]))
        token = key_row["last_token"]
        granted: list[RunRecord] = []
        claimant_token = 0
        claimant_front = next((r for r in waiters[:limit] if r.run_id == claimant), None)
        claimant_holder = next((r for r in front if r.run_id == claimant and self._holds_slot(r)), None)
        runs = self._runs()
        for row in waiters[:free]:
            if row.run_id == claimant:
                token += 1
                claimant_token = token
                continue
            carrier = row.quota_slot is not None
            if carrier and row.run_id not in carriers:
                # It carries quotas: it keeps its place and is sent a turn; its own
                # claim decides under the locks of all its limits (X3h).
                granted.append(record_of(row))
                continue
            token += 1
            quota = {"quota_slot": SlotState.HOLDER} if carrier else {}
            if runs.filter(
                pk=row.run_id,
                status=row.status,
                singleton_slot=SlotState.WAITER,
                cancel_requested=False,
                **({"quota_slot": SlotState.WAITER} if carrier else {}),
            ).update(
                singleton_slot=SlotState.HOLDER,
                singleton_tracked=True,
                fencing_token=token,
                admitted_at=DbNow(),
                wake_at=db_now_plus(self.redelivery_seconds),
                updated_at=DbNow(),
                **quota,
            ):
                now = timezone.now()
                granted.append(
                    record_of(row).evolve(admitted=True, tracked=True, fencing_token=token, admitted_at=now, **quota)
                )
        if token != key_row["last_token"]:
            SingletonKey.objects.using(self.db).filter(pk=key_row["pk"]).update(last_token=token)
        return granted, claimant_front, claimant_token, claimant_holder

    # -- starting ----------------------------------------------------------------
    def create_run(
        self, run: RunRecord, *, cap: int | None, cap_namespace: str | None = None
    ) -> tuple[RunRecord, bool]:
        """Insert ``run``; a duplicate ``run_id`` returns the existing run (R3).

        Without a cap this is one INSERT (in a savepoint inside a caller's
        transaction), and the key's lock row is left to the first claim. With a
        cap (the declared ``limit + max_queue_depth``), the key's lock is taken
        first; then, under it, the existence check, the count against the cap
        in force (:func:`~durable_singleton.admission.cap_in_force`: the key's
        runtime override replaces the declared limit, K2) and the insert, so a racing start of the same
        ``run_id`` gets the winner's run and never a full-queue error (R3, S15,
        S16, S13a). A run with ``quota_caps`` locks those quota keys first, in
        the lock order (X3e), and counts each one's active members against its
        cap in force under its lock (:class:`QuotaQueueFullError`, X3j).
        """
        capped = run.singleton_key is not None and cap is not None

        def create() -> tuple[RunRecord, bool]:
            if not capped and not run.quota_caps and not connections[self.db].in_atomic_block:
                self._insert(run)
                return run, True
            with transaction.atomic(using=self.db):
                # The capped quota keys, then the singleton key: the lock order (X3e).
                quota_rows = self._lock_capped_quota_keys(run)
                key_row = None
                if run.singleton_key is not None and cap is not None:
                    key_row = self.lock_key(run.workflow_name, run.singleton_key)
                if quota_rows or key_row is not None:
                    existing = self._locking(self._runs().filter(pk=run.run_id)).first()
                    if existing is not None:
                        return record_of(existing), False
                self._check_quota_caps(run, quota_rows, cap_namespace)
                if key_row is not None:
                    assert run.singleton_key is not None and cap is not None
                    # The limit in force, the key's runtime override included (S15, K2).
                    in_force = cap_in_force(cap, run.singleton_limit, key_row["limit_override"])
                    if self._count_active(run.workflow_name, run.singleton_key, cap_namespace, in_force) >= in_force:
                        raise SingletonQueueFullError(
                            run.workflow_name, run.singleton_key, cap - (run.singleton_limit or 1)
                        )
                self._insert(run)
                return run, True

        try:
            return self._retrying(create)
        except IntegrityError:
            # A racing start with the same run_id committed first (R3).
            existing = self._runs().filter(pk=run.run_id).first()
            if existing is None:
                raise
            return record_of(existing), False

    def start_run(
        self,
        run: RunRecord,
        *,
        cap: int | None,
        cap_namespace: str | None = None,
        deep_limit: int | None = None,
        backlog_wake_at: datetime | None = None,
        stamp: bool = False,
    ) -> tuple[RunRecord, bool]:
        """:meth:`BaseStore.start_run`; on PostgreSQL a run without a queue cap is
        one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` with the backlog
        check folded in and, with ``stamp``, ``created_at`` written by the
        database's clock (:meth:`pg.FastPath.start`): only the run it inserted
        is reported created, another start's is returned as stored (R3, S16,
        S8a, R8). A capped start with ``stamp`` reads the database's clock first."""
        fast = self._fast()
        # A run with a fair quota (its tag is read first) or a capped one (counted under its
        # quota keys' locks) takes the ORM path (X3i); a throttle carrier's memberships are
        # written by the fast path's INSERT (X6c).
        quotas_fast = not run.quota_shares and not run.quota_caps
        if fast is not None and (cap is None or run.singleton_key is None) and quotas_fast:
            for _ in range(self.claim_retries + 1):
                started = self._retrying(lambda: fast.start(run, deep_limit, backlog_wake_at, stamp=stamp))
                if started is not None:
                    return started
        room = self._sqlite_room()
        carriers = run.quota_keys or run.throttle_keys
        if room is not None and run.throttle_keys and not run.quota_keys:
            room.expect_throttled(run.run_id)  # its claims: the room's throttled claim first
        if room is not None and (cap is None or run.singleton_key is None) and not carriers:
            # One INSERT with the backlog check (the SQLite room; a throttle carrier's memberships
            # are the ORM path's, X6); the store's clock is the
            # process's, read without a statement (R8).
            if stamp and run.created_at.tzinfo is not None:
                run, backlog_wake_at = stamped(run, backlog_wake_at, self.now())
            for _ in range(self.claim_retries + 1):
                started = self._retrying(lambda: room.start(run, deep_limit, backlog_wake_at))
                if started is not None:
                    return started
        probed = run.singleton_key is not None and deep_limit is not None
        if not stamp and not probed:
            return self.create_run(run, cap=cap, cap_namespace=cap_namespace)
        # The database's clock, the key's runtime override and the depth of its queue in one read.
        now, deep = self._start_probe(run, deep_limit if probed else None)
        # Naive times (USE_TZ = False, refused by check E012) are not restamped: the
        # database's clock is aware, and the engine's times stay as they were given.
        if stamp and run.created_at.tzinfo is not None:
            run, backlog_wake_at = stamped(run, backlog_wake_at, now)
        if deep:
            run = run.evolve(wake_at=backlog_wake_at, park_reason=ParkReason.SINGLETON.value)
        return self.create_run(run, cap=cap, cap_namespace=cap_namespace)

    writes_turn_notices = True

    def start_run_with_notice(
        self,
        run: RunRecord,
        *,
        queue: str | None,
        cap: int | None,
        cap_namespace: str | None = None,
        deep_limit: int | None = None,
        backlog_wake_at: datetime | None = None,
        stamp: bool = False,
    ) -> tuple[RunRecord, bool]:
        """:meth:`BaseStore.start_run_with_notice`. On PostgreSQL's fast path (a run
        without a queue cap or quotas) one statement inserts the run and its notice
        (:func:`pg._with_notice`): one round trip, one commit. Elsewhere
        :meth:`start_run` and :func:`~.turns.add_notices` in :meth:`in_transaction`."""
        fast = self._fast()
        notice_queue = queue or DEFAULT_QUEUE
        carries = run.quota_keys or run.throttle_keys
        if fast is not None and (cap is None or run.singleton_key is None) and not carries:
            for _ in range(self.claim_retries + 1):
                started = self._retrying(
                    lambda: fast.start(run, deep_limit, backlog_wake_at, stamp=stamp, notice_queue=notice_queue)
                )
                if started is not None:
                    return started

        def both() -> tuple[RunRecord, bool]:
            stored, created = self.start_run(
                run,
                cap=cap,
                cap_namespace=cap_namespace,
                deep_limit=deep_limit,
                backlog_wake_at=backlog_wake_at,
                stamp=stamp,
            )
            if created and not ParkReason.SINGLETON.matches(stored.park_reason or ""):
                add_notices(self.db, [stored.run_id], notice_queue)
            return stored, created

        return self.in_transaction(both)

    def _start_probe(self, run: RunRecord, deep_limit: int | None) -> tuple[datetime, bool]:
        """Read, in one statement, the database's clock (R8) and, with ``deep_limit`` (the
        declared limit), whether ``run``'s key already has as many holders and waiters as its
        limit in force (:meth:`queue_is_deep`, with the key's runtime override, S8a, K2).

        The queue's first ``2 * deep_limit`` rows are counted with the override; an override
        that changes the limit in force has the queue read again with it (a second read).
        """
        db_now = {"mysql": "UTC_TIMESTAMP(6)", "postgresql": "STATEMENT_TIMESTAMP()"}.get(self._vendor, "NULL")
        if deep_limit is None or run.singleton_key is None:
            return self.now(), False
        connection = connections[self.db]
        key_row = SingletonKey.objects.using(self.db).filter(workflow_name=run.workflow_name, key=run.singleton_key)
        override_sql, override_params = key_row.values("limit_override")[:1].query.get_compiler(self.db).as_sql()
        front = self._runs().for_key(run.workflow_name, run.singleton_key).queue_front()
        front_rows = front.values("singleton_slot", "priority")[: 2 * deep_limit]
        front_sql, front_params = front_rows.query.get_compiler(self.db).as_sql()
        slot, place = connection.ops.quote_name("singleton_slot"), connection.ops.quote_name("priority")
        sql = (
            f"SELECT {db_now} AS database_now, ({override_sql}) AS limit_override, "
            f"COUNT(CASE WHEN queue_front.{slot} = %s THEN 1 END) AS holders, "
            # the waiters a start of its priority queues behind (X8)
            f"COUNT(CASE WHEN queue_front.{slot} = %s AND queue_front.{place} >= %s THEN 1 END) AS waiters "
            f"FROM ({front_sql}) queue_front"
        )
        params = [*override_params, SlotState.HOLDER.value, SlotState.WAITER.value, run.priority, *front_params]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            value, override, holders, waiters = cursor.fetchone()
        now = self.now() if value is None else _aware(value)
        limit = limit_in_force(deep_limit, override)
        if limit != deep_limit:
            return now, self.queue_is_deep(run.workflow_name, run.singleton_key, limit, priority=run.priority)
        return now, holders >= limit and waiters >= limit

    @property
    def stamps_starts(self) -> bool:  # type: ignore[override]
        """True: :meth:`start_run` stamps ``created_at`` with the database's clock, read in the
        statement that reads the key's queue (or by the fast path's insert on PostgreSQL, R8)."""
        return True

    def create_runs(
        self, runs: Sequence[RunRecord], *, caps: Mapping[str, int | None], cap_namespace: str | None = None
    ) -> list[tuple[RunRecord, bool] | BaseException]:
        """Insert a batch; per run, (run, created) or the exception its start raised.

        Runs without a cap go in one INSERT per batch of rows (:meth:`_insert_new`),
        which tells the rows it wrote from those a racing start wrote first: only
        the former are reported created; the others are read back and returned as
        stored (R3, S16). An id repeated in the batch is created from its first
        entry. Capped runs go one by one through :meth:`create_run`, under their
        key's lock (S15), and so do runs that carry quotas (their memberships
        are written with them, X3i). On a database that cannot return the rows an INSERT
        wrote (MySQL; MariaDB 10.5+ can), every run goes through :meth:`create_run`.
        Inside a transaction (a caller's ``atomic`` block, the worker dispatcher's
        start, O1a) the batch first locks every key row its runs' starts lock, in
        the one order (:meth:`_lock_batch_keys`, X3e).
        """
        if connections[self.db].in_atomic_block:
            self._lock_batch_keys(runs, caps)
        if not connections[self.db].features.can_return_rows_from_bulk_insert:
            return super().create_runs(runs, caps=caps, cap_namespace=cap_namespace)
        results: dict[int, tuple[RunRecord, bool] | BaseException] = {}
        first: dict[str, RunRecord] = {}  # the plain runs' first entry per id, in batch order
        for i, run in enumerate(runs):
            plain = not run.quota_keys and not run.throttle_keys
            if plain and (run.singleton_key is None or caps.get(run.workflow_name) is None):
                first.setdefault(run.run_id, run)
                continue
            try:
                results[i] = self.create_run(run, cap=caps.get(run.workflow_name), cap_namespace=cap_namespace)
            except Exception as exc:  # reported per run, as a single start would raise it
                results[i] = exc
        if first:
            created = self._insert_new(list(first.values()))
            stored = {
                run_id: (first[run_id], True) if run_id in created else self._stored(first[run_id]) for run_id in first
            }
            for i, run in enumerate(runs):
                if i not in results:
                    record, was_created = stored[run.run_id]
                    # Its first entry reports the creation; a repeat of the id found it (R3).
                    results[i] = (record, was_created and run is first[run.run_id])
        return [results[i] for i in range(len(runs))]

    def _lock_batch_keys(self, runs: Sequence[RunRecord], caps: Mapping[str, int | None]) -> None:
        """Lock the key rows the starts of ``runs`` lock, all at once in the one order (X3e):
        their fair quota keys (a start that passes lower-priority waiters locks its key,
        X4b, X8c) and capped quota keys (X3j) sorted by (name, key), then their capped
        singleton keys (S15) sorted by (workflow, key). A batch in one transaction holds
        each lock until its commit; run by run, in input order, two batches over the same
        keys in other orders each waited for the other's key row (a deadlock). ``caps``:
        the queue cap of each workflow by name, as :meth:`create_runs`. Nothing is locked
        for fewer than two keys (one run's own locks are in order already)."""
        quota_keys: set[tuple[str, str]] = set()
        singleton_keys: set[tuple[str, str]] = set()
        for run in runs:
            locked = {name for name, _sub_key, _weight in run.quota_shares}
            locked.update(name for name, _limit, _depth in run.quota_caps)
            quota_keys.update(q for q in run.quota_keys if q[0] in locked)
            if run.singleton_key is not None and caps.get(run.workflow_name) is not None:
                singleton_keys.add((run.workflow_name, run.singleton_key))
        self._lock_in_order(quota_keys, singleton_keys)

    def _lock_in_order(self, quota_keys: set[tuple[str, str]], singleton_keys: set[tuple[str, str]]) -> None:
        """Lock the quota keys ``quota_keys`` ((name, key) pairs) sorted by (name, key), then
        the singleton keys ``singleton_keys`` ((workflow, key) pairs) sorted by (workflow,
        key): the one global order (X3e). Nothing for fewer than two keys (one start's own
        locks are in order already)."""
        if len(quota_keys) + len(singleton_keys) < 2:
            return
        self._lock_quota_keys(quota_keys)
        for workflow_name, key in sorted(singleton_keys):
            self.lock_key(workflow_name, key)

    def lock_superseding_batch(self, runs: Sequence[RunRecord]) -> None:
        """:meth:`BaseStore.lock_superseding_batch`: inside a transaction (a caller's
        ``atomic`` block), lock every key the superseding starts of ``runs`` lock, all at
        once in the one order (X3e, X1): the quota keys the runs carry and those the keys'
        active runs carry (read without a lock, as :meth:`start_superseding` reads them),
        then the runs' singleton keys. Each start then finds its keys held by its own
        transaction. Outside a transaction each start commits and releases its own locks:
        nothing is locked here."""
        if not connections[self.db].in_atomic_block:
            return
        singleton_keys = {(run.workflow_name, run.singleton_key) for run in runs if run.singleton_key is not None}
        self._lock_in_order({q for run in runs for q in self._superseding_quota_keys(run)}, singleton_keys)

    def _superseding_quota_keys(self, run: RunRecord) -> set[tuple[str, str]]:
        """The quota keys ((name, key) pairs) a superseding start of ``run`` may free: its
        own and, when it carries any (its workflow has quotas), those of its singleton key's
        active runs, read without a lock (X3g, X1)."""
        locking = set(run.quota_keys)
        if run.quota_keys and run.singleton_key is not None:
            carried = self._runs().for_key(run.workflow_name, run.singleton_key).active()
            locking.update(q for keys in carried.values_list("quota_keys", flat=True) for q in quota_keys_of(keys))
        return locking

    def start_superseding(
        self, run: RunRecord, *, on_busy: str, limits: Limits, cap_namespace: str | None = None
    ) -> Superseding:
        """:meth:`BaseStore.start_superseding` on the ORM path, on every database
        (PostgreSQL's fast path leaves these strategies here): the run's capped
        quota keys' locks and the key's lock (X3e), then the existence check,
        the read of the key's active runs, the quota caps' count (X3j), the
        replacing and stopping writes and the insert, in one transaction (X1,
        S13, S13a). Each write is a compare-and-set on the row as read (R5a).
        The runs it ends at once free their quota slots under their quota
        keys' locks (X3g): the first attempt locks the new run's quota keys
        and those of the key's active runs, read just before without a lock;
        if a run to end carries another (a start that committed in between),
        nothing has been written yet, and the transaction starts again with
        that key locked too, in the lock order."""
        assert run.singleton_key is not None
        workflow_name, key = run.workflow_name, run.singleton_key
        locking = self._superseding_quota_keys(run)

        def start() -> Superseding:
            runs = self._runs()
            with transaction.atomic(using=self.db):
                # Every quota key it may free, then the singleton key: the lock order (X3e).
                quota_rows = self._lock_quota_keys(locking)
                key_row = self.lock_key(workflow_name, key)
                existing = self._locking(runs.filter(pk=run.run_id)).first()
                if existing is not None:
                    return Superseding(record_of(existing), False)
                active = list(self._locking(runs.for_key(workflow_name, key).active().order_by(*QUEUE_ORDER)))
                holders = [r for r in active if self._holds_slot(r)]
                waiters = [r for r in active if not self._holds_slot(r)]
                limit = self._limit(workflow_name, key_row, limits, (run.singleton_limit,))
                free = free_slots(limit, len(holders), paused=bool(key_row["paused"]))
                to_replace, stop = superseded(on_busy, free, holders, waiters, lambda r: r.quota_slot is not None)
                ending = [*to_replace, *(r for r in stop if r.status != RunStatus.RUNNING)]
                unlocked = {q for r in ending for q in quota_keys_of(r.quota_keys)} - locking
                if unlocked:
                    raise _UnlockedQuotaKeysError(unlocked)  # nothing written yet: lock them too and start again
                # The runs this start ends at once leave the quota keys' count (S15, X3j).
                self._check_quota_caps(run, quota_rows, cap_namespace, {r.run_id for r in ending})
                replaced = [self._settle_row(r, REPLACED_ERROR) for r in to_replace]
                cancelled: list[RunRecord | None] = []
                stopping: list[RunRecord] = []
                for row in stop:
                    if row.status != RunStatus.RUNNING:
                        cancelled.append(self._settle_row(row, CANCELLED_ERROR))
                    elif runs.filter(pk=row.run_id, status=RunStatus.RUNNING).update(
                        cancel_requested=True, wake_at=DbNow(), updated_at=DbNow()
                    ):
                        stopping.append(record_of(row).evolve(cancel_requested=True))
                self._insert(run)
                return Superseding(
                    run,
                    True,
                    tuple(r for r in replaced if r is not None),
                    tuple(r for r in cancelled if r is not None),
                    tuple(stopping),
                )

        while True:
            try:
                return self._retrying(start)
            except _UnlockedQuotaKeysError as more:
                locking |= more.quota_keys
            except IntegrityError:
                # A racing start of the same run_id committed first (R3).
                found = self._runs().filter(pk=run.run_id).first()
                if found is None:
                    raise
                return Superseding(record_of(found), False)

    def start_debounced(
        self,
        run: RunRecord,
        *,
        seconds: float,
        max_seconds: float,
        timeout: float | None,
        cap: int | None,
        cap_namespace: str | None = None,
        explicit_id: bool = False,
    ) -> Debounced:
        """:meth:`BaseStore.start_debounced` on the ORM path, on every database (the
        PostgreSQL fast path and the MariaDB procedures start no debounced run).

        One transaction: the debounce key's row in the key table
        (``debounce:<workflow>``, :func:`~durable_singleton.admission.debounce_lock_name`)
        is locked first, before any quota or singleton key the insert locks
        (S13, X7b: no claim takes a debounce lock, so the order has no cycle);
        the open run is found through ``ds_run_debounce_idx`` and changed by a
        compare-and-set on :func:`~durable_singleton.admission.debounce_open_q`,
        both judged on the database's clock of their own statement (``DbNow``);
        a fold writes the run's new start (``seconds`` after it, never past its
        ``debounce_until``) as an expression on the clock of that compare-and-set,
        and a new run's times are read from that clock after the decision
        (R5, R5a, X7a, X7d): a pause of this thread under the lock, while the open
        run comes due and a worker takes it, neither folds into that run nor
        stamps the new run with a time at which it was open.
        A named transient error retries the whole start (:meth:`_retrying`).
        """
        assert run.debounce_key is not None

        def start() -> Debounced:
            with transaction.atomic(using=self.db):
                self.lock_key(debounce_lock_name(run.workflow_name), run.debounce_key or "")
                # A generated run id is new: only an explicit one can name a run or a fold (R3, X7c).
                existing = self._locking(self._runs().filter(pk=run.run_id)).first() if explicit_id else None
                if existing is None and explicit_id:
                    folded_into = (
                        DebouncedStart.objects.using(self.db)
                        .filter(pk=run.run_id)
                        .values_list("run_id", flat=True)
                        .first()
                    )
                    if folded_into is not None:
                        existing = self._runs().filter(pk=folded_into).first()
                if existing is not None:
                    return Debounced(record_of(existing), False)
                # Openness is judged on the database's clock at each statement (DbNow), never on a
                # clock read earlier: this thread may pause between statements while the open run's
                # time comes and a worker takes it (X7a, R5). Once closed a run stays closed (only a
                # fold moves not_before, and only of an open run), so a clock read after a decision
                # still holds it: the times this start writes are read after its decision.
                opened = self._locking(
                    self._runs()
                    .filter(
                        workflow_name=run.workflow_name,
                        workflow_version=run.workflow_version,
                        debounce_key=run.debounce_key,
                        namespace=run.namespace,
                        singleton_key=run.singleton_key,
                    )
                    .filter(debounce_open_q(DbNow()))
                    .filter(*self._debounce_members_q(run))
                    .order_by("-created_at", "-run_id")
                )
                for row in opened[:8]:
                    if quota_keys_of(row.quota_keys) != run.quota_keys or row.debounce_until is None:
                        continue
                    if debounce_throttle_keys(row.throttle_keys or ()) != debounce_throttle_keys(run.throttle_keys):
                        continue  # another throttle key's run: its rate admits it (X6, X7a)
                    if run.quota_shares and debounce_fair_shares(
                        QuotaMembership.objects.using(self.db).filter(run_id=row.run_id).values_list("quota", "sub_key")
                    ) != debounce_fair_shares(run.quota_shares):
                        continue  # another tenant's run of a fair quota (X4, X7a)
                    # The new start time on the database's clock of the compare-and-set itself,
                    # never past the first start's bound (X7a, X7d, R5).
                    moved = Least(db_now_plus(seconds), F("debounce_until"), output_field=DateTimeField())
                    deadline = (
                        ExpressionWrapper(moved + Value(timedelta(seconds=timeout)), output_field=DateTimeField())
                        if timeout is not None
                        else None
                    )
                    changed = (
                        self._runs()
                        .filter(debounce_open_q(DbNow()), pk=row.run_id)
                        .update(
                            input=run.input, not_before=moved, wake_at=moved, deadline_at=deadline, updated_at=DbNow()
                        )
                    )
                    if not changed:
                        continue
                    row.input = run.input
                    row.not_before, row.wake_at, row.deadline_at, row.updated_at = (
                        self._runs()
                        .filter(pk=row.run_id)
                        .values_list("not_before", "wake_at", "deadline_at", "updated_at")
                        .get()
                    )
                    if explicit_id:
                        DebouncedStart.objects.using(self.db).create(
                            start_id=run.run_id, run_id=row.run_id, created_at=row.updated_at
                        )
                    return Debounced(record_of(row), False, True)
                # No open run at the decision (the read above, or the compare-and-set that found
                # one closed): the new run's times are read after it (X7a, R5).
                now = self.now()
                starts = now + timedelta(seconds=seconds)
                new = run.evolve(
                    created_at=now,
                    updated_at=now,
                    not_before=starts,
                    wake_at=starts,
                    debounce_until=now + timedelta(seconds=max_seconds),
                    deadline_at=starts + timedelta(seconds=timeout) if timeout is not None else None,
                )
                stored_run, created = self.create_run(new, cap=cap, cap_namespace=cap_namespace)
                return Debounced(stored_run, created)

        return self._retrying(start)

    def _debounce_members_q(self, run: RunRecord) -> list[Exists]:
        """The open runs a start of ``run`` may fold into hold a membership of each of
        its quota keys, under its fair sub-key (X7a, X4), and of each of its throttle
        keys (X6): found in SQL, so the key's open runs of other quota keys, tenants
        or throttle keys, however many, never hide it."""
        shares = {name: sub for name, sub in debounce_fair_shares(run.quota_shares)}
        members = QuotaMembership.objects.using(self.db)
        throttled = ThrottleMembership.objects.using(self.db)
        return [
            *(
                Exists(
                    members.filter(
                        run_id=OuterRef("pk"),
                        quota=name,
                        key=key,
                        **({"sub_key": shares[name]} if name in shares else {}),
                    )
                )
                for name, key in run.quota_keys
            ),
            *(
                Exists(throttled.filter(run_id=OuterRef("pk"), throttle=name, key=key))
                for name, key in debounce_throttle_keys(run.throttle_keys)
            ),
        ]

    def _settle_row(self, row: Run, error: Mapping[str, str]) -> RunRecord | None:
        """Settle a parked run ``cancelled`` with ``error`` by compare-and-set on its
        status as read, inside the caller's transaction under the key's lock (R5a,
        S12); None if it changed meanwhile. No slot is granted (X1)."""
        fields = _terminal_fields(RunStatus.CANCELLED, None, dict(error))
        if row.status not in PARKED_STATUSES or not self._runs().filter(pk=row.run_id, status=row.status).update(
            **fields
        ):
            return None
        if row.quota_slot is not None:
            QuotaMembership.objects.using(self.db).filter(run_id=row.run_id).update(slot=None)  # X3g
        return _settled(record_of(row), RunStatus.CANCELLED, None, dict(error))

    def _stored(self, run: RunRecord) -> tuple[RunRecord, bool]:
        """Return the stored run of an id whose insert met a conflict (R3); one
        deleted meanwhile (a purge) is created again by :meth:`create_run`."""
        row = self._runs().filter(pk=run.run_id).first()
        return (record_of(row), False) if row is not None else self.create_run(run, cap=None)

    def _insert_new(self, runs: Sequence[RunRecord]) -> set[str]:
        """Insert the runs whose ids are free; return the ids this call wrote (R3).

        One ``INSERT ... ON CONFLICT DO NOTHING ... RETURNING run_id`` per batch
        of rows the database takes (``INSERT OR IGNORE`` on SQLite, ``INSERT
        IGNORE`` on MariaDB), in one transaction. A row that a racing start
        wrote first is skipped by the INSERT and not returned, so it is never
        reported as created by this call; an INSERT that ignores conflicts
        without ``RETURNING`` (``bulk_create(ignore_conflicts=True)``) cannot
        tell the two apart. The database must return rows from a bulk insert
        (``can_return_rows_from_bulk_insert``).
        """
        connection = connections[self.db]
        objs: list[Model] = [self._row(run) for run in runs]
        fields = [f for f in Run._meta.concrete_fields if not f.generated]
        size = connection.ops.bulk_batch_size(fields, objs) or len(objs)
        written: set[str] = set()
        with transaction.atomic(using=self.db, savepoint=False), connection.cursor() as cursor:
            for start in range(0, len(objs), size):
                query = InsertQuery(Run, on_conflict=OnConflict.IGNORE)
                query.insert_values(fields, objs[start : start + size])
                compiler = query.get_compiler(using=self.db)
                compiler.returning_fields = [Run._meta.pk]
                for sql, params in compiler.as_sql():
                    cursor.execute(sql, params)
                    written.update(str(row[0]) for row in cursor.fetchall())
        return written

    def _row(self, run: RunRecord) -> Run:
        return Run(
            run_id=run.run_id,
            workflow_name=run.workflow_name,
            workflow_version=run.workflow_version,
            namespace=run.namespace,
            status=run.status,
            input=run.input,
            tags=stored_tags(run.user_tags, run.quota_keys),
            quota_keys=[list(q) for q in run.quota_keys],
            throttle_keys=[list(t) for t in run.throttle_keys],
            singleton_key=run.singleton_key,
            singleton_limit=run.singleton_limit,
            singleton_slot=SlotState.WAITER if run.singleton_key is not None and run.tracked else None,
            singleton_tracked=run.tracked,
            created_at=run.created_at,
            updated_at=run.updated_at,
            wake_at=run.wake_at,
            deadline_at=run.deadline_at,
            parent_run_id=run.parent_run_id,
            park_reason=run.park_reason,
            not_before=run.not_before,
            quota_slot=run.quota_slot,
            trace_parent=run.trace_parent,
            debounce_key=run.debounce_key,
            debounce_until=run.debounce_until,
            priority=run.priority,
        )

    def _insert(self, run: RunRecord) -> None:
        """Insert the run and, if it carries quotas, one membership per quota key,
        a waiter, and one per throttle key (X6), in one transaction (X3b)."""
        if not run.quota_keys and not run.throttle_keys:
            self._row(run).save(using=self.db, force_insert=True)
            return
        shares = {name: (sub_key, weight) for name, sub_key, weight in run.quota_shares}  # X4
        with transaction.atomic(using=self.db):
            tags = {
                (name, key): self._fair_tag(name, key, *shares[name], priority=run.priority)
                for name, key in run.quota_keys
                if name in shares
            }
            self._row(run).save(using=self.db, force_insert=True)
            QuotaMembership.objects.using(self.db).bulk_create(
                [
                    QuotaMembership(
                        run_id=run.run_id,
                        quota=name,
                        key=key,
                        slot=SlotState.WAITER,
                        created_at=run.created_at,
                        sub_key=shares.get(name, ("", 1))[0],
                        weight=shares.get(name, ("", 1))[1],
                        tag=tags.get((name, key), 0),
                        priority=run.priority,
                    )
                    for name, key in run.quota_keys
                ]
            )
            ThrottleMembership.objects.using(self.db).bulk_create(
                [
                    ThrottleMembership(
                        run_id=run.run_id, throttle=name, key=key, created_at=run.created_at, priority=run.priority
                    )
                    for name, key, _limit, _period in run.throttle_keys
                ]
            )

    def queue_is_deep(self, workflow_name: str, key: str, limit: int, *, priority: int = 0) -> bool:
        """Tell whether the key already has ``limit`` holders and ``limit`` waiters
        that a start of ``priority`` queues behind (a priority at least its own; S8a, X8).

        One index read of at most ``2 * limit`` rows, whatever the queue's length.
        """
        # Rows of the queue index carry a slot marker, so are tracked: such a row holds
        # its slot exactly when it is marked a holder (holds_slot, S12); read from the index alone.
        rows = list(
            self._runs()
            .for_key(workflow_name, key)
            .queue_front()
            .values_list("singleton_slot", "priority")[: 2 * limit]
        )
        holders = sum(1 for slot, _ in rows if slot == SlotState.HOLDER)
        before = sum(1 for slot, place in rows if slot == SlotState.WAITER and place >= priority)
        return holders >= limit and before >= limit

    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._runs().filter(pk=run_id).first()
        return record_of(row) if row is not None else None

    def delete_run(self, run_id: str) -> RunRecord | None:
        """Delete a run with its steps and signals; return what was deleted.

        In the lock order of every path: its quota keys' rows, the key's row
        (the release of the run's slot, F12, locks it too), then the run's row
        (X3e); its memberships go with it, which frees its quota slots (X3g).
        """
        seen = self._runs().filter(pk=run_id).values_list("workflow_name", "singleton_key", "quota_keys").first()
        if seen is None:
            return None
        with transaction.atomic(using=self.db):
            workflow_name, key, carried = seen
            self._lock_quota_keys(quota_keys_of(carried))  # the lock order (X3e)
            if key is not None:
                self.lock_key(workflow_name, key)
            row = self._runs().select_for_update().filter(pk=run_id).first()
            if row is None:
                return None
            row.delete()
            DebouncedStart.objects.using(self.db).filter(run_id=run_id).delete()  # X7c: forgotten with it
            return record_of(row)

    # -- a turn ------------------------------------------------------------------
    def _read_for_turn(self, run_id: str) -> tuple[Run | None, bool]:
        """Read the run, whether its lease expired and whether it is due (X5), on the database's clock."""
        expired = Case(
            When(lease_expires_at__lte=DbNow(), then=Value(True)), default=Value(False), output_field=BooleanField()
        )
        due = Case(When(is_due_q(DbNow()), then=Value(True)), default=Value(False), output_field=BooleanField())
        row = self._runs().filter(pk=run_id).annotate(lease_expired=expired, due=due).first()
        return row, bool(row is not None and row.lease_expired)  # type: ignore[attr-defined]

    @staticmethod
    def _as_read(row: Run) -> Q:
        """The compare of a claim: the run is still as this turn read it, its cancel
        flag included, so a cancel landing after the read is never run over (R5a, R6, S9)."""
        cas = Q(pk=row.run_id, status=row.status, attempts=row.attempts, cancel_requested=row.cancel_requested)
        if row.status == RunStatus.RUNNING:
            cas &= Q(lease_owner=row.lease_owner, lease_expires_at__lte=DbNow())
        return cas

    def begin_turn(
        self,
        run_id: str,
        owner: str,
        *,
        lease_seconds: float,
        limits: Limits,
        max_recoveries: int,
        retry: RetryPolicy,
        known: RunRecord | None = None,
        ttls: QueueTtls | None = None,
    ) -> Turn:
        """Take the lease and admit or park the run in one transaction (S4, S5, R5, R6).

        ``known`` is the run as this process just granted it (a handoff): its
        claim is then a confirmation without a first read. On PostgreSQL the
        claim is raw SQL (:meth:`_fast_turn`); the cases it leaves out take the
        ORM path below.
        """
        fast = self._fast()
        if fast is not None:
            turn = self._fast_turn(fast, run_id, owner, lease_seconds, limits, max_recoveries, retry, known, ttls)
            if turn is not None:
                return turn
        read: tuple[Run | None, bool] | None = None
        turn = None
        confirming = known is not None and (known.admitted or known.quota_slot == SlotState.HOLDER) and known.is_parked
        room = self._mysql_room() if not confirming else None  # a confirmation: _room_confirm
        if room is not None and not connections[self.db].in_atomic_block:
            claimed = self._retrying(lambda: self._room_claim(room, run_id, owner, lease_seconds, limits, retry, ttls))
            if isinstance(claimed, Turn):
                turn = claimed
            else:
                read = claimed
        lite = self._sqlite_room()
        if lite is not None:
            delays = (retry_delay(retry.seconds, retry.jitter), retry_delay(retry.backlog_seconds, retry.jitter))

            def plain() -> Turn | None:
                # The SQLite room's claim without a read first; None: it wrote nothing.
                lite_turn = self._retrying(lambda: lite.claim(run_id, owner, lease_seconds, limits, delays, ttls or {}))
                if lite_turn is not None:
                    run = lite_turn.run
                    if run is not None and run.singleton_key is not None:
                        key = run.singleton_key
                        self._retrying(lambda: lite.bump(run.workflow_name, key, (run, *lite_turn.granted)))
                return lite_turn

            throttles = any(name.startswith(THROTTLE_PREFIX) for name in limits)
            # A run this room saw start or park as a throttle carrier tries its throttled claim
            # first: the plain claim writes nothing for one (Room.expect_throttled).
            hinted = known is None and throttles and lite.expects_throttled(run_id)
            if known is None and not hinted:
                lite_turn = plain()
                if lite_turn is not None:
                    return lite_turn
            if (known is None or (known.throttle_keys and known.quota_slot == SlotState.WAITER)) and throttles:
                # A waiter that carries a throttle (also the turn a handoff sent one), in the room's
                # one transaction (X6); None: the ORM path reads and decides.
                throttled = self._retrying(
                    lambda: lite.claim_throttled(run_id, owner, lease_seconds, limits, delays, ttls or {})
                )
                if throttled is not None:
                    return throttled
            if hinted:
                lite.forget_throttled(run_id)
                lite_turn = plain()
                if lite_turn is not None:
                    return lite_turn
        if turn is None and confirming:
            assert known is not None
            turn = self._room_confirm(known, owner, lease_seconds, max_recoveries)
        if turn is None:
            turn = self._orm_turn(run_id, owner, lease_seconds, limits, max_recoveries, retry, known, ttls, read)
        if turn.state == TurnState.RUN and turn.run is not None and turn.run.step_count == 0 and not turn.recovered:
            # Claimed from a parked run (a claim of a running one is a recovery): its step count as
            # read is the one its compare-and-set met, and no step is stored without a lease (R4).
            turn = replace(turn, steps={})
        return turn

    def _room_confirm(self, known: RunRecord, owner: str, lease_seconds: float, max_recoveries: int) -> Turn | None:
        """The confirmation claim of a run a grant admitted (``known``: the run as the grant
        wrote it, parked, holding its slot) from that record, without a read, as PostgreSQL's
        fast path confirms (:meth:`pg.FastPath.take`): one compare-and-set on the record, the
        SQLite room's ``take`` or the MySQL/MariaDB room's ``ds_take_lease`` (S6, R5, R5a, R6).
        None: the ORM path confirms (another database, a room that is off or refused the
        call in a caller's transaction, or a rung other than a take: a requested cancel, a
        carrier of quotas)."""
        if turn_rung(known, expired=False, due=True, max_recoveries=max_recoveries) is not Rung.TAKE:
            return None
        holder = known.singleton_key is not None
        lite = self._sqlite_room()
        if lite is not None:
            return self._retrying(lambda: lite.take(known, owner, lease_seconds, recovered=False, holder=holder))
        room = self._mysql_room()
        if room is None:
            return None
        taken = self._retrying(
            lambda: room.take_lease(
                known, owner=owner, lease_seconds=lease_seconds, recoveries=known.recoveries, takes_slot=holder
            )
        )
        if taken is None:
            return None
        if not taken:
            return Turn(TurnState.SKIPPED, known)
        now = timezone.now()  # the record's times only: the row's lease is on the database's clock (R5)
        run = known.evolve(
            status=RunStatus.RUNNING,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            wake_at=None,
            attempts=known.attempts + 1,
            started_at=known.started_at or now,
            admitted=holder,
            tracked=known.tracked or holder,
        )
        return Turn(TurnState.RUN, run, recovered=False)

    def _room_claim(
        self,
        room: mysql.Room,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        retry: RetryPolicy,
        ttls: QueueTtls | None,
    ) -> Turn | tuple[Run | None, bool] | None:
        """The claim on MySQL/MariaDB in one CALL of ``ds_claim`` (:meth:`mysql.Room.claim`):
        a run without a key takes its lease, a tracked waiter of a declared workflow is
        admitted or parked under its key's lock, the same rules as :meth:`_admit` (S4, S5,
        S13, R5a, K1, X5); a waiter that carries quotas or throttles is admitted or parked
        under the locks of all its limits, the same rules as :meth:`_quota_turn` (X3, X6;
        parked over a throttle's rate, its turn names the throttle). Returns the turn; or
        the run as read and whether its lease expired, for the ORM path to decide the rest
        (:meth:`_orm_turn`); or None if the room is off."""
        delays = (retry_delay(retry.seconds, retry.jitter), retry_delay(retry.backlog_seconds, retry.jitter))
        claimed = room.claim(
            run_id=run_id,
            owner=owner,
            lease_seconds=lease_seconds,
            limits=limits,
            ttls=ttls or {},
            delays=delays,
            redelivery_seconds=self.redelivery_seconds,
        )
        if claimed is None:
            return None
        role, row, granted = claimed
        if row is None:
            return Turn(TurnState.SKIPPED)
        if role == "read":
            return row, bool(row.lease_expired)  # type: ignore[attr-defined]
        record = record_of(row)
        tokens = mysql.tokens_of(row)
        if tokens is not None:  # a quota waiter ds_admit_quota admitted: its token in each limit (X3f)
            record = record.evolve(quota_tokens=tokens)
        others = tuple(record_of(g) for g in granted)
        if role == "taken":
            return Turn(TurnState.RUN, record, recovered=False)
        if role == "admitted":
            return Turn(TurnState.RUN, record, recovered=False, granted=others, admitted=True)
        if role == TurnState.PARKED.value:  # the procedure names its outcomes as the turn states do
            # Parked over a throttle's rate (X6d): its park reason names the throttle.
            over = ParkReason.THROTTLED
            throttled = over.detail(record.park_reason) if over.matches(record.park_reason) else None
            return Turn(TurnState.PARKED, record, granted=others, throttled=throttled)
        return Turn(TurnState.SKIPPED, record, granted=others)  # skipped, refused: changed under the claim

    def _orm_turn(
        self,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        max_recoveries: int,
        retry: RetryPolicy,
        known: RunRecord | None,
        ttls: QueueTtls | None,
        read: tuple[Run | None, bool] | None = None,
    ) -> Turn:
        """:meth:`begin_turn` on the ORM path; ``read``: the run as a claim already read it
        (with its ``due`` annotation) and whether its lease expired, instead of a read."""
        row: Run | None
        if read is not None:
            row, expired = read
        elif known is not None and (known.admitted or known.quota_slot == SlotState.HOLDER) and known.is_parked:
            row = self._row(known)
            assert row is not None
            row.attempts, row.singleton_slot, row.fencing_token = known.attempts, SlotState.HOLDER, known.fencing_token
            row.step_count, row.started_at, row.recoveries = known.step_count, known.started_at, known.recoveries
            row.cancel_requested, row.singleton_tracked = known.cancel_requested, known.tracked
            row.due = True  # type: ignore[attr-defined]  # granted: admitted while due (X5)
            expired = False
        else:
            row, expired = self._read_for_turn(run_id)
        if row is None:
            return Turn(TurnState.SKIPPED)
        record = record_of(row)
        rung = turn_rung(record, expired=expired, due=bool(row.due), max_recoveries=max_recoveries)  # type: ignore[attr-defined]
        if rung is Rung.SKIP:
            return Turn(TurnState.SKIPPED, record)
        recovered = row.status == RunStatus.RUNNING
        if rung is Rung.CANCEL or rung is Rung.DEAD:
            if rung is Rung.CANCEL:
                # A timeout the tick asked a crashed holder to stop for is a timeout (D5): the
                # deadline judged on the database's clock (R5).
                deadline = row.deadline_at
                error = cancel_error(deadline, self.now()) if deadline is not None else dict(CANCELLED_ERROR)
                status, settled = RunStatus.CANCELLED, record
            else:
                # The expired lease counts as one more recovery, then the run is dead (D4).
                status, settled = RunStatus.DEAD, record.evolve(recoveries=row.recoveries + 1)
                error = {"code": "max_recoveries", "message": f"lease expired {row.recoveries + 1} times"}
            done = self._finish(
                settled, self._as_read(row), status, None, error, limits, recovered=rung is Rung.DEAD, ttls=ttls
            )
            return Turn(
                TurnState.SETTLED if done.settled else TurnState.SKIPPED, done.run or record, granted=done.granted
            )
        if rung is Rung.NOT_DUE:
            # A delayed start before its time (X5): no claim; the tick sends it at not_before.
            self._runs().filter(self._as_read(row)).update(wake_at=F("not_before"), updated_at=DbNow())
            return Turn(TurnState.SKIPPED, record.evolve(wake_at=row.not_before))
        take = {
            "status": RunStatus.RUNNING,
            "lease_owner": owner,
            "lease_expires_at": db_now_plus(lease_seconds),
            "wake_at": None,
            "attempts": row.attempts + 1,
            "recoveries": row.recoveries + (1 if recovered else 0),
            "started_at": Coalesce(F("started_at"), DbNow()),
            "updated_at": DbNow(),
        }
        now = timezone.now()
        taken = record.evolve(
            status=RunStatus.RUNNING,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            wake_at=None,
            attempts=row.attempts + 1,
            recoveries=row.recoveries + (1 if recovered else 0),
            started_at=row.started_at or now,
        )
        if rung is Rung.LIMITS:
            # It carries quotas: admitted, confirmed or recovered under the locks of all its limits (X3).
            return self._retrying(
                lambda: self._quota_turn(
                    row, record, taken, take, recovered, limits, retry, ttls, owner=owner, lease_seconds=lease_seconds
                )
            )
        if rung is Rung.ADMIT:
            return self._retrying(lambda: self._admit(row, record, taken, take, recovered, limits, retry, ttls))
        # Rung.TAKE or TAKE_OVER: no admission needed, a plain run or a holder's confirmation (S6).
        if row.singleton_key is not None:
            take.update(singleton_slot=SlotState.HOLDER, singleton_tracked=True)
        if rung is Rung.TAKE_OVER:
            return self._retrying(lambda: self._take_over(row, record, taken, take))
        room = self._sqlite_room()
        if room is not None:
            # One compare-and-set that returns the run as written (the SQLite room).
            holder = row.singleton_key is not None
            return self._retrying(lambda: room.take(record, owner, lease_seconds, recovered=recovered, holder=holder))
        if not self._retrying(lambda: self._take_lease(row, take, owner, lease_seconds)):
            return Turn(TurnState.SKIPPED, record)
        return Turn(TurnState.RUN, taken.evolve(admitted=row.singleton_key is not None), recovered=recovered)

    def _fast_turn(
        self,
        fast: pg.FastPath,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        max_recoveries: int,
        retry: RetryPolicy,
        known: RunRecord | None,
        ttls: QueueTtls | None = None,
    ) -> Turn | None:
        """The claim in raw SQL: one read, then one compare-and-set (a run without a
        key, a holder's confirmation) or one admission message (a tracked waiter of
        a workflow this process declares), the same rules as the ORM path (S4, S5,
        S6, R5a, R6). None: the ORM path decides (a requested cancel, a recovery of
        a holder or past ``max_recoveries``, an untracked run of an older release,
        a workflow this process does not declare, a claimant changed under us)."""
        delays = (retry_delay(retry.seconds, retry.jitter), retry_delay(retry.backlog_seconds, retry.jitter))
        if known is not None and (known.admitted or known.quota_slot == SlotState.HOLDER) and known.is_parked:
            run: RunRecord | None = known
            expired, due = False, True  # granted: admitted while due (X5)
        else:
            # A waiter's first turn is admitted in the same message as the read (4 round trips a
            # run on an idle key become 3); for any other run the message is the read alone.
            admitted, (run, expired, due) = self._retrying(
                lambda: self._fast_claim(fast, run_id, owner, lease_seconds, limits, delays, ttls or {})
            )
            if admitted is not None:
                return admitted
        rung = turn_rung(run, expired=expired, due=due, max_recoveries=max_recoveries)
        if run is None:
            return Turn(TurnState.SKIPPED)
        if rung is Rung.SKIP:
            return Turn(TurnState.SKIPPED, run)
        recovered = run.status == RunStatus.RUNNING
        if rung in (Rung.CANCEL, Rung.DEAD, Rung.NOT_DUE, Rung.TAKE_OVER):
            # A settle, a delayed start's wake_at (X5), a new token from the key's counter (K1):
            # the ORM path carries them out.
            return None
        if rung is Rung.LIMITS:
            if not run.quota_keys:
                # A carrier an older release inserted without quota_keys: the ORM path reads its memberships (X3b).
                return None
            if run.quota_slot == SlotState.HOLDER and not recovered:
                # A quota holder's confirmation: one compare-and-set that returns its quota tokens (X3f).
                holder = run.singleton_key is not None
                return fast.take(run, owner, lease_seconds, recovered=False, holder=holder, quotas=True)
            # The claim message did not admit it (a quota waiter is admitted there, under the locks
            # of all its limits): a recovery, or a run that changed between the message's
            # statements: the ORM path (X3i).
            return None
        if rung is Rung.TAKE:
            return fast.take(run, owner, lease_seconds, recovered=recovered, holder=run.singleton_key is not None)
        if recovered or not run.tracked or run.workflow_name not in limits:
            return None  # Rung.ADMIT of a run this path does not admit: the ORM path
        ttl = (ttls or {}).get(run.workflow_name)
        return self._retrying(lambda: fast.admit(run, owner, lease_seconds, limits, delays, ttl))

    def _fast_claim(
        self,
        fast: pg.FastPath,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Limits,
        delays: tuple[float, float],
        ttls: QueueTtls,
    ) -> tuple[Turn | None, tuple[RunRecord | None, bool, bool]]:
        """The fast path's first message of a turn (:meth:`pg.FastPath.claim`): a
        candidate waiter's admission and the read that :meth:`_read_for_turn` is
        the ORM path's twin of (the run, whether its lease expired and whether it
        is due, X5, on the database's clock)."""
        return fast.claim(run_id, owner, lease_seconds, limits, delays, ttls)

    def _lock_run(self, run_id: str) -> None:
        """Lock the run's row before the write that starts its lease, in the
        caller's transaction, after its key's lock (S13) (R5): a write that waits
        for a row another transaction holds is judged on the clock of its
        statement's start (PostgreSQL's statement timestamp, MariaDB's
        ``UTC_TIMESTAMP``), so a lease written by it would come short by the wait;
        written after this lock, it is whole. SQLite has no row locks: its
        ``BEGIN IMMEDIATE`` (check E010) takes the write lock first, and nothing
        is sent here."""
        if connections[self.db].features.has_select_for_update:
            list(self._runs().select_for_update().filter(pk=run_id).values_list("pk", flat=True))

    def _take_lease(self, row: Run, take: dict[str, Any], owner: str, lease_seconds: float) -> int:
        """Take the lease of a run without a key or of a holder: one
        compare-and-set on the row as read, after its row lock (R5, R5a, S6).
        On MySQL/MariaDB with the room's procedures, one CALL of ``ds_take_lease``
        (:mod:`durable_singleton.stores.mysql`), the same lock and compare."""
        room = self._mysql_room()
        if room is not None and not connections[self.db].in_atomic_block:
            taken = room.take_lease(
                row,
                owner=owner,
                lease_seconds=lease_seconds,
                recoveries=take["recoveries"],
                takes_slot="singleton_slot" in take,
            )
            if taken is not None:
                return int(taken)
        with transaction.atomic(using=self.db):
            self._lock_run(row.run_id)
            return self._runs().filter(self._as_read(row)).update(**take)

    def _take_over(self, row: Run, record: RunRecord, taken: RunRecord, take: dict[str, Any]) -> Turn:
        """Recover a holder whose lease expired, with a new token from its key's counter (K1, R5).

        The stalled executor may still wake up and write to an external system
        with the token it was given: the takeover's token is larger, so a
        system that keeps the highest token seen refuses the stale write.
        """
        assert row.singleton_key is not None
        with transaction.atomic(using=self.db):
            key_row = self.lock_key(row.workflow_name, row.singleton_key)
            self._lock_run(row.run_id)
            token = key_row["last_token"] + 1
            if not self._runs().filter(self._as_read(row)).update(**take, fencing_token=token):
                return Turn(TurnState.SKIPPED, record)
            SingletonKey.objects.using(self.db).filter(pk=key_row["pk"]).update(last_token=token)
        return Turn(TurnState.RUN, taken.evolve(admitted=True, tracked=True, fencing_token=token), recovered=True)

    def _admit(
        self,
        row: Run,
        record: RunRecord,
        taken: RunRecord,
        take: dict[str, Any],
        recovered: bool,
        limits: Limits,
        retry: RetryPolicy,
        ttls: QueueTtls | None = None,
    ) -> Turn:
        """Admit or park a waiter, under its key's lock (S5, S9, S12, K1); a
        claimant past its ``queue_ttl`` in ``ttls`` is parked, never admitted (X2)."""
        assert row.singleton_key is not None
        take = dict(take)  # a retried transaction starts from the claim as read, never a stale token
        runs = self._runs()
        with transaction.atomic(using=self.db):
            key_row = self.lock_key(row.workflow_name, row.singleton_key)
            self._lock_run(row.run_id)
            # A run of an older release that never ran joins the queue (S12).
            if not row.singleton_tracked and not runs.filter(self._as_read(row)).update(
                singleton_slot=SlotState.WAITER, singleton_tracked=True
            ):
                return Turn(TurnState.SKIPPED, record)
            granted, front, token, holder = self._grant(
                row.workflow_name, row.singleton_key, key_row, limits, claimant=row.run_id, ttls=ttls
            )
            if holder is not None:
                # Another claim granted this run its slot meanwhile: this claim is a confirmation (S6).
                take.update(attempts=holder.attempts + 1, recoveries=holder.recoveries)
                if holder.status == RunStatus.RUNNING or not runs.filter(self._as_read(holder)).update(**take):
                    return Turn(TurnState.SKIPPED, record, granted=tuple(granted))
                run = record_of(holder).evolve(
                    status=RunStatus.RUNNING,
                    lease_owner=taken.lease_owner,
                    lease_expires_at=taken.lease_expires_at,
                    wake_at=None,
                    attempts=holder.attempts + 1,
                    started_at=holder.started_at or taken.started_at,
                )
                return Turn(TurnState.RUN, run, recovered=False, granted=tuple(granted))
            if token:
                take.update(
                    singleton_slot=SlotState.HOLDER, singleton_tracked=True, fencing_token=token, admitted_at=DbNow()
                )
                if runs.filter(self._as_read(row), singleton_slot=SlotState.WAITER, cancel_requested=False).update(
                    **take
                ):
                    run = taken.evolve(admitted=True, tracked=True, fencing_token=token, admitted_at=timezone.now())
                    return Turn(TurnState.RUN, run, recovered=recovered, granted=tuple(granted), admitted=True)
                transaction.set_rollback(True, using=self.db)  # changed under us: grant nothing (R5a)
                return Turn(TurnState.SKIPPED, record)
            delay = retry.seconds if front is not None else retry.backlog_seconds
            parked = self._park_waiter(row, delay, retry, singleton_slot=SlotState.WAITER)
            return Turn(TurnState.PARKED if parked else TurnState.SKIPPED, record, granted=tuple(granted))

    def _park_waiter(self, row: Run, seconds: float, retry: RetryPolicy, **waits: Any) -> bool:
        """Park a denied waiter with its retry ``wake_at``, inside the claim (S5 step 5):
        a compare-and-set on the run as read and on ``waits``, the markers that make it a
        waiter (``singleton_slot`` or ``quota_slot``, ``"waiter"``): a claim that read
        the run before a handoff admitted it leaves the new holder alone (R5a, X3h)."""
        return bool(
            self._runs()
            .filter(self._as_read(row), cancel_requested=False, **waits)
            .update(
                status=RunStatus.SUSPENDED,
                attempts=row.attempts + 1,
                wake_at=db_now_plus(retry_delay(seconds, retry.jitter)),
                lease_owner=None,
                lease_expires_at=None,
                park_reason=ParkReason.SINGLETON,
                updated_at=DbNow(),
            )
        )

    # -- shared quotas (X3) ---------------------------------------------------------
    def _lock_quota_keys(self, quota_keys: Iterable[tuple[str, str]]) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        """Lock the rows of the quota keys ``quota_keys`` ((name, key) pairs) in
        the one global order, sorted by (name, key), before any singleton key
        and any run row: no two claims wait on each other (X3e, S13). Must run
        inside a transaction; returns ((name, key), key row) pairs in that order."""
        return [((name, key), self.lock_key(quota_lock_name(name), key)) for name, key in sorted(set(quota_keys))]

    def _quota_front(
        self, name: str, key: str, key_row: Mapping[str, Any], limits: Limits, ttls: QueueTtls | None = None
    ) -> tuple[int, list[str]]:
        """Read a locked quota key's free slots and its first due waiters' run
        ids in admission order, as many as its limit (X3c, X3d, X4, X8): by
        :data:`~durable_singleton.admission.QUOTA_ORDER` (``tag``, then the higher
        priority, then oldest), by priority then oldest in a quota without
        ``fair_key`` (:func:`~durable_singleton.admission.fair_tag`).
        The limit in force is the declared one in ``limits`` under
        ``quota:<name>`` (1 if this process does not declare it) or the key's
        runtime override (K2); a paused key has no free slot. A waiter past its
        workflow's ``queue_ttl`` in ``ttls`` is not among them (X2)."""
        limit = limit_in_force(declared_limit(limits, quota_lock_name(name), (1,)), key_row["limit_override"])
        members = QuotaMembership.objects.using(self.db).filter(quota=name, key=key)
        holders = self._locking(members.filter(holds_quota_slot_q())).count()
        queue = members.filter(quota_waiter_q(DbNow(), ttls)).order_by(*QUOTA_ORDER)
        waiters = [str(r) for r in self._locking(queue).values_list("run_id", flat=True)[:limit]]
        return free_slots(limit, holders, paused=bool(key_row["paused"])), waiters

    def _fair_tag(self, name: str, key: str, sub_key: str, weight: int, *, priority: int = 0) -> int:
        """The tag of a new member of priority ``priority`` in a fair quota key
        (:func:`~durable_singleton.admission.fair_place`, X4b, X8c): two probes, of
        ``ds_quota_order_idx`` (the holders' largest tag) and ``ds_quota_fair_idx`` (the
        sub-key's), without locks; and, when its sub-key has waiters of a lower priority,
        under the quota key's lock (the lock order, X3e: a fair quota is its run's only
        limit, X4d), the read of their tags and their move one turn later."""
        members = QuotaMembership.objects.using(self.db).filter(quota=name, key=key)
        lower = members.filter(sub_key=sub_key, slot=SlotState.WAITER, priority__lt=priority)
        passed: list[int] = []
        if lower.exists():
            self.lock_key(quota_lock_name(name), key)
            passed = list(self._locking(lower).values_list("tag", flat=True))
        virtual = members.filter(slot=SlotState.HOLDER).order_by("-tag").values_list("tag", flat=True).first()
        last = (
            members.filter(sub_key=sub_key, slot__isnull=False).order_by("-tag").values_list("tag", flat=True).first()
        )
        tag, shift = fair_place(virtual or 0, last, weight, passed)
        if shift:
            lower.update(tag=F("tag") + shift)
        return tag

    def _quota_turns(
        self,
        quota_rows: Sequence[tuple[tuple[str, str], Mapping[str, Any]]],
        limits: Limits,
        exclude: set[str],
        ttls: QueueTtls | None = None,
    ) -> list[RunRecord]:
        """Return the waiters within the free slots of the locked quota keys
        ``quota_rows``, as read (not admitted): each is sent a turn, and its
        own claim decides under the locks of all its limits (X3g, X3h)."""
        ids: list[str] = []
        for (name, key), key_row in quota_rows:
            free, waiters = self._quota_front(name, key, key_row, limits, ttls)
            ids.extend(i for i in waiters[:free] if i not in exclude and i not in ids)
        return self._quota_records(ids)

    def _handoff_carriers(
        self, run: RunRecord, fronts: Mapping[tuple[str, str], tuple[int, list[str]]]
    ) -> dict[str, _Carrier]:
        """The waiters that carry quotas a handoff of ``run`` admits, under the locks of
        the quota keys ``fronts`` (their free slots and first waiters, read under the locks)
        (X3h, :func:`~durable_singleton.admission.handoff_admits`): parked, not cancelled,
        and without a singleton key or with ``run``'s own (its grant then decides). Returns
        a :class:`_Carrier` by run id: the run as read and its place in each quota key."""
        ids = {i for free, waiters in fronts.values() for i in waiters[:free]}
        if not ids:
            return {}
        carried: dict[str, set[tuple[str, str]]] = {}
        members = QuotaMembership.objects.using(self.db).filter(run_id__in=ids)
        for run_id, name, key in members.values_list("run_id", "quota", "key"):
            carried.setdefault(str(run_id), set()).add((name, key))
        places = handoff_admits(fronts, lambda run_id: carried.get(run_id, ()))
        rows = self._runs().filter(
            pk__in=list(places), status__in=PARKED_STATUSES, cancel_requested=False, quota_slot=SlotState.WAITER
        )
        return {
            row.run_id: _Carrier(row, places[row.run_id])
            for row in rows
            # A throttle carrier is admitted by its own claim only, which records the admission (X6).
            if not row.throttle_keys
            and (
                row.singleton_key is None
                or (row.workflow_name, row.singleton_key) == (run.workflow_name, run.singleton_key)
            )
        }

    def _admit_carriers(self, carriers: Sequence[_Carrier]) -> list[RunRecord]:
        """Admit the waiters ``carriers`` without a singleton key that a handoff admits
        (X3h): each a compare-and-set on the waiter as read that takes its quota slot,
        with a turn due after the redelivery window, as a grant (S7a)."""
        admitted: list[RunRecord] = []
        for carrier in carriers:
            row = carrier.row
            if (
                self._runs()
                .filter(pk=row.run_id, status=row.status, quota_slot=SlotState.WAITER, cancel_requested=False)
                .update(
                    quota_slot=SlotState.HOLDER,
                    admitted_at=DbNow(),
                    wake_at=db_now_plus(self.redelivery_seconds),
                    updated_at=DbNow(),
                )
            ):
                admitted.append(record_of(row).evolve(quota_slot=SlotState.HOLDER, admitted_at=timezone.now()))
        return admitted

    def _hand_quota_tokens(
        self,
        granted: list[RunRecord],
        carriers: Mapping[str, _Carrier],
        quota_rows: Sequence[tuple[tuple[str, str], Mapping[str, Any]]],
    ) -> list[RunRecord]:
        """Give each waiter that carries quotas a handoff admitted (in ``granted``) a slot
        and the next token of each of its quota keys, in its place's order there, under
        the keys' locks (X3c, X3f, K1); return ``granted`` with their tokens."""
        admitted = {g.run_id for g in granted if g.run_id in carriers and g.quota_slot == SlotState.HOLDER}
        if not admitted:
            return granted
        tokens: dict[str, dict[str, int]] = {run_id: {} for run_id in admitted}
        members = QuotaMembership.objects.using(self.db)
        for (name, key), key_row in quota_rows:
            places = {r: carriers[r].places[(name, key)] for r in admitted if (name, key) in carriers[r].places}
            token = key_row["last_token"]
            for run_id in sorted(places, key=places.__getitem__):
                token += 1
                tokens[run_id][name] = token
                members.filter(run_id=run_id, quota=name).update(slot=SlotState.HOLDER, fencing_token=token)
            if token != key_row["last_token"]:
                SingletonKey.objects.using(self.db).filter(pk=key_row["pk"]).update(last_token=token)
        return [
            g.evolve(quota_tokens=tuple(sorted(tokens[g.run_id].items()))) if g.run_id in admitted else g
            for g in granted
        ]

    def _quota_records(self, ids: Sequence[str]) -> list[RunRecord]:
        """The runs ``ids`` as stored, in that order (one read; none for no id)."""
        if not ids:
            return []
        rows = {r.run_id: r for r in self._runs().filter(pk__in=ids)}
        return [record_of(rows[i]) for i in ids if i in rows]

    def _quota_turn(
        self,
        row: Run,
        record: RunRecord,
        taken: RunRecord,
        take: dict[str, Any],
        recovered: bool,
        limits: Limits,
        retry: RetryPolicy,
        ttls: QueueTtls | None = None,
        *,
        owner: str = "",
        lease_seconds: float = 0.0,
    ) -> Turn:
        """Admit, confirm, recover or park a run that carries quotas, in one
        transaction under the locks of all its limits: its quota keys sorted,
        its singleton key, then its row (X3d, X3e, S13).

        A holder's claim is a compare-and-set (a recovery takes a new token in
        every limit, K1, X3f). A waiter is admitted only if it is within the
        free slots of each of its quota keys, oldest first (X3d), and its
        singleton key's grant admits it (S5); then it takes a slot and a
        fencing token in every limit in the same transaction (X3c, X3f). Else
        it is parked: with the front delay if it is within the first ``limit``
        waiters of each quota key, else the backlog delay (S5 step 5).
        ``owner`` and ``lease_seconds`` (the lease ``take`` writes) let a holder's
        confirmation on MySQL/MariaDB be one CALL (``ds_take_quota_lease``).
        """
        take = dict(take)  # a retried transaction starts from the claim as read
        runs = self._runs()
        memberships = QuotaMembership.objects.using(self.db).filter(run_id=row.run_id)
        keyed = row.singleton_key is not None
        if keyed:
            take.update(singleton_slot=SlotState.HOLDER, singleton_tracked=True)
        if row.quota_slot == SlotState.HOLDER and not recovered:
            # A holder's confirmation (a run a handoff admitted, or one parked with its slots):
            # one compare-and-set on the run as read, after its row lock, with no key's lock:
            # its memberships change only by a recovery, which changes the run's attempts
            # first, so the compare refuses this claim (R5a, X3f), as pg.TAKE_QUOTA. On
            # MySQL/MariaDB one CALL of ds_take_quota_lease (sql/mysql/quota.sql).
            room = self._mysql_room() if owner and not connections[self.db].in_atomic_block else None
            taken_tokens = (
                room.take_quota_lease(
                    run_id=row.run_id,
                    status=row.status,
                    attempts=row.attempts,
                    cancel_requested=row.cancel_requested,
                    owner=owner,
                    lease_seconds=lease_seconds,
                    takes_slot=keyed,
                )
                if room is not None
                else None
            )
            if taken_tokens is False:
                return Turn(TurnState.SKIPPED, record)
            if isinstance(taken_tokens, dict):
                return Turn(
                    TurnState.RUN,
                    taken.evolve(admitted=keyed, tracked=keyed, quota_tokens=tuple(sorted(taken_tokens.items()))),
                )
            with transaction.atomic(using=self.db):
                self._lock_run(row.run_id)
                if not runs.filter(self._as_read(row), quota_slot=SlotState.HOLDER).update(**take):
                    return Turn(TurnState.SKIPPED, record)
                tokens = {q: int(t or 0) for q, t in memberships.values_list("quota", "fencing_token")}
            return Turn(
                TurnState.RUN, taken.evolve(admitted=keyed, tracked=keyed, quota_tokens=tuple(sorted(tokens.items())))
            )
        with transaction.atomic(using=self.db):
            # Its throttle keys first (only a claim locks them), then its quota keys and its
            # singleton key: the lock order (X3e, X6).
            throttle_rows = self._lock_throttle_keys(record.throttle_keys)
            quota_rows = self._lock_quota_keys(record.quota_keys)
            key_row = self.lock_key(row.workflow_name, row.singleton_key) if row.singleton_key is not None else None
            self._lock_run(row.run_id)
            if row.quota_slot == SlotState.HOLDER:
                # A takeover of a holder: a new token in every limit it holds (K1, X3f).
                token = None
                if key_row is not None:
                    token = key_row["last_token"] + 1
                    take["fencing_token"] = token
                if not runs.filter(self._as_read(row), quota_slot=SlotState.HOLDER).update(**take):
                    return Turn(TurnState.SKIPPED, record)
                if key_row is not None:
                    SingletonKey.objects.using(self.db).filter(pk=key_row["pk"]).update(last_token=token)
                tokens = self._take_quota_tokens(memberships, quota_rows)
                run = taken.evolve(admitted=keyed, tracked=keyed, quota_tokens=tuple(sorted(tokens.items())))
                return Turn(
                    TurnState.RUN, run if token is None else run.evolve(fencing_token=token), recovered=recovered
                )
            fronts = [self._quota_front(name, key, key_row_q, limits, ttls) for (name, key), key_row_q in quota_rows]
            reaches = all(quota_front_reaches(row.run_id, waiters, free) for free, waiters in fronts)
            at_front = all(row.run_id in waiters for _, waiters in fronts)
            now = database_now(self.db) if throttle_rows else None
            throttled = [self._throttle_front(t, key_row_t, limits, now, ttls) for t, key_row_t in throttle_rows]
            # Every throttle key must have room and reach it, oldest first (X6, X3d).
            reaches = reaches and all(quota_front_reaches(row.run_id, waiters, free) for free, waiters, _ in throttled)
            at_front = at_front and all(row.run_id in waiters for _, waiters, _ in throttled)
            # The throttle keys that do not reach it: it waits for their openings (X6d).
            opens = [
                (opening, t[0])
                for (t, _), (free, waiters, opening) in zip(throttle_rows, throttled, strict=True)
                if opening is not None and not quota_front_reaches(row.run_id, waiters, free)
            ]
            granted: list[RunRecord] = []
            token = 0
            if reaches and key_row is not None:
                assert row.singleton_key is not None
                granted, front, token, _ = self._grant(
                    row.workflow_name, row.singleton_key, key_row, limits, claimant=row.run_id, ttls=ttls
                )
                reaches = bool(token)
                at_front = front is not None
            if reaches:
                # A throttled admission's time is the one its throttle keys record (X6).
                take.update(quota_slot=SlotState.HOLDER, admitted_at=now if now is not None else DbNow())
                if token:
                    take["fencing_token"] = token
                if not runs.filter(self._as_read(row), quota_slot=SlotState.WAITER, cancel_requested=False).update(
                    **take
                ):
                    transaction.set_rollback(True, using=self.db)  # changed under us: grant nothing (R5a)
                    return Turn(TurnState.SKIPPED, record)
                tokens = self._take_quota_tokens(memberships, quota_rows)
                if throttle_rows:
                    assert now is not None
                    # The admission counts in each throttle key's window from now on (X6).
                    ThrottleAdmission.objects.using(self.db).bulk_create(
                        [
                            ThrottleAdmission(throttle=name, key=key, run_id=row.run_id, admitted_at=now)
                            for (name, key, _limit, _period), _row in throttle_rows
                        ]
                    )
                run = taken.evolve(
                    admitted=keyed,
                    tracked=keyed,
                    quota_tokens=tuple(sorted(tokens.items())),
                    quota_slot=SlotState.HOLDER,
                    fencing_token=token or None,
                    admitted_at=timezone.now(),
                )
                others = [g for g in granted if g.run_id != row.run_id]
                # Waiters it no longer blocks, within its quota keys' free slots, get their turn
                # (X3d): each key's front as read above, less the claimant and the slot it took.
                exclude = {row.run_id, *(g.run_id for g in others)}
                ids: list[str] = []
                for free, waiters in [*fronts, *((f, w) for f, w, _ in throttled)]:
                    behind = [i for i in waiters if i != row.run_id][: max(free - 1, 0)]
                    ids.extend(i for i in behind if i not in exclude and i not in ids)
                others += self._quota_records(ids)
                return Turn(TurnState.RUN, run, recovered=recovered, granted=tuple(others), admitted=True)
            if opens:
                # Over the rate: not due until the window lets it in, so it blocks no waiter of
                # its other limits meanwhile (X5), and the tick sends it then (X6, S8).
                opening, name = max(opens)
                parked = self._park_throttled(row, opening, name)
                if not parked:
                    return Turn(TurnState.SKIPPED, record, granted=tuple(granted))
                at = record.evolve(
                    status=RunStatus.SUSPENDED,
                    wake_at=opening,
                    not_before=opening,
                    park_reason=ParkReason.THROTTLED.of(name),
                )
                return Turn(TurnState.PARKED, at, granted=tuple(granted), throttled=name)
            delay = retry.seconds if at_front else retry.backlog_seconds
            parked = self._park_waiter(row, delay, retry, quota_slot=SlotState.WAITER)
            return Turn(TurnState.PARKED if parked else TurnState.SKIPPED, record, granted=tuple(granted))

    # -- throttles (X6) ------------------------------------------------------------
    def _lock_throttle_keys(
        self, throttle_keys: Iterable[tuple[str, str, int, float]]
    ) -> list[tuple[tuple[str, str, int, float], dict[str, Any]]]:
        """Lock the rows of the throttle keys ``throttle_keys`` in the one global order,
        sorted by (name, key), before any quota key, singleton key and run row: only a
        claim locks them, so no transaction waits for a throttle key while holding
        another limit's lock (X3e, X6, S13). Returns (throttle key, key row) pairs."""
        return [
            ((name, key, limit, period), self.lock_key(throttle_lock_name(name), key))
            for name, key, limit, period in sorted(set(throttle_keys))
        ]

    def _throttle_front(
        self,
        throttle: tuple[str, str, int, float],
        key_row: Mapping[str, Any],
        limits: Limits,
        now: datetime | None,
        ttls: QueueTtls | None,
    ) -> tuple[int, list[str], datetime | None]:
        """Read a locked throttle key's free admissions at ``now`` (the database's
        clock), its first due waiters in admission order (as many as its limit) and,
        when it is full, its window's opening (:func:`~durable_singleton.admission.throttle_room`,
        X6). The limit in force: the declared one in ``limits`` under ``throttle:<name>``,
        else the one the run's start recorded, or the key's override (K2). At most
        ``limit`` admission rows are read: the newest in the window."""
        assert now is not None
        name, key, declared, period = throttle
        limit = limit_in_force(declared_limit(limits, throttle_lock_name(name), [declared]), key_row["limit_override"])
        window = ThrottleAdmission.objects.using(self.db).filter(
            throttle=name, key=key, admitted_at__gt=now - timedelta(seconds=period)
        )
        newest = list(window.order_by("-admitted_at").values_list("admitted_at", flat=True)[:limit])
        free, opening = throttle_room(limit, [_aware(a) for a in newest], period, now, paused=bool(key_row["paused"]))
        members = ThrottleMembership.objects.using(self.db).filter(throttle=name, key=key)
        queue = members.filter(throttle_waiter_q(DbNow(), ttls)).order_by(*QUEUE_ORDER)  # X6c, X8a
        waiters = [str(r) for r in queue.values_list("run_id", flat=True)[:limit]]
        return free, waiters, opening

    def _park_throttled(self, row: Run, opening: datetime, throttle: str) -> bool:
        """Park an over-rate waiter until the window of its throttle named ``throttle``
        opens (X6d): its park reason ``throttled:<name>``, its
        ``not_before`` and ``wake_at`` at ``opening`` (a time on the database's clock),
        so every queue skips it until then (X5) and the tick sends its turn then, no
        poll (S8); a compare-and-set on the run as read (R5a)."""
        return bool(
            self._runs()
            .filter(self._as_read(row), cancel_requested=False, quota_slot=SlotState.WAITER)
            .update(
                status=RunStatus.SUSPENDED,
                attempts=row.attempts + 1,
                wake_at=opening,
                not_before=opening,
                lease_owner=None,
                lease_expires_at=None,
                park_reason=ParkReason.THROTTLED.of(throttle),
                updated_at=DbNow(),
            )
        )

    def wake_throttled(self, name: str, key: str, limit: int, *, retrying: bool = True) -> tuple[RunRecord, ...]:
        """:meth:`BaseStore.wake_throttled`: two reads of the key's parked memberships in the
        queue order (``admission.QUEUE_ORDER``, ``ds_throttle_order_idx``), the first
        over the rate and every one on its retry delay, and two conditional updates on
        the database's clock (R5)."""
        waiting = Q(quota_slot=SlotState.WAITER, status__in=PARKED_STATUSES, cancel_requested=False)
        over_rate = waiting & Q(park_reason__startswith=ParkReason.THROTTLED.value)
        on_delay = (
            waiting & Q(park_reason=ParkReason.SINGLETON) & (Q(not_before__isnull=True) | Q(not_before__lte=DbNow()))
        )
        members = ThrottleMembership.objects.using(self.db).filter(throttle=name, key=key)
        place = ("priority", "created_at", "run_id")
        first = members.filter(run__in=self._runs().filter(over_rate)).order_by(*QUEUE_ORDER).values_list(*place)
        every = (
            members.filter(run__in=self._runs().filter(on_delay)).order_by(*QUEUE_ORDER).values_list(*place)
            if retrying
            else []
        )
        found = sorted(queue_place(p, _aware(c), str(r)) for p, c, r in [*first[:limit], *every])
        ids = [run_id for _, _, run_id in found]
        if not ids:
            return ()
        self._runs().filter(over_rate, pk__in=ids).update(not_before=DbNow(), wake_at=DbNow(), updated_at=DbNow())
        if retrying:
            self._runs().filter(on_delay, pk__in=ids).update(wake_at=DbNow(), updated_at=DbNow())
        return tuple(self._quota_records(ids))  # a turn sent to one changed meanwhile is skipped (R6)

    def throttle_state(self, name: str, key: str, period: float) -> tuple[int, datetime | None]:
        """:meth:`BaseStore.throttle_state`: a count on ``ds_throttle_window_idx``, no lock."""
        window = ThrottleAdmission.objects.using(self.db).filter(
            throttle=name, key=key, admitted_at__gt=self.now() - timedelta(seconds=period)
        )
        oldest = window.order_by("admitted_at").values_list("admitted_at", flat=True).first()
        return window.count(), (_aware(oldest) + timedelta(seconds=period)) if oldest is not None else None

    def prune_throttle_admissions(self, periods: Mapping[str, float], batch: int) -> int:
        """:meth:`BaseStore.prune_throttle_admissions`: per throttle key with rows older
        than its period (found without a lock), one transaction that takes the key's lock
        as every claim of it does (X6c), reads the database's clock after it and deletes
        the rows older than the period by that clock (X6, X6b, R5). A claim reads its clock
        after the same lock and counts its window before it commits: unlocked, a prune whose
        clock read came after a claim's could delete, between that claim's clock read and its
        count, an admission its window still held, and the claim admitted one over the limit."""
        deleted = 0
        admissions = ThrottleAdmission.objects.using(self.db)
        seen = self.now()
        for name, period in sorted(periods.items()):
            if deleted >= batch:
                break
            stale_keys = (
                admissions.filter(throttle=name, admitted_at__lte=seen - timedelta(seconds=period))
                .order_by("key")
                .values_list("key", flat=True)
                .distinct()[: batch - deleted]
            )
            for key in list(stale_keys):
                if deleted >= batch:
                    break

                def prune_key(
                    name: str = name, key: str = key, period: float = period, room: int = batch - deleted
                ) -> int:
                    with transaction.atomic(using=self.db):
                        self.lock_key(THROTTLE_PREFIX + name, key)
                        now = database_now(self.db)  # after the lock, as a claim reads it (R5)
                        cutoff = now - timedelta(seconds=period)
                        stale = admissions.filter(throttle=name, key=key, admitted_at__lte=cutoff)
                        ids = list(stale.order_by("admitted_at").values_list("pk", flat=True)[:room])
                        return admissions.filter(pk__in=ids).delete()[0] if ids else 0

                deleted += self._retrying(prune_key)
        return deleted

    def _take_quota_tokens(
        self, memberships: Any, quota_rows: Sequence[tuple[tuple[str, str], Mapping[str, Any]]]
    ) -> dict[str, int]:
        """Mark every membership of the run a holder with a new fencing token
        from its quota key's counter, under the keys' locks (X3c, X3f, K1);
        return the tokens by quota name."""
        tokens: dict[str, int] = {}
        for (name, _key), key_row in quota_rows:
            token = tokens[name] = key_row["last_token"] + 1
            memberships.filter(quota=name).update(slot=SlotState.HOLDER, fencing_token=token)
            SingletonKey.objects.using(self.db).filter(pk=key_row["pk"]).update(last_token=token)
        return tokens

    def quota_queue(self, name: str, key: str, run_id: str) -> tuple[int | None, int, list[str]]:
        """:meth:`BaseStore.quota_queue`: counts on ``ds_quota_order_idx``, without
        locks, whatever the queue's length; at most 20 holders named (X3, K3)."""
        members = QuotaMembership.objects.using(self.db).filter(quota=name, key=key)
        holders = [str(r) for r in members.filter(holds_quota_slot_q()).values_list("run_id", flat=True)[:20]]
        queue = members.filter(quota_waiter_q(DbNow()))
        fields = [f.lstrip("-") for f in QUOTA_ORDER]
        mine = queue.filter(run_id=run_id).values(*fields).first()
        position = None
        if mine is not None:
            position = queue.filter(ahead_q(QUOTA_ORDER, mine)).count() + 1
        return position, queue.count(), holders

    def quota_tokens(self, run_id: str) -> dict[str, int]:
        """Return the fencing token of each quota slot the run holds, by quota
        name (X3f); empty if it holds none."""
        rows = QuotaMembership.objects.using(self.db).filter(run_id=run_id, slot=SlotState.HOLDER)
        return {q: t for q, t in rows.values_list("quota", "fencing_token") if t is not None}

    def renew_lease(self, run_id: str, owner: str, lease_seconds: float) -> bool:
        """:meth:`BaseStore.renew_lease`. Where rows lock (PostgreSQL, MySQL/MariaDB)
        it never waits for a lock another transaction holds on the run's row
        (``SELECT ... FOR UPDATE NOWAIT``, then the compare-and-set): one renewer
        thread renews every body's lease in the process (:mod:`durable_singleton.leases`),
        and a renewal queued behind one locked row let every other lease of the
        process expire (R5, S9). A locked row raises :class:`~.base.RenewalBusy`
        and the renewer retries at the lease's next interval."""
        leased = self._runs().filter(pk=run_id).leased_by(owner)
        fields = {"lease_expires_at": db_now_plus(lease_seconds), "updated_at": DbNow()}
        if not connections[self.db].features.has_select_for_update_nowait:
            return bool(leased.update(**fields))
        try:
            with transaction.atomic(using=self.db):
                if leased.select_for_update(nowait=True).values_list("pk", flat=True).first() is None:
                    return False
                return bool(leased.update(**fields))
        except OperationalError as exc:
            cause = getattr(exc.__cause__, "args", None) or exc.args
            if is_transient_error(exc) or (cause and cause[0] == _MYSQL_LOCK_NOWAIT):
                raise RenewalBusy(run_id) from exc
            raise

    def check_boundary(self, run_id: str, owner: str, lease_seconds: float) -> str:
        leased = self._runs().filter(pk=run_id).leased_by(owner)
        if leased.filter(cancel_requested=False).update(
            lease_expires_at=db_now_plus(lease_seconds), updated_at=DbNow()
        ):
            return Verdict.OK
        return Verdict.CANCELLED if leased.filter(cancel_requested=True).exists() else Verdict.FENCED

    def save_step(self, run_id: str, owner: str, step: StepRecord) -> bool:
        """:meth:`BaseStore.save_step`: the step row and the run's step count in one
        transaction fenced by ``owner``'s lease (R4, R5a), retried whole on a named
        transient error (:meth:`_retrying`: a deadlock or a lock wait timeout rolled it
        back, so it is written once)."""

        def save() -> bool:
            try:
                with transaction.atomic(using=self.db):
                    fenced = self._runs().filter(pk=run_id, cancel_requested=False).leased_by(owner)
                    if not fenced.update(step_count=F("step_count") + 1, updated_at=DbNow()):
                        return False
                    Step.objects.using(self.db).create(
                        run_id=run_id,
                        position=step.position,
                        name=step.name,
                        result=step.result,
                        started_at=step.started_at,
                        finished_at=step.finished_at,
                    )
                    return True
            except IntegrityError:
                return False

        return self._retrying(save)

    def load_steps(self, run_id: str) -> dict[int, StepRecord]:
        return {
            s.position: StepRecord(s.position, s.name, s.result, s.started_at, s.finished_at)
            for s in Step.objects.using(self.db).filter(run_id=run_id)
        }

    def park(self, run_id: str, owner: str, status: str, *, wake_at: datetime | None, reason: str = "") -> str:
        """:meth:`BaseStore.park`: a compare-and-set fenced by ``owner``'s lease (R5a),
        retried on a named transient error (:meth:`_retrying`)."""
        leased = self._runs().filter(pk=run_id).leased_by(owner)

        def park() -> int:
            return leased.filter(cancel_requested=False).update(
                status=status,
                wake_at=wake_at,
                park_reason=reason[:191],
                lease_owner=None,
                lease_expires_at=None,
                updated_at=DbNow(),
            )

        if self._retrying(park):
            return Verdict.PARKED
        return Verdict.CANCELLED if leased.filter(cancel_requested=True).exists() else Verdict.FENCED

    def finish(
        self,
        run: RunRecord,
        owner: str | None,
        status: str,
        *,
        output: Any = None,
        error: Any = None,
        limits: Limits,
        expect: Sequence[str] | None = None,
        finished_at: datetime | None = None,
        ttls: QueueTtls | None = None,
    ) -> Finish:
        fast = self._fast() if owner is not None else None
        # A run that carries quotas settles on the fast path when its record names them (X3g);
        # a throttle carrier's record was written by a release that names them (X6: its
        # throttles hold no slot to free).
        quotas_known = run.quota_slot is None or bool(run.quota_keys) or bool(run.throttle_keys)
        if not quotas_known:
            # A carrier an older release inserted without the quota_keys column (NULL, a
            # rolling upgrade): its memberships name its keys, released with the settle (X3b).
            members = QuotaMembership.objects.using(self.db).filter(run_id=run.run_id).order_by("id")
            run = run.evolve(quota_keys=tuple((str(q), str(k)) for q, k in members.values_list("quota", "key")))
        if (
            fast is not None
            and owner is not None
            and quotas_known
            and (run.singleton_key is None or run.workflow_name in limits)
        ):
            # One round trip: the settle and the handoff in raw SQL (S7, R5a, X3g).
            ttl = (ttls or {}).get(run.workflow_name)
            return self._retrying(
                lambda: fast.finish(run, owner, status, output, error, limits, finished_at, ttl, ttls)
            )
        room = self._mysql_room() if owner is not None and not connections[self.db].in_atomic_block else None
        declared = declared_limit(limits, run.workflow_name)
        if (
            room is not None
            and (run.quota_keys or run.singleton_key is not None)
            and (run.singleton_key is None or declared is not None)
        ):
            # One CALL: the settle and the handoff of the run's slots (S7, R5a, K1, X3g, X3h).
            # A keyed run of a workflow this process does not declare: the ORM path.
            assert owner is not None
            done = self._retrying(
                lambda: self._room_settle(room, run, owner, status, output, error, declared, finished_at, limits, ttls)
            )
            if done is not None:
                return done
        lite = self._sqlite_room() if owner is not None else None
        if (
            lite is not None
            and owner is not None
            and not run.quota_keys
            and run.quota_slot is None
            and (run.singleton_key is None or run.workflow_name in limits)
        ):
            # The settle and the handoff in a few raw statements (the SQLite room, S7, R5a); None:
            # the compare-and-set lost or a waiter within the free slots carries quotas (X3h).
            ttl = (ttls or {}).get(run.workflow_name)
            done = self._retrying(lambda: lite.finish(run, owner, status, output, error, declared, finished_at, ttl))
            if done is not None:
                if run.singleton_key is not None:
                    key = run.singleton_key
                    self._retrying(lambda: lite.bump(run.workflow_name, key, done.granted))
                return done
        if owner is not None:
            cas = Q(pk=run.run_id, status=RunStatus.RUNNING, lease_owner=owner, lease_expires_at__gt=DbNow())
        else:
            # Never a running run (its owner settles it, R5a), never a terminal one (R2).
            cas = Q(pk=run.run_id, status__in=[s for s in (expect or PARKED_STATUSES) if s in PARKED_STATUSES])
        return self._finish(run, cas, status, output, error, limits, finished_at, ttls=ttls)

    def _room_settle(
        self,
        room: mysql.Room,
        run: RunRecord,
        owner: str,
        status: str,
        output: Any,
        error: Any,
        declared: int | None,
        finished_at: datetime | None,
        limits: Limits,
        ttls: QueueTtls | None,
    ) -> Finish | None:
        """The settle and handoff of a run in one CALL of the MySQL/MariaDB room
        (:meth:`mysql.Room.settle`): ``ds_settle_handoff`` for a run with a singleton
        key and no quotas, ``ds_settle_quotas`` for one that carries quotas. The locks of
        all its limits, the compare-and-set on ``owner``'s unexpired lease, its slots
        freed, the waiters a handoff admits admitted (with their quota tokens) and the
        others within the free slots sent a turn, as :meth:`_finish` (S7, S12, S13, R5a,
        K1, X2, X3e-X3h). None if the room is off (the ORM path)."""
        done = room.settle(
            run_id=run.run_id,
            owner=owner,
            status=status,
            output=output,
            error=error,
            finished_at=finished_at,
            workflow_name=run.workflow_name,
            key=run.singleton_key,
            declared_limit=declared,
            ttl=(ttls or {}).get(run.workflow_name),
            redelivery_seconds=self.redelivery_seconds,
            limits=limits if run.quota_keys else None,
            ttls=ttls or {},
        )
        return None if done is None else _room_finished(run, status, output, error, finished_at, done)

    def _finish(
        self,
        run: RunRecord,
        cas: Q,
        status: str,
        output: Any,
        error: Any,
        limits: Limits,
        finished_at: datetime | None = None,
        recovered: bool = False,
        ttls: QueueTtls | None = None,
    ) -> Finish:
        """Settle by compare-and-set and hand the slot off, in one transaction (S7, S12, R5a)."""
        fields = _terminal_fields(status, output, error, finished_at)
        if recovered:
            fields["recoveries"] = F("recoveries") + 1

        if run.singleton_key is None and not run.quota_keys:
            # No slot to hand off: the compare-and-set alone (R5a), retried on a named
            # transient error as every settle is (a deadlock with a racing claim of the run).
            if not self._retrying(lambda: self._runs().filter(cas).update(**fields)):
                return Finish(None)
            settled = _settled(run, status, output, error)
            return Finish(settled.evolve(finished_at=finished_at or settled.finished_at))

        def settle() -> Finish:
            with transaction.atomic(using=self.db):
                # The lock order of every path: the quota keys sorted, then the singleton key (X3e).
                quota_rows = self._lock_quota_keys(run.quota_keys)
                key_row = (
                    self.lock_key(run.workflow_name, run.singleton_key, existing=True) if run.singleton_key else None
                )
                if not self._runs().filter(cas).update(**fields):
                    return Finish(None)
                granted: list[RunRecord] = []
                fronts: dict[tuple[str, str], tuple[int, list[str]]] = {}
                if quota_rows:
                    # Every slot freed at once, in the transaction that ends the run (X3g).
                    QuotaMembership.objects.using(self.db).filter(run_id=run.run_id).update(slot=None)
                    fronts = {qk: self._quota_front(*qk, key_row_q, limits, ttls) for qk, key_row_q in quota_rows}
                # The waiters whose every limit this transaction holds are admitted as their
                # own claims would be; the others within the free slots are sent a turn (X3h).
                carriers = self._handoff_carriers(run, fronts)
                if key_row is not None and run.singleton_key is not None:
                    granted = self._grant(
                        run.workflow_name, run.singleton_key, key_row, limits, ttls=ttls, carriers=carriers
                    )[0]
                granted += self._admit_carriers([c for c in carriers.values() if c.row.singleton_key is None])
                granted = self._hand_quota_tokens(granted, carriers, quota_rows)
                turns = [g for g in granted if g.quota_slot == SlotState.WAITER]
                known = {g.run_id for g in granted}
                fronts_ids = (i for free, waiters in fronts.values() for i in waiters[:free] if i not in known)
                turns += self._quota_records(list(dict.fromkeys(fronts_ids)))
                settled = _settled(run, status, output, error)
                return Finish(
                    settled.evolve(finished_at=finished_at or settled.finished_at),
                    handed_off([g for g in granted if g.quota_slot != SlotState.WAITER], turns),
                )

        return self._retrying(settle)

    # -- operator actions ----------------------------------------------------------
    def request_cancel(
        self, run_id: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> Finish | RunRecord | None:
        running = self._runs().filter(pk=run_id, status=RunStatus.RUNNING)
        for _ in range(self.claim_retries + 1):
            run = self.get_run(run_id)
            if run is None or run.is_terminal:
                return run
            if run.status == RunStatus.RUNNING:
                if self._retrying(lambda: running.update(cancel_requested=True, wake_at=DbNow(), updated_at=DbNow())):
                    return run.evolve(cancel_requested=True)
                continue
            error = CANCELLED_ERROR
            done = self._finish(
                run, Q(pk=run_id, status=run.status), RunStatus.CANCELLED, None, error, limits, ttls=ttls
            )
            if done.settled:
                return done
        return self.get_run(run_id)

    def reset_for_retry(self, run_id: str, redelivery_seconds: float, deadline_at: datetime | None) -> RunRecord | None:
        row = self._runs().filter(pk=run_id, status__in=(RunStatus.FAILED, RunStatus.DEAD)).first()
        if row is None:
            return None
        memberships = QuotaMembership.objects.using(self.db).filter(run_id=run_id)
        carries = memberships.exists() or bool(row.throttle_keys)  # a throttle carrier waits as one (X6)
        changes: dict[str, Any] = {
            "status": RunStatus.PENDING,
            "error": None,
            "output": None,
            "singleton_slot": SlotState.WAITER if row.singleton_key is not None else None,
            "singleton_tracked": row.singleton_key is not None,
            # Every membership back in line as a waiter (X3g).
            "quota_slot": SlotState.WAITER if carries else None,
            "recoveries": 0,
            "finished_at": None,
            "cancel_requested": False,
            "deadline_at": deadline_at,
            "admitted_at": None,
            "fencing_token": None,
        }

        def reset() -> bool:
            with transaction.atomic(using=self.db):
                if (
                    not self._runs()
                    .filter(pk=run_id, status=row.status)
                    .update(wake_at=db_now_plus(redelivery_seconds), updated_at=DbNow(), **changes)
                ):
                    return False
                if carries:
                    memberships.update(slot=SlotState.WAITER, fencing_token=None)
                return True

        if not self._retrying(reset):
            return None
        for name, value in changes.items():
            setattr(row, name, value)
        return record_of(row)

    def release(
        self, workflow_name: str, key: str, *, limits: Limits, ttls: QueueTtls | None = None
    ) -> tuple[RunRecord, ...]:
        def grant() -> tuple[RunRecord, ...]:
            with transaction.atomic(using=self.db):
                if workflow_name.startswith(QUOTA_PREFIX):
                    # A quota key: its first waiters within its free slots get a turn (X3h, K2).
                    quota_rows = self._lock_quota_keys([(workflow_name[len(QUOTA_PREFIX) :], key)])
                    return tuple(self._quota_turns(quota_rows, limits, set(), ttls))
                key_row = self.lock_key(workflow_name, key)
                return tuple(self._grant(workflow_name, key, key_row, limits, ttls=ttls)[0])

        return self._retrying(grant)

    def add_signal(self, run_id: str, name: str, payload: Any, *, signal_id: str | None = None) -> RunRecord | None:
        """Buffer a signal under the run's row lock (D2). With ``signal_id``, a
        signal of the run with that id already stored is kept and nothing is
        stored (first wins); the ``ds_signal_once`` unique constraint holds it
        across processes, and a racing insert that loses it returns the run. A
        named transient error retries the transaction whole (section 7)."""

        def send() -> RunRecord | None:
            with transaction.atomic(using=self.db):
                row = self._runs().select_for_update().filter(pk=run_id).first()
                signals = Signal.objects.using(self.db)
                sent = signal_id is not None and signals.filter(run_id=run_id, signal_id=signal_id).exists()
                if row is not None and sent:
                    return record_of(row)  # a retry of a stored signal (D2)
                if row is None or row.status not in ACTIVE_STATUSES:
                    return None
                now = timezone.now()
                signals.create(run_id=run_id, name=name, payload=payload, created_at=now, signal_id=signal_id)
                if row.status in PARKED_STATUSES and ParkReason.SIGNAL.matches(row.park_reason):
                    self._runs().filter(pk=run_id, status=row.status).update(wake_at=DbNow(), updated_at=DbNow())
                    row.wake_at = timezone.now()
                return record_of(row)

        try:
            return self._retrying(send)
        except IntegrityError:
            if signal_id is None:
                raise
            return self.get_run(run_id)  # the racing sender of the same id committed first (D2)

    def load_signals(self, run_id: str) -> list[SignalRecord]:
        return [
            SignalRecord(s.pk, s.name, s.payload, s.created_at)
            for s in Signal.objects.using(self.db).filter(run_id=run_id).order_by("pk")
        ]

    def children(self, run_id: str) -> list[str]:
        return list(self._runs().active().filter(parent_run_id=run_id).values_list("run_id", flat=True))

    def children_of_cancelled(self, batch: int) -> list[str]:
        # Driven by the active runs (the status indexes), each parent found by its key.
        parent_cancelled = Exists(self._runs().filter(pk=OuterRef("parent_run_id"), status=RunStatus.CANCELLED))
        return list(
            self._runs()
            .active()
            .filter(parent_run_id__isnull=False)
            .exclude(status=RunStatus.RUNNING, cancel_requested=True)
            .filter(parent_cancelled)
            .order_by("created_at", "run_id")
            .values_list("run_id", flat=True)[:batch]
        )

    # -- the tick ------------------------------------------------------------------
    def _take(self, queryset: Any, order: str, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        """Take a batch, oldest first, pushing each run's next send by the redelivery window (S7a)."""
        skip_locked = connections[self.db].features.has_select_for_update_skip_locked

        def take() -> list[tuple[str, str]]:
            with transaction.atomic(using=self.db):
                rows = queryset.order_by(order)
                if skip_locked:
                    rows = rows.select_for_update(skip_locked=True)
                due = [(str(a), str(b)) for a, b in rows.values_list("run_id", "workflow_name")[:batch]]
                if due:
                    queryset.filter(pk__in=[run_id for run_id, _ in due]).update(
                        wake_at=db_now_plus(redelivery_seconds)
                    )
                return due

        return self._retrying(take)

    def due_runs(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        return self._take(self._runs().due(), "wake_at", redelivery_seconds, batch)

    def seconds_to_next_wake(self, horizon: float) -> float | None:
        """:meth:`BaseStore.seconds_to_next_wake`: the earliest ``wake_at`` of the parked
        runs due within ``horizon`` seconds on the database's clock (``ds_run_due_idx``, the
        range the tick's due read scans), and that clock, in one statement (R5)."""
        soon = self._runs().parked().filter(wake_at__lte=db_now_plus(horizon))
        read = soon.aggregate(first=Min("wake_at"), now=Max(DbNow()))
        if read["first"] is None:
            return None
        return max((_aware(read["first"]) - _aware(read["now"])).total_seconds(), 0.0)

    def expired_leases(self, *, redelivery_seconds: float, batch: int) -> list[tuple[str, str]]:
        return self._take(self._runs().lease_expired(), "lease_expires_at", redelivery_seconds, batch)

    def overdue_runs(self, batch: int) -> list[RunRecord]:
        return [record_of(r) for r in self._runs().overdue().order_by("deadline_at")[:batch]]

    def expired_waiters(self, ttls: QueueTtls, batch: int) -> list[RunRecord]:
        if not ttls:
            return []
        # One condition per workflow with a TTL, on the database's clock (X2, R5).
        outlived = Q()
        for name, ttl in ttls.items():
            outlived |= Q(workflow_name=name) & queue_ttl_expired_q(ttl, DbNow())
        rows = (
            self._runs()
            .parked()
            .filter(singleton_slot=SlotState.WAITER)
            .filter(outlived)
            .order_by("created_at", "run_id")[:batch]
        )
        return [record_of(r) for r in rows]

    def expire_waiter(self, run: RunRecord, ttl: float, *, limits: Limits, ttls: QueueTtls | None = None) -> Finish:
        if run.singleton_key is None:
            return Finish(None)
        # Under the key's lock, so no admission of the key is halfway; a run admitted
        # since it was read is a holder now and is left alone (X2, R5a).
        cas = Q(pk=run.run_id, status__in=PARKED_STATUSES, singleton_slot=SlotState.WAITER) & queue_ttl_expired_q(
            ttl, DbNow()
        )
        return self._finish(run, cas, RunStatus.CANCELLED, None, dict(QUEUE_TTL_ERROR), limits, ttls=ttls)

    def request_timeout_cancel(self, run_id: str) -> bool:
        running = self._runs().filter(pk=run_id, status=RunStatus.RUNNING, cancel_requested=False)
        return bool(self._retrying(lambda: running.update(cancel_requested=True, updated_at=DbNow())))

    def catch_up(self, *, limits: Limits, batch: int, ttls: QueueTtls | None = None) -> tuple[RunRecord, ...]:
        """Grant the free slots of keys that have a waiter and fewer holders than
        their limit; one query finds them, oldest key first (S8a, S8b). A
        waiter whose turn is on its way (:func:`~durable_singleton.admission.turn_on_its_way`)
        makes no key due: it claims by that turn (S8). A key whose first waiters
        all carry quotas with no room for them is left alone
        (:meth:`_catch_up_worth`): its grant would only send them turns that park
        them again, at every tick while their quotas stay busy."""
        if not limits:
            return ()
        key_runs = self._runs().filter(workflow_name=OuterRef("workflow_name"), singleton_key=OuterRef("key"))
        holders = key_runs.filter(holds_slot_q()).order_by().values("singleton_key").annotate(n=Count("pk")).values("n")
        declared = Case(
            *[When(workflow_name=name, then=Value(limit)) for name, limit in limits.items()], default=Value(1)
        )
        keys = (
            SingletonKey.objects.using(self.db)
            .filter(workflow_name__in=list(limits))
            .annotate(
                holders=Coalesce(Subquery(holders), 0),
                # A due waiter (X5) whose turn is not on its way (S7a): a key whose waiters
                # are all not due yet, or all have a turn coming, is not picked.
                has_waiter=Exists(
                    key_runs.filter(
                        Q(singleton_slot=SlotState.WAITER) & is_due_q(DbNow()) & ~turn_on_its_way_q(DbNow())
                    )
                ),
                key_limit=limit_in_force_sql(declared, "limit_override"),
            )
            .annotate(free=free_slots_sql(F("key_limit"), F("holders"), F("paused")))
            .filter(has_waiter=True, free__gt=0)
            .order_by("pk")
            .values_list("workflow_name", "key")[:batch]
        )
        granted: list[RunRecord] = []
        for workflow_name, key in list(keys):
            if self._catch_up_worth(workflow_name, key, limits, ttls):
                granted.extend(self.release(workflow_name, key, limits=limits, ttls=ttls))
        return tuple(granted)

    def _catch_up_worth(self, workflow_name: str, key: str, limits: Limits, ttls: QueueTtls | None) -> bool:
        """Tell whether the catch-up's grant of a key with a free slot can admit one of
        its first ``limit`` due waiters (S8b, X3h, X3d): one that carries no quota
        (:func:`~durable_singleton.admission.key_only_waiter_q`), or one within the
        free slots of each of its quota keys, read without their locks (its own
        claim decides under them). If the quota frees later, its handoff sends its
        first waiters a turn itself (X3h). Without this, a keyed waiter held back
        by a busy quota was sent a turn, and parked again, at every tick."""
        key_row = SingletonKey.objects.using(self.db).filter(workflow_name=workflow_name, key=key)
        override = key_row.values_list("limit_override", flat=True).first()
        limit = limit_in_force(declared_limit(limits, workflow_name), override)
        front, _legacy = self._front(workflow_name, key, 2 * limit, (ttls or {}).get(workflow_name))
        waiters = [r for r in front if r.singleton_slot == SlotState.WAITER and not self._holds_slot(r)][:limit]
        if any(r.quota_slot is None for r in waiters):
            return True
        keys = SingletonKey.objects.using(self.db)
        for row in waiters:
            memberships = QuotaMembership.objects.using(self.db).filter(run_id=row.run_id)
            reaches = True
            for name, qkey in memberships.values_list("quota", "key"):
                quota_row = keys.filter(workflow_name=quota_lock_name(name), key=qkey)
                found = quota_row.values("limit_override", "paused").first()
                if found is None:
                    reaches = False
                    break
                free, first = self._quota_front(name, qkey, found, limits, ttls)
                if not quota_front_reaches(row.run_id, first, free):
                    reaches = False
                    break
            if reaches:
                return True
        return False

    # -- reads -----------------------------------------------------------------------
    def active_runs_for_key(self, workflow_name: str, key: str) -> Sequence[RunRecord]:
        rows = self._runs().for_key(workflow_name, key).active().order_by(*QUEUE_ORDER)
        return [record_of(r) for r in rows]

    def _count_active(self, workflow_name: str, key: str, namespace: str | None, cap: int) -> int:
        runs = self._runs().for_key(workflow_name, key).active()
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return len(list(self._locking(runs.order_by()).values_list("pk", flat=True)[:cap]))

    def _lock_capped_quota_keys(self, run: RunRecord) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        """Lock the rows of the quota keys of ``run`` whose quota has a queue cap
        (its ``quota_caps``), in the lock order (X3e); inside a transaction."""
        capped = {name for name, _limit, _depth in run.quota_caps}
        return self._lock_quota_keys(q for q in run.quota_keys if q[0] in capped)

    def _check_quota_caps(
        self,
        run: RunRecord,
        quota_rows: Sequence[tuple[tuple[str, str], Mapping[str, Any]]],
        namespace: str | None,
        leaving: Collection[str] = (),
    ) -> None:
        """Raise :class:`QuotaQueueFullError` if a locked capped quota key of ``run``
        (among ``quota_rows``, the locked quota keys) already has its cap
        in force of active members, holders and waiters of every workflow (in
        ``namespace`` if given), not counting the runs ``leaving`` (those the
        same transaction ends): the queue cap of a quota key (S15, K2, X3j)."""
        caps = {name: (limit, depth) for name, limit, depth in run.quota_caps}
        for (name, key), quota_row in quota_rows:
            if name not in caps or (name, key) not in run.quota_keys:
                continue  # a quota key locked for another reason: no cap of this run
            limit, depth = caps[name]
            # The limit in force, the quota key's runtime override included (K2).
            in_force = cap_in_force(limit + depth, limit, quota_row["limit_override"])
            members = QuotaMembership.objects.using(self.db).filter(
                holds_quota_slot_q() | quota_waiting_q(), quota=name, key=key
            )
            if namespace is not None:
                members = members.filter(run__namespace=namespace)
            if leaving:
                members = members.exclude(run_id__in=list(leaving))
            if len(list(self._locking(members.order_by()).values_list("pk", flat=True)[:in_force])) >= in_force:
                raise QuotaQueueFullError(run.workflow_name, name, key, depth)

    def count_active_for_key(self, workflow_name: str, key: str, namespace: str | None) -> int:
        runs = self._runs().for_key(workflow_name, key).active()
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return int(runs.count())

    def list_runs(self, *, workflow_name: str | None = None, namespace: str | None = None) -> list[RunRecord]:
        runs = self._runs().order_by("created_at", "run_id")
        if workflow_name is not None:
            runs = runs.filter(workflow_name=workflow_name)
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return [record_of(r) for r in runs]

    # -- reads and writes for the services (BaseStore's last section) -------------
    def select_runs(
        self,
        *,
        limit: int,
        run_ids: Sequence[str] = (),
        workflow_name: str | None = None,
        key: str | None = None,
        statuses: Sequence[str] = (),
        created_before: datetime | None = None,
        namespace: str | None = None,
        oldest_first: bool = False,
    ) -> list[RunRecord]:
        order = ("created_at", "run_id") if oldest_first else ("-created_at", "-run_id")
        runs = self._runs().order_by(*order)
        if run_ids:
            runs = runs.filter(pk__in=list(run_ids))
        if workflow_name is not None:
            runs = runs.filter(workflow_name=workflow_name)
        if key is not None:
            runs = runs.filter(singleton_key=key)
        if statuses:
            runs = runs.filter(status__in=list(statuses))
        if created_before is not None:
            runs = runs.filter(created_at__lt=created_before)
        if namespace is not None:
            runs = runs.filter(namespace=namespace)
        return [record_of(r) for r in runs[:limit]]

    def key_queue(self, run: RunRecord, named: int) -> KeyQueue:
        """Two bounded queries whatever the backlog (the queue index serves
        both), on the database's clock (S5, X5)."""
        assert run.singleton_key is not None
        runs = self._runs().for_key(run.workflow_name, run.singleton_key)
        rows = list(
            runs.holders()
            .order_by("created_at", "run_id")
            .values_list(
                "run_id",
                "status",
                "admitted_at",
                "started_at",
                "attempts",
                "namespace",
                "lease_owner",
                "lease_expires_at",
            )[: named + 1]
        )
        count = len(rows) if len(rows) <= named else runs.holders().count()
        ahead = ahead_q(QUEUE_ORDER, {"priority": run.priority, "created_at": run.created_at, "run_id": run.run_id})
        due = is_due_q(DbNow())
        totals = runs.filter(singleton_slot=SlotState.WAITER).aggregate(
            depth=Count("pk"),
            ahead=Count("pk", filter=ahead & due),
            not_due=Count("pk", filter=ahead & ~due),
            peers=Count("pk", filter=ahead & due & Q(priority=run.priority)),
        )
        holders = tuple(
            QueueHolder(r[0], r[1], since_admitted(r[2], r[3], r[4]), r[5], r[6], r[7]) for r in rows[:named]
        )
        waiting = run.tracked and not run.admitted
        return KeyQueue(holders, count, totals["depth"], totals["ahead"], totals["not_due"], waiting, totals["peers"])

    def recent_completions(self, workflow_name: str, key: str, count: int) -> list[tuple[datetime | None, datetime]]:
        rows = (
            self._runs()
            .for_key(workflow_name, key)
            .filter(status=RunStatus.COMPLETED, finished_at__isnull=False)
            .annotate(began=Coalesce("admitted_at", "started_at"))
            .order_by("-finished_at")
            .values_list("began", "finished_at")[:count]
        )
        return [(began, finished) for began, finished in rows if finished is not None]

    def hand_back_leases(self, run_ids: Sequence[str], owner_prefix: str) -> int:
        """One compare-and-set UPDATE on the database's clock (R5, R8): a process
        clock stepped ahead would write an expiry (and a wake_at) in the future
        and leave the run stranded that long."""
        if not run_ids:
            return 0
        return int(
            self._runs()
            .filter(pk__in=list(run_ids), status=RunStatus.RUNNING, lease_owner__startswith=owner_prefix)
            .update(lease_expires_at=DbNow(), wake_at=DbNow())
        )

    def worker_processes(self) -> list[WorkerRecord]:
        return [
            WorkerRecord(w.name, w.host, w.pid, w.mode, w.threads, w.queues, w.started_at, w.last_seen_at)
            for w in WorkerProcess.objects.using(self.db).order_by("host", "pid")
        ]

    def record_beat(self, name: str, at: datetime, owner: str) -> bool:
        rows = Heartbeat.objects.using(self.db)
        if not rows.filter(name=name).update(at=at, owner=owner):
            rows.bulk_create([Heartbeat(name=name, at=at, owner=owner)], ignore_conflicts=True)
        return True

    def beat(self, name: str) -> Beat | None:
        row = Heartbeat.objects.using(self.db).filter(name=name).first()
        return Beat(row.name, row.at, row.owner) if row is not None else None

    def purge_finished(
        self,
        *,
        before: datetime,
        statuses: Sequence[str],
        workflow_name: str | None,
        key: str | None,
        limit: int | None,
        dry_run: bool,
    ) -> PurgeReport:
        return retention.purge_finished_runs(
            self.db,
            before=before,
            statuses=statuses,
            workflow_name=workflow_name,
            key=key,
            limit=limit,
            dry_run=dry_run,
        )

    def slot_counts(self) -> list[SlotCount]:
        """One grouped query over the runs and one over the quota memberships (O4)."""
        waiting = Q(singleton_slot=SlotState.WAITER)
        groups = (
            self._runs()
            .filter(Q(singleton_slot__isnull=False) | legacy_holder_q())
            .values("workflow_name")
            .annotate(
                holders=Count("pk", filter=holds_slot_q()),
                waiters=Count("pk", filter=waiting),
                first=Min("created_at", filter=waiting),
            )
            .order_by()
        )
        counts = [SlotCount(g["workflow_name"], g["holders"], g["waiters"], g["first"]) for g in groups]
        quota_waiting = quota_waiting_q()
        quota_groups = (
            QuotaMembership.objects.using(self.db)
            .filter(slot__isnull=False)
            .values("quota")
            .annotate(
                holders=Count("pk", filter=holds_quota_slot_q()),
                waiters=Count("pk", filter=quota_waiting),
                first=Min("created_at", filter=quota_waiting),
            )
            .order_by()
        )
        counts += [SlotCount(quota_lock_name(g["quota"]), g["holders"], g["waiters"], g["first"]) for g in quota_groups]
        return sorted(counts, key=attrgetter("name"))

    def throttle_waiter_counts(self) -> list[ThrottleWaitCount]:
        """One grouped query over the throttle memberships; over the rate judged on the database's clock (O4, R5)."""
        groups = (
            ThrottleMembership.objects.using(self.db)
            .filter(run__quota_slot=SlotState.WAITER, run__status__in=ACTIVE_STATUSES)
            .values("throttle")
            .annotate(
                waiters=Count("pk"),
                over=Count("pk", filter=Q(run__not_before__gt=DbNow())),
                first=Min("created_at"),
            )
            .order_by("throttle")
        )
        return [
            ThrottleWaitCount(throttle_lock_name(g["throttle"]), g["waiters"], g["over"], g["first"]) for g in groups
        ]

    def count_backlog(self, created_by: datetime) -> int:
        return self._runs().backlog(created_by).count()

    def unrenewed_leases(
        self, *, settings: Settings, now: datetime, limit: int
    ) -> tuple[dict[str, int], list[RunRecord]]:
        """One grouped count, and a read of the first ``limit`` only when there are any (K3, R5)."""
        unrenewed = self._runs().unrenewed(settings=settings, now=now)
        counts = dict(
            unrenewed.values("workflow_name").annotate(n=Count("pk")).order_by().values_list("workflow_name", "n")
        )
        if not counts or limit <= 0:
            return counts, []
        return counts, [record_of(r) for r in unrenewed.order_by("lease_expires_at", "run_id")[:limit]]

    def controlled_keys(self) -> dict[tuple[str, str], tuple[bool, int | None]]:
        return key_controls.controlled(self)

    def limit_changed_at(self, workflow: str, key: str) -> datetime | None:
        return key_controls.limit_changed_at(self, workflow, key)

    def key_holder_counts(self) -> list[KeyCount]:
        """One grouped query over the runs and one over the quota memberships (K4)."""
        holders = (
            self._runs()
            .filter(holds_slot_q())
            .values("workflow_name", "singleton_key")
            .annotate(n=Count("pk"), stored_limit=Max("singleton_limit"), last_admitted=Max("admitted_at"))
            .order_by("workflow_name", "singleton_key")
        )
        counts = [
            KeyCount(g["workflow_name"], g["singleton_key"], g["n"], g["last_admitted"], g["stored_limit"])
            for g in holders
            if g["singleton_key"] is not None  # a slot needs a key (constraint ds_run_slot_only_active)
        ]
        quota_holders = (
            QuotaMembership.objects.using(self.db)
            .filter(holds_quota_slot_q())
            .values("quota", "key")
            .annotate(n=Count("pk"), last_admitted=Max("run__admitted_at"))
            .order_by("quota", "key")
        )
        counts += [KeyCount(quota_lock_name(g["quota"]), g["key"], g["n"], g["last_admitted"]) for g in quota_holders]
        return counts

    def throttle_window_counts(self, name: str, since: datetime) -> list[KeyCount]:
        """One grouped count on ``ds_throttle_window_idx`` (X6)."""
        windows = (
            ThrottleAdmission.objects.using(self.db)
            .filter(throttle=name, admitted_at__gt=since)
            .values("key")
            .annotate(n=Count("pk"), last_admitted=Max("admitted_at"))
            .order_by("key")
        )
        return [KeyCount(throttle_lock_name(name), w["key"], w["n"], w["last_admitted"]) for w in windows]

    def inactive_holders(self, limit: int) -> list[RunRecord]:
        return [record_of(r) for r in self._runs().inactive_holders().order_by("created_at", "run_id")[:limit]]

    def overdue_waiter_keys(self, since: datetime) -> list[KeyCount]:
        """One grouped query; the waiters' ``not_before`` judged on the database's clock (X5, R5)."""
        groups = (
            self._runs()
            .overdue_waiters(since)
            .values("workflow_name", "singleton_key")
            .annotate(n=Count("pk"), stored_limit=Max("singleton_limit"))
            .order_by("workflow_name", "singleton_key")
        )
        return [
            KeyCount(g["workflow_name"], g["singleton_key"], g["n"], None, g["stored_limit"])
            for g in groups
            if g["singleton_key"] is not None
        ]

    def overdue_quota_waiters(self, since: datetime, limit: int) -> list[RunRecord]:
        """One query; ``not_before`` judged on the database's clock (X5, R5)."""
        overdue = Q(wake_at__isnull=True) | Q(wake_at__lte=since)
        rows = (
            self._runs()
            .admissible()
            .filter(overdue, quota_slot=SlotState.WAITER, status__in=WAKEABLE_STATUSES, cancel_requested=False)
            .order_by("created_at", "run_id")[:limit]
        )
        return [record_of(r) for r in rows]

    def overdue_throttle_keys(self, since: datetime) -> list[KeyCount]:
        """One grouped query over the throttle memberships; ``not_before`` judged on the database's clock (X5, R5)."""
        groups = (
            ThrottleMembership.objects.using(self.db)
            .filter(
                is_due_q(DbNow(), "run__"),
                Q(run__wake_at__isnull=True) | Q(run__wake_at__lte=since),
                run__quota_slot=SlotState.WAITER,
                run__status__in=WAKEABLE_STATUSES,
                run__cancel_requested=False,
            )
            .values("throttle", "key")
            .annotate(n=Count("pk"))
            .order_by("throttle", "key")
        )
        return [KeyCount(throttle_lock_name(g["throttle"]), g["key"], g["n"]) for g in groups]

    def due_throttle_waiters(self, name: str, key: str, limit: int) -> list[RunRecord]:
        """One read of ``ds_throttle_order_idx`` in the queue order, due on the database's clock (X5, X8a, R5)."""
        members = ThrottleMembership.objects.using(self.db).filter(
            is_due_q(DbNow(), "run__"),
            throttle=name,
            key=key,
            run__quota_slot=SlotState.WAITER,
            run__status__in=ACTIVE_STATUSES,
        )
        ids = [str(i) for i in members.order_by(*QUEUE_ORDER).values_list("run_id", flat=True)[:limit]]
        runs = {r.run_id: r for r in self._runs().filter(pk__in=ids)}
        return [record_of(runs[i]) for i in ids if i in runs]

    def key_freed_since(self, workflow_name: str, key: str, since: datetime) -> bool:
        return bool(self._runs().for_key(workflow_name, key).filter(finished_at__gt=since).exists())

    def due_waiters(self, workflow_name: str, key: str, limit: int) -> list[RunRecord]:
        """One read of ``ds_run_queue_idx`` in admission order, due on the database's clock (X5, R5)."""
        return [record_of(r) for r in self._runs().for_key(workflow_name, key).due_waiting()[:limit]]

    def unredriven_leases(self, since: datetime, limit: int) -> list[RunRecord]:
        return [record_of(r) for r in self._runs().unredriven(since).order_by("lease_expires_at", "run_id")[:limit]]

    def drop_holder_marker(self, run_id: str) -> bool:
        """A compare-and-set: still marked and not active (R5a)."""
        return bool(self._runs().inactive_holders().filter(pk=run_id).update(singleton_slot=None))

    def wake_waiter(self, run_id: str) -> bool:
        """A compare-and-set on the status, ``wake_at`` on the database's clock (R5a, R8)."""
        woken = self._runs().filter(pk=run_id, status__in=WAKEABLE_STATUSES)
        return bool(woken.update(wake_at=DbNow(), updated_at=DbNow()))

    def wake_throttle_waiter(self, run_id: str, wake_at: datetime | None) -> bool:
        """A compare-and-set on the status, the waiter marker and ``wake_at`` as read,
        ``wake_at`` on the database's clock (R5a, R8)."""
        read = Q(wake_at__isnull=True) if wake_at is None else Q(wake_at=wake_at)
        woken = self._runs().filter(read, pk=run_id, status__in=WAKEABLE_STATUSES, quota_slot=SlotState.WAITER)
        return bool(woken.update(wake_at=DbNow(), updated_at=DbNow()))

    def redrive_lease(self, run_id: str, lease_expires_at: datetime) -> bool:
        """A compare-and-set on the lease as read, ``wake_at`` on the database's clock (R5a, R8)."""
        expired = self._runs().filter(pk=run_id, status=RunStatus.RUNNING, lease_expires_at=lease_expires_at)
        return bool(expired.update(wake_at=DbNow()))
