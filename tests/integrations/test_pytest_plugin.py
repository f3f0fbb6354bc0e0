"""The pytest plugin for users' tests (durable_singleton.testing.plugin).

A user's test file runs in a separate pytest process, as in a project that
installed the package: with the plugin from its ``pytest11`` entry point when
the package's metadata has it (an installed checkout), else named with ``-p``.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "durable_singleton.testing.plugin"

# The user's tests run on the in-memory store and the conformance suite on SQLite
# (DATABASE_URL is emptied for it): the same on every database pass.
pytestmark = pytest.mark.vendor_agnostic

USER_TESTS = """
import time

from durable_singleton import BaseWorkflow, Singleton, workflow
from durable_singleton import get_engine


@workflow(name="plugin-double", singleton=Singleton(key=lambda i: "one", limit=1))
def double(ctx, input):
    return input * 2


@workflow(name="plugin-nap")
def nap(ctx, input):
    ctx.sleep(0.01)
    return "rested"


class Report(BaseWorkflow):
    workflow = {"name": "plugin-report"}

    def run(self, ctx, input):
        return {"rows": input}


def test_runs_queue_per_key_and_drain_to_completion(durable_engine, durable_drain):
    assert get_engine() is durable_engine
    runs = [durable_engine.start("plugin-double", n, run_id=f"d{n}") for n in range(3)]
    assert [durable_engine.get(r.run_id).status for r in runs] == ["pending"] * 3
    assert durable_drain() >= 3
    assert [durable_engine.get(r.run_id).output for r in runs] == [0, 2, 4]


def test_each_test_gets_a_fresh_store(durable_engine):
    assert durable_engine.start("plugin-double", 1, run_id="d1").status == "pending"


def test_dispatch_goes_to_the_test_engine(durable_engine, durable_drain):
    run = Report.dispatch(3)
    durable_drain()
    assert durable_engine.get(run.run_id).output == {"rows": 3}


def test_drain_ticks_until_sleeping_runs_wake(durable_engine, durable_drain):
    run = durable_engine.start("plugin-nap")
    durable_drain(tick=False)
    assert durable_engine.get(run.run_id).status == "suspended"
    time.sleep(0.05)
    durable_drain()
    assert durable_engine.get(run.run_id).output == "rested"
"""


def _entry_point_installed() -> bool:
    return any(ep.value == PLUGIN for ep in entry_points(group="pytest11"))


def test_setup_cfg_declares_the_pytest11_entry_point() -> None:
    """The plugin is an entry point of the package, so pytest loads it in every project that installs it."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = [line.strip() for line in config["options.entry_points"]["pytest11"].splitlines() if line.strip()]
    assert lines == [f"durable_singleton = {PLUGIN}"]


def test_a_users_tests_run_workflows_on_the_fixtures(tmp_path: Path) -> None:
    """durable_engine is the default engine on a fresh in-memory store for each
    test (get_engine and Wf.dispatch reach it, R3 sees no earlier test's run);
    durable_drain runs queued turns to completion, a key's waiters in order
    (S5, S7), and ticks until a sleeping run that is due has woken (D1)."""
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", str(tmp_path)]
    if not _entry_point_installed():
        args[3:3] = ["-p", PLUGIN]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout


USER_STORES = """
from durable_singleton.stores.memory import MemoryStore


class MyStore(MemoryStore):
    '''A user's store: the in-memory one under the user's own name.'''


class CaplessStore(MemoryStore):
    '''A broken store: it ignores the queue cap.'''

    def create_run(self, run, *, cap, cap_namespace=None):
        return super().create_run(run, cap=None, cap_namespace=cap_namespace)
"""


def run_conformance(tmp_path: Path, store: str) -> subprocess.CompletedProcess[str]:
    """Run the packaged conformance suite in a separate pytest on ``--durable-store=store``."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error", "-rf"]
    if not _entry_point_installed():
        args += ["-p", PLUGIN]
    args += ["--pyargs", "durable_singleton.testing.test_store_conformance", f"--durable-store={store}"]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        # SQLite, its own test database file: never the test database of this session
        "DATABASE_URL": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_conformance_suite_runs_on_a_store_named_on_the_command_line(tmp_path: Path) -> None:
    """S13: the store conformance suite, exposed through the plugin, passes on a
    user's store class named by its dotted path and on the Django store (given
    the test database with real commits), and fails on a store that ignores the
    queue cap (S15), naming the broken rule."""
    (tmp_path / "mystores.py").write_text(USER_STORES)
    for store in ("mystores.MyStore", "django"):
        good = run_conformance(tmp_path, store)
        assert good.returncode == 0, good.stdout + good.stderr
        assert " passed" in good.stdout and "failed" not in good.stdout
    bad = run_conformance(tmp_path, "mystores.CaplessStore")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED" in bad.stdout and "cap" in bad.stdout, bad.stdout
