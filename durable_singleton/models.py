"""Django models: runs with their tags, memoized steps, buffered signals,
and one small lock row per singleton key."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.utils.translation import gettext_lazy as _
from model_utils.models import TimeStampedModel

from .admission import KEY_MAX_LENGTH, QUOTA_KEY_MAX_LENGTH, QUOTA_NAME_MAX_LENGTH
from .querysets import RunQuerySet
from .statuses import ACTIVE_STATUSES, PARKED_STATUSES, TERMINAL_STATUSES, RunStatus, SlotState, state_word

__all__ = [
    "ACTIVE_STATUSES",
    "PARKED_STATUSES",
    "TERMINAL_STATUSES",
    "Heartbeat",
    "KeyControlChange",
    "QuotaMembership",
    "Run",
    "RunStatus",
    "ScheduleFiring",
    "ScheduleState",
    "Signal",
    "SingletonKey",
    "SlotState",
    "Step",
    "ThrottleAdmission",
    "ThrottleMembership",
    "TurnNotice",
    "WorkerProcess",
]


class ExactCharField(models.CharField):  # type: ignore[type-arg]
    """A CharField compared exactly on every database.

    MySQL/MariaDB's default utf8mb4 collations ignore case and trailing spaces,
    so "job-ABC" and "job-abc " would be one run (R3) and "Store:A" and
    "store:a" one key (S1); there the column uses a binary NO PAD collation.
    Other databases compare exactly already.
    """

    def db_parameters(self, connection: Any) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql" and not self.db_collation:
            # Binary and NO PAD: trailing spaces count too.
            params["collation"] = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
        return params


ACTIVE_Q = models.Q(status__in=ACTIVE_STATUSES)


class Run(models.Model):
    """One run of a workflow (R1).

    ``tags`` holds the caller's tags and nothing else; the key tag and the
    reserved markers are the columns ``singleton_key``, ``singleton_tracked``
    and ``singleton_slot`` (``holder`` is the admitted marker), which the queue
    indexes serve (S5, S12); the quota keys are ``quota_keys`` (X3b).
    """

    run_id = ExactCharField(_("run id"), max_length=191, primary_key=True)
    workflow_name = ExactCharField(_("workflow"), max_length=191)
    workflow_version = models.CharField(_("version"), max_length=64)
    namespace = ExactCharField(_("namespace"), max_length=191, default="default")
    status = models.CharField(_("status"), max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    input = models.JSONField(_("input"), null=True)
    output = models.JSONField(_("output"), null=True, blank=True)
    error = models.JSONField(_("error"), null=True, blank=True)
    tags = models.JSONField(_("tags"), default=list, blank=True)
    singleton_key = ExactCharField(_("singleton key"), max_length=KEY_MAX_LENGTH, null=True, blank=True)
    singleton_limit = models.PositiveIntegerField(_("singleton limit"), null=True, blank=True)
    singleton_slot = models.CharField(_("slot"), max_length=6, choices=SlotState.choices, null=True, blank=True)
    singleton_tracked = models.BooleanField(_("tracked"), default=False)
    created_at = models.DateTimeField(_("created at"))
    updated_at = models.DateTimeField(_("updated at"))
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    admitted_at = models.DateTimeField(_("admitted at"), null=True, blank=True)
    wake_at = models.DateTimeField(_("wake at"), null=True, blank=True)
    deadline_at = models.DateTimeField(_("deadline at"), null=True, blank=True)
    lease_owner = models.CharField(_("lease owner"), max_length=191, null=True, blank=True)
    lease_expires_at = models.DateTimeField(_("lease expires at"), null=True, blank=True)
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    recoveries = models.PositiveIntegerField(_("recoveries"), default=0)
    parent_run_id = ExactCharField(_("parent run id"), max_length=191, null=True, blank=True)
    park_reason = models.CharField(_("park reason"), max_length=191, blank=True, default="")
    cancel_requested = models.BooleanField(_("cancel requested"), default=False)
    fencing_token = models.BigIntegerField(_("fencing token"), null=True, blank=True)
    step_count = models.PositiveIntegerField(_("stored steps"), default=0)
    #: The W3C traceparent current at the start (O8): each turn's span continues that trace.
    trace_parent = models.CharField(_("trace parent"), max_length=64, null=True, blank=True)
    #: A delayed start (X5): not claimed or admitted before this time, judged on the database's clock (R5).
    not_before = models.DateTimeField(_("not before"), null=True, blank=True)
    #: The quota marker (X3c): ``holder`` once admitted in every limit the run carries, ``waiter``
    #: before, NULL without quotas or once terminal; each membership mirrors it in the same write.
    quota_slot = models.CharField(_("quota slot"), max_length=6, choices=SlotState.choices, null=True, blank=True)
    #: The quota keys the run carries, as ``[[quota name, key], ...]``, written once at its start
    #: beside its memberships (X3b); empty for a run without quotas and for every run an older
    #: release created. Never read from ``tags``: a caller's tag is only ever a tag. NULL (no
    #: quotas) for a row an older release's process inserts during a rolling upgrade.
    quota_keys = models.JSONField(_("quota keys"), default=list, blank=True, null=True)
    #: The debounce key (X7), computed at the run's first start; NULL for a run not debounced.
    debounce_key = ExactCharField(_("debounce key"), max_length=KEY_MAX_LENGTH, null=True, blank=True)
    #: The latest start time a later start of the burst may give the run (its first start plus
    #: ``max_seconds``, on the database's clock, X7); NULL for a run not debounced.
    debounce_until = models.DateTimeField(_("debounce until"), null=True, blank=True)
    #: The throttle keys the run carries, as ``[[throttle name, key, declared limit, period
    #: seconds], ...]``, written once at its start beside its memberships (X6); empty without
    #: throttles. A run that carries one carries the quota marker (``quota_slot``) too.
    throttle_keys = models.JSONField(_("throttle keys"), default=list, blank=True, null=True)
    #: The run's priority inside its key (X8), -100 to 100: among the key's due waiters the higher
    #: is admitted first (``admission.QUEUE_ORDER``). The database's default 0 is what a row an
    #: older release's process inserts during a rolling upgrade gets.
    priority = models.SmallIntegerField(_("priority"), default=0, db_default=0)

    objects = RunQuerySet.as_manager()

    class Meta:
        verbose_name = _("run")
        verbose_name_plural = _("runs")
        ordering = ["-created_at", "-run_id"]
        indexes = [
            # The queue: holders and waiters of one key in admission order (S5, X8:
            # admission.QUEUE_ORDER); its front skips the waiters not due yet (X5) on the
            # index entries' not_before.
            models.Index(
                fields=[
                    "workflow_name",
                    "singleton_key",
                    "singleton_slot",
                    "-priority",
                    "created_at",
                    "run_id",
                    "not_before",
                ],
                name="ds_run_queue_idx",
            ),
            # Untracked active runs of an older release count as holders (S12): PostgreSQL reads
            # them through ds_run_untracked_idx, a partial index of the untracked runs that count
            # as holders alone (migrations 0009, 0026; the SQLite room's statements read it too,
            # of the untracked runs); the ORM on SQLite, MariaDB and MySQL through ds_run_legacy_idx
            # (workflow_name, singleton_key, singleton_tracked, status). Both by migration only
            # (0009, 0014): a Meta index with a condition would warn on MariaDB (models.W037),
            # and ds_run_legacy_idx on PostgreSQL led a worker's generic plan of the queue read
            # to read and sort every run of the key (S5).
            # The tick: due runs and expired leases (S8, D4). On PostgreSQL and SQLite the
            # due, lease, deadline and debounce indexes are partial (migration 0026: the parked
            # runs, or the rows with the column set), so a settled run leaves them; declared
            # whole here, as MariaDB and MySQL keep them (a condition warns there, models.W037).
            models.Index(fields=["status", "wake_at"], name="ds_run_due_idx"),
            models.Index(fields=["status", "lease_expires_at"], name="ds_run_lease_idx"),
            models.Index(fields=["status", "deadline_at"], name="ds_run_deadline_idx"),
            models.Index(fields=["namespace", "workflow_name", "status"], name="ds_run_ns_idx"),
            # The admin's run list: newest first, and its key filter. The key index also
            # carries the queue's order after the key (as ds_run_queue_idx does after the
            # workflow and key): a generic plan that reads a queue through it, not knowing
            # the key's value, reads the front in order, never every run of the key (S5).
            models.Index(fields=["created_at", "run_id"], name="ds_run_created_idx"),
            # A debounced start finds its key's open run (X7a).
            models.Index(fields=["debounce_key", "workflow_name", "status"], name="ds_run_debounce_idx"),
            models.Index(
                fields=[
                    "singleton_key",
                    "workflow_name",
                    "singleton_slot",
                    "-priority",
                    "created_at",
                    "run_id",
                    "not_before",
                ],
                name="ds_run_key_idx",
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(singleton_slot__isnull=True) | (ACTIVE_Q & models.Q(singleton_key__isnull=False)),
                name="ds_run_slot_only_active",
            ),
            models.CheckConstraint(condition=~models.Q(run_id=""), name="ds_run_id_not_empty"),
        ]

    def __str__(self) -> str:
        return f"{self.workflow_name} {self.run_id} ({state_word(self.status, self.singleton_slot)})"


class DebouncedStart(models.Model):
    """A start with an explicit run id that a debounce folded into another run (X7c):
    a retry of that start returns the run it was folded into and changes nothing (R3).
    Deleted with that run (O2)."""

    start_id = ExactCharField(_("start id"), max_length=191, primary_key=True)
    run_id = ExactCharField(_("run id"), max_length=191, db_index=True)
    created_at = models.DateTimeField(_("created at"))

    class Meta:
        verbose_name = _("debounced start")
        verbose_name_plural = _("debounced starts")

    def __str__(self) -> str:
        return f"{self.start_id} -> {self.run_id}"


class Step(models.Model):
    """A memoized step result, one per run and position (R4)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
    position = models.PositiveIntegerField(_("position"))
    name = models.CharField(_("name"), max_length=191)
    result = models.JSONField(_("result"), null=True)
    started_at = models.DateTimeField(_("started at"))
    finished_at = models.DateTimeField(_("finished at"))

    class Meta:
        verbose_name = _("step")
        verbose_name_plural = _("steps")
        ordering = ["run", "position"]
        constraints = [models.UniqueConstraint(fields=["run", "position"], name="ds_step_run_position_uniq")]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.position} {self.name}"


class Signal(models.Model):
    """A signal sent to a run, buffered in order until the body consumes it (D2)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(_("name"), max_length=191)
    payload = models.JSONField(_("payload"), null=True)
    created_at = models.DateTimeField(_("created at"))
    #: The caller's id of the signal (``engine.signal(..., signal_id=...)``): a
    #: retry with the same id stores nothing (D2). NULLs are distinct: signals
    #: sent without an id are never deduplicated.
    signal_id = ExactCharField(_("signal id"), max_length=191, null=True, blank=True)

    class Meta:
        verbose_name = _("signal")
        verbose_name_plural = _("signals")
        ordering = ["run", "id"]
        constraints = [models.UniqueConstraint(fields=["run", "signal_id"], name="ds_signal_once")]

    def __str__(self) -> str:
        return f"{self.run_id} {self.name}"


class SingletonKey(TimeStampedModel):
    """One row per (workflow, key): the lock that serializes admissions of the key.

    Claims and handoffs lock this row, never the runs of the key, so a claim
    costs the same with 10 or 10,000 waiters (S5, S13). ``last_token`` is the
    key's fencing counter, bumped by every admission (K1). ``paused`` and
    ``limit_override`` are the runtime controls (K2): the limit is the
    workflow's declared one unless overridden here.
    """

    workflow_name = ExactCharField(_("workflow"), max_length=191)
    key = ExactCharField(_("key"), max_length=KEY_MAX_LENGTH)
    last_token = models.BigIntegerField(_("last fencing token"), default=0)
    paused = models.BooleanField(_("paused"), default=False)
    limit_override = models.PositiveIntegerField(_("limit override"), null=True, blank=True)

    class Meta:
        verbose_name = _("singleton key")
        verbose_name_plural = _("singleton keys")
        constraints = [models.UniqueConstraint(fields=["workflow_name", "key"], name="ds_key_uniq")]

    def __str__(self) -> str:
        return f"{self.workflow_name} {self.key}"


class QuotaMembership(models.Model):
    """One quota key a run carries (X3b): its place in the quota key's queue and its fencing token.

    ``slot`` mirrors the run's ``quota_slot`` (written in the same transaction),
    so a quota key's holders and its oldest waiters are one read of
    ``ds_quota_order_idx``, whatever the queue's length (S13). ``created_at`` is
    the run's, the admission order (X3d). A process that does not declare the
    quota claims under the limit 1 unless the key's runtime override says
    otherwise (K2): it never over-admits. The key's lock row is
    ``SingletonKey(workflow_name="quota:<quota>", key=key)``.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="quota_memberships")
    quota = ExactCharField(_("quota"), max_length=QUOTA_NAME_MAX_LENGTH)
    key = ExactCharField(_("key"), max_length=QUOTA_KEY_MAX_LENGTH)
    slot = models.CharField(_("slot"), max_length=6, choices=SlotState.choices, null=True, blank=True)
    fencing_token = models.BigIntegerField(_("fencing token"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"))
    #: The run's sub-key (tenant) in a fair quota, "" in one without ``fair_key`` (X4).
    sub_key = ExactCharField(_("sub-key"), max_length=QUOTA_KEY_MAX_LENGTH, default="", blank=True)
    #: The sub-key's slots per round (X4).
    weight = models.PositiveIntegerField(_("weight"), default=1)
    #: The admission order's first term (``admission.fair_tag``, X4): 0 in a quota without ``fair_key``.
    tag = models.BigIntegerField(_("fair tag"), default=0)
    #: The run's priority (X8), the admission order's second term (``admission.QUOTA_ORDER``).
    priority = models.SmallIntegerField(_("priority"), default=0, db_default=0)

    class Meta:
        verbose_name = _("quota membership")
        verbose_name_plural = _("quota memberships")
        ordering = ["quota", "key", "created_at", "run"]
        indexes = [
            models.Index(
                fields=["quota", "key", "slot", "tag", "-priority", "created_at", "run"], name="ds_quota_order_idx"
            ),
            # A sub-key's last tag: one probe (X4).
            models.Index(fields=["quota", "key", "sub_key", "tag"], name="ds_quota_fair_idx"),
        ]
        constraints = [models.UniqueConstraint(fields=["run", "quota"], name="ds_quota_run_uniq")]

    def __str__(self) -> str:
        return f"{self.quota} {self.key} {self.run_id}"


class ThrottleMembership(models.Model):
    """One throttle key a run carries (X6): its place in the throttle key's queue.

    A throttle key's waiters are its memberships whose run is an active waiter
    (``quota_slot`` = ``waiter``), in the one queue order (``admission.QUEUE_ORDER``:
    higher ``priority`` first, then ``created_at``, ``run_id``): one read of
    ``ds_throttle_order_idx`` (X3d, X6c, X8a). The key's lock row is
    ``SingletonKey(workflow_name="throttle:<name>", key=key)``; its admissions are
    :class:`ThrottleAdmission` rows.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="throttle_memberships")
    throttle = ExactCharField(_("throttle"), max_length=QUOTA_NAME_MAX_LENGTH)
    key = ExactCharField(_("key"), max_length=QUOTA_KEY_MAX_LENGTH)
    created_at = models.DateTimeField(_("created at"))
    #: The run's priority (X8), the admission order's first term (``admission.QUEUE_ORDER``).
    priority = models.SmallIntegerField(_("priority"), default=0, db_default=0)

    class Meta:
        verbose_name = _("throttle membership")
        verbose_name_plural = _("throttle memberships")
        ordering = ["throttle", "key", "created_at", "run"]
        indexes = [
            models.Index(fields=["throttle", "key", "-priority", "created_at", "run"], name="ds_throttle_order_idx")
        ]
        constraints = [models.UniqueConstraint(fields=["run", "throttle"], name="ds_throttle_run_uniq")]

    def __str__(self) -> str:
        return f"{self.throttle} {self.key} {self.run_id}"


class ThrottleAdmission(models.Model):
    """One admission of a run under a throttle key, at ``admitted_at`` on the database's
    clock (X6): a window counts these, never starts. A row outlives its run (an admission
    that later failed, or whose run was deleted, still counts); the tick's retention
    deletes the rows older than their throttle's ``period``."""

    throttle = ExactCharField(_("throttle"), max_length=QUOTA_NAME_MAX_LENGTH)
    key = ExactCharField(_("key"), max_length=QUOTA_KEY_MAX_LENGTH)
    run_id = ExactCharField(_("run id"), max_length=191)
    admitted_at = models.DateTimeField(_("admitted at"))

    class Meta:
        verbose_name = _("throttle admission")
        verbose_name_plural = _("throttle admissions")
        ordering = ["throttle", "key", "admitted_at"]
        indexes = [models.Index(fields=["throttle", "key", "admitted_at"], name="ds_throttle_window_idx")]

    def __str__(self) -> str:
        return f"{self.throttle} {self.key} {self.run_id} at {self.admitted_at:%Y-%m-%d %H:%M:%S}"


class ScheduleState(models.Model):
    """A schedule (S17): its spec and its cursor, the next window not yet fired.

    Rows with ``source="code"`` mirror a ``Schedule`` declared on a workflow
    (their spec is rewritten from the code); rows with ``source="admin"`` are
    managed by an operator. The tick fires a due row under its row lock and
    moves ``next_fire_at`` in the same transaction, so a window fires once.
    """

    class Source(models.TextChoices):
        CODE = "code", _("code")
        ADMIN = "admin", _("admin")

    class Overlap(models.TextChoices):
        ALLOW = "allow", _("allow")
        SKIP = "skip", _("skip")

    class CatchUp(models.TextChoices):
        NONE = "none", _("none")
        LATEST = "latest", _("latest")
        ALL = "all", _("all, up to the limit")

    name = ExactCharField(_("name"), max_length=100, unique=True)
    workflow_name = ExactCharField(_("workflow"), max_length=191)
    every_seconds = models.PositiveIntegerField(_("every (seconds)"), null=True, blank=True)
    cron = models.CharField(_("cron"), max_length=120, blank=True, default="")
    timezone = models.CharField(_("time zone"), max_length=64, default="UTC")
    input = models.JSONField(_("input"), null=True, blank=True)
    overlap = models.CharField(_("overlap"), max_length=8, choices=Overlap.choices, default=Overlap.ALLOW)
    catch_up = models.CharField(_("catch-up"), max_length=8, choices=CatchUp.choices, default=CatchUp.LATEST)
    catch_up_limit = models.PositiveIntegerField(_("catch-up limit"), default=10)
    grace_seconds = models.FloatField(_("grace (seconds)"), default=60.0)
    source = models.CharField(_("source"), max_length=8, choices=Source.choices, default=Source.ADMIN)
    paused = models.BooleanField(_("paused"), default=False)
    next_fire_at = models.DateTimeField(_("next window"), null=True, blank=True)
    last_window_at = models.DateTimeField(_("last window fired"), null=True, blank=True)
    last_run_id = ExactCharField(_("last run id"), max_length=191, null=True, blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ["name"]
        indexes = [models.Index(fields=["paused", "next_fire_at"], name="ds_schedule_due_idx")]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(every_seconds__isnull=False) & models.Q(cron=""))
                | (models.Q(every_seconds__isnull=True) & ~models.Q(cron="")),
                name="ds_schedule_one_timing",
            ),
        ]

    def __str__(self) -> str:
        return str(self.name)


class ScheduleFiring(models.Model):
    """What became of one window of a schedule: started, existed, skipped,
    rejected by the queue cap, missed by the catch-up policy, or failed (S17, S16)."""

    schedule = models.ForeignKey(ScheduleState, on_delete=models.CASCADE, related_name="firings")
    window_at = models.DateTimeField(_("window"))
    run_id = ExactCharField(_("run id"), max_length=191, blank=True, default="")
    outcome = models.CharField(_("outcome"), max_length=8)
    detail = models.TextField(_("detail"), blank=True, default="")
    created_at = models.DateTimeField(_("recorded at"), auto_now_add=True)

    class Meta:
        verbose_name = _("schedule window")
        verbose_name_plural = _("schedule windows")
        ordering = ["-window_at"]
        constraints = [models.UniqueConstraint(fields=["schedule", "window_at"], name="ds_firing_window_uniq")]

    def __str__(self) -> str:
        return f"{self.schedule_id} {self.window_at:%Y-%m-%d %H:%M:%S} {self.outcome}"


class Heartbeat(models.Model):
    """When a periodic job of the app last completed (``name`` ``"tick"``: the
    tick, written by :mod:`durable_singleton.heartbeat`, read by ``durable_health``, O3)."""

    name = models.CharField(_("name"), max_length=64, primary_key=True)
    at = models.DateTimeField(_("at"))
    owner = models.CharField(_("owner"), max_length=191, blank=True, default="")

    class Meta:
        verbose_name = _("heartbeat")
        verbose_name_plural = _("heartbeats")

    def __str__(self) -> str:
        return f"{self.name} at {self.at:%Y-%m-%d %H:%M:%S}"


class KeyControlChange(models.Model):
    """One change of a key's runtime controls (K2): who, when, old and new value, why.

    ``key`` is empty for a change of every key of the workflow (``keys`` counts them).
    """

    workflow_name = ExactCharField(_("workflow"), max_length=191)
    key = ExactCharField(_("key"), max_length=KEY_MAX_LENGTH, blank=True, default="")
    field = models.CharField(_("control"), max_length=16)
    old_value = models.JSONField(_("old value"), null=True, blank=True)
    new_value = models.JSONField(_("new value"), null=True, blank=True)
    keys = models.PositiveIntegerField(_("keys changed"), default=1)
    changed_by = models.CharField(_("changed by"), max_length=150, blank=True, default="")
    reason = models.TextField(_("reason"), blank=True, default="")
    changed_at = models.DateTimeField(_("changed at"))

    class Meta:
        verbose_name = _("key control change")
        verbose_name_plural = _("key control changes")
        ordering = ["-changed_at", "-id"]
        indexes = [models.Index(fields=["workflow_name", "key", "changed_at"], name="ds_control_key_idx")]

    def __str__(self) -> str:
        return f"{self.workflow_name} {self.key or '*'} {self.field}: {self.old_value} -> {self.new_value}"


class TurnNotice(models.Model):
    """A turn waiting for a ``durable_worker`` to take it (``DISPATCH = "worker"``, O1, O7).

    Written in the transaction of the start (or grant, wake, tick) that
    dispatches the turn, so a rolled-back start leaves none; on PostgreSQL
    a trigger (migration 0012) NOTIFYs the channel ``durable_singleton_turn``
    as that transaction commits. A worker deletes the notices it takes with
    ``SELECT ... FOR UPDATE SKIP LOCKED``; the claim of the turn still decides
    admission (S5, R6). A notice lost with a dead worker leaves the run its
    ``wake_at``, and the tick dispatches it again (S8).
    """

    id = models.BigAutoField(primary_key=True)
    run_id = models.CharField(_("run"), max_length=191)
    queue = models.CharField(_("queue"), max_length=191, default="default")

    class Meta:
        verbose_name = _("turn notice")
        verbose_name_plural = _("turn notices")
        indexes = [
            models.Index(fields=["queue", "id"], name="ds_turn_queue_idx"),
            models.Index(fields=["run_id"], name="ds_turn_run_idx"),
        ]

    def __str__(self) -> str:
        return f"turn of {self.run_id} ({self.queue})"


class WorkerProcess(models.Model):
    """One live ``durable_worker`` process (O6): where it runs, how, and when
    it was last seen, on the database's clock.

    ``name`` is the prefix of its lease owners (``host:pid:token``,
    :func:`~durable_singleton.identity.process_name`). The row is
    refreshed every ``WORKER_HEARTBEAT_SECONDS`` and deleted on a clean stop;
    a row older than ``WORKER_DEAD_SECONDS`` belongs to a dead process, whose
    runs the tick takes back
    (:func:`~durable_singleton.stores.turns.release_dead_workers`).
    """

    name = models.CharField(_("name"), max_length=191, primary_key=True)
    host = models.CharField(_("host"), max_length=191)
    pid = models.PositiveIntegerField(_("pid"))
    mode = models.CharField(_("mode"), max_length=16)
    threads = models.PositiveIntegerField(_("threads"))
    queues = models.CharField(_("queues"), max_length=191, blank=True, default="")
    started_at = models.DateTimeField(_("started at"))
    last_seen_at = models.DateTimeField(_("last seen at"))

    class Meta:
        verbose_name = _("worker process")
        verbose_name_plural = _("worker processes")
        ordering = ["host", "pid"]

    def __str__(self) -> str:
        return self.name
