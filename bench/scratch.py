"""A database of its own for a scenario that leaves rows behind (``bench.depth``'s deep
queues, ``bench.rooms``' drains): on the server of a PostgreSQL or MySQL/MariaDB URL, made
empty before and dropped after, so that the ticks of the scenarios after it never see its
runs (100,000 waiters of a workflow their registries do not know)."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator


@contextlib.contextmanager
def scratch_database(url: str, name: str) -> Iterator[str]:
    """Yield the URL of the database ``name`` (letters, digits and ``_``) on ``url``'s server,
    created empty (dropped first if it was left), and drop it when the block ends. ``url``:
    ``postgres://`` or ``mysql://`` with a user that may create databases. Raises
    ``ValueError`` for another scheme or name."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"not a plain database name: {name!r}")
    parts = urllib.parse.urlsplit(url)
    scratch = parts._replace(path=f"/{name}").geturl()
    if parts.scheme in ("postgres", "postgresql"):
        import psycopg

        def run(*statements: str) -> None:
            with psycopg.connect(url, autocommit=True) as server:
                for statement in statements:
                    server.execute(statement)  # type: ignore[arg-type]

        drop, create = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'
    elif parts.scheme == "mysql":
        import MySQLdb

        def run(*statements: str) -> None:
            server = MySQLdb.connect(
                host=parts.hostname or "127.0.0.1",
                port=parts.port or 3306,
                user=urllib.parse.unquote(parts.username or ""),
                password=urllib.parse.unquote(parts.password or ""),
            )
            try:
                cursor = server.cursor()
                for statement in statements:
                    cursor.execute(statement)
            finally:
                server.close()

        drop = f"DROP DATABASE IF EXISTS `{name}`"
        create = f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"
    else:
        raise ValueError(f"not a PostgreSQL or MySQL URL: {parts.scheme!r}")
    run(drop, create)
    try:
        yield scratch
    finally:
        run(drop)
