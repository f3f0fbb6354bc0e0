"""The run admin: the run list and a run's read-only page (SPEC section 6).

Runs are written by the engine, so the admin adds nothing and edits nothing:
every field is read-only and the only writes are the actions (see
:mod:`.actions`), which call the engine and need the change permission.
Staff with the view permission see every page. The queue pages come from
:class:`.queues.QueuePagesMixin`.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

from .. import admission, queues
from ..admission import ACTIVE_STATUSES, ADMITTED_TAG, TRACKED_TAG, debounce_open_q, key_tag
from ..explain import lease_words
from ..models import Run, Signal, Step
from ..queues import format_age
from ..statuses import TERMINAL_STATUSES, SlotState
from ..values import is_text
from .actions import EngineActionsMixin, is_action_post
from .bounded import StorableInputMixin
from .display import (
    BACKLOG_NOTE,
    activity,
    breakable,
    clock,
    db_now,
    is_backlog_wake,
    pretty_json,
    recovery_of,
    relative,
    run_id_html,
    state_label,
    time_html,
    unrenewed_lease,
    wake_html,
)
from .filters import SingletonKeyFilter, WorkflowFilter
from .lanes import LanePagesMixin
from .queues import QueuePagesMixin

__all__ = ["RunAdmin"]

_SIGNAL_STEP = "durable:signal"


@admin.register(Run)
class RunAdmin(StorableInputMixin, QueuePagesMixin, LanePagesMixin, EngineActionsMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """Runs: read-only pages, engine actions, the queue pages and the lanes page (SPEC section 6)."""

    # Fits a 1,400 px window beside the navigation and the filters: the slot is part of the
    # status, the namespace is a filter (and on the run's page), tags come last, cut.
    list_display = (
        "run_id_display",
        "workflow_display",
        "state_display",
        "key_link",
        "created_display",
        "wake_display",
        "tags_display",
    )
    list_filter = (
        WorkflowFilter,
        "status",
        ("namespace", admin.AllValuesFieldListFilter),
        SingletonKeyFilter,
        ("singleton_slot", admin.ChoicesFieldListFilter),
    )
    list_display_links = ("run_id_display",)
    search_fields = ("run_id", "singleton_key")
    search_help_text = _("Search by run id or key (substring).")
    show_full_result_count = False
    list_per_page = 100
    actions = ("cancel_runs", "retry_runs", "wake_runs")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "run_id",
                    ("workflow_name", "workflow_version"),
                    "namespace",
                    ("state_display", "activity_display"),
                    "tags_display",
                    "parent_link",
                )
            },
        ),
        (_("Singleton"), {"fields": ("singleton_key", "priority", "limit_display", "place_display")}),
        (_("Data"), {"fields": ("input_display", "output_display", "error_display")}),
        (_("Times"), {"fields": ("times_display",)}),
        (
            _("Lease and attempts"),
            {
                "fields": (
                    "lease_owner",
                    "lease_display",
                    ("attempts", "recoveries"),
                    "park_reason_display",
                    "cancel_requested",
                )
            },
        ),
    )

    # -- permissions: the engine writes runs --------------------------------
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Run | None = None) -> list[str]:
        return [name for _title, options in self.fieldsets for line in options["fields"] for name in _flat(line)]

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """Show a run read-only; a POST is accepted only as an action (no free editing)."""
        if request.method == "POST" and not is_action_post(request):
            raise PermissionDenied
        context = {
            "title": _("Run"),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            **(extra_context or {}),
        }
        if object_id is not None and request.method == "GET" and is_text(unquote(object_id)):
            context.update(self._run_extras(unquote(object_id)))  # else no run has that id (section 7)
        return super().changeform_view(request, object_id, form_url, context)

    def save_model(self, request: HttpRequest, obj: Run, form: Any, change: bool) -> None:
        """Refuse: the engine writes runs (a stale form must never overwrite one)."""
        raise PermissionDenied

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().changelist_view(request, {"title": _("Runs"), **(extra_context or {})})

    @staticmethod
    def _run_extras(run_id: str) -> dict[str, Any]:
        steps = list(Step.objects.filter(run_id=run_id).order_by("position"))
        consumed = {s.result.get("seq") for s in steps if s.name == _SIGNAL_STEP and isinstance(s.result, dict)}
        signals = [
            {"signal": s, "consumed": s.pk in consumed, "payload": pretty_json(s.payload)}
            for s in Signal.objects.filter(run_id=run_id).order_by("pk")
        ]
        return {
            "ds_steps": [
                {"step": s, "seconds": (s.finished_at - s.started_at).total_seconds(), "result": pretty_json(s.result)}
                for s in steps
            ],
            "ds_signals": signals,
            "ds_buffered": sum(1 for s in signals if not s["consumed"]),
        }

    # -- columns and read-only fields ------------------------------------------
    @admin.display(description=_("run id"), ordering="run_id")
    def run_id_display(self, obj: Run) -> str:
        return run_id_html(obj.run_id)

    @admin.display(description=_("workflow"), ordering="workflow_name")
    def workflow_display(self, obj: Run) -> str:
        return breakable(obj.workflow_name)

    @admin.display(description=_("key"), ordering="singleton_key")
    def key_link(self, obj: Run) -> str:
        if obj.singleton_key is None:
            return "—"
        return format_html(
            '<a class="ds-key" href="{}" title="{}">{}</a>',
            self._key_url(obj.workflow_name, obj.singleton_key),
            obj.singleton_key,
            breakable(obj.singleton_key),
        )

    @admin.display(description=_("created at"), ordering="created_at")
    def created_display(self, obj: Run) -> str:
        return time_html(obj.created_at, short=True)

    @admin.display(description=_("wake at"), ordering="wake_at")
    def wake_display(self, obj: Run) -> str:
        return wake_html(obj, timezone.now())

    @admin.display(description=_("status"), ordering="status")
    def state_display(self, obj: Run) -> str:
        return state_label(obj)

    @admin.display(description=_("doing"))
    def activity_display(self, obj: Run) -> str:
        if obj.status not in ACTIVE_STATUSES:
            return "—"
        last = Step.objects.filter(run_id=obj.pk).order_by("-position").values_list("position", "name").first()
        now = db_now()
        recovery = None
        if obj.singleton_slot == SlotState.WAITER and obj.singleton_key and obj.wake_at and obj.wake_at <= now:
            # A past next try: is it waiting on a holder whose lease was not renewed (K3, D4)?
            key = queues.key_queue(obj.workflow_name, obj.singleton_key, limit=0)
            free = admission.free_slots(key.limit, len(key.holders), paused=key.paused)
            recovery = recovery_of([h.run for h in key.holders], now, free)
        return activity(obj, last[0] + 1 if last else 0, last[1] if last else None, now, recovery=recovery)

    @admin.display(description=_("times"))
    def times_display(self, obj: Run) -> str:
        now = timezone.now()
        rows = (
            (_("created at"), obj.created_at),
            (_("updated at"), obj.updated_at),
            (_("started at"), obj.started_at),
            (_("finished at"), obj.finished_at),
            (_("wake at"), obj.wake_at),
            (_("deadline at"), obj.deadline_at),
        )
        return format_html(
            '<table class="ds-times"><tbody>{}</tbody></table>{}',
            format_html_join(
                "",
                '<tr><th scope="row">{}</th><td>{}</td><td class="quiet">{}</td></tr>',
                ((label, time_html(value), relative(value, now)) for label, value in rows),
            ),
            format_html('<p class="help ds-backlog-help">{}</p>', _(BACKLOG_NOTE)) if is_backlog_wake(obj, now) else "",
        )

    @admin.display(description=_("tags"))
    def tags_display(self, obj: Run) -> str:
        tags = [(t, "user") for t in obj.tags or ()]
        if obj.singleton_key is not None:
            tags.append((key_tag(obj.singleton_key), "key"))
            if obj.singleton_tracked:
                tags.append((TRACKED_TAG, "marker"))
            if obj.singleton_slot == SlotState.HOLDER:
                tags.append((ADMITTED_TAG, "marker"))
        if not tags:
            return "—"
        # Whole, each wrapping at its separators (the run list fits 1,280 px, issue #19).
        return format_html(
            '<div class="ds-tags" title="{}">{}</div>',
            ", ".join(t for t, _kind in tags),
            format_html_join(
                " ", '<span class="ds-tag ds-tag-{}">{}</span>', ((kind, breakable(t)) for t, kind in tags)
            ),
        )

    @admin.display(description=_("parent run"))
    def parent_link(self, obj: Run) -> str:
        if not obj.parent_run_id:
            return "—"
        url = reverse(f"{self.admin_site.name}:durable_singleton_run_change", args=[obj.parent_run_id])
        return format_html('<a href="{}">{}</a>', url, obj.parent_run_id)

    @admin.display(description=_("limit"))
    def limit_display(self, obj: Run) -> str:
        if obj.singleton_key is None:
            return "—"
        row = _definition_options(obj.workflow_name)
        limit = row[0] if row else obj.singleton_limit
        depth = row[1] if row else None
        cap = _("unbounded queue") if depth is None else _("max_queue_depth %(depth)s") % {"depth": depth}
        return format_html("{} ({})", limit, cap)

    @staticmethod
    def _debounced_words(obj: Run, key_url: str, expires: str) -> str:
        """An open debounced run's place (X7a): when it starts, since when its burst
        runs, and the latest its start may move to."""
        assert obj.not_before is not None and obj.debounce_until is not None
        return format_html(
            '<a href="{}">{}</a> <time datetime="{}">{}</time> ({} {}, {} {}){}',
            key_url or "#",
            _("debounced: starts at"),
            obj.not_before.isoformat(),
            obj.not_before.strftime("%Y-%m-%d %H:%M:%S %Z"),
            _("burst since"),
            obj.created_at.strftime("%Y-%m-%d %H:%M:%S %Z"),
            _("at most until"),
            obj.debounce_until.strftime("%Y-%m-%d %H:%M:%S %Z"),
            expires,
        )

    @admin.display(description=_("place in the queue"))
    def place_display(self, obj: Run) -> str:
        place = queues.run_place(obj)
        key_url = self._key_url(obj.workflow_name, obj.singleton_key) if obj.singleton_key else ""
        if place.kind == "none":
            if (
                obj.debounce_until is not None
                and Run.objects.filter(pk=obj.pk).filter(debounce_open_q(db_now())).exists()
            ):
                return self._debounced_words(obj, "", "")
            return str(_("not a singleton run"))
        if place.kind == "terminal":
            return str(_("no slot: the run has finished"))
        if place.kind == SlotState.HOLDER:
            since = place.since
            if since is None:
                return format_html(
                    '<a href="{}">{}</a> {}',
                    key_url,
                    _("holder"),
                    _("since: not yet known (admitted on a later attempt; known once its first step has run)"),
                )
            return format_html(
                '<a href="{}">{}</a> {} <time datetime="{}">{}</time> ({} {})',
                key_url,
                _("holder"),
                _("since"),
                since.isoformat(),
                since.strftime("%Y-%m-%d %H:%M:%S.%f %Z"),
                format_age((timezone.now() - since).total_seconds()),
                _("ago"),
            )
        holders = format_html_join(", ", '<a href="{}">{}</a>', ((self._change_url(h), h) for h in place.holders))
        # A waiter's queue TTL, on the database's clock as the tick judges it (X2, R5).
        expiry = queues.queue_ttl_words(queues.queue_ttl_left(obj, db_now()))
        expires = format_html(' <span class="ds-expiry">({})</span>', expiry) if expiry else ""
        if place.kind == "legacy-pending":
            return format_html("{} {}", _("untracked run of an older release, not in the queue; holders:"), holders)
        if place.kind == "not-due" and place.not_before is not None and obj.debounce_until is not None:
            return self._debounced_words(obj, key_url, expires)
        if place.kind == "not-due" and place.not_before is not None:
            return format_html(
                '<a href="{}">{}</a> <time datetime="{}">{}</time> {}{}',
                key_url,
                _("not due until"),
                place.not_before.isoformat(),
                place.not_before.strftime("%Y-%m-%d %H:%M:%S %Z"),
                _("(a delayed start): it keeps its creation place in line and blocks no due waiter"),
                expires,
            )
        if place.holders:
            behind = _("behind holders")
        elif obj.quota_slot == SlotState.WAITER:
            # Its key's slot is free; it waits for a quota (X3d), which explain names.
            behind = _("behind no holder of its key; it waits for its quotas")
        else:
            behind = _("behind no holder (a slot is free)")
        return format_html(
            '<a href="{}">{} {}</a> {} {}{}', key_url, _("position"), place.position, behind, holders, expires
        )

    @admin.display(description=_("input"))
    def input_display(self, obj: Run) -> str:
        return pretty_json(obj.input)

    @admin.display(description=_("output"))
    def output_display(self, obj: Run) -> str:
        return pretty_json(obj.output)

    @admin.display(description=_("error"))
    def error_display(self, obj: Run) -> str:
        return pretty_json(obj.error)

    @admin.display(description=_("park reason"))
    def park_reason_display(self, obj: Run) -> str:
        # A finished run is parked for nothing: the row may keep the last park's reason (S5).
        if obj.status in TERMINAL_STATUSES or not obj.park_reason:
            return "—"
        return str(obj.park_reason)

    @admin.display(description=_("lease expires"))
    def lease_display(self, obj: Run) -> str:
        if obj.lease_expires_at is None:
            return "—"
        now = db_now()  # the lease's clock (R5)
        lease = unrenewed_lease(obj, now)
        if lease is not None:
            # Not renewed for longer than the renewal interval: its worker may be gone (K3).
            return format_html(
                '{} (<span class="ds-warn ds-unrenewed">{}</span>)',
                time_html(obj.lease_expires_at),
                lease_words(lease, at=clock),
            )
        state = _("expired") if obj.lease_expires_at <= now else _("valid")
        return format_html("{} ({}, {})", time_html(obj.lease_expires_at), state, relative(obj.lease_expires_at, now))


def _flat(line: Any) -> tuple[str, ...]:
    return tuple(line) if isinstance(line, list | tuple) else (line,)


def _definition_options(workflow: str) -> tuple[int, int | None] | None:
    return queues.singleton_options().get(workflow)
