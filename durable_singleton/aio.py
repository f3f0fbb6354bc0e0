"""Async twins of the engine's calls, for async views and consumers.

Each ``a``-method runs its synchronous twin through asgiref's
``sync_to_async(thread_sensitive=True)``, as Django's own async ORM methods
and ``django.tasks``' ``aenqueue`` do: the database work happens on a worker
thread, never on the event loop, and under Django's ASGI handler each
request gets its own such thread, so concurrent requests do not wait for one
another. The rules are the synchronous calls' (S3, R3, S15, D2, D6).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from asgiref.sync import sync_to_async

if TYPE_CHECKING:
    from .stores.base import RunRecord

__all__ = ["AsyncEngineMixin"]


class _SyncEngine(Protocol):
    """The synchronous calls the mixin wraps (implemented by :class:`~durable_singleton.engine.Engine`)."""

    def start(
        self,
        name: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        parent_run_id: str | None = None,
        namespace: str | None = None,
    ) -> RunRecord: ...

    def get(self, run_id: str) -> RunRecord: ...

    def signal(self, run_id: str, name: str, payload: Any = None) -> RunRecord: ...

    def cancel(self, run_id: str) -> RunRecord: ...


class AsyncEngineMixin:
    """``astart``, ``aget``, ``asignal`` and ``acancel`` for :class:`~durable_singleton.engine.Engine`."""

    async def astart(
        self: _SyncEngine,
        name: str,
        input: Any = None,
        *,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        parent_run_id: str | None = None,
        namespace: str | None = None,
    ) -> RunRecord:
        """Create a run and dispatch its first turn after commit, off the event loop; see ``Engine.start``.

        ``run_id``: a non-empty str of at most 191 characters, or None for a
        generated one; an existing run with that id is returned (R3).
        Raises what ``start`` raises, each writing nothing:
        :class:`~durable_singleton.exceptions.InvalidRunIdError`,
        :class:`~durable_singleton.exceptions.UnknownWorkflowError`,
        :class:`~durable_singleton.exceptions.InvalidInputError`,
        :class:`~durable_singleton.exceptions.SingletonKeyError`, or
        :class:`~durable_singleton.SingletonQueueFullError` (S15).
        """
        return await sync_to_async(self.start, thread_sensitive=True)(
            name, input, run_id=run_id, tags=tags, version=version, parent_run_id=parent_run_id, namespace=namespace
        )

    async def aget(self: _SyncEngine, run_id: str) -> RunRecord:
        """Return run ``run_id``; raise :class:`~durable_singleton.exceptions.RunNotFoundError` (D10)."""
        return await sync_to_async(self.get, thread_sensitive=True)(run_id)

    async def asignal(self: _SyncEngine, run_id: str, name: str, payload: Any = None) -> RunRecord:
        """Buffer signal ``name`` with a JSON ``payload`` for an active run and wake it if it waits (D2).

        Raises :class:`~durable_singleton.exceptions.RunNotFoundError` for an
        unknown or terminal run and
        :class:`~durable_singleton.exceptions.InvalidInputError` for a
        non-JSON payload.
        """
        return await sync_to_async(self.signal, thread_sensitive=True)(run_id, name, payload)

    async def acancel(self: _SyncEngine, run_id: str) -> RunRecord:
        """Cancel a run (D6) and release its slot (S7); a terminal run is returned unchanged.

        Raises :class:`~durable_singleton.exceptions.RunNotFoundError`.
        """
        return await sync_to_async(self.cancel, thread_sensitive=True)(run_id)
