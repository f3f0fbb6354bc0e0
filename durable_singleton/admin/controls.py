"""The admin's runtime key controls (K2): the controls form and change history
on a key's queue page, and the list of every recorded change.

Changing a control needs the run change permission (as the queue actions do)
and calls the engine; the change is recorded with the user's name.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.translation import gettext_lazy as _

from ..admission import KEY_MAX_LENGTH, THROTTLE_PREFIX
from ..exceptions import DurableSingletonError
from ..models import KeyControlChange
from ..runtime import get_engine
from ..values import is_text
from .bounded import StorableInputMixin

__all__ = ["KeyControlChangeAdmin"]

CHANGE_PERMISSION = "durable_singleton.change_run"


@admin.register(KeyControlChange)
class KeyControlChangeAdmin(StorableInputMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """Every recorded change of a key's controls: written by the engine, read-only here."""

    list_display = (
        "changed_at",
        "workflow_name",
        "key_display",
        "field",
        "old_value",
        "new_value",
        "changed_by",
        "reason",
    )
    list_filter = ("field", "workflow_name")
    search_fields = ("key", "workflow_name", "changed_by", "reason")
    date_hierarchy = "changed_at"

    @admin.display(description=_("key"), ordering="key")
    def key_display(self, obj: KeyControlChange) -> str:
        return obj.key or str(_("every key (%(n)d)") % {"n": obj.keys})

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: KeyControlChange | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: KeyControlChange | None = None) -> bool:
        return False

    def get_urls(self) -> list[Any]:
        return [
            path("apply/", self.admin_site.admin_view(self.apply_view), name="durable_singleton_keycontrol_apply"),
            *super().get_urls(),
        ]

    def apply_view(self, request: HttpRequest) -> HttpResponse:
        """Apply one control from the key page's form: pause, resume, limit or clear."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not request.user.has_perm(CHANGE_PERMISSION):
            raise PermissionDenied
        workflow = request.POST.get("workflow", "")
        key = request.POST.get("key", "")
        action = request.POST.get("control", "")
        reason = request.POST.get("reason", "")
        by = request.user.get_username()
        engine = get_engine()
        back = reverse("admin:durable_singleton_run_queue_key") + "?" + urlencode({"workflow": workflow, "key": key})
        if workflow.startswith(THROTTLE_PREFIX):
            # A throttle key's controls are on its own page (X6, K2).
            back = (
                reverse("admin:durable_singleton_run_throttle_key")
                + "?"
                + urlencode({"throttle": workflow[len(THROTTLE_PREFIX) :], "key": key})
            )
        if not (is_text(workflow) and is_text(key, KEY_MAX_LENGTH)):
            back = reverse("admin:durable_singleton_run_queues")  # no key page can show that key (section 7)
        try:
            if action == "pause":
                state = engine.pause_key(workflow, key, by=by, reason=reason)
            elif action == "resume":
                state = engine.resume_key(workflow, key, by=by, reason=reason)
            elif action == "limit":
                raw = request.POST.get("limit", "")
                try:
                    limit = int(raw)
                except ValueError:
                    raise DurableSingletonError(f"the limit must be a whole number >= 1, got {raw!r}") from None
                state = engine.override_limit(workflow, key, limit, by=by, reason=reason)
            elif action == "clear":
                state = engine.override_limit(workflow, key, None, by=by, reason=reason)
            else:
                raise DurableSingletonError(f"unknown control {action!r}")
        except DurableSingletonError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return HttpResponseRedirect(back)
        self.message_user(
            request,
            _("Key %(key)s: %(state)s, limit %(limit)d.")
            % {"key": key, "state": _("paused") if state.paused else _("admitting"), "limit": state.limit},
            messages.SUCCESS,
        )
        return HttpResponseRedirect(back)
