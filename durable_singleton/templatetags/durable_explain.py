"""``{% durable_explain run_id as explanation %}``: a run's explanation (K3) for the admin's templates."""

from __future__ import annotations

from django import template

from ..exceptions import DurableSingletonError
from ..explain import Explanation
from ..runtime import get_engine

register = template.Library()


@register.simple_tag
def durable_explain(run_id: str | None) -> Explanation | None:
    """Return the default engine's explanation of ``run_id``, or None if there is no such run."""
    if not run_id:
        return None
    try:
        return get_engine().explain(str(run_id))
    except DurableSingletonError:
        return None
