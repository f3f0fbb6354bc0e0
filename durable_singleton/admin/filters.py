"""List filters of the run list: exact key typed into a box, workflow from the registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from ..definitions import registry
from ..models import Run
from .display import breakable

__all__ = ["SingletonKeyFilter", "WorkflowFilter"]


class SingletonKeyFilter(admin.ListFilter):
    """Filter runs by exact key, typed into a box (a list of 10,000 keys is no filter)."""

    title = _("key")
    parameter_name = "singleton_key"
    template = "admin/durable_singleton/input_filter.html"

    def __init__(self, request: HttpRequest, params: dict[str, Any], model: Any, model_admin: Any) -> None:
        super().__init__(request, params, model, model_admin)
        if self.parameter_name in params:
            self.used_parameters[self.parameter_name] = params.pop(self.parameter_name)[-1]

    def value(self) -> str | None:
        """Return the key typed in, or None."""
        value = self.used_parameters.get(self.parameter_name)
        return str(value) if value else None

    def has_output(self) -> bool:
        return True

    def expected_parameters(self) -> list[str | None]:
        return [self.parameter_name]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        value = self.value()
        return queryset.filter(singleton_key=value) if value else queryset

    def choices(self, changelist: Any) -> Iterator[dict[str, Any]]:
        keep = [
            (name, value)
            for name, values in changelist.filter_params.items()
            if name != self.parameter_name
            for value in values
        ]
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": _("All"),
            "hidden": keep,
            "value": self.value() or "",
        }


class WorkflowFilter(admin.SimpleListFilter):
    """Filter runs by workflow, offering the registered workflows (no scan of the run table)."""

    title = _("workflow")
    parameter_name = "workflow_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        names = set(registry.latest)
        chosen = self.value()
        if chosen:
            names.add(chosen)  # a workflow no longer registered, reached by a link
        return [(name, breakable(name)) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        return queryset.filter(workflow_name=self.value()) if self.value() else queryset
