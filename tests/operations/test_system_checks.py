"""Gate tests: system checks (section 7), migrations, import without Django."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from durable_singleton import checks
from durable_singleton.conf import Settings
from durable_singleton.exceptions import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]


def test_manage_py_check_passes(db: None) -> None:
    call_command("check", "--fail-level", "WARNING")


def test_migrations_are_complete(db: None) -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_package_imports_without_django_configured() -> None:
    code = (
        "import durable_singleton as d; "
        "assert d.Singleton and d.BaseWorkflow and d.workflow and d.step; "
        "from durable_singleton import admission, exceptions, definitions; print('ok')"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_sqlite_without_immediate_mode_is_an_error(settings: Any) -> None:
    """F16, S13: an unsafe SQLite configuration is refused by a system check."""
    from django.db import connections

    db = connections.settings["default"]
    saved = dict(db)
    try:
        db.update({"ENGINE": "django.db.backends.sqlite3", "OPTIONS": {}})
        ids = [m.id for m in checks.check_sqlite()]
        assert ids == ["durable_singleton.E010"]
        db["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}
        assert checks.check_sqlite() == []
    finally:
        db.clear()
        db.update(saved)


def test_missing_tick_and_non_json_serializer_are_reported(settings: Any) -> None:
    from celery import current_app

    conf = current_app.conf
    saved = (conf.beat_schedule, conf.task_serializer)
    try:
        conf.beat_schedule = {}
        conf.task_serializer = "pickle"
        ids = sorted(m.id for m in checks.check_celery())
        assert ids == ["durable_singleton.E020", "durable_singleton.W001"]
    finally:
        conf.beat_schedule, conf.task_serializer = saved
    assert checks.check_celery() == []


def test_the_default_beat_schedule_passes_while_worker_ticks_run(settings: Any) -> None:
    """O5: ``beat_schedule()`` sends the tick to the default queue (no extra
    worker needed): while each Celery worker's main process ticks
    (``CELERY_WORKER_TICK``, the default) that is no warning."""
    from celery import current_app

    from durable_singleton.tasks import beat_schedule

    conf = current_app.conf
    saved = conf.beat_schedule
    try:
        conf.beat_schedule = beat_schedule()
        assert "queue" not in conf.beat_schedule["durable-singleton-tick"]["options"]  # type: ignore[operator]
        assert checks.check_celery() == []
        conf.beat_schedule = beat_schedule(queue="durable_tick")
        assert conf.beat_schedule["durable-singleton-tick"]["options"]["queue"] == "durable_tick"  # type: ignore[index]
        assert checks.check_celery() == []
    finally:
        conf.beat_schedule = saved


def test_a_tick_on_the_turns_queue_without_worker_ticks_is_a_warning(settings: Any) -> None:
    """O5: with the workers' tick threads off (``CELERY_WORKER_TICK`` False),
    a beat entry that sends the tick to a queue turns also go to (the
    default queue, by the entry's options or by ``task_routes``) lets bodies
    that hold every worker slot hold up the tick: W003. A queue of its own
    passes, and so does any queue while the tick threads run."""
    from celery import current_app

    from durable_singleton.tasks import TICK_TASK, beat_schedule

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "CELERY_WORKER_TICK": False}
    conf = current_app.conf
    saved = (conf.beat_schedule, conf.task_routes)
    try:
        conf.beat_schedule = {"tick": {"task": TICK_TASK, "schedule": 1.0}}
        messages = checks.check_celery()
        assert [m.id for m in messages] == ["durable_singleton.W003"]
        assert "'celery'" in messages[0].msg and "CELERY_WORKER_TICK" in str(messages[0].hint)
        conf.beat_schedule = beat_schedule()
        assert [m.id for m in checks.check_celery()] == ["durable_singleton.W003"]
        conf.beat_schedule = {"tick": {"task": TICK_TASK, "schedule": 1.0, "options": {"queue": "celery"}}}
        assert [m.id for m in checks.check_celery()] == ["durable_singleton.W003"]
        conf.beat_schedule = {"tick": {"task": TICK_TASK, "schedule": 1.0}}
        conf.task_routes = {TICK_TASK: {"queue": "ticks"}}
        current_app.amqp.flush_routes()  # Celery reads task_routes once
        assert checks.check_celery() == []
        conf.task_routes = None
        current_app.amqp.flush_routes()
        conf.beat_schedule = beat_schedule(queue="durable_tick")
        assert checks.check_celery() == []
        settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "CELERY_WORKER_TICK": True}
        conf.beat_schedule = {"tick": {"task": TICK_TASK, "schedule": 1.0}}
        assert checks.check_celery() == []
    finally:
        conf.beat_schedule, conf.task_routes = saved
        current_app.amqp.flush_routes()


def test_unknown_setting_and_bad_lease_are_errors(settings: Any) -> None:
    settings.DURABLE_SINGLETON = {"LEASE_SECONDS": 5, "LEASE_RENEW_SECONDS": 5}
    assert [m.id for m in checks.check_settings()] == ["durable_singleton.E004"]
    settings.DURABLE_SINGLETON = {"LEASE_SECOND": 5}
    messages = checks.check_settings()
    assert [m.id for m in messages] == ["durable_singleton.E001"] and "LEASE_SECOND" in messages[0].msg


def test_each_bad_setting_is_one_e001_with_a_hint(settings: Any) -> None:
    """Section 7, O1: a value of the wrong type or range and an unknown key are
    each reported as durable_singleton.E001 with a hint, not a traceback."""
    settings.DURABLE_SINGLETON = {
        "LEASE_SECONDS": "30",
        "TICK_SECONDS": -1,
        "WORKER_THREADS": 0,
        "SCOPE_READS": "yes",
        "MAX_RECOVERIES": True,
        "RETENTION_SECONDS": 0,
        "NOPE": 1,
    }
    messages = checks.check_settings()
    assert {m.id for m in messages} == {"durable_singleton.E001"} and all(m.hint for m in messages)
    assert len(messages) == 7, [m.msg for m in messages]
    text = " ".join(m.msg for m in messages)
    for name in ("LEASE_SECONDS", "TICK_SECONDS", "WORKER_THREADS", "SCOPE_READS", "MAX_RECOVERIES", "NOPE"):
        assert name in text
    # The other checks do not crash on the invalid settings either.
    assert checks.check_sqlite() == [] and checks.check_celery() == []


def test_valid_numbers_none_and_bounds_pass(settings: Any) -> None:
    """Ints where floats are expected, None where allowed, and values at an
    inclusive bound are accepted."""
    settings.DURABLE_SINGLETON = {
        "LEASE_SECONDS": 30,
        "LEASE_RENEW_SECONDS": 10,
        "REDELIVERY_SECONDS": 0,
        "RETENTION_SECONDS": None,
        "DATABASE": None,
        "MAX_RECOVERIES": 0,
    }
    assert checks.check_settings() == []


def test_lease_renewal_not_below_lease_is_e004_and_bad_types_skip_it(settings: Any) -> None:
    settings.DURABLE_SINGLETON = {"LEASE_SECONDS": 10, "LEASE_RENEW_SECONDS": 10}
    assert [m.id for m in checks.check_settings()] == ["durable_singleton.E004"]
    settings.DURABLE_SINGLETON = {"LEASE_SECONDS": "10", "LEASE_RENEW_SECONDS": 10}
    assert [m.id for m in checks.check_settings()] == ["durable_singleton.E001"]


def test_manage_py_check_reports_a_string_lease_without_a_traceback() -> None:
    """Section 7: ``manage.py check`` with LEASE_SECONDS="30" prints E001 and exits 1."""
    code = (
        "import django, os, sys; os.environ['DJANGO_SETTINGS_MODULE'] = 'testproject.settings'; "
        "from django.conf import settings; django.setup(); "
        "settings.DURABLE_SINGLETON = {'LEASE_SECONDS': '30'}; "
        "from django.core.management import execute_from_command_line; "
        "execute_from_command_line(['manage.py', 'check'])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "durable_singleton.E001" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "HINT" in done.stderr


def test_manage_py_check_of_the_test_project_with_a_bad_setting_prints_e001_not_a_traceback(tmp_path: Path) -> None:
    """Section 7 (#34 item 4): with ``DURABLE_SINGLETON = {"LEASE_SECONDS": "30"}``
    in the settings module itself, ``manage.py check`` of the test project
    prints E001 and exits 1: no module of the project or the package reads the
    settings at import (the test project is what users copy)."""
    (tmp_path / "bad_lease_settings.py").write_text(
        "from testproject.settings import *  # noqa: F403\n"
        "DURABLE_SINGLETON = {**DURABLE_SINGLETON, 'LEASE_SECONDS': '30'}  # noqa: F405\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bad_lease_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "durable_singleton.E001" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_pickle_in_accept_content_is_e020(settings: Any) -> None:
    """Section 7: a worker accepting pickle is an error even with a JSON serializer."""
    from celery import current_app

    conf = current_app.conf
    saved = conf.accept_content
    try:
        conf.accept_content = ["json", "pickle"]
        messages = checks.check_celery()
        assert [m.id for m in messages] == ["durable_singleton.E020"] and "pickle" in messages[0].msg
        conf.accept_content = ["application/json"]
        assert checks.check_celery() == []
    finally:
        conf.accept_content = saved


def test_settings_from_mapping_refuses_what_e001_reports() -> None:
    """Section 7: bad input raises a typed error instead of failing later."""
    with pytest.raises(ConfigurationError, match="TICK_SECONDS"):
        Settings.from_mapping({"TICK_SECONDS": -1})
    assert Settings.from_mapping({"RETENTION_SECONDS": None}).RETENTION_SECONDS is None


@pytest.mark.parametrize(
    "store",
    ["django", "memory", "tests.codec_stores.EncryptedDjangoStore", "durable_singleton.stores.memory.MemoryStore"],
)
def test_every_store_the_runtime_builds_passes_e002(settings: Any, store: str, monkeypatch: Any) -> None:
    """Section 7, S13 (#16 defect 5): E002 and the composition root resolve STORE
    in one place, so the dotted path docs/codec.rst tells users to set passes
    ``manage.py check`` as it passes ``build_store``."""
    from cryptography.fernet import Fernet

    from durable_singleton.runtime import build_store
    from durable_singleton.stores.base import BaseStore
    from tests import codec_stores

    monkeypatch.setattr(codec_stores, "KEYS", [Fernet.generate_key()])
    settings.DURABLE_SINGLETON = {"STORE": store}
    assert [m.id for m in checks.check_settings()] == []
    assert isinstance(build_store(Settings.from_mapping({"STORE": store})), BaseStore)


@pytest.mark.parametrize(
    ("store", "why"),
    [
        ("no_such_module.Store", "dotted path"),
        ("sqlite", "dotted path"),
        ("durable_singleton.conf.Settings", "not a BaseStore subclass"),
        ("durable_singleton.stores.base.BaseStore", "abstract"),
    ],
)
def test_a_store_the_runtime_refuses_is_e002(settings: Any, store: str, why: str) -> None:
    """Section 7, S13 (#16 defect 5): what ``build_store`` refuses with a
    ConfigurationError is E002, with the same message."""
    from durable_singleton.runtime import build_store

    settings.DURABLE_SINGLETON = {"STORE": store}
    messages = checks.check_settings()
    assert [m.id for m in messages] == ["durable_singleton.E002"] and why in messages[0].msg, messages
    with pytest.raises(ConfigurationError, match=why):
        build_store(Settings.from_mapping({"STORE": store}))


@pytest.mark.parametrize("dispatch", ["thread", "manual"])
def test_a_remote_workflow_without_celery_dispatch_is_e005(settings: Any, dispatch: str) -> None:
    """Section 2, section 7 (#18 item 11): a remote workflow's turns are sent to
    its Celery queue; with DISPATCH "thread" or "manual" they reach this process,
    which has no body and hands them back to itself without end. The check
    names each remote workflow and its queue; with Celery it says nothing."""
    from durable_singleton.definitions import Registry

    remote = Registry()
    remote.add("elsewhere", "1", None, queue="other-service", remote=True, origin="remote:other-service")
    remote.add("local-body", "1", lambda ctx, i: i)
    settings.DURABLE_SINGLETON = {"DISPATCH": dispatch}
    messages = checks.check_remote_workflows(registry=remote)
    assert [m.id for m in messages] == ["durable_singleton.E005"], messages
    assert (
        "'elsewhere'" in messages[0].msg and "other-service" in messages[0].msg and "local-body" not in messages[0].msg
    )
    assert messages[0].hint
    settings.DURABLE_SINGLETON = {"DISPATCH": "celery"}
    assert checks.check_remote_workflows(registry=remote) == []


def test_the_foreground_worker_refuses_a_remote_workflow(settings: Any) -> None:
    """Section 2, O1 (#18 item 11): ``durable_worker`` runs turns on its own
    threads whatever DISPATCH says, so a remote workflow's turns would bounce
    there too: it refuses to start, naming the workflow (the test project
    declares ``remote-sync`` on queue ``remote``)."""
    from django.core.management import CommandError

    with pytest.raises(CommandError, match=r"remote-sync.*remote"):
        call_command("durable_worker", "--threads", "1")


def test_a_coalescing_window_past_the_redelivery_window_is_an_error(settings: Any) -> None:
    """S8, #17: a first turn held back DISPATCH_COALESCE_SECONDS would be sent
    again by the tick once REDELIVERY_SECONDS passed: E006; a window of a few
    milliseconds (the default) or 0 is fine."""
    settings.DURABLE_SINGLETON = {"DISPATCH_COALESCE_SECONDS": 5.0, "REDELIVERY_SECONDS": 5.0}
    assert [m.id for m in checks.check_settings()] == ["durable_singleton.E006"]
    settings.DURABLE_SINGLETON = {"DISPATCH_COALESCE_SECONDS": 0.0}
    assert checks.check_settings() == []
    settings.DURABLE_SINGLETON = {}
    assert checks.check_settings() == []


def test_a_queue_ttl_at_most_the_redelivery_window_is_w002(settings: Any) -> None:
    """X2, F4, section 7: a start's first turn that does not arrive (a shell
    start beside ``durable_worker``, a lost broker send) is sent again after
    REDELIVERY_SECONDS; a queue_ttl no longer than that ends such a run
    ``queue_ttl_expired`` on an idle key (found by a new user). The check
    names each such workflow; a longer TTL or none says nothing."""
    from durable_singleton.definitions import Registry

    reg = Registry()
    reg.add("short", "1", lambda ctx, i: i, singleton={"key": lambda i: "k", "queue_ttl": 3})
    reg.add("long", "1", lambda ctx, i: i, singleton={"key": lambda i: "k", "queue_ttl": 60})
    reg.add("none", "1", lambda ctx, i: i, singleton={"key": lambda i: "k"})
    settings.DURABLE_SINGLETON = {"REDELIVERY_SECONDS": 5.0}
    messages = checks.check_queue_ttls(registry=reg)
    assert [m.id for m in messages] == ["durable_singleton.W002"], messages
    assert "'short'" in messages[0].msg and "'long'" not in messages[0].msg and messages[0].hint
    settings.DURABLE_SINGLETON = {"REDELIVERY_SECONDS": 2.0}
    assert checks.check_queue_ttls(registry=reg) == []
