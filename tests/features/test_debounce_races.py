"""Attacks on debounce (X7, X7a-X7e) with real commits, threads and processes.

Each test races debounced starts against each other, against a worker taking
the run the moment it becomes due, against a caller's rollback, a retry, a
cancel, a skewed process clock and bad input, on the DATABASE_URL database
(SQLite, PostgreSQL, MariaDB). "Newest" is commit order: the starts of one
debounce key are serialized by its lock (X7b), and the database's clock read
under it orders them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from durable_singleton import Debounce
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import InvalidInputError, SingletonKeyError
from durable_singleton.testing import make_engine

from ..conftest import spawn

pytestmark = pytest.mark.django_db(transaction=True)


def _declare(registry: Registry, log: list[Any], *, seconds: float, max_seconds: float, **options: Any) -> None:
    lock = threading.Lock()

    def body(ctx: Any, input: dict[str, Any]) -> Any:
        with lock:
            log.append((ctx.run_id, input["n"]))
        return input["n"]

    registry.add(
        "sync",
        "1",
        body,
        debounce=Debounce(key=lambda i: i["store"], seconds=seconds, max_seconds=max_seconds),
        **options,
    )


def _drive(engine: Engine) -> None:
    engine.tick()
    engine.dispatcher.drain()  # type: ignore[attr-defined]


def _wait(condition: Any, what: str, seconds: float = 120.0) -> None:
    from ..worker_processes import wait_for

    wait_for(condition, seconds, what)


def test_starts_racing_the_due_moment_never_run_an_input_a_fold_replaced(registry: Registry) -> None:
    """X7a, X7d, X7b, R5: one thread starts one debounce key without pause while a
    worker thread ticks and runs every due turn, so starts keep landing at the
    moment a run becomes due (a quiet period of 0.2 s, capped at 0.5 s). Every
    start is answered with a run; the body of each run runs once, with the
    newest input (by commit order) of the starts answered with that run: no
    start's input is lost and no run's body sees an input a later fold replaced.
    No run starts later than its burst's cap (``not_before <= debounce_until``)."""
    log: list[Any] = []
    _declare(registry, log, seconds=0.2, max_seconds=0.5)
    starter = make_engine("django", registry=registry)
    worker = make_engine("django", registry=registry)
    answered: list[tuple[int, str]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            while not stop.is_set():
                _drive(worker)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    thread = spawn(work)
    try:
        for n in range(300):
            answered.append((n, starter.start("sync", {"store": "A", "n": n}).run_id))
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors
    runs = {r.run_id: r for r in starter.store.list_runs(workflow_name="sync")}
    assert {run_id for _, run_id in answered} == set(runs)
    # Every run's time comes; then each runs once.
    _wait(lambda: all(r.not_before < starter.store.now() for r in starter.store.list_runs(workflow_name="sync")), "due")

    def finished() -> bool:
        _drive(worker)
        return all(r.is_terminal for r in worker.store.list_runs(workflow_name="sync"))

    _wait(finished, "every run finished")
    newest: dict[str, int] = {}
    for n, run_id in answered:
        newest[run_id] = n
    ran = sorted(log)
    assert ran == sorted(newest.items()), (len(runs), [(r, n) for r, n in ran if newest[r] != n])
    for run in worker.store.list_runs(workflow_name="sync"):
        assert run.status == "completed" and run.input["n"] == newest[run.run_id]
        assert run.debounce_until is not None and run.not_before is not None
        assert run.not_before <= run.debounce_until
    assert len(runs) >= 2  # the stream outlived at least one burst


@pytest.mark.slow  # four Python processes start Django: not in the quick tier (noxfile QUICK)
def test_processes_bursting_one_key_leave_the_input_of_the_last_commit(tmp_path: Any) -> None:
    """X7b, X7a, S13: four processes start debounce keys at once, fifteen starts
    each, three per key (``K0`` to ``K4``, so every process races each key's
    first start), each start printing the run it was given and the run's new
    start time (the database's clock under the key's lock plus ``seconds``, so
    it orders the starts by commit). Each key has one run; every start of it
    was given that run; its input is the input of the start with the latest
    start time: the newest commit won."""
    from durable_singleton.models import Run

    from ..worker_processes import start_at_once

    texts = start_at_once(tmp_path, "tests.features.debounce_starter", "15", "race")
    starts = [line.split() for text in texts for line in text.splitlines() if line.startswith("start ")]
    assert len(starts) == 60, texts
    runs = {r.debounce_key: r for r in Run.objects.filter(workflow_name="sync-race")}
    assert Run.objects.filter(workflow_name="sync-race").count() == len(runs) == 5
    for key, run in runs.items():
        mine = [s for s in starts if s[4] == key]
        assert {s[1] for s in mine} == {run.run_id}
        latest = max(datetime.fromisoformat(s[3]) for s in mine)
        newest = [int(s[2]) for s in mine if datetime.fromisoformat(s[3]) == latest]
        assert run.input["n"] in newest, (run.input, newest)
        assert run.not_before == latest


def test_a_start_in_a_transaction_rolled_back_folds_nothing(registry: Registry) -> None:
    """X7b, R3, X7c: a start folded inside a caller's transaction that rolls back
    leaves the open run's input and start time as they were; a retry of a start
    with an explicit run id whose first attempt rolled back then folds for real,
    and a second retry changes nothing (no record of the rolled-back fold
    survives, and the committed one holds)."""
    _declare(registry, [], seconds=600, max_seconds=1800)
    engine = make_engine("django", registry=registry)
    first = engine.start("sync", {"store": "A", "n": 0})
    before = engine.get(first.run_id)
    with pytest.raises(RuntimeError), transaction.atomic():
        folded = engine.start("sync", {"store": "A", "n": 1}, run_id="retry-me")
        assert folded.run_id == first.run_id
        raise RuntimeError("the caller's transaction fails")
    after = engine.get(first.run_id)
    assert (after.input, after.not_before, after.wake_at) == (before.input, before.not_before, before.wake_at)
    again = engine.start("sync", {"store": "A", "n": 2}, run_id="retry-me")
    assert again.run_id == first.run_id and engine.get(first.run_id).input["n"] == 2
    engine.start("sync", {"store": "A", "n": 3})
    moved = engine.get(first.run_id)
    assert engine.start("sync", {"store": "A", "n": 2}, run_id="retry-me").run_id == first.run_id
    kept = engine.get(first.run_id)
    assert (kept.input["n"], kept.not_before) == (3, moved.not_before)
    assert [r.run_id for r in engine.store.list_runs(workflow_name="sync")] == [first.run_id]


def test_concurrent_retries_of_one_explicit_run_id_fold_once(registry: Registry) -> None:
    """X7c, R3, X7b: eight threads retry one start (explicit run id) at once while
    another start made the key's run: every retry returns that run, one record
    of the fold exists, and the input is the retried start's."""
    from durable_singleton.models import DebouncedStart

    from ..conftest import run_threads

    _declare(registry, [], seconds=600, max_seconds=1800)
    engine = make_engine("django", registry=registry)
    first = engine.start("sync", {"store": "A", "n": 0})
    results = run_threads(8, lambda i: engine.start("sync", {"store": "A", "n": 1}, run_id="same").run_id)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    assert set(results) == {first.run_id}
    assert list(DebouncedStart.objects.values_list("start_id", "run_id")) == [("same", first.run_id)]
    assert [r.run_id for r in engine.store.list_runs(workflow_name="sync")] == [first.run_id]


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"store": "A", "n": 9, "blob": "x" * 5000}, id="huge"),
        pytest.param({"store": "A", "n": 9, "when": object()}, id="not-json"),
        pytest.param({"store": "B" * 192, "n": 9}, id="key-too-long"),
        pytest.param({"n": 9}, id="key-raises"),
    ],
)
def test_a_bad_start_leaves_the_open_run_untouched(registry: Registry, bad: dict[str, Any]) -> None:
    """X7, R5a, section 7: a start refused for its input (larger than
    MAX_INPUT_BYTES, not JSON, a debounce key longer than 191 characters, a key
    function that raises) raises a typed error and writes nothing: no run, no
    key row, and the key's open run keeps its input and start time."""
    from durable_singleton.models import Run, SingletonKey

    _declare(registry, [], seconds=600, max_seconds=1800)
    engine = make_engine("django", registry=registry, MAX_INPUT_BYTES=1024)
    first = engine.start("sync", {"store": "A", "n": 0})
    before = engine.get(first.run_id)
    keys = list(SingletonKey.objects.values_list("workflow_name", "key"))
    with pytest.raises((InvalidInputError, SingletonKeyError)):
        engine.start("sync", bad)
    after = engine.get(first.run_id)
    assert (after.input, after.not_before) == (before.input, before.not_before)
    assert Run.objects.count() == 1
    assert list(SingletonKey.objects.values_list("workflow_name", "key")) == keys


def test_a_skewed_process_clock_plays_no_part(registry: Registry) -> None:
    """R5, X7b: engines whose own clocks are an hour ahead and an hour behind start
    one debounce key: the run's start time is the database's now plus
    ``seconds`` each time (never the process's), it folds both starts, and a
    tick and turn of the fast engine does not run the body before that time."""
    log: list[Any] = []
    _declare(registry, log, seconds=600, max_seconds=1800)
    ahead = make_engine("django", registry=registry, clock=lambda: datetime.now(UTC) + timedelta(hours=1))
    behind = make_engine("django", registry=registry, clock=lambda: datetime.now(UTC) - timedelta(hours=1))
    low = ahead.store.now()
    run = ahead.start("sync", {"store": "A", "n": 0})
    folded = behind.start("sync", {"store": "A", "n": 1})
    high = ahead.store.now()
    stored = ahead.get(run.run_id)
    assert folded.run_id == run.run_id and stored.input["n"] == 1
    assert stored.not_before is not None and stored.debounce_until is not None
    assert low + timedelta(seconds=600) <= stored.not_before <= high + timedelta(seconds=600)
    assert low + timedelta(seconds=1800) <= stored.debounce_until <= high + timedelta(seconds=1800)
    _drive(ahead)
    ahead.execute(run.run_id)
    assert log == [] and ahead.get(run.run_id).status == "pending"


def test_cancel_racing_folds_never_leaves_a_folded_start_without_a_live_run(registry: Registry) -> None:
    """X7a, D6, R5a: a thread folds starts into the key's run while another cancels
    the run each start returns. A start folds only into a run still open when
    its fold commits: every start's answer is a run that was pending when the
    start returned, or a run that a cancel ended after it; after the race the
    last start's run holds the last input."""
    from ..conftest import run_threads

    _declare(registry, [], seconds=600, max_seconds=1800)
    engine = make_engine("django", registry=registry)
    answered: list[tuple[int, str, str]] = []

    def race(i: int) -> None:
        if i == 0:
            for n in range(60):
                run = engine.start("sync", {"store": "A", "n": n})
                answered.append((n, run.run_id, run.status))
        else:
            for _ in range(60):
                for run in engine.store.list_runs(workflow_name="sync"):
                    if run.status == "pending":
                        engine.cancel(run.run_id)

    for result in run_threads(2, race):
        if isinstance(result, BaseException):
            raise result
    assert all(status == "pending" for _, _, status in answered)
    n, run_id, _ = answered[-1]
    last = engine.get(run_id)
    assert last.input["n"] == n


@pytest.mark.parametrize("store_name", ["memory", "django"])
def test_a_start_of_another_version_starts_its_own_run(registry: Registry, store_name: str) -> None:
    """X7a, R1: during a rolling deploy the new release starts version 2 of a
    debounced workflow while version 1's run of the key is open. The version 2
    start must not fold into the version 1 run (whose body would then get an
    input of the new shape): it starts its own run, and each body runs with its
    own version's input."""
    from datetime import timedelta as _td

    from durable_singleton.models import Run

    ran: list[tuple[str, Any]] = []
    options = {"debounce": Debounce(key=lambda i: i["store"], seconds=600, max_seconds=1800)}
    registry.add("sync", "1", lambda ctx, input: ran.append(("1", input)), **options)
    registry.add("sync", "2", lambda ctx, input: ran.append(("2", input)), **options)
    engine = make_engine(store_name, registry=registry)
    old = engine.start("sync", {"store": "A", "n": 0}, version="1")
    new = engine.start("sync", {"store": "A", "shape": "v2"}, version="2")
    assert new.run_id != old.run_id
    assert engine.get(old.run_id).input == {"store": "A", "n": 0}
    assert engine.get(new.run_id).workflow_version == "2"
    if store_name == "django":
        past = engine.store.now() - _td(seconds=1)
        Run.objects.update(not_before=past, wake_at=past)
        for run_id in (old.run_id, new.run_id):
            engine.execute(run_id)
        assert sorted(ran) == [("1", {"store": "A", "n": 0}), ("2", {"store": "A", "shape": "v2"})]


@pytest.mark.parametrize("store_name", ["memory", "django"])
def test_a_start_of_another_tenant_of_a_fair_quota_starts_its_own_run(registry: Registry, store_name: str) -> None:
    """X7a, X4: a debounced workflow under a fair quota (sub-key = the input's
    tenant). A start whose input gives another tenant must not fold into the
    open run of the first tenant: that run's quota membership counts it as the
    first tenant's, so the fold would run tenant B's work on tenant A's share.
    It starts its own run, counted under its own tenant."""
    from durable_singleton import Quota

    quota = Quota("api", limit=1, fair_key=lambda i: i["tenant"])
    registry.add(
        "sync",
        "1",
        lambda ctx, input: None,
        quotas=[quota],
        debounce=Debounce(key=lambda i: i["store"], seconds=600, max_seconds=1800),
    )
    engine = make_engine(store_name, registry=registry)
    first = engine.start("sync", {"store": "A", "tenant": "a", "n": 0})
    same = engine.start("sync", {"store": "A", "tenant": "a", "n": 1})
    other = engine.start("sync", {"store": "A", "tenant": "b", "n": 2})
    assert same.run_id == first.run_id
    assert other.run_id != first.run_id
    assert engine.get(first.run_id).input["tenant"] == "a"
    if store_name == "django":
        from durable_singleton.models import QuotaMembership

        assert dict(QuotaMembership.objects.values_list("run_id", "sub_key")) == {
            first.run_id: "a",
            other.run_id: "b",
        }


@pytest.mark.parametrize("store_name", ["memory", "django"])
def test_a_start_finds_its_tenants_run_among_many_open_runs_of_the_key(registry: Registry, store_name: str) -> None:
    """X7a, X4, X7b: twelve tenants of a fair quota each open a run of one debounce
    key; a second start of the first tenant folds into that tenant's run, however
    many newer open runs of other tenants the key has (no second run of one
    burst), and so does every tenant's second start."""
    from durable_singleton import Quota

    registry.add(
        "sync",
        "1",
        lambda ctx, input: None,
        quotas=[Quota("api", limit=1, fair_key=lambda i: i["tenant"])],
        debounce=Debounce(key=lambda i: i["store"], seconds=600, max_seconds=1800),
    )
    engine = make_engine(store_name, registry=registry)
    first = {t: engine.start("sync", {"store": "A", "tenant": f"t{t}", "n": 0}).run_id for t in range(12)}
    assert len(set(first.values())) == 12
    again = {t: engine.start("sync", {"store": "A", "tenant": f"t{t}", "n": 1}).run_id for t in range(12)}
    assert again == first
    assert len(engine.store.list_runs(workflow_name="sync")) == 12


def test_a_start_paused_while_the_open_run_comes_due_never_splits_its_burst(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X7a, X7b, R5: a debounced start takes its key's lock, then its thread
    pauses (a loaded machine) while the key's open run comes due and a worker
    takes it. The start then decides on the database's
    clock of its statements, not on the one it read before the pause: the run
    whose time came is closed, so the start never folds into it and creates its
    own run, stamped (``created_at``) after the open run's start time, so no
    run of the key was open when it was created (the soak's ``debounce_split``).
    On MariaDB and PostgreSQL the claim lands during the pause and the start
    created a run stamped with the clock of before it; on SQLite (one writer)
    the start folded into the run whose time had come."""
    log: list[Any] = []
    _declare(registry, log, seconds=0.3, max_seconds=30)
    starter = make_engine("django", registry=registry)
    worker = make_engine("django", registry=registry)
    first = starter.start("sync", {"store": "A", "n": 0}, run_id="burst-1")
    real_lock_key = starter.store.lock_key
    paused: list[bool] = []

    def claim_when_due() -> None:
        due = first.not_before
        assert due is not None
        try:
            _wait(lambda: worker.store.now() > due, "the open run's start time")
            for _ in range(40):  # SQLite: the start holds the write lock until it commits
                with contextlib.suppress(Exception):  # a locked database: try again
                    _drive(worker)
                if worker.get(first.run_id).status != "pending":
                    return
                time.sleep(0.05)
        finally:
            connection.close()  # this thread's own connection

    claimer = threading.Thread(target=claim_when_due)

    def lock_then_pause(workflow_name: str, key: str, **kwargs: Any) -> dict[str, Any]:
        row = real_lock_key(workflow_name, key, **kwargs)
        if not paused:  # the debounce key's lock taken (the start's first statement), then a pause
            paused.append(True)
            claimer.start()
            claimer.join(timeout=5)
        return row

    monkeypatch.setattr(starter.store, "lock_key", lock_then_pause)
    second = starter.start("sync", {"store": "A", "n": 1}, run_id="burst-2")
    monkeypatch.undo()
    claimer.join(timeout=120)
    assert paused and not claimer.is_alive()
    closed = worker.get(first.run_id)
    assert closed.input == {"store": "A", "n": 0}, "folded into a run whose start time had come"
    assert second.run_id == "burst-2" and closed.not_before is not None
    assert second.created_at >= closed.not_before, "created while the key's run was open"

    def both_ran() -> bool:
        _drive(worker)
        return len(log) == 2

    _wait(both_ran, "both bodies")
    assert sorted(log) == [("burst-1", 0), ("burst-2", 1)]


def test_a_fold_paused_before_its_write_moves_the_start_from_the_time_of_its_write(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X7d, X7a, R5: a start that folds into the key's open run moves that run's start
    to ``seconds`` after itself, on the database's clock of the compare-and-set that
    writes it. Here the process pauses 4 s inside the start, under the key's lock
    (any read of the store's clock pauses, once): the folded run's start is still
    10 s after the fold was written, never 10 s after a clock read before the pause
    (6 s after the write, its quiet period cut short by the pause). Before, the fold
    read the clock, then wrote ``that read + seconds``."""
    log: list[Any] = []
    _declare(registry, log, seconds=10, max_seconds=60)
    engine = make_engine("django", registry=registry)
    first = engine.start("sync", {"store": "A", "n": 0}, run_id="fold-1")
    real_now = engine.store.now
    paused: list[bool] = []

    def now_then_pause() -> datetime:
        moment = real_now()
        if not paused:
            paused.append(True)
            time.sleep(4)
        return moment

    monkeypatch.setattr(engine.store, "now", now_then_pause)
    folded = engine.start("sync", {"store": "A", "n": 1}, run_id="fold-2")
    monkeypatch.undo()
    after = engine.store.now()  # the database's clock, read after the start returned
    assert folded.run_id == first.run_id, "the start did not fold into the open run"
    assert folded.not_before is not None and folded.input == {"store": "A", "n": 1}
    stored = engine.get(first.run_id)
    assert stored.not_before == folded.not_before
    # The fold's write came at most 2 s before ``after`` (a loaded machine), its start 10 s after it.
    assert folded.not_before >= after + timedelta(seconds=8), (folded.not_before, after)
