"""Workflows used by the tests, registered into a test's own registry."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from durable_singleton import Singleton
from durable_singleton.definitions import Registry, WorkflowDefinition
from durable_singleton.models import Run

from .conftest import Monitor, spawn


def audited(
    registry: Registry,
    monitor: Monitor,
    *,
    name: str = "wf",
    limit: int = 1,
    max_queue_depth: int | None = None,
    hold: threading.Event | None = None,
    steps: int = 1,
    on_busy: str = "queue",
) -> WorkflowDefinition:
    """Register a singleton workflow keyed by ``input['k']`` whose body records
    entry and exit in ``monitor`` and, if ``hold`` is given, waits for it.
    ``on_busy``: the key's strategy on a busy start (X1)."""
    step_name = f"{name}:work"
    if step_name not in registry.steps:
        registry.add_step(step_name, lambda x: x)

    def body(ctx: Any, input: dict[str, Any]) -> dict[str, Any]:
        key = input["k"]
        monitor.enter(key, ctx.run_id)
        try:
            if hold is not None:
                assert hold.wait(30), "hold was never released"
            for n in range(steps):
                ctx.step(step_name, {"n": n})
            return {"done": ctx.run_id}
        finally:
            monitor.exit(key)

    return registry.add(
        name,
        "1",
        body,
        singleton=Singleton(
            key=lambda i: f"key:{i['k']}", limit=limit, max_queue_depth=max_queue_depth, on_busy=on_busy
        ),
    )


@contextmanager
def body_held(
    execute: Callable[[str], Any], run_id: str, monitor: Monitor, hold: threading.Event, timeout: float = 60.0
) -> Iterator[None]:
    """Run ``execute(run_id)`` in a thread (an :func:`audited` workflow with
    ``hold``) and yield once its body has entered (``monitor.entered == [run_id]``),
    so the block runs while it holds its slot; afterwards release ``hold`` and
    join the thread. Raises AssertionError if the body has not entered in
    ``timeout`` seconds."""
    thread = spawn(execute, run_id)
    try:
        deadline = time.monotonic() + timeout
        while monitor.entered != [run_id]:
            assert time.monotonic() < deadline, f"{run_id}'s body never entered: {monitor.entered}"
            time.sleep(0.01)
        yield
    finally:
        hold.set()
        thread.join(10)


@contextmanager
def connected(receiver: Callable[..., Any], *signals: Any) -> Iterator[None]:
    """While the block runs, ``receiver`` is connected to each Django signal of
    ``signals``; disconnected after it, even if it raises."""
    for signal in signals:
        signal.connect(receiver)
    try:
        yield
    finally:
        for signal in signals:
            signal.disconnect(receiver)


@contextmanager
def counted_per_run(signal: Any) -> Iterator[Counter[str]]:
    """Count the sends of the Django signal ``signal`` (``run_created``,
    ``run_finished``: its ``run`` argument) per run id, whichever thread sent
    them, while the block runs."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def receiver(sender: Any, run: Any, **kwargs: Any) -> None:
        with lock:
            counts[run.run_id] += 1

    signal.connect(receiver, weak=False)
    try:
        yield counts
    finally:
        signal.disconnect(receiver)


@contextmanager
def store_method_replaced(engine: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """While the block runs, ``engine.store.<name>`` is ``replacement`` (on this
    store object only; a replacement calls the real method it read before);
    afterwards the store's own method is back."""
    setattr(engine.store, name, replacement)
    try:
        yield
    finally:
        delattr(engine.store, name)


def manual_default_engine(settings: Any) -> Any:
    """The default engine (``get_engine()``) with the manual dispatcher, its
    queue emptied (the engine outlives tests: turns of earlier ones are
    dropped); ``settings`` is pytest-django's fixture. Turns wait for ``drain()``."""
    from durable_singleton.runtime import get_engine

    settings.DURABLE_SINGLETON = {**settings.DURABLE_SINGLETON, "DISPATCH": "manual"}
    engine = get_engine()
    engine.dispatcher.queue.clear()
    return engine


def apps_at(targets: list[tuple[str, str]]) -> Any:
    """Migrate the default database to ``targets`` (``[(app, migration)]``) and
    return the historical apps there (``apps.get_model`` gives the models as
    that migration left them)."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def migrate_to_latest() -> None:
    """Migrate the default database forward to this app's last migration."""
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes("durable_singleton"))


class KeysInside:
    """Counts the bodies inside each key at once (``inside``, ``peak`` per key)
    and records the runs whose bodies ended (``done``), from any thread; a body
    calls :meth:`enter` with its keys, then :meth:`leave`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.done: list[str] = []

    def enter(self, keys: list[str]) -> None:
        with self.lock:
            for k in keys:
                self.inside[k] = self.inside.get(k, 0) + 1
                self.peak[k] = max(self.peak.get(k, 0), self.inside[k])

    def leave(self, keys: list[str], run_id: str) -> None:
        with self.lock:
            for k in keys:
                self.inside[k] -= 1
            self.done.append(run_id)

    def most(self, prefix: str) -> int:
        """The most bodies ever inside one key starting with ``prefix`` at once."""
        return max(v for k, v in self.peak.items() if k.startswith(prefix))


def control_key(engine: Any, name: str, key: str, action: str, limit: int | None = None) -> None:
    """Apply a key control (K2) by ``t`` to key ``key`` of ``name`` (a workflow,
    or ``quota:<quota name>``): ``action`` ``"pause"``, ``"resume"``, or any
    other: override the key's limit with ``limit`` (None clears the override)."""
    if action == "pause":
        engine.pause_key(name, key, by="t")
    elif action == "resume":
        engine.resume_key(name, key, by="t")
    else:
        engine.override_limit(name, key, limit, by="t")


def control_one_quota_key(
    rng: Any, engines: dict[str, Any], quotas: dict[str, str], limits: dict[str, int]
) -> tuple[str, str, str, int | None]:
    """A step of a differential test: one random key control (K2) on a random key of one
    of ``quotas`` (quota name: its key letters), the same on every engine of ``engines``
    (by name; its key ``<name>-<key>``): pause, resume, a limit override one above
    ``limits[quota]`` or down to 1, or the override cleared. Returns (quota, key,
    action, limit)."""
    quota = rng.choice(list(quotas))
    key = rng.choice(quotas[quota])
    action = rng.choice(["pause", "resume", "up", "down", "clear"])
    limit = {"up": limits[quota] + 1, "down": 1, "clear": None}.get(action)
    for name, e in engines.items():
        control_key(e, f"quota:{quota}", f"{name}-{key}", action, limit)
    return quota, key, action, limit


class HandClock:
    """A clock a test moves by hand (an engine's or the memory store's one
    clock, R5): it reads ``now`` (an aware UTC datetime, the real time at
    creation unless given) until the test moves it."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now if now is not None else datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        self.now += timedelta(seconds=seconds)


def seeds(count: int) -> list[Any]:
    """The seeds ``0 .. count - 1`` of a random-schedule test, for
    ``pytest.mark.parametrize``: seed 0 runs everywhere, the others are marked
    ``slow``, so the quick tier (``nox -s quick``) runs one schedule of each
    test and CI's database passes run them all."""
    import pytest

    return [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(1, count))]


def claim(engine: Any, run_id: str, owner: str | None = None, lease_seconds: float = 30.0) -> Any:
    """Run one claim of ``run_id`` as ``execute`` does, without the body: the
    store's ``begin_turn`` (S5). Returns the :class:`Turn`."""
    import uuid

    return engine.store.begin_turn(
        run_id,
        owner or f"test:{uuid.uuid4().hex[:8]}",
        lease_seconds=lease_seconds,
        limits=engine.limits(),
        max_recoveries=engine.settings.MAX_RECOVERIES,
        retry=engine._retry_policy(),
    )


def sleep_past_lease(engine: Any, run_id: str, timeout: float = 30.0) -> None:
    """Wait until the store's clock (the clock that decides a lease, R5) is
    past the lease ``run_id`` holds, however loaded the machine is: a fixed
    sleep of the lease's length can end before the store's clock got there
    (the clock's floor, a slow claim). Raises AssertionError after ``timeout``
    seconds."""
    sleep_past(engine, "lease_expires_at", run_id, timeout=timeout)


def sleep_past(engine: Any, field: str, *run_ids: str, timeout: float = 30.0) -> None:
    """Wait until the store's own clock (``engine.store.now()``: the database's,
    which decides leases, timers and deadlines, R5) is past ``field`` of each
    run, e.g. ``sleep_past(engine, "wake_at", "A", "B")`` (``wake_at``,
    ``deadline_at``, ``lease_expires_at``), read again once the clock passed it
    (a later write may have moved it). A fixed sleep of
    the interval can end before that clock got there: the engine's clock is
    the process's, corrected with an error up to half a round trip, and a
    loaded machine stretches the round trip. Raises AssertionError after
    ``timeout`` seconds."""
    import time

    for run_id in run_ids:
        when = getattr(engine.get(run_id), field)
        assert when is not None, f"run {run_id} has no {field}"
        deadline = time.monotonic() + timeout
        while True:
            while engine.store.now() <= when:
                assert time.monotonic() < deadline, f"the store's clock never passed {run_id}'s {field} ({when})"
                time.sleep(0.01)
            # Read again once the clock passed it: a write after the first read (a claim's
            # confirmation stamping the lease again, on a loaded machine) may have moved it.
            now_when = getattr(engine.get(run_id), field)
            if now_when is None or now_when <= when:
                break
            when = now_when


def tick_until(engine: Any, condition: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    """Tick and run the turns the tick sent (a manual dispatcher's drain), every
    20 ms, until ``condition()`` is true: the work of a timer, a deadline or a
    retry is done when the store's clock has passed it AND the body's own read
    of the clock (the process clock corrected to the store's, R8, off by up to
    half a round trip) agrees, so one tick after a fixed sleep may come too
    early on a loaded machine. Raises AssertionError naming ``what`` after
    ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        engine.tick()
        engine.dispatcher.drain(max_turns=100)
        time.sleep(0.02)


def waiter_behind_a_freed_slot(engine: Any, registry: Registry, monitor: Monitor) -> None:
    """Key K of workflow ``wf`` (:func:`audited`): holder A claimed, B parked
    behind it, then A's slot freed with no handoff (as a crash between the two
    would leave it), and the dispatcher's record of sends cleared: only the
    tick's catch-up can grant B now (S8)."""
    audited(registry, monitor)
    engine.start("wf", {"k": "K"}, run_id="A")
    engine.start("wf", {"k": "K"}, run_id="B")
    assert claim(engine, "A", "w").state.value == "run"
    assert engine.execute("B") == "parked"
    free_slot_without_handoff(engine, "A")
    engine.dispatcher.sent.clear()


def two_waiters_behind_freed_slots(engine: Any, workflow: str) -> None:
    """Key K of ``workflow`` (limit 2): holders H1 and H2 claimed, W1 and W2
    parked behind them, then both slots freed with no handoff: W1 and W2 wait
    on a key with two free slots (S5, S7)."""
    for run_id in ("H1", "H2", "W1", "W2"):
        engine.start(workflow, {}, run_id=run_id)
    assert claim(engine, "H1").state.value == "run" and claim(engine, "H2").state.value == "run"
    assert claim(engine, "W1").state.value == "parked" and claim(engine, "W2").state.value == "parked"
    free_slot_without_handoff(engine, "H1")
    free_slot_without_handoff(engine, "H2")


def admitted(turn: Any) -> str:
    """Return "admitted", "parked" or "gone" for a :class:`Turn` (the old claim's verdicts)."""
    from durable_singleton.stores.base import TurnState

    return {TurnState.RUN: "admitted", TurnState.PARKED: "parked"}.get(turn.state, "gone")


def free_slot_without_handoff(engine: Any, run_id: str) -> None:
    """Make a holder terminal by a raw write that grants nothing, as a row edit
    or an older release would: only the tick's catch-up can give its slot on (S8a)."""
    from durable_singleton.stores.memory import MemoryStore

    if isinstance(engine.store, MemoryStore):
        with engine.store._critical():
            run = engine.store._runs[run_id]
            engine.store._runs[run_id] = run.evolve(status="completed", admitted=False, tracked=False, lease_owner=None)
    else:
        from durable_singleton.models import Run

        assert Run.objects.filter(pk=run_id).update(status="completed", singleton_slot=None, singleton_tracked=False)


def settle(engine: Any, run_id: str, status: str, **fields: Any) -> bool:
    """Settle ``run_id`` as its holder would (or, parked, as the tick would) and
    send the waiters its slot was granted to (S7). Returns whether it settled."""
    run = engine.store.get_run(run_id)
    if run is None or run.is_terminal:
        return False
    owner = run.lease_owner if run.status == "running" else None
    if run.status == "running" and owner is None:
        # A running run without a lease (an older release's): settle it as a raw write would.
        from durable_singleton.stores.memory import MemoryStore

        if isinstance(engine.store, MemoryStore):
            with engine.store._critical():
                done = engine.store._settle(run, status, fields.get("output"), fields.get("error"), engine.limits())
        else:
            from django.db.models import Q

            done = engine.store._finish(
                run, Q(pk=run_id), status, fields.get("output"), fields.get("error"), engine.limits()
            )
    else:
        done = engine.store.finish(run, owner, status, limits=engine.limits(), expect=(run.status,), **fields)
    if done.settled:
        engine._settled(done)
    return bool(done.settled)


def backend_id() -> int:
    """Return the server's id of this thread's database connection (PostgreSQL
    ``pg_backend_pid()``, MySQL/MariaDB ``CONNECTION_ID()``), connecting if needed."""
    from django.db import connection

    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if connection.vendor == "postgresql" else "SELECT CONNECTION_ID()")
        (backend,) = cursor.fetchone()
    return int(backend)


def kill_backend(backend: int) -> None:
    """Kill connection ``backend`` from the server's side, from another thread's
    own connection, as an operator or a failover would (``pg_terminate_backend``,
    ``KILL CONNECTION``); no error reaches the killed connection until it is used."""
    from django.db import connection

    statement = "SELECT pg_terminate_backend(%s)" if connection.vendor == "postgresql" else "KILL CONNECTION %s"

    def kill() -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute(statement, [backend])
        finally:
            connection.close()

    killer = threading.Thread(target=kill)
    killer.start()
    killer.join(30)


def kill_this_connection() -> None:
    """Kill the calling thread's database connection from the server's side (PostgreSQL, MariaDB)."""
    kill_backend(backend_id())


def hold_in_transaction(lock: Callable[[], object], seconds: float) -> threading.Thread:
    """Start a daemon thread that, in a transaction of its own connection,
    calls ``lock()`` (a key's or a run's row lock, a write) and holds what it
    took for ``seconds``; return the thread once ``lock()`` has returned."""
    from django.db import connections, transaction

    locked = threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                lock()
                locked.set()
                time.sleep(seconds)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert locked.wait(10), "the lock was not taken"
    return thread


def drain(engine: Any) -> None:
    """Run every turn queued on a manual dispatcher, and the turns those queue (S7)."""
    engine.dispatcher.drain()


def drain_chains(engine: Any) -> None:
    """Run every turn queued on a manual dispatcher with ``execute_chain``
    (each turn and the handoffs it runs in line, O6), oldest first."""
    queue = engine.dispatcher.queue
    while queue:
        engine.execute_chain(queue.popleft())


def parks_when_asked(ctx: Any, input: dict[str, Any]) -> None:
    """A body that waits for the signal ``go`` when its input has a true ``park``."""
    if input.get("park"):
        ctx.wait_for_signal("go")


def holds_when_asked(ctx: Any, input: dict[str, Any]) -> str:
    """A body that waits for the signal ``go`` when its input has a true
    ``hold``; returns its run id."""
    if input.get("hold"):
        ctx.wait_for_signal("go")
    return str(ctx.run_id)


def keyed_registry(name: str) -> Registry:
    """A new registry with one workflow ``name``, keyed by ``input['k']``, whose
    body is :func:`parks_when_asked`."""
    registry = Registry()
    registry.add(name, "1", parks_when_asked, singleton={"key": lambda i: i["k"]})
    return registry


def queued(engine: Any) -> Any:
    """The turns queued on a manual dispatcher, oldest first (a deque of run ids)."""
    return engine.dispatcher.queue


def execute_one_turn(rng: Any, engines: dict[str, Any], first: str) -> str | None:
    """A step of a differential test: execute, on every engine of ``engines`` (by
    name), the turn at one random place of its queue, the same place in each; return
    what was done (``execute <run id>`` of engine ``first``), or None if ``first``
    has no turn queued. Each engine's run ids are ``<name>-<id>``."""
    queues = {name: queued(e) for name, e in engines.items()}
    if not queues[first]:
        return None
    index = rng.randrange(len(queues[first]))
    what = f"execute {queues[first][index]}"
    for name, e in engines.items():
        turn = queues[name][index]
        del queues[name][index]
        e.execute(turn)
    return what


def act_on_one(
    rng: Any, engines: dict[str, Any], first: str, ids: list[str], holds: Callable[[Any], bool], action: str, *args: Any
) -> str | None:
    """A step of a differential test: pick at random one of ``ids`` whose run on engine
    ``first`` ``holds(run)``, and call ``engine.<action>("<name>-<id>", *args)`` on
    every engine of ``engines`` (e.g. ``signal`` with ``"go"``, ``cancel``,
    ``retry``); return what was done (``cancel 004``), or None if no run holds."""
    chosen_from = [i for i in ids if holds(engines[first].get(f"{first}-{i}"))]
    if not chosen_from:
        return None
    chosen = rng.choice(chosen_from)
    for name, e in engines.items():
        getattr(e, action)(f"{name}-{chosen}", *args)
    return f"{action} {chosen}"


def quota_body(ctx: Any, input: dict[str, Any]) -> dict[str, int]:
    """A body that waits for the signal ``go`` when its input says ``hold``, fails
    when it says ``fail``, and returns the quota tokens it ran under (X3, K1)."""
    if input.get("hold"):
        ctx.wait_for_signal("go")
    if input.get("fail"):
        raise RuntimeError("boom")
    return dict(ctx.quota_tokens)


def holding_body(log: list[str]) -> Callable[[Any, dict[str, Any]], str]:
    """A body that waits for the signal ``go`` when its input says ``hold``, then
    appends its run id to ``log`` and returns it: the order bodies ran in."""

    def body(ctx: Any, input: dict[str, Any]) -> str:
        if input.get("hold"):
            ctx.wait_for_signal("go")
        log.append(ctx.run_id)
        return str(ctx.run_id)

    return body


def running_run(
    run_id: str, workflow: str, owner: str, now: datetime, expires_in: float, status: str = "running"
) -> Run:
    """Create run ``run_id`` of ``workflow`` running (or in ``status``) under ``owner``'s lease:
    created at ``now`` (the store's clock, R5) and leased until ``expires_in`` seconds after it."""
    return Run.objects.create(
        run_id=run_id,
        workflow_name=workflow,
        workflow_version="1",
        status=status,
        created_at=now,
        updated_at=now,
        lease_owner=owner,
        lease_expires_at=now + timedelta(seconds=expires_in),
    )


def fresh_django_store(clock: Any) -> Any:
    """A Django store on emptied run and key tables, for each example of a
    model-based test (``clock`` is the machine's; the Django store reads the
    database's clock, R5)."""
    from durable_singleton.models import SingletonKey
    from durable_singleton.stores.django import DjangoStore

    Run.objects.all().delete()
    SingletonKey.objects.all().delete()
    return DjangoStore()


class MachineClock:
    """A model machine's clock for the in-memory store, moved by the machine (lease
    expiry, wake times); the Django store reads the database's clock (R5)."""

    def __init__(self) -> None:
        from django.utils import timezone

        self.now = timezone.now()

    def __call__(self) -> Any:
        return self.now


class StoreMachine(RuleBasedStateMachine):
    """A model-based test's hypothesis machine on one store: each example gets a
    fresh :class:`MachineClock` and the store ``make_store(clock)`` returns (set by
    :func:`run_machine`)."""

    make_store: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.clock = MachineClock()
        self.store = self.make_store(self.clock)


@precondition(lambda self: self.owner)
@rule(data=st.data())
def crash_and_expire(self: Any, data: st.DataObject) -> None:
    """A machine's rule (``self.owner``: the runs it executes, by owner): a worker dies
    and its lease expires (the row's expiry moves into the past on the store's clock);
    the next turn takes over (D4), with new quota tokens (X3f)."""
    run_id = data.draw(st.sampled_from(sorted(self.owner)))
    self.owner.pop(run_id)
    plant_run_fields(self.store, run_id, lease_expires_at=self.store.now() - timedelta(seconds=1))


def random_input(rng: Any, hold: float, fail: float) -> dict[str, Any]:
    """A random schedule's start input: key ``k`` in a/b, quota keys ``p`` in x/y and
    ``o`` in u/v, held (``hold``, the body waits for the signal ``go``) and failing
    (``fail``) with these probabilities (:func:`quota_body`)."""
    return {
        "k": rng.choice("ab"),
        "p": rng.choice("xy"),
        "o": rng.choice("uv"),
        "hold": rng.random() < hold,
        "fail": rng.random() < fail,
    }


def machine_stores() -> list[Any]:
    """The stores a model-based test runs its machine on, for ``pytest.mark.parametrize``:
    ``memory`` (vendor-agnostic: the SQLite passes) and ``django``, the Django store of
    the DATABASE_URL database (a long loop: marked ``slow``, so CI's database passes
    run it and the quick tier does not)."""
    import pytest

    return [
        pytest.param("memory", marks=pytest.mark.vendor_agnostic),
        pytest.param("django", marks=[pytest.mark.slow, pytest.mark.django_db(transaction=True)]),
    ]


def machine_store(kind: str, fresh: Callable[[Any], Any] = fresh_django_store) -> Callable[[Any], Any]:
    """The ``make_store(clock)`` of a machine on store ``kind`` (:func:`machine_stores`):
    the in-memory store on the machine's clock, or ``fresh`` (a Django store on
    emptied tables, each example)."""
    if kind == "memory":
        from durable_singleton.stores.memory import MemoryStore

        return lambda clock: MemoryStore(clock=clock)
    return fresh


def run_machine(protocol: type, make_store: Callable[[Any], Any], **overrides: Any) -> None:
    """Run the hypothesis state machine ``protocol`` as a test on the stores that
    ``make_store(clock)`` returns, with no deadline, no example database and
    ``overrides`` to hypothesis's settings (``max_examples``, ...)."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    machine = type("Machine", (protocol,), {"make_store": staticmethod(make_store)})
    run_state_machine_as_test(
        machine,
        settings=settings(
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            **overrides,
        ),
    )


def execute_racing(engines: list[Any], ids: list[str], done: Any, rounds: int = 40, timeout: float = 240.0) -> None:
    """Execute the runs ``ids`` from one thread per engine, each thread its own
    share first and then every run, ``rounds`` times or until ``done`` (what the
    bodies record as finished) holds as many as ``ids``; a redelivered turn of
    a finished or held run is a no-op (S5, S9, R6). Raises AssertionError with
    what any thread raised."""
    from .conftest import run_threads

    def worker(i: int) -> None:
        for _ in range(rounds):
            for run_id in ids[i :: len(engines)] + ids:
                engines[i].execute(run_id)
            if len(done) >= len(ids):
                return

    results = run_threads(len(engines), worker, timeout=timeout)
    assert [r for r in results if isinstance(r, BaseException)] == []


def plant_run_fields(store: Any, run_id: str, **fields: Any) -> None:
    """Write ``fields`` (e.g. ``lease_expires_at``, ``wake_at``) of run ``run_id``
    straight into ``store``'s row, unfenced, as a dead worker or a passing clock
    leaves them: the in-memory store's record or the ``Run`` table (D4, S8)."""
    from durable_singleton.stores.memory import MemoryStore

    if isinstance(store, MemoryStore):
        with store._critical():
            store._runs[run_id] = store._runs[run_id].evolve(**fields)
    else:
        Run.objects.filter(pk=run_id).update(**fields)


def round_trips(fn: Callable[[], Any]) -> list[str]:
    """Return the statements (BEGIN and COMMIT included) ``fn`` sent on the default
    connection, one per round trip, leaving out the ``PREPARE`` a PostgreSQL
    connection sends once at the first use of each statement."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        fn()
    return [q["sql"] for q in queries.captured_queries if not q["sql"].lstrip().startswith("PREPARE ")]


def room_engine(registry: Registry) -> Any:
    """An engine on the Django store (the database's room) of ``registry`` whose
    clock was read once, so that the round trips counted after it leave that read out."""
    from durable_singleton.stores.django import DjangoStore
    from durable_singleton.testing import make_engine

    made = make_engine(DjangoStore(), registry=registry)
    made.now()
    return made


def fault_bodies(workflow: str) -> int:
    """The body entries (``BodyAudit`` rows) of ``workflow``: the test project's scheduled
    syncs, which a worker's tick fires at their windows (every 15 minutes), write rows of
    their own, so a test counts its workflow's alone."""
    from testproject.inventory.models import BodyAudit

    return BodyAudit.objects.filter(workflow_name=workflow).count()
