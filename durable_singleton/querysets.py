"""Intention-revealing querysets for runs."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from django.db import models

from .admission import ACTIVE_STATUSES, HOLDING_LEGACY_STATUSES

if TYPE_CHECKING:
    from .models import Run

    _Base = models.QuerySet[Run]
else:
    _Base = models.QuerySet


class RunQuerySet(_Base):
    """Query helpers that name the admission vocabulary (holder, waiter, due)."""

    def active(self) -> RunQuerySet:
        """Runs in ``pending``, ``running``, ``suspended`` or ``blocked`` (R2)."""
        return self.filter(status__in=ACTIVE_STATUSES)

    def for_key(self, workflow_name: str, key: str) -> RunQuerySet:
        """Runs of one workflow (all versions) tagged with one key (S2)."""
        return self.filter(workflow_name=workflow_name, singleton_key=key)

    def holders(self) -> RunQuerySet:
        """Active runs that hold a slot: admitted, or untracked legacy runs (S5, S12)."""
        return self.filter(
            models.Q(singleton_slot="holder") | models.Q(singleton_tracked=False, status__in=HOLDING_LEGACY_STATUSES)
        )

    def waiting(self) -> RunQuerySet:
        """Active runs waiting for a slot, in admission order (S5 step 3)."""
        return self.filter(singleton_slot="waiter").order_by("created_at", "run_id")

    def due(self, now: datetime) -> RunQuerySet:
        """Parked runs whose ``wake_at`` has come (S8)."""
        return self.filter(status__in=("pending", "suspended", "blocked"), wake_at__lte=now)

    def lease_expired(self, now: datetime) -> RunQuerySet:
        """Running runs whose lease expired and whose next check is due (D4)."""
        return self.filter(status="running", lease_expires_at__lte=now).filter(
            models.Q(wake_at__isnull=True) | models.Q(wake_at__lte=now)
        )
