"""The soak's driver (soak/driver.py) runs on each of the three databases.

Issue #32 asks for the chaos soak on PostgreSQL, MariaDB and SQLite: ``--db
sqlite`` is a file in the soak's output folder, with the faults of the workers
and the broker and none of a server's (S5, S9, R5, K1 are judged by the same
checker on every database). Arguments and files only: no workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from soak.driver import DATABASES, SqliteFile, fault_kinds, parse

pytestmark = pytest.mark.vendor_agnostic

WORKER_AND_BROKER_FAULTS = {"kill_pool", "kill_worker", "freeze_short", "freeze_past_lease", "redis_restart"}


@pytest.mark.parametrize("database", ["postgresql", "mariadb", "sqlite"])
def test_each_database_is_a_choice_of_db(database: str) -> None:
    """``python -m soak --db sqlite`` is accepted beside the two servers (issue #32)."""
    assert database in DATABASES
    assert parse(["--db", database, "--seed", "1"]).db == database


def test_sqlite_gets_the_worker_and_broker_faults_and_no_server_fault() -> None:
    """S5, S9, R5: a SQLite file takes every fault of the workers and the broker
    (kills, freezes within and past the lease, a Redis restart); it has no
    server, so no connection is killed and nothing restarted."""
    assert set(fault_kinds("sqlite")) == WORKER_AND_BROKER_FAULTS
    assert set(fault_kinds("postgresql")) == WORKER_AND_BROKER_FAULTS | {"db_kill_connections"}
    assert set(fault_kinds("mariadb")) == WORKER_AND_BROKER_FAULTS | {"db_kill_connections", "db_restart"}


def test_the_sqlite_file_lives_in_the_output_folder_and_starts_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is named by an absolute URL (the workers start in the project's
    folder), and a file left in the folder by an earlier soak, with its WAL,
    is removed, so the checker never judges an older soak's rows."""
    monkeypatch.chdir(tmp_path)
    Path("out").mkdir()
    for name in ("soak.sqlite3", "soak.sqlite3-wal", "soak.sqlite3-shm"):
        (tmp_path / "out" / name).write_bytes(b"an earlier soak")
    sqlite = SqliteFile(Path("out") / "soak.sqlite3")
    assert sqlite.url == f"sqlite:///{tmp_path / 'out' / 'soak.sqlite3'}"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
