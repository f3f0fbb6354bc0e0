"""App config: registers checks, connects receivers, discovers ``workflows`` modules and the
workflows of django.tasks tasks run by the durable task backend."""

from __future__ import annotations

from importlib.util import find_spec

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class DurableSingletonConfig(AppConfig):
    """durable_singleton's app config."""

    name = "durable_singleton"
    verbose_name = "Durable singleton workflows"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import celery_tick, checks, receivers, signals

        checks.register()
        celery_tick.connect()  # the tick thread of each Celery worker's main process (O5)
        signals.connect_log_receivers()
        receivers.connect()
        autodiscover_modules("workflows")
        if find_spec("django.tasks") is not None:  # Django 6.0+: the django.tasks backend's workflows
            from .tasks_backend import register_configured_tasks

            register_configured_tasks()
