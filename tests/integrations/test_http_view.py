"""The test project's view, driven over real HTTP against a running server.

pytest-django's ``live_server`` serves the project on a loopback port in a
thread of this process; turns go to the manual dispatcher, so the test decides
when bodies run. The database is whichever DATABASE_URL selects.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from durable_singleton.engine import Engine
from durable_singleton.models import Run
from tests.helpers import manual_default_engine

pytestmark = pytest.mark.django_db(transaction=True)


class Response:
    """Status, headers and decoded JSON body of one HTTP exchange."""

    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.json = json.loads(body or b"null")


def request(url: str, method: str = "GET", data: dict[str, Any] | None = None, **headers: str) -> Response:
    """Send one HTTP request; return the response whatever its status."""
    body = json.dumps(data).encode() if data is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return Response(resp.status, resp.headers, resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return Response(err.code, err.headers, err.read())


@pytest.fixture
def engine(settings: Any) -> Engine:
    """The default engine with the manual dispatcher: the view's turns wait for ``drain()``."""
    return manual_default_engine(settings)  # type: ignore[no-any-return]


def test_post_returns_202_until_the_queue_is_full_then_429_with_retry_after(live_server: Any, engine: Engine) -> None:
    """sync-inventory has limit 1 and max_queue_depth 2: three POSTs for one
    store are accepted (202 with the run id, S3), the fourth is refused with
    429 and Retry-After and writes no row (S15); another store still accepts."""
    url = f"{live_server.url}/inventory/H1/sync"
    accepted = [request(url, "POST", {"duration": 0}) for _ in range(3)]
    assert [r.status for r in accepted] == [202, 202, 202]
    run_ids = [r.json["run_id"] for r in accepted]
    assert len(set(run_ids)) == 3
    assert all(r.json["status"] == "pending" for r in accepted)

    refused = request(url, "POST", {"duration": 0})
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "5"
    assert refused.json["error"] == "queue_full"
    assert "sync-inventory" in refused.json["detail"] and "store:H1" in refused.json["detail"]
    assert set(Run.objects.for_key("sync-inventory", "store:H1").values_list("run_id", flat=True)) == set(run_ids)

    other = request(f"{live_server.url}/inventory/H2/sync", "POST", {"duration": 0})
    assert other.status == 202


def test_get_run_follows_the_run_from_pending_to_completed(live_server: Any, engine: Engine) -> None:
    """GET /runs/<id> reports a started run, then, after its turns ran, its
    completed status, output and key tag (S1); an unknown id is 404."""
    created = request(f"{live_server.url}/inventory/H3/sync", "POST", {"duration": 0})
    assert created.status == 202
    run_url = f"{live_server.url}/runs/{created.json['run_id']}"

    pending = request(run_url)
    assert pending.status == 200
    assert pending.json["status"] == "pending"
    assert "singleton:store:H3" in pending.json["tags"]

    assert engine.dispatcher.drain() >= 1
    done = request(run_url)
    assert done.status == 200
    assert done.json["status"] == "completed"
    assert done.json["output"] == {"store_id": "H3", "reconciled": 3}

    assert request(f"{live_server.url}/runs/no-such-run").status == 404


def test_a_full_queue_accepts_again_once_it_drains_and_replays_stay_idempotent(
    live_server: Any, engine: Engine
) -> None:
    """With the queue full, a POST repeating an existing Idempotency-Key
    returns that run (202) instead of 429, before the cap check (R3, S16);
    once the runs completed, a new POST is accepted again (S15)."""
    url = f"{live_server.url}/inventory/H4/sync"
    first = request(url, "POST", {"duration": 0}, **{"Idempotency-Key": "http-h4-1"})
    assert first.status == 202 and first.json["run_id"] == "http-h4-1"
    assert [request(url, "POST", {"duration": 0}).status for _ in range(2)] == [202, 202]
    assert request(url, "POST", {"duration": 0}).status == 429

    replay = request(url, "POST", {"duration": 0}, **{"Idempotency-Key": "http-h4-1"})
    assert replay.status == 202
    assert replay.json["run_id"] == "http-h4-1"
    assert Run.objects.for_key("sync-inventory", "store:H4").count() == 3

    engine.dispatcher.drain()
    assert set(Run.objects.for_key("sync-inventory", "store:H4").values_list("status", flat=True)) == {"completed"}
    again = request(url, "POST", {"duration": 0})
    assert again.status == 202
    assert request(f"{live_server.url}/runs/{again.json['run_id']}").json["status"] == "pending"
