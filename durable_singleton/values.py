"""Checks of the values callers hand the engine: JSON values, text, numbers
and the ids derived from other ids.

Every store refuses the same values because every value passes these checks
first (section 7): a JSON value reads back equal, nests at most
:data:`MAX_JSON_DEPTH` levels and holds no NUL; text holds no NUL, control
character or lone surrogate and fits its column; a number is finite and in
its range (each database has its own largest integer, and ``timedelta``
refuses huge or infinite seconds). A call, a command option or a query
string that fails one raises a typed error from
:mod:`durable_singleton.exceptions` before anything is written. A boundary
that finds no check it needs here adds it here.
"""

from __future__ import annotations

import hashlib
import json
import math
import unicodedata
from typing import Any

from .exceptions import InvalidInputError, InvalidInputTypeError, ValidationError

__all__ = [
    "ID_MAX_LENGTH",
    "MAX_INT",
    "MAX_JSON_DEPTH",
    "MAX_LIMIT",
    "MAX_SECONDS",
    "check_int",
    "check_seconds",
    "check_text",
    "derived_id",
    "is_text",
    "printable",
    "to_json_value",
]


#: Characters of a run id, a namespace, a signal name and every other
#: identifier column (191: a utf8mb4 index on MySQL/MariaDB).
ID_MAX_LENGTH = 191

#: The largest limit (a declared limit or a runtime override) every database
#: stores: PostgreSQL's ``integer``, the column of ``limit_override``.
MAX_LIMIT = 2**31 - 1

#: The largest count a command or a query string may ask for (rows, runs,
#: pages): far beyond any real listing, far below every database's LIMIT and
#: OFFSET range (PostgreSQL's bigint, SQLite's 64-bit integer).
MAX_INT = 10**9

#: The largest number of seconds accepted as an age, a period or a wait:
#: 100 years, within ``timedelta``'s range and ``threading``'s wait.
MAX_SECONDS = 100 * 366 * 86400.0

#: Deepest nesting of lists and objects accepted in a JSON value, counting the
#: outermost: within MariaDB's limit for a JSON column (32, counting a leaf),
#: so every store accepts the same values.
MAX_JSON_DEPTH = 30


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Tell whether ``value`` nests lists/dicts deeper than ``limit`` (iteratively, no recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list | tuple):
            if depth > limit:
                return True
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return False


def to_json_value(value: Any, what: str, *, max_bytes: int | None = None, setting: str = "MAX_RESULT_BYTES") -> Any:
    """Return ``value`` as it reads back from JSON; raise :class:`InvalidInputError`.

    Refused too: NUL characters and lone surrogates, which some databases
    cannot store (PostgreSQL), nesting deeper than :data:`MAX_JSON_DEPTH`
    (MySQL/MariaDB's limit; deeper values also break Python's JSON encoder),
    and, with ``max_bytes``, an encoding (UTF-8) longer than that (the
    ``setting`` named in the message), so every store behaves the same (section 7).
    """
    if _depth_exceeds(value, MAX_JSON_DEPTH):
        raise InvalidInputError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        size = len(text.encode("utf-8"))
    except TypeError as exc:
        raise InvalidInputTypeError(f"{what} is not JSON-serializable: {exc}") from exc
    except ValueError as exc:
        raise InvalidInputError(f"{what} is not JSON-serializable: {exc}") from exc
    if max_bytes is not None and size > max_bytes:
        raise InvalidInputError(f"{what} is {size} bytes encoded; at most {setting} = {max_bytes} are allowed")
    if "\x00" in text or "\\u0000" in text:
        raise InvalidInputError(f"{what} contains a NUL character, which databases cannot store")
    return json.loads(text)


def printable(text: str) -> str:
    """Return ``text`` safe to store: NULs and lone surrogates escaped."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def check_text(
    value: object, what: str, max_length: int = ID_MAX_LENGTH, *, empty: bool = False, allow: str = ""
) -> str:
    """Return ``value`` if it is a str every database stores as it is; raise :class:`ValidationError`.

    It must have at most ``max_length`` characters, a non-space one unless
    ``empty``, no control character (NUL included) but those in ``allow``
    (``"\\t\\n"`` for free text), and no lone surrogate (R1, section 7).
    """
    if not isinstance(value, str) or (not empty and not value.strip()) or len(value) > max_length:
        raise ValidationError(
            f"{what} must be a str of at most {max_length} characters"
            f"{'' if empty else ' with a non-space character'}, got {value!r:.80}"
        )
    if any(unicodedata.category(c) == "Cc" and c not in allow for c in value):
        raise ValidationError(f"{what} contains a control character (NUL included)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{what} is not valid text: {exc}") from exc
    return value


def is_text(value: object, max_length: int = ID_MAX_LENGTH) -> bool:
    """Tell whether :func:`check_text` accepts ``value`` (empty allowed): for a
    filter that ignores what no column can hold instead of raising."""
    try:
        check_text(value, "value", max_length, empty=True)
    except ValidationError:
        return False
    return True


def check_int(value: object, what: str, *, low: int = 0, high: int = MAX_INT) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]``; raise :class:`ValidationError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationError(f"{what} must be a whole number from {low} to {high}, got {value!r:.80}")
    return value


def check_seconds(
    value: object, what: str, *, low: float = 0.0, high: float = MAX_SECONDS, strict: bool = False
) -> float:
    """Return ``value`` as float seconds if it is a finite number in range; raise :class:`ValidationError`.

    The range is ``[low, high]``, or ``(low, high]`` with ``strict``: no NaN,
    no infinity, no bool (section 7).
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (low < value if strict else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bound = f"{'>' if strict else '>='} {low:g} and <= {high:g}"
        raise ValidationError(f"{what} must be a finite number of seconds {bound}, got {value!r:.80}")
    return float(value)  # type: ignore[arg-type]


def derived_id(text: str, max_length: int = ID_MAX_LENGTH) -> str:
    """Return the id ``text`` names, made to fit ``max_length`` characters.

    An id built from another (a child's ``<parent>:child:<n>``, an event's
    ``event:<id>:<workflow>``) can pass the column although each part fits.
    ``text`` that fits is returned as it is; longer text keeps its start and
    ends with ``~`` and 24 hex digits of its SHA-256, so the same parts always
    derive the same id (R3, D7, D8) and different ones practically never
    the same.
    """
    if len(text) <= max_length:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return f"{text[: max_length - len(digest) - 1]}~{digest}"
