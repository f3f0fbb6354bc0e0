"""The lanes page of the run admin: one workflow's busy keys as lanes over the last minutes,
drawn on the server as SVG (no script library, no CDN: it works offline), refreshed in place.

Each lane is a key: its holders' time in their slots as bars over time (a
bar still open at *now* holds its slot), a mark at each admission, a line
at each handoff (a release that admitted a waiter, S7), and its waiters as a
queue of numbered boxes in admission order (S5 step 3), position 1 first.
A shared quota's key is a lane too (X3): its holders and waiters are every
workflow's that carries the quota, its label links the quota key's page, and
each waiter's tooltip says why it waits (X3d). ``?quota=NAME`` narrows the
page to that quota's keys. The data is :func:`durable_singleton.lanes.workflow_lanes`
or :func:`durable_singleton.lanes.quota_lanes`; this module only turns it into
coordinates. The page hangs off the run admin (``get_urls`` +
``admin_site.admin_view`` + ``each_context``) with an overridable template
name, as the queue pages do; ``?fragment=1`` returns only the drawing, which
the page's small script fetches every ``refresh`` seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.translation import gettext as _

from ..admission import KEY_MAX_LENGTH, QUOTA_KEY_MAX_LENGTH, QUOTA_NAME_MAX_LENGTH
from ..definitions import registry
from ..explain import lease_words
from ..lanes import DEFAULT_MINUTES, MAX_MINUTES, Lane, Lanes, Member, quota_lanes, workflow_lanes
from ..queues import Cause, format_age, quota_workflows, singleton_options
from ..runtime import get_engine
from ..statuses import RunStatus, Verdict
from .params import flag_param, int_param, refresh_param, text_param

__all__ = ["LanePagesMixin", "draw"]

#: The window lengths offered as links, in minutes (any 1 to MAX_MINUTES works as ``?minutes=``).
MINUTE_CHOICES = (1, 5, 10, 30, 60)

# The drawing's coordinates (SVG user units, about pixels at 1,000 px wide).
WIDTH = 1000
AXIS_X0 = 8
AXIS_X1 = 730  # now
QUEUE_X = 756
BOX = 16
BOX_STEP = 20
QUEUE_BOXES = 10  # boxes drawn per lane; "+N" says how many more wait
TOP = 30
#: A lane's label line: its baseline 13 units below the lane's top, then room for the
#: admission marks and handoff ticks that rise above the first row (they never reach the label).
LABEL_H = 26
LABEL_BASELINE = 13
ROW_H = 14
ROW_STEP = 18
LANE_GAP = 14
_TICK_STEPS = (5, 10, 15, 30, 60, 120, 300, 600)
#: The axis labels' font (11 px): a generous width per character, in user units, and the
#: least gap between two labels; a tick whose label would come closer to another is not labelled.
_CHAR_W = 7.0
_LABEL_GAP = 10.0


def _clock(moment: datetime) -> str:
    return timezone.localtime(moment).strftime("%H:%M:%S.%f")[:-3]


def _f(value: float) -> str:
    return f"{value:.1f}"


def _ticks(seconds: float) -> list[tuple[float, str]]:
    """Return (seconds before now, label) for a readable step: at most 10 ticks across the window."""
    step = next((s for s in _TICK_STEPS if seconds / s <= 10), _TICK_STEPS[-1])
    out = []
    back = step
    while back < seconds - step / 4:
        out.append((float(back), f"-{back // 60} min" if back % 60 == 0 else f"-{back} s"))
        back += step
    return out


def _text_span(x: float, text: str, anchor: str) -> tuple[float, float]:
    """Return the (left, right) an axis label of ``text`` at ``x`` takes, generously."""
    width = len(text) * _CHAR_W
    left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
    return left, left + width


def _axis(seconds: float, start_label: str, now_label: str) -> list[dict[str, str]]:
    """Return the axis's grid lines (``x``) and their labels: a tick's label is left out (its
    line kept) where it would come within ``_LABEL_GAP`` of the start's, now's or a kept
    tick's label, so no two labels overlap whatever the window."""
    taken = [_text_span(AXIS_X0, start_label, "start"), _text_span(AXIS_X1, now_label, "end")]
    ticks = []
    for back, label in _ticks(seconds):
        x = AXIS_X1 - back / seconds * (AXIS_X1 - AXIS_X0)
        left, right = _text_span(x, label, "middle")
        clear = all(right + _LABEL_GAP <= a or b + _LABEL_GAP <= left for a, b in taken)
        if clear:
            taken.append((left, right))
        ticks.append({"x": _f(x), "label": label if clear else ""})
    return ticks


def _bar_class(status: str, holding: bool) -> str:
    if holding:
        # A holder runs, or it parked (its park's verdict) and keeps its slot (S6).
        return str(RunStatus.RUNNING) if status == RunStatus.RUNNING else str(Verdict.PARKED)
    return str(status)


#: A quota lane's waiters counted by cause, in words (X3d).
_CAUSE_COUNTS = (
    (Cause.NEEDS_QUOTA, "%(count)s for a slot of the quota"),
    (Cause.NEEDS_KEY, "%(count)s for their own key"),
    (Cause.NEEDS_WORKER, "%(count)s for a worker"),
)


def _whose(run_id: str, member: Member | None) -> str:
    """Say a run of a quota lane with its workflow and own key: ``R (W · K)``; the run id alone
    on a singleton key's lane (``member`` None)."""
    if member is None:
        return run_id
    own = f" · {member.singleton_key}" if member.singleton_key else ""
    return f"{run_id} ({member.workflow}{own})"


def _summary(lane: Lane) -> str:
    """Return a lane's label text after its key: the limit in force (K2), the counts and, on a
    quota key's lane, why its waiters wait (X3d); on a singleton key's, those a free slot
    would admit but for a shared quota."""
    text = _("limit %(limit)s · %(holders)s holding · %(waiting)s waiting") % {
        "limit": lane.limit,
        "holders": lane.holders,
        "waiting": lane.waiting,
    }
    if lane.quota is None:
        if lane.waiting_for_quota:
            text += " " + _("(%(count)s for a shared quota: see the queue page)") % {"count": lane.waiting_for_quota}
        if lane.throttled:
            text += " " + _("(%(count)s throttled until their window opens)") % {"count": lane.throttled}
        return text
    parts = [_(words) % {"count": lane.causes[cause]} for cause, words in _CAUSE_COUNTS if lane.causes.get(cause)]
    if lane.not_due:
        parts.append(_("%(count)s not due yet") % {"count": lane.not_due})
    return text + (": " + ", ".join(parts) if parts else "")


def _lane(
    lane: Lane,
    lanes: Lanes,
    y: float,
    x_of: Callable[[datetime], float],
    run_url: Callable[[str], str],
    quota_url: Callable[[str, str], str] | None = None,
) -> dict[str, Any]:
    """Return one lane's shapes, its top at ``y``."""
    rows_top = y + LABEL_H
    shared = lane.quota is not None

    def row_y(slot: int) -> float:
        return rows_top + slot * ROW_STEP

    bars = []
    for hold in lane.holds:
        x = x_of(max(hold.start, lanes.start))
        x2 = x_of(min(hold.end or lanes.now, lanes.now))
        # A bar is at least 2 units wide, and ends at its end (never past the now line):
        # a span shorter than that grows to the left.
        x = min(x, x2 - 2.0)
        holding = hold.end is None
        state = _bar_class(hold.status, holding)
        bars.append(
            {
                "run_id": hold.run_id,
                "url": run_url(hold.run_id),
                "x": _f(x),
                "y": _f(row_y(hold.slot)),
                "w": _f(x2 - x),
                "h": ROW_H,
                "state": state,
                "holding": holding,
                "unrenewed": hold.unrenewed is not None,
                "title": _("%(run)s: %(state)s, held from %(start)s to %(end)s (%(age)s)")
                % {
                    "run": _whose(hold.run_id, lane.members.get(hold.run_id) if shared else None),
                    "state": hold.status,
                    "start": _clock(hold.start),
                    "end": _("now") if holding else _clock(hold.end or lanes.now),
                    "age": format_age(hold.seconds(lanes.now)),
                }
                + (
                    "; " + _("lease %(words)s") % {"words": lease_words(hold.unrenewed, at=_clock)}
                    if hold.unrenewed is not None
                    else ""
                ),
            }
        )
    admissions = [
        {
            "run_id": hold.run_id,
            "d": f"M{_f(x_of(hold.start))},{_f(row_y(hold.slot) - 1)} l-4,-5 h8 z",
            "title": _("%(run)s admitted at %(at)s") % {"run": hold.run_id, "at": _clock(hold.start)},
        }
        for hold in lane.admissions(lanes.start)
    ]
    handoffs = []
    for handoff in lane.handoffs:
        if handoff.admitted_at < lanes.start:
            continue
        x1, x2 = x_of(max(handoff.released_at, lanes.start)), x_of(handoff.admitted_at)
        y1, y2 = row_y(handoff.from_slot) + ROW_H / 2, row_y(handoff.to_slot) + ROW_H / 2
        handoffs.append(
            {
                "released_by": handoff.released_by,
                "admitted": handoff.admitted,
                # A tick across both rows at the admission, joined to the release when rows differ.
                "d": f"M{_f(x1)},{_f(y1)} L{_f(x2)},{_f(y2)} M{_f(x2)},{_f(min(y1, y2) - ROW_H / 2 - 2)} "
                f"V{_f(max(y1, y2) + ROW_H / 2 + 2)}",
                "title": _("handoff: %(old)s released at %(released)s, %(new)s admitted %(gap)s later")
                % {
                    "old": handoff.released_by,
                    "released": _clock(handoff.released_at),
                    "new": handoff.admitted,
                    "gap": format_age(handoff.gap_seconds),
                },
            }
        )
    waiters = []
    for n, run_id in enumerate(lane.waiters[:QUEUE_BOXES]):
        member = lane.members.get(run_id) if shared else None
        cause = member.cause if member is not None else None
        waiters.append(
            {
                "run_id": run_id,
                "url": run_url(run_id),
                "position": n + 1,
                "cause": cause.name.lower() if cause is not None else "",
                "x": _f(QUEUE_X + n * BOX_STEP),
                "y": _f(rows_top),
                "tx": _f(QUEUE_X + n * BOX_STEP + BOX / 2),
                "ty": _f(rows_top + BOX / 2 + 3.5),
                "title": _("position %(n)s: %(run)s") % {"n": n + 1, "run": _whose(run_id, member)}
                + (", " + _(cause.value) if cause is not None else ""),
            }
        )
    # Boxes and "+N" count the waiters in line (a quota lane's delayed starts not due yet are not, X5).
    more = lane.due - len(waiters)
    name = _("quota %(quota)s · %(key)s") % {"quota": lane.quota, "key": lane.key} if shared else lane.key
    label = name if len(name) <= 90 else name[:89] + "…"
    return {
        "key": lane.key,
        "quota": lane.quota,
        "label": label,
        "name": name,
        "label_url": quota_url(lane.quota, lane.key) if quota_url is not None and lane.quota is not None else "",
        "label_y": _f(y + LABEL_BASELINE),
        "summary": _summary(lane),
        "paused": lane.paused,
        "slots": [{"y": _f(row_y(i)), "h": ROW_H} for i in range(lane.slots)],
        "bars": bars,
        "admissions": admissions,
        "handoffs": handoffs,
        "waiters": waiters,
        # The waiters in line now: boxes or "+N", else "no waiter" (X5: not those not due yet).
        "waiting": lane.due,
        "more": more,
        "more_x": _f(QUEUE_X + len(waiters) * BOX_STEP + 2),
        "more_y": _f(rows_top + BOX / 2 + 4),
        "height": LABEL_H + lane.slots * ROW_STEP + LANE_GAP,
    }


def draw(
    lanes: Lanes, run_url: Callable[[str], str], quota_url: Callable[[str, str], str] | None = None
) -> dict[str, Any]:
    """Return the SVG's shapes for ``lanes``: the time axis (``AXIS_X0`` at the window's start,
    ``AXIS_X1`` at now), then per lane its label, slot rows, bars, admissions, handoffs and
    waiters' boxes; ``run_url(run_id)`` links each bar and box to its run's page, and
    ``quota_url(quota, key)`` a quota key's label to that key's page (X3)."""
    seconds = max((lanes.now - lanes.start).total_seconds(), 1.0)

    def x_of(moment: datetime) -> float:
        offset = (moment - lanes.start).total_seconds()
        return AXIS_X0 + max(0.0, min(offset / seconds, 1.0)) * (AXIS_X1 - AXIS_X0)

    drawn = []
    y = float(TOP)
    for lane in lanes.lanes:
        shapes = _lane(lane, lanes, y, x_of, run_url, quota_url)
        drawn.append(shapes)
        y += shapes["height"]
    height = y + 4
    now_label = _("now")
    start_label = _("-%(minutes)s min") % {"minutes": f"{lanes.minutes:g}"}
    return {
        "width": WIDTH,
        "height": _f(height),
        "x0": AXIS_X0,
        "x1": AXIS_X1,
        "axis_width": AXIS_X1 - AXIS_X0,
        "queue_x": QUEUE_X,
        "axis_bottom": _f(height - 4),
        "ticks": _axis(seconds, start_label, now_label),
        # "now" alone on the axis (the status line above gives the time), the time in its tooltip.
        "now_label": now_label,
        "now_title": timezone.localtime(lanes.now).strftime("%H:%M:%S"),
        "start_label": start_label,
        "lanes": drawn,
    }


class LanePagesMixin:
    """The lanes page, for the ``ModelAdmin`` of :class:`~durable_singleton.models.Run`."""

    #: Template of the lanes page; None: ``admin/durable_singleton/lanes.html``.
    lanes_template: str | None = None
    #: Template of the drawing alone (``?fragment=1``); None: ``admin/durable_singleton/includes/lanes_svg.html``.
    lanes_fragment_template: str | None = None
    #: Seconds between refreshes of an open lanes page (0: never); ``?refresh=N`` overrides.
    lanes_refresh_seconds = 2
    #: Lanes drawn at most, and waiters drawn per lane.
    lanes_max_keys = 30

    admin_site: admin.AdminSite
    opts: Any
    has_view_or_change_permission: Callable[..., bool]

    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path("queues/lanes/", self.admin_site.admin_view(self.lanes_view), name="{}_{}_lanes".format(*info)),
            *super().get_urls(),  # type: ignore[misc]
        ]

    def _admin_url(self, name: str, *args: str) -> str:
        return reverse(f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{name}", args=args)

    def _quota_key_url(self, quota: str, key: str) -> str:
        return self._admin_url("quota_key") + "?" + urlencode({"quota": quota, "key": key})

    def lanes_view(self, request: HttpRequest) -> HttpResponse:
        """Draw one workflow's busy keys (``?workflow=``), its singleton keys then the keys of
        the shared quotas it carries, or one shared quota's keys (``?quota=``, X3), over the
        last ``?minutes=`` (1 to 60, default 10); ``?key=`` draws that key first."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        workflow = text_param(request, "workflow")
        quota = text_param(request, "quota", QUOTA_NAME_MAX_LENGTH)
        key = text_param(request, "key", QUOTA_KEY_MAX_LENGTH if quota else KEY_MAX_LENGTH) or None
        minutes = int_param(request, "minutes", DEFAULT_MINUTES, 1, MAX_MINUTES)
        refresh = refresh_param(request, self.lanes_refresh_seconds)
        query = {k: v for k, v in request.GET.items() if k != "fragment"}

        def link(**changes: str) -> str:
            return "?" + urlencode({**query, **changes})

        carried = quota_workflows()
        if quota:
            title = _("Lanes of the shared quota %(quota)s") % {"quota": quota}
        elif workflow:
            title = _("Lanes of %(workflow)s") % {"workflow": workflow}
        else:
            title = _("Lanes")
        context: dict[str, Any] = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "subtitle": None,
            "has_view_permission": True,
            "workflow": workflow,
            "quota": quota,
            "key": key,
            "minutes": minutes,
            "max_minutes": MAX_MINUTES,
            "refresh": refresh,
            "queues_url": self._admin_url("queues"),
            "changelist_url": self._admin_url("changelist"),
            "fragment_url": link(fragment="1"),
            "minute_links": [
                {"minutes": m, "url": link(minutes=str(m)), "selected": m == minutes} for m in MINUTE_CHOICES
            ],
            "pause_url": link(refresh="0"),
            "resume_url": "?" + urlencode({k: v for k, v in query.items() if k != "refresh"}),
            # Every workflow with a singleton key or shared quotas: a quota-only one has lanes (X3).
            "workflows": [
                {"name": name, "url": "?" + urlencode({"workflow": name})}
                for name in sorted({*singleton_options(), *carried})
            ],
            "quotas": [
                {"name": name, "url": "?" + urlencode({"quota": name})} for name in sorted(list(registry.quotas))
            ],
            # The shared quotas of the chosen workflow, each a link to its keys' lanes alone.
            "carried": [
                {"name": name, "url": "?" + urlencode({"workflow": workflow, "quota": name})}
                for name in carried.get(workflow, ())
            ],
        }
        if workflow or quota:
            engine = get_engine()
            # The database's clock: spans end "now" on it, and leases are judged on it (R5, K3).
            bounds: dict[str, Any] = {
                "now": engine.store.now(),
                "minutes": minutes,
                "first_key": key,
                "max_keys": self.lanes_max_keys,
                "settings": engine.settings,
            }
            lanes = quota_lanes(quota, **bounds) if quota else workflow_lanes(workflow, **bounds)
            drawing = draw(lanes, lambda run_id: self._admin_url("change", quote(run_id)), self._quota_key_url)
            for lane in drawing["lanes"]:
                lane["focus"] = lane["key"] == key and lane["quota"] == (quota or None)
            context["lanes"] = lanes
            context["drawing"] = drawing
            context["quota_lanes"] = any(lane.quota is not None for lane in lanes.lanes)
            context["queue_url"] = (
                self._admin_url("queues") + "?" + urlencode({"workflow": workflow} if workflow else {})
            )
        request.current_app = self.admin_site.name
        if flag_param(request, "fragment"):
            return TemplateResponse(
                request,
                self.lanes_fragment_template or "admin/durable_singleton/includes/lanes_svg.html",
                context,
            )
        return TemplateResponse(
            request,
            self.lanes_template
            or [
                f"admin/{self.opts.app_label}/{self.opts.model_name}/lanes.html",
                f"admin/{self.opts.app_label}/lanes.html",
            ],
            context,
        )
