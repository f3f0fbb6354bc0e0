"""How the admin pages show a run: times, JSON, its state in words, what a
holder is doing, and why a waiter's next wake is far away.

Each rule is written once here and used by the run list, the run page and
the key's queue page.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from ..admission import is_legacy_holder
from ..conf import Settings
from ..explain import lease_words
from ..queues import format_age
from ..renewals import LeaseState, lease_state
from ..statuses import ParkReason, RunStatus, SlotState

__all__ = [
    "BACKLOG_NOTE",
    "activity",
    "breakable",
    "clock",
    "db_now",
    "is_backlog_wake",
    "overdue_html",
    "pretty_json",
    "recovery_html",
    "recovery_of",
    "relative",
    "run_id_html",
    "state_label",
    "time_html",
    "unrenewed_lease",
    "wake_html",
]

#: A waiter whose wake is further away than this, in seconds, is a backlog
#: waiter: the engine retries it late on purpose (S8a).
BACKLOG_WAKE_AFTER_SECONDS = 60.0

BACKLOG_NOTE = gettext_noop(
    "A waiter behind the first waiters of its key retries only this late on purpose, so a long "
    "queue costs nothing while it waits (S8a). It is admitted sooner: the release of a holder wakes "
    "the next waiters at once (S7), and the tick's per-key catch-up wakes the oldest waiters of any "
    "key with a free slot within about a tick. This time is only the fallback."
)


#: A name may wrap after one of these characters (``task:inventory.tasks.sync_store``, ``store:north-east``).
_SEPARATOR = re.compile(r"([.:/_\-@,=])")
#: A run of hex digits longer than a uuid's group (a ``uuid4().hex`` run id) may wrap every 8 digits.
_HEX_RUN = re.compile(r"[0-9a-f]{17,}")


def breakable(text: Any) -> SafeString:
    """Return ``text`` escaped, with a line-break opportunity (``<wbr>``) after each separator
    (``. : / _ - @ , =``) and every 8 digits of a long hex run, so that long workflow names,
    keys, run ids, tags and host names wrap where a reader splits them, never mid-word, and
    never overflow their cell."""

    def hex_groups(part: str) -> str:
        return _HEX_RUN.sub(lambda m: "<wbr>".join(m[0][i : i + 8] for i in range(0, len(m[0]), 8)), part)

    pieces = _SEPARATOR.split(str(text))
    # split() with a group alternates text and separators: escape both, break after each separator.
    return SafeString(
        "".join(
            f"{conditional_escape(piece)}<wbr>" if n % 2 else hex_groups(str(conditional_escape(piece)))
            for n, piece in enumerate(pieces)
        )
    )


#: A generated run id (``uuid4().hex``, or a uuid with dashes): hex digits and dashes only.
_GENERATED_ID = re.compile(r"[0-9a-f]{8}-?(?:[0-9a-f]{4}-?){3}[0-9a-f]{12}")
#: Characters of a generated run id shown in a list: enough to find it (search, durable_explain).
SHORT_ID = 8


def run_id_html(run_id: str) -> SafeString:
    """Return a run id for a list's cell, the whole id in its tooltip: a generated one
    (a uuid, 32 hex digits) as its first :data:`SHORT_ID` characters and "…", unbroken
    (``durable_explain`` and the list's search take that prefix); any other id whole,
    wrapping only after its separators (:func:`breakable`)."""
    if _GENERATED_ID.fullmatch(run_id):
        return format_html('<span class="ds-run-id ds-run-id-short" title="{}">{}…</span>', run_id, run_id[:SHORT_ID])
    return format_html('<span class="ds-run-id" title="{}">{}</span>', run_id, breakable(run_id))


def _decoded(value: Any) -> tuple[bool, Any]:
    """Decode an encoded payload (S13) with this process's codec store, if it has one that can."""
    from ..codecs import PayloadDecodeError
    from ..runtime import get_engine

    codec = get_engine().store.codec
    if codec is None:
        return False, value
    try:
        return True, codec.decode(value)
    except PayloadDecodeError:
        return False, value


def pretty_json(value: Any) -> SafeString:
    """Return ``value`` as indented JSON in a ``<pre>``; ``null`` quietly.

    An encoded payload (the codec store, S13) is shown decoded when this
    process's store has the codec and key for it, else as what it is.
    """
    from ..codecs import ENVELOPE_KEY, is_envelope

    if value is None:
        return format_html('<span class="quiet">{}</span>', "null")
    if is_envelope(value):
        ok, plain = _decoded(value)
        if not ok:
            return format_html(
                '<span class="ds-tag ds-tag-marker">{}</span>',
                f"encoded payload ({value[ENVELOPE_KEY]}); this process has no codec and key that decode it",
            )
        text = json.dumps(plain, indent=2, ensure_ascii=False, sort_keys=False, default=str)
        return format_html(
            '<pre class="ds-json">{}</pre><span class="quiet">{}</span>', text, "decoded (stored encoded)"
        )
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)
    return format_html('<pre class="ds-json">{}</pre>', text)


def time_html(value: datetime | None, *, short: bool = False) -> SafeString | str:
    """Return a ``<time>`` in the current time zone: month, day and seconds when ``short``
    (the full time in the tooltip), else the date, microseconds and zone."""
    if value is None:
        return "—"
    local = timezone.localtime(value)
    full = local.strftime("%Y-%m-%d %H:%M:%S.%f %Z")
    if not short:
        return format_html('<time datetime="{}">{}</time>', value.isoformat(), full)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>', value.isoformat(), full, local.strftime("%m-%d %H:%M:%S")
    )


def relative(value: datetime | None, now: datetime) -> str:
    """Return ``in 4.2 s`` or ``3 min 12 s ago``; empty for None."""
    if value is None:
        return ""
    seconds = (value - now).total_seconds()
    if seconds >= 0:
        return _("in %(age)s") % {"age": format_age(seconds)}
    return _("%(age)s ago") % {"age": format_age(-seconds)}


def state_label(run: Any) -> SafeString:
    """Return the run's state in words: a waiter reads ``waiting`` whatever its stored
    status (pending or suspended, S5), with the stored status in the tooltip; a holder
    reads its status and ``holder`` (an untracked one of an older release: ``holder
    (legacy)``, S12)."""
    if run.singleton_slot == SlotState.WAITER:
        return format_html(
            '<span class="ds-state ds-state-waiting" title="{}">{}</span>',
            _("waiting for a slot of its key (stored status: %(status)s)") % {"status": run.status},
            _("waiting"),
        )
    slot: SafeString | str = ""
    if run.singleton_slot == SlotState.HOLDER:
        slot = format_html('<span class="ds-slot ds-slot-holder">{}</span>', _("holder"))
    elif is_legacy_holder(run.status, key=run.singleton_key, tracked=run.singleton_tracked):
        slot = format_html('<span class="ds-slot ds-slot-holder">{}</span>', _("holder (legacy)"))
    return format_html('<span class="ds-state ds-state-{}">{}{}</span>', run.status, run.get_status_display(), slot)


def is_backlog_wake(run: Any, now: datetime) -> bool:
    """Tell whether ``run`` is a waiter whose ``wake_at`` is the far backlog fallback (S8a)."""
    return (
        run.singleton_slot == SlotState.WAITER
        and run.wake_at is not None
        and (run.wake_at - now).total_seconds() > BACKLOG_WAKE_AFTER_SECONDS
    )


def wake_html(run: Any, now: datetime, *, short: bool = True) -> SafeString | str:
    """Return the run's ``wake_at``; a backlog waiter's is marked as the fallback and explained (S8a)."""
    shown = time_html(run.wake_at, short=short)
    if not is_backlog_wake(run, now):
        return shown
    return format_html('{} <span class="ds-backlog" title="{}">{}</span>', shown, _(BACKLOG_NOTE), _("fallback"))


def db_now() -> datetime:
    """Return the default engine's store's clock, the database's (R5): the "now" of
    the admin's pages that judge leases and wake times (one read)."""
    from ..runtime import get_engine

    return get_engine().store.now()


def _settings() -> Settings:
    from ..runtime import get_engine

    return get_engine().settings


def clock(value: datetime) -> str:
    """Return ``value`` as the admin's pages show a time of today: ``HH:MM:SS`` in the current time zone."""
    return timezone.localtime(value).strftime("%H:%M:%S")


def unrenewed_lease(run: Any, now: datetime, settings: Settings | None = None) -> LeaseState | None:
    """Return ``run``'s lease when it was not renewed for longer than the renewal interval
    at ``now`` (the database's clock, :func:`db_now`): :func:`~durable_singleton.renewals.lease_state`
    with the default engine's settings; else None."""
    lease = lease_state(run.status, run.lease_owner, run.lease_expires_at, settings=settings or _settings(), now=now)
    return lease if lease is not None and lease.unrenewed else None


def overdue_html(value: datetime | None, now: datetime) -> SafeString | str:
    """Return a wake time: ``HH:MM:SS``, or ``overdue since HH:MM:SS`` once it has come
    by ``now`` (the database's clock) and nobody has taken the turn; "—" for None."""
    if value is None:
        return "—"
    shown = format_html('<time datetime="{}">{}</time>', value.isoformat(), clock(value))
    if value > now:
        return shown
    return format_html(
        '<span class="ds-overdue" title="{}">{} {}</span>',
        _("%(age)s ago") % {"age": format_age((now - value).total_seconds())},
        _("overdue since"),
        shown,
    )


def recovery_of(holders: Any, now: datetime, free_slots: int, settings: Settings | None = None) -> LeaseState | None:
    """Return the unrenewed lease (K3) a waiter is really waiting on: when its key has no free
    slot and a holder's lease was not renewed, that holder's (the earliest to expire), from
    whose expiry the tick recovers it and a slot frees (D4, S7); else None. ``holders``: the
    key's holding runs; ``now``: the database's clock (R5)."""
    if free_slots > 0:
        return None
    leases = [lease for run in holders if (lease := unrenewed_lease(run, now, settings)) is not None]
    return min(leases, key=lambda lease: lease.expires_at, default=None)


def recovery_html(lease: LeaseState, now: datetime) -> SafeString:
    """Return, in neutral words, what a waiter behind a holder whose lease was not renewed
    waits for (a normal recovery, not a fault, D4): "waiting for the holder's lease to expire
    at T", or, once it has, that the tick recovers the holder."""
    at = format_html('<time datetime="{}">{}</time>', lease.expires_at.isoformat(), clock(lease.expires_at))
    if lease.expires_at > now:
        words = format_html("{} {}", _("waiting for the holder's lease to expire at"), at)
    else:
        words = format_html("{} {}{}", _("the holder's lease expired at"), at, _("; the tick recovers it"))
    return format_html(
        '<span class="ds-recovery" title="{}">{}</span>',
        _("its holder's lease %(words)s") % {"words": lease_words(lease, at=clock)},
        words,
    )


def activity(
    run: Any,
    steps_done: int | None,
    last_step: str | None,
    now: datetime,
    settings: Settings | None = None,
    recovery: LeaseState | None = None,
) -> SafeString | str:
    """Return what an active run is doing: the step a running body is in, that its
    lease was not renewed (K3), or why it is parked.

    ``steps_done``: how many steps it has finished (their results are stored,
    R4); ``last_step``: the name of the last one. A running body is inside
    step ``steps_done + 1`` (or between steps); its name is known once stored.
    ``now`` is the database's clock (:func:`db_now`), on which leases are
    judged (R5); ``settings`` default to the default engine's. ``recovery``: the
    unrenewed lease of the holder a waiter waits on (:func:`recovery_of`), said
    instead of a past next try.
    """
    done = steps_done or 0
    if run.status == RunStatus.RUNNING:
        lease = unrenewed_lease(run, now, settings)
        if lease is not None:
            # The cell shows the brief words (at most two lines, issue #19 item 4);
            # its title the whole (K3).
            return format_html(
                '<span class="ds-warn ds-unrenewed" title="{}">{}</span>',
                _("lease %(words)s") % {"words": lease_words(lease, at=clock)},
                _("lease %(words)s") % {"words": lease_words(lease, at=clock, brief=True)},
            )
        if done == 0:
            return _("running, before its first step finished")
        # The step's name may wrap at its separators (a holder's row stays two lines high, issue #19).
        done_text = SafeString(
            conditional_escape(_("%(count)s done, last: %(name)s"))
            % {"count": done, "name": format_html('<span class="ds-step-name">{}</span>', breakable(last_step))}
        )
        return format_html("{} <strong>{}</strong> ({})", _("running step"), done + 1, done_text)
    reason = run.park_reason or ""
    if ParkReason.SLEEP.matches(reason):
        return format_html("{} {}", _("sleeping until"), time_html(run.wake_at, short=True))
    if ParkReason.SIGNAL.matches(reason):
        return _("waiting for signal %(name)s") % {"name": ParkReason.SIGNAL.detail(reason)}
    if ParkReason.CHILD.matches(reason):
        return _("waiting for child run %(run)s") % {"run": ParkReason.CHILD.detail(reason)}
    if run.status == RunStatus.BLOCKED:
        return _("blocked: %(reason)s") % {"reason": reason}
    if ParkReason.THROTTLED.matches(reason) and run.not_before is not None and run.not_before > now:
        # Over a throttle's rate: not due until its window opens, then the tick sends its turn (X6d).
        return format_html(
            "{} {}",
            _("throttled by %(name)s: next admission at") % {"name": ParkReason.THROTTLED.detail(reason)},
            time_html(run.not_before, short=True),
        )
    if run.singleton_slot == SlotState.WAITER and run.quota_slot == SlotState.WAITER:
        # In line for its key and its quotas (X3d): a quota's handoff sends its turn (X3h).
        return _("in line for a slot of its key and of its quotas; next try %(when)s") % {
            "when": relative(run.wake_at, now) or "—"
        }
    if run.singleton_slot == SlotState.WAITER:
        # In line for its key: a far wake is only the fallback (S8a), a past one is overdue.
        if is_backlog_wake(run, now):
            return _("in line for a slot; admitted when one frees (fallback try %(when)s)") % {
                "when": relative(run.wake_at, now)
            }
        if run.wake_at is not None and run.wake_at <= now:
            if recovery is not None:
                # A normal recovery (D4): the slot frees at the holder's lease expiry, not a fault.
                return format_html("{}; {}", _("in line for a slot"), recovery_html(recovery, now))
            return format_html(
                "{} {}", _("in line for a slot; next try overdue since"), time_html(run.wake_at, short=True)
            )
        return _("in line for a slot; next try %(when)s") % {"when": relative(run.wake_at, now) or "—"}
    if run.status in (RunStatus.PENDING, RunStatus.SUSPENDED):
        if run.wake_at is not None and run.wake_at <= now:
            return format_html("{} {}", _("parked, next turn overdue since"), time_html(run.wake_at, short=True))
        return _("parked, next turn %(when)s") % {"when": relative(run.wake_at, now) or "—"}
    return "—"
