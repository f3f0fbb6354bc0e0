"""Django system checks (ids ``durable_singleton.E0xx`` / ``W0xx``), SPEC section 7."""

from __future__ import annotations

from typing import Any

from django.core import checks

__all__ = ["check_celery", "check_settings", "check_sqlite", "register"]


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E001: ``DURABLE_SINGLETON`` must parse."""
    from .conf import get_settings
    from .exceptions import ConfigurationError

    try:
        settings = get_settings()
    except ConfigurationError as exc:
        return [checks.Error(str(exc), hint="Fix the DURABLE_SINGLETON setting.", id="durable_singleton.E001")]
    errors: list[checks.CheckMessage] = []
    if settings.STORE not in ("django", "memory"):
        errors.append(
            checks.Error(
                f"STORE {settings.STORE!r} is unknown.", hint="Use 'django' or 'memory'.", id="durable_singleton.E002"
            )
        )
    if settings.DISPATCH not in ("celery", "thread", "manual"):
        errors.append(
            checks.Error(
                f"DISPATCH {settings.DISPATCH!r} is unknown.",
                hint="Use 'celery', 'thread' or 'manual'.",
                id="durable_singleton.E003",
            )
        )
    if settings.LEASE_RENEW_SECONDS >= settings.LEASE_SECONDS:
        errors.append(
            checks.Error(
                "LEASE_RENEW_SECONDS must be smaller than LEASE_SECONDS.",
                hint="Renew at most every third of the lease (docs/durability.rst).",
                id="durable_singleton.E004",
            )
        )
    return errors


def check_sqlite(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E010: SQLite needs ``transaction_mode = IMMEDIATE`` for a safe claim (S13, F16)."""
    from django.db import connections

    from .conf import get_settings

    settings = get_settings()
    if settings.STORE != "django":
        return []
    alias = settings.DATABASE or "default"
    if alias not in connections.settings:
        return [checks.Error(f"DATABASE {alias!r} is not in DATABASES.", id="durable_singleton.E011")]
    db = connections.settings[alias]
    if db.get("ENGINE", "").endswith("sqlite3"):
        mode = str(db.get("OPTIONS", {}).get("transaction_mode", "")).upper()
        if mode != "IMMEDIATE":
            return [
                checks.Error(
                    f"SQLite database {alias!r} runs transactions in DEFERRED mode: concurrent claims "
                    "can fail with 'database is locked'.",
                    hint="Set DATABASES[...]['OPTIONS'] = {'transaction_mode': 'IMMEDIATE', 'timeout': 20}.",
                    id="durable_singleton.E010",
                )
            ]
    return []


def check_celery(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """W001: the tick is missing from the beat schedule; E020: non-JSON serializer."""
    from .conf import get_settings

    if get_settings().DISPATCH != "celery":
        return []
    try:
        from celery import current_app
    except ImportError:  # pragma: no cover - celery is a dependency
        return [checks.Error("DISPATCH is 'celery' but Celery is not installed.", id="durable_singleton.E021")]
    from .tasks import TICK_TASK

    conf = current_app.conf
    messages: list[checks.CheckMessage] = []
    schedule = conf.beat_schedule or {}
    if not any(entry.get("task") == TICK_TASK for entry in schedule.values()):
        messages.append(
            checks.Warning(
                "The durable_singleton tick is not in the Celery beat schedule: lost wake-ups, "
                "timers and recoveries will not be driven.",
                hint=(
                    "app.conf.beat_schedule.update(durable_singleton.tasks.beat_schedule()), or set "
                    "DURABLE_SINGLETON = {'DISPATCH': 'thread'} for the embedded in-process worker."
                ),
                id="durable_singleton.W001",
            )
        )
    if conf.task_serializer != "json" or "json" not in (conf.accept_content or ["json"]):
        messages.append(
            checks.Error(
                f"Celery task_serializer is {conf.task_serializer!r}; durable_singleton sends run ids as JSON.",
                hint="Set CELERY_TASK_SERIALIZER = 'json'.",
                id="durable_singleton.E020",
            )
        )
    return messages


def register() -> None:
    """Register the checks with Django (called from ``ready()``)."""
    checks.register(check_settings, "durable_singleton")
    checks.register(check_sqlite, "durable_singleton")
    checks.register(check_celery, "durable_singleton")
