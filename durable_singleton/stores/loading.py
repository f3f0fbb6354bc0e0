"""What ``DURABLE_SINGLETON["STORE"]`` names: the one place that resolves it.

The composition root (:func:`durable_singleton.runtime.build_store`) builds
the class found here, and system check E002 reports what it refuses, so a
setting that passes ``manage.py check`` is one the runtime builds (#16).
"""

from __future__ import annotations

import inspect

from django.utils.module_loading import import_string

from ..exceptions import ConfigurationError
from .base import BaseStore

__all__ = ["STORE_ALIASES", "store_class"]

#: The short names ``STORE`` accepts beside a dotted path, and the class each names.
STORE_ALIASES = {
    "django": "durable_singleton.stores.django.DjangoStore",
    "memory": "durable_singleton.stores.memory.MemoryStore",
}


def store_class(name: str) -> type[BaseStore]:
    """Return the store class ``name`` names: "django", "memory" or a dotted path
    to a concrete :class:`~durable_singleton.stores.base.BaseStore` subclass.

    Raises :class:`~durable_singleton.exceptions.ConfigurationError` naming the
    setting and what is wrong: not importable, not a ``BaseStore`` subclass, or
    abstract (it leaves an abstract method unimplemented).
    """
    path = STORE_ALIASES.get(name, name)
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ConfigurationError(
            f"DURABLE_SINGLETON['STORE'] must be 'django', 'memory' or a dotted path to a store class, "
            f"got {name!r}: {exc}"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, BaseStore)):
        raise ConfigurationError(f"DURABLE_SINGLETON['STORE'] = {name!r} is not a BaseStore subclass")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigurationError(f"DURABLE_SINGLETON['STORE'] = {name!r} is abstract: it does not implement {missing}")
    return cls
