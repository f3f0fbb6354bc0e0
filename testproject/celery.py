"""The test project's Celery app, with the durable_singleton tick in its beat schedule.

Run it as the README says::

    celery -A testproject worker --prefetch-multiplier 1 -O fair
    celery -A testproject beat

Each worker's main process ticks while it holds the tick's lease, and
beat's tick (on the default queue) is the fallback (O5;
``tests/workers/test_tick_period.py`` starts these two against the test database).
"""

from __future__ import annotations

import os

from celery import Celery

from durable_singleton.tasks import beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.conf.beat_schedule.update(beat_schedule())


def _spans_to_file(**kwargs: object) -> None:
    """In each pool process, export OpenTelemetry spans as JSON lines to the
    file ``DURABLE_OTEL_SPANS`` names (tests/operations/test_tracing.py, O8)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    out = open(os.environ["DURABLE_OTEL_SPANS"], "a")  # noqa: SIM115 - open for the life of the process
    provider = TracerProvider()
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


if os.environ.get("DURABLE_OTEL_SPANS"):
    from celery.signals import worker_process_init

    worker_process_init.connect(_spans_to_file, weak=False)
