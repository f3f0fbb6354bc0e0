"""``manage.py durable_queues``: the admin's queue table in the terminal, or as JSON."""

from __future__ import annotations

import io
import json
import shutil
from argparse import ArgumentParser
from datetime import UTC
from typing import Any, Literal

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.translation import ngettext

from ... import queues
from ...admission import KEY_MAX_LENGTH
from ._options import count_option, text_option


class Command(BaseCommand):
    help = (
        "Print every workflow and key with active runs: limit, holders, waiting, the oldest waiter's age, "
        "the cap (limit + max_queue_depth: the active runs at which starts are refused) and how full it is "
        "(the admin's queue page); with --runs, the run ids of each key's holders and waiters. Below it, "
        "the shared quotas' keys with active members (X3j), as the workflow quota:<name>, and the throttle "
        "keys with waiters (X6), as the workflow throttle:<name>: admissions in the current window, waiters, "
        "how many are over the rate and the next admission."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--workflow", help="Only this workflow (exact name).")
        parser.add_argument("--key", dest="key_contains", help="Only keys containing this text.")
        parser.add_argument(
            "--only",
            choices=[name for name in queues.FILTERS if name],
            default="",
            help="waiting: keys with waiters; full: keys at their cap; stalled: waiters and a free slot.",
        )
        parser.add_argument(
            "--sort",
            default="-waiting",
            help=f"One of {', '.join(queues.SORTS)}; prefix - for descending (default: -waiting).",
        )
        parser.add_argument("--limit", type=int, default=50, help="Rows to print (default 50; 0: all).")
        parser.add_argument(
            "--runs",
            action="store_true",
            help="Also list each key's holders and its first --runs-per-key waiters by run id, in admission order.",
        )
        parser.add_argument(
            "--runs-per-key", type=int, default=20, help="With --runs: ids listed per key and kind (default 20)."
        )
        parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
        parser.add_argument("--database", default=None, help="Database alias (default: the router's choice).")

    def handle(self, *args: Any, **options: Any) -> None:
        # Bounded before any query (section 7): NUL or a huge --limit were database errors.
        count_option(options["limit"], "--limit", low=0)
        count_option(options["runs_per_key"], "--runs-per-key")
        workflow = text_option(options["workflow"], "--workflow")
        key_contains = text_option(options["key_contains"], "--key", KEY_MAX_LENGTH)
        try:
            page = queues.queue_table(
                workflow=workflow,
                key_contains=key_contains,
                only=options["only"],
                sort=options["sort"],
                limit=options["limit"] or None,
                using=options["database"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        now = timezone.now()
        quota_rows = [
            q
            for q in queues.quota_table(limit=options["limit"] or _ALL, using=options["database"])
            if (workflow is None or workflow == q.workflow)
            and (key_contains is None or key_contains in q.key)
            and _quota_kept(q, options["only"])
        ]
        throttle_rows = [
            t
            for t in queues.throttle_table(limit=options["limit"] or _ALL, using=options["database"])
            if (workflow is None or workflow == t.workflow)
            and (key_contains is None or key_contains in t.key)
            and _throttle_kept(t, options["only"])
        ]
        members = (
            queues.queue_members(page.rows, per_key=options["runs_per_key"], using=options["database"])
            if options["runs"]
            else None
        )
        if options["json"]:
            rows = []
            for row in page.rows:
                entry = row.as_dict(now)
                if members is not None:
                    entry["holder_ids"] = members[row.workflow, row.key].holders
                    entry["waiter_ids"] = members[row.workflow, row.key].waiters
                rows.append(entry)
            document = {
                "as_of": now.isoformat(),
                "keys": page.keys,
                "holders": page.holders,
                "waiting": page.waiting,
                "rows": rows,
                "quotas": [_quota_dict(q, now) for q in quota_rows],
                "throttles": [t.as_dict() for t in throttle_rows],
            }
            self.stdout.write(json.dumps(document, indent=2))
            return
        # Drawn with rich only on a terminal; piped or redirected, plain columns that
        # keep every name whole on its line (grep, a log, a pager).
        drawn = self.stdout.isatty()
        self.stdout.write(self._table(page, now, drawn), ending="")
        if members is not None:
            self.stdout.write(_member_lines(page, members), ending="")
        if quota_rows:
            self.stdout.write(_quota_table(quota_rows, now, drawn), ending="")
        if throttle_rows:
            self.stdout.write(_throttle_table(throttle_rows, drawn), ending="")

    def _table(self, page: queues.QueuePage, now: Any, drawn: bool) -> str:
        """Render the page as a text table (:func:`_render`)."""
        title = ngettext(
            "%(keys)d key with active runs, %(holders)d holding, %(waiting)d waiting",
            "%(keys)d keys with active runs, %(holders)d holding, %(waiting)d waiting",
            page.keys,
        ) % {"keys": page.keys, "holders": page.holders, "waiting": page.waiting}
        caption = f"as of {now:%Y-%m-%d %H:%M:%S %Z}" + (
            f"; first {len(page.rows)} rows" if len(page.rows) < page.keys else ""
        )
        header = ["workflow", "key", "limit", "holders", "waiting", "oldest waiter", "cap", "full"]
        rows = []
        for row in page.rows:
            fullness = row.fullness
            rows.append(
                [
                    row.workflow,
                    row.key,
                    str(row.limit),
                    str(row.holders),
                    str(row.waiting),
                    queues.format_age(row.oldest_wait_seconds(now)),
                    "—" if row.capacity is None else str(row.capacity),
                    "—" if fullness is None else f"{row.active}/{row.capacity} ({fullness:.0%})",
                ]
            )
        return _render(title, caption, header, rows, drawn)


#: ``--limit 0``: every row.
_ALL = 10**9


def _quota_kept(row: queues.QuotaRow, only: str) -> bool:
    """Apply ``--only`` to a quota key as to a singleton key: waiting, full (at its cap), stalled."""
    if only == "waiting":
        return row.waiting > 0
    if only == "full":
        return row.capacity is not None and row.active >= row.capacity
    if only == "stalled":
        return row.waiting > 0 and row.free_slots > 0
    return True


def _throttle_kept(row: queues.ThrottleRow, only: str) -> bool:
    """Apply ``--only`` to a throttle key (X6): waiting (every listed key has waiters), full (its
    window holds its limit's admissions), stalled (room in the window and a waiter not over the rate)."""
    if only == "full":
        return row.admitted >= row.limit
    if only == "stalled":
        return row.free_admissions > 0 and row.waiting > row.throttled
    return True


def _throttle_table(rows: list[queues.ThrottleRow], drawn: bool) -> str:
    """Render the throttle keys with waiters (X6, K3): the rate, its use in the current window,
    the waiters, how many are over the rate, and the next admission (the database's clock)."""
    title = ngettext("%(keys)d throttle key with waiters", "%(keys)d throttle keys with waiters", len(rows)) % {
        "keys": len(rows)
    }
    header = ["workflow", "key", "rate", "in window", "waiting", "throttled", "next admission", "oldest waiter"]
    cells = [
        [
            row.workflow,
            row.key,
            f"{row.limit} per {queues.format_age(row.period)}" + (" (paused)" if row.paused else ""),
            f"{row.admitted}/{row.limit}",
            str(row.waiting),
            str(row.throttled),
            "—" if row.next_admission_at is None else f"{row.next_admission_at.astimezone(UTC):%H:%M:%S} UTC",
            queues.format_age(
                None if row.oldest_waiter_at is None else (row.as_of - row.oldest_waiter_at).total_seconds()
            ),
        ]
        for row in rows
    ]
    return _render(title, "most waiters first", header, cells, drawn)


def _quota_dict(row: queues.QuotaRow, now: Any) -> dict[str, Any]:
    """A quota key's row as JSON: its fields and the cap (S15, X3j)."""
    return {
        "workflow": row.workflow,
        "quota": row.quota,
        "key": row.key,
        "limit": row.limit,
        "holders": row.holders,
        "waiting": row.waiting,
        "oldest_waiter_at": None if row.oldest_waiter_at is None else row.oldest_waiter_at.isoformat(),
        "oldest_wait_seconds": None
        if row.oldest_waiter_at is None
        else round((now - row.oldest_waiter_at).total_seconds(), 3),
        "capacity": row.capacity,
        "paused": row.paused,
        "limit_override": row.limit_override,
    }


def _quota_table(rows: list[queues.QuotaRow], now: Any, drawn: bool) -> str:
    """Render the shared quotas' keys (X3j) as the singleton keys' table is rendered."""
    title = ngettext("%(keys)d quota key with active members", "%(keys)d quota keys with active members", len(rows)) % {
        "keys": len(rows)
    }
    header = ["workflow", "key", "limit", "holders", "waiting", "oldest waiter", "cap", "full"]
    cells = [
        [
            row.workflow,
            row.key,
            str(row.limit),
            str(row.holders),
            str(row.waiting),
            queues.format_age(None if row.oldest_waiter_at is None else (now - row.oldest_waiter_at).total_seconds()),
            "—" if row.capacity is None else str(row.capacity),
            "—" if row.fullness is None else f"{row.active}/{row.capacity} ({row.fullness:.0%})",
        ]
        for row in rows
    ]
    return _render(title, "most waiters first", header, cells, drawn)


def _render(title: str, caption: str, header: list[str], rows: list[list[str]], drawn: bool) -> str:
    """Render a table: ``drawn`` (the output is a terminal) and with rich installed
    (``durable-singleton[rich]``), a rich table as wide as the terminal whose cells
    fold onto more lines rather than lose a character; else plain aligned columns,
    each row on one line, every value whole."""
    if not drawn:
        return _plain_table(title, caption, header, rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return _plain_table(title, caption, header, rows)
    table = Table(title=title, caption=caption)
    for name in header:
        table.add_column(name, overflow="fold", justify=_justify(name))
    for cells in rows:
        table.add_row(*cells)
    buffer = io.StringIO()
    width = shutil.get_terminal_size((120, 24)).columns
    Console(file=buffer, width=max(width, 80), color_system=None, highlight=False).print(table)
    return buffer.getvalue()


def _member_lines(page: queues.QueuePage, members: dict[tuple[str, str], queues.KeyMembers]) -> str:
    """Return each row's holders and waiters by run id, one key a paragraph; waiters in admission order."""

    def ids(listed: list[str], total: int) -> str:
        more = total - len(listed)
        return (" ".join(listed) or "—") + (f" (and {more} more)" if more > 0 else "")

    lines = []
    for row in page.rows:
        found = members[row.workflow, row.key]
        lines += [
            f"{row.workflow}  {row.key}",
            f"  holding ({row.holders}): {ids(found.holders, row.holders)}",
            f"  waiting ({row.waiting}): {ids(found.waiters, row.waiting)}",
        ]
    return "\n".join(lines) + "\n" if lines else ""


def _justify(column: str) -> Literal["left", "right"]:
    """Text columns align left, figures right."""
    return "left" if column in ("workflow", "key") else "right"


def _plain_table(title: str, caption: str, header: list[str], rows: list[list[str]]) -> str:
    """Return ``title``, the aligned columns and ``caption`` as plain text lines."""
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = (
            cell.ljust(width) if _justify(name) == "left" else cell.rjust(width)
            for cell, width, name in zip(cells, widths, header, strict=True)
        )
        return "  ".join(padded).rstrip()

    return "\n".join([title, line(header), *(line(cells) for cells in rows), caption, ""])
