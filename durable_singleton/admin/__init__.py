"""The Django admin: runs, the per-key queues ("why is my run waiting, and
behind whom?") and schedules.

One module per idea: :mod:`.runs` (the run list and page), :mod:`.queues`
(the queue table and a key's page), :mod:`.actions` (cancel, retry, wake
through the engine), :mod:`.filters`, :mod:`.display` (how a run's state,
times and activity read), :mod:`.schedules`, :mod:`.controls` (K2) and :mod:`.workers` (O6). Importing the package
registers the model admins.
"""

from __future__ import annotations

from .actions import ActionLocation
from .controls import KeyControlChangeAdmin
from .filters import SingletonKeyFilter, WorkflowFilter
from .runs import RunAdmin
from .schedules import ScheduleAdmin, ScheduleFiringAdmin
from .workers import WorkerProcessAdmin

__all__ = [
    "ActionLocation",
    "KeyControlChangeAdmin",
    "RunAdmin",
    "ScheduleAdmin",
    "ScheduleFiringAdmin",
    "SingletonKeyFilter",
    "WorkerProcessAdmin",
    "WorkflowFilter",
]
