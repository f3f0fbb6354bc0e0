"""A real network partition of a holder from PostgreSQL and Redis (issue #12).

A Celery worker runs in a network namespace of its own (``ip netns`` and a
veth pair, created by the test under unique names and removed afterwards, on
failure too). PostgreSQL and Redis listen on 127.0.0.1 only, so this process
relays TCP to them from the host end of the veth pair (:class:`Forwarder`),
and the worker's ``DATABASE_URL`` and ``CELERY_BROKER_URL`` name that address.
The partition sets the host end of the pair down: the worker's packets vanish
without an error or a reset, the database and the broker see idle connections
(the relay's), and the worker sees nothing but silence. Healing sets it up
again; the stalled TCP connections carry on.

A fencing store in this process (:class:`FencingStore`, an HTTP server
reached through the same relay) keeps the highest fencing token it has seen
per key and refuses a write carrying a lower one, the external system of K1.
The bodies (workflow ``partition-fenced``, testproject) tell it their token on
entry and then do their side effect, a write carrying the token, once the
test opens the gate for that body entry; the partition falls while the
first bodies wait at the gate, i.e. mid-body.

Leases are the fault tests' (``LEASE_SECONDS`` = 3, renewed every 1 s); the
tick runs in this process every 0.5 s (``Driver``). The figures go to
``artifacts/partition.json``. Needs root (network namespaces) and iproute2's
``ip``, PostgreSQL and Redis; skipped with the reason otherwise. ::

    .venv/bin/python tools/services.py run --pg --redis -- bash -c \\
      'DATABASE_URL=$DS_PG_URL CELERY_BROKER_URL=$DS_REDIS_URL \\
       .venv/bin/python -m pytest -q -s tests/workers/test_network_partition.py'
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from django.conf import settings
from django.db import connection

from durable_singleton.models import Run, Step
from testproject.demo.live import database_url
from testproject.inventory.models import BodyAudit
from testproject.inventory.workflows import PARTITION_FENCE_URL_ENV, PARTITION_QUEUE
from tests.celery_workers import CeleryWorkers, celery_stack_missing, celery_workers
from tests.workers.test_celery_faults import LEASE, RENEW, SLACK, TICK, Driver, lease_env, turn_outcomes

__all__ = ["celery_workers"]  # the fixture, imported for this module's test

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKFLOW = "partition-fenced"
ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "partition.json"
KEEP_RUNS = 20  # the artifact keeps the figures of the last 20 runs


class NamespaceUnavailableError(Exception):
    """This machine cannot make a network namespace here (permission, kernel)."""


def _namespaces_missing() -> str | None:
    """Return why this process cannot make network namespaces, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "needs iproute2's ip command to create network namespaces"
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) to create network namespaces"
    return None


def _ip(*args: str) -> None:
    """Run ``ip args``; raise CalledProcessError with its stderr."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespace:
    """A network namespace joined to this one by a veth pair (a /30 of
    10.213.0.0/16 that no interface here uses). Names are unique to this
    instance; :meth:`remove` deletes the pair and the namespace."""

    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:6]
        self.name = f"ds-partition-{suffix}"
        self.host_if, self.ns_if = f"dsp{suffix}h", f"dsp{suffix}n"  # at most 15 characters
        used = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
        free = [n for n in range(256) if f" 10.213.{n}." not in used]
        net = random.choice(free)
        self.host_ip, self.ns_ip = f"10.213.{net}.1", f"10.213.{net}.2"
        self.cut_off = False

    def __enter__(self) -> Namespace:
        try:
            _ip("netns", "add", self.name)
        except subprocess.CalledProcessError as exc:
            raise NamespaceUnavailableError(f"ip netns add failed: {exc.stderr.strip()}") from exc
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            inside = ("netns", "exec", self.name, "ip")
            _ip(*inside, "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
            _ip(*inside, "link", "set", self.ns_if, "up")
            _ip(*inside, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.remove()
            raise NamespaceUnavailableError(f"{' '.join(map(str, exc.cmd))} failed: {exc.stderr.strip()}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command that runs a program inside the namespace (exec, same PID)."""
        return ("ip", "netns", "exec", self.name)

    def cut(self) -> None:
        """Partition: the host end goes down; packets from either side vanish silently."""
        _ip("link", "set", self.host_if, "down")
        self.cut_off = True

    def heal(self) -> None:
        """Undo :meth:`cut`."""
        if self.cut_off:
            _ip("link", "set", self.host_if, "up")
            self.cut_off = False

    def remove(self) -> None:
        """Delete the veth pair and the namespace (either may be gone already)."""
        for args in (("link", "del", self.host_if), ("netns", "del", self.name)):
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _ip(*args)


class Forwarder:
    """Accepts TCP connections on ``host`` (an ephemeral port, :attr:`port`)
    and relays each to ``target``, both ways, one thread per direction."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server((host, 0))
        self.port = int(self.listener.getsockname()[1])
        self.sockets: list[socket.socket] = []
        self.accepted = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"forward:{self.port}", daemon=True).start()

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self.sockets += [client, upstream]
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop accepting and close every relayed connection."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        with self._lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class FencingStore:
    """K1's external system, over HTTP on 127.0.0.1: keeps the highest token
    seen per key and refuses a call with a lower one (HTTP 409).

    ``POST /begin`` and ``POST /write`` take ``{"key", "token", "entry"}``; a
    write also stores ``entry`` as the key's value. ``GET /gate?entry=E``
    answers whether the test opened the gate for body entry ``E``
    (:meth:`open`). Every call is logged with the time it arrived
    (``time.monotonic()``).
    """

    def __init__(self) -> None:
        self.highest: dict[str, int] = {}
        self.values: dict[str, str] = {}
        self.log: list[dict[str, Any]] = []
        self.opened: set[str] = set()
        self.all_open = False
        self._lock = threading.Lock()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                entry = parse_qs(urlsplit(self.path).query).get("entry", [""])[0]
                with store._lock:
                    store.log.append({"op": "gate", "entry": entry, "at": time.monotonic()})
                self._answer(200, {"open": store.all_open or entry in store.opened})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                op = self.path.strip("/")
                key, token = str(body["key"]), int(body["token"])
                with store._lock:
                    accepted = token >= store.highest.get(key, 0)
                    if accepted:
                        store.highest[key] = token
                        if op == "write":
                            store.values[key] = body["entry"]
                    store.log.append(
                        {
                            "op": op,
                            "key": key,
                            "token": token,
                            "entry": body["entry"],
                            "accepted": accepted,
                            "highest": store.highest[key],
                            "at": time.monotonic(),
                        }
                    )
                self._answer(200 if accepted else 409, {"accepted": accepted, "highest": store.highest[key]})

            def _answer(self, code: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, name="fencing-store", daemon=True).start()

    def __enter__(self) -> FencingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def open(self, *entries: str) -> None:
        """Open the gate for ``entries``, or for every entry if none is given."""
        with self._lock:
            self.opened.update(entries)
            self.all_open = self.all_open or not entries

    def calls(self, op: str, entry: str) -> list[dict[str, Any]]:
        """Return the logged calls ``op`` of body entry ``entry``."""
        with self._lock:
            return [c for c in self.log if c["op"] == op and c["entry"] == entry]


class PartitionDriver(Driver):
    """A :class:`Driver` that also keeps, per run and lease owner, the latest
    lease expiry stored (the database's clock), and reports the fencing
    store's calls."""

    def __init__(self, fence: FencingStore, *workers: CeleryWorkers) -> None:
        super().__init__(*workers)
        self.fence = fence
        self.expiry: dict[tuple[str, str], datetime] = {}

    def report(self) -> str:
        with self.fence._lock:
            calls = list(self.fence.log)
        start = calls[0]["at"] if calls else 0.0
        gates = Counter(c["entry"] for c in calls if c["op"] == "gate")
        lines = [f"fencing store calls (seconds since the first); gate polls per entry: {dict(gates)}"]
        lines += [
            f"  {c['at'] - start:7.3f} {c['op']} {c['entry']} token={c['token']} accepted={c['accepted']}"
            for c in calls
            if c["op"] != "gate"
        ]
        return super().report() + "\n" + "\n".join(lines)

    def poll(self) -> None:
        super().poll()
        for run_id, owner, expires in Run.objects.filter(pk__in=self.run_ids, status="running").values_list(
            "run_id", "lease_owner", "lease_expires_at"
        ):
            seen = self.expiry.get((run_id, owner))
            if owner and expires and (seen is None or expires > seen):
                self.expiry[(run_id, owner)] = expires


def _db_now() -> datetime:
    """Return the database's clock (R5)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        now: datetime = cursor.fetchone()[0]
    return now


def _entry(run_id: str, attempt: int) -> BodyAudit | None:
    return BodyAudit.objects.filter(run_id=f"{run_id}#{attempt}").first()


def _net_ns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _broker_url(host: str, port: int) -> str:
    """Return ``CELERY_BROKER_URL`` with its host and port replaced."""
    parts = urlsplit(str(settings.CELERY_BROKER_URL))
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return parts._replace(netloc=netloc).geturl()


def _record(figures: dict[str, Any]) -> None:
    """Add this run's figures to the artifact (the last KEEP_RUNS runs) and print them."""
    ARTIFACT.parent.mkdir(exist_ok=True)
    data = json.loads(ARTIFACT.read_text()) if ARTIFACT.exists() else {}
    runs = data.setdefault("partition_takeover", [])
    runs.append({"lease_seconds": LEASE, "renew_seconds": RENEW, "tick_seconds": TICK, **figures})
    del runs[:-KEEP_RUNS]
    ARTIFACT.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"\npartition_takeover: {json.dumps(figures)}")


@contextlib.contextmanager
def _partition_setup(workers: CeleryWorkers) -> Iterator[tuple[Namespace, FencingStore, dict[str, str]]]:
    """Make the namespace, the fencing store and the relays; yield them with the
    environment of a worker inside the namespace. On the way out (failure
    included): open the gate, heal, stop every worker, close the relays and the
    store, delete the veth pair and the namespace."""
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(Namespace())
        except NamespaceUnavailableError as exc:
            pytest.skip(f"cannot make a network namespace here: {exc}")
        fence = stack.enter_context(FencingStore())
        db = connection.settings_dict
        broker = urlsplit(str(settings.CELERY_BROKER_URL))
        pg = stack.enter_context(Forwarder(net.host_ip, (db["HOST"] or "localhost", int(db["PORT"] or 5432))))
        redis = stack.enter_context(Forwarder(net.host_ip, (broker.hostname or "localhost", broker.port or 6379)))
        http = stack.enter_context(Forwarder(net.host_ip, ("127.0.0.1", fence.port)))
        stack.callback(workers.stop)
        stack.callback(net.heal)
        stack.callback(fence.open)
        env = lease_env(
            DATABASE_URL=database_url({**db, "HOST": net.host_ip, "PORT": pg.port}),
            CELERY_BROKER_URL=_broker_url(net.host_ip, redis.port),
            **{PARTITION_FENCE_URL_ENV: f"http://{net.host_ip}:{http.port}"},
        )
        yield net, fence, env


def test_a_partitioned_holder_is_taken_over_and_its_late_writes_are_refused(celery_workers: CeleryWorkers) -> None:
    """R5, R5a, K1, F8: a worker in its own network namespace holds two keys:
    run A (side effect inside a step) and run B (side effect in the body, so
    its last write is the settle). Both bodies have told the fencing store
    their tokens t1 and wait at the gate when the worker is cut off from
    PostgreSQL, Redis and the fencing store (packets dropped, no reset).

    - Its leases expire by the database's clock: nobody takes A or B over
      before the last expiry the worker stored (R5); the tick then lets a
      worker in this process's namespace take each over within one lease plus one tick
      of the partition, with a token t2 > t1 (K1). The new bodies tell the
      fencing store t2 and wait at the gate.
    - While cut off, nothing of the worker reaches the fencing store.
    - Healed, with the gate open for the cut-off bodies only, they do their
      side effects with t1 while the new holder still runs: the fencing store
      refuses both (K1); A's step result is refused by the lease owner's
      compare-and-set although no result is stored for its position yet (the
      turn logs ``lease lost`` and ends ``fenced``), and B's settle is refused
      although B is still ``running`` (``fenced``) (R5a). A and B still
      belong to the new holder, and A has no step stored.
    - The gate opens for the new holder: A and B complete with its output and
      token t2, one recovery each; A's step at position 0 is stored once, the
      new holder's; the fencing store holds the new holder's writes.
    """
    if reason := celery_stack_missing():
        pytest.skip(reason)
    if reason := _namespaces_missing():
        pytest.skip(reason)
    with _partition_setup(celery_workers) as (net, fence, netns_env):
        driver = PartitionDriver(fence, celery_workers)
        common = ("--disable-prefetch",)  # a busy worker takes no more turns
        (cut_off,) = celery_workers.start(
            1, concurrency=2, queues=PARTITION_QUEUE, env=netns_env, prefix=net.prefix, extra_args=common
        )
        assert _net_ns(cut_off.pid) != _net_ns(os.getpid()), "the worker did not start in its own namespace"
        a = driver.start(WORKFLOW, driver.key("pa"), "A", gate=True, effect_in="step")
        b = driver.start(WORKFLOW, driver.key("pb"), "B", gate=True, effect_in="body")
        a1, b1, a2, b2 = f"{a}#1", f"{b}#1", f"{a}#2", f"{b}#2"
        driver.until("A and B entered and begun", lambda: fence.calls("begin", a1) and fence.calls("begin", b1), 90)
        for first in (_entry(a, 1), _entry(b, 1)):
            assert first is not None and first.pid in cut_off.children(), driver.report()
        (taker,) = celery_workers.start(
            1,
            concurrency=2,
            queues=PARTITION_QUEUE,
            env=lease_env(**{PARTITION_FENCE_URL_ENV: f"http://127.0.0.1:{fence.port}"}),
            extra_args=common,
        )
        held = {r: Run.objects.values_list("lease_owner", "fencing_token").get(pk=r) for r in (a, b)}

        partitioned_at, cut_mono = _db_now(), time.monotonic()
        net.cut()
        driver.until(
            "A and B taken over by the other worker",
            lambda: fence.calls("begin", a2) and fence.calls("begin", b2),
            LEASE + TICK + 30,
        )
        taken = {r: Run.objects.values_list("status", "lease_owner", "fencing_token").get(pk=r) for r in (a, b)}
        fence.open(a1, b1)
        healed_at, heal_mono = _db_now(), time.monotonic()
        net.heal()

        def late_turns() -> list[str] | None:
            """Return the outcomes of the cut-off worker's two turns, once both ended."""
            outcomes = turn_outcomes(cut_off.log())
            return outcomes if len(outcomes) >= 2 else None

        outcomes = driver.until("the cut-off worker's turns' end", late_turns, 90)
        assert outcomes == ["fenced", "fenced"], driver.report()
        # Refused while the new holder still runs: by the lease owner's compare, not by a terminal status (R5a).
        after_late = {r: Run.objects.values_list("status", "lease_owner", "fencing_token").get(pk=r) for r in (a, b)}
        assert after_late == taken, driver.report()
        assert all(status == "running" and owner != held[r][0] for r, (status, owner, _t) in taken.items())
        assert not Step.objects.filter(run_id__in=(a, b)).exists(), driver.report()
        fence.open(a2, b2)
        driver.until("A and B completed by the new holder", lambda: driver.settled(a, b), 90)
        report = driver.report()

        figures: dict[str, Any] = {}
        for run_id, name in ((a, "A"), (b, "B")):
            owner, t1 = held[run_id]
            second = _entry(run_id, 2)
            assert second is not None and second.pid in taker.children(), report
            # The takeover: after the old lease ran out by the database's clock, with a higher token (R5, K1).
            expired_at = driver.expiry[(run_id, owner)]
            assert expired_at >= partitioned_at, report
            assert second.entered_at >= expired_at, f"{name} taken over before its lease expired\n{report}"
            takeover = (second.entered_at - partitioned_at).total_seconds()
            assert takeover <= LEASE + TICK + SLACK, f"{name} taken over {takeover:.2f} s after the cut\n{report}"
            run = Run.objects.get(pk=run_id)
            assert (run.status, run.recoveries, run.lease_owner) == ("completed", 1, None), report
            assert t1 is not None and run.fencing_token is not None and run.fencing_token > t1, report
            t2 = run.fencing_token
            assert run.output == {
                "store_id": run.input["store_id"],
                "begun": True,
                "pid": second.pid,
                "token": t2,
                "accepted": True,
            }, report
            # The fencing store: both begins accepted, the late side effect refused, the new one kept (K1).
            first_entry, second_entry = f"{run_id}#1", f"{run_id}#2"
            assert [c["accepted"] for c in fence.calls("begin", first_entry)] == [True], fence.log
            assert [c["accepted"] for c in fence.calls("begin", second_entry)] == [True], fence.log
            (late,) = fence.calls("write", first_entry)
            assert (late["token"], late["accepted"], late["highest"]) == (t1, False, t2), fence.log
            assert late["at"] > heal_mono, fence.log
            (kept,) = fence.calls("write", second_entry)
            assert (kept["token"], kept["accepted"]) == (t2, True) and kept["at"] > late["at"], fence.log
            assert fence.values[run.singleton_key] == second_entry and fence.highest[run.singleton_key] == t2
            # Silence while cut off: no call of the cut-off body arrived between the cut and the heal.
            arrived = [c["at"] for c in fence.log if c["entry"] == first_entry]
            assert not [t for t in arrived if cut_mono + 0.1 < t < heal_mono], f"{name} reached the store while cut off"
            figures[name] = {
                "partition_to_lease_expiry_seconds": round((expired_at - partitioned_at).total_seconds(), 3),
                "partition_to_takeover_seconds": round(takeover, 3),
                "expiry_to_takeover_seconds": round((second.entered_at - expired_at).total_seconds(), 3),
                "heal_to_refused_late_write_seconds": round(late["at"] - heal_mono, 3),
                "tokens": [t1, t2],
            }

        # A's late step result and B's late settle were refused (R5a): what is stored is the new holder's.
        (step,) = Step.objects.filter(run_id=a)
        second_a = _entry(a, 2)
        assert second_a is not None
        assert (step.position, step.name) == (0, "partition:effect"), report
        assert step.result == {"pid": second_a.pid, "token": Run.objects.get(pk=a).fencing_token, "accepted": True}
        assert not Step.objects.filter(run_id=b).exists(), report
        log = cut_off.log()
        assert f"run {a}: lease lost; this turn's writes are fenced" in log, log
        assert f"run {b}: lease lost" not in log, log  # B's body had no step left: its settle was refused
        assert all(n <= 1 for n in driver.peak.values()), report
        figures["partitioned_seconds"] = round((healed_at - partitioned_at).total_seconds(), 3)
        figures["refused"] = {
            "fencing_store_late_writes": 2,
            "step_results": 1,
            "settles": 1,
            "cut_off_turns_fenced": 2,
        }
        _record(figures)
