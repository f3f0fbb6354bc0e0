"""durable_singleton: durable Django workflows that never overlap for one key.

Public names only; see README.rst. Importing the package imports the engine,
its context and the runtime (Django's modules with them) but reads no settings:
it works before Django is configured (tests/operations/test_system_checks.py).
"""

from __future__ import annotations

from .admission import (
    ADMITTED_TAG,
    TRACKED_TAG,
    singleton_admission_denial_patch,
    singleton_admission_tags,
    without_singleton_markers,
)
from .context import WorkflowCtx
from .definitions import Debounce, Quota, Singleton, Throttle, WorkflowOptions, step
from .engine import Engine
from .exceptions import QuotaQueueFullError, SingletonBusyError, SingletonQueueFullError
from .runtime import get_engine
from .schedules import Schedule
from .statuses import OnBusy
from .workflows import BaseWorkflow, workflow

__all__ = [
    "ADMITTED_TAG",
    "TRACKED_TAG",
    "BaseWorkflow",
    "Debounce",
    "Engine",
    "OnBusy",
    "Quota",
    "QuotaQueueFullError",
    "Schedule",
    "Singleton",
    "SingletonBusyError",
    "SingletonQueueFullError",
    "Throttle",
    "WorkflowCtx",
    "WorkflowOptions",
    "get_engine",
    "singleton_admission_denial_patch",
    "singleton_admission_tags",
    "step",
    "without_singleton_markers",
    "workflow",
]
