"""The async API: ``astart``, ``aget``, ``asignal``, ``acancel`` and
``Wf.adispatch``, in process and under a real ASGI server.

The server is uvicorn in a subprocess serving the test project's async views
(testproject/inventory/async_views.py) on the test database; turns go to its
manual dispatcher, so runs stay where the test puts them. The event loop
check holds the key's lock from the test so that starts wait on the
database, and asks the server for a trivial page meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import F

from durable_singleton.definitions import Registry
from durable_singleton.exceptions import RunNotFoundError, SingletonQueueFullError
from durable_singleton.models import Run, SingletonKey
from durable_singleton.testing import make_engine
from testproject.inventory.workflows import SyncInventory

REPO = Path(__file__).resolve().parents[2]


def call(url: str, method: str = "GET", data: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """Send one HTTP request; return (status, decoded JSON body) whatever the status."""
    body = json.dumps(data).encode() if data is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read() or b"null")


def _database_url() -> str:
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings['NAME']}"
    from testproject.demo.live import database_url

    return database_url(settings)


@pytest.fixture
def asgi_server(tmp_path: Path) -> Iterator[str]:
    """Serve the test project with uvicorn on a free loopback port; return its base URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": _database_url(),
        "DURABLE_DISPATCH": "manual",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log_path = tmp_path / "uvicorn.log"
    command = [sys.executable, "-m", "uvicorn", "testproject.asgi:application", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning", "--no-access-log"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"uvicorn exited: {log_path.read_text(errors='replace')}"
            try:
                if call(f"{base}/async/ping", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"uvicorn never answered: {log_path.read_text(errors='replace')}"
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.django_db(transaction=True)
def test_starts_waiting_on_the_database_leave_the_event_loop_free(asgi_server: str) -> None:
    """Two async starts of one key wait on the key's lock (held here, S15's
    serialized count); meanwhile the same server answers a trivial request,
    while the starts still wait (no bound on its time: the lock is held until
    the ping is answered, so a blocked loop could not answer it at all).
    When the lock is released both starts return 202 (S3)."""
    status, first = call(f"{asgi_server}/async/inventory/AS1/sync", "POST", {})
    assert status == 202, first
    keys = SingletonKey.objects.filter(workflow_name="sync-inventory", key="store:AS1")
    locked, release = threading.Event(), threading.Event()

    def hold_the_key_lock() -> None:
        try:
            with transaction.atomic():
                list(keys.select_for_update())
                keys.update(last_token=F("last_token"))  # SQLite: the database write lock
                locked.set()
                release.wait(30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_key_lock, daemon=True)
    holder.start()
    assert locked.wait(60)
    with ThreadPoolExecutor(2) as pool:
        try:
            starts = [pool.submit(call, f"{asgi_server}/async/inventory/AS1/sync", "POST", {}) for _ in range(2)]
            time.sleep(0.5)
            assert not any(s.done() for s in starts), "a start did not wait for the key's lock"
            assert call(f"{asgi_server}/async/ping", timeout=25)[0] == 200
            assert not any(s.done() for s in starts), "the lock was released too early to show anything"
        finally:
            release.set()
            holder.join(30)
        results = [s.result(30) for s in starts]
    assert [status for status, _body in results] == [202, 202]
    assert Run.objects.filter(singleton_key="store:AS1").count() == 3


@pytest.mark.django_db(transaction=True)
def test_async_views_read_signal_cancel_and_refuse_a_full_queue(asgi_server: str) -> None:
    """aget reads a run (404 for an unknown id), asignal buffers a signal on an
    active run (D2), acancel cancels it (D6), a terminal run takes no signal;
    the fourth async start of one store is refused with 429 (S15, S16)."""
    status, run = call(f"{asgi_server}/async/inventory/AS2/sync", "POST", {})
    assert status == 202 and run["status"] == "pending"
    url = f"{asgi_server}/async/runs/{run['run_id']}"
    assert call(url) == (200, {"run_id": run["run_id"], "status": "pending", "output": None})
    assert call(f"{url}/signal/go", "POST", {"n": 1})[0] == 200
    assert call(f"{url}/cancel", "POST")[1]["status"] == "cancelled"
    assert call(url)[1]["status"] == "cancelled"
    assert call(f"{url}/signal/go", "POST", {"n": 2})[0] == 404
    assert call(f"{asgi_server}/async/runs/no-such-run")[0] == 404
    codes = [call(f"{asgi_server}/async/inventory/AS3/sync", "POST", {})[0] for _ in range(4)]
    assert codes == [202, 202, 202, 429]


def test_async_calls_run_off_the_event_loop_thread() -> None:
    """In process: astart runs start (and so the key function) on another
    thread than the event loop's; aget, asignal, acancel and Wf.adispatch
    return what their synchronous twins return and raise the same errors."""
    registry = Registry()
    threads: list[int] = []

    def key(input: Any) -> str:
        threads.append(threading.get_ident())
        return "k"

    registry.add("wf", "1", lambda ctx, i: i, singleton={"key": key, "limit": 1, "max_queue_depth": 0})
    engine = make_engine("memory", registry=registry)

    async def scenario() -> None:
        loop_thread = threading.get_ident()
        run = await engine.astart("wf", {"n": 1}, run_id="a1")
        assert threads and loop_thread not in threads
        assert (await engine.aget("a1")).status == "pending"
        assert (await engine.astart("wf", {"n": 1}, run_id="a1")).run_id == run.run_id  # R3
        with pytest.raises(SingletonQueueFullError):
            await engine.astart("wf", {"n": 2})
        assert (await engine.asignal("a1", "go", {"x": 1})).run_id == "a1"
        assert (await engine.acancel("a1")).status == "cancelled"
        with pytest.raises(RunNotFoundError):
            await engine.aget("missing")
        other = make_engine("memory")
        started = await SyncInventory.adispatch({"store_id": "Z"}, engine=other)
        assert started.workflow_name == "sync-inventory" and other.get(started.run_id).status == "pending"

    asyncio.run(scenario())
