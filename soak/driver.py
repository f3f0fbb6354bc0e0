"""The soak's driver: services, workers, ticks, workload, faults, drain, dump.

Everything it does to the system is appended to ``events.jsonl`` in the
output folder (starts, cancels, signals, retries, duplicate deliveries and
each fault with its PIDs and times); the bodies append to ``audit.jsonl``;
at the end the database is dumped to ``final.json``. :mod:`soak.check`
reads only those three files.

``--features`` adds the workload of issues #18 and #20 (all by default):

* ``namespaces`` (D10, D7): some runs are started by scoped engines of two
  tenants; scoped engines (the tenants' and the default namespace's) probe
  recent runs of another namespace with ``get``, ``start`` of the same id,
  ``signal``, ``cancel`` and ``wake``, and read their own;
* ``schedules`` (S17): the schedule ``soak-every-second`` fires a window a
  second, paused when the load ends;
* ``clock`` (R8): a fourth tick loop runs on an engine whose process clock is
  stepped (an hour or ten minutes ahead, a minute or 5 s back) right after
  each correction, and starts runs through it;
* ``retention`` (O2, D7, R4): ``soak-retain`` parents call a child and sleep;
  the driver purges their finished children meanwhile (``purge_finished`` or
  the admin's ``delete_run``), so each parent replays without its child;
* ``quotas`` (X2, X3, X4): about one iteration in twenty of the load starts
  quota runs in place of its run (:class:`QuotaPlan`): a ``soak-qa`` run (the
  shared quota only), a ``soak-qb`` run or three at once on one key (the
  shared quota and a limit-1 key with a ``queue_ttl``: the third usually
  expires), or a burst of the fair quota's tenant ``big`` followed by one
  run of a small tenant. They take the other runs' faults, cancels and
  duplicate deliveries;
* ``controls`` (X6, X7, X8): about one iteration in twenty-five starts
  control runs in place of its run (:class:`ControlPlan`): a burst of six
  ``soak-th`` runs on one throttle key (3 admissions a second), five
  ``soak-pr`` runs on one limit-1 key with priorities -5, 0 and 5, or a burst
  of four ``soak-db`` starts of one debounce key, back to back; a debounced
  start that folds into an open run writes a ``debounce_fold`` event (its
  start id, the run it went into, its input's number) in place of ``start``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY_MARK = b" ready."
TERMINAL = ("completed", "failed", "cancelled", "dead")
WORKFLOWS = ("soak-l1", "soak-l2", "soak-l3", "soak-timeout")
#: The databases of ``--db``; ``sqlite`` is a file in the output folder.
DATABASES = ("postgresql", "mariadb", "sqlite")
FEATURES = ("namespaces", "schedules", "clock", "retention", "quotas", "controls")
#: The tenants' namespaces (D10); the default engine's is ``default``.
TENANTS = ("tenant-a", "tenant-b")
#: The clock steps of the stepped tick loop, seconds (R8).
CLOCK_STEPS = (3600.0, 600.0, -60.0, -5.0)


def _services() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import services
    finally:
        sys.path.pop(0)
    return services


class Log:
    """An append-only JSON-lines file, safe to write from several threads."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    def write(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._file.write(json.dumps({"e": event, "t": time.time(), **fields}, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def _can_rename_host() -> bool:
    """Tell whether a worker group can get a host name of its own (a UTS
    namespace: root and util-linux's ``unshare``); the lease owners then name
    two hosts, as two machines would (``socket.gethostname()``)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--uts", "--", "true"], capture_output=True)
    return probe.returncode == 0


@dataclass
class SqliteFile:
    """The database of ``--db sqlite``: a file in the output folder, no server.

    The test project's settings open it as every SQLite deployment of the app
    should (WAL, ``synchronous=NORMAL``, ``BEGIN IMMEDIATE``, a 30 s busy
    timeout); the worker groups, the tick loops and the driver share it. A
    file left by an earlier soak in the same folder is removed first.
    """

    path: Path

    def __post_init__(self) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)

    @property
    def url(self) -> str:
        return f"sqlite:///{self.path.resolve()}"

    def stop(self) -> None:
        """Nothing to stop: the file stays in the output folder beside the dump."""


def fault_kinds(db: str) -> list[str]:
    """Return the faults the soak injects on ``db`` (one of :data:`DATABASES`).

    Every database gets the faults of the workers and the broker; a server
    gets 1 to 3 of its connections killed, and MariaDB's is restarted. A
    SQLite file has no server, so neither applies: its connection is a file
    handle inside the process, which dies with it (``kill_pool``,
    ``kill_worker``).
    """
    kinds = ["kill_pool", "kill_worker", "freeze_short", "freeze_past_lease", "redis_restart"]
    if db != "sqlite":
        kinds.append("db_kill_connections")
    if db == "mariadb":
        kinds.append("db_restart")
    return kinds


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)


@dataclass
class Worker:
    """One ``celery worker`` (a group of ``concurrency`` pool processes) by its node name."""

    name: str
    env: dict[str, str]
    log_dir: Path
    concurrency: int = 2
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        log_path = self.log_dir / f"{self.name}.{self.starts}.log"
        args = [
            sys.executable, "-m", "celery", "-A", "soak.celery_app", "worker", "--loglevel=INFO",
            "--pool=prefork", f"--concurrency={self.concurrency}", "-n", f"{self.name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        if _can_rename_host():  # each group on a host name of its own, as on two machines
            args = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', f"{self.name}-host", *args]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.log_path = log_path

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while READY_MARK not in self.log_path.read_bytes():
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pool(self) -> list[int]:
        return _children(self.proc.pid) if self.alive() and self.proc else []

    def kill_group(self) -> list[int]:
        assert self.proc is not None
        pids = [self.proc.pid, *self.pool()]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        return pids

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


@dataclass
class Plan:
    """The random choices of one soak (seeded)."""

    rng: random.Random
    keys: int
    retain: bool = False  # the ``retention`` feature: 4 % of runs are soak-retain parents
    frng: random.Random = field(default_factory=random.Random)  # its own stream: the rest is as without it

    def run(self, n: int) -> tuple[str, dict[str, Any]]:
        if self.retain and self.frng.random() < 0.04:
            frng = self.frng
            return "soak-retain", {"key": f"rt-k{frng.randrange(3)}", "plan": [["retain", "rc", 2.5]]}
        rng = self.rng
        roll = rng.random()
        if roll < 0.04:
            plan: list[list[Any]] = [["work", 2500]] if rng.random() < 0.2 else [["sleep", 3.0]]
            return "soak-timeout", {"key": f"t{rng.randrange(2)}", "plan": plan}
        workflow = "soak-l1" if roll < 0.5 else "soak-l2" if roll < 0.75 else "soak-l3"
        ops = []
        for _ in range(rng.randint(1, 2)):
            op = rng.random()
            if op < 0.68:
                ops.append(["work", rng.randint(0, 20)])
            elif op < 0.79:
                ops.append(["sleep", round(rng.uniform(0.2, 1.0), 2)])
            elif op < 0.87:
                ops.append(["signal"])
            elif op < 0.95:
                ops.append(["flaky", rng.randint(0, 10)])
            else:
                ops.append(["child", f"c{rng.randrange(3)}"])
        return workflow, {"key": f"{workflow[-2:]}-k{rng.randrange(self.keys)}", "plan": ops}


@dataclass
class QuotaPlan:
    """The runs of the ``quotas`` feature (X2, X3, X4), from a seeded stream of their own."""

    rng: random.Random
    #: Runs of the big tenant in one burst of the fair quota, started back to back.
    burst: int = 8

    def batch(self) -> list[tuple[str, dict[str, Any]]]:
        """Return the quota runs to start in place of the load's next run (usually none)."""
        rng = self.rng
        roll = rng.random()
        qkey = f"q{rng.randrange(2)}"
        if roll < 0.025:  # the shared quota only
            ops: list[list[Any]] = [["work", rng.randint(0, 60)] if rng.random() < 0.6 else ["sleep", 0.3]]
            if rng.random() < 0.15:
                ops.append(["flaky", rng.randint(0, 10)])
            return [("soak-qa", {"key": "qa", "qkey": qkey, "plan": ops})]
        if roll < 0.045:  # the shared quota and a limit-1 key with a queue_ttl (X2): three at once, the last may expire
            key = f"qb-k{rng.randrange(3)}"
            # A step that a fault may hit while the run holds both limits (a takeover: new tokens, X3f), then a sleep.
            return [
                ("soak-qb", {"key": key, "qkey": qkey,
                             "plan": [["work", rng.randint(20, 120)], ["sleep", round(rng.uniform(0.4, 0.7), 2)]]})
                for _ in range(3 if rng.random() < 0.35 else 1)
            ]  # fmt: skip
        if roll < 0.05:  # a burst of the fair quota's big tenant, then one run of a small tenant (X4)
            plan = [["sleep", 0.3], ["work", 2]]
            burst = [("soak-qf", {"key": "qf", "qkey": "f", "tenant": "big", "plan": plan}) for _ in range(self.burst)]
            return [
                *burst,
                ("soak-qf", {"key": "qf", "qkey": "f", "tenant": f"small-{rng.randrange(3)}", "plan": plan}),
            ]
        return []


@dataclass
class ControlPlan:
    """The runs of the ``controls`` feature (X6, X7, X8), from a seeded stream of their own."""

    rng: random.Random
    #: The debounced starts so far: each numbers its input (X7).
    n: int = 0

    def batch(self) -> list[tuple[str, dict[str, Any], int]]:
        """Return the control runs to start in place of the load's next run (usually
        none), as (workflow, input, priority)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.015:  # a burst on one throttle key: half of it waits for the next window (X6)
            tkey = f"th-k{rng.randrange(2)}"
            return [("soak-th", {"key": "th", "tkey": tkey, "plan": [["work", rng.randint(0, 30)]]}, 0)] * 6
        if roll < 0.03:  # a limit-1 key's queue of mixed priorities (X8)
            key = f"pr-k{rng.randrange(2)}"
            return [
                ("soak-pr", {"key": key, "plan": [["work", rng.randint(20, 60)]]}, rng.choice((-5, 0, 5)))
                for _ in range(5)
            ]
        if roll < 0.04:  # a burst of one debounce key: one run with the newest input (X7)
            dkey = f"db-k{rng.randrange(3)}"
            burst = []
            for _ in range(4):
                self.n += 1
                burst.append(("soak-db", {"key": "db", "dkey": dkey, "n": self.n, "plan": [["work", 5]]}, 0))
            return burst
        return []


@dataclass
class Soak:
    """One soak: call :meth:`run`."""

    args: argparse.Namespace
    out: Path
    events: Log = field(init=False)
    stop_load: threading.Event = field(default_factory=threading.Event)
    stop_faults: threading.Event = field(default_factory=threading.Event)  # set to end the faults early
    stop_all: threading.Event = field(default_factory=threading.Event)
    workers: list[Worker] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    signals_due: list[tuple[float, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    frozen: set[int] = field(default_factory=set)
    namespace_of: dict[str, str] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)  # the 1-minute load average, sampled by the fault loop

    def __post_init__(self) -> None:
        self.events = Log(self.out / "events.jsonl")
        self.rng = random.Random(self.args.seed)
        self.fault_rng = random.Random(self.args.seed + 2)
        self.features = set(self.args.features)

    def engine(self, **options: Any) -> Any:
        """Return an engine over the default engine's store and dispatcher with
        ``options`` (``namespace``, ``scope_reads``; a clock of its own)."""
        from durable_singleton.engine import Engine
        from durable_singleton.runtime import get_engine

        base = get_engine()
        return Engine(base.store, base.dispatcher, registry=base.registry, settings=base.settings, **options)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + n

    # -- the pieces --------------------------------------------------------

    def _db(self, fn: Callable[[], Any], *, attempts: int = 60) -> Any:
        """Call ``fn`` (a database call), retrying with a fresh connection for
        about ``attempts`` half-seconds while the server is away."""
        from django.db import connection

        for attempt in range(attempts):
            try:
                return fn()
            except Exception as exc:
                if not _is_transient(exc) or attempt == attempts - 1:
                    raise
                self.count("driver_db_retries")
                with contextlib.suppress(Exception):
                    connection.close()
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def tick_loop(self, n: int) -> None:
        from django.db import connection

        from durable_singleton.runtime import get_engine

        engine = get_engine()
        rng = random.Random(self.args.seed + 100 + n)
        while not self.stop_all.is_set():
            self.tick_once(engine, "ticks")
            self.stop_all.wait(self.args.tick * rng.uniform(0.8, 1.2))
        connection.close()

    def tick_once(self, engine: Any, counter: str) -> None:
        """One tick of ``engine``, counted under ``counter``; an error is counted
        (tick_errors) and the thread's connection closed for the next one."""
        from django.db import connection

        try:
            engine.tick()
            self.count(counter)
        except Exception:
            self.count("tick_errors")
            with contextlib.suppress(Exception):
                connection.close()

    def load_loop(self) -> None:
        from django.db import connection

        from durable_singleton.runtime import get_engine

        engine = get_engine()
        retain = "retention" in self.features
        plan = Plan(random.Random(self.args.seed), self.args.keys, retain, random.Random(self.args.seed + 3))
        rng = random.Random(self.args.seed + 1)
        frng = random.Random(self.args.seed + 4)
        scoped = (
            {ns: self.engine(namespace=ns, scope_reads=True) for ns in ("default", *TENANTS)}
            if "namespaces" in self.features
            else {}
        )
        quotas = QuotaPlan(random.Random(self.args.seed + 7)) if "quotas" in self.features else None
        controls = ControlPlan(random.Random(self.args.seed + 8)) if "controls" in self.features else None
        begin = time.monotonic()
        n = 0
        while not self.stop_load.is_set():
            regular = plan.run(n + 1)
            # A batch of control runs, or else of quota runs, takes the place of the regular
            # run: the rate stays --rate.
            control = controls.batch() if controls is not None else []
            for workflow, input, priority in control:
                n += 1
                self.start_control(engine, n, workflow, dict(input), priority)
            for workflow, input in [] if control else (quotas.batch() if quotas is not None else None) or [regular]:
                n += 1
                self.start_one(engine, scoped, n, workflow, input, rng, frng)
            ahead = n / self.args.rate - (time.monotonic() - begin)
            if ahead > 0:
                self.stop_load.wait(ahead)
        connection.close()

    def start_one(
        self,
        engine: Any,
        scoped: dict[str, Any],
        n: int,
        workflow: str,
        input: dict[str, Any],
        rng: random.Random,
        frng: random.Random,
    ) -> None:
        """Start the load's ``n``-th run, then maybe probe, schedule its signals,
        deliver a recent run's turn again or cancel a recent run."""
        from durable_singleton.tasks import execute_run

        run_id = f"s{n:06d}"
        starter, ns = engine, "default"
        if scoped and frng.random() < 0.15:  # a tenant's run (D10)
            ns = frng.choice(TENANTS)
            starter = scoped[ns]
            input["secret"] = f"{ns}-secret-{n}"
        t_req = time.time()
        try:
            self._db(lambda: starter.start(workflow, input, run_id=run_id))
        except Exception as exc:
            self.events.write("start_failed", run=run_id, error=repr(exc))
            self.count("start_failed")
            return
        self.events.write(
            "start", run=run_id, wf=workflow, key=input["key"], plan=input["plan"], t_req=t_req, ns=ns,
            secret=input.get("secret"),
        )  # fmt: skip
        with self.lock:
            self.namespace_of[run_id] = ns
            self.started.append(run_id)
        if scoped and frng.random() < 0.08:
            self.probe(scoped, frng)
        for op in input["plan"]:  # one signal per wait, each sent once, some before the wait (D2)
            if op[0] == "signal":
                with self.lock:
                    self.signals_due.append((time.time() + rng.uniform(0, 3), run_id))
        if rng.random() < 0.05:  # a duplicate delivery of a recent run's turn (R6, F15)
            victim = rng.choice(self.started[-50:])
            with contextlib.suppress(Exception):
                execute_run.apply_async((victim,), retry=False)
                self.events.write("dup", run=victim)
                self.count("duplicate_deliveries")
        if rng.random() < 0.03:  # a cancel of a recent run, wherever it is (D6)
            self.cancel(engine, rng.choice(self.started[-100:]))

    def start_control(self, engine: Any, n: int, workflow: str, input: dict[str, Any], priority: int) -> None:
        """Start the load's ``n``-th run, a control run (X6, X7, X8), on the default
        namespace's engine with ``priority``; a debounced start that went into another
        run writes ``debounce_fold`` in place of ``start``."""
        run_id = f"s{n:06d}"
        t_req = time.time()
        try:
            run = self._db(lambda: engine.start(workflow, input, run_id=run_id, priority=priority))
        except Exception as exc:
            numbered = {"dkey": input["dkey"], "n": input["n"]} if "dkey" in input else {}
            self.events.write("start_failed", run=run_id, error=repr(exc), t_req=t_req, **numbered)
            self.count("start_failed")
            return
        if run.run_id != run_id:  # folded into its key's open run (X7)
            self.events.write(
                "debounce_fold", run=run_id, into=run.run_id, wf=workflow, dkey=input["dkey"], n=input["n"],
                t_req=t_req,
            )  # fmt: skip
            self.count("debounce_folds")
            return
        extra = {"dkey": input["dkey"], "n": input["n"]} if "dkey" in input else {}
        self.events.write(
            "start", run=run_id, wf=workflow, key=input["key"], plan=input["plan"], t_req=t_req, ns="default",
            priority=priority, **extra,
        )  # fmt: skip
        with self.lock:
            self.namespace_of[run_id] = "default"
            self.started.append(run_id)

    def probe(self, scoped: dict[str, Any], rng: random.Random) -> None:
        """Probe a recent run through a scoped engine (D10): one of another
        namespace with get, start of its id, signal, cancel or wake (each must
        say "no such run" or "id in use", and reveal nothing), or one of its
        own with get (it must be found). The checker judges the outcome."""
        from durable_singleton.exceptions import DurableSingletonError, RunIdInUseError, RunNotFoundError

        with self.lock:
            run_id = rng.choice(self.started[-300:])
            owner = self.namespace_of.get(run_id)
        ns = rng.choice(sorted(scoped))
        engine = scoped[ns]
        op = "get" if ns == owner else rng.choice(("get", "start", "signal", "cancel", "wake"))
        calls: dict[str, Callable[[], Any]] = {
            "get": lambda: engine.get(run_id),
            "start": lambda: engine.start("soak-l1", {"key": "probe", "plan": []}, run_id=run_id),
            "signal": lambda: engine.signal(run_id, "probe", {"from": ns}),
            "cancel": lambda: engine.cancel(run_id),
            "wake": lambda: engine.wake(run_id),
        }
        got: dict[str, Any] | None = None
        text = ""
        try:
            found = self._db(calls[op], attempts=6)
            outcome = "returned"
            secret = found.input.get("secret") if isinstance(found.input, dict) else None
            got = {"ns": found.namespace, "run": found.run_id, "secret": secret, "status": found.status}
        except RunIdInUseError as exc:
            outcome, text = "in_use", str(exc)
        except RunNotFoundError as exc:
            outcome, text = "not_found", str(exc)
        except DurableSingletonError as exc:
            outcome, text = f"typed:{type(exc).__name__}", str(exc)
        except Exception as exc:
            outcome, text = "error", repr(exc)
        self.events.write("ns_probe", run=run_id, ns=ns, owner=owner, op=op, outcome=outcome, got=got, text=text[:500])
        self.count("namespace_probes")

    def stepped_loop(self) -> None:
        """Tick, and start runs, on an engine whose process clock steps (R8).

        Each step first lets the engine correct its clock to the database's,
        then moves its process clock by one of :data:`CLOCK_STEPS` (what an
        NTP step or a resumed VM does between two corrections); the engine
        ticks twice, then starts a run on a limit-1 key and ticks twice more.
        """
        from datetime import timedelta

        from django.db import connection

        from durable_singleton.core import StoreClock

        engine = self.engine()
        clock = engine.now
        assert isinstance(clock, StoreClock)
        honest = clock._local
        rng = random.Random(self.args.seed + 5)
        n = 0
        while not self.stop_all.is_set():
            delta = rng.choice(CLOCK_STEPS)
            with contextlib.suppress(Exception):
                clock._local = honest
                clock.correct()
            clock._local = lambda d=delta: honest() + timedelta(seconds=d)  # type: ignore[misc]
            self.events.write("clock_step", seconds=delta)
            self.count("clock_steps")
            for turn in range(4):
                if turn == 2 and not self.stop_load.is_set():
                    n += 1
                    run_id = f"x{n:06d}"
                    key = f"l1-k{rng.randrange(self.args.keys)}"
                    plan = [["work", rng.randint(0, 20)]]
                    t_req = time.time()
                    try:
                        self._db(lambda: engine.start("soak-l1", {"key": key, "plan": plan}, run_id=run_id))  # noqa: B023
                    except Exception as exc:
                        self.events.write("start_failed", run=run_id, error=repr(exc))
                        self.count("start_failed")
                    else:
                        self.events.write(
                            "start", run=run_id, wf="soak-l1", key=key, plan=plan, t_req=t_req, ns="default",
                            stepped=delta,
                        )  # fmt: skip
                        with self.lock:
                            self.namespace_of[run_id] = "default"
                            self.started.append(run_id)
                self.tick_once(engine, "stepped_ticks")
                self.stop_all.wait(self.args.tick * rng.uniform(0.8, 1.2))
        connection.close()

    def purge_children(self, engine: Any, rng: random.Random) -> None:
        """Delete the finished children of soak-retain parents that stored their
        outcome (O2; a child deleted before its parent saw it fails the parent,
        as documented): by ``purge_finished`` on the child's own key
        (retention's and ``durable_purge``'s path) or by the store's
        ``delete_run`` (the admin's), each listed in an event."""
        from datetime import timedelta

        from durable_singleton.models import Run, Step
        from durable_singleton.retention import purge_finished

        cutoff = engine.now() - timedelta(seconds=0.3)
        finished = list(
            Run.objects.filter(workflow_name="soak-rchild", status__in=TERMINAL, finished_at__lt=cutoff).values_list(
                "run_id", "parent_run_id", "singleton_key"
            )
        )
        if not finished:
            return
        seen = set(
            Step.objects.filter(
                run_id__in={parent for _, parent, _ in finished}, name="durable:child-outcome"
            ).values_list("run_id", flat=True)
        )
        for run_id, parent, key in finished:
            if parent not in seen:
                continue
            if rng.random() < 0.5:
                how = "purge"
                deleted = purge_finished(engine, before=cutoff, workflow="soak-rchild", key=key).runs
            else:
                how, deleted = "delete_run", int(engine.store.delete_run(run_id) is not None)
            self.events.write("purge", how=how, runs=[run_id], deleted=deleted)
            self.count("children_purged", deleted)

    def cancel(self, engine: Any, run_id: str) -> None:
        t_req = time.time()
        try:
            run = self._db(lambda: engine.cancel(run_id), attempts=10)
        except Exception as exc:
            self.events.write("cancel_failed", run=run_id, error=repr(exc))
            return
        self.events.write("cancel", run=run_id, t_req=t_req, status=run.status, requested=run.cancel_requested)
        self.count("cancels")

    def service_loop(self) -> None:
        """Send due signals and retry the runs failed by a flaky step (D2, D9)."""
        from django.db import connection

        from durable_singleton.exceptions import DurableSingletonError
        from durable_singleton.models import Run
        from durable_singleton.runtime import get_engine

        engine = get_engine()
        last_retry = last_purge = 0.0
        unknown_retries: dict[str, Any] = {}  # run id -> its finished_at when a retry of it raised
        prng = random.Random(self.args.seed + 6)
        while not self.stop_all.is_set():
            now = time.time()
            with self.lock:
                due = [s for s in self.signals_due if s[0] <= now]
                self.signals_due = [s for s in self.signals_due if s[0] > now]
            for _, run_id in due:
                try:
                    self._db(lambda: engine.signal(run_id, "go", {"at": time.time()}), attempts=1)  # noqa: B023
                    self.events.write("signal", run=run_id)
                    self.count("signals")
                except DurableSingletonError as exc:
                    status = self._db(lambda: engine.get(run_id).status, attempts=5)  # noqa: B023
                    if status == "failed":  # failed by a flaky step: the retry brings it back; signal it then
                        with self.lock:
                            self.signals_due.append((now + 0.5, run_id))
                    else:  # ended meanwhile (cancelled, timed out)
                        self.events.write("signal_refused", run=run_id, error=repr(exc), status=status)
                except Exception:
                    with self.lock:
                        self.signals_due.append((now + 0.5, run_id))
                    with contextlib.suppress(Exception):
                        connection.close()
            if now - last_retry > 1.0:
                last_retry = now
                try:
                    # A retry whose call raised (its commit's reply lost on a fault, then its
                    # second try refused: the run was no longer failed) may have been stored:
                    # it was if the failure it answered is gone (the row's finished_at moved,
                    # reset_for_retry clears it), and its line is written now (D9).
                    for run_id, finished in list(unknown_retries.items()):
                        row = Run.objects.filter(run_id=run_id).values_list("status", "finished_at").first()
                        del unknown_retries[run_id]
                        if row is None or row[0] != "failed" or row[1] != finished:
                            self.events.write("retry", run=run_id, verified=True)
                            self.count("retries")
                    failed = list(
                        Run.objects.filter(status="failed", workflow_name__startswith="soak-").values_list(
                            "run_id", "error", "finished_at"
                        )
                    )
                    for run_id, error, finished in failed:
                        if (error or {}).get("type") == "FlakyStepError":
                            unknown_retries[run_id] = finished
                            engine.retry(run_id)
                            del unknown_retries[run_id]
                            self.events.write("retry", run=run_id)
                            self.count("retries")
                except Exception:
                    with contextlib.suppress(Exception):
                        connection.close()
            if "retention" in self.features and now - last_purge > 1.0:
                last_purge = now
                try:
                    self.purge_children(engine, prng)
                except Exception as exc:
                    self.events.write("purge_failed", error=repr(exc))
                    with contextlib.suppress(Exception):
                        connection.close()
            self.stop_all.wait(0.1)
        connection.close()

    def supervise(self) -> None:
        """Start again, within about a second, every worker group that exited:
        killed by a fault, or exited by itself (a Celery worker can end with
        "Unrecoverable error" when its broker restarts), as systemd or
        Kubernetes would in a deployment."""
        while not self.stop_all.wait(1.0):
            for worker in self.workers:
                if worker.alive():
                    continue
                code = worker.proc.returncode if worker.proc else None
                self.events.write("worker_exit", name=worker.name, code=code)
                self.count("worker_exits_by_itself" if code not in (-signal.SIGKILL,) else "worker_restarts")
                worker.start()
                try:
                    worker.wait_ready()
                except RuntimeError as exc:  # still starting (its broker away): it retries by itself
                    self.events.write("worker_slow_start", name=worker.name, error=str(exc)[-300:])

    # -- faults ------------------------------------------------------------

    def fault_loop(self, db: Any, redis: Any, seconds: float, until_runs: int | None = None) -> None:
        """Inject a random fault every ``--fault-every`` seconds (on average) for
        ``seconds``, or (``until_runs``) until that many runs were started if
        sooner. Runs on the main thread: a server restarted here gets a
        parent-death signal tied to this thread (tools/services.py), which
        outlives it."""
        from django.db import connection

        rng = self.fault_rng
        kinds = fault_kinds(self.args.db)
        lease = self.args.lease
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            if until_runs is not None and len(self.started) >= until_runs:
                break
            self.stop_faults.wait(min(left, self.args.fault_every * rng.uniform(0.5, 1.5)))
            self.loads.append(os.getloadavg()[0])
            if time.monotonic() >= until:
                break
            kind = rng.choice(kinds)
            try:
                if kind == "kill_pool":
                    worker = rng.choice([w for w in self.workers if w.alive()])
                    pool = [p for p in worker.pool() if p not in self.frozen]
                    if pool:
                        pid = rng.choice(pool)
                        os.kill(pid, signal.SIGKILL)
                        self.events.write("fault", kind=kind, pids=[pid], until=time.time())
                elif kind == "kill_worker":
                    worker = rng.choice([w for w in self.workers if w.alive()])
                    t = time.time()
                    pids = worker.kill_group()  # the supervisor starts it again
                    self.events.write("fault", kind=kind, pids=pids, t=t, until=t)
                elif kind in ("freeze_short", "freeze_past_lease"):
                    pause = rng.uniform(0.3, lease * 0.4) if kind == "freeze_short" else lease + rng.uniform(1, 3)
                    worker = rng.choice([w for w in self.workers if w.alive()])
                    pool = [p for p in worker.pool() if p not in self.frozen]
                    if pool:
                        threading.Thread(target=self._freeze, args=(kind, rng.choice(pool), pause)).start()
                elif kind == "redis_restart":
                    t = time.time()
                    redis.restart()
                    self.events.write("fault", kind=kind, t=t, until=time.time())
                elif kind == "db_restart":
                    t = time.time()
                    db.restart()
                    self.events.write("fault", kind=kind, t=t, until=time.time())
                elif kind == "db_kill_connections":
                    killed = self._kill_connections(rng.randint(1, 3))
                    self.events.write("fault", kind=kind, connections=killed, until=time.time())
                self.count(f"fault:{kind}")
                print(f"soak: {seconds - (until - time.monotonic()):.0f} s, {len(self.started)} runs started, "
                      f"fault {kind}", flush=True)  # fmt: skip
            except Exception as exc:
                self.events.write("fault_error", kind=kind, error=repr(exc))
                self.count("fault_errors")
                with contextlib.suppress(Exception):
                    connection.close()
        connection.close()

    def _freeze(self, kind: str, pid: int, seconds: float) -> None:
        with self.lock:
            self.frozen.add(pid)
        t = time.time()
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # it died since it was chosen (a kill fault): nothing to thaw
            with self.lock:
                self.frozen.discard(pid)
            return
        try:
            self.stop_all.wait(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.events.write("fault", kind=kind, pids=[pid], t=t, until=time.time())
            with self.lock:
                self.frozen.discard(pid)

    def _kill_connections(self, n: int) -> int:
        from django.db import connection

        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                )
                pids = [row[0] for row in cursor.fetchall()]
                chosen = random.sample(pids, min(n, len(pids)))
                for pid in chosen:
                    cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            else:
                cursor.execute(
                    "SELECT id FROM information_schema.processlist WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
                ids = [row[0] for row in cursor.fetchall()]
                chosen = random.sample(ids, min(n, len(ids)))
                for id_ in chosen:
                    with contextlib.suppress(Exception):
                        cursor.execute(f"KILL CONNECTION {int(id_)}")
        return len(chosen)

    # -- the whole soak ----------------------------------------------------

    def active(self) -> int:
        """Count the runs not yet ended: active ones, and those failed by their
        flaky step that the service loop has yet to retry."""
        from durable_singleton.models import Run

        def count() -> int:
            failed = Run.objects.filter(status="failed").values_list("error", flat=True)
            retrying = sum(1 for error in failed if (error or {}).get("type") == "FlakyStepError")
            return Run.objects.exclude(status__in=TERMINAL).count() + retrying

        return int(self._db(count))

    def run(self, db: Any, redis: Any) -> dict[str, Any]:
        args = self.args
        threads = [threading.Thread(target=self.tick_loop, args=(n,), name=f"tick{n}") for n in range(3)]
        if "clock" in self.features:
            threads.append(threading.Thread(target=self.stepped_loop, name="stepped"))
        threads.append(threading.Thread(target=self.service_loop, name="service"))
        threads.append(threading.Thread(target=self.supervise, name="supervisor"))
        loader = threading.Thread(target=self.load_loop, name="load")
        began = time.time()
        for thread in [*threads, loader]:
            thread.start()
        self.fault_loop(db, redis, args.seconds)
        if len(self.started) < args.min_runs and args.max_seconds > args.seconds:
            # A loaded machine started fewer runs: the load and the faults go on (--max-seconds).
            print(
                f"soak: {len(self.started)} runs started in {args.seconds:g} s; going on until {args.min_runs} "
                f"or {args.max_seconds:g} s in all",
                flush=True,
            )
            self.fault_loop(db, redis, args.max_seconds - args.seconds, until_runs=args.min_runs)
        self.stop_load.set()
        loader.join()
        if "schedules" in self.features:  # no window after the load: the drain can end (S17)
            from durable_singleton.runtime import get_engine
            from durable_singleton.schedules import declared_schedules, pause_schedule, schedule_store_for

            from .workflows import SCHEDULE

            engine = get_engine()
            # Every declared schedule: the test project's every-15-minutes syncs too, whose
            # window at a quarter hour could otherwise start a run as the drain ends.
            for declared in declared_schedules(engine):
                self._db(lambda name=declared.name: pause_schedule(engine, name))
            row = self._db(lambda: schedule_store_for(engine.store).get(SCHEDULE.name))
            cursor = row.next_fire_at.timestamp() if row is not None and row.next_fire_at is not None else None
            self.events.write("schedule_paused", name=SCHEDULE.name, cursor=cursor)  # the first window not yet fired
        thawed_by = time.monotonic() + self.args.lease + 10  # every freeze ends within lease + 3 s
        while self.frozen and time.monotonic() < thawed_by:
            time.sleep(0.1)
        load_end = time.time()
        self.events.write("load_end")
        drain_deadline = time.monotonic() + args.drain
        while (left := self.active()) and time.monotonic() < drain_deadline:
            print(f"soak: draining, {left} runs active", flush=True)
            time.sleep(2.0)
        self.events.write("drain_end", active=left)
        self.stop_all.set()
        for thread in threads:
            thread.join()
        return {"load_seconds": load_end - began, "drain_seconds": time.time() - load_end, "active_left": left}

    def dump(self) -> None:
        from durable_singleton.models import (
            QuotaMembership,
            Run,
            ScheduleFiring,
            SingletonKey,
            Step,
            ThrottleAdmission,
        )

        def epoch(value: Any) -> float | None:
            return value.timestamp() if value is not None else None

        runs = [
            {**row, **{k: epoch(row[k]) for k in ("created_at", "admitted_at", "finished_at")}}
            for row in Run.objects.values(
                "run_id", "workflow_name", "singleton_key", "singleton_limit", "status", "error", "created_at",
                "admitted_at", "finished_at", "fencing_token", "attempts", "recoveries", "parent_run_id",
                "cancel_requested", "step_count", "namespace", "output", "quota_slot", "priority", "throttle_keys",
                "debounce_key", "not_before",
            )
        ]  # fmt: skip
        for row in runs:
            row["not_before"] = epoch(row["not_before"])
        # The throttle admissions the tick's retention has not deleted yet (X6b).
        admissions = [
            {**row, "admitted_at": epoch(row["admitted_at"])}
            for row in ThrottleAdmission.objects.values("throttle", "key", "run_id", "admitted_at")
        ]
        # Each run's quota keys (X3b): its place (tag, sub-key, weight, X4), slot and last token (X3f).
        memberships = [
            {**row, "created_at": epoch(row["created_at"])}
            for row in QuotaMembership.objects.values(
                "run_id", "quota", "key", "slot", "fencing_token", "sub_key", "weight", "tag", "created_at"
            )
        ]
        steps = [
            {**row, "finished_at": epoch(row["finished_at"])}
            for row in Step.objects.values("run_id", "position", "name", "finished_at", "result")
        ]
        keys = list(SingletonKey.objects.values("workflow_name", "key", "last_token"))
        firings = [
            {**row, "window_at": epoch(row["window_at"]), "created_at": epoch(row["created_at"])}
            for row in ScheduleFiring.objects.values(
                "schedule__name", "window_at", "run_id", "outcome", "detail", "created_at"
            )
        ]
        (self.out / "final.json").write_text(
            json.dumps(
                {
                    "runs": runs,
                    "steps": steps,
                    "keys": keys,
                    "firings": firings,
                    "memberships": memberships,
                    "throttle_admissions": admissions,
                },
                default=str,
            )
        )


def _commit() -> str | None:
    """Return the commit the soak's code is at (``git describe --always --dirty``), None outside git."""
    try:
        command = ["git", "describe", "--always", "--dirty", "--abbrev=7"]
        found = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def _is_transient(exc: BaseException) -> bool:
    from django.db import DatabaseError, InterfaceError, OperationalError

    return isinstance(exc, (OperationalError, InterfaceError, DatabaseError, ConnectionError, OSError))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=DATABASES, default="postgresql")
    parser.add_argument("--seconds", type=float, default=120.0, help="load phase, seconds (faults run meanwhile)")
    parser.add_argument("--rate", type=float, default=15.0, help="runs started per second")
    parser.add_argument("--keys", type=int, default=6, help="keys per workflow")
    parser.add_argument("--fault-every", type=float, default=3.0, help="mean seconds between faults")
    parser.add_argument("--lease", type=float, default=4.0, help="LEASE_SECONDS of the workers, seconds")
    parser.add_argument("--tick", type=float, default=0.5, help="seconds between ticks of each of the 3 tick loops")
    parser.add_argument("--drain", type=float, default=90.0, help="at most this many seconds to let runs finish")
    parser.add_argument("--min-runs", type=int, default=0, help="fail unless at least this many runs were started")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="go on past --seconds until --min-runs runs were started, for at most this many seconds in all "
        "(a loaded machine starts runs more slowly; default: --seconds, no extension)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default artifacts/soak-<db>-<time>)")
    parser.add_argument("--keep", action="store_true", help="keep the servers' folder")
    parser.add_argument(
        "--features",
        default=",".join(FEATURES),
        help=f"comma-separated workload of #18 and #20 ({', '.join(FEATURES)}; 'none' for none; default all)",
    )
    args = parser.parse_args(argv)
    chosen = [] if args.features.strip() in ("", "none") else [f.strip() for f in args.features.split(",")]
    unknown = sorted(set(chosen) - set(FEATURES))
    if unknown:
        parser.error(f"--features: unknown {', '.join(unknown)} (choose from {', '.join(FEATURES)}, or none)")
    args.features = tuple(f for f in FEATURES if f in chosen)
    if args.max_seconds is None:
        args.max_seconds = args.seconds
    if args.max_seconds < args.seconds:
        parser.error(f"--max-seconds ({args.max_seconds:g}) is shorter than --seconds ({args.seconds:g})")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    return args


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # through the finally blocks that stop workers and servers


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "artifacts" / f"soak-{args.db}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("audit.jsonl", "events.jsonl", "final.json", "summary.json"):
        (out / name).unlink(missing_ok=True)
    services = _services()
    root = Path(tempfile.mkdtemp(prefix="ds-soak-"))
    root.chmod(0o755)
    print(
        f"soak: --db {args.db} --seconds {args.seconds:g} --max-seconds {args.max_seconds:g} --rate {args.rate:g} "
        f"--seed {args.seed} "
        f"--features {','.join(args.features) or 'none'}; output {out}"
    )
    if args.db == "sqlite":
        db: Any = SqliteFile(out / "soak.sqlite3")
    else:
        db = services.start_postgres(root) if args.db == "postgresql" else services.start_mariadb(root)
    redis = services.start_redis(root)
    env = {
        "DJANGO_SETTINGS_MODULE": "soak.settings",
        "DATABASE_URL": db.url,
        "CELERY_BROKER_URL": redis.url,
        "DURABLE_DISPATCH": "celery",
        "SOAK_AUDIT": str(out / "audit.jsonl"),
        "SOAK_DIR": str(out),
        "DURABLE_LEASE_SECONDS": str(args.lease),
        "DURABLE_LEASE_RENEW_SECONDS": str(max(args.lease / 4, 0.5)),
        "DURABLE_TICK_SECONDS": str(args.tick),
        "DATABASE_CONN_MAX_AGE": "60",  # persistent connections, as a deployment keeps them
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(ROOT),
        "SOAK_FEATURES": ",".join(args.features),  # soak.workflows declares the schedule only with it
    }
    os.environ.update(env)
    soak = Soak(args, out)
    summary: dict[str, Any] = {
        "db": args.db,
        "seed": args.seed,
        "args": {k: str(v) for k, v in vars(args).items()},
        "commit": _commit(),
        "cores": os.cpu_count(),
    }
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        (out / "workers").mkdir(exist_ok=True)
        soak.workers = [Worker(f"soak-{group}", dict(os.environ), out / "workers") for group in ("a", "b")]
        for worker in soak.workers:
            worker.start()
        for worker in soak.workers:
            worker.wait_ready()
        summary.update(soak.run(db, redis))
        for worker in soak.workers:  # quiescent before the dump: nothing writes after it
            worker.stop()
        soak.dump()
    finally:
        soak.stop_load.set()  # the threads end (after an error or SIGTERM too), then the workers stop
        soak.stop_all.set()
        for worker in soak.workers:
            worker.stop()
        soak.events.close()
        redis.stop()
        db.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    from . import check

    summary["driver"] = dict(sorted(soak.counts.items()))
    if soak.loads:
        loads = sorted(soak.loads)
        summary["load_average"] = {"min": loads[0], "median": loads[len(loads) // 2], "max": loads[-1]}
    report = check.check(out)
    summary.update(report)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(check.render(summary))
    ok = not report["violations"] and report["runs"] >= args.min_runs and not summary.get("active_left")
    print(f"soak: {'PASS' if ok else 'FAIL'} ({out / 'summary.json'})")
    return 0 if ok else 1
