"""The admission rules, each in one place (SPEC S1, S2, S5, S12, S14, S15, K2).

Who holds a slot is :func:`holds_slot`; whether a run may be admitted yet
(its delayed start, X5) is :func:`is_due`; whether a waiter outlived its
key's ``queue_ttl`` (X2) is :func:`queue_ttl_expired`; the limit in force on a key is
:func:`limit_in_force`; the slots it has free, :func:`free_slots`; the queue
cap ``start`` applies, :func:`cap_in_force`; a key's queue order (X8), :func:`queue_place`
with :data:`QUEUE_ORDER` and :func:`queue_order_sql_text`; the runs a superseding start
(``on_busy``, X1) ends or stops, :func:`superseded`. Each has its SQL twin, an
expression over the run table's columns for the code that decides in a
query: :func:`holds_slot_q`, :func:`is_due_q`, :func:`limit_in_force_sql`,
:func:`free_slots_sql`, :func:`queue_ttl_expired_q`; and each has one spelling as SQL text for the raw
statements of the PostgreSQL fast path (:mod:`durable_singleton.stores.pg`):
:func:`holds_slot_sql_text`, :func:`legacy_holder_sql_text`,
:func:`is_due_sql_text`, :func:`limit_in_force_sql_text`,
:func:`free_slots_sql_text`, :func:`queue_ttl_expired_sql_text` (every grant
of the fast path skips the waiters past their TTL, X2). The stores, the audit, the queue views, the
metrics, explain and the cap call these and restate none of them; the
conformance suite checks that each Python spelling, its ORM twin and its SQL
text agree.

Nothing here runs a query. A custom store uses these helpers to implement
its claim inside its own transaction (S14); the store base class's fallback
admission decides with :func:`decide_admission`.
"""

from __future__ import annotations

import functools
import math
import operator
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from django.db.models import Case, DateTimeField, ExpressionWrapper, F, IntegerField, Q, Value, When
from django.db.models.functions import Coalesce, Greatest
from django.db.models.lookups import Exact, GreaterThan

from .exceptions import InvalidNotBeforeError, InvalidPriorityError, SingletonKeyError
from .statuses import ACTIVE_STATUSES, OnBusy, Rung, RunStatus, SlotState
from .values import MAX_SECONDS

__all__ = [
    "ACTIVE_STATUSES",
    "ADMITTED_TAG",
    "DEBOUNCE_PREFIX",
    "FAIR_SCALE",
    "HOLDING_LEGACY_STATUSES",
    "KEY_MAX_LENGTH",
    "KEY_TAG_PREFIX",
    "MAX_PRIORITY",
    "MAX_WEIGHT",
    "MIN_PRIORITY",
    "QUEUE_ORDER",
    "QUOTA_KEY_MAX_LENGTH",
    "QUOTA_NAME_MAX_LENGTH",
    "QUOTA_ORDER",
    "QUOTA_PREFIX",
    "RESERVED_TAGS",
    "THROTTLE_PREFIX",
    "TRACKED_TAG",
    "Candidate",
    "TurnRun",
    "ahead_q",
    "cap_in_force",
    "check_not_before",
    "check_priority",
    "compute_debounce_key",
    "compute_quota_key",
    "compute_singleton_key",
    "debounce_fair_shares",
    "debounce_lock_name",
    "debounce_open",
    "debounce_open_q",
    "debounce_throttle_keys",
    "decide_admission",
    "declared_limit",
    "effective_limit",
    "fair_place",
    "fair_tag",
    "free_slots",
    "free_slots_sql",
    "free_slots_sql_text",
    "handoff_admits",
    "holds_quota_slot",
    "holds_quota_slot_q",
    "holds_quota_slot_sql_text",
    "holds_slot",
    "holds_slot_q",
    "holds_slot_sql_text",
    "is_due",
    "is_due_q",
    "is_due_sql_text",
    "is_holder",
    "is_legacy_holder",
    "key_only_waiter_q",
    "key_tag",
    "legacy_holder_q",
    "legacy_holder_sql_text",
    "limit_in_force",
    "limit_in_force_sql",
    "limit_in_force_sql_text",
    "order_expressions",
    "order_sql_text",
    "queue_cap",
    "queue_order_sql_text",
    "queue_place",
    "queue_ttl_expired",
    "queue_ttl_expired_q",
    "queue_ttl_expired_sql_text",
    "queue_ttl_expires_at",
    "quota_front_reaches",
    "quota_keys_of",
    "quota_lock_name",
    "quota_tag",
    "quota_waiter_q",
    "quota_waiter_sql_text",
    "quota_waiting_q",
    "retry_delay",
    "singleton_admission_denial_patch",
    "singleton_admission_tags",
    "stored_tags",
    "superseded",
    "throttle_keys_of",
    "throttle_lock_name",
    "throttle_opens_at",
    "throttle_room",
    "throttle_waiter_q",
    "turn_on_its_way",
    "turn_on_its_way_q",
    "turn_rung",
    "user_tags_of",
    "waiter_expired",
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
#: The lowest and the highest priority of a run inside its key (X8), Django's task bounds;
#: a start without one has the priority 0.
MIN_PRIORITY = -100
MAX_PRIORITY = 100
#: A key's queue order as ``order_by`` fields (S5 step 3, X8): the higher priority first, then
#: the oldest by (``created_at``, ``run_id``). :func:`queue_place` is its Python spelling,
#: :func:`queue_order_sql_text` its SQL text; ``ds_run_queue_idx`` serves it.
QUEUE_ORDER = ("-priority", "created_at", "run_id")


def queue_place(priority: int, created_at: datetime, run_id: str) -> tuple[int, datetime, str]:
    """Return a waiter's sort key in its key's queue (S5 step 3, X8): higher ``priority``
    first, FIFO by (``created_at``, ``run_id``) within a priority; the one definition,
    :data:`QUEUE_ORDER` its ORM twin, :func:`queue_order_sql_text` its SQL text."""
    return (-priority, created_at, run_id)


def order_sql_text(order: Sequence[str], table: str) -> str:
    """SQL text of the ``order_by`` fields ``order`` (``-`` descending) as an ORDER BY list
    on the table named (or aliased) ``table``: :data:`QUEUE_ORDER`, :data:`QUOTA_ORDER`."""
    return ", ".join(f"{table}.{f[1:]} DESC" if f.startswith("-") else f"{table}.{f}" for f in order)


def order_expressions(order: Sequence[str]) -> list[Any]:
    """Return the ``order_by`` fields ``order`` (``-`` descending) as expressions, for a
    window's ``order_by`` (:data:`QUEUE_ORDER`, :data:`QUOTA_ORDER`)."""
    return [F(f[1:]).desc() if f.startswith("-") else F(f).asc() for f in order]


def queue_order_sql_text(table: str) -> str:
    """SQL text of :data:`QUEUE_ORDER` (an ORDER BY list) on the run table named (or
    aliased) ``table`` (S5 step 3, X8): ``priority DESC, created_at, run_id``."""
    return order_sql_text(QUEUE_ORDER, table)


def ahead_q(order: Sequence[str], place: Mapping[str, Any], prefix: str = "") -> Q:
    """Return the condition "before ``place`` in ``order``" (S5 step 3, X8, X3d): ``order``
    ``order_by`` fields (:data:`QUEUE_ORDER`, :data:`QUOTA_ORDER`; ``-`` descending), ``place``
    the run's value of each field (named without the ``-``), ``prefix`` a lookup path before
    each field. Its count plus one is the run's position in that order."""
    terms: list[Q] = []
    equal: dict[str, Any] = {}
    for spelled in order:
        field = spelled.lstrip("-")
        lookup = "gt" if spelled.startswith("-") else "lt"
        terms.append(Q(**equal, **{f"{prefix}{field}__{lookup}": place[field]}))
        equal[f"{prefix}{field}"] = place[field]
    return functools.reduce(operator.or_, terms)


def check_priority(value: object) -> int:
    """Return ``value`` as a run's priority inside its key (X8): an int (not a bool) from
    :data:`MIN_PRIORITY` to :data:`MAX_PRIORITY`. Raises
    :class:`~durable_singleton.exceptions.InvalidPriorityError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidPriorityError(f"priority must be an int, got {type(value).__name__} {value!r} (X8)")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise InvalidPriorityError(f"priority must be from {MIN_PRIORITY} to {MAX_PRIORITY}, got {value} (X8)")
    return int(value)


def declared_limit(limits: Mapping[str, int], name: str, stored: Iterable[int | None] = ()) -> int | None:
    """Return the declared limit of workflow ``name`` (or of a quota, by its
    lock name ``quota:<name>``) for :func:`limit_in_force` (S2, X3c).

    ``limits`` maps a name to the limit of its latest registered version (the
    engine's ``limits()``); ``stored`` gives the limits stored on the key's
    runs (None or 0: none stored), the fallback for a workflow this process
    does not declare, of which the largest counts (a quota's fallback is 1).
    Returns None when neither says (:func:`limit_in_force` reads 1). The one
    spelling of this fallback on every Python path; the PostgreSQL statements
    take the declared limit as a parameter (NULL: 1, as here with nothing
    stored).
    """
    if name in limits:
        return limits[name]
    known = [int(limit) for limit in stored if limit]
    return max(known) if known else None


def limit_in_force(declared: int | None, override: int | None = None) -> int:
    """Return the limit in force on a key: the runtime override if set (K2), else the declared one (S2).

    ``declared`` is the limit of the workflow's latest registered version, or
    the largest limit stored on the key's runs when this process does not
    know the workflow (None: 1). ``override`` is the key's runtime override
    (None: not set). Always >= 1. A lowered limit admits no one until holders
    drop below it and never evicts a holder (S8b, K2); a paused key keeps its
    limit and has no free slot (:func:`free_slots`). SQL twin:
    :func:`limit_in_force_sql`.
    """
    if override is not None:
        return max(int(override), 1)
    return max(int(declared or 1), 1)


#: The name this rule had before #16; kept for custom stores.
effective_limit = limit_in_force


def limit_in_force_sql(declared: Any, override: Any) -> Greatest:
    """SQL twin of :func:`limit_in_force`: ``GREATEST(COALESCE(override, declared, 1), 1)``.

    ``declared`` and ``override`` are expressions (a column name, ``F``, a
    ``Subquery``, an aggregate) or plain values; None is SQL NULL.
    """
    parts = [_expr(override), _expr(declared), Value(1)]
    return Greatest(Coalesce(*parts, output_field=IntegerField()), Value(1), output_field=IntegerField())


def limit_in_force_sql_text(declared: str, override: str) -> str:
    """SQL text of :func:`limit_in_force` for raw statements: ``declared`` and
    ``override`` are SQL expressions (a column, a placeholder), NULL when unset.

    Written without ``GREATEST`` so that it runs on every database the
    conformance suite checks it on.
    """
    chosen = f"COALESCE({override}, {declared}, 1)"
    return f"(CASE WHEN {chosen} < 1 THEN 1 ELSE {chosen} END)"


def free_slots(limit: int, holders: int, *, paused: bool) -> int:
    """Return a key's free slots: none while it is paused (K2), else ``limit - holders``, never negative (S5).

    ``limit`` is the limit in force (:func:`limit_in_force`), ``holders`` the
    number of runs that hold a slot (:func:`holds_slot`). SQL twin:
    :func:`free_slots_sql`.
    """
    if paused:
        return 0
    return max(int(limit) - int(holders), 0)


def free_slots_sql(limit: Any, holders: Any, paused: Any) -> Case:
    """SQL twin of :func:`free_slots`; each argument an expression, a column name or a value
    (``paused`` NULL: not paused)."""
    limit_e, holders_e = _expr(limit), _expr(holders)
    return Case(
        When(Exact(Coalesce(_expr(paused), Value(False)), Value(True)), then=Value(0)),
        When(GreaterThan(limit_e, holders_e), then=limit_e - holders_e),
        default=Value(0),
        output_field=IntegerField(),
    )


def free_slots_sql_text(limit: str, holders: str, paused: str) -> str:
    """SQL text of :func:`free_slots` for raw statements; each argument an SQL
    expression (``paused`` NULL: not paused), bracketed here: ``holders`` may be a sum
    (tracked and untracked holders, S12)."""
    return (
        f"(CASE WHEN COALESCE({paused}, FALSE) THEN 0 WHEN ({limit}) > ({holders})"
        f" THEN ({limit}) - ({holders}) ELSE 0 END)"
    )


def queue_cap(limit: int, max_queue_depth: int | None) -> int | None:
    """Return the active runs (or quota members) at which a start is refused,
    ``limit + max_queue_depth``, or None for an unbounded queue (S15, X3j):
    the one formula of a singleton key's and a quota key's cap."""
    return None if max_queue_depth is None else limit + max_queue_depth


def cap_in_force(declared_cap: int, declared: int | None, override: int | None) -> int:
    """Return the number of active runs at which ``start`` refuses a key's new runs (S15, K2).

    ``declared_cap`` is the declared ``limit + max_queue_depth`` (what the
    engine passes a store's ``create_run``), ``declared`` the declared limit
    it was computed from, ``override`` the key's runtime override: the cap is
    the limit in force plus ``max_queue_depth``.
    """
    depth = int(declared_cap) - max(int(declared or 1), 1)
    return limit_in_force(declared, override) + depth


def superseded[R](
    on_busy: str,
    free: int,
    holders: Sequence[R],
    waiters: Sequence[R],
    carries_quotas: Callable[[R], bool] = lambda _run: False,
) -> tuple[list[R], list[R]]:
    """Return (the waiters a new start replaces, the holders it asks to stop) (X1).

    ``free`` is the key's free slots (:func:`free_slots`), ``holders`` and
    ``waiters`` its active runs, waiters in queue order (:func:`queue_place`:
    higher priority first, then oldest, X8). ``"replace_queued"`` replaces the waiters queued behind the
    holders, those beyond the free slots (the ones within them are being
    admitted) and those within them that ``carries_quotas`` (a grant does not
    admit such a run: it may wait for a quota, X3h), so at most one run, the
    new one, is queued; ``"cancel_in_progress"``
    replaces every waiter and stops every holder, so the new run is admitted
    next, when they settle (D6). Any other strategy changes nothing. The stores
    call this under the key's lock, in the start's transaction.
    """
    if on_busy == OnBusy.CANCEL_IN_PROGRESS:
        return list(waiters), list(holders)
    if on_busy == OnBusy.REPLACE_QUEUED:
        free = max(free, 0)
        return [w for w in waiters[:free] if carries_quotas(w)] + list(waiters[free:]), []
    return [], []


def _expr(value: Any) -> Any:
    if isinstance(value, str):
        return F(value)
    if value is None or isinstance(value, (bool, int)):
        return Value(value)
    return value


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
        "status": RunStatus.SUSPENDED,
        "wake_at": now + timedelta(seconds=retry_delay(seconds, jitter)),
        "lease_owner": None,
        "lease_expires_at": None,
    }


def is_due(not_before: datetime | None, now: datetime) -> bool:
    """Tell whether a run may be claimed and admitted now: it has no ``not_before``,
    or ``not_before`` has come by ``now`` (X5): the one definition.

    ``now`` is the store's clock (the database's, R5), never a process's own.
    A run that is not due is skipped by its key's queue: it takes no slot and
    blocks none of the due waiters behind it; once due it is admitted in its
    (``created_at``, ``run_id``) place among the due waiters, the place it
    has held since its creation (S5 step 3). SQL twin: :func:`is_due_q`.
    """
    return not_before is None or not_before <= now


def is_due_q(now: Any, prefix: str = "") -> Q:
    """SQL twin of :func:`is_due` on the run table's ``not_before`` column;
    ``now`` is the database's clock (``querysets.DbNow()``) (X5, R5);
    ``prefix``: the lookup path to the run (``"run__"`` from a quota membership, X3d)."""
    return Q(**{f"{prefix}not_before__isnull": True}) | Q(**{f"{prefix}not_before__lte": now})


def is_due_sql_text(table: str, now: str) -> str:
    """SQL text of :func:`is_due` for raw statements, on the ``not_before``
    column of the run table named (or aliased) ``table``; ``now`` is the SQL of
    the database's clock (``querysets.PG_NOW_SQL``) (X5, R5)."""
    return f"({table}.not_before IS NULL OR {table}.not_before <= {now})"


def queue_ttl_expires_at(created_at: datetime, ttl: float) -> datetime:
    """Return when a waiter created at ``created_at`` ends by its key's
    ``queue_ttl`` of ``ttl`` seconds if it is not admitted by then (X2).

    It counts from the run's creation (``created_at``, stamped on the store's
    clock, R8), a delayed start's (X5) included, not from its ``not_before``.
    """
    return created_at + timedelta(seconds=ttl)


def queue_ttl_expired(created_at: datetime, ttl: float, now: datetime) -> bool:
    """Tell whether a waiter created at ``created_at`` has outlived ``ttl``
    seconds by ``now`` (X2): the one definition.

    ``now`` is the store's clock (the database's, R5), never a process's own.
    Only a waiter (an active run of a key without a slot, parked) expires; a
    run admitted meanwhile keeps its slot whatever its age. Every grant skips
    a waiter for which this is true (it is never admitted, the tick ends it);
    :func:`waiter_expired` applies it to an optional TTL. SQL twins:
    :func:`queue_ttl_expired_q`, :func:`queue_ttl_expired_sql_text`.
    """
    return queue_ttl_expires_at(created_at, ttl) <= now


def waiter_expired(created_at: datetime, ttl: float | None, now: datetime) -> bool:
    """:func:`queue_ttl_expired` for a workflow that may declare no TTL
    (``ttl`` None: never expired): what every grant asks of a waiter (X2, S5)."""
    return ttl is not None and queue_ttl_expired(created_at, ttl, now)


def queue_ttl_expired_q(ttl: float, now: Any, prefix: str = "") -> Q:
    """SQL twin of :func:`queue_ttl_expired` on the run table's ``created_at``
    column (``prefix``: the path to the run, ``"run__"`` from a quota
    membership); ``now`` is the database's clock (``querysets.DbNow()``) (X2, R5)."""
    cutoff = ExpressionWrapper(now - Value(timedelta(seconds=ttl)), output_field=DateTimeField())
    return Q(**{f"{prefix}created_at__lte": cutoff})


def queue_ttl_expired_sql_text(table: str, ttl: str, now: str) -> str:
    """SQL text of :func:`waiter_expired` for raw statements, on the
    ``created_at`` column of the run table named (or aliased) ``table``:
    ``ttl`` is the SQL of the TTL in seconds (a ``float8`` parameter, NULL when
    the workflow declares none: never expired), ``now`` the SQL of the
    database's clock (X2, R5). Always TRUE or FALSE, never NULL."""
    return f"COALESCE({table}.created_at <= {now} - make_interval(secs => {ttl}), FALSE)"


def check_not_before(value: object, now: datetime) -> datetime | None:
    """Return the ``not_before`` time of a delayed start (X5), or None for no delay.

    ``value``: None; an aware :class:`~datetime.datetime` within
    :data:`~durable_singleton.values.MAX_SECONDS` (100 years) of ``now``, either
    way; or a number of seconds from ``now`` (an int or float, finite, >= 0, at
    most ``MAX_SECONDS``), ``now`` being the engine's clock corrected to the
    store's (R8). A time in the past is due at once. The bound keeps every time
    computed from it (its execution deadline, D5) within every database's
    datetime range. Raises :class:`InvalidNotBeforeError` for a naive datetime,
    one farther from ``now``, a negative, infinite, NaN or larger number of
    seconds, a bool or any other type (section 7).
    """
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidNotBeforeError(f"not_before must be an aware datetime, got the naive {value.isoformat()}")
        try:
            gap = abs((value.astimezone(UTC) - now).total_seconds())
        except OverflowError:  # its UTC instant is outside datetime's range
            gap = math.inf
        if gap > MAX_SECONDS:
            raise InvalidNotBeforeError(
                f"not_before must be within {MAX_SECONDS:g} seconds (100 years) of now, got {value.isoformat()}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidNotBeforeError(
            f"not_before must be an aware datetime or a number of seconds, got {type(value).__name__}"
        )
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise InvalidNotBeforeError(
            f"not_before in seconds must be finite, >= 0 and <= {MAX_SECONDS:g} (100 years), got {value!r}"
        )
    return now + timedelta(seconds=value)


@dataclass(frozen=True)
class Candidate:
    """One active run of a key, as admission sees it (``not_before``: its delayed start, X5)."""

    run_id: str
    created_at: datetime
    status: str
    tags: Sequence[str]
    not_before: datetime | None = None
    priority: int = 0

    @property
    def order(self) -> tuple[int, datetime, str]:
        """Admission order: :func:`queue_place` (S5 step 3, X8)."""
        return queue_place(self.priority, self.created_at, self.run_id)


def is_legacy_holder(status: str, *, key: str | None, tracked: bool) -> bool:
    """Tell whether a run of an older release holds a slot: it has a key, no
    tracked marker, and is ``running``, ``suspended`` or ``blocked`` (S12)."""
    return key is not None and not tracked and status in HOLDING_LEGACY_STATUSES


def holds_slot(status: str, *, key: str | None, admitted: bool, tracked: bool) -> bool:
    """Tell whether a run holds a slot of its key (S5 step 2, S6, S12): the one definition.

    ``key``: the run's singleton key (None: no key, no slot); ``admitted``:
    it carries the admitted marker (``singleton_slot`` = ``holder``);
    ``tracked``: it carries the tracked marker. An active run with the
    admitted marker holds its slot whatever it is doing; an untracked active
    run of an older release holds one when it is ``running``, ``suspended``
    or ``blocked`` (:func:`is_legacy_holder`). A terminal run holds nothing.
    SQL twin: :func:`holds_slot_q`.
    """
    if key is None or status not in ACTIVE_STATUSES:
        return False
    return admitted or is_legacy_holder(status, key=key, tracked=tracked)


def legacy_holder_q() -> Q:
    """SQL twin of :func:`is_legacy_holder`, on the run table's columns (S12)."""
    return Q(singleton_key__isnull=False, singleton_tracked=False, status__in=HOLDING_LEGACY_STATUSES)


def holds_slot_q() -> Q:
    """SQL twin of :func:`holds_slot`, on the run table's columns (S5, S12)."""
    marked = Q(singleton_key__isnull=False, singleton_slot=SlotState.HOLDER, status__in=ACTIVE_STATUSES)
    return marked | legacy_holder_q()


class TurnRun(Protocol):
    """What :func:`turn_rung` reads of a run (a ``RunRecord``)."""

    @property
    def status(self) -> str: ...
    @property
    def is_terminal(self) -> bool: ...
    @property
    def cancel_requested(self) -> bool: ...
    @property
    def recoveries(self) -> int: ...
    @property
    def holds_slot(self) -> bool: ...
    @property
    def quota_slot(self) -> str | None: ...
    @property
    def singleton_key(self) -> str | None: ...


def turn_rung(run: TurnRun | None, *, expired: bool, due: bool, max_recoveries: int) -> Rung:
    """The turn ladder: what a claim of ``run`` does, decided here once for every
    store (the Django store's rooms and its ORM path, the memory store, the S14
    fallback). ``run`` is the run as the claim read it (None: there is none);
    ``expired``: its lease ended on the store's clock (R5); ``due``: its
    ``not_before`` has come on that clock (:func:`is_due`, X5). The rungs, in
    order: a run gone, terminal or leased by a live executor is skipped (R6); a
    requested cancel settles it (S9); a recovery past ``max_recoveries``
    settles it dead (D4); a delayed start before its time is not claimed (X5);
    a carrier of quota or throttle keys is admitted under all its limits (X3,
    X6); a run without a key or a holder takes its lease (S6), a holder whose
    lease expired with a new token (K1); any other run is a waiter (S4, S5).
    A store that cannot carry out a rung on its short path hands the turn to
    its reference path, which stands on the same rung.
    """
    if run is None or run.is_terminal or (run.status == RunStatus.RUNNING and not expired):
        return Rung.SKIP
    recovered = run.status == RunStatus.RUNNING
    if run.cancel_requested:
        return Rung.CANCEL
    if recovered and run.recoveries >= max_recoveries:
        return Rung.DEAD
    if not due and not recovered and not run.holds_slot:
        return Rung.NOT_DUE
    if run.quota_slot is not None:
        return Rung.LIMITS
    if run.singleton_key is None or run.holds_slot:
        return Rung.TAKE_OVER if run.singleton_key is not None and recovered else Rung.TAKE
    return Rung.ADMIT


def turn_on_its_way(status: str, park_reason: str, wake_at: datetime | None, now: datetime) -> bool:
    """Tell whether a run's turn was sent and is still within its redelivery
    window: it is ``pending`` with no park reason and its ``wake_at`` is after
    ``now`` (S8, S8a, S7a).

    A start stamps ``wake_at`` = ``created_at`` + ``REDELIVERY_SECONDS`` and
    sends the first turn; a retry does the same, and the tick's ``due`` job
    pushes ``wake_at`` one window ahead whenever it sends a turn again. Such a
    waiter claims by its own turn, so the tick's per-key catch-up leaves it
    alone (granting it would send a second turn); once ``wake_at`` passes the
    turn is overdue (lost), and the catch-up grants it like any waiter.
    ``now`` is the store's clock (R5, R8); ``wake_at`` None is no window.
    A run parked with a reason (a waiter denied admission, a deep start, a
    hand-back) has no turn on its way. SQL twin: :func:`turn_on_its_way_q`.
    """
    return status == RunStatus.PENDING and not park_reason and wake_at is not None and wake_at > now


def turn_on_its_way_q(now: Any) -> Q:
    """SQL twin of :func:`turn_on_its_way`, on the run table's columns;
    ``now`` is an expression of the database's clock (``DbNow()``, R5)."""
    return Q(status=RunStatus.PENDING, park_reason="", wake_at__gt=now)


# -- shared quotas (X3) ---------------------------------------------------------------------
#: Prefix of a quota's name in the key table (X3b), and of a quota key in :attr:`RunRecord.tags`.
QUOTA_PREFIX = "quota:"
#: Longest quota name accepted (characters, X3a).
QUOTA_NAME_MAX_LENGTH = 64
#: Longest quota key accepted (characters, X3a).
#: The key table's ``workflow_name`` prefix of a workflow's debounce lock rows (X7b).
DEBOUNCE_PREFIX = "debounce:"


def debounce_lock_name(workflow: str) -> str:
    """Return the key table's ``workflow_name`` of ``workflow``'s debounce keys:
    ``debounce:<workflow>``, cut to the column's 191 characters (X7b). Two names
    cut alike share their lock rows: it serializes more starts, never fewer."""
    return f"{DEBOUNCE_PREFIX}{workflow}"[:KEY_MAX_LENGTH]


def compute_debounce_key(workflow: str, key_fn: Callable[[Any], object], input: Any) -> str:
    """Compute a start's debounce key from its input (X7), as
    :func:`compute_singleton_key` computes a singleton key; raises
    :class:`SingletonKeyError` naming the debounce key."""
    try:
        return compute_singleton_key(workflow, key_fn, input)
    except SingletonKeyError as exc:
        problem = str(exc).split(": singleton key: ", 1)[-1]
        raise SingletonKeyError(workflow, problem, "debounce key") from exc.__cause__


def debounce_open(run: Any, now: datetime) -> bool:
    """Tell whether the debounced ``run`` (a RunRecord) is open, so that a start of
    its debounce key folds into it (X7a): ``pending``, holding no slot of its key
    nor of its quotas, no lease, and its ``not_before`` later than ``now``, the
    store's clock (R5). No claim takes a run before its ``not_before`` (X5), so
    an open run's body has not been entered. SQL twin: :func:`debounce_open_q`."""
    return (
        run.debounce_key is not None
        and run.status == RunStatus.PENDING
        and not run.admitted
        and run.quota_slot != SlotState.HOLDER
        and run.lease_owner is None
        and run.not_before is not None
        and run.not_before > now
    )


def debounce_fair_shares(shares: Iterable[Sequence[Any]]) -> frozenset[tuple[str, str]]:
    """Return the (quota, sub-key) pairs of a run's fair quotas (X4) from its
    ``(quota, sub_key, ...)`` rows, the empty sub-keys of plain quotas left out:
    a start folds into an open run only if they are equal (X7a), since the
    run's memberships count it under those sub-keys and a fold changes none."""
    return frozenset((str(row[0]), str(row[1])) for row in shares if row[1])


def debounce_throttle_keys(throttle_keys: Iterable[Sequence[Any]]) -> tuple[tuple[str, str], ...]:
    """Return the (throttle, key) pairs of a run's throttle keys (X6) from its
    ``(name, key, ...)`` rows, sorted: a start folds into an open run only if
    they are equal (X7a), since the run is admitted under those keys' rates and
    a fold changes none of them (a fold across throttle keys ran one key's input
    under another key's rate)."""
    return tuple(sorted((str(row[0]), str(row[1])) for row in throttle_keys))


def debounce_open_q(now: Any) -> Q:
    """SQL twin of :func:`debounce_open` on the run table; ``now`` is the database's
    clock (``querysets.DbNow()``) (X7a, R5)."""
    return (
        Q(debounce_key__isnull=False, status=RunStatus.PENDING, lease_owner__isnull=True, not_before__gt=now)
        & (Q(singleton_slot__isnull=True) | ~Q(singleton_slot=SlotState.HOLDER))
        & (Q(quota_slot__isnull=True) | ~Q(quota_slot=SlotState.HOLDER))
    )


QUOTA_KEY_MAX_LENGTH = 127


def quota_lock_name(name: str) -> str:
    """Return the key table's ``workflow_name`` of the quota ``name``: ``quota:<name>`` (X3b).

    No workflow may have a name of that spelling (X3a), so a quota key never
    collides with a singleton key, and the key controls (K2) address it as
    ``(quota_lock_name(name), key)``."""
    return f"{QUOTA_PREFIX}{name}"


def quota_tag(name: str, key: str) -> str:
    """Return ``quota:<name>:<key>``, how :attr:`RunRecord.tags` spells one quota key a run
    carries (X3b); stored in the ``tags`` column beside the caller's tags for an older
    release's processes (:func:`stored_tags`), never read back as a key (the keys are the
    run's ``quota_keys``)."""
    return f"{QUOTA_PREFIX}{name}:{key}"


def stored_tags(user_tags: Iterable[str], quota_keys: Iterable[tuple[str, str]]) -> list[str]:
    """Return the ``tags`` column of a run: the caller's tags, then one
    :func:`quota_tag` per quota key it carries (X3b, R1). The keys' source is the
    ``quota_keys`` column; their tags are written too so that a process of the release
    before migration 0015, still running during a rolling upgrade, which reads a run's
    quota keys from its tags, sees the quotas of the runs this release starts (a start
    drops a caller's tag spelled ``quota:...``, so every such tag of a new run is one of
    its keys)."""
    tags = list(user_tags)
    tags.extend(quota_tag(name, key) for name, key in quota_keys)
    return tags


def user_tags_of(stored: Iterable[str] | None, quota_keys: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """Return a run's caller tags from its ``tags`` column: every tag but the
    :func:`stored_tags` spelling of the keys in ``quota_keys`` (X3b, R1). A tag that
    only looks like a quota key (an older release's caller tag ``quota:billing:acme`` on
    a run without that key) stays the caller's."""
    spelled = {quota_tag(name, key) for name, key in quota_keys}
    return tuple(tag for tag in stored or () if tag not in spelled)


def quota_keys_of(stored: Iterable[Sequence[str]] | None) -> tuple[tuple[str, str], ...]:
    """Return a run's quota keys as (name, key) pairs from its ``quota_keys`` column,
    ``[[name, key], ...]`` (X3b): the keys its start recorded beside its memberships.

    The only source of a run's quota keys: a caller's tag is never read as one,
    whatever its spelling (an older release stored ``quota:...`` tags as given, R1)."""
    return tuple((str(name), str(key)) for name, key in stored or ())


def compute_quota_key(
    workflow: str, quota: str, key_fn: Callable[[Any], object], input: Any, what: str = "key", kind: str = "quota"
) -> str:
    """Compute a run's key of the quota ``quota`` from its input, once, at start (X3a, S1);
    with ``what="fair_key"``, its sub-key (X4); with ``kind="throttle"``, its key of the
    throttle ``quota`` (X6).

    Raises :class:`SingletonKeyError` naming the workflow and the quota (or throttle) if
    ``key_fn`` raises, or returns anything but a non-empty ``str`` of at most
    :data:`QUOTA_KEY_MAX_LENGTH` characters.
    """
    subject = f"{kind} {quota!r}"
    try:
        key = key_fn(input)
    except Exception as exc:  # the user's key function may raise anything
        raise SingletonKeyError(workflow, f"{what} function raised {type(exc).__name__}: {exc}", subject) from exc
    if not isinstance(key, str) or not key:
        got = "an empty string" if isinstance(key, str) else type(key).__name__
        raise SingletonKeyError(workflow, f"{what} function returned {got}, not a non-empty str", subject)
    if len(key) > QUOTA_KEY_MAX_LENGTH:
        raise SingletonKeyError(
            workflow, f"{what} is {len(key)} characters long; at most {QUOTA_KEY_MAX_LENGTH}", subject
        )
    return key


def holds_quota_slot(status: str, quota_slot: str | None) -> bool:
    """Tell whether a run holds a slot of each quota key it carries (X3c): the one definition.

    ``quota_slot`` is the run's quota marker (``Run.quota_slot``, mirrored on
    each of its memberships): ``holder`` once admitted in every limit it
    carries, ``waiter`` before, None without quotas or once terminal. A run
    holds its quota slots when it is active and marked ``holder``; a terminal
    run holds none."""
    return status in ACTIVE_STATUSES and quota_slot == SlotState.HOLDER


def holds_quota_slot_q() -> Q:
    """SQL twin of :func:`holds_quota_slot` on the quota membership table (X3c):
    the membership is marked ``holder`` and its run is active."""
    return Q(slot=SlotState.HOLDER, run__status__in=ACTIVE_STATUSES)


def key_only_waiter_q() -> Q:
    """The runs that wait for a slot of their singleton key and carry no quota (X3d):
    the waiters a free slot of their key alone admits. One that carries quotas may
    wait for one of them (X3h): the slot audit's stalled waiter and the queue
    table's "free slot" judge only these, and the tick's catch-up (S8b) grants a
    key whose first waiters all carry quotas only when one of them has room in
    each (``DjangoStore._catch_up_worth``)."""
    return Q(singleton_slot=SlotState.WAITER, quota_slot__isnull=True)


def quota_waiting_q() -> Q:
    """The memberships that wait in a quota key's queue, due or not (X3c): marked
    ``waiter``, their run active."""
    return Q(slot=SlotState.WAITER, run__status__in=ACTIVE_STATUSES)


def quota_waiter_q(now: Any, ttls: Mapping[str, float] | None = None) -> Q:
    """The memberships that wait in a quota key's queue and are due (X3d, X5) by
    ``now``, the database's clock (``DbNow()``, R5): the ones a claim orders.
    With ``ttls`` (the ``queue_ttl`` seconds by workflow name), not those past
    their workflow's TTL: every grant skips them, a quota's as a key's (X2,
    :func:`waiter_expired`); the tick ends them."""
    waiting = quota_waiting_q() & is_due_q(now, "run__")
    for workflow, ttl in sorted((ttls or {}).items()):
        if ttl is not None:
            waiting &= ~(Q(run__workflow_name=workflow) & queue_ttl_expired_q(ttl, now, "run__"))
    return waiting


def holds_quota_slot_sql_text(membership: str, run: str) -> str:
    """SQL text of :func:`holds_quota_slot_q` for raw statements, on the quota
    membership table aliased ``membership`` joined to its run aliased ``run`` (X3c)."""
    return f"({membership}.slot = '{SlotState.HOLDER.value}' AND {run}.status IN ({_sql_in(ACTIVE_STATUSES)}))"


def quota_waiter_sql_text(membership: str, run: str, now: str, ttls: str = "") -> str:
    """SQL text of :func:`quota_waiter_q` for raw statements, on the aliases of
    :func:`holds_quota_slot_sql_text`; ``now`` the SQL of the database's clock (X3d, X5, R5);
    ``ttls``: the SQL of a ``jsonb`` object of the ``queue_ttl`` seconds by workflow name
    (the waiters past their TTL left out, X2), or '' for none."""
    expired = (
        f" AND NOT {queue_ttl_expired_sql_text(run, f'({ttls} ->> {run}.workflow_name)::float8', now)}" if ttls else ""
    )
    return (
        f"({membership}.slot = '{SlotState.WAITER.value}' AND {run}.status IN ({_sql_in(ACTIVE_STATUSES)})"
        f" AND {is_due_sql_text(run, now)}{expired})"
    )


#: The admission order of a quota key's waiters, by membership (X3d, X4, X8): the one order
#: :meth:`DjangoStore._quota_front <durable_singleton.stores.django.DjangoStore._quota_front>`
#: reads and :func:`fair_tag` feeds; after the fair tag, :data:`QUEUE_ORDER`.
QUOTA_ORDER = ("tag", *QUEUE_ORDER)


#: Largest weight of a sub-key inside a fair quota (slots per round, X4).
MAX_WEIGHT = 1000


#: The virtual time one admission of a sub-key of weight 1 takes in a fair quota (X4).
FAIR_SCALE = 1000


def fair_tag(virtual_time: int, last_tag: int | None, weight: int) -> int:
    """Return the tag of a run joining a quota key's queue (X3d, X4): its admission
    order is by (tag, ``created_at``, ``run_id``), the one definition.

    Start-time fair queuing: ``virtual_time`` is the largest tag among the quota
    key's holders (0 if none); ``last_tag`` the largest tag among the active
    members of the run's sub-key (None if none); ``weight`` the sub-key's slots
    per round. The run's tag is the later of the virtual time and the end of its
    sub-key's last turn, ``last_tag + FAIR_SCALE // weight``: a sub-key's burst of
    10,000 gets tags one turn apart, and another sub-key's single run, arriving
    later, gets the virtual time, ahead of all but the burst's first. In a quota
    without ``fair_key`` every run has the tag 0: oldest first, as S5 step 3.
    Tags are written at the starts (a start that passes its sub-key's waiters of a
    lower priority moves them one turn later, :func:`fair_place`); two starts racing on one
    sub-key may get one tag (then the older goes first): fairness is
    approximate, admission (:func:`quota_front_reaches`) is exact."""
    if last_tag is None:
        return max(virtual_time, 0)
    return max(virtual_time, last_tag + FAIR_SCALE // max(weight, 1))


def fair_place(virtual_time: int, last_tag: int | None, weight: int, passed: Sequence[int]) -> tuple[int, int]:
    """Return (the tag of a run joining a fair quota key's queue, the tags' shift of the
    waiters of its sub-key it passes) (X4b, X8c): the one definition.

    ``passed``: the tags of its sub-key's waiters of a lower priority than its own. With
    none, its tag is :func:`fair_tag` and nothing shifts. Else it takes the earliest of
    their tags and each of them moves one turn later (``FAIR_SCALE // weight``, the shift
    returned): the sub-key's turns stay where they were, plus one at their end, as for any
    new run of the sub-key, and within the sub-key the higher priority goes first (X8);
    the other sub-keys' runs keep their tags, so the round-robin across sub-keys is kept."""
    if not passed:
        return fair_tag(virtual_time, last_tag, weight), 0
    return min(passed), FAIR_SCALE // max(weight, 1)


def quota_front_reaches(run_id: str, waiters: Sequence[str], free: int) -> bool:
    """Tell whether ``run_id`` is among the first ``free`` of a limit's due
    waiters, ``waiters`` given oldest first by (``created_at``, ``run_id``)
    (X3d, S5 step 3): a run is admitted only when this holds in every limit it
    carries, so a run at the front of a limit is never overtaken there."""
    return free > 0 and run_id in waiters[:free]


def handoff_admits(
    fronts: Mapping[tuple[str, str], tuple[int, Sequence[str]]],
    carried: Callable[[str], Iterable[tuple[str, str]]],
) -> dict[str, dict[tuple[str, str], int]]:
    """Return the waiters that carry quotas which a handoff admits on its own (X3h, X3d).

    ``fronts``: each quota key the handoff locked, as (name, key), with its free
    slots (after the settled run's) and its first due waiters' run ids in
    admission order. ``carried``: the quota keys (name, key) of a run id. A run
    within the free slots of one of ``fronts`` is admitted when every quota key
    it carries is one of ``fronts`` and it is within that key's free slots
    (:func:`quota_front_reaches`): the handoff holds the locks of all its quota
    limits and decides as the run's own claim would. Its status, its cancel
    flag and its singleton key (the handoff's own, granting it a slot) are the
    caller's to check. Returns, in order of first place, each run's place
    (1-based) in each of its quota keys: the order of its token there (X3f)."""
    places: dict[str, dict[tuple[str, str], int]] = {}
    for quota_key, (free, waiters) in fronts.items():
        for pos, run_id in enumerate(waiters[: max(free, 0)], start=1):
            places.setdefault(run_id, {})[quota_key] = pos
    return {
        run_id: where
        for run_id, where in places.items()
        if set(carried(run_id)) == set(where)  # every limit it carries is held here, and it is within each
    }


# -- throttles (X6) -------------------------------------------------------------------------
#: Prefix of a throttle's name in the key table (X6): its lock row and K2 controls.
THROTTLE_PREFIX = "throttle:"


def throttle_lock_name(name: str) -> str:
    """Return the key table's ``workflow_name`` of the throttle ``name``: ``throttle:<name>`` (X6).

    No workflow may have a name of that spelling (X3a, X6), so a throttle key never
    collides with a singleton or quota key, and the key controls (K2: pause, limit
    override) address it as ``(throttle_lock_name(name), key)``."""
    return f"{THROTTLE_PREFIX}{name}"


def throttle_keys_of(stored: Iterable[Sequence[Any]] | None) -> tuple[tuple[str, str, int, float], ...]:
    """Return a run's throttle keys as (name, key, declared limit, period seconds) from its
    ``throttle_keys`` column, ``[[name, key, limit, period], ...]`` (X6): written once at its
    start."""
    return tuple((str(n), str(k), int(lim), float(per)) for n, k, lim, per in stored or ())


def throttle_waiter_q(now: Any, ttls: Mapping[str, float] | None = None) -> Q:
    """The throttle memberships whose run waits in the throttle key's queue and is due
    by ``now`` (``DbNow()``, R5) (X6, X3d, X5): the run is active and marked a waiter
    (``quota_slot``); with ``ttls``, not past its workflow's ``queue_ttl`` (X2)."""
    waiting = Q(run__quota_slot=SlotState.WAITER, run__status__in=ACTIVE_STATUSES) & is_due_q(now, "run__")
    for workflow, ttl in sorted((ttls or {}).items()):
        if ttl is not None:
            waiting &= ~(Q(run__workflow_name=workflow) & queue_ttl_expired_q(ttl, now, "run__"))
    return waiting


def throttle_room(
    limit: int, admissions: Sequence[datetime], period: float, now: datetime, *, paused: bool
) -> tuple[int, datetime | None]:
    """Return a throttle key's (free admissions now, when a waiter they do not reach may
    next be admitted) (X6): the one rule.

    ``admissions``: the key's recorded admission times (any order; those at or before
    ``now - period`` are not counted); ``now``: the store's clock (the database's, R5);
    ``limit``: the limit in force (:func:`limit_in_force`, K2). A throttle key admits at
    most ``limit`` runs in any half-open interval ``[t, t + period)``: an admission at
    ``now`` is allowed while fewer than ``limit`` admissions lie in ``(now - period, now]``.
    The opening, for a waiter the free admissions do not reach: when the key is full, the
    time the oldest admission that keeps it full leaves the window
    (:func:`throttle_opens_at`); with room, the free admissions go to the older waiters
    first and fill the window, so no earlier than its oldest admission (or ``now``, if it
    has none) plus ``period``. None while the key is paused (a paused key has no free
    admission, K2; its waiters retry)."""
    cutoff = now - timedelta(seconds=period)
    counted = sorted(a for a in admissions if a > cutoff)
    free = free_slots(limit, len(counted), paused=paused)
    if paused:
        return 0, None
    if free > 0:
        return free, (counted[0] if counted else now) + timedelta(seconds=period)
    return 0, throttle_opens_at(limit, counted, period)


def throttle_opens_at(limit: int, counted: Sequence[datetime], period: float) -> datetime | None:
    """Return when a full throttle key next has room (X6): with ``counted`` the
    admissions in the window, oldest first, the ``(len(counted) - limit + 1)``-th oldest
    plus ``period`` seconds (then ``limit - 1`` remain in the window). None with room."""
    if len(counted) < max(limit, 1):
        return None
    return counted[len(counted) - max(limit, 1)] + timedelta(seconds=period)


def _sql_in(values: Iterable[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def legacy_holder_sql_text(table: str) -> str:
    """SQL text of :func:`is_legacy_holder` for raw statements, on the columns of
    the run table named (or aliased) ``table`` (S12)."""
    return (
        f"({table}.singleton_key IS NOT NULL AND NOT {table}.singleton_tracked"
        f" AND {table}.status IN ({_sql_in(HOLDING_LEGACY_STATUSES)}))"
    )


def holds_slot_sql_text(table: str) -> str:
    """SQL text of :func:`holds_slot` for raw statements, on the columns of the
    run table named (or aliased) ``table`` (S5, S12)."""
    marked = (
        f"({table}.singleton_key IS NOT NULL AND {table}.singleton_slot = '{SlotState.HOLDER.value}'"
        f" AND {table}.status IN ({_sql_in(ACTIVE_STATUSES)}))"
    )
    return f"({marked} OR {legacy_holder_sql_text(table)})"


def is_holder(status: str, tags: Sequence[str]) -> bool:
    """Tell whether an active run with a key holds a slot, from its tags (S5 step 2, S12):
    :func:`holds_slot` with the markers read from ``tags``."""
    return holds_slot(status, key="", admitted=ADMITTED_TAG in tags, tracked=TRACKED_TAG in tags)


def _skipped_as_expired(c: Candidate, run_id: str, ttl: float | None, now: datetime) -> bool:
    """A waiter that no grant reaches (X2): past its TTL, and parked or the claimant itself."""
    return (c.run_id == run_id or c.status != RunStatus.RUNNING) and waiter_expired(c.created_at, ttl, now)


def decide_admission(
    candidates: Iterable[Candidate], run_id: str, limit: int, now: datetime | None = None, ttl: float | None = None
) -> bool:
    """Decide whether ``run_id`` may take a slot among the key's active runs.

    ``candidates`` are the active runs of one workflow and key (S5 step 1).
    Holders keep their slots; the ``limit - holders`` free slots go to the
    oldest due waiters (:func:`is_due` at ``now``, the store's clock; None:
    every waiter is due) by (``created_at``, ``run_id``); pending runs are
    waiters too (X5). ``ttl``: the workflow's ``queue_ttl`` in seconds (None:
    none); with ``now``, a parked waiter past it (:func:`waiter_expired`), or
    ``run_id`` itself past it, is skipped, never admitted (X2); another
    running run without the marker (a claim under way) keeps its place.
    Returns True if ``run_id`` is a holder or among those waiters.
    """
    runs = [c for c in candidates if c.status in ACTIVE_STATUSES]
    holders = [c for c in runs if is_holder(c.status, c.tags)]
    if any(c.run_id == run_id for c in holders):
        return True
    free = limit - len(holders)
    if free <= 0:
        return False
    waiters = sorted(
        (
            c
            for c in runs
            if not is_holder(c.status, c.tags)
            and (now is None or (is_due(c.not_before, now) and not _skipped_as_expired(c, run_id, ttl, now)))
        ),
        key=lambda c: c.order,
    )
    return any(c.run_id == run_id for c in waiters[:free])
