"""Codec stores the tests name in ``DURABLE_SINGLETON["STORE"]`` (a dotted path
builds its store with no arguments): the keys come from ``KEYS``, newest first,
or, in a process of its own, from its environment."""

from __future__ import annotations

import os

from durable_singleton.codecs import ChainCodec, FernetCodec, ZlibCodec
from durable_singleton.stores.codec import CodecStore
from durable_singleton.stores.django import DjangoStore

#: Fernet keys, newest first; a test sets them before it builds the engine.
KEYS: list[bytes] = []


class EncryptedDjangoStore(CodecStore):
    """The Django store with payloads compressed, then encrypted with ``KEYS``."""

    def __init__(self) -> None:
        super().__init__(DjangoStore(), ChainCodec(ZlibCodec(), FernetCodec(list(KEYS))))


class EnvKeysStore(CodecStore):
    """The Django store with payloads compressed, then encrypted with the key in
    ``DS_PAYLOAD_KEY``, also decrypting with the comma-separated keys in
    ``DS_PAYLOAD_DECODE_KEYS`` (the settings of one process of a rolling deploy)."""

    def __init__(self) -> None:
        decode_only = [k for k in os.environ.get("DS_PAYLOAD_DECODE_KEYS", "").split(",") if k]
        fernet = FernetCodec(os.environ["DS_PAYLOAD_KEY"], decode_only=decode_only)
        super().__init__(DjangoStore(), ChainCodec(ZlibCodec(), fernet))
