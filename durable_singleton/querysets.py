"""Intention-revealing querysets for runs, and the database clock.

Every decision that compares a stored time with "now" (lease expiry, wake
times, execution deadlines) is made in SQL against :class:`DbNow`, the
database server's clock in UTC, never against a process's own clock (R5).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import ExpressionWrapper, Func, Value
from django.db.models.expressions import CombinedExpression

from .admission import (
    QUEUE_ORDER,
    holds_slot_q,
    is_due_q,
    is_due_sql_text,
    key_only_waiter_q,
    legacy_holder_q,
    queue_order_sql_text,
)
from .conf import Settings
from .renewals import unrenewed_q
from .statuses import ACTIVE_STATUSES, PARKED_STATUSES, WAKEABLE_STATUSES, RunStatus, SlotState

if TYPE_CHECKING:
    from .models import Run  # noqa: F401  (the queryset's type argument, as a string)

__all__ = ["PG_NOW_SQL", "DbNow", "RunQuerySet", "db_now_plus", "sqlite_now"]

#: :class:`DbNow` on PostgreSQL, the spelling the raw statements of
#: :mod:`durable_singleton.stores.pg` use too (R5).
PG_NOW_SQL = "STATEMENT_TIMESTAMP()"


def sqlite_now() -> datetime:
    """Return SQLite's clock: the UTC time of the database file's host, in microseconds.

    SQLite's own ``'now'`` reads the same host clock to the millisecond only;
    with that, a run created and claimed within one millisecond could read as
    started before it was created, and two starts of one millisecond would tie
    in the queue order (R8, S5). SQLite runs in the process, so the process
    reads the host clock directly.
    """
    return datetime.now(UTC)


def database_now(using: str) -> datetime:
    """Return the database server's time in UTC for Django database ``using`` (an alias;
    R5, R8): on SQLite, its host's (:func:`sqlite_now`). The one read of the database's
    clock by a statement of its own (``DjangoStore.now`` and the worker registry call it)."""
    connection = connections[using]
    if connection.vendor == "sqlite":
        return sqlite_now()
    sql = "SELECT STATEMENT_TIMESTAMP()" if connection.vendor == "postgresql" else "SELECT UTC_TIMESTAMP(6)"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        value: Any = cursor.fetchone()[0]
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    moment: datetime = value if value.tzinfo is not None else value.replace(tzinfo=UTC)  # MySQL's is naive UTC
    return moment


class DbNow(Func):
    """The database server's current time in UTC: the one clock of leases (R5, S13a).

    PostgreSQL: ``STATEMENT_TIMESTAMP()``; MySQL/MariaDB: ``UTC_TIMESTAMP(6)``,
    whatever the session's ``time_zone`` (Django stores UTC there);
    SQLite: :func:`sqlite_now`, the UTC time of the file's host, bound as a
    parameter when the statement is compiled, read once for the whole statement.
    """

    template = "CURRENT_TIMESTAMP"
    output_field = models.DateTimeField()

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template=PG_NOW_SQL, **extra)

    def as_mysql(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(compiler, connection, template="UTC_TIMESTAMP(6)", **extra)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        # Naive UTC, as the database's clock reads on every vendor (whatever USE_TZ says; check E012).
        # One reading per statement (its compiler), as STATEMENT_TIMESTAMP() and UTC_TIMESTAMP(6)
        # are one instant through a statement: an UPDATE that writes the clock into two columns
        # writes the same time into both.
        now = getattr(compiler, "_ds_now", None)
        if now is None:
            now = sqlite_now().replace(tzinfo=None).isoformat(" ", timespec="microseconds")
            compiler._ds_now = now
        return "%s", [now]


def db_now_plus(seconds: float) -> ExpressionWrapper[CombinedExpression]:
    """Return the expression "database now + ``seconds``" (R5)."""
    return ExpressionWrapper(DbNow() + Value(timedelta(seconds=seconds)), output_field=models.DateTimeField())


class RunQuerySet(models.QuerySet["Run"]):
    """Query helpers that name the admission vocabulary (holder, waiter, due, lease)."""

    def active(self) -> RunQuerySet:
        """Runs in ``pending``, ``running``, ``suspended`` or ``blocked`` (R2)."""
        return self.filter(status__in=ACTIVE_STATUSES)

    def parked(self) -> RunQuerySet:
        """Active runs that are not running, so hold no lease (D1-D3)."""
        return self.filter(status__in=PARKED_STATUSES)

    def for_key(self, workflow_name: str, key: str) -> RunQuerySet:
        """Runs of one workflow (all versions) tagged with one key (S2)."""
        return self.filter(workflow_name=workflow_name, singleton_key=key)

    def holders(self) -> RunQuerySet:
        """Active runs that hold a slot: admitted, or untracked legacy runs (S5, S12)."""
        return self.filter(holds_slot_q())

    @staticmethod
    def legacy_q() -> models.Q:
        """Untracked active runs of an older release that count as holders (S12):
        :func:`~durable_singleton.admission.legacy_holder_q`."""
        return legacy_holder_q()

    def waiting(self) -> RunQuerySet:
        """Active runs waiting for a slot, in admission order (S5 step 3, X8:
        :data:`~durable_singleton.admission.QUEUE_ORDER`), due or not (X5)."""
        return self.filter(singleton_slot=SlotState.WAITER).order_by(*QUEUE_ORDER)

    def admissible(self) -> RunQuerySet:
        """Runs whose delayed start has come by the database's clock (X5, R5):
        :func:`~durable_singleton.admission.is_due_q` at :class:`DbNow`."""
        return self.filter(is_due_q(DbNow()))

    def not_due(self) -> RunQuerySet:
        """Runs whose delayed start has not come yet by the database's clock (X5, R5)."""
        return self.exclude(is_due_q(DbNow()))

    def due_waiting(self) -> RunQuerySet:
        """The waiters the free slots go to, in admission order: :meth:`waiting` that are
        :meth:`admissible` (S5 step 3, X5); a waiter not due yet blocks none of them."""
        return self.waiting().admissible()

    def queue_front(self) -> RunQuerySet:
        """Holders, then due waiters in admission order: one read of ``ds_run_queue_idx`` (S5, X5, X8).

        'holder' sorts before 'waiter', so the first ``limit`` rows hold every
        holder when there are fewer than ``limit``, followed by exactly the
        waiters the free slots go to. A waiter whose ``not_before`` has not
        come is skipped on the index entry's ``not_before`` (X5).
        """
        return (
            self.filter(singleton_slot__isnull=False)
            .filter(models.Q(singleton_slot=SlotState.HOLDER) | is_due_q(DbNow()))
            .order_by("singleton_slot", *QUEUE_ORDER)
        )

    @staticmethod
    def queue_front_sql_text(table: str, now: str = PG_NOW_SQL) -> tuple[str, str]:
        """Return :meth:`queue_front` as SQL text for raw statements: (the
        condition, the ORDER BY list) on the run table named (or aliased)
        ``table``, ``now`` the SQL of the database's clock (X5)."""
        due = is_due_sql_text(table, now)
        holder = f"{table}.singleton_slot = '{SlotState.HOLDER.value}'"
        condition = f"{table}.singleton_slot IS NOT NULL AND ({holder} OR {due})"
        return condition, f"{table}.singleton_slot, {queue_order_sql_text(table)}"

    def due(self) -> RunQuerySet:
        """Parked runs whose ``wake_at`` has come by the database's clock (S8, R5)."""
        return self.parked().filter(wake_at__lte=DbNow())

    def leased_by(self, owner: str) -> RunQuerySet:
        """The running runs ``owner`` holds an unexpired lease on, by the database's clock (R5, R5a)."""
        return self.filter(status=RunStatus.RUNNING, lease_owner=owner, lease_expires_at__gt=DbNow())

    def lease_expired(self) -> RunQuerySet:
        """Running runs whose lease expired by the database's clock and whose
        next re-drive is due (D4, R5)."""
        return self.filter(status=RunStatus.RUNNING, lease_expires_at__lte=DbNow()).filter(
            models.Q(wake_at__isnull=True) | models.Q(wake_at__lte=DbNow())
        )

    def overdue(self) -> RunQuerySet:
        """Active runs whose execution deadline passed by the database's clock (D5, R5)."""
        return self.active().filter(deadline_at__lte=DbNow())

    def backlog(self, created_by: datetime) -> RunQuerySet:
        """``pending`` runs never started, created at or before ``created_by``,
        that do not wait for a slot of their key: no worker took their first turn (O3)."""
        return self.filter(status=RunStatus.PENDING, attempts=0, created_at__lte=created_by).exclude(
            singleton_slot=SlotState.WAITER
        )

    def unrenewed(self, *, settings: Settings, now: datetime) -> RunQuerySet:
        """Running runs whose lease was not renewed for longer than the renewal
        interval at ``now``, a time read from the database's clock (K3, R5):
        :func:`~durable_singleton.renewals.unrenewed_q`."""
        return self.filter(unrenewed_q(settings=settings, now=now))

    def inactive_holders(self) -> RunQuerySet:
        """Runs marked as holding a slot that are not active (K4): the check
        constraint ``ds_run_slot_only_active`` refuses them where it stands."""
        return self.filter(singleton_slot=SlotState.HOLDER).exclude(status__in=ACTIVE_STATUSES)

    def overdue_waiters(self, since: datetime) -> RunQuerySet:
        """Waiters a free slot of their key alone admits (X3d), ``pending`` or
        ``suspended``, due by the database's clock (X5, R5), whose ``wake_at``
        is unset or not after ``since`` (K4)."""
        overdue = models.Q(wake_at__isnull=True) | models.Q(wake_at__lte=since)
        return self.admissible().filter(overdue, key_only_waiter_q(), status__in=WAKEABLE_STATUSES)

    def unredriven(self, since: datetime) -> RunQuerySet:
        """Running runs whose lease expired at or before ``since`` and whose
        ``wake_at`` is unset or not after it: no tick re-drove them (K4, D4)."""
        return self.filter(status=RunStatus.RUNNING, lease_expires_at__lte=since).filter(
            models.Q(wake_at__isnull=True) | models.Q(wake_at__lte=since)
        )
