"""The queue pages of the run admin: every workflow and key with active runs,
and one key's holders and waiters in admission order (SPEC section 6, S5).

They hang off the run admin (``get_urls`` + ``admin_site.admin_view`` +
``each_context``) with overridable template names, read through
:mod:`durable_singleton.queues` in a bounded number of queries, and page with
Django's :class:`~django.core.paginator.Paginator`. The queue table is an
aggregate of runs, not a list of model rows, so the change list's own sorting
does not apply to it: its column headers carry the sort in ``?o=`` as the
change list's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.translation import gettext as _

from .. import admission, queues
from ..admission import KEY_MAX_LENGTH, QUOTA_KEY_MAX_LENGTH, QUOTA_NAME_MAX_LENGTH
from ..queues import format_age
from ..statuses import SlotState
from .display import (
    BACKLOG_NOTE,
    activity,
    db_now,
    is_backlog_wake,
    overdue_html,
    recovery_html,
    recovery_of,
    state_label,
    unrenewed_lease,
)
from .params import choice_param, page_param, refresh_param, text_param

__all__ = ["QueuePagesMixin"]


class _OnePageAtATime:
    """A row source for :class:`Paginator` whose ``fetch(offset, limit)`` returns a page's rows
    and the total in one query, so a page costs one query instead of a count and a slice."""

    def __init__(self, fetch: Callable[[int, int], tuple[Sequence[Any], int]], per_page: int, first: int) -> None:
        self._fetch = fetch
        self._per_page = per_page
        self._first = first
        self._pages: dict[int, Sequence[Any]] = {}
        self._total: int | None = None

    def _load(self, offset: int) -> Sequence[Any]:
        if offset not in self._pages:
            self._pages[offset], self._total = self._fetch(offset, self._per_page)
        return self._pages[offset]

    def count(self) -> int:
        if self._total is None:
            self._load(self._first)
        assert self._total is not None
        return self._total

    def __getitem__(self, window: slice) -> Sequence[Any]:
        start = window.start or 0
        return self._load(start)[: window.stop - start]


def _one_query_page[L](
    request: HttpRequest,
    per_page: int,
    load: Callable[[int, int], L],
    rows: Callable[[L], tuple[Sequence[Any], int]],
) -> tuple[Page[Any], L]:
    """Return the page ``?p=`` asks for of what ``load(offset, limit)`` reads in one query, and
    that read; ``rows(read)`` gives its page's rows and the total."""
    loaded: list[L] = []

    def fetch(offset: int, limit: int) -> tuple[Sequence[Any], int]:
        loaded[:] = [load(offset, limit)]
        return rows(loaded[0])

    paginator: Paginator[Any] = Paginator(
        _OnePageAtATime(fetch, per_page, (page_param(request) - 1) * per_page),  # type: ignore[arg-type]
        per_page,
    )
    return paginator.get_page(page_param(request)), loaded[0]


def _page_url(request: HttpRequest) -> Callable[[int], str]:
    """Return a function of a page number to this page's query with ``p`` set to it."""

    def page_url(n: int) -> str:
        return "?" + urlencode({**{k: v for k, v in request.GET.items() if k != "p"}, "p": n})

    return page_url


class QueuePagesMixin:
    """The queue table and the key pages, for the ``ModelAdmin`` of :class:`~durable_singleton.models.Run`."""

    #: Template of the queue table; None: ``admin/durable_singleton/queues.html``.
    queues_template: str | None = None
    #: Template of one key's queue; None: ``admin/durable_singleton/queue_key.html``.
    queue_key_template: str | None = None
    #: Template of one quota key's queue; None: ``admin/durable_singleton/quota_key.html``.
    quota_key_template: str | None = None
    #: Template of one throttle key's page; None: ``admin/durable_singleton/throttle_key.html``.
    throttle_key_template: str | None = None
    #: Seconds between refreshes of the open queue pages (0: never); ``?refresh=N`` overrides.
    queue_refresh_seconds = 2
    #: Rows per page of the queue table, and waiters per page of a key's queue.
    queue_per_page = 100

    admin_site: admin.AdminSite
    opts: Any
    actions: Sequence[str]
    action_form: Any
    has_view_or_change_permission: Callable[..., bool]
    has_change_permission: Callable[..., bool]
    get_queryset: Callable[..., Any]
    get_action_choices: Callable[..., Any]
    response_action: Callable[..., HttpResponse | None]

    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path("queues/", self.admin_site.admin_view(self.queues_view), name="{}_{}_queues".format(*info)),
            path("queues/key/", self.admin_site.admin_view(self.queue_key_view), name="{}_{}_queue_key".format(*info)),
            path(
                "queues/throttle/",
                self.admin_site.admin_view(self.throttle_key_view),
                name="{}_{}_throttle_key".format(*info),
            ),
            path(
                "queues/quota/",
                self.admin_site.admin_view(self.quota_key_view),
                name="{}_{}_quota_key".format(*info),
            ),
            *super().get_urls(),  # type: ignore[misc]
        ]

    def _url(self, name: str) -> str:
        return reverse(f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{name}")

    def _key_url(self, workflow: str, key: str) -> str:
        return f"{self._url('queue_key')}?{urlencode({'workflow': workflow, 'key': key})}"

    def _quota_url(self, quota: str, key: str) -> str:
        return f"{self._url('quota_key')}?{urlencode({'quota': quota, 'key': key})}"

    def _throttle_url(self, throttle: str, key: str) -> str:
        return f"{self._url('throttle_key')}?{urlencode({'throttle': throttle, 'key': key})}"

    def _change_url(self, run_id: str) -> str:
        return reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_change",
            args=[quote(run_id)],
        )

    def _refresh(self, request: HttpRequest) -> float:
        return refresh_param(request, self.queue_refresh_seconds)

    @staticmethod
    def _paging(page: Page[Any], url: Callable[[int], str]) -> dict[str, Any]:
        """Return the template's paging context: numbers and links, elided as the change list's are."""
        paginator = page.paginator
        return {
            "page_number": page.number,
            "pages": paginator.num_pages,
            "previous_url": url(page.previous_page_number()) if page.has_previous() else None,
            "next_url": url(page.next_page_number()) if page.has_next() else None,
            "page_links": [
                {"number": n, "url": url(n) if isinstance(n, int) and n != page.number else None}
                for n in paginator.get_elided_page_range(page.number, on_each_side=2, on_ends=1)
            ]
            if paginator.num_pages > 1
            else [],
        }

    def queues_view(self, request: HttpRequest) -> HttpResponse:
        """List every workflow and key with active runs: limit, holders, waiting, oldest wait, cap, fullness."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        params = request.GET
        sort = choice_param(request, "o", [*queues.SORTS, *(f"-{s}" for s in queues.SORTS)], "-waiting")
        only = choice_param(request, "only", queues.FILTERS, "")
        workflow = text_param(request, "workflow")
        search = text_param(request, "q").strip()
        page, table = _one_query_page(
            request,
            self.queue_per_page,
            lambda offset, limit: queues.queue_table(
                workflow=workflow or None, key_contains=search or None, only=only, sort=sort, offset=offset, limit=limit
            ),
            lambda table: (table.rows, table.keys),
        )
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
                # A free slot under the limit in force (a paused key has none, K2) and a
                # waiter it alone admits: one that carries no quota (X3d).
                "stalled": row.stalled,
                # Waiters its free slot would admit but for a shared quota they carry (X3d).
                "quota_waiters": row.waiting_for_quota,
                # A free slot with waiters is normal for the moment a claim takes; for long, not (S8a).
                "stuck": row.stalled and (row.oldest_wait_seconds(now) or 0) > 10,
            }
            for row in page.object_list
        ]
        # The shared quotas (X3j): their busiest keys, beside the singleton keys' table.
        carried = queues.quota_workflows()
        quota_rows = [
            {
                "row": q,
                "url": self._quota_url(q.quota, q.key),
                "lanes_url": f"{self._url('lanes')}?{urlencode({'quota': q.quota, 'key': q.key})}",
                "age": format_age(None if q.oldest_waiter_at is None else (now - q.oldest_waiter_at).total_seconds()),
            }
            for q in queues.quota_table(
                limit=self.queue_per_page,
                # A chosen workflow narrows the shared quotas to those its runs carry (X3).
                quotas=carried.get(workflow, ()) if workflow else None,
            )
        ]
        # The throttle keys with waiters (X6): the rate, its use in the current window, the waiters.
        throttled = queues.throttle_workflows()
        throttle_rows = [
            {
                "row": t,
                "url": self._throttle_url(t.throttle, t.key),
                "age": format_age(
                    None if t.oldest_waiter_at is None else (t.as_of - t.oldest_waiter_at).total_seconds()
                ),
                "period": format_age(t.period),
            }
            for t in queues.throttle_table(
                limit=self.queue_per_page,
                # A chosen workflow narrows the throttles to those its runs carry (X6).
                throttles=throttled.get(workflow, ()) if workflow else None,
            )
        ]
        # Workflows with a singleton key, shared quotas or throttles: the last two have rows below only.
        workflows = sorted({*queues.singleton_options(), *carried, *throttled, *([workflow] if workflow else [])})
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Queues"),
            "subtitle": None,
            "has_view_permission": True,
            "rows": rows,
            "quota_rows": quota_rows,
            "throttle_rows": throttle_rows,
            "headers": _sort_headers(sort, link),
            "totals": table,
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
            **self._paging(page, lambda n: link(p=str(n))),
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
        """Show one key's holders (what each is doing) and its waiters in admission order (S5), with actions."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        workflow = text_param(request, "workflow")
        key = text_param(request, "key", KEY_MAX_LENGTH)
        if not workflow or not key:
            return HttpResponseRedirect(self._url("queues"))
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            # The same actions, permission checks and messages as the run list.
            response = self.response_action(request, queryset=self.get_queryset(request).for_key(workflow, key))
            return response if response is not None else HttpResponseRedirect(request.get_full_path())
        page, queue = _one_query_page(
            request,
            self.queue_per_page,
            lambda offset, limit: queues.key_queue(workflow, key, offset=offset, limit=limit),
            lambda queue: (queue.waiters, queue.waiting),
        )
        # The database's clock: leases and wake times are judged on it (R5, K3).
        now = db_now()

        free_slots = admission.free_slots(queue.limit, len(queue.holders), paused=queue.paused)
        # A holder whose lease was not renewed holds the slot until it expires (K3, D4).
        recovery = recovery_of([h.run for h in queue.holders], now, free_slots)

        # The quota keys each listed run carries (X3b), one query: a waiter its key would admit
        # may wait for one of them (X3d), and the page says which, linked to its queue.
        listed = [*queue.holders, *page.object_list]
        carried = queues.quota_places([item.run.run_id for item in listed if item.run.quota_slot == SlotState.WAITER])

        def entry(item: queues.QueuedRun) -> dict[str, Any]:
            run = item.run
            since = item.since
            # Its lease was not renewed for longer than the renewal interval (K3).
            unrenewed = unrenewed_lease(run, now) is not None
            # Parked over a throttle's rate: its next try is the window's opening, not a release (X6d).
            throttled = queues.throttled_until(run, now) is not None
            return {
                # Waiting for the key, or able to run and waiting for a worker (#9).
                "cause": queues.run_cause(
                    status=run.status,
                    holder=item.position is None,
                    wake_at=run.wake_at,
                    position=item.position,
                    free_slots=free_slots,
                    now=now,
                    unrenewed=unrenewed,
                    quota_waiter=run.quota_slot == SlotState.WAITER,
                    throttled=throttled,
                ),
                "quotas": [
                    {"quota": q, "key": k, "url": self._quota_url(q, k)}
                    for q, k, slot in carried.get(run.run_id, [])
                    if slot == SlotState.WAITER
                ],
                "run": run,
                "position": item.position,
                "url": self._change_url(run.run_id),
                "state": state_label(run),
                "since": since,
                "held": format_age((now - since).total_seconds()) if since else None,
                "waited": format_age((now - run.created_at).total_seconds()),
                # A waiter's queue TTL, on the database's clock as the tick judges it (X2, R5).
                "expiry": queues.queue_ttl_words(queues.queue_ttl_left(run, now)),
                "legacy": run.singleton_slot != SlotState.HOLDER and item.position is None,
                "doing": activity(run, item.steps_done, item.last_step, now, recovery=recovery),
                "unrenewed": unrenewed,
                # A wake time that has come and nobody took the turn reads "overdue since" (K3),
                # unless the waiter waits on a dead holder's lease: a normal recovery (D4).
                "wake": overdue_html(run.wake_at, now)
                if recovery is None or item.position is None or run.wake_at is None or run.wake_at > now
                else recovery_html(recovery, now),
                # Waiters further back retry late; a release or the tick's catch-up admits them (S7, S8a).
                "on_release": is_backlog_wake(run, now) and not throttled,
            }

        waiters = [entry(w) for w in page.object_list]
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
            "waiters": waiters,
            "any_backlog": any(w["on_release"] for w in waiters),
            "free_slots": free_slots,
            "backlog_note": _(BACKLOG_NOTE),
            "now": now,
            "refresh": self._refresh(request),
            "can_act": can_act,
            "action_form": action_form,
            "queues_url": self._url("queues"),
            "runs_url": self._url("changelist") + "?" + urlencode({"workflow_name": workflow, "singleton_key": key}),
            **self._paging(page, _page_url(request)),
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

    def quota_key_view(self, request: HttpRequest) -> HttpResponse:
        """Show one shared quota key (X3, K3): its holders across workflows and its due waiters
        in the quota's admission order with their positions and why each waits."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        quota = text_param(request, "quota", QUOTA_NAME_MAX_LENGTH)
        key = text_param(request, "key", QUOTA_KEY_MAX_LENGTH)
        if not quota or not key:
            return HttpResponseRedirect(self._url("queues"))
        page, queue = _one_query_page(
            request,
            self.queue_per_page,
            lambda offset, limit: queues.quota_key_queue(quota, key, offset=offset, limit=limit),
            lambda queue: (queue.waiters, queue.waiting),
        )
        now = db_now()  # leases and due times are judged on the database's clock (R5, K3)

        def entry(item: queues.QueuedRun) -> dict[str, Any]:
            run = item.run
            unrenewed = unrenewed_lease(run, now) is not None
            if item.position is None:
                cause = queues.run_cause(
                    status=run.status,
                    holder=True,
                    wake_at=run.wake_at,
                    position=None,
                    free_slots=0,
                    now=now,
                    unrenewed=unrenewed,
                )
            else:
                cause = queues.quota_waiter_cause(run, item.position, queue.free_slots)
            return {
                "run": run,
                "position": item.position,
                "cause": cause,
                "url": self._change_url(run.run_id),
                "key_url": self._key_url(run.workflow_name, run.singleton_key) if run.singleton_key else None,
                "state": state_label(run),
                "unrenewed": unrenewed,
                "waited": format_age((now - run.created_at).total_seconds()),
                "wake": overdue_html(run.wake_at, now),
            }

        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Quota %(quota)s, key %(key)s") % {"quota": quota, "key": key},
            "subtitle": None,
            "has_view_permission": True,
            "queue": queue,
            "holders": [entry(h) for h in queue.holders],
            "waiters": [entry(w) for w in page.object_list],
            "now": now,
            "refresh": self._refresh(request),
            "queues_url": self._url("queues"),
            # This quota's keys as lanes over time, this key first (X3).
            "lanes_url": f"{self._url('lanes')}?{urlencode({'quota': quota, 'key': key})}",
            **self._paging(page, _page_url(request)),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request,
            self.quota_key_template
            or [
                f"admin/{self.opts.app_label}/{self.opts.model_name}/quota_key.html",
                f"admin/{self.opts.app_label}/quota_key.html",
            ],
            context,
        )

    def throttle_key_view(self, request: HttpRequest) -> HttpResponse:
        """Show one throttle key (X6, K3): its rate and the admissions in its current window,
        its waiters in its admission order with why each waits (over the rate until the
        window's opening, or in line), and its controls (K2)."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        throttle = text_param(request, "throttle", QUOTA_NAME_MAX_LENGTH)
        key = text_param(request, "key", QUOTA_KEY_MAX_LENGTH)
        if not throttle or not key:
            return HttpResponseRedirect(self._url("queues"))
        page, queue = _one_query_page(
            request,
            self.queue_per_page,
            lambda offset, limit: queues.throttle_key_queue(throttle, key, offset=offset, limit=limit),
            lambda queue: (queue.waiters, queue.waiting),
        )
        now = queue.as_of  # the database's clock (R5, K3)

        def entry(item: queues.QueuedRun) -> dict[str, Any]:
            run = item.run
            over = run.not_before is not None and run.not_before > now
            return {
                "run": run,
                "position": item.position,
                "over_rate": over,
                "doing": activity(run, None, None, now),
                "url": self._change_url(run.run_id),
                "key_url": self._key_url(run.workflow_name, run.singleton_key) if run.singleton_key else None,
                "state": state_label(run),
                "waited": format_age((now - run.created_at).total_seconds()),
                "wake": overdue_html(run.wake_at, now),
            }

        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Throttle %(throttle)s, key %(key)s") % {"throttle": throttle, "key": key},
            "subtitle": None,
            "has_view_permission": True,
            "queue": queue,
            "period": format_age(queue.period),
            "waiters": [entry(w) for w in page.object_list],
            "now": now,
            "refresh": self._refresh(request),
            "queues_url": self._url("queues"),
            **self._paging(page, _page_url(request)),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request,
            self.throttle_key_template
            or [
                f"admin/{self.opts.app_label}/{self.opts.model_name}/throttle_key.html",
                f"admin/{self.opts.app_label}/throttle_key.html",
            ],
            context,
        )


def _sort_headers(sort: str, link: Callable[..., str]) -> list[dict[str, Any]]:
    """Return the queue table's column headers, each linking to its sort (``?o=name`` or ``-name``)."""
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
    return headers
