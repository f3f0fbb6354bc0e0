"""Lifecycle signals of runs, with logging receivers connected in ``ready()``.

Each is sent with ``sender=Engine`` and ``run`` (a
:class:`~durable_singleton.records.RunRecord`); ``run_parked`` also
carries ``reason`` (``"singleton"``, ``"throttled:<name>"``, ``"sleep"``,
``"signal:<name>"``...):

* ``run_created``: a start inserted a new run (not for an idempotent re-start);
* ``run_debounced``: a start was folded into its debounce key's open run (X7),
  which it names; nothing was created;
* ``run_admitted``: a singleton run took a slot of its key (S5);
* ``run_parked``: a turn ended with the run parked (a denied claim, a sleep,
  a wait for a signal or a child, ``blocked``); a denied claim's also carries
  ``throttle``: the name of the throttle whose full window parked the run
  until it opens (X6), else None;
* ``run_finished``: the run became terminal (its ``status`` says which);
* ``run_dead``: the run was dead-lettered (D4), before ``run_finished``.

``tick_finished`` is sent with ``sender=Engine`` and ``seconds`` (a float)
after each tick, with its duration (the metrics' tick histogram, O4).

The engine sends each with ``send_robust``: a receiver that raises is logged
by Django (the ``django.dispatch`` logger) and changes nothing else: the
other receivers run, and the turn, the handoff and the grants' sends go on
(a receiver's error never holds back a run, S7).

The logging receivers write to the ``durable_singleton`` logger with the
structured fields ``run_id``, ``workflow`` and ``key`` (``extra=``, for a
JSON formatter); they never log a run's input or output.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

from .statuses import RunStatus

__all__ = [
    "connect_log_receivers",
    "fields",
    "run_admitted",
    "run_created",
    "run_dead",
    "run_debounced",
    "run_finished",
    "run_parked",
    "tick_finished",
]

logger = logging.getLogger("durable_singleton")

run_created = Signal()
run_debounced = Signal()
run_admitted = Signal()
run_parked = Signal()
run_finished = Signal()
run_dead = Signal()
tick_finished = Signal()


def fields(run: Any) -> dict[str, Any]:
    """Return the structured log fields of ``run``: ``run_id``, ``workflow``, ``key``."""
    return {"run_id": run.run_id, "workflow": run.workflow_name, "key": run.singleton_key}


def _log_admitted(sender: Any, run: Any, **kwargs: Any) -> None:
    logger.debug("run %s admitted to %s key %s", run.run_id, run.workflow_name, run.singleton_key, extra=fields(run))


def _log_parked(sender: Any, run: Any, reason: str = "", **kwargs: Any) -> None:
    logger.debug("run %s parked (%s)", run.run_id, reason, extra=fields(run))


def _log_finished(sender: Any, run: Any, **kwargs: Any) -> None:
    level = logging.INFO if run.status == RunStatus.COMPLETED else logging.WARNING
    logger.log(level, "run %s of %s ended %s", run.run_id, run.workflow_name, run.status, extra=fields(run))


def _log_dead(sender: Any, run: Any, **kwargs: Any) -> None:
    code = (run.error or {}).get("code") if isinstance(run.error, dict) else None
    logger.error("run %s of %s is dead (%s)", run.run_id, run.workflow_name, code, extra=fields(run))


def connect_log_receivers() -> None:
    """Connect the logging receivers (idempotent)."""
    run_admitted.connect(_log_admitted, dispatch_uid="durable_singleton.log_admitted")
    run_parked.connect(_log_parked, dispatch_uid="durable_singleton.log_parked")
    run_finished.connect(_log_finished, dispatch_uid="durable_singleton.log_finished")
    run_dead.connect(_log_dead, dispatch_uid="durable_singleton.log_dead")
