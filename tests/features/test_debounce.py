"""Debounce (X7, X7a-X7e; #33 items 2 and 4): ``Debounce(key=fn, seconds=s, max_seconds=m)``.

A start whose debounce key has an open run (pending, no slot, no lease, its
start time still later than the store's now, X7a) creates nothing: that run
takes the start's input (the newest wins) and its start moves to ``s`` after
this start, never past ``m`` after the burst's first start; a start once the
run's time has come starts a new run. Decided under the debounce key's lock,
idempotent by run id (X7b, X7c). On the in-memory store and on the
DATABASE_URL database (SQLite, PostgreSQL, MariaDB), with real commits.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db.models import F

from durable_singleton import Debounce
from durable_singleton.definitions import Registry
from durable_singleton.engine import Engine
from durable_singleton.exceptions import (
    InvalidNotBeforeError,
    InvalidWorkflowError,
    SingletonKeyError,
    UnknownWorkflowError,
)
from durable_singleton.explain import ExplainState
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.values import MAX_SECONDS
from tests.helpers import HandClock as Clock

from ..conftest import run_threads

SECONDS = 600.0
MAX = 1800.0


@pytest.fixture
def timed(make: Callable[..., Engine], store_kind: str) -> Engine:
    """An engine whose time ``pass_time`` moves (the memory store's clock, or the stored times)."""
    return make(Clock()) if store_kind == "memory" else make()


def pass_time(engine: Engine, seconds: float) -> None:
    """Let ``seconds`` pass for the debounced runs: on the memory store its clock moves;
    on the database every stored time a debounce compares moves back by as much."""
    if isinstance(engine.store, MemoryStore):
        engine.store.clock.now += timedelta(seconds=seconds)  # type: ignore[attr-defined]
        return
    from durable_singleton.models import Run

    shift = timedelta(seconds=seconds)
    for column in ("not_before", "wake_at", "debounce_until", "deadline_at"):
        Run.objects.filter(**{f"{column}__isnull": False}).update(**{column: F(column) - shift})
    Run.objects.update(created_at=F("created_at") - shift, updated_at=F("updated_at") - shift)


def _declare(registry: Registry, log: list[Any], *, singleton: Any = None, **debounce: Any) -> None:
    def body(ctx: Any, input: dict[str, Any]) -> Any:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        log.append((ctx.run_id, input["n"]))
        return input["n"]

    options = {"seconds": SECONDS, "max_seconds": MAX, **debounce}
    registry.add(
        "sync",
        "1",
        body,
        singleton=singleton,
        debounce=Debounce(key=lambda i: i["store"], **options),
    )


def _runs(engine: Engine) -> list[Any]:
    return engine.store.list_runs(workflow_name="sync")


def _run_due(engine: Engine) -> None:
    """Let the tick send the due runs' turns and run them (S8, X5)."""
    for _ in range(5):
        engine.tick()
        engine.dispatcher.drain()  # type: ignore[attr-defined]


def test_a_burst_of_starts_gives_one_run_with_the_newest_input(timed: Engine, registry: Registry) -> None:
    """X7, X7a: twenty starts of one debounce key inside its quiet period return the
    same run; it alone exists, it holds the last start's input, no turn is sent
    before its time, and once its time comes its body runs once with that input."""
    log: list[Any] = []
    _declare(registry, log)
    started = [timed.start("sync", {"store": "A", "n": n}) for n in range(20)]
    assert {r.run_id for r in started} == {started[0].run_id}
    runs = _runs(timed)
    assert [r.run_id for r in runs] == [started[0].run_id]
    assert runs[0].input == {"store": "A", "n": 19}
    assert runs[0].status == "pending" and runs[0].debounce_key == "A"
    assert not timed.dispatcher.queue  # type: ignore[attr-defined]
    timed.dispatcher.drain()  # type: ignore[attr-defined]
    assert log == []
    pass_time(timed, MAX + 1)
    _run_due(timed)
    assert log == [(started[0].run_id, 19)]
    assert timed.get(started[0].run_id).status == "completed"


def test_a_fold_moves_only_the_input_and_the_start_time(timed: Engine, registry: Registry) -> None:
    """X7b, X8: a debounced start keeps its priority (it was dropped: a debounced run
    always had priority 0); a start folded into an open run gives it its input and moves
    its start, and the run keeps the tags and the priority of the start that created it."""
    log: list[Any] = []
    _declare(registry, log)
    first = timed.start("sync", {"store": "A", "n": 0}, tags=["first"], priority=5)
    folded = timed.start("sync", {"store": "A", "n": 1}, tags=["second"], priority=-5)
    assert folded.run_id == first.run_id
    run = timed.get(first.run_id)
    assert run.input == {"store": "A", "n": 1}
    assert run.not_before is not None and first.not_before is not None and run.not_before >= first.not_before
    assert run.tags == first.tags and "first" in run.tags and "second" not in run.tags
    assert run.priority == 5
    # start_many gives a debounced run the batch's priority, as start does (X8).
    [batch] = timed.start_many("sync", [{"store": "B", "n": 0}], priority=7)
    assert not isinstance(batch, Exception) and timed.get(batch.run_id).priority == 7


def test_each_debounce_key_has_its_own_run(timed: Engine, registry: Registry) -> None:
    """X7: starts of two debounce keys fold into one run per key, each with its newest input."""
    _declare(registry, [])
    for n in range(3):
        timed.start("sync", {"store": "A", "n": n})
        timed.start("sync", {"store": "B", "n": 10 + n})
    inputs = sorted((r.debounce_key, r.input["n"]) for r in _runs(timed))
    assert inputs == [("A", 2), ("B", 12)]


def test_a_start_of_another_throttle_key_starts_its_own_run(timed: Engine, registry: Registry) -> None:
    """X7a, X6: a start folds only into an open run of its own throttle keys. Two starts of
    one debounce key whose inputs name two tenants of a per-tenant rate are two runs, each
    counted on its tenant's rate; a third start of the first tenant folds into its run.
    Before, the second start folded into the first tenant's run, which then ran the second
    tenant's input on the first tenant's rate (the second tenant's body ran twice in an hour
    against a limit of 1 an hour)."""
    from durable_singleton import Throttle

    rate = Throttle("tenant-rate", key=lambda i: i["tenant"], limit=1, period=3600)
    registry.add(
        "sync",
        "1",
        lambda ctx, i: i["n"],
        throttles=[rate],
        debounce=Debounce(key=lambda i: i["store"], seconds=SECONDS, max_seconds=MAX),
    )
    first = timed.start("sync", {"store": "S", "tenant": "t1", "n": 1})
    second = timed.start("sync", {"store": "S", "tenant": "t2", "n": 2})
    third = timed.start("sync", {"store": "S", "tenant": "t1", "n": 3})
    assert second.run_id != first.run_id, "a start of tenant t2 folded into tenant t1's run"
    assert third.run_id == first.run_id
    by_tenant = {tuple(k for _n, k, *_rest in r.throttle_keys): r.input["n"] for r in _runs(timed)}
    assert by_tenant == {("t1",): 3, ("t2",): 2}, by_tenant


def test_a_start_moves_the_run_start_but_never_past_max_seconds(timed: Engine, registry: Registry) -> None:
    """X7: each start moves the open run's start to ``seconds`` after it; a start later
    than ``max_seconds - seconds`` after the burst's first start gives it the cap,
    the first start plus ``max_seconds``, and the cap holds the run's start there."""
    _declare(registry, [])
    first = timed.start("sync", {"store": "A", "n": 0})
    assert first.not_before is not None and first.debounce_until is not None
    assert first.not_before == first.created_at + timedelta(seconds=SECONDS)
    assert first.debounce_until == first.created_at + timedelta(seconds=MAX)
    assert first.wake_at == first.not_before
    pass_time(timed, SECONDS / 2)
    moved = timed.start("sync", {"store": "A", "n": 1})
    assert moved.run_id == first.run_id
    assert moved.not_before is not None and moved.debounce_until is not None
    assert moved.not_before > first.not_before - timedelta(seconds=SECONDS / 2)  # moved later than it was
    assert moved.not_before < moved.debounce_until
    for n in range(2, 6):  # keep the burst going past max_seconds - seconds
        pass_time(timed, SECONDS / 2)
        capped = timed.start("sync", {"store": "A", "n": n})
        assert capped.run_id == first.run_id
    assert capped.not_before == capped.debounce_until
    assert capped.wake_at == capped.debounce_until
    assert len(_runs(timed)) == 1


def test_a_start_once_the_run_is_due_creates_a_new_run(timed: Engine, registry: Registry) -> None:
    """X7, X7a: once the run's start time has come (whether or not a worker took it
    yet) it is no longer open: the next start creates a new debounced run."""
    _declare(registry, [])
    first = timed.start("sync", {"store": "A", "n": 0})
    pass_time(timed, SECONDS + 1)
    second = timed.start("sync", {"store": "A", "n": 1})
    assert second.run_id != first.run_id
    assert timed.get(first.run_id).input == {"store": "A", "n": 0}
    assert second.input == {"store": "A", "n": 1}


def test_a_start_after_the_run_began_creates_a_new_run(timed: Engine, registry: Registry) -> None:
    """X7: a start after the run's body ran starts a new run; the first keeps its input."""
    log: list[Any] = []
    _declare(registry, log)
    first = timed.start("sync", {"store": "A", "n": 0, "hold": True})
    pass_time(timed, SECONDS + 1)
    _run_due(timed)
    assert timed.get(first.run_id).status == "suspended"
    second = timed.start("sync", {"store": "A", "n": 1})
    assert second.run_id != first.run_id
    assert timed.get(first.run_id).input["n"] == 0


def test_a_restart_with_an_explicit_run_id_does_not_apply_twice(timed: Engine, registry: Registry) -> None:
    """X7c, R3: a start of id B folded into run A is remembered; starting B again (a
    retry) returns A and changes nothing, so C's newer input stays; also once A is due."""
    _declare(registry, [])
    a = timed.start("sync", {"store": "A", "n": 0}, run_id="A")
    b = timed.start("sync", {"store": "A", "n": 1}, run_id="B")
    timed.start("sync", {"store": "A", "n": 2}, run_id="C")
    assert b.run_id == "A"
    before = timed.get("A")
    again = timed.start("sync", {"store": "A", "n": 1}, run_id="B")
    assert again.run_id == "A"
    after = timed.get("A")
    assert after.input["n"] == 2 and after.not_before == before.not_before
    pass_time(timed, MAX + 1)
    assert timed.start("sync", {"store": "A", "n": 1}, run_id="B").run_id == a.run_id
    assert timed.start("sync", {"store": "A", "n": 0}, run_id="A").run_id == "A"
    assert [r.run_id for r in _runs(timed)] == ["A"]


def test_the_debounced_run_queues_behind_the_singleton_holder(timed: Engine, registry: Registry) -> None:
    """X7e, S5: a debounced workflow with a singleton key: the second burst's run,
    once due, waits behind the first run holding the key and is admitted when it
    ends; a start meanwhile creates a third run (the second is no longer open)."""
    log: list[Any] = []
    _declare(registry, log, singleton={"key": lambda i: i["store"], "limit": 1})
    first = timed.start("sync", {"store": "A", "n": 0, "hold": True})
    pass_time(timed, SECONDS + 1)
    _run_due(timed)
    assert timed.get(first.run_id).admitted
    second = timed.start("sync", {"store": "A", "n": 1})
    timed.start("sync", {"store": "A", "n": 2})
    assert second.run_id != first.run_id and len(_runs(timed)) == 2
    pass_time(timed, SECONDS + 1)
    _run_due(timed)
    waiting = timed.get(second.run_id)
    assert waiting.status in {"pending", "suspended"} and not waiting.admitted
    third = timed.start("sync", {"store": "A", "n": 3})
    assert third.run_id not in {first.run_id, second.run_id}
    timed.signal(first.run_id, "go")
    _run_due(timed)
    assert (second.run_id, 2) in log
    assert timed.get(second.run_id).status == "completed"


def test_a_skip_singleton_refuses_only_a_new_run_a_fold_goes_through(timed: Engine, registry: Registry) -> None:
    """X7e, X1: under ``on_busy="skip"`` the queue cap counts new runs only: while the
    holder runs, a burst's first start on the busy key raises SingletonBusyError."""
    from durable_singleton.exceptions import SingletonBusyError

    _declare(registry, [], singleton={"key": lambda i: i["store"], "on_busy": "skip"})
    first = timed.start("sync", {"store": "A", "n": 0})
    assert timed.start("sync", {"store": "A", "n": 1}).run_id == first.run_id  # folded: nothing new
    pass_time(timed, SECONDS + 1)
    with pytest.raises(SingletonBusyError):
        timed.start("sync", {"store": "A", "n": 2})
    assert len(_runs(timed)) == 1


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"seconds": 0, "max_seconds": 10}, "debounce.seconds"),
        ({"seconds": -1, "max_seconds": 10}, "debounce.seconds"),
        ({"seconds": 10, "max_seconds": 5}, "debounce.max_seconds"),
        ({"seconds": MAX_SECONDS * 2, "max_seconds": MAX_SECONDS * 2}, "debounce.seconds"),
        ({"seconds": 10, "max_seconds": MAX_SECONDS * 2}, "debounce.max_seconds"),
        ({"seconds": "10", "max_seconds": 20}, "debounce.seconds"),
        ({"seconds": True, "max_seconds": 20}, "debounce.seconds"),
        ({"seconds": float("nan"), "max_seconds": 20}, "debounce.seconds"),
        ({"seconds": 10, "max_seconds": None}, "debounce.max_seconds"),
        ({"seconds": 10, "max_seconds": 20, "key": "store"}, "debounce.key"),
    ],
)
def test_a_bad_declaration_is_refused_and_registers_nothing(
    registry: Registry, options: dict[str, Any], field: str
) -> None:
    """X7, section 7: a bad debounce raises InvalidWorkflowError naming the field; the
    workflow is not registered."""
    spec = {"key": lambda i: i["store"], **options}
    with pytest.raises(InvalidWorkflowError) as caught:
        registry.add("sync", "1", lambda ctx, i: None, debounce=Debounce(**spec))
    assert caught.value.field == field
    with pytest.raises(UnknownWorkflowError):
        registry.get("sync")


@pytest.mark.parametrize(
    ("singleton", "field"),
    [
        ({"key": lambda i: i["store"], "on_busy": "replace_queued"}, "debounce"),
        ({"key": lambda i: i["store"], "on_busy": "cancel_in_progress"}, "debounce"),
        ({"key": lambda i: i["store"], "queue_ttl": MAX}, "singleton.queue_ttl"),
    ],
)
def test_a_debounce_refuses_what_would_end_its_own_run(registry: Registry, singleton: Any, field: str) -> None:
    """X7e: a superseding on_busy, or a queue_ttl no longer than max_seconds (a burst
    would expire its own run), is refused at registration."""
    with pytest.raises(InvalidWorkflowError) as caught:
        _declare(registry, [], singleton=singleton)
    assert caught.value.field == field


def test_a_bad_start_writes_nothing(timed: Engine, registry: Registry) -> None:
    """X7, section 7: a debounce key function that raises or returns a non-str, and a
    ``not_before`` on a debounced workflow, raise a typed error and write nothing,
    neither a run nor a change to the open run."""
    _declare(registry, [])
    open_run = timed.start("sync", {"store": "A", "n": 0})
    with pytest.raises(SingletonKeyError, match="debounce key"):
        timed.start("sync", {"n": 1})  # the key function raises KeyError
    with pytest.raises(SingletonKeyError, match="debounce key"):
        timed.start("sync", {"store": 7, "n": 1})
    with pytest.raises(SingletonKeyError, match="debounce key"):
        timed.start("sync", {"store": "", "n": 1})
    with pytest.raises(InvalidNotBeforeError):
        timed.start("sync", {"store": "A", "n": 1}, not_before=5)
    runs = _runs(timed)
    assert [r.run_id for r in runs] == [open_run.run_id]
    assert runs[0].input == {"store": "A", "n": 0} and runs[0].not_before == open_run.not_before


def test_start_many_folds_each_start_in_order(timed: Engine, registry: Registry) -> None:
    """X7: a batch of starts of one key is one run with the batch's last input; a bad
    input anywhere in the batch raises before anything is written."""
    _declare(registry, [])
    with pytest.raises(SingletonKeyError):
        timed.start_many("sync", [{"store": "A", "n": 0}, {"n": 1}])
    assert _runs(timed) == []
    out = timed.start_many("sync", [{"store": "A", "n": n} for n in range(5)])
    assert len({r.run_id for r in out}) == 1  # type: ignore[union-attr]
    assert [r.input["n"] for r in _runs(timed)] == [4]


def test_explain_says_when_a_debounced_run_starts(timed: Engine, registry: Registry) -> None:
    """X7, K3: explain names the run's start, the burst's first start and its cap."""
    _declare(registry, [])
    run = timed.start("sync", {"store": "A", "n": 0})
    explanation = timed.explain(run.run_id)
    assert explanation.state == ExplainState.NOT_DUE
    assert "debounced: starts at" in explanation.sentence and "burst since" in explanation.sentence
    assert "at most until" in explanation.sentence
    assert explanation.debounce_key == "A" and explanation.debounce_until == run.debounce_until


def test_concurrent_starts_of_one_key_create_one_run(timed: Engine, registry: Registry) -> None:
    """X7b, S13: starts of one debounce key from eight threads at once (each its own
    connection on the database) create one run, whatever the interleaving; every
    start returns it, and it holds one of the starts' inputs."""
    _declare(registry, [])

    def burst(i: int) -> set[str]:
        return {timed.start("sync", {"store": "A", "n": i * 100 + j}).run_id for j in range(5)}

    results = run_threads(8, burst)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    ids = set().union(*results)
    runs = _runs(timed)
    assert len(runs) == 1 and ids == {runs[0].run_id}
    # The newest by commit order wins (test_debounce_races.py checks which): here, one of the starts'.
    assert runs[0].input["n"] in {i * 100 + j for i in range(8) for j in range(5)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow  # four Python processes start Django: not in the quick tier (noxfile QUICK)
def test_concurrent_starts_from_several_processes_create_one_run(tmp_path: Any) -> None:
    """X7b, S13: four processes, each its own connection and engine, start one
    debounce key at once, ten starts each; the database holds one run of the
    key, and every start was given its id."""
    from durable_singleton.models import Run

    from ..worker_processes import start_at_once

    texts = start_at_once(tmp_path, "tests.features.debounce_starter", "10", "proc")
    given = {word for text in texts for word in text.split() if len(word) == 32}  # the run ids printed
    runs = list(Run.objects.filter(workflow_name="sync-proc").values_list("run_id", flat=True))
    assert len(runs) == 1 and given == set(runs), texts


@pytest.mark.django_db
def test_the_admin_run_page_says_when_a_debounced_run_starts(admin_client: Any, registry: Registry) -> None:
    """X7, K3: the admin's run page says "debounced: starts at T (burst since T0, at most
    until T1)" in its explanation and in the run's place."""
    from django.urls import reverse

    from durable_singleton.testing import make_engine

    _declare(registry, [])
    engine = make_engine("django", registry=registry)
    run = engine.start("sync", {"store": "A", "n": 0})
    engine.start("sync", {"store": "A", "n": 1})
    page = admin_client.get(reverse("admin:durable_singleton_run_change", args=[run.run_id]))
    text = page.content.decode()
    assert page.status_code == 200
    assert "is debounced: starts at" in text and "burst since" in text
    assert "debounced: starts at</a>" in text and "at most until" in text


@pytest.mark.django_db(transaction=True)
def test_a_fold_committed_during_a_claim_gives_the_body_the_folded_input(registry: Registry) -> None:
    """X7d, R5a: a start folds into run D a moment before D's time and commits only
    after a worker's claim of D read it (due, the old input) and waits for its row:
    the claim goes through (its compare-and-set is on status and attempts), or on
    PostgreSQL's one-statement claim finds D no longer due; either way no body
    runs with the input the fold replaced. PostgreSQL and MariaDB (row locks)."""
    from django.db import connection, transaction

    from durable_singleton.models import Run
    from durable_singleton.testing import make_engine

    from ..conftest import spawn
    from ..worker_processes import wait_for

    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no row locks: a claim cannot read while a fold holds its write")
    waiting_sql = (
        "SELECT COUNT(*) FROM pg_locks WHERE NOT granted"
        if connection.vendor == "postgresql"
        # The claim's locking read of D's row, in its procedure or on the ORM path: only this
        # test's open transaction holds that row.
        else "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID()"
        " AND INFO LIKE '%%FOR UPDATE%%'"
    )
    log: list[Any] = []
    _declare(registry, log)
    engine = make_engine("django", registry=registry)
    run = engine.start("sync", {"store": "A", "n": 0})
    starts = engine.store.now() + timedelta(seconds=3)
    Run.objects.filter(pk=run.run_id).update(not_before=starts, wake_at=starts)
    outcome: list[Any] = []
    with transaction.atomic():
        folded = engine.start("sync", {"store": "A", "n": 1})  # holds D's row until the commit
        assert folded.run_id == run.run_id
        wait_for(lambda: engine.store.now() > starts, 30, "D's former start time passed")
        spawn(lambda: outcome.append(engine.execute(run.run_id)))

        def claim_waits() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(waiting_sql)
                return bool(cursor.fetchone()[0])

        def processes() -> str:
            with connection.cursor() as cursor:
                cursor.execute("SHOW FULL PROCESSLIST" if connection.vendor == "mysql" else "SELECT 1")
                return "\n".join(str(row) for row in cursor.fetchall())

        wait_for(lambda: claim_waits() or outcome, 60, "the claim waits for D's row", processes)
    wait_for(lambda: outcome, 60, "the claim's turn ended")
    assert [n for _, n in log] in ([], [1])
    stored = Run.objects.get(pk=run.run_id)
    assert stored.input == {"store": "A", "n": 1}
