"""Pure decision helpers for singleton admission (SPEC S1, S5, S12, S14).

Nothing here touches a database. A custom store uses these helpers to
implement ``try_admit_singleton`` inside its own transaction (S14); the
store base class's fallback admission decides with :func:`decide_admission`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .exceptions import SingletonKeyError
from .statuses import ACTIVE_STATUSES, RunStatus

__all__ = [
    "ACTIVE_STATUSES",
    "ADMITTED_TAG",
    "HOLDING_LEGACY_STATUSES",
    "KEY_MAX_LENGTH",
    "KEY_TAG_PREFIX",
    "RESERVED_TAGS",
    "TRACKED_TAG",
    "Candidate",
    "compute_singleton_key",
    "decide_admission",
    "effective_limit",
    "is_holder",
    "key_tag",
    "retry_delay",
    "singleton_admission_denial_patch",
    "singleton_admission_tags",
    "without_singleton_markers",
]

#: Reserved tag of a run that holds a slot of its key (S5, S12).
ADMITTED_TAG = "durable:singleton:admitted"
#: Reserved tag of a singleton run created by this release (S12).
TRACKED_TAG = "durable:singleton:tracked"
#: Tags a caller may not set: stripped from caller tags, never inherited (S12).
RESERVED_TAGS = frozenset({ADMITTED_TAG, TRACKED_TAG})
#: Prefix of the key tag ``singleton:<key>`` (S1).
KEY_TAG_PREFIX = "singleton:"
#: Longest key accepted (characters); it is stored in an indexed column.
KEY_MAX_LENGTH = 191
#: An untracked run (created by an older release) in one of these statuses
#: counts as a holder, so a rolling upgrade never over-admits (S12).
HOLDING_LEGACY_STATUSES = (RunStatus.RUNNING, RunStatus.SUSPENDED, RunStatus.BLOCKED)


def effective_limit(declared: int | None, override: int | None = None) -> int:
    """Return a key's limit: the runtime override if set (K2), else the declared one (S2).

    ``declared`` is the limit of the workflow's latest registered version, or
    the limit stored on the run when this process does not know the workflow.
    This is the only place the two are combined; a lowered limit admits no one
    until holders drop below it and never evicts a holder (S8b, K2).
    """
    if override is not None:
        return max(int(override), 1)
    return max(int(declared or 1), 1)


def key_tag(key: str) -> str:
    """Return the run tag ``singleton:<key>`` (S1)."""
    return f"{KEY_TAG_PREFIX}{key}"


def compute_singleton_key(workflow: str, key_fn: Callable[[Any], object], input: Any) -> str:
    """Compute a run's singleton key from its input, once, at start (S1).

    Raises :class:`SingletonKeyError` if ``key_fn`` raises, or returns anything
    but a non-empty ``str`` of at most :data:`KEY_MAX_LENGTH` characters.
    """
    try:
        key = key_fn(input)
    except Exception as exc:  # the user's key function may raise anything
        raise SingletonKeyError(workflow, f"key function raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(key, str):
        raise SingletonKeyError(workflow, f"key function returned {type(key).__name__}, not str")
    if not key:
        raise SingletonKeyError(workflow, "key function returned an empty string")
    if len(key) > KEY_MAX_LENGTH:
        raise SingletonKeyError(workflow, f"key is {len(key)} characters long; at most {KEY_MAX_LENGTH} are allowed")
    return key


def without_singleton_markers(tags: Iterable[str]) -> list[str]:
    """Return ``tags`` without the reserved markers, order kept (S12)."""
    return [t for t in tags if t not in RESERVED_TAGS]


def singleton_admission_tags(tags: Iterable[str]) -> list[str]:
    """Return ``tags`` with the admitted marker added once (S5 step 4)."""
    tags = list(tags)
    return tags if ADMITTED_TAG in tags else [*tags, ADMITTED_TAG]


def retry_delay(
    seconds: float = 1.0, jitter: float = 0.25, rng: Callable[[float, float], float] = random.uniform
) -> float:
    """Return a gate retry delay in seconds: ``seconds`` +/- ``jitter``, uniform (S5 step 5)."""
    return seconds + rng(-jitter, jitter)


def singleton_admission_denial_patch(now: datetime, *, seconds: float = 1.0, jitter: float = 0.25) -> dict[str, Any]:
    """Return the field changes that park a denied run (S5 step 5).

    The run becomes ``suspended`` with ``wake_at`` = ``now`` + ``seconds``
    +/- ``jitter`` (uniform), and its lease is released. A custom store applies
    the patch in the same transaction as its read, and only to a run that is
    still active (S9).
    """
    return {
        "status": "suspended",
        "wake_at": now + timedelta(seconds=retry_delay(seconds, jitter)),
        "lease_owner": None,
        "lease_expires_at": None,
    }


@dataclass(frozen=True)
class Candidate:
    """One active run of a key, as admission sees it."""

    run_id: str
    created_at: datetime
    status: str
    tags: Sequence[str]

    @property
    def order(self) -> tuple[datetime, str]:
        """Admission order: oldest first by (``created_at``, ``run_id``) (S5 step 3)."""
        return (self.created_at, self.run_id)


def is_holder(status: str, tags: Sequence[str]) -> bool:
    """Tell whether an active run holds a slot (S5 step 2, S12)."""
    if ADMITTED_TAG in tags:
        return True
    return TRACKED_TAG not in tags and status in HOLDING_LEGACY_STATUSES


def decide_admission(candidates: Iterable[Candidate], run_id: str, limit: int) -> bool:
    """Decide whether ``run_id`` may take a slot among the key's active runs.

    ``candidates`` are the active runs of one workflow and key (S5 step 1).
    Holders keep their slots; the ``limit - holders`` free slots go to the
    oldest waiters by (``created_at``, ``run_id``); pending runs are waiters
    too. Returns True if ``run_id`` is a holder or among those waiters.
    """
    runs = [c for c in candidates if c.status in ACTIVE_STATUSES]
    holders = [c for c in runs if is_holder(c.status, c.tags)]
    if any(c.run_id == run_id for c in holders):
        return True
    free = limit - len(holders)
    if free <= 0:
        return False
    waiters = sorted((c for c in runs if not is_holder(c.status, c.tags)), key=lambda c: c.order)
    return any(c.run_id == run_id for c in waiters[:free])
