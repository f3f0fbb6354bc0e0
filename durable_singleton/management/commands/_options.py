"""Argument helpers shared by the operations commands (not a command).

Each option a command passes on to a query or the engine goes through one of
these checks (:mod:`durable_singleton.values`), so a bad value is a
:class:`~django.core.management.CommandError` naming the option, never a
database error or a traceback (section 7).
"""

from __future__ import annotations

import argparse
import math
import re

from django.core.management.base import CommandError

from ...exceptions import ValidationError
from ...values import ID_MAX_LENGTH, MAX_INT, MAX_SECONDS, check_int, check_seconds, check_text

__all__ = ["count_option", "duration", "seconds_option", "text_option"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """Parse an age such as ``90``, ``90s``, ``15m``, ``12h`` or ``7d`` into seconds
    (>= 0, at most :data:`~durable_singleton.values.MAX_SECONDS`, 100 years).

    Raises :class:`argparse.ArgumentTypeError` for anything else.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r:.80} is not an age like 90, 90s, 15m, 12h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r:.80} is longer than 100 years")
    return seconds


def text_option(value: object, flag: str, max_length: int = ID_MAX_LENGTH) -> str | None:
    """Return a text option (None: not given) that a column can hold; raise :class:`CommandError`."""
    if value is None:
        return None
    try:
        return check_text(value, flag, max_length)
    except ValidationError as exc:
        raise CommandError(str(exc)) from None


def count_option(value: object, flag: str, *, low: int = 1, high: int = MAX_INT) -> int:
    """Return a whole-number option in ``[low, high]``; raise :class:`CommandError`."""
    try:
        return check_int(value, flag, low=low, high=high)
    except ValidationError as exc:
        raise CommandError(str(exc)) from None


def seconds_option(
    value: object, flag: str, *, low: float = 0.0, high: float = MAX_SECONDS, strict: bool = False
) -> float:
    """Return a finite number of seconds in range (``strict``: above ``low``); raise :class:`CommandError`."""
    try:
        return check_seconds(value, flag, low=low, high=high, strict=strict)
    except ValidationError as exc:
        raise CommandError(str(exc)) from None
