"""The run admin's actions: thin shells over the engine (cancel, retry, wake).

Each needs the change permission and reports with ``message_user`` and
``ngettext``. On Django 6.1+ they are offered on a run's page too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.functional import Promise
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

try:  # Django 6.1 runs actions on the change form too
    from django.contrib.admin.options import ActionLocation
except ImportError:  # pragma: no cover - Django 5.2 and 6.0: on the run list and the key pages only
    ActionLocation = None  # type: ignore[assignment,misc]

from ..admission import ACTIVE_STATUSES
from ..engine import Engine
from ..exceptions import DurableSingletonError
from ..models import Run
from ..runtime import get_engine
from ..statuses import PARKED_STATUSES, RunStatus

StrOrPromise = str | Promise

__all__ = ["FORM_PREFIX", "ActionLocation", "EngineActionsMixin", "change_action"]

#: The prefix of the action form on a run's page (Django 6.1+).
FORM_PREFIX = "CHANGE_FORM"
_PARKED = PARKED_STATUSES
_RETRYABLE = (RunStatus.FAILED, RunStatus.DEAD)


def change_action(description: StrOrPromise, description_plural: StrOrPromise) -> Callable[[Any], Any]:
    """``admin.action`` needing the change permission, on the run list and, on Django 6.1+, a run's page."""
    options: dict[str, Any] = {"permissions": ["change"], "description": description}
    if ActionLocation is not None:
        options["description_plural"] = description_plural
        options["location"] = [ActionLocation.CHANGE_LIST, ActionLocation.CHANGE_FORM]
    else:
        options["description"] = description_plural
    decorate: Callable[[Any], Any] = admin.action(**options)
    return decorate


def is_action_post(request: HttpRequest) -> bool:
    """Tell whether a POST to a run's page runs an action (never a save: the engine writes runs)."""
    if ActionLocation is None:  # Django < 6.1 has no actions on the change form
        return False
    return f"{FORM_PREFIX}-action" in request.POST and not {"_save", "_continue", "_addanother"} & set(request.POST)


class EngineActionsMixin:
    """Cancel, retry and wake, for a ``ModelAdmin`` of :class:`~durable_singleton.models.Run`."""

    message_user: Callable[..., None]

    @change_action(_("Cancel this %(verbose_name)s"), _("Cancel selected %(verbose_name_plural)s"))
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        """Cancel active runs through the engine (D6); a holder's slot is released (S7)."""
        self._engine_action(
            request,
            queryset,
            ACTIVE_STATUSES,
            lambda engine, run_id: engine.cancel(run_id),
            done=lambda n: ngettext("Cancelled %(count)d run.", "Cancelled %(count)d runs.", n),
            skipped=lambda n: ngettext(
                "Skipped %(count)d run that has already finished.",
                "Skipped %(count)d runs that have already finished.",
                n,
            ),
        )

    @change_action(
        _("Retry this failed or dead %(verbose_name)s"), _("Retry selected failed or dead %(verbose_name_plural)s")
    )
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        """Send failed or dead runs back through admission with their stored key (D9)."""
        self._engine_action(
            request,
            queryset,
            _RETRYABLE,
            lambda engine, run_id: engine.retry(run_id),
            done=lambda n: ngettext("Retried %(count)d run.", "Retried %(count)d runs.", n),
            skipped=lambda n: ngettext(
                "Skipped %(count)d run that is neither failed nor dead.",
                "Skipped %(count)d runs that are neither failed nor dead.",
                n,
            ),
        )

    @change_action(_("Wake this parked %(verbose_name)s now"), _("Wake selected parked %(verbose_name_plural)s now"))
    def wake_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        """Dispatch parked runs now; a singleton waiter still claims through the store (S5)."""
        self._engine_action(
            request,
            queryset,
            _PARKED,
            lambda engine, run_id: engine.wake(run_id),
            done=lambda n: ngettext("Woke %(count)d run.", "Woke %(count)d runs.", n),
            skipped=lambda n: ngettext(
                "Skipped %(count)d run that is not parked.", "Skipped %(count)d runs that are not parked.", n
            ),
        )

    def _engine_action(
        self,
        request: HttpRequest,
        queryset: QuerySet[Run],
        eligible: tuple[str, ...],
        call: Callable[[Engine, str], Any],
        *,
        done: Callable[[int], str],
        skipped: Callable[[int], str],
    ) -> None:
        engine = get_engine()
        ok, skip, failed = 0, 0, []
        for run_id, status in queryset.order_by("created_at", "run_id").values_list("run_id", "status"):
            if status not in eligible:
                skip += 1
                continue
            try:
                call(engine, run_id)
            except DurableSingletonError as exc:
                failed.append(f"{run_id}: {exc}")
            else:
                ok += 1
        if ok:
            self.message_user(request, done(ok) % {"count": ok}, messages.SUCCESS)
        if skip:
            self.message_user(request, skipped(skip) % {"count": skip}, messages.WARNING)
        if failed:
            message = ngettext("%(count)d run failed: %(errors)s", "%(count)d runs failed: %(errors)s", len(failed))
            self.message_user(request, message % {"count": len(failed), "errors": "; ".join(failed)}, messages.ERROR)
