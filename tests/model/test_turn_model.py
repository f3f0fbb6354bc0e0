"""A stateful model-based test of the turn protocol (issue #8), with hypothesis.

Random interleavings of start, a delayed start (X5) and its coming due, a waiter's queue TTL passing (X2),
a "replace_queued" start (X1, version 2 of the workflow: its versions share the key, S2),
turn (claim), a holder's step, sleep and wake,
a signal, cancel, execution timeout, a worker crash with lease expiry and the
takeover, the tick, a limit change between deploys, and the holder's settle,
run against the real store (in memory, and the Django store on the DATABASE_URL
database). A small reference model keeps what the store must agree with.

Invariants after every step:

* at most ``limit`` holders per key, counting the limit in force when each
  holder was admitted (a lowered limit never evicts, K2, S8b);
* admission follows the queue order among the key's due waiters: higher
  priority first, FIFO within a priority (S5 step 3, X5, X8; starts draw a
  priority from -1, 0 and 1);
* a run whose not_before has not come is never claimed or admitted (X5);
* no body of a cancelled run resumes (D6, F13);
* a run the tick ended by its queue TTL was never admitted, and is
  ``cancelled`` with code ``queue_ttl_expired`` (X2, R5a);
* a run a "replace_queued" start replaced was never admitted, and is
  ``cancelled`` with code ``replaced``; right after such a start the key has
  at most one waiter beyond its free slots (X1, R5a);
* fencing tokens strictly increase per key in admission order (K1);
* at the end, once the holders finish, every waiter is admitted and every run
  ends (S7, S8).

Bodies are driven step by step by the state machine: a "turn" claims through
the store (``begin_turn``), and the body's later writes are the store's fenced
calls, so each rule is one atomic store call, as in a worker.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from durable_singleton.definitions import Registry
from durable_singleton.stores.base import StepRecord, TurnState
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.helpers import StoreMachine, crash_and_expire, machine_store, machine_stores, run_machine

KEYS = ("A", "B")
#: The queue TTL (X2): longer than the hours the teardown moves the clock, so
#: only ``queue_ttl_passes`` ends a waiter by it.
QUEUE_TTL = 30 * 86400.0
EXAMPLES = 25
STEPS = 40


class TurnProtocol(StoreMachine):
    """The machine; ``make_store`` is set by the test that runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = Registry()
        self.limit = 2
        self._declare(self.limit)
        self.engine = make_engine(
            self.store, registry=self.registry, clock=self.clock if isinstance(self.store, MemoryStore) else None
        )
        self.created: list[str] = []
        self.key_of: dict[str, str] = {}
        self.owner: dict[str, str] = {}  # run -> owner of the turn this machine is "executing"
        self.admitted_order: dict[str, list[str]] = {k: [] for k in KEYS}
        self.tokens: dict[str, list[int]] = {k: [] for k in KEYS}
        self.limit_at_admission: dict[str, int] = {}
        self.cancelled_seen: set[str] = set()
        self.expired_seen: set[str] = set()
        self.replaced_seen: set[str] = set()
        self.n = 0

    def _declare(self, limit: int) -> None:
        registry = Registry()
        registry.add_step("m:step", lambda x: x)
        singleton = {"key": lambda i: i["k"], "limit": limit, "queue_ttl": QUEUE_TTL}
        registry.add("m", "1", lambda ctx, i: None, singleton=singleton, timeout=3600)
        replacing = {**singleton, "on_busy": "replace_queued"}
        registry.add("m", "2", lambda ctx, i: None, singleton=replacing, timeout=3600)
        self.registry = registry
        if hasattr(self, "engine"):
            self.engine.registry = registry

    # -- helpers -------------------------------------------------------------------
    def _run(self, run_id: str) -> Any:
        return self.store.get_run(run_id)

    def _runs(self) -> dict[str, Any]:
        """Every run of the machine by id, read at once (``list_runs``: one query on
        the Django store instead of one per run)."""
        return {r.run_id: r for r in self.store.list_runs(workflow_name="m")}

    def _active(self) -> list[str]:
        runs = self._runs()
        return [r for r in self.created if not runs[r].is_terminal]

    def _record_admission(self, run: Any, runs: dict[str, Any], now: Any) -> None:
        """Record ``run``'s admission; ``runs`` and ``now`` are read right after the
        store call that admitted it (``_runs()``, ``store.now()``)."""
        key = self.key_of[run.run_id]
        if run.run_id in self.admitted_order[key]:
            return
        # The queue order (S5 step 3, X8): every due waiter of the key ahead of it by
        # (priority DESC, created_at, run_id) was admitted or ended first.
        for other in self.created:
            if other == run.run_id or self.key_of[other] != key:
                continue
            older = runs[other]
            if older.queue_place < run.queue_place and self._is_due(older, now):
                assert other in self.admitted_order[key] or older.is_terminal or older.admitted, (
                    f"{run.run_id} admitted before due waiter {other} ahead of it in the queue order"
                )
        self.admitted_order[key].append(run.run_id)
        assert run.fencing_token is not None
        self.tokens[key].append(run.fencing_token)
        self.limit_at_admission[run.run_id] = self.limit

    def _record_admissions(self, run_ids: list[str]) -> None:
        """Record the admissions of ``run_ids`` (one store call's), in token order."""
        runs, now = self._runs(), self.store.now()
        for run in sorted((runs[r] for r in run_ids), key=lambda r: r.fencing_token or 0):
            self._record_admission(run, runs, now)

    @staticmethod
    def _is_due(run: Any, now: Any) -> bool:
        return run.not_before is None or run.not_before <= now

    def _sync_admissions(self) -> None:
        self._record_admissions([r.run_id for r in self._runs().values() if r.admitted])

    # -- rules ---------------------------------------------------------------------
    @rule(key=st.sampled_from(KEYS), priority=st.sampled_from((0, 1, -1)))
    def start(self, key: str, priority: int) -> None:
        self.n += 1
        self.clock.now += timedelta(microseconds=10)
        run = self.engine.start("m", {"k": key}, run_id=f"r{self.n:03d}", priority=priority)
        self.created.append(run.run_id)
        self.key_of[run.run_id] = key

    @rule(key=st.sampled_from(KEYS))
    def start_delayed(self, key: str) -> None:
        """A delayed start (X5): not due for an hour, until ``delays_pass``."""
        self.n += 1
        self.clock.now += timedelta(microseconds=10)
        not_before = self.store.now() + timedelta(hours=1)
        run = self.engine.start("m", {"k": key}, run_id=f"r{self.n:03d}", not_before=not_before)
        self.created.append(run.run_id)
        self.key_of[run.run_id] = key

    @rule(key=st.sampled_from(KEYS))
    def start_replacing(self, key: str) -> None:
        """A "replace_queued" start (X1): it ends the key's waiters beyond its free
        slots (code ``replaced``), never a holder, and leaves at most one run queued."""
        self.n += 1
        self.clock.now += timedelta(microseconds=10)
        runs = [r for r in self._runs().values() if self.key_of[r.run_id] == key]
        waiting = [r.run_id for r in runs if not r.is_terminal and not r.admitted]
        holding = [r for r in runs if not r.is_terminal and r.admitted]
        run = self.engine.start("m", {"k": key}, run_id=f"r{self.n:03d}", version="2")
        self.created.append(run.run_id)
        self.key_of[run.run_id] = key
        afters = self._runs()
        for run_id in waiting:
            after = afters[run_id]
            if after.is_terminal:
                assert after.error["code"] == "replaced", after
                self.replaced_seen.add(run_id)
                self.cancelled_seen.add(run_id)
        for before in holding:
            after = afters[before.run_id]
            assert (after.status, after.cancel_requested) == (before.status, before.cancel_requested), after
        active = self.store.active_runs_for_key("m", key)
        holders = sum(1 for r in active if r.admitted)
        assert len(active) - holders <= max(self.limit - holders, 0) + 1, active

    @rule()
    def delays_pass(self) -> None:
        """Every delayed start comes due (its not_before moves into the past)."""
        self._sync_admissions()
        self._make_due()

    def _make_due(self) -> None:
        past = self.store.now() - timedelta(seconds=1)
        if isinstance(self.store, MemoryStore):
            with self.store._critical():
                for run_id, run in list(self.store._runs.items()):
                    if run.not_before is not None and run.not_before > past:
                        self.store._runs[run_id] = run.evolve(not_before=past)
        else:
            from durable_singleton.models import Run

            Run.objects.filter(not_before__gt=past).update(not_before=past)

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def turn(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        owner = f"o{self.n}-{run_id}-{len(self.owner)}"
        self.n += 1
        turn = self.store.begin_turn(
            run_id,
            owner,
            lease_seconds=30,
            limits=self.engine.limits(),
            max_recoveries=3,
            retry=self.engine._retry_policy(),
        )
        admitted = [g.run_id for g in turn.granted]
        if turn.state is TurnState.RUN:
            assert run_id not in self.cancelled_seen, "a cancelled run's body resumed (D6, F13)"
            assert self._run(run_id).admitted
            admitted.append(run_id)
            self.owner[run_id] = owner
        self._record_admissions(admitted)  # one claim's admissions, in token order

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.owner)))
        run = self._run(run_id)
        step = StepRecord(run.step_count, "m:step", 1, self.engine.now(), self.engine.now())
        if not self.store.save_step(run_id, self.owner[run_id], step):
            self.owner.pop(run_id)  # fenced or cancelled: the body stops here

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.owner)))
        owner = self.owner.pop(run_id)
        done = self.store.finish(self._run(run_id), owner, "completed", limits=self.engine.limits())
        self._record_admissions([g.run_id for g in done.granted])

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def sleep(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.owner)))
        owner = self.owner.pop(run_id)
        verdict = self.store.park(run_id, owner, "suspended", wake_at=self.store.now(), reason="sleep")
        if verdict == "cancelled":
            done = self.store.finish(self._run(run_id), owner, "cancelled", limits=self.engine.limits())
            self._record_admissions([g.run_id for g in done.granted])

    crash_and_expire = crash_and_expire  # a worker dies, its lease expires (D4, X3f)

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        run = self.engine.cancel(run_id)
        self._sync_admissions()
        if run.status == "cancelled":
            self.cancelled_seen.add(run_id)

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def time_out(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        past = self.store.now() - timedelta(seconds=1)
        if isinstance(self.store, MemoryStore):
            with self.store._critical():
                self.store._runs[run_id] = self.store._runs[run_id].evolve(deadline_at=past)
        else:
            from durable_singleton.models import Run

            Run.objects.filter(pk=run_id).update(deadline_at=past)
        self.tick()

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def queue_ttl_passes(self, data: st.DataObject) -> None:
        """A run's queue TTL passes (X2): its created_at moves back past it; the tick
        ends it if it is still a waiter, and leaves it alone if it holds a slot."""
        run_id = data.draw(st.sampled_from(self.created))
        before = self._run(run_id)
        earlier = before.created_at - timedelta(seconds=QUEUE_TTL + 1)
        if isinstance(self.store, MemoryStore):
            with self.store._critical():
                self.store._runs[run_id] = self.store._runs[run_id].evolve(created_at=earlier)
        else:
            from durable_singleton.models import Run

            Run.objects.filter(pk=run_id).update(created_at=earlier)
        self.tick()
        after = self._run(run_id)
        if before.admitted or before.status == "running":
            assert run_id not in self.expired_seen, f"{run_id} ended by its queue TTL while it held a slot"
        elif not before.is_terminal:
            assert after.is_terminal or after.admitted, f"{run_id} outlived its queue TTL as a waiter"

    @rule()
    def tick(self) -> None:
        report = self.engine.tick()
        assert report.errors == []
        self.engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        self._sync_admissions()
        for run_id in report.timed_out:
            if self._run(run_id).status == "cancelled":
                self.cancelled_seen.add(run_id)
        for run_id in report.expired:
            self.expired_seen.add(run_id)
            self.cancelled_seen.add(run_id)
            self.owner.pop(run_id, None)

    @rule(limit=st.sampled_from((1, 2, 3)))
    def deploy_with_limit(self, limit: int) -> None:
        self.limit = limit
        self._declare(limit)

    # -- invariants ----------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        """Every invariant below, on one read of the runs and of the store's clock
        after the step (one query for all of them on the Django store)."""
        runs, now = self._runs(), self.store.now()
        self.holders_within_the_limit_they_were_admitted_under(runs)
        self.no_run_is_claimed_or_admitted_before_its_not_before(runs, now)
        self.no_run_ended_by_its_queue_ttl_was_admitted(runs)
        self.no_replaced_run_was_admitted(runs)
        self.tokens_strictly_increase_per_key()
        self.cancelled_runs_stay_cancelled(runs)

    def holders_within_the_limit_they_were_admitted_under(self, runs: dict[str, Any]) -> None:
        for key in KEYS:
            holders = [r for r in runs.values() if self.key_of[r.run_id] == key and not r.is_terminal and r.admitted]
            if holders:
                allowed = max(self.limit_at_admission.get(r.run_id, self.limit) for r in holders)
                assert len(holders) <= allowed, f"{len(holders)} holders of {key} over limit {allowed}"

    def no_run_is_claimed_or_admitted_before_its_not_before(self, runs: dict[str, Any], now: Any) -> None:
        for run in runs.values():
            if not self._is_due(run, now):
                assert not run.admitted and run.attempts == 0 and run.started_at is None, run
                assert run.status in ("pending", "cancelled"), run

    def no_run_ended_by_its_queue_ttl_was_admitted(self, runs: dict[str, Any]) -> None:
        for run_id in self.expired_seen:
            run = runs[run_id]
            assert run_id not in self.admitted_order[self.key_of[run_id]], f"{run_id} was admitted, then expired"
            assert run.status == "cancelled" and run.error["code"] == "queue_ttl_expired", run

    def no_replaced_run_was_admitted(self, runs: dict[str, Any]) -> None:
        for run_id in self.replaced_seen:
            run = runs[run_id]
            assert run_id not in self.admitted_order[self.key_of[run_id]], f"{run_id} was admitted, then replaced"
            assert run.status == "cancelled" and run.error["code"] == "replaced", run

    def tokens_strictly_increase_per_key(self) -> None:
        for key in KEYS:
            tokens = self.tokens[key]
            assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens

    def cancelled_runs_stay_cancelled(self, runs: dict[str, Any]) -> None:
        for run_id in self.cancelled_seen:
            assert runs[run_id].status == "cancelled"

    def teardown(self) -> None:
        """Liveness (S7, S8): the holders finish, the tick catches up; every run ends."""
        deadline = time.monotonic() + 30
        self.engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        for run_id in list(self.owner):
            self.store.finish(self._run(run_id), self.owner.pop(run_id), "completed", limits=self.engine.limits())
        self._make_due()
        while self._active():
            assert time.monotonic() < deadline, f"runs never finished: {self._active()}"
            past = self.store.now() - timedelta(seconds=1)
            for run_id in self._active():
                run = self._run(run_id)
                if run.status == "running":  # a crashed holder: its lease expires
                    if isinstance(self.store, MemoryStore):
                        with self.store._critical():
                            self.store._runs[run_id] = self.store._runs[run_id].evolve(lease_expires_at=past)
                    else:
                        from durable_singleton.models import Run

                        Run.objects.filter(pk=run_id).update(lease_expires_at=past)
            if isinstance(self.store, MemoryStore):
                self.clock.now += timedelta(hours=2)  # every wake time and backlog retry comes
            else:
                from durable_singleton.models import Run

                Run.objects.filter(wake_at__isnull=False).update(wake_at=past)
            self.engine.tick()
            self.engine.dispatcher.drain()  # type: ignore[attr-defined]
            self._sync_admissions()
        for key in KEYS:
            tokens = self.tokens[key]
            assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), (key, tokens, self.admitted_order[key])


def _run_machine(make_store: Any) -> None:
    run_machine(
        TurnProtocol,
        make_store,
        max_examples=EXAMPLES,
        stateful_step_count=STEPS,
        phases=[Phase.explicit, Phase.reuse, Phase.generate] if os.environ.get("DS_NO_SHRINK") else list(Phase),
    )


@pytest.mark.parametrize("kind", machine_stores())
def test_protocol_model(kind: str) -> None:
    """Issue #8: the model-based test on the in-memory store and on the Django store
    of the DATABASE_URL database (S5, S7, K1, D5, D6)."""
    _run_machine(machine_store(kind))
