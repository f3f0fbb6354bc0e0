"""Argument helpers shared by the operations commands (not a command)."""

from __future__ import annotations

import argparse
import re

__all__ = ["duration"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """Parse an age such as ``90``, ``90s``, ``15m``, ``12h`` or ``7d`` into seconds (>= 0).

    Raises :class:`argparse.ArgumentTypeError` for anything else.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 90, 90s, 15m, 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]
