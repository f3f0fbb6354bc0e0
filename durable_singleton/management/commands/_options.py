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
from typing import Any

from django.core.management.base import CommandError

from ...exceptions import AmbiguousRunIdError, RunNotFoundError, ValidationError
from ...values import ID_MAX_LENGTH, MAX_INT, MAX_SECONDS, check_int, check_seconds, check_text, is_text

__all__ = ["count_option", "duration", "resolve_run_id", "seconds_option", "text_option"]

#: Run ids listed at most in an ambiguous prefix's error.
CANDIDATES_LISTED = 10

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


def resolve_run_id(engine: Any, text: str) -> str:
    """Return the run id ``text`` names, as git takes a commit: the run whose id it is,
    else the one run whose id begins with it (``69b0836c`` for a 32-character id).

    With ``engine.scope_reads`` only runs of ``engine.namespace`` count (D10).
    Raises :class:`~durable_singleton.exceptions.AmbiguousRunIdError` (a
    :class:`~durable_singleton.exceptions.RunNotFoundError`) listing the first
    :data:`CANDIDATES_LISTED` run ids that begin with ``text`` when there are
    several, and with no candidate when none does. One query for an exact id,
    one more for a prefix.
    """
    from ...models import Run

    try:
        return str(engine.get(text).run_id)
    except RunNotFoundError:
        if not text or not is_text(text):
            raise  # no run id begins with text no column can hold (section 7)
    runs = Run.objects.filter(run_id__startswith=text)
    if engine.scope_reads:
        runs = runs.filter(namespace=engine.namespace)
    found = list(runs.order_by("run_id").values_list("run_id", flat=True)[: CANDIDATES_LISTED + 1])
    if len(found) == 1:
        return str(found[0])
    raise AmbiguousRunIdError(text, found[:CANDIDATES_LISTED], more=len(found) > CANDIDATES_LISTED)
