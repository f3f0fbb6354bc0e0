"""The Django admin: runs, and the per-key queues ("why is my run waiting, and behind whom?").

Runs are written by the engine, so the admin adds nothing and edits nothing:
every field is read-only and the only writes are the actions, which call the
engine (cancel, retry, wake) and need the change permission. Staff with the
view permission see every page. The queue pages hang off the run admin
(``get_urls`` + ``admin_site.admin_view`` + ``each_context``) and read through
:mod:`durable_singleton.queues`, a bounded number of queries per page.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages

try:  # Django 6.1 runs actions on the change form too
    from django.contrib.admin.options import ActionLocation
except ImportError:  # pragma: no cover - Django 5.2: on the run list and the key pages only
    ActionLocation = None  # type: ignore[assignment,misc]
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from . import queues
from .admission import ACTIVE_STATUSES, ADMITTED_TAG, TRACKED_TAG, key_tag
from .definitions import registry
from .engine import Engine, get_engine
from .exceptions import DurableSingletonError
from .models import Run, Signal, Step
from .queues import format_age

__all__ = ["RunAdmin", "SingletonKeyFilter", "WorkflowFilter"]

_SIGNAL_STEP = "durable:signal"
_FORM_PREFIX = "CHANGE_FORM"


def _change_action(description: str, description_plural: str) -> Callable[[Any], Any]:
    """``admin.action`` needing the change permission, on the run list and, on Django 6.1+, a run's page."""
    options: dict[str, Any] = {"permissions": ["change"], "description": description}
    if ActionLocation is not None:
        options["description_plural"] = description_plural
        options["location"] = [ActionLocation.CHANGE_LIST, ActionLocation.CHANGE_FORM]
    else:
        options["description"] = description_plural
    return admin.action(**options)


_PARKED = ("pending", "suspended", "blocked")
_RETRYABLE = ("failed", "dead")


def _pretty_json(value: Any) -> SafeString:
    if value is None:
        return format_html('<span class="quiet">{}</span>', "null")
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)
    return format_html('<pre class="ds-json">{}</pre>', text)


class SingletonKeyFilter(admin.ListFilter):
    """Filter runs by exact key, typed into a box (a list of 10,000 keys is no filter)."""

    title = _("key")
    parameter_name = "singleton_key"
    template = "admin/durable_singleton/input_filter.html"

    def __init__(self, request: HttpRequest, params: dict[str, Any], model: Any, model_admin: Any) -> None:
        super().__init__(request, params, model, model_admin)
        if self.parameter_name in params:
            self.used_parameters[self.parameter_name] = params.pop(self.parameter_name)[-1]

    def value(self) -> str | None:
        """Return the key typed in, or None."""
        return self.used_parameters.get(self.parameter_name) or None

    def has_output(self) -> bool:
        return True

    def expected_parameters(self) -> list[str]:
        return [self.parameter_name]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        value = self.value()
        return queryset.filter(singleton_key=value) if value else queryset

    def choices(self, changelist: Any) -> Iterator[dict[str, Any]]:
        keep = [
            (name, value)
            for name, values in changelist.filter_params.items()
            if name != self.parameter_name
            for value in values
        ]
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": _("All"),
            "hidden": keep,
            "value": self.value() or "",
        }


class WorkflowFilter(admin.SimpleListFilter):
    """Filter runs by workflow, offering the registered workflows (no scan of the run table)."""

    title = _("workflow")
    parameter_name = "workflow_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = set(registry.latest)
        if self.value():
            names.add(self.value())  # a workflow no longer registered, reached by a link
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        return queryset.filter(workflow_name=self.value()) if self.value() else queryset


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    """Runs: read-only pages, engine actions, and the queue pages (SPEC section 6)."""

    list_display = (
        "run_id",
        "workflow_name",
        "status",
        "namespace",
        "key_link",
        "slot_display",
        "tags_display",
        "created_display",
        "wake_display",
    )
    list_filter = (
        WorkflowFilter,
        "status",
        ("namespace", admin.AllValuesFieldListFilter),
        SingletonKeyFilter,
        ("singleton_slot", admin.ChoicesFieldListFilter),
    )
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
                    "status",
                    "tags_display",
                    "parent_link",
                )
            },
        ),
        (_("Singleton"), {"fields": ("singleton_key", "limit_display", "place_display")}),
        (_("Data"), {"fields": ("input_display", "output_display", "error_display")}),
        (_("Times"), {"fields": ("times_display",)}),
        (
            _("Lease and attempts"),
            {
                "fields": (
                    "lease_owner",
                    "lease_display",
                    ("attempts", "recoveries"),
                    "park_reason",
                    "cancel_requested",
                )
            },
        ),
    )
    #: Template of the queue table; None: ``admin/durable_singleton/queues.html``.
    queues_template: str | None = None
    #: Template of one key's queue; None: ``admin/durable_singleton/queue_key.html``.
    queue_key_template: str | None = None
    #: Seconds between refreshes of the open queue pages (0: never); ``?refresh=N`` overrides.
    queue_refresh_seconds = 2
    #: Rows per page of the queue table, and waiters per page of a key's queue.
    queue_per_page = 100

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
        if request.method == "POST" and not self._is_action_post(request):
            raise PermissionDenied
        context = {
            "title": _("Run"),
            "show_save": False,
            "show_save_and_continue": False,
            "show_save_and_add_another": False,
            **(extra_context or {}),
        }
        if object_id is not None and request.method == "GET":
            context.update(self._run_extras(admin.utils.unquote(object_id)))
        return super().changeform_view(request, object_id, form_url, context)

    def save_model(self, request: HttpRequest, obj: Run, form: Any, change: bool) -> None:
        """Refuse: the engine writes runs (a stale form must never overwrite one)."""
        raise PermissionDenied

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        return super().changelist_view(request, {"title": _("Runs"), **(extra_context or {})})

    @staticmethod
    def _is_action_post(request: HttpRequest) -> bool:
        if ActionLocation is None:  # Django < 6.1 has no actions on the change form
            return False
        return f"{_FORM_PREFIX}-action" in request.POST and not {"_save", "_continue", "_addanother"} & set(
            request.POST
        )

    @staticmethod
    def _run_extras(run_id: str) -> dict[str, Any]:
        steps = list(Step.objects.filter(run_id=run_id).order_by("position"))
        consumed = {s.result.get("seq") for s in steps if s.name == _SIGNAL_STEP and isinstance(s.result, dict)}
        signals = [
            {"signal": s, "consumed": s.pk in consumed, "payload": _pretty_json(s.payload)}
            for s in Signal.objects.filter(run_id=run_id).order_by("pk")
        ]
        return {
            "ds_steps": [
                {"step": s, "seconds": (s.finished_at - s.started_at).total_seconds(), "result": _pretty_json(s.result)}
                for s in steps
            ],
            "ds_signals": signals,
            "ds_buffered": sum(1 for s in signals if not s["consumed"]),
        }

    # -- columns -------------------------------------------------------------
    @admin.display(description=_("key"), ordering="singleton_key")
    def key_link(self, obj: Run) -> str:
        if obj.singleton_key is None:
            return "—"
        return format_html(
            '<a href="{}">{}</a>', self._key_url(obj.workflow_name, obj.singleton_key), obj.singleton_key
        )

    @admin.display(description=_("created at"), ordering="created_at")
    def created_display(self, obj: Run) -> str:
        return _time(obj.created_at, short=True)

    @admin.display(description=_("wake at"), ordering="wake_at")
    def wake_display(self, obj: Run) -> str:
        return _time(obj.wake_at, short=True)

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
            '<table class="ds-times"><tbody>{}</tbody></table>',
            format_html_join(
                "",
                '<tr><th scope="row">{}</th><td>{}</td><td class="quiet">{}</td></tr>',
                ((label, _time(value), _relative(value, now)) for label, value in rows),
            ),
        )

    @admin.display(description=_("slot"), ordering="singleton_slot")
    def slot_display(self, obj: Run) -> str:
        if obj.singleton_slot:
            return format_html('<span class="ds-slot ds-slot-{}">{}</span>', obj.singleton_slot, obj.singleton_slot)
        if obj.singleton_key and not obj.singleton_tracked and obj.status in ("running", "suspended", "blocked"):
            return format_html('<span class="ds-slot ds-slot-holder">{}</span>', _("holder (legacy)"))
        return "—"

    @admin.display(description=_("tags"))
    def tags_display(self, obj: Run) -> str:
        tags = [(t, "user") for t in obj.tags or ()]
        if obj.singleton_key is not None:
            tags.append((key_tag(obj.singleton_key), "key"))
            if obj.singleton_tracked:
                tags.append((TRACKED_TAG, "marker"))
            if obj.singleton_slot == "holder":
                tags.append((ADMITTED_TAG, "marker"))
        if not tags:
            return "—"
        return format_html_join(" ", '<span class="ds-tag ds-tag-{}">{}</span>', ((kind, t) for t, kind in tags))

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

    @admin.display(description=_("place in the queue"))
    def place_display(self, obj: Run) -> str:
        place = queues.run_place(obj)
        key_url = self._key_url(obj.workflow_name, obj.singleton_key) if obj.singleton_key else ""
        if place.kind == "none":
            return _("not a singleton run")
        if place.kind == "terminal":
            return _("no slot: the run has finished")
        if place.kind == "holder":
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
        if place.kind == "legacy-pending":
            return format_html("{} {}", _("untracked run of an older release, not in the queue; holders:"), holders)
        return format_html(
            '<a href="{}">{} {}</a> {} {}',
            key_url,
            _("position"),
            place.position,
            _("behind holders") if place.holders else _("behind no holder (a slot is free)"),
            holders,
        )

    @admin.display(description=_("input"))
    def input_display(self, obj: Run) -> str:
        return _pretty_json(obj.input)

    @admin.display(description=_("output"))
    def output_display(self, obj: Run) -> str:
        return _pretty_json(obj.output)

    @admin.display(description=_("error"))
    def error_display(self, obj: Run) -> str:
        return _pretty_json(obj.error)

    @admin.display(description=_("lease expires"))
    def lease_display(self, obj: Run) -> str:
        if obj.lease_expires_at is None:
            return "—"
        now = timezone.now()
        state = _("expired") if obj.lease_expires_at <= now else _("valid")
        return format_html("{} ({}, {})", _time(obj.lease_expires_at), state, _relative(obj.lease_expires_at, now))

    # -- actions: thin shells over the engine ---------------------------------
    @_change_action(_("Cancel this %(verbose_name)s"), _("Cancel selected %(verbose_name_plural)s"))
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

    @_change_action(
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

    @_change_action(_("Wake this parked %(verbose_name)s now"), _("Wake selected parked %(verbose_name_plural)s now"))
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

    # -- the queue pages -------------------------------------------------------
    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path("queues/", self.admin_site.admin_view(self.queues_view), name="{}_{}_queues".format(*info)),
            path("queues/key/", self.admin_site.admin_view(self.queue_key_view), name="{}_{}_queue_key".format(*info)),
            *super().get_urls(),
        ]

    def _url(self, name: str) -> str:
        return reverse(f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{name}")

    def _key_url(self, workflow: str, key: str) -> str:
        return f"{self._url('queue_key')}?{urlencode({'workflow': workflow, 'key': key})}"

    def _change_url(self, run_id: str) -> str:
        return reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_change",
            args=[admin.utils.quote(run_id)],
        )

    def _refresh(self, request: HttpRequest) -> float:
        try:
            return max(float(request.GET.get("refresh", self.queue_refresh_seconds)), 0.0)
        except ValueError:
            return float(self.queue_refresh_seconds)

    def _page_number(self, request: HttpRequest) -> int:
        try:
            return max(int(request.GET.get("p", "1")), 1)
        except ValueError:
            return 1

    def queues_view(self, request: HttpRequest) -> HttpResponse:
        """List every workflow and key with active runs: limit, holders, waiting, oldest wait, cap, fullness."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        params = request.GET
        sort = params.get("o", "-waiting")
        if sort.lstrip("-") not in queues.SORTS:
            sort = "-waiting"
        only = params.get("only", "")
        if only not in queues.FILTERS:
            only = ""
        workflow = params.get("workflow", "")
        search = params.get("q", "").strip()
        number = self._page_number(request)
        per_page = self.queue_per_page

        def fetch(n: int) -> queues.QueuePage:
            return queues.queue_table(
                workflow=workflow or None,
                key_contains=search or None,
                only=only,
                sort=sort,
                offset=(n - 1) * per_page,
                limit=per_page,
            )

        page = fetch(number)
        pages = max((page.keys + per_page - 1) // per_page, 1)
        if number > pages:  # past the end (keys drained): show the last page
            number = pages
            page = fetch(number)
        now = timezone.now()

        def link(**changes: str) -> str:
            """Return this page's query with ``changes`` (an empty value removes the parameter)."""
            query = {k: v for k, v in params.items() if k != "p"}
            for k, v in changes.items():
                if v:
                    query[k] = v
                else:
                    query.pop(k, None)
            return "?" + urlencode(query)

        headers = []
        for name, label, numeric in (
            ("workflow", _("workflow"), False),
            ("key", _("key"), False),
            ("limit", _("limit"), True),
            ("holders", _("holders"), True),
            ("waiting", _("waiting"), True),
            ("oldest", _("oldest waiter"), True),
            ("fullness", _("cap and fullness"), True),
        ):
            current = sort.lstrip("-") == name
            descending = sort.startswith("-")
            # Numbers sort largest first on the first click; "oldest" means earliest creation.
            first = name if name in ("workflow", "key", "oldest") else f"-{name}"
            target = (name if descending else f"-{name}") if current else first
            headers.append(
                {
                    "name": name,
                    "label": label,
                    "numeric": numeric,
                    "url": link(o=target),
                    "sorted": current,
                    "ascending": current and not descending,
                }
            )
        rows = [
            {
                "row": row,
                "url": self._key_url(row.workflow, row.key),
                "age": format_age(row.oldest_wait_seconds(now)),
                "fullness_pct": None if row.fullness is None else round(row.fullness * 100),
                # The meter turns red at the cap, where starts are refused (S15).
                "meter_low": None if row.capacity is None else row.capacity / 2,
                "meter_high": None if row.capacity is None else row.capacity - 0.5,
                "over": row.holders > row.limit,
                "stalled": row.waiting > 0 and row.holders < row.limit,
                # A free slot with waiters is normal for the moment a claim takes; for long, not (S8a).
                "stuck": row.waiting > 0 and row.holders < row.limit and (row.oldest_wait_seconds(now) or 0) > 10,
            }
            for row in page.rows
        ]
        workflows = sorted({*queues.singleton_options(), *([workflow] if workflow else [])})
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Queues"),
            "subtitle": None,
            "has_view_permission": True,
            "rows": rows,
            "headers": headers,
            "totals": page,
            "now": now,
            "refresh": self._refresh(request),
            "pause_url": link(refresh="0"),
            "resume_url": link(refresh=""),
            "search": search,
            "search_hidden": [(k, v) for k, v in params.items() if k not in ("q", "p")],
            "filters": [
                {"label": label, "url": link(only=value), "selected": value == only}
                for value, label in queues.FILTERS.items()
            ],
            "workflow_filters": [
                {"label": _("All"), "url": link(workflow=""), "selected": not workflow},
                *({"label": w, "url": link(workflow=w), "selected": w == workflow} for w in workflows),
            ],
            "page_number": number,
            "pages": pages,
            "previous_url": link(p=str(number - 1)) if number > 1 else None,
            "next_url": link(p=str(number + 1)) if number < pages else None,
            "changelist_url": self._url("changelist"),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request,
            self.queues_template
            or [
                f"admin/{self.opts.app_label}/{self.opts.model_name}/queues.html",
                f"admin/{self.opts.app_label}/queues.html",
            ],
            context,
        )

    def queue_key_view(self, request: HttpRequest) -> HttpResponse:
        """Show one key's holders and its waiters in admission order (S5), with actions."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        workflow = request.GET.get("workflow", "")
        key = request.GET.get("key", "")
        if not workflow or not key:
            return HttpResponseRedirect(self._url("queues"))
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            # The same actions, permission checks and messages as the run list.
            response = self.response_action(request, queryset=self.get_queryset(request).for_key(workflow, key))
            return response if response is not None else HttpResponseRedirect(request.get_full_path())
        per_page = self.queue_per_page
        number = self._page_number(request)
        queue = queues.key_queue(workflow, key, offset=(number - 1) * per_page, limit=per_page)
        pages = max((queue.waiting + per_page - 1) // per_page, 1)
        if number > pages:  # past the end (the queue drained): show the last page
            number = pages
            queue = queues.key_queue(workflow, key, offset=(number - 1) * per_page, limit=per_page)
        now = timezone.now()

        def page_url(n: int) -> str:
            return "?" + urlencode({**{k: v for k, v in request.GET.items() if k != "p"}, "p": n})

        def entry(item: queues.QueuedRun) -> dict[str, Any]:
            run = item.run
            since = item.since
            return {
                "run": run,
                "position": item.position,
                "url": self._change_url(run.run_id),
                "since": since,
                "held": format_age((now - since).total_seconds()) if since else None,
                "waited": format_age((now - run.created_at).total_seconds()),
                "legacy": run.singleton_slot != "holder" and item.position is None,
                # Waiters further back retry late; a release or the tick's catch-up admits them (S7, S8a).
                "on_release": run.wake_at is not None and (run.wake_at - now).total_seconds() > 60,
            }

        can_act = self.has_change_permission(request)
        action_form = None
        if can_act:
            action_form = self.action_form(auto_id=None)
            action_form.fields["action"].choices = [
                choice for choice in self.get_action_choices(request) if choice[0] in ("", *self.actions)
            ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Queue of %(key)s") % {"key": key},
            "subtitle": workflow,
            "has_view_permission": True,
            "queue": queue,
            "holders": [entry(h) for h in queue.holders],
            "waiters": [entry(w) for w in queue.waiters],
            "free_slots": max(queue.limit - len(queue.holders), 0),
            "now": now,
            "refresh": self._refresh(request),
            "can_act": can_act,
            "action_form": action_form,
            "queues_url": self._url("queues"),
            "runs_url": self._url("changelist") + "?" + urlencode({"workflow_name": workflow, "singleton_key": key}),
            "page_number": number,
            "pages": pages,
            "previous_url": page_url(number - 1) if number > 1 else None,
            "next_url": page_url(number + 1) if number < pages else None,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request,
            self.queue_key_template
            or [
                f"admin/{self.opts.app_label}/{self.opts.model_name}/queue_key.html",
                f"admin/{self.opts.app_label}/queue_key.html",
            ],
            context,
        )


def _time(value: datetime | None, *, short: bool = False) -> str:
    if value is None:
        return "—"
    local = timezone.localtime(value)
    text = local.strftime("%Y-%m-%d %H:%M:%S") if short else local.strftime("%Y-%m-%d %H:%M:%S.%f %Z")
    return format_html('<time datetime="{}">{}</time>', value.isoformat(), text)


def _relative(value: datetime | None, now: datetime) -> str:
    if value is None:
        return ""
    seconds = (value - now).total_seconds()
    if seconds >= 0:
        return _("in %(age)s") % {"age": format_age(seconds)}
    return _("%(age)s ago") % {"age": format_age(-seconds)}


def _flat(line: Any) -> tuple[str, ...]:
    return tuple(line) if isinstance(line, list | tuple) else (line,)


def _definition_options(workflow: str) -> tuple[int, int | None] | None:
    return queues.singleton_options().get(workflow)


# The schedule pages live in their own module; registering them is a side effect of importing it.
from . import admin_schedules  # noqa: E402, F401
