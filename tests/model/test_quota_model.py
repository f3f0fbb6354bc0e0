"""A stateful model-based test of admission under shared quotas (#20, X3), with hypothesis.

Random interleavings of starts of three workflows over one shared quota
(limit 2 per quota key; one workflow also on a singleton key of limit 1, one
fair across two tenants, X4), turns (claims), settles, cancels, worker crashes
with lease expiry and the takeover, and the tick, against the real store (in
memory, and the Django store on the DATABASE_URL database).

Invariants after every step:

* at most 2 holders per quota key and 1 per singleton key, however many limits
  each run carries (X3d);
* a run holds its quota slot exactly when it holds its singleton slot, if it
  has one: all or nothing (X3d);
* the quota tokens a claim hands out strictly increase per quota key (X3f, K1);
* no body of a cancelled run resumes (D6);
* in the fair quota (its runs' only limit, X4d) every admission, a claim's or a
  grant's, goes to a run among the key's first free waiters in its queue order
  (fair tag, priority descending, ``created_at``, ``run_id``: X3d, X4, X8a,
  X8c), judged on the order the machine computes from the stored tags; starts
  draw a priority from -1, 0 and 1;
* a quota key with a queue cap never has more active members than its cap,
  and a start it refuses raised QuotaQueueFullError with the key full and
  wrote nothing (S15, X3j);
* at the end, once the holders finish, every run ends (X3g, S7, S8).

Every admission is recorded with its tokens where it happens: a claim's (and
the waiters its claim grants), a settle's handoff, and those of the tick and of
a cancel (the ``run_admitted`` signal of every grant they hand off). The
interleaving does not depend on wall-clock time: on the Django store, whose
clock is the database's, the retries, the redelivery window and the leases are
an hour away, so only the machine's rules (a crash's expired lease, the
teardown's wake) make anything due, and a seed replays the same run (#34 item 11:
a catch-up grant that a retry made due under load went unrecorded, and the
claim that confirmed it later read as a token out of order).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from durable_singleton import Quota, signals
from durable_singleton.definitions import Registry
from durable_singleton.exceptions import QuotaQueueFullError
from durable_singleton.stores.base import TurnState
from durable_singleton.stores.memory import MemoryStore
from durable_singleton.testing import make_engine
from tests.helpers import StoreMachine, crash_and_expire, machine_store, machine_stores, run_machine

QUOTA_KEYS = ("P", "Q")
WORKFLOWS = ("plain", "keyed", "fair", "capped")
QUOTA_LIMIT = 2
#: The capped quota's limit + max_queue_depth (S15, X3j).
CAP = 1 + 2
#: Seconds to a waiter's retry, a turn's redelivery and a lease's end: never reached by
#: the wall clock during a run of the machine (the memory store's clock is the machine's).
FAR = 3600.0


class QuotaProtocol(StoreMachine):
    """The machine; ``make_store`` is set by the test that runs it."""

    def __init__(self) -> None:
        super().__init__()
        registry = Registry()
        pool = Quota("pool", key=lambda i: i["q"], limit=QUOTA_LIMIT)
        fair = Quota("pool-fair", key=lambda i: i["q"], limit=QUOTA_LIMIT, fair_key=lambda i: i["t"])
        registry.add("plain", "1", lambda ctx, i: None, quotas=[pool], timeout=3600)
        registry.add("keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: i["q"]}, quotas=[pool])
        registry.add("fair", "1", lambda ctx, i: None, quotas=[fair])  # a fair quota is a run's only limit (X4d)
        capped = Quota("pool-capped", key=lambda i: i["q"], limit=1, max_queue_depth=CAP - 1)
        registry.add("capped", "1", lambda ctx, i: None, quotas=[capped, pool])
        self.engine = make_engine(
            self.store,
            registry=registry,
            clock=self.clock if isinstance(self.store, MemoryStore) else None,
            ADMISSION_RETRY_SECONDS=FAR,
            ADMISSION_RETRY_JITTER_SECONDS=0.0,
            REDELIVERY_SECONDS=FAR,
        )
        self.created: list[str] = []
        self.owner: dict[str, str] = {}
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.admitted_with: dict[str, tuple[tuple[str, int], ...]] = {}
        self.cancelled_seen: set[str] = set()
        self.n = 0
        #: The runs the engine's grants admitted (run_admitted), not yet recorded.
        self.signalled: list[str] = []
        signals.run_admitted.connect(self._admitted, weak=False)

    def _admitted(self, sender: Any, run: Any, **kwargs: Any) -> None:
        self.signalled.append(run.run_id)

    def _record_signalled(self) -> None:
        """Record the admissions the engine's grants made (a tick's, a cancel's release)."""
        ids, self.signalled = list(dict.fromkeys(self.signalled)), []
        self._record_granted(ids)

    def _record_granted(self, run_ids: Any) -> None:
        """Record the runs of ``run_ids`` that a grant admitted (quota holders), with their tokens."""
        runs = [self._run(run_id) for run_id in run_ids]
        self._record_tokens(*((r, self.store.quota_tokens(r.run_id)) for r in runs if r.quota_slot == "holder"))

    def _run(self, run_id: str) -> Any:
        return self.store.get_run(run_id)

    def _active(self) -> list[str]:
        ended = {r.run_id for r in self.store.list_runs() if r.is_terminal}
        return [r for r in self.created if r not in ended]

    def _record_tokens(self, *admitted: tuple[Any, Any]) -> None:
        """Record the quota tokens of runs admitted together, (run, tokens by quota name),
        once per admission: when a handoff admits them (a confirmation then brings the
        same tokens) or when a claim admits or takes over one (new tokens). Each quota
        key's tokens strictly increase in admission order (X3f, X3h)."""
        fresh: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for run, given in admitted:
            tokens = tuple(sorted(dict(given).items()))
            if self.admitted_with.get(run.run_id) == tokens:
                continue
            self.admitted_with[run.run_id] = tokens
            for name, token in tokens:
                fresh.setdefault((name, dict(run.quota_keys)[name]), []).append((token, run.run_id))
        for pair, given_here in fresh.items():
            seen = self.tokens.setdefault(pair, [])
            for token, run_id in sorted(given_here):
                assert not seen or token > seen[-1], f"quota token {token} of {run_id} after {seen} (X3f)"
                seen.append(token)

    def _fair_queues(self) -> dict[str, tuple[list[str], list[str]]]:
        """Each fair quota key's holders and its waiters in the queue order the machine
        computes from the stored tags: (tag, priority descending, created_at, run_id)
        (X4, X8a, X8c). One read of the store's rows."""
        from durable_singleton.admission import ACTIVE_STATUSES

        rows: list[tuple[str, str, int, int, Any, str | None]] = []  # run, key, tag, priority, created, slot
        if isinstance(self.store, MemoryStore):
            for run in self.store._runs.values():
                if run.workflow_name == "fair" and run.status in ACTIVE_STATUSES:
                    tag = self.store._quota_tags.get((run.run_id, "pool-fair"), 0)
                    key = dict(run.quota_keys)["pool-fair"]
                    rows.append((run.run_id, key, tag, run.priority, run.created_at, run.quota_slot))
        else:
            from durable_singleton.models import QuotaMembership

            found = QuotaMembership.objects.filter(quota="pool-fair", run__status__in=ACTIVE_STATUSES)
            for values in found.values_list(
                "run_id", "key", "tag", "run__priority", "run__created_at", "run__quota_slot"
            ):
                rows.append(values)
        queues: dict[str, tuple[list[str], list[str]]] = {}
        for key in QUOTA_KEYS:
            mine = [r for r in rows if r[1] == key]
            waiters = sorted((r for r in mine if r[5] == "waiter"), key=lambda r: (r[2], -r[3], r[4], r[0]))
            queues[key] = ([r[0] for r in mine if r[5] == "holder"], [r[0] for r in waiters])
        return queues

    def _check_fair_order(self, before: dict[str, tuple[list[str], list[str]]]) -> None:
        """Every fair run admitted since ``before`` was among its key's first waiters then
        (less those ended since), as many as the slots the holders of then left free (X3d, X8c)."""
        for key, (holders, waiters) in before.items():
            free = QUOTA_LIMIT - sum(1 for r in holders if self._run(r).holds_quota_slots)
            # The waiters still in line after the rule: a cancelled one left its place.
            waiters = [r for r in waiters if not self._run(r).is_terminal]
            for run_id in waiters:
                if self._run(run_id).quota_slot == "holder":
                    place = waiters.index(run_id) + 1
                    assert place <= free, (
                        f"{run_id} admitted in pool-fair {key} at place {place} of {waiters} with {free} free "
                        "(X3d, X4, X8a, X8c)"
                    )

    @rule(
        workflow=st.sampled_from(WORKFLOWS),
        key=st.sampled_from(QUOTA_KEYS),
        tenant=st.sampled_from("ab"),
        priority=st.sampled_from((0, 1, -1)),
    )
    def start(self, workflow: str, key: str, tenant: str, priority: int = 0) -> None:
        self.n += 1
        self.clock.now += timedelta(microseconds=10)
        run_id = f"r{self.n:03d}"
        try:
            run = self.engine.start(workflow, {"q": key, "t": tenant}, run_id=run_id, priority=priority)
        except QuotaQueueFullError as full:
            assert workflow == "capped" and (full.quota, full.key) == ("pool-capped", key)
            assert self._capped_members(key) >= CAP, "refused below the cap (S15)"
            assert self._run(run_id) is None, "a refused start wrote its run (S15)"
            return
        self.created.append(run.run_id)

    def _capped_members(self, key: str, runs: dict[str, Any] | None = None) -> int:
        """The capped quota key's active members: holders and waiters (S15, X3j);
        ``runs``: every run by id, read at once (read now if omitted)."""
        if runs is None:
            runs = {r.run_id: r for r in self.store.list_runs()}
        return sum(1 for r in runs.values() if not r.is_terminal and ("pool-capped", key) in r.quota_keys)

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def turn(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        self.n += 1
        owner = f"o{self.n}"
        fair = self._fair_queues()
        turn = self.store.begin_turn(
            run_id,
            owner,
            lease_seconds=FAR,
            limits=self.engine.limits(),
            max_recoveries=3,
            retry=self.engine._retry_policy(),
        )
        if turn.state is TurnState.RUN:
            assert run_id not in self.cancelled_seen, "a cancelled run's body resumed (D6)"
            assert turn.run.quota_slot == "holder"
            self._record_tokens((turn.run, turn.run.quota_tokens))
            self.owner[run_id] = owner
        self._record_granted(g.run_id for g in turn.granted)  # the waiters its claim admitted (S7)
        self._check_fair_order(fair)

    @precondition(lambda self: self.owner)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.owner)))
        fair = self._fair_queues()
        done = self.store.finish(self._run(run_id), self.owner.pop(run_id), "completed", limits=self.engine.limits())
        self._check_fair_order(fair)
        self._record_tokens(  # the waiters its handoff admitted (X3h)
            *(
                (self._run(g.run_id), self.store.quota_tokens(g.run_id))
                for g in done.granted
                if g.quota_slot == "holder"
            )
        )

    @precondition(lambda self: self.created)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.created))
        run = self._run(run_id)
        if run.is_terminal or run.status == "running":
            return
        fair = self._fair_queues()
        self.engine.cancel(run_id)
        self._check_fair_order(fair)
        self._record_signalled()
        if self._run(run_id).status == "cancelled":
            self.cancelled_seen.add(run_id)
            self.owner.pop(run_id, None)

    crash_and_expire = crash_and_expire  # a worker dies, its lease expires (D4, X3f)

    @rule()
    def tick(self) -> None:
        fair = self._fair_queues()
        self.engine.tick()
        self._check_fair_order(fair)
        self._record_signalled()
        self.engine.dispatcher.queue.clear()  # type: ignore[attr-defined]  # turns are the machine's to run

    @invariant()
    def invariants_hold(self) -> None:
        """Every invariant below, on one read of the runs after the step (``list_runs``:
        one query on the Django store instead of one per run)."""
        runs = {r.run_id: r for r in self.store.list_runs()}
        self.no_limit_over_its_cap_and_all_or_nothing(runs)
        self.cancelled_runs_stay_cancelled(runs)

    def no_limit_over_its_cap_and_all_or_nothing(self, runs: dict[str, Any]) -> None:
        quota_holders: dict[tuple[str, str], int] = {}
        key_holders: dict[str, int] = {}
        for run in (runs[run_id] for run_id in self.created):
            if run.holds_quota_slots:
                for pair in run.quota_keys:
                    quota_holders[pair] = quota_holders.get(pair, 0) + 1
            if run.singleton_key is not None:
                assert run.holds_slot == run.holds_quota_slots, f"{run.run_id}: one limit without the other (X3d)"
                if run.holds_slot:
                    key_holders[run.singleton_key] = key_holders.get(run.singleton_key, 0) + 1
        assert all(n <= (1 if name == "pool-capped" else QUOTA_LIMIT) for (name, _), n in quota_holders.items()), (
            quota_holders
        )
        assert all(n <= 1 for n in key_holders.values()), key_holders
        over = [key for key in QUOTA_KEYS if self._capped_members(key, runs) > CAP]
        assert not over, f"over the quota's queue cap (S15, X3j): {over}"

    def cancelled_runs_stay_cancelled(self, runs: dict[str, Any]) -> None:
        for run_id in self.cancelled_seen:
            assert runs[run_id].status == "cancelled"

    def teardown(self) -> None:
        """Liveness (X3g, S7, S8): the holders finish, crashed leases expire, wake
        times come, the tick and the turns run; every run ends."""
        signals.run_admitted.disconnect(self._admitted)
        deadline = time.monotonic() + 30
        for run_id in list(self.owner):
            self.store.finish(self._run(run_id), self.owner.pop(run_id), "completed", limits=self.engine.limits())
        while self._active():
            assert time.monotonic() < deadline, f"runs never finished: {self._active()}"
            past = self.store.now() - timedelta(seconds=1)
            if isinstance(self.store, MemoryStore):
                with self.store._critical():
                    for run_id in self._active():
                        run = self.store._runs[run_id]
                        if run.status == "running":
                            self.store._runs[run_id] = run.evolve(lease_expires_at=past)
                self.clock.now += timedelta(hours=2)
            else:
                from durable_singleton.models import Run

                Run.objects.filter(status="running").update(lease_expires_at=past)
                Run.objects.filter(wake_at__isnull=False).update(wake_at=past)
            self.engine.tick()
            self.engine.dispatcher.drain()  # type: ignore[attr-defined]


def _run_machine(make_store: Any) -> None:
    run_machine(QuotaProtocol, make_store, max_examples=20, stateful_step_count=35)


@pytest.mark.parametrize("kind", machine_stores())
def test_quota_model(kind: str) -> None:
    """X3d, X3f, X3g, X4: the quota machine on the in-memory store and on the Django
    store of the DATABASE_URL database."""
    _run_machine(machine_store(kind))
