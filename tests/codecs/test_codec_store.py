"""The codec store (S13): payloads encoded at rest around the in-memory store
and the Django store on the DATABASE_URL database; keys, statuses and times in
clear; the claim forwarded (no over-admission under racing claims); a wrong key
is a typed error; key rotation with ``manage.py durable_reencode``."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command

from durable_singleton.codecs import ChainCodec, FernetCodec, PayloadDecodeError, ZlibCodec, is_envelope
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.runtime import build_store
from durable_singleton.schedules import Schedule, fire_due_schedules
from durable_singleton.stores.base import BaseStore
from durable_singleton.stores.codec import CodecStore
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from durable_singleton.testing.conformance import StoreConformance
from tests import codec_stores
from tests.conftest import Monitor, run_threads
from tests.helpers import admitted, audited, claim

KEY_A, KEY_B = Fernet.generate_key(), Fernet.generate_key()


def _codec(*keys: bytes) -> ChainCodec:
    return ChainCodec(ZlibCodec(), FernetCodec(list(keys)))


@pytest.fixture
def codec_engine(store_kind: str, registry: Registry) -> Engine:
    from durable_singleton.conf import Settings

    inner = build_store(Settings.from_mapping({"STORE": store_kind, "DISPATCH": "manual"}))
    return make_engine(CodecStore(inner, _codec(KEY_A)), registry=registry)


def _at_rest(engine: Engine, run_id: str) -> dict[str, Any]:
    """Return the stored payload columns of a run, its steps and signals, as stored."""
    inner = engine.store.inner  # type: ignore[attr-defined]
    if getattr(inner, "db", None) is None:
        run = inner._runs[run_id]
        return {
            "input": run.input,
            "output": run.output,
            "steps": [s.result for s in inner._steps.get(run_id, {}).values()],
            "signals": [s.payload for s in inner._signals.get(run_id, [])],
            "key": run.singleton_key,
            "status": run.status,
        }
    from durable_singleton.models import Run, Signal, Step

    row = Run.objects.get(pk=run_id)
    return {
        "input": row.input,
        "output": row.output,
        "steps": list(Step.objects.filter(run_id=run_id).values_list("result", flat=True)),
        "signals": list(Signal.objects.filter(run_id=run_id).values_list("payload", flat=True)),
        "key": row.singleton_key,
        "status": row.status,
    }


def test_payloads_are_encoded_at_rest_and_clear_through_the_engine(codec_engine: Engine, registry: Registry) -> None:
    """S13: input, output, step results and signal payloads are stored as envelopes
    of the codec chain; the engine and the body see the plain values; the key and
    the status stay clear."""
    registry.add_step("secret:step", lambda x: {"echo": x})

    def body(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
        step = ctx.step("secret:step", input["card"])
        payload = ctx.wait_for_signal("go")
        return {"step": step, "signal": payload}

    registry.add("secret", "1", body, singleton={"key": lambda i: f"acct:{i['acct']}"})
    codec_engine.start("secret", {"acct": "7", "card": "4242"}, run_id="S1")
    codec_engine.dispatcher.drain()
    codec_engine.signal("S1", "go", {"pin": "0000"})
    codec_engine.dispatcher.drain()
    run = codec_engine.get("S1")
    assert run.status == "completed" and run.input == {"acct": "7", "card": "4242"}
    assert run.output == {"step": {"echo": "4242"}, "signal": {"pin": "0000"}}
    stored = _at_rest(codec_engine, "S1")
    assert (stored["key"], stored["status"]) == ("acct:7", "completed")
    for value in (stored["input"], stored["output"], *stored["steps"], *stored["signals"]):
        assert is_envelope(value) and value["$ds_codec"] == "zlib+fernet", value
    assert "4242" not in json.dumps(stored) and "0000" not in json.dumps(stored)


def test_wrong_key_is_a_typed_error(codec_engine: Engine, registry: Registry) -> None:
    """S13: reading a payload written under another key raises PayloadDecodeError, never garbage."""
    registry.add("plain", "1", lambda c, i: i)
    codec_engine.start("plain", {"n": 1}, run_id="P1")
    other = make_engine(CodecStore(codec_engine.store.inner, _codec(KEY_B)), registry=registry)  # type: ignore[attr-defined]
    with pytest.raises(PayloadDecodeError):
        other.get("P1")


def test_claim_is_forwarded_so_racing_claims_never_over_admit(
    codec_engine: Engine, registry: Registry, monitor: Monitor
) -> None:
    """S13, S5, S9: through the codec store the claim is still the inner store's
    one atomic call: eight racing claims on one key admit exactly one."""
    audited(registry, monitor)
    names = [f"c{n}" for n in range(8)]
    for name in names:
        codec_engine.start("wf", {"k": "K"}, run_id=name)
    verdicts = run_threads(8, lambda i: admitted(claim(codec_engine, names[i])))
    assert sorted(verdicts) == ["admitted"] + ["parked"] * 7, verdicts
    assert codec_engine.store.supports_atomic_admission


def test_schedule_inputs_are_encoded_at_rest(codec_engine: Engine, registry: Registry) -> None:
    """S13, S17: a declared schedule's input is stored encoded and its runs get the plain input."""
    registry.add("rep", "1", lambda c, i: i, schedules=[Schedule("enc", every=1, input={"token": "s3cret"})])
    fire_due_schedules(codec_engine, codec_engine.now(), 10)
    if getattr(codec_engine.store.inner, "db", None) is not None:  # type: ignore[attr-defined]
        from durable_singleton.models import ScheduleState

        assert is_envelope(ScheduleState.objects.get(name="enc").input)
        assert "s3cret" not in json.dumps(ScheduleState.objects.get(name="enc").input)
    import time

    deadline = time.monotonic() + 30
    while not codec_engine.store.list_runs(workflow_name="rep"):  # polled: the next window is due within 1 s
        assert time.monotonic() < deadline, "the schedule's next window never fired"
        time.sleep(0.05)
        fire_due_schedules(codec_engine, codec_engine.now(), 10)
    (run,) = codec_engine.store.list_runs(workflow_name="rep")
    assert run.input == {"token": "s3cret"}


@pytest.fixture
def rotated_settings(settings: Any) -> Iterator[None]:
    settings.DURABLE_SINGLETON = {
        **settings.DURABLE_SINGLETON,
        "DISPATCH": "manual",
        "STORE": "tests.codec_stores.EncryptedDjangoStore",
    }
    yield
    codec_stores.KEYS[:] = []


@pytest.mark.django_db(transaction=True)
def test_key_rotation_with_the_reencode_command(rotated_settings: None, registry: Registry) -> None:
    """S13: rows written under key A (and rows written in plain before the codec)
    read with keys [B, A]; ``durable_reencode`` rewrites them under B, after which
    key A can be dropped; --dry-run writes nothing."""
    from durable_singleton.models import Run

    registry.add("plain", "1", lambda c, i: {"out": i})
    old = make_engine(CodecStore(build_store_django(), _codec(KEY_A)), registry=registry)
    old.start("plain", {"n": 1}, run_id="R1")
    old.dispatcher.drain()
    bare = make_engine("django", registry=registry)
    bare.start("plain", {"n": 2}, run_id="R2")  # written before the codec was configured

    codec_stores.KEYS[:] = [KEY_B, KEY_A]
    out = io.StringIO()
    call_command("durable_reencode", "--dry-run", "--json", stdout=out)
    dry = json.loads(out.getvalue())
    assert dry["durable_singleton_run"][1] == 2 and Run.objects.get(pk="R2").input == {"n": 2}
    out = io.StringIO()
    call_command("durable_reencode", stdout=out)
    assert "durable_singleton_run: re-encoded 2 of 2 rows" in out.getvalue()
    only_b = make_engine(CodecStore(build_store_django(), _codec(KEY_B)), registry=registry)
    assert only_b.get("R1").output == {"out": {"n": 1}} and only_b.get("R2").input == {"n": 2}


def build_store_django() -> Any:
    from durable_singleton.conf import Settings

    return build_store(Settings.from_mapping({"STORE": "django", "DISPATCH": "manual"}))


class TestCodecStoreOverMemory(StoreConformance):
    """S13: the store contract holds through the codec store around the in-memory store."""

    @pytest.fixture
    def store(self) -> BaseStore:
        return CodecStore(MemoryStore(), _codec(KEY_A))


@pytest.mark.django_db(transaction=True)
class TestCodecStoreOverDjango(StoreConformance):
    """S13: the store contract holds through the codec store around the Django store
    on the DATABASE_URL database (SQLite, PostgreSQL or MariaDB in CI)."""

    @pytest.fixture
    def store(self) -> BaseStore:
        return CodecStore(DjangoStore(), _codec(KEY_A))


@pytest.mark.django_db(transaction=True)
def test_admin_shows_payloads_decoded_only_where_the_codec_is_configured(
    admin_client: Any, settings: Any, registry: Registry
) -> None:
    """S13: the run page shows an encoded payload decoded in a process whose store
    has the codec and key, and as an encoded payload in one that has not."""
    from django.urls import reverse

    from durable_singleton.definitions import registry as default_registry

    codec_stores.KEYS[:] = [KEY_A]
    try:
        writer = make_engine(CodecStore(build_store_django(), _codec(KEY_A)), registry=default_registry)
        writer.start("sync-inventory", {"store_id": "ENC", "note": "hush"}, run_id="enc-1")
        url = reverse("admin:durable_singleton_run_change", args=["enc-1"])
        plain = admin_client.get(url).content.decode()
        assert "encoded payload (zlib+fernet)" in plain and "hush" not in plain
        settings.DURABLE_SINGLETON = {
            **settings.DURABLE_SINGLETON,
            "DISPATCH": "manual",
            "STORE": "tests.codec_stores.EncryptedDjangoStore",
        }
        decoded = admin_client.get(url).content.decode()
        assert "hush" in decoded and "decoded (stored encoded)" in decoded
    finally:
        codec_stores.KEYS[:] = []


def test_every_store_method_is_forwarded_to_the_inner_store() -> None:
    """S13, D4: the codec store defines every public method of ``BaseStore``,
    so none falls back to the base class's default instead of the inner
    store's. Before: ``is_unreachable`` and ``discard_broken_connection`` did,
    so around the Django store a dropped connection under a body (an
    ``OperationalError``) failed the run instead of handing it back, and a
    broken connection was never dropped (docs/durability.rst)."""
    methods = {n: v for n, v in vars(BaseStore).items() if callable(v) or isinstance(v, property)}
    public = [name for name in methods if not name.startswith("_")]
    missing = [name for name in public if name not in vars(CodecStore)]
    assert missing == []
    from django.db import OperationalError

    wrapped = CodecStore(DjangoStore(), _codec(KEY_A))
    assert wrapped.is_unreachable(OperationalError("server closed the connection"))
    # Every capability flag is the inner store's (X6: supports_throttles was not
    # copied, so a codec store refused every throttled workflow the Django store admits).
    flags = [name for name in dir(BaseStore) if name.startswith("supports_")]
    assert {f: getattr(wrapped, f) for f in flags} == {f: getattr(wrapped.inner, f) for f in flags}
    assert wrapped.supports_throttles
