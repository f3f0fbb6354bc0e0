"""Settings for durable_singleton, read lazily from ``settings.DURABLE_SINGLETON``.

Every value has a default here, in one typed place; nothing is cached at import
time, so ``override_settings`` takes effect at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

DEFAULTS: dict[str, Any] = {
    # Where runs live: "django" (the ORM store) or "memory" (the in-memory store).
    "STORE": "django",
    # How turns are executed: "celery" (send a Celery task after commit),
    # "thread" (the embedded in-process worker) or "manual" (tests drain them).
    "DISPATCH": "celery",
    # Database alias for the ORM store; None means the router's choice.
    "DATABASE": None,
    # Namespace of the default engine, and whether its reads are scoped (D10).
    "NAMESPACE": "default",
    "SCOPE_READS": False,
    # Lease held by a turn while its body runs, in seconds (R5). Renewed every
    # LEASE_RENEW_SECONDS; a pause longer than LEASE_SECONDS - LEASE_RENEW_SECONDS
    # lets another worker take the run over (docs/durability.rst).
    "LEASE_SECONDS": 30.0,
    "LEASE_RENEW_SECONDS": 10.0,
    # Gate retry for the first `limit` waiters of a key: 1 s +/- 250 ms (S5).
    "ADMISSION_RETRY_SECONDS": 1.0,
    "ADMISSION_RETRY_JITTER_SECONDS": 0.25,
    # Retry for waiters further back: they wait for the push and the tick's
    # per-key catch-up instead of polling (S8a).
    "BACKLOG_RETRY_SECONDS": 3600.0,
    # A run whose turn was dispatched but not yet claimed is dispatched again
    # after this long (lost broker send, F4), in seconds.
    "REDELIVERY_SECONDS": 5.0,
    # Recoveries of an expired lease before a run is dead-lettered (D4).
    "MAX_RECOVERIES": 5,
    # Bounded retries of a claim on transient database errors (section 7).
    "CLAIM_RETRIES": 5,
    # Period of the Celery beat tick, in seconds (S8).
    "TICK_SECONDS": 1.0,
    # Largest number of due runs one tick dispatches.
    "TICK_BATCH": 500,
    # Threads of the embedded in-process worker.
    "WORKER_THREADS": 4,
    # Long fallback wake-up of a run waiting on a signal, in seconds (D2).
    "SIGNAL_FALLBACK_SECONDS": 300.0,
}


@dataclass(frozen=True)
class Settings:
    """A snapshot of the effective settings; see :data:`DEFAULTS` for meanings."""

    STORE: str
    DISPATCH: str
    DATABASE: str | None
    NAMESPACE: str
    SCOPE_READS: bool
    LEASE_SECONDS: float
    LEASE_RENEW_SECONDS: float
    ADMISSION_RETRY_SECONDS: float
    ADMISSION_RETRY_JITTER_SECONDS: float
    BACKLOG_RETRY_SECONDS: float
    REDELIVERY_SECONDS: float
    MAX_RECOVERIES: int
    CLAIM_RETRIES: int
    TICK_SECONDS: float
    TICK_BATCH: int
    WORKER_THREADS: int
    SIGNAL_FALLBACK_SECONDS: float

    @classmethod
    def from_mapping(cls, overrides: dict[str, Any] | None = None) -> Settings:
        """Merge ``overrides`` over :data:`DEFAULTS`.

        Raises :class:`~durable_singleton.exceptions.ConfigurationError` for an
        unknown key.
        """
        from .exceptions import ConfigurationError

        values = dict(DEFAULTS)
        for name, value in (overrides or {}).items():
            if name not in DEFAULTS:
                known = ", ".join(sorted(DEFAULTS))
                raise ConfigurationError(f"DURABLE_SINGLETON has unknown key {name!r}; known keys: {known}")
            values[name] = value
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def get_settings() -> Settings:
    """Return the effective settings, read from Django settings now (never cached)."""
    from django.conf import settings

    return Settings.from_mapping(getattr(settings, "DURABLE_SINGLETON", None))
