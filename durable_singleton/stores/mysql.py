"""The MariaDB/MySQL room: the hot transactions as stored procedures, one CALL each.

The decisions are the ORM path's (:mod:`durable_singleton.stores.django`); this
room carries some of them out in fewer round trips. Each procedure lives in a
named block of ``durable_singleton/sql/mysql/*.sql`` (``-- name: <procedure>``),
created by migration ``0016_mysql_procedures`` on MySQL/MariaDB only
(:func:`install`). Today: ``ds_take_lease``, the claim of a run that needs no
admission (a run without a key, a holder's confirmation, S6): the row lock and
the compare-and-set in one CALL instead of five round trips (``SET autocommit``,
the lock, the update, ``COMMIT``, ``SET autocommit``).

Where the procedures are missing (the database user could not create them,
docs/operations.rst) or cannot be called (no ``EXECUTE``), the store takes
the ORM path: :class:`Room` is None for that database, or turns itself off at
the first refusal and the claim is made on the ORM path (the S14-style fallback).
"""

from __future__ import annotations

import logging
import re
from functools import cache
from pathlib import Path
from typing import Any

from django.db import OperationalError, connections

__all__ = [
    "NOT_ALLOWED",
    "PROCEDURES",
    "Room",
    "install",
    "installed",
    "not_allowed",
    "room_of",
    "statements",
    "uninstall",
]

logger = logging.getLogger(__name__)

SQL_DIR = Path(__file__).resolve().parent.parent / "sql" / "mysql"

#: The procedures this room calls, in the order migration 0016 creates them.
PROCEDURES = ("ds_take_lease",)

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.M)
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
    """Return the named blocks of ``sql/mysql/*.sql`` by name: each block's text, its
    ``-- name:`` line and the comment lines under it included, up to the next block."""
    found: dict[str, str] = {}
    for path in sorted(SQL_DIR.glob("*.sql")):
        text = path.read_text(encoding="utf-8")
        marks = list(_NAME.finditer(text))
        for mark, following in zip(marks, [*marks[1:], None], strict=True):
            end = following.start() if following is not None else len(text)
            found[mark.group(1)] = text[mark.start() : end].strip() + "\n"
    return found


def install(connection: Any) -> None:
    """Create (or replace) the room's procedures on ``connection`` (migration 0016).

    MySQL/MariaDB only; each procedure is dropped first, so a later migration that
    changes one runs this again. Needs the ``CREATE ROUTINE`` and ``ALTER ROUTINE``
    privileges (docs/operations.rst)."""
    with connection.cursor() as cursor:
        for name in PROCEDURES:
            cursor.execute(f"DROP PROCEDURE IF EXISTS {name}")
            cursor.execute(statements()[name])


def uninstall(connection: Any) -> None:
    """Drop the room's procedures (migration 0016 reversed): the store takes the ORM path."""
    with connection.cursor() as cursor:
        for name in PROCEDURES:
            cursor.execute(f"DROP PROCEDURE IF EXISTS {name}")


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

    def _call(self, name: str, params: list[Any]) -> list[tuple[Any, ...]] | None:
        """CALL ``name`` outside any transaction of the caller's (the procedure commits its
        own); return its result rows, or None if the server refused it (the ORM path)."""
        connection = connections[self.using]
        placeholders = ", ".join(["%s"] * len(params))
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"CALL {name}({placeholders})", params)
                rows = list(cursor.fetchall())
                while cursor.nextset():  # the CALL's own status: read, or the next query fails
                    pass
        except OperationalError as exc:
            code = getattr(exc.__cause__, "args", None) or exc.args
            if code and code[0] in _MISSING:
                logger.warning("MySQL room off for database %r (%s): the ORM path", self.using, exc)
                self.usable = False
                return None
            raise
        return rows

    def take_lease(
        self,
        *,
        run_id: str,
        status: str,
        attempts: int,
        cancel_requested: bool,
        lease_owner: str | None,
        owner: str,
        lease_seconds: float,
        recoveries: int,
        takes_slot: bool,
    ) -> bool | None:
        """``ds_take_lease``: the lease of a run without a key or of a holder, one CALL
        (S6, R5, R5a). The run as read: ``status``, ``attempts``, ``cancel_requested``,
        ``lease_owner``; ``recoveries`` its count after this claim; ``takes_slot``: a
        holder's confirmation (it keeps its slot). Returns True if the lease is ours,
        False if the run changed under the turn, None if the room is off (the caller
        takes the ORM path)."""
        rows = self._call(
            "ds_take_lease",
            [
                run_id,
                status,
                attempts,
                cancel_requested,
                lease_owner,
                owner,
                round(lease_seconds * 1_000_000),
                recoveries,
                takes_slot,
            ],
        )
        if rows is None:
            return None
        return bool(rows and rows[0][0])


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
