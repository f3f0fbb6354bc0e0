"""Adversarial: the claim message of the PostgreSQL fast path (a waiter's
first turn admitted in the message that reads it, ``pg.CLAIM_MESSAGE``, #17).

The first two tests failed on c0ba5f7, where the admission statement checked
that its run was a candidate in its own snapshot, not that the message's lock
statement had locked the key: a run that became a candidate between the two
(a retry's reset) was admitted without the key's lock, beside a locked
admission of another run, with the same token. The admission now writes only
for a key row the transaction recorded as locked (``pg.CLAIM_LOCKED``).

Each test cites the SPEC rules it guards. The tests that need PostgreSQL's
fast path skip elsewhere.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from django.db import connection, connections, transaction

from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.models import Run
from durable_singleton.statuses import RunStatus
from durable_singleton.stores import pg
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.django import DjangoStore
from durable_singleton.testing import make_engine

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's fast path (the claim message)"),
]

RUN = Run._meta.db_table


def _engine(registry: Registry, **settings: Any) -> Engine:
    engine = make_engine(DjangoStore(), registry=registry, **settings)
    assert engine.store._fast() is not None, "the fast path is not in use"  # type: ignore[attr-defined]
    return engine


def _claim_params(engine: Engine, run_id: str, owner: str = "probe") -> dict[str, Any]:
    limits = engine.limits()
    return {
        "run_id": run_id,
        "limits": json.dumps({n: int(v) for n, v in limits.items() if v is not None}),
        "ttls": json.dumps({n: float(v) for n, v in engine.queue_ttls().items() if v is not None}),
        "owner": owner,
        "lease": 30.0,
        "recovered": 0,
        "redelivery": 5.0,
        "front": 1.0,
        "backlog": 5.0,
    }


def _raw_claim(engine: Engine, run_id: str) -> tuple[int, list[tuple[Any, ...]], tuple[Any, ...] | None]:
    """Send the product's CLAIM_MESSAGE as FastPath.claim does, and return the
    rows the key lock statement locked, the admission's rows and the read (each
    result found by its statement's name, whatever the message's order)."""
    fast = engine.store._fast()  # type: ignore[attr-defined]
    results: dict[str, list[tuple[Any, ...]]] = {}
    with connection.cursor() as cursor:
        fast._send(cursor, pg.CLAIM_MESSAGE, _claim_params(engine, run_id))
        for n, statement in enumerate(pg.CLAIM_MESSAGE.statements):
            if n:
                cursor.nextset()
            label = statement.name.rsplit("_", 1)[0]
            results[label] = list(cursor.fetchall()) if cursor.description is not None else []
    read = results["ds_read"]
    return len(results["ds_claim_lock_key"]), results["ds_claim_admit"], read[0] if read else None


def _fail(run_id: str) -> None:
    """What a settle as failed leaves: terminal, no slot, markers dropped."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {RUN} SET status = 'failed', singleton_slot = NULL, singleton_tracked = FALSE,"
            " lease_owner = NULL, lease_expires_at = NULL, fencing_token = NULL, finished_at = now()"
            " WHERE run_id = %s",
            [run_id],
        )


def _holders(workflow: str, key: str) -> list[str]:
    return sorted(
        Run.objects.filter(
            workflow_name=workflow,
            singleton_key=key,
            singleton_slot="holder",
            status__in=("pending", "running", "suspended", "blocked"),
        ).values_list("run_id", flat=True)
    )


# -- the key's lock ---------------------------------------------------------------------------------
def test_the_claim_message_writes_nothing_without_the_key_lock(registry: Registry) -> None:
    """S5, S9, S13 (and pg.py's docstring: "its values read from its own row
    after its key's lock"): every write of the claim message's admission
    (a grant, the claimant's lease, its park) happens under the key's lock.

    X is a failed run of key K; another connection retries it (D9:
    ``reset_for_retry``, a plain compare-and-set that takes no key lock) and
    fails it again, over and over, while this connection sends X's claim
    message (a duplicate delivery, or the retry's own turn arriving at the
    commit). The message's key-lock statement and its admission statement
    take separate snapshots: when the retry commits between them, the lock
    statement saw no candidate (so locked nothing) and the admission saw
    one, and wrote without the lock."""
    registry.add("cm-lock", "1", lambda ctx, i: None, singleton={"key": lambda i: "K"})
    engine = _engine(registry)
    engine.start("cm-lock", {}, run_id="X")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    _fail("X")
    stop = threading.Event()
    flips = [0]

    def flip() -> None:
        try:
            while not stop.is_set():
                engine.store.reset_for_retry("X", 5.0, None)
                _fail("X")
                flips[0] += 1
        finally:
            connections.close_all()

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    unlocked: list[list[int]] = []
    locked_writes = claims = 0
    deadline = time.monotonic() + 6.0
    try:
        while time.monotonic() < deadline and not unlocked:
            locked, admitted, _ = _raw_claim(engine, "X")
            claims += 1
            if admitted and not locked:
                unlocked.append([row[0] for row in admitted])
            elif admitted:
                locked_writes += 1
    finally:
        stop.set()
        flipper.join(10)
    assert not unlocked, (
        f"the claim message admitted or parked X without its key's lock (result tags {unlocked[0]}, "
        f"0: lease, 1: grant, 2: park) after {claims} claims, {flips[0]} retries, {locked_writes} locked writes"
    )


def _turn(engine: Engine, run_id: str, owner: str, lease: float = 30.0) -> Any:
    return engine.store.begin_turn(
        run_id,
        owner,
        lease_seconds=lease,
        limits=engine.limits(),
        max_recoveries=engine.settings.MAX_RECOVERIES,
        retry=engine._retry_policy(),
        ttls=engine.queue_ttls(),
    )


def _waiting_for_a_lock(pid: int) -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


def _pid() -> int:
    connection.ensure_connection()
    return int(connection.connection.info.backend_pid)


def test_a_retried_run_claimed_beside_a_locked_admission_never_exceeds_the_limit(registry: Registry) -> None:
    """S5, S9, K1, D9: key K, limit 1, idle. X (created first) failed; Y, a
    younger waiter, is being admitted by its claim D, which holds K's lock and
    whose snapshot has X failed (D's write of Y's row waits for Y's row lock,
    held by a view's transaction that sent Y a signal, D2).
    Meanwhile X is retried (``reset_for_retry``, no key lock) while a claim A of
    X is in flight (a duplicate delivery; the retry's own dispatch). Under the
    rules A waits for K's lock, then finds Y holding and parks X: one holder,
    and every token of K distinct. The claim message's admission runs without
    the key's lock when the retry commits between its lock statement and its
    admission statement: A admits X beside Y, both with the same fencing token.
    One shot per fresh key, up to 30 shots."""
    registry.add("cm-retry", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    engine = _engine(registry)
    for shot in range(30):
        found = _retry_beside_a_locked_admission(engine, shot)
        assert found is None, found


def _retry_beside_a_locked_admission(engine: Engine, shot: int) -> str | None:
    """One shot of the test above on key ``K<shot>``: a finding, or None."""
    key, x, y = f"K{shot}", f"X{shot}", f"Y{shot}"
    engine.start("cm-retry", {"k": key}, run_id=x)
    _fail(x)
    engine.start("cm-retry", {"k": key}, run_id=y)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    with transaction.atomic():
        engine.store.lock_key("cm-retry", key)  # type: ignore[attr-defined]  # the key's row exists
    row_locked, release = threading.Event(), threading.Event()
    pids: dict[str, int] = {}
    turns: dict[str, Any] = {}

    def hold_y() -> None:
        try:
            with transaction.atomic():  # a view's transaction that signals Y (D2: under Y's row lock)
                engine.signal(y, "ping")
                row_locked.set()
                release.wait(20)
        finally:
            connections.close_all()

    def claim_y() -> None:
        try:
            pids["D"] = _pid()
            turns["D"] = _turn(engine, y, "D")
        finally:
            connections.close_all()

    def claim_x() -> None:
        try:
            pids["A"] = _pid()
            while not release.is_set():
                turn = _turn(engine, x, "A")
                if turn.state is not TurnState.SKIPPED:
                    turns["A"] = turn
                    return
        finally:
            connections.close_all()

    threads = [threading.Thread(target=hold_y, daemon=True)]
    threads[0].start()
    assert row_locked.wait(10)
    threads.append(threading.Thread(target=claim_y, daemon=True))
    threads[1].start()
    deadline = time.monotonic() + 10
    while "D" not in pids or not _waiting_for_a_lock(pids["D"]):
        assert time.monotonic() < deadline, "D never waited for Y's row"
        time.sleep(0.005)
    threads.append(threading.Thread(target=claim_x, daemon=True))
    threads[2].start()
    while "A" not in pids:
        time.sleep(0.001)
    time.sleep(0.002 * (shot % 5))
    assert engine.store.reset_for_retry(x, 5.0, None) is not None
    deadline = time.monotonic() + 10
    while "A" not in turns and not _waiting_for_a_lock(pids["A"]):
        assert time.monotonic() < deadline, "A neither waited nor claimed"
        time.sleep(0.002)
    release.set()
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive()
    holders = _holders("cm-retry", key)
    if len(holders) <= 1:
        return None
    tokens = list(Run.objects.filter(run_id__in=holders).order_by("run_id").values_list("run_id", "fencing_token"))
    return f"shot {shot}: holders {tokens} (limit 1); turns {[(k, t.state) for k, t in turns.items()]}"


# -- guards: the rules the claim message must keep ---------------------------------------------------
def _start(engine: Engine, workflow: str, run_id: str, key: str = "K", **kwargs: Any) -> None:
    engine.start(workflow, {"k": key}, run_id=run_id, **kwargs)
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]


def _execute_from_threads(engine: Any, ids: list[str], threads: int) -> None:
    """Execute the runs ``ids`` from ``threads`` threads at once, each starting
    at its own place in ``ids``, until every run completed or 8 s passed;
    raises AssertionError with what any thread raised."""
    from tests.conftest import run_threads

    def worker(i: int) -> None:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if all(engine.get(r).status == RunStatus.COMPLETED for r in ids):
                return
            for run_id in ids[i:] + ids[:i]:
                engine.execute(run_id)

    results = run_threads(threads, worker)
    assert not [r for r in results if isinstance(r, BaseException)], results


def _keyed(registry: Registry, name: str, body: Any = None, **singleton: Any) -> None:
    registry.add(name, "1", body or (lambda ctx, i: None), singleton={"key": lambda i: i["k"], **singleton})


def test_two_claims_of_one_waiter_at_once_admit_it_once(registry: Registry) -> None:
    """R6, S5, K1: four threads, each with its own connection, send the first
    turn of the same waiter W at once (a duplicate delivery); exactly one
    takes the lease, with token 1, the others skip; W is the key's one holder."""
    from tests.conftest import run_threads

    _keyed(registry, "cm-dup")
    engine = _engine(registry)
    for shot in range(12):
        w = f"W{shot}"
        _start(engine, "cm-dup", w, key=f"K{shot}")
        turns = run_threads(4, lambda i, w=w: _turn(engine, w, f"o{i}"))
        errors = [t for t in turns if isinstance(t, BaseException)]
        assert not errors, errors
        states = sorted(t.state.value for t in turns)
        assert states.count("run") == 1, (shot, states)
        row = Run.objects.get(pk=w)
        assert row.singleton_slot == "holder" and row.fencing_token == 1 and row.attempts == 1, (
            shot,
            row.singleton_slot,
            row.fencing_token,
            row.attempts,
        )
        assert _holders("cm-dup", f"K{shot}") == [w]


def test_a_claim_racing_a_cancel_never_runs_the_cancelled_run(registry: Registry) -> None:
    """S9, D6, R5a: a waiter's first turn and ``engine.cancel`` race, each on
    its own connection. Either the claim took the lease first (the cancel is
    then a request on a running run, never undone: the flag stays set) or the
    cancel landed first (the run ends cancelled, and the claim does not run
    it). Never a run both cancelled by the cancel and admitted by the claim."""
    from tests.conftest import run_threads

    _keyed(registry, "cm-cancel")
    engine = _engine(registry)
    for shot in range(15):
        w = f"W{shot}"
        _start(engine, "cm-cancel", w, key=f"K{shot}")
        claim, cancelled = run_threads(2, lambda i, w=w: _turn(engine, w, "c") if i == 0 else engine.cancel(w))
        assert not isinstance(claim, BaseException) and not isinstance(cancelled, BaseException), (claim, cancelled)
        row = Run.objects.get(pk=w)
        if claim.state is TurnState.RUN:
            assert cancelled.status == RunStatus.RUNNING, (shot, cancelled.status)
            assert row.status == RunStatus.RUNNING and row.cancel_requested, (shot, row.status, row.cancel_requested)
        else:
            assert row.status == RunStatus.CANCELLED, (shot, claim.state, row.status)
            assert cancelled.status == RunStatus.CANCELLED


def test_a_waiter_whose_cancel_was_requested_is_settled_never_admitted(registry: Registry) -> None:
    """S9, D6: a pending waiter carrying a requested cancel (the flag landed
    while it was parked) is not admitted by its claim on an idle key: the
    turn settles it cancelled, and it takes no slot and no token."""
    _keyed(registry, "cm-flag")
    engine = _engine(registry)
    _start(engine, "cm-flag", "W")
    Run.objects.filter(pk="W").update(cancel_requested=True)
    _, admitted, _ = _raw_claim(engine, "W")
    assert admitted == [], "the claim message wrote for a cancelled waiter"
    turn = _turn(engine, "W", "c")
    assert turn.state is not TurnState.RUN, turn.state
    row = Run.objects.get(pk="W")
    assert row.status == RunStatus.CANCELLED and row.fencing_token is None, (row.status, row.fencing_token)


def test_concurrent_turns_on_a_key_admit_in_creation_order_one_at_a_time(registry: Registry) -> None:
    """S5, S9 (FIFO, the limit), S7: on a key of limit 1, five runs created in
    order are executed by five threads at once, over and over (the handoff's
    grants racing the waiters' own claims), until all complete: never two
    bodies at once, and the bodies enter in creation order."""
    lock = threading.Lock()
    running: list[str] = []
    entered: list[str] = []
    overlap: list[tuple[str, ...]] = []

    def body(ctx: Any, i: Any) -> None:
        with lock:
            running.append(ctx.run_id)
            entered.append(ctx.run_id)
            if len(running) > 1:
                overlap.append(tuple(running))
        time.sleep(0.01)
        with lock:
            running.remove(ctx.run_id)

    _keyed(registry, "cm-fifo", body)
    engine = _engine(registry)
    ids = [f"R{n}" for n in range(5)]
    for run_id in ids:
        _start(engine, "cm-fifo", run_id)

    _execute_from_threads(engine, ids, 5)
    assert not overlap, f"two bodies of one key at once: {overlap[:3]}"
    assert entered == ids, entered
    assert all(engine.get(r).status == RunStatus.COMPLETED for r in ids)


def test_a_waiter_past_its_queue_ttl_is_never_admitted_by_its_claim(registry: Registry) -> None:
    """X2: a waiter of a workflow with ``queue_ttl=0.5`` whose first turn comes
    after 0.7 s, on an idle key, is not admitted (no slot, no token); a fresh
    waiter of the same workflow on another key is."""
    _keyed(registry, "cm-ttl", queue_ttl=0.5)
    engine = _engine(registry)
    _start(engine, "cm-ttl", "OLD", key="K1")
    time.sleep(0.7)
    _start(engine, "cm-ttl", "NEW", key="K2")
    old = _turn(engine, "OLD", "o")
    assert old.state is not TurnState.RUN, old.state
    row = Run.objects.get(pk="OLD")
    assert row.singleton_slot != "holder" and row.fencing_token is None, (row.singleton_slot, row.fencing_token)
    assert _turn(engine, "NEW", "n").state is TurnState.RUN


def test_a_delayed_start_is_not_admitted_before_its_time_nor_blocks_the_due(registry: Registry) -> None:
    """X5: on an idle key, D (``not_before`` 60 s away) is claimed: it is not
    admitted and its wake moves to its ``not_before``; W, started after D, is
    admitted by its own first turn (D does not block the due waiters behind it)."""
    _keyed(registry, "cm-later")
    engine = _engine(registry)
    _start(engine, "cm-later", "D", not_before=60)
    _start(engine, "cm-later", "W")
    _, admitted, _ = _raw_claim(engine, "D")
    assert admitted == [], "the claim message wrote for a run not yet due"
    turn = _turn(engine, "D", "d")
    assert turn.state is not TurnState.RUN, turn.state
    row = Run.objects.get(pk="D")
    assert row.singleton_slot != "holder" and row.wake_at == row.not_before, (row.singleton_slot, row.wake_at)
    assert _turn(engine, "W", "w").state is TurnState.RUN
    assert _holders("cm-later", "K") == ["W"]


def test_a_paused_key_admits_nothing_and_resumes(registry: Registry) -> None:
    """K2: with key K paused, a waiter's first turn parks it (no slot, no token);
    after the resume its turn admits it."""
    _keyed(registry, "cm-pause")
    engine = _engine(registry)
    engine.controls.pause_key("cm-pause", "K")
    _start(engine, "cm-pause", "W")
    assert _turn(engine, "W", "w").state is TurnState.PARKED
    assert Run.objects.get(pk="W").fencing_token is None
    engine.controls.resume_key("cm-pause", "K")
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    assert _turn(engine, "W", "w2").state is TurnState.RUN
    assert _holders("cm-pause", "K") == ["W"]


@pytest.mark.parametrize(("declared", "override", "admitted"), [(1, 3, 3), (3, 1, 1)], ids=["raised", "lowered"])
def test_a_limit_override_is_the_limit_of_the_claim(
    registry: Registry, declared: int, override: int, admitted: int
) -> None:
    """K2, S5: with key K's limit overridden (declared 1, override 3; declared 3,
    override 1), four waiters' first turns admit exactly the override's number,
    the oldest, and park the others."""
    _keyed(registry, "cm-over", limit=declared)
    engine = _engine(registry)
    engine.controls.override_limit("cm-over", "K", override)
    ids = [f"W{n}" for n in range(4)]
    for run_id in ids:
        _start(engine, "cm-over", run_id)
    states = [_turn(engine, r, f"o{r}").state for r in ids]
    assert states == [TurnState.RUN] * admitted + [TurnState.PARKED] * (4 - admitted), states
    assert _holders("cm-over", "K") == ids[:admitted]


def test_a_workflow_the_process_does_not_declare_is_left_to_the_orm_path(registry: Registry) -> None:
    """S5, S2 (pg.py: a workflow not in ``limits`` falls back): a claim from a
    process whose ``limits`` lack the workflow writes nothing in the claim
    message, and its turn still honours the limit stored on the run: with H
    holding key K (limit 1), W is not admitted."""
    _keyed(registry, "cm-undeclared")
    engine = _engine(registry)
    _start(engine, "cm-undeclared", "H")
    _start(engine, "cm-undeclared", "W")
    assert _turn(engine, "H", "h").state is TurnState.RUN
    other = make_engine(DjangoStore(), registry=Registry())
    assert other.limits() == {}
    _, admitted, _ = _raw_claim(other, "W")
    assert admitted == [], "the claim message admitted a workflow the process does not declare"
    turn = _turn(other, "W", "w")
    assert turn.state is not TurnState.RUN, turn.state
    assert _holders("cm-undeclared", "K") == ["H"]


def test_runs_of_an_older_release_fall_back_and_count_as_holders(registry: Registry) -> None:
    """S12: an untracked active run of an older release (no ``tracked``
    marker) is no candidate of the claim message. A running one is counted
    as a holder: a tracked waiter's first turn is parked beside it. An
    untracked pending one, on an idle key, joins the queue through the ORM
    path and is admitted."""
    _keyed(registry, "cm-legacy")
    engine = _engine(registry)
    _start(engine, "cm-legacy", "L", key="K1")
    Run.objects.filter(pk="L").update(status="running", singleton_tracked=False, singleton_slot=None)
    _start(engine, "cm-legacy", "W", key="K1")
    assert _turn(engine, "W", "w").state is TurnState.PARKED
    _start(engine, "cm-legacy", "U", key="K2")
    Run.objects.filter(pk="U").update(singleton_tracked=False, singleton_slot=None)
    _, admitted, _ = _raw_claim(engine, "U")
    assert admitted == [], "the claim message wrote for an untracked run"
    assert _turn(engine, "U", "u").state is TurnState.RUN
    row = Run.objects.get(pk="U")
    assert row.singleton_tracked and row.singleton_slot == "holder" and row.fencing_token == 1


def test_the_claim_message_is_prepared_again_after_deallocate_all(registry: Registry) -> None:
    """S5, R6 (pg.py ``_send``): after ``DEALLOCATE ALL`` on the connection (a
    pooler's ``DISCARD ALL``), a waiter's first turn still admits it, once."""
    _keyed(registry, "cm-dealloc")
    engine = _engine(registry)
    _start(engine, "cm-dealloc", "A", key="K1")
    assert _turn(engine, "A", "a").state is TurnState.RUN
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    _start(engine, "cm-dealloc", "B", key="K2")
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert _turn(engine, "B", "b").state is TurnState.RUN
    assert Run.objects.get(pk="B").fencing_token == 1


def test_fencing_tokens_strictly_increase_across_concurrent_admissions(registry: Registry) -> None:
    """K1, S5: on a key of limit 3, nine runs executed by six threads at once
    (claims and handoffs racing) get nine distinct tokens 1..9, never more
    than three bodies at once, and a run admitted after another finished has
    the larger token (runs granted by one statement share its moment, so
    ``admitted_at`` alone does not order them)."""
    lock = threading.Lock()
    running = [0]
    highest = [0]
    seen: list[tuple[str, Any]] = []

    def body(ctx: Any, i: Any) -> None:
        with lock:
            running[0] += 1
            highest[0] = max(highest[0], running[0])
            seen.append((ctx.run_id, ctx.fencing_token))
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    _keyed(registry, "cm-tokens", body, limit=3)
    engine = _engine(registry)
    ids = [f"T{n}" for n in range(9)]
    for run_id in ids:
        _start(engine, "cm-tokens", run_id)

    _execute_from_threads(engine, ids, 6)
    rows = list(
        Run.objects.filter(run_id__in=ids).values_list(
            "run_id", "fencing_token", "status", "admitted_at", "finished_at"
        )
    )
    assert all(row[2] == RunStatus.COMPLETED for row in rows), rows
    assert highest[0] <= 3, highest[0]
    assert sorted(t for _, t in seen) == list(range(1, 10)), seen
    assert sorted(row[1] for row in rows) == list(range(1, 10)), rows
    # A run admitted after another one finished was admitted by a later transaction: a larger token.
    later = [(a[0], a[1], b[0], b[1]) for a in rows for b in rows if a[3] > b[4] and a[1] < b[1]]
    assert not later, f"admitted after an earlier holder finished, with a smaller token: {later}"


# -- the message of a process that declares no quota and no throttle --------------------------------
def _first_turn(engine: Engine, run_id: str) -> tuple[Any, list[str]]:
    """The first turn's claim of ``run_id`` as a worker's turn sends it, and the statements sent."""
    from tests.helpers import round_trips

    limits, retry = engine.limits(), engine._retry_policy()
    turns: list[Any] = []
    sent = round_trips(
        lambda: turns.append(
            engine.store.begin_turn(run_id, "probe", lease_seconds=30, limits=limits, max_recoveries=3, retry=retry)
        )
    )
    return turns[0], sent


def test_a_process_without_quotas_or_throttles_claims_without_their_statements(registry: Registry) -> None:
    """S5, K1, X3i: when no workflow of the process declares a quota or a throttle, a
    waiter's first turn is the claim message without the quota and throttle keys' locks
    and admission (``pg.CLAIM_PLAIN_MESSAGE``), one round trip, and admits the run with
    its token as the whole message does; a run without a key takes its lease in it."""
    registry.add("cm-plain", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})
    registry.add("cm-unkeyed", "1", lambda ctx, i: None)
    engine = _engine(registry)
    keyed = engine.start("cm-plain", {"k": "A"}).run_id
    unkeyed = engine.start("cm-unkeyed", {}).run_id
    engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
    for run_id in (keyed, unkeyed):
        turn, sent = _first_turn(engine, run_id)
        assert turn.state is TurnState.RUN and turn.run.status == RunStatus.RUNNING, turn
        assert len(sent) == 1, sent
        assert "claim_admit" in sent[0] and "claim_take" in sent[0], sent
        assert "claim_quota_admit" not in sent[0] and "throttle" not in sent[0], sent
    assert Run.objects.get(pk=keyed).fencing_token == 1
    assert _holders("cm-plain", "A") == [keyed]


def test_a_quota_carrier_claimed_by_a_process_that_declares_no_quota_keeps_its_quota(registry: Registry) -> None:
    """X3, X3i, X6, R1 (a rolling deploy: the release that declares the quota starts the
    runs, one that does not claims them): the claim message without the quota statements
    writes nothing for a quota carrier, and the turn goes on from its read under the locks
    of all its limits: with its quota held by another run it parks; once the quota frees,
    it is admitted with its quota token."""
    from durable_singleton import Quota

    pool = Quota("cm-pool", key=lambda i: "P", limit=1)
    declaring = Registry()
    declaring.add("cm-quota", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]}, quotas=[pool])
    starter = _engine(declaring)
    first = starter.start("cm-quota", {"k": "A"}).run_id
    second = starter.start("cm-quota", {"k": "B"}).run_id
    starter.dispatcher.queue.clear()  # type: ignore[attr-defined]
    registry.add("cm-quota", "1", lambda ctx, i: None, singleton={"key": lambda i: i["k"]})  # no quota here
    claimer = _engine(registry)
    assert not any(name.startswith(("quota:", "throttle:")) for name in claimer.limits())
    turn, sent = _first_turn(claimer, first)
    assert turn.state is TurnState.RUN, turn
    assert "claim_quota_admit" not in sent[0], sent
    assert Run.objects.get(pk=first).quota_slot == "holder"
    parked, _ = _first_turn(claimer, second)
    assert parked.state is not TurnState.RUN, parked  # the quota's one slot is first's (X3)
    assert Run.objects.get(pk=second).quota_slot == "waiter"
    claimer.store.finish(turn.run, "probe", RunStatus.COMPLETED, limits=claimer.limits())
    again, _ = _first_turn(claimer, second)
    assert again.state is TurnState.RUN and Run.objects.get(pk=second).quota_slot == "holder", again
