"""The words the protocol speaks, one definition each (R2, S5, R5, D1-D4):
run statuses, slot states, turn outcomes, store verdicts and park reasons.

No other module of the package spells one of these as a string literal
(tests/docs_and_packaging/test_literals.py checks it; migrations, frozen history, excepted). A
``TextChoices`` or ``StrEnum`` member is a ``str``, so it is stored and
compared as the plain value.
"""

from __future__ import annotations

import enum

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = [
    "ACTIVE_STATUSES",
    "PARKED_STATUSES",
    "SUPERSEDING",
    "TERMINAL_STATUSES",
    "WAITING",
    "WAKEABLE_STATUSES",
    "OnBusy",
    "Outcome",
    "ParkReason",
    "RunStatus",
    "Rung",
    "SlotState",
    "Verdict",
    "state_word",
]


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
#: Parked waiting for a slot and not blocked on an event: the waiters the slot audit may wake (K4).
WAKEABLE_STATUSES: tuple[str, ...] = (RunStatus.PENDING, RunStatus.SUSPENDED)
#: Terminal statuses (R2): a terminal run never changes status again.
TERMINAL_STATUSES: tuple[str, ...] = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD)


class SlotState(models.TextChoices):
    """Where an active singleton run stands in its key's queue (S5).

    ``holder`` is the durable admitted marker; ``waiter`` is every tracked
    active run without a slot, pending included. Terminal runs have no slot.
    """

    HOLDER = "holder", _("holder")
    WAITER = "waiter", _("waiter")


class OnBusy(enum.StrEnum):
    """What a start does on a key with no free slot: ``Singleton(on_busy=...)`` (X1)."""

    QUEUE = "queue"  # queue behind the holders, oldest first (S3, S5): the default
    SKIP = "skip"  # create nothing, raise SingletonBusyError: the queue cap at depth 0 (S15)
    REPLACE_QUEUED = "replace_queued"  # cancel the waiters queued behind the holders (code "replaced")
    CANCEL_IN_PROGRESS = "cancel_in_progress"  # also ask the holders to stop at their next step boundary (D6)


#: The strategies whose start changes the key's other runs, under its lock (X1).
SUPERSEDING: tuple[str, ...] = (OnBusy.REPLACE_QUEUED, OnBusy.CANCEL_IN_PROGRESS)


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


class Rung(enum.StrEnum):
    """The step of the turn ladder a claim stands on (:func:`~durable_singleton.admission.turn_rung`):
    what a turn of a run does, decided once for every store (S4, S5, S6, S9, R6, D4, X3, X5)."""

    SKIP = "skip"  # gone, terminal, or running under a lease that has not expired (R6)
    CANCEL = "cancel"  # a cancel was requested: settle it cancelled, granting its slot (S9)
    DEAD = "dead"  # a recovery past max_recoveries: settle it dead, granting its slot (D4)
    NOT_DUE = "not_due"  # a delayed start before its not_before: no claim, wake_at = not_before (X5)
    LIMITS = "limits"  # it carries quota or throttle keys: admitted under every limit's lock (X3, X6)
    TAKE = "take"  # a run without a key, or a holder's confirmation: take the lease (S6)
    TAKE_OVER = "take_over"  # a holder whose lease expired: take it over with a new token (K1, R5)
    ADMIT = "admit"  # a waiter: admitted or parked under its key's lock (S4, S5)


class Verdict(enum.StrEnum):
    """What a store answered a lease-fenced write of a running run (R5, D6):
    ``BaseStore.check_boundary`` and ``BaseStore.park``."""

    OK = "ok"  # the boundary renewed the lease: the body goes on
    PARKED = "parked"  # the park was written, the lease released
    CANCELLED = "cancelled"  # a cancel was requested: nothing written (D6)
    FENCED = "fenced"  # the lease is no longer this executor's: nothing written (R5)


class ParkReason(enum.StrEnum):
    """Why a parked run is parked (``park_reason``). The members whose value ends
    with a colon are prefixes: the reason carries a detail after it."""

    SINGLETON = "singleton"  # denied admission: a waiter (S5 step 5)
    THROTTLED = "throttled:"  # over a throttle's rate until its window opens: throttled:<name> (X6d)
    SLEEP = "sleep"  # ctx.sleep / ctx.sleep_until (D1)
    SIGNAL = "signal:"  # ctx.wait_for_signal: signal:<name> (D2)
    CHILD = "child:"  # ctx.call_child: child:<run id> (D7)
    INTERRUPTED = "interrupted:"  # a store call failed under the body: interrupted:<count in a row> (D4)
    SHUTDOWN = "shutdown:"  # handed back with its slot by a worker shutting down: shutdown:<count in a row> (O1, R7)

    def of(self, detail: object) -> str:
        """Return the reason ``<prefix><detail>`` of a prefix member."""
        return f"{self.value}{detail}"

    def matches(self, reason: str) -> bool:
        """Tell whether ``reason`` is this one: starts with a prefix member, equals another."""
        return reason.startswith(self.value) if self.value.endswith(":") else reason == self.value

    def detail(self, reason: str) -> str:
        """Return what follows this prefix in ``reason``."""
        return reason.removeprefix(self.value)


#: The state of a key's waiter, whatever its stored status (S5).
WAITING = "waiting"


def state_word(status: str, slot: str | None) -> str:
    """Return a run's state as every page and command names it: ``waiting`` for
    a waiter of its key (``slot`` = ``waiter``, stored ``pending`` or
    ``suspended``, S5), else its status."""
    return WAITING if slot == SlotState.WAITER else str(status)
