"""Payload codecs (S13): envelopes, Fernet with rotation, zlib, a chain, typed errors."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_singleton.codecs import ChainCodec, FernetCodec, PayloadDecodeError, ZlibCodec, is_envelope
from durable_singleton.exceptions import ConfigurationError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KEY_OLD, KEY_NEW = Fernet.generate_key(), Fernet.generate_key()

pytestmark = pytest.mark.vendor_agnostic  # pure Python: no store, no database


@settings(max_examples=60, deadline=None)
@given(json_values)
def test_every_codec_round_trips_any_json_value(value: object) -> None:
    """S13: what a codec encodes it decodes to the same JSON value; None stays None."""
    for codec in (ZlibCodec(), FernetCodec(KEY_OLD), ChainCodec(ZlibCodec(9), FernetCodec(KEY_OLD))):
        encoded = codec.encode(value)
        assert (encoded is None) == (value is None)
        assert encoded is None or is_envelope(encoded)
        assert codec.decode(encoded) == value


def test_encrypted_payload_hides_the_value_and_names_the_codec() -> None:
    """S13: at rest the payload is an envelope naming the codec chain; the plaintext is not in it."""
    codec = ChainCodec(ZlibCodec(), FernetCodec(KEY_OLD))
    encoded = codec.encode({"card": "4242 4242 4242 4242"})
    assert encoded["$ds_codec"] == "zlib+fernet" and "4242" not in str(encoded)


def test_rotation_decrypts_with_old_keys_and_encrypts_with_the_first() -> None:
    """S13: with [new, old] keys, payloads written under the old key still decrypt; new
    writes and re-encoded payloads use the new key, so the old key can then be dropped."""
    old = FernetCodec(KEY_OLD)
    rotated = FernetCodec([KEY_NEW, KEY_OLD])
    stored = old.encode({"n": 1})
    assert rotated.decode(stored) == {"n": 1}
    again, changed = rotated.reencode(stored)
    assert changed and FernetCodec(KEY_NEW).decode(again) == {"n": 1}
    with pytest.raises(PayloadDecodeError):
        FernetCodec(KEY_NEW).decode(stored)


def test_decode_only_keys_decrypt_and_never_encrypt() -> None:
    """S13, rolling rotation step 1: ``decode_only`` keys read what the new key
    wrote while the codec still writes with its own key, which a process that
    has not yet received the new key reads; a malformed one is refused."""
    step_1 = FernetCodec(KEY_OLD, decode_only=[KEY_NEW])
    written_by_new = FernetCodec(KEY_NEW).encode({"n": 1})
    assert step_1.decode(written_by_new) == {"n": 1}
    assert FernetCodec(KEY_OLD).decode(step_1.encode({"n": 2})) == {"n": 2}
    with pytest.raises(PayloadDecodeError):
        FernetCodec(KEY_NEW).decode(step_1.encode({"n": 3}))
    assert FernetCodec(KEY_NEW, decode_only=KEY_OLD).decode(step_1.encode({"n": 4})) == {"n": 4}
    with pytest.raises(ConfigurationError, match="decode_only key #0"):
        FernetCodec(KEY_OLD, decode_only=["not a key"])
    with pytest.raises(ConfigurationError, match="at least one key"):
        FernetCodec([], decode_only=[KEY_NEW])


def test_wrong_key_or_wrong_codec_is_a_typed_error_never_garbage() -> None:
    """S13: a payload this codec cannot decode raises PayloadDecodeError."""
    stored = FernetCodec(KEY_OLD).encode([1, 2])
    with pytest.raises(PayloadDecodeError, match="cannot be decrypted"):
        FernetCodec(KEY_NEW).decode(stored)
    with pytest.raises(PayloadDecodeError, match="codec 'fernet'"):
        ZlibCodec().decode(stored)
    with pytest.raises(PayloadDecodeError, match="not zlib"):
        ZlibCodec().decode({"$ds_codec": "zlib", "data": "aGVsbG8="})
    tampered = dict(stored, data=stored["data"][:-8] + "AAAAAAA=")
    with pytest.raises(PayloadDecodeError):
        FernetCodec(KEY_OLD).decode(tampered)


def test_plaintext_written_before_the_codec_reads_as_it_is() -> None:
    """S13: rows written before a codec was configured stay readable; re-encoding encodes them."""
    codec = FernetCodec(KEY_OLD)
    assert codec.decode({"store_id": "A"}) == {"store_id": "A"}
    encoded, changed = codec.reencode({"store_id": "A"})
    assert changed and is_envelope(encoded)


def test_bad_configuration_is_refused() -> None:
    """Section 7: a codec with no key, a malformed key or a bad level raises ConfigurationError."""
    with pytest.raises(ConfigurationError):
        FernetCodec([])
    with pytest.raises(ConfigurationError, match="key #0"):
        FernetCodec("not-a-key")
    with pytest.raises(ConfigurationError):
        ZlibCodec(10)
    with pytest.raises(ConfigurationError):
        ChainCodec()
