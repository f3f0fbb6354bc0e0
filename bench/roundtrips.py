"""Count the round trips one Django connection makes to its database, whatever sends them.

``with RoundTrips(connection) as trips: ...`` counts every request the
connection's driver sent to the server and got an answer to while the block
ran: ORM queries, raw SQL through ``connection.cursor()``, statements sent
through the driver's own connection object (``connection.connection``), and
the transaction control the driver sends by itself (``BEGIN``, ``COMMIT``,
``SET autocommit``). Django's ``CaptureQueriesContext`` sees only what goes
through Django's cursor wrapper; this counts on the connection itself:

* PostgreSQL (psycopg 3): libpq's protocol trace of the connection
  (``PGconn.trace``); one round trip is one ``ReadyForQuery`` from the server
  (a simple query, or a Parse/Bind/Execute/Sync exchange). A PL/pgSQL
  function call is one round trip, whatever it runs inside.
* MySQL/MariaDB: the session's ``Questions`` status counter (every statement
  a client sent, stored programs' own statements excluded), read before and
  after; the reads themselves are subtracted.
* SQLite: ``sqlite3.Connection.set_trace_callback``, one per statement the
  library runs (SQLite has no server: a "round trip" is one statement).

Only this connection is counted (another thread's or process's are not), so
the counts hold while workers run elsewhere. The block must not open a new
connection (the counter is attached to the one open at entry; it opens it if
needed).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import Counter
from types import TracebackType
from typing import Any

#: Statements that only steer a transaction (counted in ``control``).
_CONTROL = re.compile(r"^\s*(BEGIN|START TRANSACTION|COMMIT|ROLLBACK|SAVEPOINT|RELEASE|SET\s+autocommit)\b", re.I)
_PG_SENT = re.compile(r'^F\t\d+\t(Query|Parse)\t (?:"[^"]*" )?"(.*)"', re.S)


def is_control(sql: str) -> bool:
    """Tell whether ``sql`` is transaction control (BEGIN, COMMIT, ROLLBACK, savepoints, SET autocommit)."""
    return bool(_CONTROL.match(sql))


class RoundTrips:
    """Round trips of one Django connection while a ``with`` block runs.

    After the block: ``total`` (round trips), ``control`` (those that were
    transaction control: BEGIN, COMMIT, ROLLBACK, savepoints, SET autocommit;
    PostgreSQL and SQLite only, MariaDB's from its ``Com_*`` counters) and
    ``statements`` (the SQL text of each, PostgreSQL and SQLite only).
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.vendor: str = connection.vendor
        self.total = 0
        self.control = 0
        self.statements: list[str] = []
        self._trace: Any = None
        self._before: dict[str, int] = {}

    # -- MySQL / MariaDB ---------------------------------------------------

    _MYSQL_VARS = ("Questions", "Com_begin", "Com_commit", "Com_rollback", "Com_savepoint", "Com_set_option")

    def _mysql_status(self) -> dict[str, int]:
        raw = self.connection.connection
        cursor = raw.cursor()
        try:
            names = ", ".join(f"'{n}'" for n in self._MYSQL_VARS)
            cursor.execute(f"SHOW SESSION STATUS WHERE Variable_name IN ({names})")
            return {str(name): int(value) for name, value in cursor.fetchall()}
        finally:
            cursor.close()

    # -- the context manager ----------------------------------------------

    def __enter__(self) -> RoundTrips:
        self.connection.ensure_connection()
        raw = self.connection.connection
        if self.vendor == "postgresql":
            self._trace = tempfile.TemporaryFile()
            raw.pgconn.trace(self._trace.fileno())
            from psycopg import pq

            raw.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        elif self.vendor == "mysql":
            self._before = self._mysql_status()
        elif self.vendor == "sqlite":
            raw.set_trace_callback(self.statements.append)
        else:
            raise NotImplementedError(f"round trips on {self.vendor}")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        raw = self.connection.connection
        if self.vendor == "postgresql":
            raw.pgconn.untrace()
            self._trace.seek(0)
            text = self._trace.read().decode("utf-8", "replace")
            self._trace.close()
            lines = text.split("\n")
            self.total = sum(1 for line in lines if line.startswith("B\t") and "\tReadyForQuery\t" in line)
            for line in lines:
                sent = _PG_SENT.match(line)
                if sent:
                    self.statements.append(sent.group(2))
            self.control = sum(1 for s in self.statements if is_control(s))
        elif self.vendor == "mysql":
            after = self._mysql_status()
            delta = Counter({k: after[k] - self._before.get(k, 0) for k in after})
            # The second SHOW STATUS is counted in Questions (the first one is not, it ran before).
            self.total = delta["Questions"] - 1
            self.control = sum(delta[k] for k in self._MYSQL_VARS[1:])
        elif self.vendor == "sqlite":
            raw.set_trace_callback(None)
            self.total = len(self.statements)
            self.control = sum(1 for s in self.statements if is_control(s))

    def as_dict(self) -> dict[str, Any]:
        """Return the counts as plain data."""
        return {"round_trips": self.total, "transaction_control": self.control}


def _self_check() -> None:  # python -m bench.roundtrips: a quick look on DATABASE_URL
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()
    from django.db import connection, transaction

    with RoundTrips(connection) as trips, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    print(connection.vendor, trips.as_dict(), trips.statements)


if __name__ == "__main__":
    _self_check()
