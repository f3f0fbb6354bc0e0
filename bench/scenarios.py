"""The scenarios of issue #4, each returning its raw figures as a dict.

Times are wall-clock epoch seconds (``time.time()``) taken in the runner and
in the bodies on the same machine; durations are reported in milliseconds.
Every body is audited (:mod:`bench.audit`), and every scenario reports the
highest concurrency seen per key.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, connections

from durable_singleton.engine import Engine
from durable_singleton.models import Run

from . import audit
from .procs import ROOT, tick_times, wait_until
from .roundtrips import RoundTrips
from .workflows import DEBOUNCED, WORKFLOW


def pct(values: Sequence[float], q: float) -> float:
    """Return the ``q`` quantile (0..1) of ``values``, linearly interpolated; NaN if empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    """Return count, p50, p99, mean and max of ``seconds``, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": pct(ms, 0.5),
        "p99_ms": pct(ms, 0.99),
        "mean_ms": sum(ms) / len(ms) if ms else math.nan,
        "max_ms": max(ms) if ms else math.nan,
    }


def concurrency_report(tag: str, limit: int | None) -> dict[str, Any]:
    """Return the highest concurrency seen over the keys of scenario ``tag``, and the keys over ``limit``."""
    seen = audit.max_concurrency(tag)
    top = max(seen.values(), default=0)
    over = sorted(k for k, n in seen.items() if limit is not None and n > limit)
    return {"limit": limit, "keys": len(seen), "max_seen": top, "keys_over_limit": over[:20], "ok": not over}


def sequence_handoffs(events: Sequence[audit.Event], terminal: dict[str, float] | None = None) -> dict[str, Any]:
    """Return the handoffs of one key's serial bodies: next entry minus previous exit (and terminal)."""
    entered: dict[str, float] = {}
    left: dict[str, float] = {}
    for e in events:
        (entered if e.kind == "E" else left)[e.run] = e.at
    order = sorted(entered, key=entered.__getitem__)
    by_exit = []
    by_terminal = []
    for before, after in itertools.pairwise(order):
        if before in left:
            by_exit.append(entered[after] - left[before])
        if terminal is not None and before in terminal:
            by_terminal.append(entered[after] - terminal[before])
    out: dict[str, Any] = {"exit_to_entry": summary_ms(by_exit)}
    if terminal is not None:
        out["terminal_to_entry"] = summary_ms(by_terminal)
    return out


def handoff_stages(events: Sequence[audit.Event], stages: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Split each handoff into traced stages (``--trace``): where the time between two bodies goes.

    exit -> fin (settle), fin -> sent (push: wake + publish), sent -> recv
    (broker to a worker), recv -> admit (the claim: the store's ``begin_turn``),
    admit -> entry (load steps, lease keeper, body start); fin -> admit when
    the successor ran inline in the releasing worker (no publish).
    """
    entered = {e.run: e.at for e in events if e.kind == "E"}
    left = {e.run: e.at for e in events if e.kind == "X"}
    order = sorted(entered, key=entered.__getitem__)
    names = ("exit_fin", "fin_sent", "sent_recv", "recv_admit", "admit_entry", "fin_admit_inline")
    parts: dict[str, list[float]] = {k: [] for k in names}
    for before, after in itertools.pairwise(order):
        fin = min(stages.get(before, {}).get("fin", [math.inf]))
        # With bench/proposals.py P1 the claim admits without the run_admitted signal: take the entry.
        admit = max((t for t in stages.get(after, {}).get("admit", []) if t <= entered[after]), default=entered[after])
        sent = min((t for t in stages.get(after, {}).get("sent", []) if fin <= t <= admit), default=math.nan)
        if math.isnan(sent) and before in left and not math.isinf(fin) and not math.isnan(admit):
            # No publish between the release and the admission: the successor ran inline (P2).
            parts["exit_fin"].append(fin - left[before])
            parts["fin_admit_inline"].append(admit - fin)
            parts["admit_entry"].append(entered[after] - admit)
            continue
        recv = min((t for t in stages.get(after, {}).get("recv", []) if t >= sent), default=math.nan)
        if before not in left or math.isinf(fin) or math.isnan(admit + sent + recv) or recv > admit:
            continue
        parts["exit_fin"].append(fin - left[before])
        parts["fin_sent"].append(sent - fin)
        parts["sent_recv"].append(recv - sent)
        parts["recv_admit"].append(admit - recv)
        parts["admit_entry"].append(entered[after] - admit)
    return {k: summary_ms(v) for k, v in parts.items()}


def last_exit(tag: str) -> float:
    """Return the time of the last body exit of scenario ``tag``."""
    return max((e.at for e in audit.events(tag) if e.kind == "X"), default=math.nan)


def new_tag(name: str) -> str:
    """Return a fresh scenario tag (a run of the bench never reuses Redis keys)."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


@dataclass
class Sizes:
    """How big each scenario is; the defaults are the issue's sizes."""

    round_trips: int = 500
    chain_links: int = 2000
    independent: int = 5000
    handoff_runs: int = 500
    hot_runs: int = 2000
    many_runs: int = 2000
    many_keys: int = 1000
    backlog: int = 10_000
    backlog_window: float = 30.0
    claim_sizes: tuple[int, ...] = (10, 1000, 10_000)
    #: The waiters on one key of python -m bench.depth, on each database (issue #32).
    depth_sizes: tuple[int, ...] = (10, 10_000, 100_000)
    claim_reps: int = 200
    lane_idle_probes: int = 60
    burst_producers: int = 1
    peer_hot_runs: int = 2000
    peer_many_runs: int = 2000
    peer_many_keys: int = 1000

    def scaled(self, factor: float) -> Sizes:
        """Return these sizes multiplied by ``factor`` (at least 10 each; the window at least 5 s)."""

        def n(value: int) -> int:
            return max(10, int(value * factor))

        return Sizes(
            round_trips=n(self.round_trips),
            chain_links=n(self.chain_links),
            independent=n(self.independent),
            handoff_runs=n(self.handoff_runs),
            hot_runs=n(self.hot_runs),
            many_runs=n(self.many_runs),
            many_keys=n(self.many_keys),
            backlog=n(self.backlog),
            backlog_window=max(5.0, self.backlog_window * factor),
            claim_sizes=tuple(sorted({10, n(1000), n(10_000)})),
            depth_sizes=tuple(sorted({10, n(10_000), n(100_000)})),
            claim_reps=n(self.claim_reps),
            lane_idle_probes=n(self.lane_idle_probes),
            burst_producers=self.burst_producers,
            peer_hot_runs=n(self.peer_hot_runs),
            peer_many_runs=n(self.peer_many_runs),
            peer_many_keys=n(self.peer_many_keys),
        )


# --------------------------------------------------------------------------
# 1. Baseline: plain Celery
# --------------------------------------------------------------------------


def baseline(sizes: Sizes) -> dict[str, Any]:
    """Round trip of a no-op task (p50, p99), a serial chain (links/s), independent no-ops (tasks/s)."""
    from .tasks import count, link, noop

    for _ in range(30):  # warm every worker process and connection
        noop.delay().get(timeout=30)
    trips = []
    for _ in range(sizes.round_trips):
        started = time.perf_counter()
        noop.delay().get(timeout=30)
        trips.append(time.perf_counter() - started)

    tag = new_tag("chain")
    r = audit.client()
    started_at = time.time()
    link.delay(sizes.chain_links - 1, tag)
    popped = r.blpop([f"bench:{tag}:done"], timeout=300)
    if popped is None:
        raise TimeoutError("the serial chain did not finish in 300 s")
    chain_seconds = float(popped[1]) - started_at

    tag = new_tag("independent")
    started_at = time.time()
    for _ in range(sizes.independent):
        count.delay(tag)
    sent_at = time.time()
    wait_until(lambda: int(r.get(f"bench:{tag}:count") or 0) >= sizes.independent, 300, "independent tasks")
    independent_seconds = float(r.get(f"bench:{tag}:last") or "nan") - started_at
    return {
        "round_trip": summary_ms(trips),
        "chain": {
            "links": sizes.chain_links,
            "seconds": chain_seconds,
            "links_per_s": sizes.chain_links / chain_seconds,
            "ms_per_link": chain_seconds / sizes.chain_links * 1000,
        },
        "independent": {
            "tasks": sizes.independent,
            "send_seconds": sent_at - started_at,
            "seconds": independent_seconds,
            "tasks_per_s": sizes.independent / independent_seconds,
        },
    }


# --------------------------------------------------------------------------
# durable_singleton helpers
# --------------------------------------------------------------------------


def debounce_burst(engine: Engine, starts: int = 1000) -> dict[str, Any]:
    """X7 (#33): ``starts`` debounced starts on one key, one after another from this
    process, each with a new input; report the runs they created (the target: one),
    whether the run holds the last input, and each start's duration. The run is
    cancelled at the end (its quiet period is an hour: no body runs)."""
    key = f"debounce-{uuid.uuid4().hex[:8]}"
    tag = new_tag("debounce")
    seconds: list[float] = []
    ids: set[str] = set()
    for n in range(starts):
        began = time.perf_counter()
        ids.add(engine.start(DEBOUNCED, {"tag": tag, "key": key, "n": n}).run_id)
        seconds.append(time.perf_counter() - began)
    runs = list(Run.objects.filter(workflow_name=DEBOUNCED, singleton_key=key).values("run_id", "input"))
    for run in runs:
        engine.cancel(run["run_id"])
    # The same machine's plain start, for scale: delayed an hour (as the debounced run is), each
    # on its own key, then cancelled.
    plain: list[float] = []
    for n in range(starts // 5):
        began = time.perf_counter()
        run_id = engine.start(WORKFLOW, {"tag": tag, "key": f"{key}-{n}"}, not_before=3600).run_id
        plain.append(time.perf_counter() - began)
        engine.cancel(run_id)
    return {
        "starts": starts,
        "runs_created": len(runs),
        "run_ids_returned": len(ids),
        "newest_input_kept": bool(runs) and all(r["input"]["n"] == starts - 1 for r in runs),
        "start_ms": summary_ms(seconds),
        "plain_delayed_start_ms": summary_ms(plain),
    }


def start(engine: Engine, tag: str, key: str, **extra: Any) -> str:
    """Start one run of the bench workflow on ``key``; return its id."""
    return engine.start(WORKFLOW, {"tag": tag, "key": key, **extra}).run_id


def key_runs(key: str) -> Any:
    """Return the runs of the bench workflow on ``key``."""
    return Run.objects.filter(workflow_name=WORKFLOW, singleton_key=key)


def wait_parked(key: str, waiters: int, timeout: float) -> float:
    """Wait until every waiter of ``key`` has had its first turn and parked; return the seconds waited.

    The front waiter retries about once a second, so at any moment it may be
    running: all but one parked (suspended, or created parked deep in the
    queue), none pending with a turn on its way.
    """

    def parked() -> bool:
        runs = key_runs(key)
        # A start deep in the queue is created parked (pending, reason "singleton", no turn sent: S8a).
        deep = runs.filter(status="pending", park_reason="singleton")
        turn_pending = runs.filter(status="pending").exclude(park_reason="singleton").exists()
        return not turn_pending and runs.filter(status="suspended").count() + deep.count() >= waiters - 1

    return wait_until(parked, timeout, f"{waiters} waiters of {key} to park", every=0.25)


def start_parked_holder(engine: Engine, tag: str, key: str) -> str:
    """Start a holder of ``key`` that parks with its slot waiting for the signal ``release``."""
    run_id = start(engine, tag, key, park=True)
    wait_until(
        lambda: Run.objects.filter(pk=run_id, status="suspended").exists(), 60, f"holder of {key} to park", every=0.02
    )
    return run_id


def terminal_times(run_ids: Sequence[str]) -> dict[str, float]:
    """Return each finished run's ``finished_at`` as epoch seconds."""
    out: dict[str, float] = {}
    ids = list(run_ids)
    for chunk in range(0, len(ids), 1000):
        rows = Run.objects.filter(pk__in=ids[chunk : chunk + 1000]).values_list("run_id", "finished_at")
        out.update({run_id: at.timestamp() for run_id, at in rows if at is not None})
    return out


def hot_key(engine: Engine, name: str, runs: int) -> dict[str, Any]:
    """Queue ``runs`` runs on one key behind a working holder, release it, and drain (scenarios 2 and 3)."""
    tag = new_tag(name)
    key = tag
    plug = start(engine, tag, key, hold=True)
    wait_until(lambda: len(audit.events(tag)) >= 1, 60, "the holder's body", every=0.01)
    queued_at = time.time()
    ids = [start(engine, tag, key) for _ in range(runs)]
    started_seconds = time.time() - queued_at
    parked_seconds = wait_parked(key, runs, timeout=300)
    released_at = audit.release(tag)
    wait_until(lambda: audit.done_count(tag) >= runs + 1, 600, f"{runs} runs to drain", every=0.02)
    end = last_exit(tag)
    events = audit.events(tag)
    terminal = terminal_times([plug, *ids])
    traced = {}
    if os.environ.get("BENCH_TRACE") == "1":
        from . import trace

        traced = {"stages": handoff_stages(events, trace.stages())}
    return {
        **traced,
        "runs": runs,
        "start_seconds": started_seconds,
        "park_seconds": parked_seconds,
        "drain_seconds": end - released_at,
        "runs_per_s": runs / (end - released_at),
        "handoff": sequence_handoffs(events, terminal),
        "concurrency": concurrency_report(tag, 1),
    }


def many_keys(engine: Engine, runs: int, keys: int, *, bulk: bool = False) -> dict[str, Any]:
    """Start ``runs`` runs over ``keys`` keys (limit 1 each) and wait for all (scenario 4).

    ``bulk``: start them with ``engine.start_many`` in batches of 500 (one
    INSERT and one send per batch) instead of one ``start`` each.
    """
    tag = new_tag("many-bulk" if bulk else "many")
    started_at = time.time()
    if bulk:
        inputs = [{"tag": tag, "key": f"{tag}:{n % keys}"} for n in range(runs)]
        for first in range(0, runs, 500):
            engine.start_many(WORKFLOW, inputs[first : first + 500])
    else:
        for n in range(runs):
            start(engine, tag, f"{tag}:{n % keys}")
    sent_at = time.time()
    wait_until(lambda: audit.done_count(tag) >= runs, 600, f"{runs} runs over {keys} keys", every=0.02)
    seconds = last_exit(tag) - started_at
    first = min((e.at for e in audit.events(tag) if e.kind == "E"), default=math.nan)
    return {
        "runs": runs,
        "keys": keys,
        "start_seconds": sent_at - started_at,
        "first_entry_seconds": first - started_at,
        "seconds": seconds,
        "runs_per_s": runs / seconds,
        "concurrency": concurrency_report(tag, 1),
    }


# --------------------------------------------------------------------------
# 6. Lane isolation
# --------------------------------------------------------------------------


@dataclass
class LaneProbe:
    """Single runs on key B, one after the other: dispatch time per run."""

    engine: Engine
    tag: str = field(default_factory=lambda: new_tag("laneB"))
    dispatched: dict[str, float] = field(default_factory=dict)

    def probe(self, timeout: float = 120.0) -> None:
        """Start one run on key B and wait until its body has left."""
        before = time.time()
        run_id = start(self.engine, self.tag, f"{self.tag}:B")
        self.dispatched[run_id] = before
        popped = audit.client().blpop([f"bench:{self.tag}:done"], timeout=timeout)
        if popped is None:
            raise TimeoutError(f"run {run_id} on key B did not finish in {timeout:.0f}s")

    def delays(self) -> dict[str, Any]:
        """Return the start delays (dispatch to body entry) of the probes."""
        entered = {e.run: e.at for e in audit.events(self.tag) if e.kind == "E"}
        delays = [entered[r] - at for r, at in self.dispatched.items() if r in entered]
        return {**summary_ms(delays), "concurrency": concurrency_report(self.tag, 1)}


def tick_under_load_pull(engine: Engine, slots: int, window: float, tick_seconds: float) -> dict[str, Any]:
    """O5 for ``durable_worker``: the tick's period while bodies hold all
    ``slots`` worker threads for ``window`` seconds. The periods are the gaps
    between successive renewals of the tick's lease (its row's expiry moves
    at each tick, on the database's clock), read every 20 ms from this
    process; the p99 also as a ratio to ``tick_seconds`` (target: at most 2)."""
    from durable_singleton.models import Heartbeat
    from durable_singleton.stores.turns import TICK_LEASE

    tag = new_tag("ptick")
    for n in range(slots):
        start(engine, tag, f"{tag}-k{n}", hold=True)
    wait_until(
        lambda: sum(1 for e in audit.events(tag) if e.kind == "E") >= slots, 120, "every worker thread holding a body"
    )
    seen: list[Any] = []
    began = time.monotonic()
    while time.monotonic() - began < window:
        at = Heartbeat.objects.filter(name=TICK_LEASE).values_list("at", flat=True).first()
        if at is not None and (not seen or at != seen[-1]):
            seen.append(at)
        time.sleep(0.02)
    audit.release(tag)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(seen)]
    p99 = pct(gaps, 0.99) if gaps else math.nan
    return {
        "slots": slots,
        "window_s": window,
        "ticks": len(seen),
        "period_p50_s": pct(gaps, 0.5) if gaps else math.nan,
        "period_p99_s": p99,
        "period_max_s": max(gaps) if gaps else math.nan,
        "p99_ratio": p99 / tick_seconds,
    }


def tick_under_load(
    engine: Engine, slots: int, window: float, worker_logs: list[Any], tick_seconds: float
) -> dict[str, Any]:
    """O5: the tick's period while bodies hold all ``slots`` worker slots
    (workers x concurrency) for ``window`` seconds; the periods are the gaps
    between the ticks the Celery workers logged (``worker_logs``, Paths: the
    tick threads of their main processes, one at a time by the tick's lease),
    the p99 also as a ratio to ``tick_seconds`` (target: at most 2)."""
    tag = new_tag("tick")
    for n in range(slots):
        start(engine, tag, f"{tag}-k{n}", hold=True)
    wait_until(
        lambda: sum(1 for e in audit.events(tag) if e.kind == "E") >= slots, 120, "every worker slot holding a body"
    )
    began = time.time()
    time.sleep(window)
    ended = time.time()
    audit.release(tag)
    logs = [path.read_text(errors="replace") for path in worker_logs]
    times = [t for t in tick_times(*logs) if began <= t <= ended]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    p99 = pct(gaps, 0.99) if gaps else math.nan
    return {
        "slots": slots,
        "window_s": window,
        "ticks": len(times),
        "period_p50_s": pct(gaps, 0.5) if gaps else math.nan,
        "period_p99_s": p99,
        "period_max_s": max(gaps) if gaps else math.nan,
        "p99_ratio": p99 / tick_seconds,
    }


def lane_idle(engine: Engine, sizes: Sizes) -> dict[str, Any]:
    """Key B's start delay with nothing else running (scenario 6's reference)."""
    idle = LaneProbe(engine)
    for _ in range(3):
        idle.probe()
    idle.dispatched.clear()
    for _ in range(sizes.lane_idle_probes):
        idle.probe()
        time.sleep(0.02)
    return {"idle": idle.delays()}


def burst(engine: Engine, sizes: Sizes, env: dict[str, str]) -> dict[str, Any]:
    """Land ``sizes.backlog`` runs on key A behind a parked holder while probing key B (scenario 6).

    The burst comes from separate producer processes (``bench/burst.py``).
    Returns the probes' delays, the burst's timings, and key A's tag, key and
    holder for the backlog scenario that follows.
    """
    tag = new_tag("laneA")
    key = tag
    holder = start_parked_holder(engine, tag, key)
    probes = LaneProbe(engine)
    for _ in range(3):
        probes.probe()
    probes.dispatched.clear()
    per = [sizes.backlog // sizes.burst_producers] * sizes.burst_producers
    per[0] += sizes.backlog - sum(per)
    started_at = time.time()
    producers = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.burst", tag, key, str(n)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        for n in per
    ]
    try:
        wait_until(
            lambda: (
                int(audit.client().get(f"bench:{tag}:producers") or 0) >= len(producers)
                or any(p.poll() is not None for p in producers)
            ),
            120,
            "the burst producers to start",
        )
        started_at = time.time()
        while any(p.poll() is None for p in producers):
            probes.probe()
            time.sleep(0.02)
        landed_at = time.time()

        def settled() -> bool:
            # Every turn sent has run: what is pending now was created parked (S8a).
            return not key_runs(key).filter(status="pending").exclude(park_reason="singleton").exists()

        while not settled():
            if time.time() - started_at > 900:
                raise TimeoutError("the burst's turns did not settle in 900 s")
            probes.probe()
            time.sleep(0.02)
        settled_at = time.time()
    finally:
        for p in producers:
            if p.poll() is None:
                p.kill()
            p.wait()
    reports = [json.loads(p.stdout.read() or b"{}") for p in producers if p.stdout is not None]
    return {
        "during_burst": probes.delays(),
        "burst": {
            "runs": sizes.backlog,
            "producers": sizes.burst_producers,
            "land_seconds": landed_at - started_at,
            "settle_seconds": settled_at - started_at,
            "starts_per_s": sizes.backlog / (landed_at - started_at),
            "producer_starts_per_s": sum(r.get("starts_per_s", 0) for r in reports),
            "producer_reports": reports,
        },
        "_key": key,
        "_tag": tag,
        "_holder": holder,
    }


# --------------------------------------------------------------------------
# 5. Backlog cost
# --------------------------------------------------------------------------

_STATS_SQL = (
    "SELECT queryid, left(query, 200), calls FROM pg_stat_statements "
    "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_XACT_SQL = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"


def _statements() -> tuple[dict[int, tuple[str, int]], int]:
    with connection.cursor() as cursor:
        cursor.execute(_STATS_SQL)
        calls = {qid: (query, n) for qid, query, n in cursor.fetchall()}
        cursor.execute(_XACT_SQL)
        xacts = int(cursor.fetchone()[0])
    return calls, xacts


def statement_rate(window: float) -> dict[str, Any]:
    """Count the database's statements (pg_stat_statements) and transactions over ``window`` seconds.

    The two snapshot reads themselves are subtracted.
    """
    before, xacts_before = _statements()
    started = time.monotonic()
    time.sleep(window)
    after, xacts_after = _statements()
    seconds = time.monotonic() - started
    deltas = []
    for qid, (query, calls) in after.items():
        delta = calls - before.get(qid, ("", 0))[1]
        if delta > 0:
            deltas.append((delta, query))
    deltas.sort(reverse=True)
    mine = sum(d for d, q in deltas if "pg_stat_statements" in q or "pg_stat_database" in q)
    total = sum(d for d, _ in deltas) - mine
    utility = sum(d for d, q in deltas if q.strip().upper() in ("BEGIN", "COMMIT", "ROLLBACK"))
    return {
        "window_seconds": seconds,
        "statements": total,
        "statements_per_s": total / seconds,
        "statements_per_s_without_begin_commit": (total - utility) / seconds,
        "transactions_per_s": (xacts_after - xacts_before - 2) / seconds,
        "top": [{"calls": d, "query": q} for d, q in deltas[:12] if "pg_stat_" not in q],
    }


def setup_claim_key(engine: Engine, waiters: int) -> dict[str, str]:
    """Start a parked holder and ``waiters`` waiters on a fresh key; wait until they parked."""
    tag = new_tag(f"claim{waiters}")
    key = tag
    holder = start_parked_holder(engine, tag, key)
    for _ in range(waiters):
        start(engine, tag, key)
    wait_parked(key, waiters, timeout=600)
    return {"tag": tag, "key": key, "holder": holder}


_EXPLAIN_ON = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_buffers = on",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_level = 'notice'",
    "SET client_min_messages = notice",
)
_EXPLAIN_OFF = ("SET auto_explain.log_min_duration = -1", "SET client_min_messages = DEFAULT")


def explained(alias: str, fn: Any) -> list[dict[str, Any]]:
    """Run ``fn()`` on PostgreSQL with ``auto_explain`` reporting every statement it sends, nested
    statements of functions included, as ``EXPLAIN (ANALYZE, BUFFERS)`` would: return the plans.

    Each plan: ``duration_ms``, ``buffers`` (the first node's line), ``query`` (its first 400
    characters) and ``plan`` (the text).
    Returns [] on another database.
    """
    conn = connections[alias]
    if conn.vendor != "postgresql":
        return []
    conn.ensure_connection()
    raw = conn.connection
    notes: list[str] = []

    def keep(diagnostic: Any) -> None:
        notes.append(str(diagnostic.message_primary or ""))

    raw.add_notice_handler(keep)
    try:
        with conn.cursor() as cursor:
            for sql in _EXPLAIN_ON:
                cursor.execute(sql)
        try:
            fn()
        finally:
            with conn.cursor() as cursor:
                for sql in _EXPLAIN_OFF:
                    cursor.execute(sql)
    finally:
        raw.remove_notice_handler(keep)
    plans = []
    for note in notes:
        if not note.startswith("duration:"):
            continue
        head, _, plan = note.partition("plan:")
        lines = plan.strip().splitlines()
        query = lines[0].removeprefix("Query Text: ") if lines and lines[0].startswith("Query Text:") else ""
        body = [line for line in lines if not line.startswith("Query Text:")]
        buffers = next((line.strip() for line in body if "Buffers:" in line), "")
        plans.append(
            {
                "duration_ms": float(head.split()[1]),
                "buffers": buffers,
                "query": query[:400],
                "plan": "\n".join(body)[:4000],
            }
        )
    return plans


def claim_costs(engine: Engine, keys: dict[int, dict[str, str]], reps: int) -> dict[str, Any]:
    """Time one claim (``begin_turn``) of the last waiter of each key and count its round trips.

    The key's holder is parked, so the claim reads the queue front and parks
    the waiter again: the denial path, in one transaction (S5). Sizes are
    interleaved so they share the machine's noise. Round trips are counted on
    the connection (:mod:`bench.roundtrips`, BEGIN and COMMIT included). On
    PostgreSQL five more claims at the smallest and at the largest size run
    under ``auto_explain`` (analyze, buffers, nested statements): the plans of
    every statement the median one sent (by server time) are in the result
    (``explain``), with the server time of each of the five.
    """
    store = engine.store
    alias = store.database
    settings = engine.settings
    tails = {}
    for size, info in keys.items():
        tail = (
            key_runs(info["key"])
            .filter(status__in=("suspended", "pending"), singleton_slot="waiter")
            .order_by("-created_at", "-run_id")
            .first()
        )
        if tail is None:
            raise RuntimeError(f"no parked waiter on {info['key']}")
        tails[size] = tail.run_id
    timings: dict[int, list[float]] = {size: [] for size in keys}
    statements: dict[int, list[int]] = {size: [] for size in keys}
    outcomes: dict[int, set[str]] = {size: set() for size in keys}

    def one(size: int, n: int, capture: bool) -> None:
        owner = f"bench-claim:{size}:{n}"
        options = {
            "lease_seconds": settings.LEASE_SECONDS,
            "limits": engine.limits(),
            "max_recoveries": settings.MAX_RECOVERIES,
            "retry": engine._retry_policy(),
        }
        with RoundTrips(connections[alias]) as trips:
            began = time.perf_counter()
            turn = store.begin_turn(tails[size], owner, **options)
            elapsed = time.perf_counter() - began
        if capture:
            statements[size].append(trips.total)
        else:
            timings[size].append(elapsed)
        outcomes[size].add(turn.state.name)

    for n in range(5):
        for size in keys:
            one(size, n, capture=True)
    for n in range(reps):
        for size in keys:
            one(size, n, capture=False)
    out: dict[str, Any] = {}
    for size in keys:
        out[str(size)] = {
            **summary_ms(timings[size]),
            "statements": max(statements[size]),
            "outcomes": sorted(outcomes[size]),
        }
    for size in sorted({min(keys), max(keys)}):
        # Five explained claims per size, interleaved with nothing else: the median one is kept.
        runs = [explained(alias, lambda size=size, n=n: one(size, reps + n, capture=True)) for n in range(5)]
        runs = sorted((r for r in runs if r), key=lambda plans: sum(p["duration_ms"] for p in plans))
        if runs:
            plans = runs[len(runs) // 2]
            out[str(size)]["explain"] = {
                "key": keys[size]["key"],
                "statements": len(plans),
                "duration_ms": round(sum(p["duration_ms"] for p in plans), 3),
                "duration_ms_of_each_claim": [round(sum(p["duration_ms"] for p in r), 3) for r in runs],
                "plans": plans,
            }
    return out


def killed_worker_reentry(engine: Engine, workers: Sequence[Any], timeout: float = 120.0) -> dict[str, Any]:
    """O6 at the default settings: a ``durable_worker`` holding a run is killed
    with SIGKILL; the delay from the kill to the run's body entered again in
    another worker (the dead process's registry row silent for
    ``WORKER_DEAD_SECONDS``, the tick's holder ends its leases, the tick's
    recovery re-drives the run), and the recoverer's log line naming the run
    and the dead owner (issue #31's target: within 15 s, logged).

    ``workers``: the :class:`bench.procs.Proc` of each worker (at least two);
    the one whose body holds the run is killed, its process group with it. The
    held body never leaves; the one entered again is released at the end.
    Raises :class:`TimeoutError` if the body is not entered again within
    ``timeout`` seconds."""
    import signal

    from durable_singleton.models import WorkerProcess

    tag = new_tag("kill9")
    run_id = start(engine, tag, f"{tag}-k", hold=True)

    def entries() -> list[audit.Event]:
        return [e for e in audit.events(tag) if e.kind == "E" and e.run == run_id]

    wait_until(lambda: bool(entries()), 60, "the body entered", every=0.02)
    pid = entries()[0].pid
    victim = next(w for w in workers if w.process.pid == pid)
    killed = time.time()
    os.killpg(pid, signal.SIGKILL)
    victim.process.wait(10)
    wait_until(lambda: len(entries()) >= 2, timeout, "the run's body entered again", every=0.02)
    again = entries()[1]
    audit.release(tag)
    logged = [
        line
        for w in workers
        if w is not victim
        for line in w.log.read_text(errors="replace").splitlines()
        if run_id in line and "dead worker" in line and f":{pid}" in line
    ]
    return {
        "reentry_s": round(again.at - killed, 2),
        "reentered_in_pid": again.pid,
        "logged": len(logged),
        "log_line": logged[0].strip() if logged else None,
        "dead_row_left": WorkerProcess.objects.filter(pid=pid).exists(),
        "worker_dead_seconds": engine.settings.WORKER_DEAD_SECONDS,
        "worker_heartbeat_seconds": engine.settings.WORKER_HEARTBEAT_SECONDS,
        "lease_seconds": engine.settings.LEASE_SECONDS,
    }
