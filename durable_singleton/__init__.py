"""durable_singleton: durable Django workflows that never overlap for one key.

Public names only; see README.rst.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .admission import (
    ADMITTED_TAG,
    TRACKED_TAG,
    singleton_admission_denial_patch,
    singleton_admission_tags,
    without_singleton_markers,
)
from .definitions import Quota, Singleton, WorkflowOptions, step
from .exceptions import QuotaQueueFullError, SingletonBusyError, SingletonQueueFullError
from .schedules import Schedule
from .statuses import OnBusy
from .workflows import BaseWorkflow, workflow

if TYPE_CHECKING:
    from .context import WorkflowCtx
    from .engine import Engine
    from .runtime import get_engine

__all__ = [
    "ADMITTED_TAG",
    "TRACKED_TAG",
    "BaseWorkflow",
    "Engine",
    "OnBusy",
    "Quota",
    "QuotaQueueFullError",
    "Schedule",
    "Singleton",
    "SingletonBusyError",
    "SingletonQueueFullError",
    "WorkflowCtx",
    "WorkflowOptions",
    "get_engine",
    "singleton_admission_denial_patch",
    "singleton_admission_tags",
    "step",
    "without_singleton_markers",
    "workflow",
]


def __getattr__(name: str) -> Any:
    # Engine and context import Django lazily; keep the package importable
    # without configured settings.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "get_engine":
        from .runtime import get_engine

        return get_engine
    if name == "WorkflowCtx":
        from .context import WorkflowCtx

        return WorkflowCtx
    raise AttributeError(f"module 'durable_singleton' has no attribute {name!r}")
