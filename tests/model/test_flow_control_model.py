"""A stateful model-based test of the flow controls of issue #33 (X6 throttle,
X7 debounce), with hypothesis.

Random interleavings of starts of a throttled workflow (two throttle keys, at
most 2 admissions per 60 s each), starts of a debounced workflow (two debounce
keys, 30 s quiet period, 100 s at most from a burst's first start), turns
(claims), settles, cancels, the tick and the passing of time, against the real
store (in memory, and the Django store on the DATABASE_URL database: SQLite,
PostgreSQL, MariaDB). The throttled starts draw a priority (0 or 5): a throttle
key's queue is the one order of X8a; the priority order inside a singleton key
is the turn machine's (tests/model/test_turn_model.py).

Time is the machine's, never the wall clock's: on the memory store its clock
moves; on the Django store, whose clock is the database's (R5), a passing of
``d`` seconds moves every stored time that is judged against the clock
(throttle admissions, ``not_before``, ``wake_at``, ``debounce_until``) ``d``
seconds back, and the machine adds ``d`` to its own offset: a time the store
recorded plus the offset at the moment it was recorded is its place on the
machine's timeline. The steps (7 s, 40 s) never sum to a period (30, 60, 100),
so no decision lands on a boundary; the few milliseconds a database takes are
covered by a margin of ``MARGIN`` seconds in which the machine accepts either
outcome.

Invariants, each judged on the store's answers:

* throttle (X6b): in every throttle key, the admission times the store
  recorded (on the machine's timeline) never hold more than the limit in any
  half-open interval of ``PERIOD`` seconds;
* throttle order (X6c, X8a, X3d): a throttled claim is admitted only if the
  due waiters of its throttle key ahead of it in the queue order (higher
  priority first, then oldest), plus the admissions already in the window,
  leave it room;
* debounce (X7, X7a, X7b): a start while its key's debounced run is open (not
  begun, its start time not come) returns that run, which then holds this
  start's input (the newest wins), and creates no run; a start once it has
  begun or its start time has come creates a new run; the run's start time is
  ``SECONDS`` after the last start of its burst, never past ``MAX_SECONDS``
  after the first; a debounced body begins with its burst's newest input, never
  before its start time: one run per burst;
* no run is claimed before its ``not_before`` (X5, X6d, X7a);
* at the end, the holders settle and time passes: every run ends (S7, S8, X6d).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from durable_singleton import Debounce, Throttle
from durable_singleton.definitions import Registry
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.helpers import StoreMachine, machine_store, machine_stores, run_machine

THROTTLE_KEYS = ("A", "B")
DEBOUNCE_KEYS = ("X", "Y")
#: The throttle's admissions per window and window, seconds (X6).
LIMIT = 2
PERIOD = 60.0
#: The debounce's quiet period and its longest hold from a burst's first start, seconds (X7).
SECONDS = 30.0
MAX_SECONDS = 100.0
#: The passings of time, seconds: no sum of them is 30, 60 or 100.
STEPS = (7.0, 40.0)
#: Seconds around a boundary in which the machine accepts either outcome (a database's
#: statements read its clock a few milliseconds apart).
MARGIN = 0.5
#: Seconds to a waiter's retry, a turn's redelivery and a lease's end: never reached.
FAR = 24 * 3600.0


def fresh_flow_store(clock: Any) -> Any:
    """A Django store on emptied tables, throttle admissions and folded starts too
    (they outlive their runs, X6b, X7c)."""
    from durable_singleton.models import DebouncedStart, Run, SingletonKey, ThrottleAdmission
    from durable_singleton.stores.django import DjangoStore

    Run.objects.all().delete()
    SingletonKey.objects.all().delete()
    ThrottleAdmission.objects.all().delete()
    DebouncedStart.objects.all().delete()
    return DjangoStore()


def most_in_a_window(times: list[float], period: float) -> tuple[int, float]:
    """The most of ``times`` (seconds) in one half-open interval ``[t, t + period)``,
    and its ``t``: the worst interval starts at one of them."""
    best = (0, 0.0)
    for t in times:
        n = sum(1 for u in times if t <= u < t + period)
        best = max(best, (n, t))
    return best


class FlowControl(StoreMachine):
    """The machine; ``make_store`` is set by the test that runs it."""

    def __init__(self) -> None:
        super().__init__()
        registry = Registry()
        rate = Throttle("rate", key=lambda i: i["k"], limit=LIMIT, period=PERIOD)
        registry.add("thr", "1", lambda ctx, i: None, throttles=[rate])
        debounce = Debounce(key=lambda i: i["k"], seconds=SECONDS, max_seconds=MAX_SECONDS)
        registry.add("deb", "1", lambda ctx, i: None, debounce=debounce)
        self.memory = isinstance(self.store, MemoryStore)
        self.engine = make_engine(
            self.store,
            registry=registry,
            clock=self.clock if self.memory else None,
            ADMISSION_RETRY_SECONDS=FAR,
            ADMISSION_RETRY_JITTER_SECONDS=0.0,
            BACKLOG_RETRY_SECONDS=FAR,
            REDELIVERY_SECONDS=FAR,
        )
        #: Seconds the Django store's stored times were moved back (the machine's clock ahead of the database's).
        self.offset = 0.0
        self.created: list[str] = []
        self.key_of: dict[str, str] = {}
        self.owner: dict[str, str] = {}
        #: Each throttle key's admissions on the machine's timeline (seconds), with their runs.
        self.admissions: dict[str, list[tuple[float, str]]] = {k: [] for k in THROTTLE_KEYS}
        self.admitted: set[str] = set()
        #: Each debounce key's burst: its run, first and last start (machine's seconds), newest input.
        self.burst: dict[str, dict[str, Any]] = {}
        #: The newest input of each debounced run's burst, and the runs whose body began.
        self.newest: dict[str, Any] = {}
        self.begun: set[str] = set()
        self.n = 0

    # -- time ----------------------------------------------------------------------------
    def _now(self) -> float:
        """The machine's clock, seconds: the store's plus the offset."""
        return float(self.store.now().timestamp()) + self.offset

    def _at(self, stored: Any) -> float:
        """A time the store holds now, on the machine's timeline (seconds)."""
        return float(stored.timestamp()) + self.offset

    @rule(seconds=st.sampled_from(STEPS))
    def time_passes(self, seconds: float) -> None:
        """``seconds`` pass on the store's clock (the memory store's), or every time the
        Django store judges against its clock moves that far back."""
        if self.memory:
            self.clock.now += timedelta(seconds=seconds)
            return
        from django.db.models import F

        from durable_singleton.models import Run, ThrottleAdmission

        back = timedelta(seconds=seconds)
        ThrottleAdmission.objects.update(admitted_at=F("admitted_at") - back)
        for field in ("not_before", "wake_at", "debounce_until"):
            Run.objects.filter(**{f"{field}__isnull": False}).update(**{field: F(field) - back})
        self.offset += seconds

    # -- starts --------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.n += 1
        if self.memory:
            self.clock.now += timedelta(microseconds=10)
        return f"r{self.n:03d}"

    @rule(key=st.sampled_from(THROTTLE_KEYS), count=st.sampled_from((1, 3)), priority=st.sampled_from((0, 5)))
    def start_throttled(self, key: str, count: int, priority: int) -> None:
        """``count`` starts of throttle key ``key`` at ``priority``, one after the other."""
        for _ in range(count):
            run = self.engine.start("thr", {"k": key}, run_id=self._new_id(), priority=priority)
            self.created.append(run.run_id)
            self.key_of[run.run_id] = key

    def _open(self, key: str, now: float) -> bool | None:
        """Whether ``key``'s burst run is open at ``now`` (X7a) by the machine's account:
        True, False, or None within ``MARGIN`` of its start time."""
        burst = self.burst.get(key)
        if burst is None or burst["run"] in self.begun or self.store.get_run(burst["run"]).is_terminal:
            return False
        starts_at = float(min(burst["last"] + SECONDS, burst["first"] + MAX_SECONDS))
        if abs(starts_at - now) < MARGIN:
            return None
        return now < starts_at

    @rule(key=st.sampled_from(DEBOUNCE_KEYS))
    def start_debounced(self, key: str) -> None:
        run_id = self._new_id()
        given = {"k": key, "n": self.n}
        before = self._now()
        was_open = self._open(key, before)
        run = self.engine.start("deb", given, run_id=run_id)
        after = self._now()
        burst = self.burst.get(key)
        folded = run.run_id != run_id
        if was_open is True:
            assert folded and burst is not None and run.run_id == burst["run"], (
                f"start {run_id} of {key} made a second run {run.run_id} while {burst} was open (X7)"
            )
        elif was_open is False:
            assert not folded, f"start {run_id} of {key} folded into {run.run_id} after it began or came due (X7a)"
        if folded:
            assert burst is not None and run.run_id == burst["run"], f"{run_id} folded into {run.run_id}, not {burst}"
            burst["last"] = before
        else:
            self.created.append(run_id)
            self.key_of[run_id] = key
            self.burst[key] = burst = {"run": run_id, "first": before, "last": before}
        self.newest[burst["run"]] = given
        stored = self.store.get_run(burst["run"])
        assert stored.input == given, f"{burst['run']} holds {stored.input}, not the newest start's {given} (X7)"
        expected = min(burst["last"] + SECONDS, burst["first"] + MAX_SECONDS)
        assert stored.not_before is not None
        starts_at = self._at(stored.not_before)
        assert expected - MARGIN <= starts_at <= expected + (after - before) + MARGIN, (
            f"{burst['run']} starts at {starts_at - before:+.3f} s, not {expected - before:+.3f} s (X7b)"
        )
        assert len(self.store.list_runs()) == len(self.created), "a debounced start created a run it did not return"

    # -- turns ---------------------------------------------------------------------------
    def _waiting(self) -> list[str]:
        """The runs not ended whose body this machine is not running."""
        ended = {r.run_id for r in self.store.list_runs() if r.is_terminal}
        return [r for r in self.created if r not in self.owner and r not in ended]

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def turn(self, data: st.DataObject) -> None:
        """One turn of a run not ended (a claim, S5), as a worker takes it."""
        waiting = self._waiting()
        if waiting:
            self._turn(data.draw(st.sampled_from(waiting)))

    @rule()
    def turn_each(self) -> None:
        """A turn of every run not ended, oldest first, as busy workers take them."""
        for run_id in self._waiting():
            self._turn(run_id)

    def _turn(self, run_id: str) -> None:
        before = self.store.get_run(run_id)
        now = self._now()
        waiting = self._due_waiters_ahead(before, now) if before.throttle_keys else 0
        self.n += 1
        turn = self.store.begin_turn(
            run_id,
            f"o{self.n}",
            lease_seconds=FAR,
            limits=self.engine.limits(),
            max_recoveries=3,
            retry=self.engine._retry_policy(),
        )
        if turn.state is not TurnState.RUN:
            return
        run = self.store.get_run(run_id)
        assert before.not_before is None or self._at(before.not_before) <= self._now() + MARGIN, (
            f"{run_id} claimed before its not_before (X5, X6d, X7a)"
        )
        self.owner[run_id] = f"o{self.n}"
        if run.debounce_key is not None and run_id not in self.begun:
            self.begun.add(run_id)
            assert run.input == self.newest[run_id], f"{run_id} began with {run.input}, not {self.newest[run_id]} (X7)"
        if run.throttle_keys and run_id not in self.admitted:
            self.admitted.add(run_id)
            assert run.admitted_at is not None
            at = self._at(run.admitted_at)
            key = self.key_of[run_id]
            in_window = sum(1 for t, _ in self.admissions[key] if at - PERIOD < t <= at)
            assert waiting + in_window + 1 <= LIMIT, (
                f"{run_id} admitted past {waiting} due waiters of {key} ahead of it with {in_window} "
                f"admissions in the window (X6c, X8a, X3d)"
            )
            self.admissions[key].append((at, run_id))

    def _due_waiters_ahead(self, run: Any, now: float) -> int:
        """The throttled runs of ``run``'s throttle key that wait, are due at ``now`` and
        are ahead of it in the queue order (``RunRecord.queue_place``: higher priority
        first, then oldest by (``created_at``, ``run_id``); X6c, X8a)."""
        older = 0
        for other in self.store.list_runs(workflow_name="thr"):
            if (
                other.throttle_keys
                and self.key_of[other.run_id] == self.key_of[run.run_id]
                and other.queue_place < run.queue_place
                and other.quota_slot == "waiter"
                and not other.is_terminal
                and (other.not_before is None or self._at(other.not_before) <= now - MARGIN)
            ):
                older += 1
        return older

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.owner)))
        owner = self.owner.pop(run_id)
        self.store.finish(self.store.get_run(run_id), owner, "completed", limits=self.engine.limits())

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        if run_id in self.owner:
            return  # a holder's cancel ends at its next boundary: the machine's settle plays it
        self.engine.cancel(run_id)
        self.engine.dispatcher.queue.clear()  # type: ignore[attr-defined]

    @rule()
    def tick(self) -> None:
        report = self.engine.tick()
        assert report.errors == []
        self.engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # turns are the machine's to run

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def admissions_per_window_within_the_limit(self) -> None:
        for key, admitted in self.admissions.items():
            most, at = most_in_a_window([t for t, _ in admitted], PERIOD)
            assert most <= LIMIT, f"{most} admissions of throttle key {key} within {PERIOD} s from {at} (X6b)"

    @invariant()
    def one_open_run_per_debounce_key(self) -> None:
        now = self._now()
        for key in DEBOUNCE_KEYS:
            open_runs = [
                r
                for r in self.store.list_runs(workflow_name="deb")
                if r.debounce_key == key
                and r.status == "pending"
                and r.run_id not in self.begun
                and r.not_before is not None
                and self._at(r.not_before) > now + MARGIN
            ]
            assert len(open_runs) <= 1, f"two open debounced runs of {key}: {[r.run_id for r in open_runs]} (X7)"

    def teardown(self) -> None:
        """Liveness (S7, S8, X6d): the holders settle, time passes, the tick sends the
        turns and the bodies run; every run ends. Each round admits at least one run of each
        throttle key (the window passed), so the rounds are bounded by the runs, not by the
        wall clock."""
        for run_id in list(self.owner):
            self.store.finish(
                self.store.get_run(run_id), self.owner.pop(run_id), "completed", limits=self.engine.limits()
            )
        rounds = 0
        while active := [r for r in self.store.list_runs() if not r.is_terminal]:
            rounds += 1
            assert rounds <= len(self.created) + 2, f"runs never finished: {active}"
            self.time_passes(FAR + 3600.0)  # every wake, retry and redelivery (FAR away) comes due
            self.engine.tick()
            self.engine.dispatcher.drain()  # type: ignore[attr-defined]


def _run(make_store: Any, examples: int) -> None:
    run_machine(
        FlowControl,
        make_store,
        max_examples=examples,
        stateful_step_count=30,
        phases=[Phase.explicit, Phase.reuse, Phase.generate] if os.environ.get("DS_NO_SHRINK") else list(Phase),
    )


@pytest.mark.parametrize("kind", machine_stores())
def test_flow_control_model(kind: str) -> None:
    """X6b, X6c, X6d, X7, X7a, X7b, X5: the flow-control machine on the in-memory store
    (40 examples) and on the Django store of the DATABASE_URL database, its clock the
    database's moved by the machine (12 examples)."""
    _run(machine_store(kind, fresh_flow_store), 40 if kind == "memory" else 12)
