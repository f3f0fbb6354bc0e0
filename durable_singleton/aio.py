"""Async twins of the engine's calls, for async views and consumers.

:func:`async_twin` makes the ``a``-method of a synchronous method: it runs
the method through asgiref's ``sync_to_async(thread_sensitive=True)``, as
Django's own async ORM methods and ``django.tasks``' ``aenqueue`` do: the
database work happens on a worker thread, never on the event loop, and under
Django's ASGI handler each request gets its own such thread, so concurrent
requests do not wait for one another. A twin takes exactly its method's
arguments (it is built from it) and follows its rules (S3, R3, S15, D2, D6);
:class:`~durable_singleton.engine.Engine` has ``astart``, ``aget``,
``asignal`` and ``acancel``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate

from asgiref.sync import sync_to_async

__all__ = ["async_twin"]


def async_twin[S, **P, R](
    method: Callable[Concatenate[S, P], R],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """Return the async twin of ``method`` (a function defined on a class), to be
    set on the class as ``a<name>``: same parameters, same exceptions, run off
    the event loop on Django's thread-sensitive executor."""

    @functools.wraps(method)
    async def twin(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await sync_to_async(method, thread_sensitive=True)(self, *args, **kwargs)

    twin.__name__ = twin.__qualname__ = f"a{method.__name__}"
    twin.__doc__ = (
        f"Async twin of :meth:`{method.__name__}`: the same arguments, run off the event loop (thread-sensitive).\n\n"
        + (method.__doc__ or "")
    )
    return twin
