"""Codecs for payloads at rest (S13): encryption, compression, and a chain.

A codec turns a JSON value into an *envelope*, itself a JSON object that a
JSON column stores as it stores any value, and back::

    {"$ds_codec": "zlib+fernet", "data": "<base64 of the transformed JSON bytes>"}

A value that is not an envelope decodes to itself, so rows written before a
codec was configured stay readable (and ``manage.py durable_reencode``
rewrites them). A value encoded by a codec other than the one decoding it,
or by a key the codec does not hold, raises :class:`PayloadDecodeError`,
never garbage.

Codecs: :class:`FernetCodec` (cryptography's Fernet; several keys make a
MultiFernet: the first encrypts, every key decrypts, and keys that only
decrypt can be deployed first, so keys rotate in a rolling deploy),
:class:`ZlibCodec`, and :class:`ChainCodec` (for example compress, then
encrypt).
"""

from __future__ import annotations

import base64
import json
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from .exceptions import ConfigurationError, DurableSingletonError

__all__ = [
    "ENVELOPE_KEY",
    "ChainCodec",
    "Codec",
    "FernetCodec",
    "PayloadDecodeError",
    "ZlibCodec",
    "is_envelope",
]

#: The key that marks an encoded value.
ENVELOPE_KEY = "$ds_codec"


class PayloadDecodeError(DurableSingletonError):
    """A stored payload cannot be decoded: encoded by another codec, or with a
    key this process does not hold (S13). Nothing is returned in its place."""


def is_envelope(value: Any) -> bool:
    """Tell whether ``value`` is an encoded payload (an envelope)."""
    return isinstance(value, dict) and set(value) == {ENVELOPE_KEY, "data"} and isinstance(value[ENVELOPE_KEY], str)


class Codec(ABC):
    """Transforms the JSON bytes of a payload; subclasses implement the two byte methods.

    ``name`` identifies the transformation in every envelope it writes.
    """

    name: str = ""

    @abstractmethod
    def encode_bytes(self, data: bytes) -> bytes:
        """Return the transformed bytes."""

    @abstractmethod
    def decode_bytes(self, data: bytes) -> bytes:
        """Return the original bytes; raise :class:`PayloadDecodeError` if they cannot be recovered."""

    def encode(self, value: Any) -> Any:
        """Return the envelope of JSON ``value`` (None stays None, so "no output" stays visible)."""
        if value is None:
            return None
        raw = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        return {ENVELOPE_KEY: self.name, "data": base64.b64encode(self.encode_bytes(raw)).decode("ascii")}

    def decode(self, value: Any) -> Any:
        """Return the JSON value an envelope holds; a value that is not an envelope as it is.

        Raises :class:`PayloadDecodeError` for an envelope of another codec or a wrong key.
        """
        if not is_envelope(value):
            return value
        if value[ENVELOPE_KEY] != self.name:
            raise PayloadDecodeError(
                f"payload encoded with codec {value[ENVELOPE_KEY]!r}, this store decodes {self.name!r}"
            )
        try:
            raw = base64.b64decode(value["data"], validate=True)
        except (ValueError, TypeError) as exc:
            raise PayloadDecodeError(f"payload of codec {self.name!r} is not base64: {exc}") from None
        plain = self.decode_bytes(raw)
        try:
            return json.loads(plain)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PayloadDecodeError(f"payload of codec {self.name!r} is not JSON once decoded: {exc}") from None

    def reencode(self, value: Any) -> tuple[Any, bool]:
        """Return (``value`` encoded with this codec's current keys, whether that changed it).

        A plaintext value is encoded; an envelope is decoded (with any key) and
        encoded again (with the first key). Raises :class:`PayloadDecodeError`.
        """
        encoded = self.encode(self.decode(value))
        return encoded, encoded != value


class ZlibCodec(Codec):
    """Compress payloads with zlib at ``level`` (0-9, default 6)."""

    name = "zlib"

    def __init__(self, level: int = 6) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 9:
            raise ConfigurationError(f"ZlibCodec level must be an int from 0 to 9, got {level!r}")
        self.level = level

    def encode_bytes(self, data: bytes) -> bytes:
        return zlib.compress(data, self.level)

    def decode_bytes(self, data: bytes) -> bytes:
        try:
            return zlib.decompress(data)
        except zlib.error as exc:
            raise PayloadDecodeError(f"payload is not zlib data: {exc}") from None


class FernetCodec(Codec):
    """Encrypt payloads with Fernet (AES-128-CBC and HMAC-SHA256, from cryptography).

    ``keys``: one or more url-safe base64 Fernet keys (``Fernet.generate_key()``),
    newest first. New payloads are encrypted with the first; every key
    decrypts. ``decode_only``: more keys that decrypt and never encrypt.

    A key is rotated in a rolling deploy in this order (docs/codec.rst), so
    that every process decrypts with the new key before any encrypts with it
    (S13): deploy ``FernetCodec(old, decode_only=[new])`` everywhere; then
    ``FernetCodec(new, decode_only=[old])``; re-encode the stored rows
    (``manage.py durable_reencode``); then ``FernetCodec(new)``.

    Needs the ``encryption`` extra (``pip install durable-singleton[encryption]``,
    which installs cryptography). Raises :class:`ConfigurationError` for no
    key or a malformed key (in either argument).
    """

    name = "fernet"

    def __init__(
        self, keys: str | bytes | Sequence[str | bytes], *, decode_only: str | bytes | Sequence[str | bytes] = ()
    ) -> None:
        from cryptography.fernet import Fernet, MultiFernet

        if isinstance(keys, str | bytes):
            keys = [keys]
        if isinstance(decode_only, str | bytes):
            decode_only = [decode_only]
        if not keys:
            raise ConfigurationError("FernetCodec needs at least one key to encrypt with")
        fernets = []
        for what, group in (("key", keys), ("decode_only key", decode_only)):
            for n, key in enumerate(group):
                try:
                    fernets.append(Fernet(key))
                except (ValueError, TypeError) as exc:
                    raise ConfigurationError(f"FernetCodec {what} #{n} is not a Fernet key: {exc}") from None
        # MultiFernet encrypts with its first key and decrypts with any.
        self._fernet = MultiFernet(fernets)

    def encode_bytes(self, data: bytes) -> bytes:
        return self._fernet.encrypt(data)

    def decode_bytes(self, data: bytes) -> bytes:
        from cryptography.fernet import InvalidToken

        try:
            return self._fernet.decrypt(data)
        except InvalidToken:
            raise PayloadDecodeError(
                "payload cannot be decrypted with the configured keys (wrong key, or tampered)"
            ) from None


class ChainCodec(Codec):
    """Apply ``codecs`` in order when encoding (e.g. ``ZlibCodec(), FernetCodec(keys)``:
    compress, then encrypt), in reverse when decoding. Its name joins theirs with ``+``."""

    def __init__(self, *codecs: Codec) -> None:
        if not codecs or not all(isinstance(c, Codec) for c in codecs):
            raise ConfigurationError("ChainCodec takes one or more Codec instances")
        self.codecs = codecs
        self.name = "+".join(c.name for c in codecs)

    def encode_bytes(self, data: bytes) -> bytes:
        for codec in self.codecs:
            data = codec.encode_bytes(data)
        return data

    def decode_bytes(self, data: bytes) -> bytes:
        for codec in reversed(self.codecs):
            data = codec.decode_bytes(data)
        return data
