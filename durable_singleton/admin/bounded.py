"""Bounded input at the admin's model pages (section 7): a query string or an
object id that no column can hold never reaches the database.

PostgreSQL refuses NUL in text with a ``DataError`` that Django's change
list and ``get_object`` do not catch (an HTTP 500): the change lists answer
such a query string with a 400 (:func:`.params.check_query`, the check every
admin page of this app makes through :mod:`.params`), and an object id that could not name a row
is "does not exist", as any unknown id is.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse

from ..values import ID_MAX_LENGTH, is_text
from .params import check_query

__all__ = ["StorableInputMixin"]


class StorableInputMixin:
    """For a ``ModelAdmin`` of this app: refuse unstorable query strings and object ids."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        check_query(request)
        return super().changelist_view(request, extra_context)  # type: ignore[misc, no-any-return]

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Any:
        if not is_text(object_id, ID_MAX_LENGTH):
            return None  # no row has that id: the admin's "does not exist"
        return super().get_object(request, object_id, from_field)  # type: ignore[misc]
