"""The store conformance suite on the store named by ``--durable-store``.

Run it on a store of your own with no code of your own::

    pytest --pyargs durable_singleton.testing.test_store_conformance --durable-store=myapp.stores.MyStore

``--durable-store`` takes what the ``STORE`` setting takes (``memory``,
``django`` or a dotted path to a :class:`~durable_singleton.stores.base.BaseStore`
subclass); the ``durable_store`` fixture of the pytest plugin builds it.
"""

from __future__ import annotations

import pytest

from ..stores.base import BaseStore
from .conformance import StoreConformance


class TestStore(StoreConformance):
    """Every rule of :class:`StoreConformance` on the configured store."""

    @pytest.fixture
    def store(self, durable_store: BaseStore) -> BaseStore:
        return durable_store
