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


@register.simple_tag(takes_context=True)
def durable_key_controls(context: template.Context, workflow: str, key: str) -> dict[str, object] | None:
    """Return a key's controls (K2), its recorded changes and whether the user may change them."""
    engine = get_engine()
    try:
        state = engine.key_controls(workflow, key)
    except DurableSingletonError:
        return None
    request = context.get("request")
    user = getattr(request, "user", None)
    return {
        "state": state,
        "history": engine.control_history(workflow, key, limit=20),
        "can_change": bool(user is not None and user.has_perm("durable_singleton.change_run")),
    }
