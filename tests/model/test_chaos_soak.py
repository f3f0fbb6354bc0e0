"""Chaos: workers, ticks, cancels, sleeps, timeouts and duplicate deliveries
racing on real commits; bodies counted, tokens and admission order checked
(S5, S6, S7, S9, R2, R6, K1, D5, D6).

A soak, not a unit test: skipped unless ``DS_CHAOS=1`` (about a minute per
database), e.g. ``DS_CHAOS=1 CHAOS_RUNS=120 CHAOS_SEED=7 pytest tests/model/test_chaos_soak.py``.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from django.db import connections

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import RunNotFoundError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("DS_CHAOS"), reason="a soak: set DS_CHAOS=1 to run it"),
]


def _chaos(
    engine: Engine,
    registry: Registry,
    *,
    keys: int,
    limit: int,
    runs: int,
    seconds: float,
    timeout: float | None = None,
) -> dict[str, Any]:
    lock = threading.Lock()
    current: dict[str, int] = defaultdict(int)
    highest: dict[str, int] = defaultdict(int)
    first_token: dict[str, int] = {}
    entries: list[tuple[str, str, int | None]] = []
    step_calls: dict[tuple[str, int], int] = defaultdict(int)
    errors: list[BaseException] = []

    def step(x: Any) -> Any:
        with lock:
            step_calls[(x["run"], x["n"])] += 1
        time.sleep(random.random() * 0.01)
        return x

    registry.add_step("chaos:step", step)

    def body(ctx: Any, input: dict[str, Any]) -> Any:
        key = input["k"]
        with lock:
            current[key] += 1
            highest[key] = max(highest[key], current[key])
            entries.append((key, ctx.run_id, ctx.fencing_token))
            first_token.setdefault(ctx.run_id, ctx.fencing_token)
            assert first_token[ctx.run_id] == ctx.fencing_token, "a holder's token changed"
        try:
            for n in range(input["steps"]):
                ctx.step("chaos:step", {"run": ctx.run_id, "n": n})
                if input.get("sleep") == n:
                    ctx.sleep(0.05)
            if input.get("fail"):
                raise RuntimeError("boom")
            return {"ok": True}
        finally:
            with lock:
                current[key] -= 1

    registry.add("chaos", "1", body, singleton={"key": lambda i: i["k"], "limit": limit}, timeout=timeout)
    rng = random.Random(int(os.environ.get("CHAOS_SEED", "1")))
    ids = []
    for i in range(runs):
        k = f"K{rng.randrange(keys)}"
        inp = {"k": k, "steps": rng.randrange(1, 4)}
        if rng.random() < 0.3:
            inp["sleep"] = rng.randrange(inp["steps"])
        if rng.random() < 0.1:
            inp["fail"] = True
        ids.append(engine.start("chaos", inp, run_id=f"c{i:04d}").run_id)
    stop = threading.Event()
    dispatcher: Any = engine.dispatcher

    def guard(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the test
                errors.append(exc)
            finally:
                connections.close_all()

        return run

    def worker() -> None:
        while not stop.is_set():
            with dispatcher._lock:
                run_id = dispatcher.queue.popleft() if dispatcher.queue else None
            if run_id is None:
                time.sleep(0.003)
                continue
            if random.random() < 0.2:
                with dispatcher._lock:
                    dispatcher.queue.append(run_id)  # a duplicate delivery (R6)
            if random.random() < 0.5:
                engine.execute_chain(run_id)
            else:
                engine.execute(run_id)

    def ticker() -> None:
        while not stop.is_set():
            engine.tick()
            time.sleep(0.05)

    def canceller() -> None:
        while not stop.is_set():
            time.sleep(0.03)
            with contextlib.suppress(RunNotFoundError):
                engine.cancel(random.choice(ids))

    threads = [threading.Thread(target=guard(worker)) for _ in range(4)]
    threads += [threading.Thread(target=guard(ticker)) for _ in range(2)]
    threads += [threading.Thread(target=guard(canceller))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(r.is_terminal for r in engine.store.list_runs()):
            break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(60)
    final = {r.run_id: r for r in engine.store.list_runs()}
    return {
        "highest": dict(highest),
        "entries": entries,
        "first_token": first_token,
        "step_calls": dict(step_calls),
        "errors": errors,
        "final": final,
    }


@pytest.fixture
def mysql_session(store_kind: str) -> Any:
    """On MySQL/MariaDB, every new connection of the test runs at REPEATABLE READ
    with a non-UTC session time zone (S13a)."""
    from django.db import connection
    from django.db.backends.signals import connection_created

    def setup(sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.vendor == "mysql":
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                cursor.execute("SET time_zone = '-05:00'")

    if store_kind == "django" and connection.vendor == "mysql":
        connection_created.connect(setup)
        setup(None, connection)
    yield
    connection_created.disconnect(setup)


@pytest.mark.parametrize("timeout", [None, 0.4])
@pytest.mark.parametrize("limit", [1, 2])
def test_chaos(
    make: Any, registry: Registry, store_kind: str, limit: int, timeout: float | None, mysql_session: Any
) -> None:
    """S9, S13a, K1, R6, D6: under racing workers, ticks, duplicates and cancels,
    at most ``limit`` bodies per key; tokens strictly increase in admission
    order; steps run once; every run ends. On MySQL/MariaDB at REPEATABLE READ
    with a session time zone of -05:00."""
    engine = make(
        LEASE_SECONDS=3.0,
        LEASE_RENEW_SECONDS=0.5,
        ADMISSION_RETRY_SECONDS=0.05,
        ADMISSION_RETRY_JITTER_SECONDS=0.02,
        REDELIVERY_SECONDS=0.3,
        BACKLOG_RETRY_SECONDS=0.5,
    )
    out = _chaos(
        engine,
        registry,
        keys=3,
        limit=limit,
        runs=int(os.environ.get("CHAOS_RUNS", "60")),
        seconds=float(os.environ.get("CHAOS_SECONDS", "60")),
        timeout=timeout,
    )
    assert not out["errors"], out["errors"]
    assert max(out["highest"].values()) <= limit, out["highest"]
    stuck = [r for r in out["final"].values() if not r.is_terminal]
    assert not stuck, [(r.run_id, r.status, r.admitted, r.wake_at) for r in stuck]
    twice = {k: v for k, v in out["step_calls"].items() if v > 1}
    assert not twice, twice
    # Tokens: distinct per key, and in admission order (created_at, run_id) among admitted runs.
    by_key: dict[str, list[tuple[Any, str, int]]] = defaultdict(list)
    for run_id, token in out["first_token"].items():
        run = out["final"][run_id]
        by_key[run.singleton_key].append((run.created_at, run_id, token))
    for key, items in by_key.items():
        tokens = [t for _, _, t in sorted(items)]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (key, sorted(items))
