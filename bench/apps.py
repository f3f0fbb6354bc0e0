"""The bench app: its workflows, plain Celery tasks and peer tasks are found by discovery."""

from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    """The benchmark's Django app (no models: the audit lives in Redis)."""

    name = "bench"
    label = "bench"
    verbose_name = "durable_singleton benchmarks"

    def ready(self) -> None:
        import os

        from . import trace

        trace.connect()
        patch = os.environ.get("BENCH_PATCH")
        if patch:  # measure a proposed core change (bench/proposals.py) in every process
            from . import proposals

            proposals.apply(patch)
