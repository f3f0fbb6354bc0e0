"""Run statuses, slot states and turn outcomes: one definition each (R2, S5).

Every module names statuses through these enumerations; a ``TextChoices``
member is a ``str``, so it is stored and compared as the plain value.
"""

from __future__ import annotations

import enum

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["ACTIVE_STATUSES", "PARKED_STATUSES", "TERMINAL_STATUSES", "Outcome", "RunStatus", "SlotState"]


class RunStatus(models.TextChoices):
    """Run statuses (R2): four active, four terminal."""

    PENDING = "pending", _("pending")
    RUNNING = "running", _("running")
    SUSPENDED = "suspended", _("suspended")
    BLOCKED = "blocked", _("blocked")
    COMPLETED = "completed", _("completed")
    FAILED = "failed", _("failed")
    CANCELLED = "cancelled", _("cancelled")
    DEAD = "dead", _("dead")


#: Active statuses (R2): the run may still run.
ACTIVE_STATUSES: tuple[str, ...] = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED)
#: Active and not running: no lease is held (D1-D3).
PARKED_STATUSES: tuple[str, ...] = (RunStatus.PENDING, RunStatus.SUSPENDED, RunStatus.BLOCKED)
#: Terminal statuses (R2): a terminal run never changes status again.
TERMINAL_STATUSES: tuple[str, ...] = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD)


class SlotState(models.TextChoices):
    """Where an active singleton run stands in its key's queue (S5).

    ``holder`` is the durable admitted marker; ``waiter`` is every tracked
    active run without a slot, pending included. Terminal runs have no slot.
    """

    HOLDER = "holder", _("holder")
    WAITER = "waiter", _("waiter")


class Outcome(enum.StrEnum):
    """What one turn of a run ended with (:meth:`Engine.execute`)."""

    SKIPPED = "skipped"  # not claimable: terminal, or leased by another live executor (R6)
    PARKED = "parked"  # denied admission: parked as a waiter (S5 step 5)
    SUSPENDED = "suspended"  # the body slept or waits (D1, D2)
    BLOCKED = "blocked"  # the body blocked (D3)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD = "dead"
    FENCED = "fenced"  # this executor's lease was taken over: its writes were refused (R5)
    INTERRUPTED = "interrupted"  # a store call failed under the body: the run resumes from its stored steps (D4)
