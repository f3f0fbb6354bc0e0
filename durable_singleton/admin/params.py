"""The one way every admin page of this app reads its query string (section 7).

A value that no column can hold (NUL, a control character, overlong text)
never reaches the database: a text parameter that names a row (a workflow, a
key) is refused with :class:`~django.core.exceptions.BadRequest` (an HTTP
400); a number that is not one, not finite or out of range is replaced by the
page's default or clamped to its bounds, as the change list does with a page
number. PostgreSQL refuses NUL in text with a ``DataError`` that no view
catches (an HTTP 500): the pages read their parameters here, not from
``request.GET`` directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from django.core.exceptions import BadRequest
from django.http import HttpRequest

from ..values import ID_MAX_LENGTH, is_text

__all__ = [
    "MAX_PAGE",
    "MAX_REFRESH_SECONDS",
    "QUERY_VALUE_MAX_LENGTH",
    "check_query",
    "choice_param",
    "flag_param",
    "int_param",
    "page_param",
    "refresh_param",
    "text_param",
]

#: The highest page a query string may ask for: far beyond any queue, far below
#: every database's OFFSET range (a huge ``?p=`` was a database error, section 7).
MAX_PAGE = 100_000

#: The longest ``?refresh=`` period, in seconds.
MAX_REFRESH_SECONDS = 3600.0

#: The longest query-string value a change list passes on (a search may be long).
QUERY_VALUE_MAX_LENGTH = 10_000


def check_query(request: HttpRequest, max_length: int = QUERY_VALUE_MAX_LENGTH) -> None:
    """Raise :class:`BadRequest` (a 400) if any name or value of the query string is
    not text a column can hold (NUL, a control character, over ``max_length``)."""
    for name, values in request.GET.lists():
        if not all(is_text(v, max_length) for v in (name, *values)):
            raise BadRequest(f"the query parameter {name[:40]!r} is not text a column can hold")


def text_param(request: HttpRequest, name: str, max_length: int = ID_MAX_LENGTH) -> str:
    """Return query parameter ``name`` ("" when absent); raise :class:`BadRequest` (a 400)
    for text no column can hold: NUL, a control character, over ``max_length`` characters."""
    value = request.GET.get(name, "")
    if not is_text(value, max_length):
        raise BadRequest(f"the {name!r} parameter is not text a durable_singleton column can hold")
    return value


def choice_param(request: HttpRequest, name: str, choices: Iterable[str], default: str) -> str:
    """Return query parameter ``name`` if it is one of ``choices``, else ``default`` (ignored)."""
    value = request.GET.get(name, default)
    return value if value in set(choices) else default


def flag_param(request: HttpRequest, name: str) -> bool:
    """Return whether query parameter ``name`` is set to a non-empty value other than "0"."""
    return request.GET.get(name, "") not in ("", "0")


def int_param(request: HttpRequest, name: str, default: int, low: int, high: int) -> int:
    """Return query parameter ``name`` as a whole number clamped to ``[low, high]``;
    ``default`` when it is absent or not a whole number."""
    raw = request.GET.get(name)
    if raw is None:
        return default
    try:
        value = int(raw[:40])
    except ValueError:
        return default
    return min(max(value, low), high)


def page_param(request: HttpRequest) -> int:
    """Return ``?p=`` clamped to 1..:data:`MAX_PAGE` (1 when it is not a number); a page
    past the last shows the last, as the change list's does."""
    return int_param(request, "p", 1, 1, MAX_PAGE)


def refresh_param(request: HttpRequest, default: float) -> float:
    """Return ``?refresh=`` in seconds (0: never), clamped to 0..:data:`MAX_REFRESH_SECONDS`;
    ``default`` when it is absent, not a number, NaN or infinite."""
    raw = request.GET.get("refresh")
    if raw is None:
        return float(default)
    try:
        seconds = float(raw[:40])
    except ValueError:
        return float(default)
    if not math.isfinite(seconds):
        return float(default)
    return min(max(seconds, 0.0), MAX_REFRESH_SECONDS)
