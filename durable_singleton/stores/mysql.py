"""The MariaDB/MySQL room: the hot transactions as stored procedures, one CALL each.

The decisions are the ORM path's (:mod:`durable_singleton.stores.django`); this
room carries them out in fewer round trips. Each procedure lives in a named
block of ``durable_singleton/sql/mysql/*.sql`` (``-- name: <procedure>``, read
by the one loader, :mod:`durable_singleton.sql`), created by migrations
``0016_mysql_procedures``, ``0017_mysql_settle``, ``0021_mysql_commit_last``,
``0022_mysql_quotas``, ``0024_mysql_throttles`` and ``0025_mysql_key_locks`` on MySQL/MariaDB only
(:func:`install`): ``ds_claim``, a turn's claim without a read first (a run
without a key takes its lease, a tracked waiter is admitted or parked under its
key's lock; any other run is only read and the ORM path decides);
``ds_take_lease``, a holder's confirmation (S6); ``ds_settle_handoff``, the
settle of a run with a key and no quotas and the grant of its slots (S7);
``ds_grant_waiters``, the grant both share (S5, K1). The shared quotas (X3),
``sql/mysql/quota.sql``, migration ``0022_mysql_quotas``: ``ds_admit_quota``, the
claim of a waiter that carries quotas or throttles (``ds_claim`` calls it);
``ds_take_quota_lease``, the confirmation of a quota or throttle holder;
``ds_settle_quotas``, the settle of a run that carries quotas and the handoff of
its slots. The throttles (X6), ``sql/mysql/throttle.sql``, migration
``0024_mysql_throttles``: ``ds_throttle_keys_of`` and ``ds_throttle_front``, with
which ``ds_admit_quota`` locks a throttle carrier's throttle keys first, counts
each key's window at one reading of the database's clock after the locks,
records its admission at that time or parks it until the window opens
(``throttled:<name>``). Every key row is locked through ``ds_lock_key``, by its
primary key when ``ds_key_ids`` read it before the transaction
(``ds_lock_known_key``, migration ``0025_mysql_key_locks``; S13a). One CALL each instead of five to thirty round trips
(``SET autocommit``, the locks, the reads, the writes, ``COMMIT``, ``SET
autocommit``). A throttle carrier's start stays the ORM path's.

Where the procedures are missing (the database user could not create them,
docs/operations.rst) or cannot be called (no ``EXECUTE``), the store takes
the ORM path: :class:`Room` is None for that database, or turns itself off at
the first refusal and the claim is made on the ORM path (the S14-style fallback).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any

from django.db import DatabaseError, OperationalError, connections
from django.db.models import DEFERRED

from .. import sql as sql_blocks
from ..models import Run

__all__ = [
    "NOT_ALLOWED",
    "PROCEDURES",
    "Room",
    "install",
    "installed",
    "not_allowed",
    "room_of",
    "statements",
    "tokens_of",
    "uninstall",
]

logger = logging.getLogger(__name__)

#: The procedures migration ``0016_mysql_procedures`` creates.
PROCEDURES_0016 = ("ds_take_lease",)
#: The procedures migration ``0017_mysql_settle`` creates, in order (a procedure after those it calls).
PROCEDURES_0017 = ("ds_grant_waiters", "ds_send_runs", "ds_settle_handoff", "ds_claim")
#: The procedures migration ``0022_mysql_quotas`` creates (``sql/mysql/quota.sql``), in order,
#: and those it creates again: ``ds_grant_waiters`` takes the carriers a handoff admits, its
#: callers pass them, and ``ds_claim`` calls ``ds_admit_quota``.
PROCEDURES_0022 = (
    "ds_lock_key",
    "ds_quota_keys_of",
    "ds_quota_front",
    "ds_send_granted",
    "ds_admit_quota",
    "ds_take_quota_lease",
    "ds_settle_quotas",
)
#: The procedures migration ``0024_mysql_throttles`` creates (``sql/mysql/throttle.sql``), in
#: order, and those it creates again: ``ds_admit_quota`` claims a waiter that carries
#: throttles too, and ``ds_claim`` calls it for one.
PROCEDURES_0024 = ("ds_throttle_keys_of", "ds_throttle_front")
#: The procedures migration ``0025_mysql_key_locks`` creates (``sql/mysql/quota.sql``), in
#: order: ``ds_lock_known_key`` locks a key row its caller read before its transaction
#: (``ds_key_ids``) by its primary key; the migration creates its callers again after them.
PROCEDURES_0025 = ("ds_key_ids", "ds_lock_known_key")
#: The procedures this room calls.
PROCEDURES = PROCEDURES_0016 + PROCEDURES_0017 + PROCEDURES_0022 + PROCEDURES_0024 + PROCEDURES_0025

# The server's refusals of a CALL that mean "not installed" (docs/operations.rst): no such
# procedure; no EXECUTE; access denied (database, table); its definer no longer exists.
_MISSING = {1305, 1370, 1044, 1142, 1449}
#: The server's refusals of ``CREATE PROCEDURE`` and ``DROP PROCEDURE [IF EXISTS]`` to a user
#: without the grants (docs/operations.rst): access denied (database, table), no SUPER, no
#: ALTER ROUTINE (MariaDB refuses even ``DROP PROCEDURE IF EXISTS`` of a missing procedure
#: so), binary logging without SUPER.
NOT_ALLOWED = frozenset({1044, 1142, 1227, 1370, 1419})


def not_allowed(exc: BaseException) -> bool:
    """Tell whether ``exc`` (a database error of :func:`install` or :func:`uninstall`) is the
    server's refusal to a user without ``CREATE ROUTINE`` or ``ALTER ROUTINE``."""
    code: tuple[Any, ...] = getattr(exc.__cause__, "args", None) or exc.args
    return bool(code) and code[0] in NOT_ALLOWED


@cache
def statements() -> dict[str, str]:
    """Return the ``CREATE PROCEDURE`` statement of each named block of ``sql/mysql/*.sql``,
    by procedure name, as the one loader of every room reads them
    (:func:`durable_singleton.sql.statements`)."""
    return sql_blocks.statements("mysql")


def install(connection: Any, names: Sequence[str] = PROCEDURES) -> None:
    """Create (or replace) the procedures ``names`` on ``connection`` (migrations 0016 and 0017).

    MySQL/MariaDB only; each procedure is dropped first, so a later migration that
    changes one runs this again. Needs the ``CREATE ROUTINE`` and ``ALTER ROUTINE``
    privileges (docs/operations.rst). Raises ``KeyError`` for a name no block has."""
    with connection.cursor() as cursor:
        for name in names:
            cursor.execute(f"DROP PROCEDURE IF EXISTS {name}")
            cursor.execute(statements()[name])


def uninstall(connection: Any, names: Sequence[str] = PROCEDURES) -> None:
    """Drop the procedures ``names`` (a migration reversed): the store takes the ORM path."""
    with connection.cursor() as cursor:
        for name in reversed(names):
            cursor.execute(f"DROP PROCEDURE IF EXISTS {name}")


def migration_steps(names: Sequence[str]) -> tuple[Callable[[Any, Any], None], Callable[[Any, Any], None]]:
    """Return the (forwards, backwards) functions of a migration's ``RunPython`` that
    create, and drop, the procedures ``names`` on MySQL/MariaDB (nothing elsewhere). A
    user without ``CREATE ROUTINE`` (or ``ALTER ROUTINE``) gets a warning and no change:
    the store then takes the ORM path (docs/operations.rst)."""
    migrations_logger = logging.getLogger("durable_singleton.migrations")

    def create(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor != "mysql":
            return
        try:
            install(schema_editor.connection, names)
        except DatabaseError as exc:
            if not not_allowed(exc):  # the user may not create routines; the ORM path serves (S14-style)
                raise
            migrations_logger.warning(
                "durable_singleton: stored procedures not created (%s); the ORM path serves MySQL", exc
            )

    def drop(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor != "mysql":
            return
        try:
            uninstall(schema_editor.connection, names)
        except DatabaseError as exc:
            if not not_allowed(exc):
                raise
            migrations_logger.warning("durable_singleton: stored procedures not dropped (%s)", exc)

    return create, drop


def installed(using: str) -> bool:
    """Tell whether every procedure of the room exists in database ``using`` (one read)."""
    names = ", ".join(["%s"] * len(PROCEDURES))
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.ROUTINES "
            f"WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_TYPE = 'PROCEDURE' AND ROUTINE_NAME IN ({names})",
            list(PROCEDURES),
        )
        return int(cursor.fetchone()[0]) == len(PROCEDURES)


class Room:
    """The procedures of one MySQL/MariaDB database (``using``, a Django alias).

    ``usable`` turns False, for this process, at the first call the server refuses
    because the procedure is missing or may not be executed; the caller then takes
    the ORM path."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.usable = True

    def _call_sets(self, name: str, params: list[Any]) -> list[tuple[list[str], list[tuple[Any, ...]]]] | None:
        """CALL ``name`` outside any transaction of the caller's (the procedure commits its
        own) and return every result set it sent, (column names, rows), in order; None if
        the server refused the CALL (the room turns off: the ORM path), or nothing called
        inside a transaction the caller opened (``atomic``, ATOMIC_REQUESTS, or autocommit
        off): a procedure's START TRANSACTION would commit it, so the ORM path decides in
        the caller's transaction (R5a, S13). One round trip."""
        connection = connections[self.using]
        if connection.in_atomic_block or not connection.get_autocommit():
            return None
        placeholders = ", ".join(["%s"] * len(params))
        sets: list[tuple[list[str], list[tuple[Any, ...]]]] = []
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"CALL {name}({placeholders})", params)
                while True:
                    if cursor.description:
                        sets.append(([str(c[0]) for c in cursor.description], list(cursor.fetchall())))
                    if not cursor.nextset():  # the CALL's own status last: read, or the next query fails
                        break
        except OperationalError as exc:
            code = getattr(exc.__cause__, "args", None) or exc.args
            if code and code[0] in _MISSING:
                logger.warning("MySQL room off for database %r (%s): the ORM path", self.using, exc)
                self.usable = False
                return None
            raise
        return sets

    def settle(
        self,
        *,
        run_id: str,
        owner: str,
        status: str,
        output: Any,
        error: Any,
        finished_at: datetime | None,
        workflow_name: str,
        key: str | None,
        declared_limit: int | None,
        ttl: float | None,
        redelivery_seconds: float,
        limits: Mapping[str, int | None] | None = None,
        ttls: Mapping[str, float] | None = None,
    ) -> tuple[Run | None, list[Run], list[Run]] | None:
        """Settle a run by compare-and-set on ``owner``'s unexpired lease and hand its
        slots off, one CALL (S7, S12, R5a, K1, S13): ``ds_settle_handoff`` for a run with
        a singleton key and no quotas (``limits`` None), ``ds_settle_quotas`` for a run
        that carries quotas (X3g, X3h). ``output``/``error``: the run's end as the ORM
        writes it (JSON-able values); ``finished_at``: an aware datetime or None (the
        database's clock); ``key``: its singleton key or None (only with quotas);
        ``declared_limit``: its workflow's declared limit (needed with a key); ``ttl``:
        its ``queue_ttl`` in seconds or None (X2); ``redelivery_seconds``: the grants'
        turn window (S7a); ``limits``: with quotas, the declared limits by name (quotas
        under ``quota:<name>``); ``ttls``: with quotas, the ``queue_ttl`` seconds by
        workflow name. Returns (the settled row or None if the compare failed, the
        waiters granted or admitted, each with ``ds_tokens`` its quota tokens, the
        waiters sent a turn as they are), or None if the room is off (the caller takes
        the ORM path)."""
        first = [*self._settle_args(run_id, owner, status, output, error, finished_at), workflow_name, key]
        if limits is None:
            assert key is not None and declared_limit is not None
            name = "ds_settle_handoff"
            params = [*first, declared_limit, _microseconds(ttl), _microseconds(redelivery_seconds)]
        else:
            name = "ds_settle_quotas"
            params = [
                *first,
                declared_limit,
                _microseconds(ttl),
                _limits_json(limits),
                _ttls_json(ttls or {}),
                _microseconds(redelivery_seconds),
            ]
        sets = self._call_sets(name, params)
        return None if sets is None else _settled(self.using, sets)

    def _settle_args(
        self, run_id: str, owner: str, status: str, output: Any, error: Any, finished_at: datetime | None
    ) -> list[Any]:
        """The first arguments of both settle procedures: the run, its lease owner and its
        end as the ORM writes it (``output``/``error`` JSON-able, ``finished_at`` aware or None)."""
        connection = connections[self.using]
        fields = Run._meta
        return [
            run_id,
            owner,
            status,
            fields.get_field("output").get_db_prep_value(output, connection),
            fields.get_field("error").get_db_prep_value(error, connection),
            connection.ops.adapt_datetimefield_value(finished_at),
        ]

    def claim(
        self,
        *,
        run_id: str,
        owner: str,
        lease_seconds: float,
        limits: Mapping[str, int | None],
        ttls: Mapping[str, float],
        delays: tuple[float, float],
        redelivery_seconds: float,
    ) -> tuple[str, Run | None, list[Run]] | None:
        """``ds_claim``: a turn's claim without a read first, one CALL (S4, S5, S9, K1, X5).
        ``limits``: the declared limit of each workflow by name (None: undeclared);
        ``ttls``: the ``queue_ttl`` seconds of those that declare one (X2);
        ``delays``: the retry delays (seconds) of a parked waiter at the front and in
        the backlog; ``redelivery_seconds``: the grants' turn window (S7a). A quota
        waiter's claim, and a throttle waiter's, is ``ds_admit_quota``'s (X3c-X3i, X6b-X6d;
        its ``"admitted"`` row carries its quota tokens, :func:`tokens_of`; ``limits`` then
        holds the quotas' under ``quota:<name>`` and the throttles' under
        ``throttle:<name>``; a run parked over a throttle's rate has the park reason
        ``throttled:<name>``).
        Returns (what happened: ``"taken"``, ``"admitted"``, ``"parked"``, ``"skipped"``,
        ``"refused"`` or ``"read"``; the run's row as stored after it, None if there is
        no such run, its ``ds_due`` and ``ds_expired`` set when only read; the waiters
        granted a slot, then those sent a turn as they are), or None if the room is off."""
        sets = self._call_sets(
            "ds_claim",
            [
                run_id,
                owner,
                _microseconds(lease_seconds),
                _limits_json(limits),
                _ttls_json(ttls),
                _microseconds(delays[0]),
                _microseconds(delays[1]),
                _microseconds(redelivery_seconds),
            ],
        )
        if sets is None:
            return None
        columns, rows = sets[0]
        role = str(rows[0][0]) if rows else "read"
        roles = _by_role(self.using, sets[1:])
        run = _runs_of(self.using, columns, rows)[0] if rows else None
        return role, run, [*roles.get("granted", []), *roles.get("turn", [])]

    def take_quota_lease(
        self,
        *,
        run_id: str,
        status: str,
        attempts: int,
        cancel_requested: bool,
        owner: str,
        lease_seconds: float,
        takes_slot: bool,
    ) -> dict[str, int] | bool | None:
        """``ds_take_quota_lease``: a quota holder's confirmation, one CALL (S6, R5, R5a, X3f).
        The run as read: ``status`` (parked), ``attempts``, ``cancel_requested``;
        ``takes_slot``: it has a singleton key (it keeps that slot too). Returns its quota
        tokens by name if the lease is ours, False if the run changed under the turn
        (nothing written), None if the room is off (the caller takes the ORM path)."""
        rows = self._call(
            "ds_take_quota_lease",
            [run_id, status, attempts, cancel_requested, owner, _microseconds(lease_seconds), takes_slot],
        )
        if rows is None:
            return None
        if not rows or not rows[0][0]:
            return False
        return {str(name): int(token) for name, token in json.loads(rows[0][1] or "{}").items()}

    def _call(self, name: str, params: list[Any]) -> list[tuple[Any, ...]] | None:
        """CALL ``name`` as :meth:`_call_sets` does; return the rows of its first result
        set (none: an empty list), or None if the server refused it (the ORM path)."""
        sets = self._call_sets(name, params)
        if sets is None:
            return None
        return sets[0][1] if sets else []

    def take_lease(
        self, run: Any, *, owner: str, lease_seconds: float, recoveries: int, takes_slot: bool
    ) -> bool | None:
        """``ds_take_lease``: the lease of a run without a key or of a holder, one CALL
        (S6, R5, R5a). ``run``: the run as read (a :class:`~durable_singleton.records.RunRecord`
        or a ``Run`` row: its ``run_id``, ``status``, ``attempts``, ``cancel_requested`` and
        ``lease_owner`` are the compare); ``recoveries`` its count after this claim;
        ``takes_slot``: a holder's confirmation (it keeps its slot). Returns True if the
        lease is ours, False if the run changed under the turn, None if the room is off
        (the caller takes the ORM path)."""
        rows = self._call(
            "ds_take_lease",
            [
                run.run_id,
                run.status,
                run.attempts,
                run.cancel_requested,
                run.lease_owner,
                owner,
                round(lease_seconds * 1_000_000),
                recoveries,
                takes_slot,
            ],
        )
        if rows is None:
            return None
        return bool(rows and rows[0][0])


def _limits_json(limits: Mapping[str, int | None]) -> str:
    """The declared limits by name as the procedures read them: a JSON object, None left out."""
    return json.dumps({name: int(limit) for name, limit in limits.items() if limit is not None})


def _ttls_json(ttls: Mapping[str, float | None]) -> str:
    """The ``queue_ttl`` of each workflow as the procedures read them: microseconds, JSON (X2)."""
    return json.dumps({name: _microseconds(ttl) for name, ttl in ttls.items() if ttl is not None})


def tokens_of(run: Run) -> tuple[tuple[str, int], ...] | None:
    """The quota tokens a procedure sent with ``run`` (its ``ds_tokens`` column), sorted by
    quota name, or None if it sent none (X3f)."""
    raw = getattr(run, "tokens", None)
    if raw is None:
        return None
    return tuple(sorted((str(name), int(token)) for name, token in json.loads(raw).items()))


def _microseconds(seconds: float | None) -> int | None:
    """Seconds as whole microseconds, the unit of the procedures' intervals (None stays None)."""
    return None if seconds is None else round(float(seconds) * 1_000_000)


@cache
def _converters(using: str, column: str) -> tuple[str, list[Any], Any]:
    """The run field stored in ``column``: its attribute name, the converters Django applies
    to a value read from database ``using`` (the backend's, then the field's), its column."""
    connection = connections[using]
    field = next(f for f in Run._meta.concrete_fields if f.column == column)
    col = field.get_col(Run._meta.db_table)
    return field.attname, [*connection.ops.get_db_converters(col), *field.get_db_converters(connection)], col


def _runs_of(using: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[Run]:
    """The :class:`~durable_singleton.models.Run` of each row a procedure sent (``r.*`` and
    leading ``ds_*`` columns: ``ds_due`` and ``ds_expired`` become the row's ``due`` and
    ``lease_expired``), each value converted as the ORM converts it (JSON, booleans, aware
    datetimes)."""
    connection = connections[using]
    runs: list[Run] = []
    for values in rows:
        fields: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for column, value in zip(columns, values, strict=True):
            if column.startswith("ds_"):
                extra[column[3:]] = value
                continue
            name, converters, col = _converters(using, column)
            for convert in converters:
                value = convert(value, col, connection)
            fields[name] = value
        attnames = [f.attname for f in Run._meta.concrete_fields]
        run = Run.from_db(using, attnames, [fields.get(name, DEFERRED) for name in attnames])
        if "due" in extra:
            run.due = bool(extra["due"])  # type: ignore[attr-defined]
            run.lease_expired = bool(extra["expired"])  # type: ignore[attr-defined]
        if "tokens" in extra:
            run.tokens = extra["tokens"]  # type: ignore[attr-defined]  # tokens_of reads it
        runs.append(run)
    return runs


def _settled(using: str, sets: Any) -> tuple[Run | None, list[Run], list[Run]]:
    """A settle procedure's result sets: (the settled row or None if the compare failed,
    the waiters granted or admitted, the waiters sent a turn as they are)."""
    roles = _by_role(using, sets)
    settled = roles.get("settled", [])
    return (settled[0] if settled else None), roles.get("granted", []), roles.get("turn", [])


def _by_role(using: str, sets: Sequence[tuple[list[str], list[tuple[Any, ...]]]]) -> dict[str, list[Run]]:
    """The rows of result sets headed by ``ds_role``, as runs, by role, in the order sent."""
    found: dict[str, list[Run]] = {}
    for columns, rows in sets:
        for row in rows:
            found.setdefault(str(row[0]), []).extend(_runs_of(using, columns, [row]))
    return found


def room_of(using: str) -> Room | None:
    """Return the room of MySQL/MariaDB database ``using`` if its procedures are installed, else None
    (logged as a warning: the ORM path serves)."""
    if connections[using].vendor != "mysql":
        return None
    if installed(using):
        return Room(using)
    # Missing (migration 0016 could not create them) or invisible to this user (no EXECUTE):
    # said once per database and store, as a refused CALL is (docs/operations.rst).
    logger.warning("MySQL room off for database %r (no procedures this user may call): the ORM path", using)
    return None
