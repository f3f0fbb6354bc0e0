"""A running run's lease as its renewals show it (R5, K3): the one rule of an
unrenewed lease.

A turn takes its lease with ``lease_expires_at`` = the database's now +
``LEASE_SECONDS``, and renews it the same way every ``LEASE_RENEW_SECONDS``
while the body runs and at each step boundary. So the lease's last renewal,
on the database's clock, is ``lease_expires_at - LEASE_SECONDS``
(:attr:`LeaseState.renewed_at`). A lease not renewed for longer than the
renewal interval (plus :func:`renewal_slack`, the time a renewal itself takes
on a loaded machine) is *unrenewed*: its worker was killed, is frozen or is
cut off from the database, and the body may no longer be running. Nobody
takes the run over before its lease expires (R5); the tick recovers it from
then on (D4), so ``lease_expires_at`` is when it is recovered
(:attr:`LeaseState.recovery_at`).

:func:`lease_state` judges one run, :func:`unrenewed_q` is its SQL twin for
the code that counts in a query. ``explain``, ``durable_health``, the admin
and the metrics call these and restate neither. Both judge on the clock
passed as ``now``, which the caller reads from the store (``store.now()``,
the database's clock, R5), never a process's own clock. Every process of a
deployment must use the same ``LEASE_SECONDS`` (a reader with a shorter one
would read leases as renewed earlier than they were).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Q

from .conf import Settings
from .statuses import RunStatus

__all__ = ["LeaseState", "lease_state", "renewal_slack", "unrenewed_q"]

#: The largest slack allowed a renewal beyond ``LEASE_RENEW_SECONDS``, in seconds.
MAX_RENEWAL_SLACK_SECONDS = 1.0


def renewal_slack(renew_seconds: float) -> float:
    """Return the seconds a renewal may come late before its lease reads as unrenewed:
    half the renewal interval, at most :data:`MAX_RENEWAL_SLACK_SECONDS`.

    The keeper waits ``LEASE_RENEW_SECONDS`` after a renewal before it writes
    the next one, so consecutive renewals are that far apart plus the round
    trip and the scheduling of the keeper's thread.
    """
    return min(MAX_RENEWAL_SLACK_SECONDS, renew_seconds / 2)


@dataclass(frozen=True)
class LeaseState:
    """A running run's lease as of ``now`` (the database's clock, R5).

    ``renewed_at``: its last renewal (or its claim); ``not_renewed_seconds``:
    seconds since then (never negative); ``renew_seconds``: the renewal
    interval; ``unrenewed``: not renewed for longer than the interval plus its
    slack (:func:`renewal_slack`), or expired; ``expired``: ``expires_at`` has
    come, so the tick may recover the run now.
    """

    owner: str | None
    expires_at: datetime
    renewed_at: datetime
    not_renewed_seconds: float
    renew_seconds: float
    unrenewed: bool
    expired: bool

    @property
    def recovery_at(self) -> datetime:
        """Return when the run is recovered: its lease's expiry, from which the tick re-drives it (D4)."""
        return self.expires_at

    def seconds_to_recovery(self, now: datetime) -> float:
        """Return the seconds from ``now`` (the database's clock) to :attr:`recovery_at`, at least 0."""
        return max(0.0, (self.expires_at - now).total_seconds())


def lease_state(
    status: str, owner: str | None, expires_at: datetime | None, *, settings: Settings, now: datetime
) -> LeaseState | None:
    """Return the lease of a run in ``status`` leased by ``owner`` until
    ``expires_at`` (aware datetimes), judged at ``now``, the database's clock
    (``store.now()``, R5): None unless the run is ``running`` with a lease.

    ``settings`` gives ``LEASE_SECONDS`` (the lease's length: its last renewal
    is ``expires_at - LEASE_SECONDS``) and ``LEASE_RENEW_SECONDS``. SQL twin:
    :func:`unrenewed_q`.
    """
    if status != RunStatus.RUNNING or expires_at is None:
        return None
    renewed_at = expires_at - timedelta(seconds=settings.LEASE_SECONDS)
    silent = max(0.0, (now - renewed_at).total_seconds())
    renew = settings.LEASE_RENEW_SECONDS
    return LeaseState(
        owner=owner,
        expires_at=expires_at,
        renewed_at=renewed_at,
        not_renewed_seconds=silent,
        renew_seconds=renew,
        unrenewed=silent > renew + renewal_slack(renew) or expires_at <= now,
        expired=expires_at <= now,
    )


def unrenewed_q(*, settings: Settings, now: datetime) -> Q:
    """SQL twin of :func:`lease_state`'s ``unrenewed``, on the run table's columns:
    running, with a lease last renewed more than the renewal interval plus its
    slack before ``now`` (a value read from the database's clock, R5), or expired."""
    renew = settings.LEASE_RENEW_SECONDS
    # renewed_at < now - (renew + slack)  <=>  expires_at < now + LEASE_SECONDS - renew - slack
    bound = now + timedelta(seconds=settings.LEASE_SECONDS - renew - renewal_slack(renew))
    return Q(status=RunStatus.RUNNING, lease_expires_at__isnull=False) & (
        Q(lease_expires_at__lt=bound) | Q(lease_expires_at__lte=now)
    )
