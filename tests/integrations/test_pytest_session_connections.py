"""A user's test session that used the engine's threads ends with its test
database dropped (O1; #34 item 3): every thread the package starts (the
embedded worker's workers and tick, the lease renewer, the send buffer) closes
its Django connections when it stops, and the pytest plugin stops them before
pytest-django drops the test database. On PostgreSQL a connection left open
fails that drop ("being accessed by other users")."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "durable_singleton.testing.plugin"

SETTINGS = """
from testproject.settings import *  # noqa: F403

# Persistent connections, as many projects have them: a thread's connection
# outlives its unit of work unless the thread closes it.
DATABASES["default"]["CONN_MAX_AGE"] = 60  # noqa: F405
# Its own test database: never the one of the session that runs this file.
DATABASES["default"]["TEST"] = {"NAME": "test_durable_user_session"}  # noqa: F405
DURABLE_SINGLETON = {
    **DURABLE_SINGLETON,  # noqa: F405
    "DISPATCH": "thread",
    "LEASE_SECONDS": 5.0,
    "LEASE_RENEW_SECONDS": 0.2,
    "TICK_SECONDS": 0.2,
}
"""

USER_TESTS = """
import time

import pytest

from durable_singleton import get_engine, workflow
from durable_singleton.worker import start_embedded_worker


@workflow(name="session-nap")
def nap(ctx, input):
    time.sleep(1.0)  # past several renewals: the renewer thread opens its connection
    return "rested"


@pytest.mark.django_db(transaction=True)
def test_a_run_on_the_embedded_worker():
    assert start_embedded_worker(force=True)
    engine = get_engine()
    engine.start("session-nap", {}, run_id="nap-1")
    deadline = time.monotonic() + 60
    while engine.get("nap-1").status != "completed":
        assert time.monotonic() < deadline, engine.get("nap-1").status
        time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_session_that_used_the_embedded_worker_drops_its_test_database(tmp_path: Path) -> None:
    """O1, R5 (#34 item 3): a user's test starts the embedded worker on the
    Django store with persistent connections and runs a body long enough to be
    renewed, and leaves everything running; the session ends with pytest-django
    dropping its test database, without "being accessed by other users"."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(("postgres", "pgsql")):
        pytest.skip("the drop of a database in use fails on PostgreSQL only")
    (tmp_path / "session_settings.py").write_text(SETTINGS)
    (tmp_path / "test_user_session.py").write_text(USER_TESTS)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)]
    if not any(ep.value == PLUGIN for ep in entry_points(group="pytest11")):
        args[3:3] = ["-p", PLUGIN]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "session_settings",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 passed" in done.stdout, out
    assert "being accessed by other users" not in out and "error" not in done.stdout.lower(), out
