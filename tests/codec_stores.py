"""Codec stores the tests name in ``DURABLE_SINGLETON["STORE"]`` (a dotted path
builds its store with no arguments): the keys come from ``KEYS``, newest first."""

from __future__ import annotations

from durable_singleton.codecs import ChainCodec, FernetCodec, ZlibCodec
from durable_singleton.stores.codec import CodecStore
from durable_singleton.stores.django import DjangoStore

#: Fernet keys, newest first; a test sets them before it builds the engine.
KEYS: list[bytes] = []


class EncryptedDjangoStore(CodecStore):
    """The Django store with payloads compressed, then encrypted with ``KEYS``."""

    def __init__(self) -> None:
        super().__init__(DjangoStore(), ChainCodec(ZlibCodec(), FernetCodec(list(KEYS))))
