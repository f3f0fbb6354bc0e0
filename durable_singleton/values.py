"""Checks of the values callers hand the engine: JSON values and identifiers.

Every store refuses the same values because every value passes these checks
first (section 7): a JSON value reads back equal, nests at most
:data:`MAX_JSON_DEPTH` levels and holds no NUL; an identifier is printable text.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from .exceptions import InvalidInputError, InvalidInputTypeError, ValidationError

__all__ = ["MAX_JSON_DEPTH", "check_text", "printable", "to_json_value"]


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


def check_text(value: object, what: str, max_length: int = 191) -> str:
    """Check an identifier (run id, tag, signal name, namespace); raise :class:`ValidationError`."""
    if not isinstance(value, str) or not value.strip() or len(value) > max_length:
        raise ValidationError(
            f"{what} must be a str of at most {max_length} characters with a non-space character, got {value!r:.80}"
        )
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ValidationError(f"{what} contains a control character (NUL included)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{what} is not valid text: {exc}") from exc
    return value
