"""Settings for durable_singleton, read lazily from ``settings.DURABLE_SINGLETON``.

Every value has a default here, in one typed place; nothing is cached at import
time, so ``override_settings`` takes effect at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

DEFAULTS: dict[str, Any] = {
    # Where runs live: "django" (the ORM store) or "memory" (the in-memory store).
    "STORE": "django",
    # How turns are executed: "celery" (send a Celery task after commit),
    # "worker" (write a turn notice that `manage.py durable_worker` processes
    # take from the database), "thread" (the embedded in-process worker) or
    # "manual" (tests drain them). See docs/operations.rst (O1).
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
    # Period of the tick, in seconds (S8).
    "TICK_SECONDS": 1.0,
    # DISPATCH "celery": each Celery worker's main process runs a tick thread
    # that ticks every TICK_SECONDS while it holds the tick's lease (one
    # process at a time, O5, O1b); beat's tick is then the fallback. False:
    # only beat's tick task ticks.
    "CELERY_WORKER_TICK": True,
    # Largest number of due runs one tick dispatches.
    "TICK_BATCH": 500,
    # Most runs one Celery message carries (the execute_runs task): start_many
    # sends its runs in messages of this many, and coalesced starts are sent
    # once this many are buffered. 1: one message per run.
    "DISPATCH_BATCH": 25,
    # How long a start's first turn may wait, in seconds, for other starts of
    # the process to share its Celery message (coalesced sends). 0: each start
    # sends its own message at commit.
    "DISPATCH_COALESCE_SECONDS": 0.005,
    # Threads of the embedded in-process worker and of each durable_worker.
    "WORKER_THREADS": 4,
    # DISPATCH "worker": how often an idle durable_worker looks for turn
    # notices where the database cannot notify it (SQLite, MySQL/MariaDB), in
    # seconds; on PostgreSQL LISTEN/NOTIFY wakes it and this poll only backs
    # a lost notice up (O7).
    "WORKER_POLL_SECONDS": 0.2,
    # How often a durable_worker refreshes its row in the worker registry,
    # in seconds (O6).
    "WORKER_HEARTBEAT_SECONDS": 2.0,
    # A durable_worker not seen for this long is dead: the tick takes back
    # the runs it held, whatever their lease says, in seconds (O6, R5).
    "WORKER_DEAD_SECONDS": 10.0,
    # Long fallback wake-up of a run waiting on a signal, in seconds (D2).
    "SIGNAL_FALLBACK_SECONDS": 300.0,
    # Finished runs (with their steps and signals) older than this are deleted
    # by the tick, in seconds since they finished; None keeps them (O2).
    "RETENTION_SECONDS": 7 * 24 * 3600.0,
    # Largest number of finished runs one tick deletes (O2).
    "RETENTION_BATCH": 500,
    # Largest run input, signal or event payload accepted, in bytes of its JSON
    # encoding (UTF-8); larger ones raise InvalidInputError. None: no limit.
    "MAX_INPUT_BYTES": 1_000_000,
    # Most distinct tags a run accepts (reserved markers aside); more raise
    # InvalidInputError at start (section 7).
    "MAX_TAGS": 100,
    # Largest step result or workflow output stored, in bytes of its JSON
    # encoding (UTF-8); a larger one raises InvalidInputError in the body.
    # Below MySQL/MariaDB's default max_allowed_packet (16 MB) with room for
    # escaping. None: no limit.
    "MAX_RESULT_BYTES": 4_000_000,
}

# What system check E001 holds each value to, beyond the type of its default
# (a number for a float, an int for an int, a bool, a str): the smallest
# accepted value (and whether it is excluded), and which settings accept None.
_MINIMUM: dict[str, tuple[float, bool]] = {
    "LEASE_SECONDS": (0, True),
    "LEASE_RENEW_SECONDS": (0, True),
    "ADMISSION_RETRY_SECONDS": (0, True),
    "ADMISSION_RETRY_JITTER_SECONDS": (0, False),
    "BACKLOG_RETRY_SECONDS": (0, True),
    "REDELIVERY_SECONDS": (0, False),
    "MAX_RECOVERIES": (0, False),
    "CLAIM_RETRIES": (0, False),
    "TICK_SECONDS": (0, True),
    "TICK_BATCH": (1, False),
    "DISPATCH_BATCH": (1, False),
    "DISPATCH_COALESCE_SECONDS": (0, False),
    "WORKER_THREADS": (1, False),
    "WORKER_POLL_SECONDS": (0, True),
    "WORKER_HEARTBEAT_SECONDS": (0, True),
    "WORKER_DEAD_SECONDS": (0, True),
    "SIGNAL_FALLBACK_SECONDS": (0, True),
    "RETENTION_SECONDS": (0, True),
    "RETENTION_BATCH": (1, False),
    "MAX_RESULT_BYTES": (0, True),
    "MAX_TAGS": (0, False),
}
#: Upper bounds (inclusive) of the worker's periods, in seconds: a period the
#: worker cannot wait (``threading`` refuses a timeout past ``TIMEOUT_MAX``) or
#: subtract from the database's clock (a date before year 1) killed its fetch,
#: heartbeat or tick thread at the first use (O1, O6, section 7).
_MAXIMUM: dict[str, float] = {
    "WORKER_POLL_SECONDS": 60.0,
    "WORKER_HEARTBEAT_SECONDS": 3600.0,
    "WORKER_DEAD_SECONDS": 86400.0,
}
_NULLABLE = frozenset({"DATABASE", "RETENTION_SECONDS", "MAX_INPUT_BYTES", "MAX_RESULT_BYTES"})


def _kind(default: Any) -> tuple[str, Any]:
    """What a value must be, from its default: (description, predicate)."""
    if isinstance(default, bool):
        return "True or False", lambda v: isinstance(v, bool)
    if isinstance(default, int):
        return "an int", lambda v: isinstance(v, int) and not isinstance(v, bool)
    if isinstance(default, float):
        # Finite: an infinite period killed the tick thread, NaN made it spin (section 7).
        return "a finite number", lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return "a str", lambda v: isinstance(v, str)


def problems(overrides: Any) -> list[tuple[str, str]]:
    """Return ``(message, hint)`` for each invalid part of a ``DURABLE_SINGLETON``
    value: not a dict, an unknown key, a value of the wrong type or out of range.

    Checks each key on its own (system check E001); an empty list means
    :meth:`Settings.from_mapping` accepts it.
    """
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        return [(f"DURABLE_SINGLETON must be a dict, got {type(overrides).__name__}.", "Use a dict of settings.")]
    found = []
    known = ", ".join(sorted(DEFAULTS))
    for name, value in overrides.items():
        if name not in DEFAULTS:
            found.append((f"DURABLE_SINGLETON has unknown key {name!r}.", f"Known keys: {known}."))
            continue
        if value is None and name in _NULLABLE:
            continue
        default = DEFAULTS[name]
        what, accepts = _kind(default if default is not None else "")
        minimum = _MINIMUM.get(name)
        if minimum is not None:
            low, strict = minimum
            what += f" {'>' if strict else '>='} {low:g}"
        maximum = _MAXIMUM.get(name)
        if maximum is not None:
            what += f" and <= {maximum:g}"
        if name in _NULLABLE:
            what += " or None"
        ok = accepts(value)
        if ok and minimum is not None:
            ok = value > minimum[0] if minimum[1] else value >= minimum[0]
        if ok and maximum is not None:
            ok = value <= maximum
        if not ok:
            found.append(
                (
                    f"DURABLE_SINGLETON[{name!r}] must be {what}, got {value!r}.",
                    f"Set {name} to {what} (default {default!r}); see the settings reference.",
                )
            )
    return found


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
    CELERY_WORKER_TICK: bool
    TICK_BATCH: int
    DISPATCH_BATCH: int
    DISPATCH_COALESCE_SECONDS: float
    WORKER_THREADS: int
    WORKER_POLL_SECONDS: float
    WORKER_HEARTBEAT_SECONDS: float
    WORKER_DEAD_SECONDS: float
    SIGNAL_FALLBACK_SECONDS: float
    RETENTION_SECONDS: float | None
    RETENTION_BATCH: int
    MAX_INPUT_BYTES: int | None
    MAX_RESULT_BYTES: int | None
    MAX_TAGS: int

    @classmethod
    def from_mapping(cls, overrides: dict[str, Any] | None = None) -> Settings:
        """Merge ``overrides`` over :data:`DEFAULTS`.

        Raises :class:`~durable_singleton.exceptions.ConfigurationError` naming
        every unknown key and every value of the wrong type or range (see
        :func:`problems`; ``manage.py check`` reports the same as E001).
        """
        from .exceptions import ConfigurationError

        found = problems(overrides)
        if found:
            raise ConfigurationError(" ".join(message for message, _ in found))
        values = dict(DEFAULTS)
        values.update(overrides or {})
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def get_settings() -> Settings:
    """Return the effective settings, read from Django settings now (never cached)."""
    from django.conf import settings

    return Settings.from_mapping(getattr(settings, "DURABLE_SINGLETON", None))
