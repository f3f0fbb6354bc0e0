"""The admin's schedule pages: schedules with their next window, and what
became of each window (S17).

Schedules declared in code are listed read-only (their spec comes from the
code); an operator adds and edits schedules of their own here. An edit is
written by the schedule store under the row's lock, only the fields it
changed (:meth:`~durable_singleton.stores.schedule_state.DjangoScheduleStore.edit`),
so it never undoes a cursor a tick moved; unticking "paused" resumes the
schedule as the resume action does (its catch-up policy picks the windows that
passed while it was paused). Pause and resume are also actions that need the
change permission and call :mod:`durable_singleton.schedules`.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from ..exceptions import DurableSingletonError
from ..models import ScheduleFiring, ScheduleState
from ..queues import format_age
from ..runtime import get_engine
from ..schedules import pause_schedule, resume_schedule, schedule_store_for
from ..stores.schedule_state import EDITABLE_FIELDS, DjangoScheduleStore, spec_of
from .bounded import StorableInputMixin

__all__ = ["ScheduleAdmin", "ScheduleFiringAdmin"]

_SPEC_FIELDS = ("name", *(f for f in EDITABLE_FIELDS if f != "paused"))
_RECENT_WINDOWS = 20


def _run_link(run_id: str | None, outcome: str = "started") -> SafeString | str:
    if not run_id or outcome not in ("started", "existed"):
        return "-"
    return format_html('<a href="{}">{}</a>', reverse("admin:durable_singleton_run_change", args=[run_id]), run_id)


class ScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """Checks an operator's schedule the way a declared one is checked (section 7)."""

    class Meta:
        model = ScheduleState
        fields = [*_SPEC_FIELDS, "paused"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        # The row as it would be saved: the fields the form has (a read-only name
        # is not one of them) over the stored ones.
        probe = ScheduleState(**{k: data[k] if k in data else getattr(self.instance, k) for k in _SPEC_FIELDS})
        probe.cron = probe.cron or ""
        try:
            spec_of(probe)
        except DurableSingletonError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


@admin.register(ScheduleState)
class ScheduleAdmin(StorableInputMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """Schedules with their next window; pause and resume actions (S17)."""

    form = ScheduleForm
    list_display = (
        "name",
        "workflow_name",
        "timing",
        "overlap",
        "catch_up",
        "next_window",
        "last_window_at",
        "last_run",
        "source",
    )
    list_filter = ("paused", "source", "workflow_name")
    search_fields = ("name", "workflow_name")
    ordering = ("name",)
    actions = ("pause_selected", "resume_selected")
    readonly_fields = ("source", "next_window", "last_window_at", "last_run", "recent_windows")

    def get_readonly_fields(self, request: HttpRequest, obj: ScheduleState | None = None) -> Any:
        if obj is not None and obj.source == ScheduleState.Source.CODE:
            return (*_SPEC_FIELDS, "paused", *self.readonly_fields)  # the code owns it; pause with the actions
        if obj is not None:
            return ("name", *self.readonly_fields)  # the name is part of every run id
        return ()

    def get_fields(self, request: HttpRequest, obj: ScheduleState | None = None) -> Any:
        if obj is None:
            return [*_SPEC_FIELDS, "paused"]
        return [*_SPEC_FIELDS, "paused", *self.readonly_fields]

    def has_delete_permission(self, request: HttpRequest, obj: ScheduleState | None = None) -> bool:
        if obj is not None and obj.source == ScheduleState.Source.CODE:
            return False  # the next deploy would declare it again
        return super().has_delete_permission(request, obj)

    @admin.display(description=_("timing"))
    def timing(self, obj: ScheduleState) -> str:
        if obj.every_seconds:
            return f"every {obj.every_seconds} s"
        return f"cron {obj.cron} ({obj.timezone})"

    @admin.display(description=_("next window"), ordering="next_fire_at")
    def next_window(self, obj: ScheduleState) -> str:
        if obj.paused:
            return str(_("paused"))
        if obj.next_fire_at is None:
            return str(_("at the next tick"))
        when = timezone.localtime(obj.next_fire_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        delta = (obj.next_fire_at - timezone.now()).total_seconds()
        if delta >= 0:
            return f"{when} (in {format_age(delta)})"
        return f"{when} (due {format_age(-delta)} ago)"

    @admin.display(description=_("last run"))
    def last_run(self, obj: ScheduleState) -> SafeString | str:
        return _run_link(obj.last_run_id)

    @admin.display(description=_("recent windows"))
    def recent_windows(self, obj: ScheduleState) -> SafeString | str:
        firings = list(obj.firings.order_by("-window_at")[:_RECENT_WINDOWS])
        if not firings:
            return "-"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (f.window_at.strftime("%Y-%m-%d %H:%M:%S"), f.outcome, _run_link(f.run_id, f.outcome), f.detail)
                for f in firings
            ),
        )
        return format_html(
            "<table><thead><tr><th>{}</th><th>{}</th><th>{}</th><th>{}</th></tr></thead><tbody>{}</tbody></table>",
            _("window (UTC)"),
            _("outcome"),
            _("run"),
            _("detail"),
            rows,
        )

    def save_model(self, request: HttpRequest, obj: ScheduleState, form: Any, change: bool) -> None:
        store = get_engine().store
        if not change:
            obj.source = ScheduleState.Source.ADMIN
            # Its first window from now on the store's clock (R8).
            obj.next_fire_at = spec_of(obj).first_window_at_or_after(store.now())
            super().save_model(request, obj, form, change)
            return
        states = schedule_store_for(store)
        assert isinstance(states, DjangoScheduleStore), "the admin's schedules are rows of the Django store"
        changes = {name: form.cleaned_data[name] for name in form.changed_data if name in EDITABLE_FIELDS}
        if changes and not states.edit(obj.name, changes):
            self.message_user(request, _("The schedule was deleted meanwhile."), messages.WARNING)

    def _set_paused(self, request: HttpRequest, queryset: QuerySet[ScheduleState], paused: bool) -> None:
        engine = get_engine()
        action = pause_schedule if paused else resume_schedule
        done = 0
        for name in queryset.values_list("name", flat=True):
            action(engine, name)
            done += 1
        verb = _("paused") if paused else _("resumed")
        self.message_user(
            request,
            ngettext("%(n)d schedule %(verb)s.", "%(n)d schedules %(verb)s.", done) % {"n": done, "verb": verb},
            messages.SUCCESS,
        )

    @admin.action(description=_("Pause the selected schedules"), permissions=["change"])
    def pause_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        self._set_paused(request, queryset, True)

    @admin.action(description=_("Resume the selected schedules"), permissions=["change"])
    def resume_selected(self, request: HttpRequest, queryset: QuerySet[ScheduleState]) -> None:
        self._set_paused(request, queryset, False)


@admin.register(ScheduleFiring)
class ScheduleFiringAdmin(StorableInputMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """What became of each window: written by the tick, read-only here."""

    list_display = ("window_at", "schedule", "outcome", "run", "detail")
    list_filter = ("outcome", "schedule")
    list_select_related = ("schedule",)
    search_fields = ("run_id", "schedule__name")
    date_hierarchy = "window_at"

    @admin.display(description=_("run"))
    def run(self, obj: ScheduleFiring) -> SafeString | str:
        return _run_link(obj.run_id, obj.outcome)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ScheduleFiring | None = None) -> bool:
        return False
