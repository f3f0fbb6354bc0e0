"""Gate tests: system checks (section 7), migrations, import without Django."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from django.core.management import call_command

from durable_singleton import checks

ROOT = Path(__file__).resolve().parent.parent


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


def test_unknown_setting_and_bad_lease_are_errors(settings: Any) -> None:
    settings.DURABLE_SINGLETON = {"LEASE_SECONDS": 5, "LEASE_RENEW_SECONDS": 5}
    assert [m.id for m in checks.check_settings()] == ["durable_singleton.E004"]
    settings.DURABLE_SINGLETON = {"LEASE_SECOND": 5}
    messages = checks.check_settings()
    assert [m.id for m in messages] == ["durable_singleton.E001"] and "LEASE_SECOND" in messages[0].msg
