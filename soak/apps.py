"""The soak's Django app: its workflows, and the audit of accepted settles."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class SoakConfig(AppConfig):
    name = "soak"
    label = "soak"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable_singleton import signals

        from . import audit

        def parked(sender: Any, run: Any, reason: str = "", **kwargs: Any) -> None:
            audit.emit("parked", run=run.run_id, reason=reason)

        def finished(sender: Any, run: Any, **kwargs: Any) -> None:
            audit.emit("settled", run=run.run_id, status=run.status)

        # Sent only after the store accepted the park or the settle (a fenced
        # write sends nothing), in the process that wrote it.
        signals.run_parked.connect(parked, dispatch_uid="soak.parked", weak=False)
        signals.run_finished.connect(finished, dispatch_uid="soak.finished", weak=False)
