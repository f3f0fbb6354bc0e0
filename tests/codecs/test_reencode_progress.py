"""``durable_reencode`` on SQLite leaves the workers room (#18 item 11, S13,
O1): SQLite has one write lock, and a re-encode that took it for 500 rows at a
time, batch after batch, starved every worker's claim and settle (146 of 300
runs unfinished after 25 s). It now re-encodes a few rows per write
transaction, computes each new value before it takes the lock, writes only
the rows still as it read them, and leaves the lock free for at least as long
as it held it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connections
from django.utils import timezone

from durable_singleton.codecs import ChainCodec, FernetCodec, ZlibCodec
from durable_singleton.conf import Settings
from durable_singleton.definitions import Registry
from durable_singleton.dispatch import ThreadDispatcher
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.stores.codec import CodecStore
from durable_singleton.stores.django import DjangoStore
from durable_singleton.stores.reencode import reencode_all
from tests.conftest import vendor

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

KEY_OLD, KEY_NEW = Fernet.generate_key(), Fernet.generate_key()
OLD_ROWS = 10_000
WORK_RUNS = 30


def _old_rows() -> None:
    """Insert OLD_ROWS finished runs whose input is encoded under the old key."""
    old = ChainCodec(ZlibCodec(), FernetCodec([KEY_OLD]))
    payload = old.encode({"pad": "x" * 200})
    finished = timezone.now() - timedelta(hours=1)
    Run.objects.bulk_create(
        [
            Run(
                run_id=f"old-{n:06d}",
                workflow_name="archived",
                workflow_version="1",
                status="completed",
                input=payload,
                created_at=finished,
                updated_at=finished,
                finished_at=finished,
            )
            for n in range(OLD_ROWS)
        ],
        batch_size=2000,
    )


def test_workers_progress_during_a_reencode_on_sqlite(registry: Registry) -> None:
    """S13, O1: while ``reencode_all`` rewrites 10,000 rows under the new key,
    worker threads on the same SQLite database start, claim and settle 30
    runs: every one of them completes before the re-encode is done, and the
    re-encode rewrites every old row."""
    if vendor() != "sqlite":
        pytest.skip("PostgreSQL and MariaDB lock rows, not the database: only SQLite's one write lock can starve")
    registry.add("work", "1", lambda ctx, i: i["n"])
    _old_rows()
    store = CodecStore(DjangoStore(), ChainCodec(ZlibCodec(), FernetCodec([KEY_NEW, KEY_OLD])))
    settings = Settings.from_mapping({"DISPATCH": "thread", "TICK_SECONDS": 0.2, "REDELIVERY_SECONDS": 1.0})
    dispatcher = ThreadDispatcher(store, threads=2, tick_seconds=0.2)
    engine = Engine(store, dispatcher, registry=registry, settings=settings)
    dispatcher.bind(engine)
    finished = threading.Event()
    counts: dict[str, Any] = {}

    def reencode() -> None:
        try:
            counts.update(reencode_all(store))
        finally:
            finished.set()
            connections.close_all()

    dispatcher.start()
    reencoder = threading.Thread(target=reencode, daemon=True)
    try:
        reencoder.start()
        for n in range(WORK_RUNS):
            engine.start("work", {"n": n}, run_id=f"work-{n}")
        # Poll until the re-encode is done: how many runs completed while it ran?
        completed = 0
        while not finished.wait(timeout=0.05):
            completed = Run.objects.filter(workflow_name="work", status="completed").count()
            if completed == WORK_RUNS:
                break
        assert completed == WORK_RUNS, (
            f"the re-encode finished with {WORK_RUNS - completed} of {WORK_RUNS} runs unfinished"
        )
        reencoder.join(timeout=300)
        assert not reencoder.is_alive(), "the re-encode did not finish"
    finally:
        dispatcher.stop(timeout=10)
        finished.wait(timeout=300)
    assert counts["durable_singleton_run"][1] >= OLD_ROWS, counts
    assert Run.objects.filter(workflow_name="work", status="completed").count() == WORK_RUNS
