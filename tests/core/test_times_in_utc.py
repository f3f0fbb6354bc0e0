"""Adversarial: stored times must be UTC, the zone of the database clock (R5, S13a, D5)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from durable_singleton import checks
from durable_singleton.definitions import Registry
from durable_singleton.testing import make_engine


def vendor_is_postgresql() -> bool:
    from django.db import connection

    return bool(connection.vendor == "postgresql")


@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(vendor_is_postgresql(), reason="PostgreSQL stores time zones natively")
def test_naive_local_times_break_deadlines_so_a_check_refuses_them() -> None:
    """R5, D5, S13a: with USE_TZ = False and TIME_ZONE = 'America/New_York',
    Django stores naive local times while leases, wake times and deadlines are
    compared with the database's UTC clock: a run with a one-hour timeout was
    cancelled with ``execution_timeout`` at the first tick. The configuration
    is refused by system check E012."""
    registry = Registry()
    registry.add("slow", "1", lambda ctx, i: ctx.sleep(600), timeout=3600)
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        assert [m.id for m in checks.check_time_zone()] == ["durable_singleton.E012"]
        engine = make_engine("django", registry=registry)
        engine.start("slow", {}, run_id="A")
        engine.dispatcher.drain()
        engine.tick()
        # What the check guards against: the deadline is judged five hours early.
        assert engine.get("A").status == "cancelled"
    assert checks.check_time_zone() == []


def test_a_database_time_zone_other_than_utc_is_refused(settings: Any) -> None:
    """R5, S13a: on SQLite and MySQL/MariaDB, DATABASES[...]['TIME_ZONE'] makes
    Django store times in that zone, off from the UTC clock every comparison
    uses: system check E013. PostgreSQL stores time zones natively."""
    from django.db import connections

    db = connections.settings["default"]
    saved = dict(db)
    try:
        for engine in ("django.db.backends.sqlite3", "django.db.backends.mysql"):
            db.update({"ENGINE": engine, "TIME_ZONE": "Europe/Paris"})
            assert [m.id for m in checks.check_time_zone()] == ["durable_singleton.E013"]
            db["TIME_ZONE"] = "UTC"
            assert checks.check_time_zone() == []
            with override_settings(USE_TZ=False):
                db["TIME_ZONE"] = None
                assert [m.id for m in checks.check_time_zone()] == ["durable_singleton.E012"]
        db.update({"ENGINE": "django.db.backends.postgresql", "TIME_ZONE": "Europe/Paris"})
        assert checks.check_time_zone() == []
        with override_settings(USE_TZ=False):
            assert checks.check_time_zone() == []
    finally:
        db.clear()
        db.update(saved)
