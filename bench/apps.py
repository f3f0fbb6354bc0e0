"""The bench app: its workflows, plain Celery tasks and peer tasks are found by discovery."""

from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    """The benchmark's Django app (no models: the audit lives in Redis)."""

    name = "bench"
    label = "bench"
    verbose_name = "durable_singleton benchmarks"

    def ready(self) -> None:
        from . import trace

        trace.connect()
