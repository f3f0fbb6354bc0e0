"""Lifecycle signals of runs, with logging receivers connected in ``ready()``.

Each is sent with ``sender=Engine`` and ``run`` (a RunRecord); ``run_parked``
also carries ``reason``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

__all__ = ["connect_log_receivers", "run_admitted", "run_created", "run_dead", "run_finished", "run_parked"]

logger = logging.getLogger("durable_singleton")

run_created = Signal()
run_admitted = Signal()
run_parked = Signal()
run_finished = Signal()
run_dead = Signal()


def _log_admitted(sender: Any, run: Any, **kwargs: Any) -> None:
    logger.debug("run %s admitted to %s key %s", run.run_id, run.workflow_name, run.singleton_key)


def _log_parked(sender: Any, run: Any, reason: str = "", **kwargs: Any) -> None:
    logger.debug("run %s parked (%s)", run.run_id, reason)


def _log_finished(sender: Any, run: Any, **kwargs: Any) -> None:
    level = logging.INFO if run.status == "completed" else logging.WARNING
    logger.log(level, "run %s of %s ended %s", run.run_id, run.workflow_name, run.status)


def _log_dead(sender: Any, run: Any, **kwargs: Any) -> None:
    logger.error("run %s of %s is dead: %s", run.run_id, run.workflow_name, run.error)


def connect_log_receivers() -> None:
    """Connect the logging receivers (idempotent)."""
    run_admitted.connect(_log_admitted, dispatch_uid="durable_singleton.log_admitted")
    run_parked.connect(_log_parked, dispatch_uid="durable_singleton.log_parked")
    run_finished.connect(_log_finished, dispatch_uid="durable_singleton.log_finished")
    run_dead.connect(_log_dead, dispatch_uid="durable_singleton.log_dead")
