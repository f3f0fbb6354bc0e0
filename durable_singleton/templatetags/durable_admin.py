"""``{{ name|breakable }}``: a long name that wraps at its separators, for the admin's templates."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString

from ..admin.display import breakable as _breakable

register = template.Library()


@register.filter
def breakable(value: Any) -> SafeString:
    """Return ``value`` escaped, breakable after ``. : / _ - @ , =`` (see :func:`..admin.display.breakable`)."""
    return _breakable(value)
