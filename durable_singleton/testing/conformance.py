"""The store conformance suite: the store contract stated as tests.

Any :class:`~durable_singleton.stores.base.BaseStore` must pass it: the claim
(S5, S9, R6), FIFO admission (S5 step 3), the handoff (S7, S7a), fencing
(R5, R5a, K1), the queue cap (S15, R3), recovery (D4), execution timeouts
(D5), cancel (D6), the delayed start (X5), priority inside a key (X8), the queue TTL (X2, for a store
with ``supports_queue_ttl``: the tick ends a waiter past it, and no grant
admits one, given the declared TTLs), the reads and repairs of the metrics, health and the slot audit (O3, O4, K4),
the strategies of a busy start (X1:
``on_busy``; a store without ``supports_on_busy`` refuses the superseding
ones with a typed error and writes nothing), the debounce (X7: a burst of starts is
one run with the newest input, a retried start changes nothing; a store without
``supports_debounce`` refuses with a typed error and writes nothing), for a store without an atomic claim the fallback
warning (S14) and, for a store on the Django run table, that the admission
rules' Python spellings and their SQL twins agree (S5, S12, K2, X5). Subclass
:class:`StoreConformance` in a test module and give it a ``store`` fixture
that returns a fresh, empty store::

    import pytest
    from durable_singleton.testing.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self):
            return MyStore()

A store on a database needs real commits (``pytest.mark.django_db(transaction=True)``
on the subclass). The suite needs pytest; it is imported only by tests.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest

from ..context import WorkflowCtx
from ..definitions import Debounce, Quota, Registry, Throttle
from ..engine import Engine
from ..exceptions import (
    QuotaQueueFullError,
    SingletonBusyError,
    SingletonFallbackWarning,
    SingletonQueueFullError,
    UnsupportedByStoreError,
)
from ..statuses import Outcome, ParkReason, RunStatus, SlotState, Verdict
from ..stores.base import CANCELLED_ERROR, BaseStore, TurnState
from . import make_engine

__all__ = ["StoreConformance"]

LEASE = 0.3  # seconds: short, so the suite can let a lease expire
#: The engine's lease (seconds): long, so that no body's lease expires on a
#: loaded machine unless a test asks for it (a claim with ``lease=LEASE``). With
#: the short lease as the engine's, a renewer starved for 0.3 s let a takeover
#: (R5) run a body a second time, which the tests that count bodies saw.
ENGINE_LEASE = 30.0
DELAY = 3.0  # seconds: a delayed start's not_before, long enough for the claims made before it
QUEUE_TTL = 1.0  # seconds: the queue TTL of conf-ttl's waiters (X2)


def _refused_without_on_busy(engine: Engine, workflow: str) -> bool:
    """On a store without ``supports_on_busy``: check that a start of
    ``workflow`` (a superseding strategy, X1) raises UnsupportedByStoreError and
    writes nothing, and return True (the check is done); else False."""
    if engine.store.supports_on_busy:
        return False
    with pytest.raises(UnsupportedByStoreError):
        engine.start(workflow, {"k": "K"}, run_id="A")
    assert engine.store.get_run("A") is None
    return True


class _Bodies:
    """Records body entries per key and the highest number running at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.highest: dict[str, int] = {}
        self.entered: list[str] = []
        self.tokens: list[int | None] = []

    def enter(self, key: str, run_id: str, token: int | None) -> None:
        with self.lock:
            self.running[key] = self.running.get(key, 0) + 1
            self.highest[key] = max(self.highest.get(key, 0), self.running[key])
            self.entered.append(run_id)
            self.tokens.append(token)

    def exit(self, key: str) -> None:
        with self.lock:
            self.running[key] -= 1


class StoreConformance:
    """The contract every store keeps; subclass it and provide a ``store`` fixture."""

    @pytest.fixture
    def registry(self) -> Registry:
        return Registry()

    @pytest.fixture
    def bodies(self) -> _Bodies:
        return _Bodies()

    @pytest.fixture
    def engine(self, store: BaseStore, registry: Registry, bodies: _Bodies) -> Engine:
        registry.add_step("conformance:step", lambda x: x)

        def body(ctx: WorkflowCtx, input: dict[str, Any]) -> str:
            key = input["k"]
            bodies.enter(key, ctx.run_id, ctx.fencing_token)
            try:
                ctx.step("conformance:step", input.get("n", 0))
                return ctx.run_id
            finally:
                bodies.exit(key)

        for limit in (1, 2):
            registry.add(
                f"conf-{limit}",
                "1",
                body,
                singleton={"key": lambda i: i["k"], "limit": limit, "max_queue_depth": None},
                timeout=3600,
            )
        registry.add("conf-capped", "1", body, singleton={"key": lambda i: i["k"], "max_queue_depth": 2})
        registry.add("conf-timeout", "1", body, singleton={"key": lambda i: i["k"]}, timeout=LEASE)
        registry.add("conf-ttl", "1", body, singleton={"key": lambda i: i["k"], "queue_ttl": QUEUE_TTL})
        for on_busy in ("skip", "replace_queued", "cancel_in_progress"):
            registry.add(f"conf-{on_busy}", "1", body, singleton={"key": lambda i: i["k"], "on_busy": on_busy})
        # Two workflows sharing one quota, the second with a singleton key too (X3).
        pool = Quota("conf-pool", key=lambda i: i["k"], limit=1)
        registry.add("conf-quota", "1", body, quotas=[pool])
        registry.add("conf-quota-keyed", "1", body, singleton={"key": lambda i: i["s"]}, quotas=[pool])
        # A quota with a queue cap, shared by two workflows (S15, X3j).
        capped = Quota("conf-capped-pool", key=lambda i: i["k"], limit=1, max_queue_depth=1)
        registry.add("conf-quota-capped", "1", body, quotas=[capped])
        registry.add("conf-quota-capped-keyed", "1", body, singleton={"key": lambda i: i["s"]}, quotas=[capped])
        # One throttle (2 admissions an hour per key) named by a workflow without a key and by
        # one with a singleton key (X6).
        rate = Throttle("conf-rate", key=lambda i: i["k"], limit=2, period=3600)
        registry.add("conf-throttle", "1", body, throttles=[rate])
        registry.add("conf-throttle-keyed", "1", body, singleton={"key": lambda i: i["s"]}, throttles=[rate])
        # A debounced workflow with a singleton key (X7): an hour of quiet, no body runs in a test.
        registry.add(
            "conf-debounce",
            "1",
            body,
            singleton={"key": lambda i: i["k"]},
            debounce=Debounce(key=lambda i: i["k"], seconds=3600, max_seconds=7200),
        )
        return make_engine(store, registry=registry, LEASE_SECONDS=ENGINE_LEASE, LEASE_RENEW_SECONDS=ENGINE_LEASE / 3)

    @staticmethod
    def _turn(engine: Engine, run_id: str, owner: str, lease: float = 30.0) -> Any:
        return engine.store.begin_turn(
            run_id,
            owner,
            lease_seconds=lease,
            limits=engine.limits(),
            max_recoveries=engine.settings.MAX_RECOVERIES,
            retry=engine._retry_policy(),
        )

    # -- the claim ------------------------------------------------------------------
    def test_claim_admits_at_most_limit_holders(self, engine: Engine) -> None:
        """S5, S6: limit 2 and four waiters: two claims run, two park; a holder's
        next claim is a confirmation."""
        for n in range(4):
            engine.start("conf-2", {"k": "K"}, run_id=f"r{n}")
        states = [self._turn(engine, f"r{n}", f"w{n}").state for n in range(4)]
        assert states.count(TurnState.RUN) == 2 and states.count(TurnState.PARKED) == 2
        holders = [r for r in engine.store.active_runs_for_key("conf-2", "K") if r.admitted]
        assert sorted(r.run_id for r in holders) == ["r0", "r1"]

    def test_waiters_are_admitted_oldest_first(self, engine: Engine, bodies: _Bodies) -> None:
        """S5 step 3, S7: whatever order their turns arrive in, runs of a key are
        admitted by (created_at, run_id), one at a time for limit 1."""
        for n in range(5):
            engine.start("conf-1", {"k": "K"}, run_id=f"r{n}")
        for n in (4, 2, 3, 1, 0):
            engine.execute(f"r{n}")
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        assert bodies.entered == [f"r{n}" for n in range(5)]
        assert bodies.highest["K"] == 1

    def test_racing_claims_admit_one(self, engine: Engine, bodies: _Bodies) -> None:
        """S5, S9, R6: eight turns of one key's runs and duplicate deliveries at
        once: one body at a time, each body once, every run completes."""
        for n in range(8):
            engine.start("conf-1", {"k": "K"}, run_id=f"r{n}")
        barrier = threading.Barrier(16, timeout=30)
        errors: list[BaseException] = []

        def racer(i: int) -> None:
            try:
                barrier.wait()
                engine.execute(f"r{i % 8}")
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                engine.close_thread_resources()

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        _settle_all(engine)
        assert bodies.highest["K"] == 1 and sorted(bodies.entered) == [f"r{n}" for n in range(8)]

    # -- shared quotas ---------------------------------------------------------------
    def test_a_shared_quota_admits_one_run_at_a_time_across_workflows(self, engine: Engine, bodies: _Bodies) -> None:
        """X3, X3d, X3e, X3g: runs of two workflows sharing a quota of 1 (one also on
        singleton keys), their turns racing on eight threads: one body at a time per
        quota key, each body once, every run completes, no claim deadlocks. A store
        that does not admit quotas (``admits_quotas``: ``supports_quotas`` and its own
        atomic claim, not the S14 fallback) refuses the start and writes nothing."""
        if not engine.store.admits_quotas:
            with pytest.raises(UnsupportedByStoreError):
                engine.start("conf-quota", {"k": "K"}, run_id="A")
            assert engine.store.get_run("A") is None
            return
        ids = []
        for n in range(6):
            workflow = "conf-quota" if n % 2 else "conf-quota-keyed"
            ids.append(engine.start(workflow, {"k": "K", "s": f"s{n % 3}"}, run_id=f"q{n}").run_id)
        barrier = threading.Barrier(8, timeout=30)
        errors: list[BaseException] = []

        def racer(i: int) -> None:
            try:
                barrier.wait()
                for run_id in ids[i % 6 :] + ids[: i % 6]:
                    engine.execute(run_id)
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                engine.close_thread_resources()

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        _settle_all(engine)
        assert bodies.highest["K"] == 1 and sorted(bodies.entered) == sorted(ids)
        assert all(engine.get(r).status == RunStatus.COMPLETED and engine.get(r).quota_slot is None for r in ids)

    def test_a_quota_queue_cap_counts_the_quota_keys_members_across_workflows(self, engine: Engine) -> None:
        """S15, S16, X3j, K2, R3: a quota of limit 1 and max_queue_depth 1 takes two
        members per quota key, whatever workflow started them; the third start
        raises QuotaQueueFullError (a SingletonQueueFullError naming the quota)
        and writes nothing, in ``start`` and per run in ``start_many``; an
        existing id is returned; another quota key is not counted; the key's
        runtime limit override raises the cap; a settled member frees room."""
        if not engine.store.admits_quotas:
            return
        engine.start("conf-quota-capped", {"k": "K"}, run_id="A")
        engine.start("conf-quota-capped-keyed", {"k": "K", "s": "S"}, run_id="B")
        with pytest.raises(QuotaQueueFullError) as caught:
            engine.start("conf-quota-capped", {"k": "K"}, run_id="C")
        full = caught.value
        assert isinstance(full, SingletonQueueFullError)
        assert (full.workflow, full.quota, full.key, full.max_queue_depth) == (
            "conf-quota-capped",
            "conf-capped-pool",
            "K",
            1,
        )
        assert "conf-capped-pool" in str(full) and engine.store.get_run("C") is None
        [refused] = engine.start_many("conf-quota-capped-keyed", [{"k": "K", "s": "T"}], run_ids=["D"])
        assert isinstance(refused, QuotaQueueFullError) and engine.store.get_run("D") is None
        assert engine.start("conf-quota-capped", {"k": "K"}, run_id="A").run_id == "A"
        assert engine.start("conf-quota-capped", {"k": "other"}, run_id="O").run_id == "O"
        if engine.store.supports_key_controls:
            engine.override_limit("quota:conf-capped-pool", "K", 2, by="conformance")
            engine.start("conf-quota-capped", {"k": "K"}, run_id="C")  # cap 2 + 1 = 3 members
            with pytest.raises(QuotaQueueFullError):
                engine.start("conf-quota-capped", {"k": "K"}, run_id="E")
            engine.override_limit("quota:conf-capped-pool", "K", None, by="conformance")
        _settle_all(engine)
        assert engine.start("conf-quota-capped", {"k": "K"}, run_id="F").run_id == "F"

    def test_a_quota_waiter_takes_no_slot_while_its_singleton_key_is_busy(self, engine: Engine) -> None:
        """X3d: B needs its singleton key (held by A) and the quota: it takes no
        quota slot while it waits, and keeps its place; when A settles, B is
        admitted in both at once, with a larger quota token (X3f)."""
        if not engine.store.admits_quotas:
            return
        engine.start("conf-quota-keyed", {"k": "K1", "s": "S"}, run_id="A")
        engine.start("conf-quota-keyed", {"k": "K2", "s": "S"}, run_id="B")
        engine.start("conf-quota", {"k": "K2"}, run_id="C")
        first = self._turn(engine, "A", "w")
        assert first.state is TurnState.RUN and dict(first.run.quota_tokens)
        assert self._turn(engine, "B", "w").state is TurnState.PARKED
        assert engine.get("B").quota_slot == SlotState.WAITER and not engine.get("B").admitted
        # C is behind B in K2's line: not admitted past it though K2 has a free slot.
        assert self._turn(engine, "C", "w").state is TurnState.PARKED
        a = engine.get("A")
        done = engine.store.finish(a, "w", RunStatus.COMPLETED, limits=engine.limits())
        assert done.settled and "B" in [g.run_id for g in done.granted]
        b = self._turn(engine, "B", "w")
        assert b.state is TurnState.RUN and b.run.admitted and b.run.quota_slot == SlotState.HOLDER
        assert dict(b.run.quota_tokens)["conf-pool"] >= 1

    def test_a_handoff_admits_the_waiters_whose_every_limit_it_holds(self, engine: Engine) -> None:
        """X3h, X3d, X3f, S7a: A (quota key K, singleton key S) settles. B, waiting for
        the same two limits, is admitted by the handoff: a slot and the next token in
        each, sent its turn as a holder, whose claim only confirms it; C, behind B in
        K's line, is neither admitted nor sent a turn. When B settles, C (K alone) is
        admitted the same way. Y waits for K2 and for its own singleton key U, which
        X's handoff does not hold: it is sent a turn, not admitted, and its own claim
        admits it."""
        if not engine.store.admits_quotas:
            return
        limits = engine.limits()
        engine.start("conf-quota-keyed", {"k": "K", "s": "S"}, run_id="A")
        engine.start("conf-quota-keyed", {"k": "K", "s": "S"}, run_id="B")
        engine.start("conf-quota", {"k": "K"}, run_id="C")
        a = self._turn(engine, "A", "w")
        assert a.state is TurnState.RUN
        for waiter in ("B", "C"):
            assert self._turn(engine, waiter, "w").state is TurnState.PARKED
        done = engine.store.finish(engine.get("A"), "w", RunStatus.COMPLETED, limits=limits)
        assert done.settled and [g.run_id for g in done.granted] == ["B"], done.granted
        b_stored = engine.get("B")
        assert b_stored.quota_slot == SlotState.HOLDER and b_stored.admitted and b_stored.is_parked
        assert engine.get("C").quota_slot == SlotState.WAITER
        b = self._turn(engine, "B", "w")
        assert b.state is TurnState.RUN and b.run.admitted and b.run.quota_slot == SlotState.HOLDER
        assert dict(b.run.quota_tokens)["conf-pool"] == dict(a.run.quota_tokens)["conf-pool"] + 1
        assert (b.run.fencing_token or 0) > (a.run.fencing_token or 0)
        done = engine.store.finish(b.run, "w", RunStatus.COMPLETED, limits=limits)
        assert [(g.run_id, g.quota_slot) for g in done.granted] == [("C", SlotState.HOLDER)], done.granted
        c = self._turn(engine, "C", "w")
        assert (
            c.state is TurnState.RUN
            and dict(c.run.quota_tokens)["conf-pool"] == dict(b.run.quota_tokens)["conf-pool"] + 1
        )
        assert engine.store.finish(c.run, "w", RunStatus.COMPLETED, limits=limits).granted == ()
        # A limit the handoff does not hold: a turn only, and the waiter's own claim decides.
        engine.start("conf-quota-keyed", {"k": "K2", "s": "T"}, run_id="X")
        engine.start("conf-quota-keyed", {"k": "K2", "s": "U"}, run_id="Y")
        x = self._turn(engine, "X", "w")
        assert self._turn(engine, "Y", "w").state is TurnState.PARKED
        done = engine.store.finish(x.run, "w", RunStatus.COMPLETED, limits=limits)
        assert [(g.run_id, g.quota_slot) for g in done.granted] == [("Y", SlotState.WAITER)], done.granted
        assert engine.get("Y").quota_slot == SlotState.WAITER and not engine.get("Y").admitted
        y = self._turn(engine, "Y", "w")
        assert y.state is TurnState.RUN and y.run.quota_slot == SlotState.HOLDER

    # -- throttles -------------------------------------------------------------------
    def test_a_throttle_key_admits_its_limit_per_window_and_parks_the_rest_until_it_opens(self, engine: Engine) -> None:
        """X6b, X6c, X6d: a throttle key of 2 an hour admits A and B, each in its
        claim; C is parked by the throttle, named in its turn, with its wake_at and
        not_before at the window's opening (A's admission plus the period), and is
        not due meanwhile; D, of another throttle key, is admitted. A settle frees
        no admission: the key still counts two. With a singleton key: F waits for
        its key held by E, not for the throttle (no opening); E's handoff sends F a
        turn without admitting it, and F's own claim admits it and records its
        admission. A store that does not admit throttles refuses the start."""
        if not (engine.store.supports_throttles and engine.store.admits_quotas):
            with pytest.raises(UnsupportedByStoreError):
                engine.start("conf-throttle", {"k": "K"}, run_id="A")
            assert engine.store.get_run("A") is None
            return
        limits = engine.limits()
        for run_id in ("A", "B", "C"):
            engine.start("conf-throttle", {"k": "K"}, run_id=run_id)
        engine.start("conf-throttle", {"k": "K2"}, run_id="D")
        for run_id in ("A", "B"):
            turn = self._turn(engine, run_id, "w")
            assert turn.state is TurnState.RUN and turn.run.quota_slot == SlotState.HOLDER, turn
            assert turn.throttled is None
        c = self._turn(engine, "C", "w")
        assert c.state is TurnState.PARKED and c.throttled == "conf-rate", c
        stored = engine.get("C")
        a = engine.get("A")
        assert stored.status == RunStatus.SUSPENDED and stored.quota_slot == SlotState.WAITER
        assert stored.not_before is not None and stored.wake_at == stored.not_before
        assert a.admitted_at is not None
        assert abs((stored.not_before - a.admitted_at).total_seconds() - 3600) < 1.0, (stored.not_before, a)
        assert self._turn(engine, "C", "w").state is not TurnState.RUN  # not due before the opening (X5)
        d = self._turn(engine, "D", "w")
        assert d.state is TurnState.RUN, d
        for run_id in ("A", "B"):
            assert engine.store.finish(engine.get(run_id), "w", RunStatus.COMPLETED, limits=limits).settled
        counted, opening = engine.store.throttle_state("conf-rate", "K", 3600)
        assert counted == 2 and opening is not None
        # With a singleton key: its key's wait is not the throttle's.
        engine.start("conf-throttle-keyed", {"k": "K3", "s": "S"}, run_id="E")
        engine.start("conf-throttle-keyed", {"k": "K3", "s": "S"}, run_id="F")
        e = self._turn(engine, "E", "w")
        assert e.state is TurnState.RUN and e.run.admitted and e.run.fencing_token, e
        f = self._turn(engine, "F", "w")
        assert f.state is TurnState.PARKED and f.throttled is None, f
        assert engine.get("F").not_before is None and engine.get("F").quota_slot == SlotState.WAITER
        done = engine.store.finish(e.run, "w", RunStatus.COMPLETED, limits=limits)
        assert [(g.run_id, g.quota_slot) for g in done.granted] == [("F", SlotState.WAITER)], done.granted
        assert not engine.get("F").admitted
        f = self._turn(engine, "F", "w")
        assert f.state is TurnState.RUN and f.run.admitted and (f.run.fencing_token or 0) > e.run.fencing_token, f
        assert engine.store.throttle_state("conf-rate", "K3", 3600)[0] == 2

    def test_a_throttle_key_admits_its_higher_priority_waiter_first(self, engine: Engine) -> None:
        """X6c, X8a: a throttle key's due waiters are admitted in the one queue order,
        higher priority first, then oldest: with 2 admissions an hour, lo1 and lo2
        (priority 0) started before hi (priority 5), and their turns in creation
        order, lo1 and hi are admitted and lo2 is parked by the throttle (the
        key's free admissions go to hi ahead of it)."""
        if not (engine.store.supports_throttles and engine.store.admits_quotas):
            pytest.skip("this store does not admit throttles (X6)")
        for run_id, priority in (("lo1", 0), ("lo2", 0), ("hi", 5)):
            engine.start("conf-throttle", {"k": "P"}, run_id=run_id, priority=priority)
        lo1 = self._turn(engine, "lo1", "w")
        assert lo1.state is TurnState.RUN and lo1.throttled is None, lo1
        lo2 = self._turn(engine, "lo2", "w")
        assert lo2.state is TurnState.PARKED and lo2.throttled == "conf-rate", lo2
        assert not engine.get("lo2").admitted
        hi = self._turn(engine, "hi", "w")
        assert hi.state is TurnState.RUN and hi.run.quota_slot == SlotState.HOLDER, hi
        assert engine.store.throttle_state("conf-rate", "P", 3600)[0] == 2

    # -- the handoff and the token -----------------------------------------------
    def test_release_grants_the_oldest_waiter_with_a_larger_token(self, engine: Engine, bodies: _Bodies) -> None:
        """S7, S7a, K1: a settled holder's slot goes to the oldest waiter in the same
        write; the waiter is sent once; tokens strictly increase per key."""
        for n in range(3):
            engine.start("conf-1", {"k": "K"}, run_id=f"r{n}")
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert engine.execute("r2") == Outcome.PARKED
        assert engine.execute("r1") == Outcome.PARKED
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert engine.execute("r0") == Outcome.COMPLETED
        assert list(engine.dispatcher.queue) == ["r1"]  # type: ignore[attr-defined]
        assert engine.get("r1").admitted and not engine.get("r2").admitted
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        tokens = [t for t in bodies.tokens if t is not None]
        assert bodies.entered == ["r0", "r1", "r2"]
        assert len(tokens) == len(bodies.tokens) and tokens == sorted(tokens) and len(set(tokens)) == 3

    # -- priority inside a key -----------------------------------------------------------
    def test_waiters_are_admitted_by_priority_then_oldest(self, engine: Engine, bodies: _Bodies) -> None:
        """X8, S5 step 3, S7: a key's waiters are admitted higher priority first and
        oldest first within a priority, whatever order their turns arrive in."""
        priorities = {"r0": 0, "r1": 0, "r2": 5, "r3": 5, "r4": -3, "r5": 10, "r6": -100, "r7": 100}
        for run_id, priority in priorities.items():
            engine.start("conf-1", {"k": "K"}, run_id=run_id, priority=priority)
        assert engine.get("r7").priority == 100 and engine.get("r6").priority == -100
        for run_id in ("r0", "r6", "r4", "r3", "r1", "r7", "r2", "r5"):
            engine.execute(run_id)
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        assert bodies.entered == ["r7", "r5", "r2", "r3", "r0", "r1", "r4", "r6"]
        assert bodies.highest["K"] == 1

    def test_a_holder_is_never_preempted_and_the_handoff_grants_the_highest_priority(
        self, engine: Engine, bodies: _Bodies
    ) -> None:
        """X8, S5, S7, K1: a waiter of priority 100 started after a holder of priority
        -100 parks behind it (the holder keeps its slot); the holder's settle grants
        the slot, with a larger token, to the highest-priority waiter, in the same
        write, ahead of an older waiter of priority 0."""
        engine.start("conf-1", {"k": "K"}, run_id="low", priority=-100)
        held = self._turn(engine, "low", "w")
        assert held.state is TurnState.RUN
        engine.start("conf-1", {"k": "K"}, run_id="old", priority=0)
        engine.start("conf-1", {"k": "K"}, run_id="high", priority=100)
        assert self._turn(engine, "high", "w2").state is TurnState.PARKED
        assert engine.get("low").admitted and not engine.get("high").admitted
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        done = engine.store.finish(engine.get("low"), "w", RunStatus.COMPLETED, limits=engine.limits())
        assert [g.run_id for g in done.granted] == ["high"]
        assert engine.get("high").admitted and not engine.get("old").admitted
        assert engine.get("high").fencing_token > held.run.fencing_token

    def test_a_quota_admits_its_waiters_by_priority_then_oldest(self, engine: Engine, bodies: _Bodies) -> None:
        """X8, X3d: a quota key's waiters (across workflows) are admitted higher
        priority first, oldest first within one. A store that does not admit quotas
        refuses the start (checked by the shared-quota case)."""
        if not engine.store.admits_quotas:
            pytest.skip("this store does not admit quotas (X3)")
        starts = [("q0", 0), ("q1", 0), ("q2", 7), ("q3", -1), ("q4", 7)]
        for n, (run_id, priority) in enumerate(starts):
            workflow = "conf-quota" if n % 2 else "conf-quota-keyed"
            engine.start(workflow, {"k": "K", "s": f"s{n}"}, run_id=run_id, priority=priority)
        for run_id in ("q0", "q3", "q1", "q4", "q2"):
            engine.execute(run_id)
        _settle_all(engine)
        assert bodies.entered == ["q2", "q4", "q0", "q1", "q3"]
        assert bodies.highest["K"] == 1

    def test_a_bad_priority_raises_and_writes_nothing(self, engine: Engine) -> None:
        """X8, section 7: a priority that is not an int from -100 to 100 (a bool, a
        float, a str, None, 101, -101) raises InvalidPriorityError from start,
        start_many and signal_with_start, and nothing is written."""
        from ..exceptions import InvalidPriorityError, ValidationError

        for bad in (True, False, 1.0, "1", None, 101, -101, 10**6):
            with pytest.raises(InvalidPriorityError):
                engine.start("conf-1", {"k": "K"}, run_id="A", priority=bad)  # type: ignore[arg-type]
            with pytest.raises(ValidationError):
                engine.start_many("conf-1", [{"k": "K"}], run_ids=["B"], priority=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidPriorityError):
                engine.signal_with_start(
                    "conf-1",
                    {"k": "K"},
                    run_id="C",
                    signal="go",
                    priority=bad,  # type: ignore[arg-type]
                )
        assert engine.store.list_runs() == []

    # -- the delayed start -------------------------------------------------------------
    def test_a_waiter_not_due_blocks_no_one_and_runs_when_due(self, engine: Engine, bodies: _Bodies) -> None:
        """X5, S5 step 3, S7, R5: D, created first with a not_before DELAY seconds
        ahead on the store's clock, is not claimed (its wake time becomes its
        not_before); W behind it is admitted; W's settle grants D nothing; once
        due, the tick sends D and it runs."""
        from datetime import timedelta

        not_before = engine.store.now() + timedelta(seconds=DELAY)
        engine.start("conf-1", {"k": "K"}, run_id="D", not_before=not_before)
        engine.start("conf-1", {"k": "K"}, run_id="W")
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        early = self._turn(engine, "D", "early")
        assert early.state is TurnState.SKIPPED, "a run was claimed before its not_before"
        stored = engine.get("D")
        assert stored.status == RunStatus.PENDING and not stored.admitted and stored.wake_at == not_before
        w = self._turn(engine, "W", "w")
        assert w.state is TurnState.RUN, "a waiter not due blocked the due waiter behind it"
        done = engine.store.finish(engine.get("W"), "w", RunStatus.COMPLETED, limits=engine.limits())
        assert done.settled and "D" not in [r.run_id for r in done.granted]
        assert not engine.get("D").admitted
        time.sleep(max(0.0, (not_before - engine.store.now()).total_seconds()) + 0.05)
        _settle_all(engine)
        assert bodies.entered == ["D"] and engine.get("D").status == RunStatus.COMPLETED

    # -- fencing ---------------------------------------------------------------------
    def test_a_taken_over_lease_fences_every_write(self, engine: Engine) -> None:
        """R5, R5a, D4: once a lease expired and another executor took the run, the
        first executor's renewal, step, park and settle are all refused."""
        engine.start("conf-1", {"k": "K"}, run_id="A")
        first = self._turn(engine, "A", "slow", lease=LEASE)
        assert first.state is TurnState.RUN
        time.sleep(LEASE + 0.2)
        second = self._turn(engine, "A", "fast")
        assert second.state is TurnState.RUN and second.recovered
        store = engine.store
        assert not store.renew_lease("A", "slow", 30)
        assert store.check_boundary("A", "slow", 30) == Verdict.FENCED
        from ..stores.base import StepRecord

        step = StepRecord(0, "conformance:step", 1, engine.now(), engine.now())
        assert not store.save_step("A", "slow", step)
        parked = store.park("A", "slow", RunStatus.SUSPENDED, wake_at=engine.now(), reason=ParkReason.SLEEP)
        assert parked == Verdict.FENCED
        run = engine.get("A")
        assert not store.finish(run, "slow", RunStatus.COMPLETED, limits=engine.limits()).settled
        assert store.finish(run, "fast", RunStatus.COMPLETED, limits=engine.limits()).settled
        assert engine.get("A").status == RunStatus.COMPLETED

    def test_a_terminal_run_never_changes(self, engine: Engine) -> None:
        """R2: settles are compare-and-set: a completed run is not settled again,
        not claimed, not cancelled."""
        engine.start("conf-1", {"k": "K"}, run_id="A")
        assert engine.execute("A") == Outcome.COMPLETED
        run = engine.get("A")
        late = engine.store.finish(run, None, RunStatus.FAILED, limits=engine.limits(), expect=(RunStatus.COMPLETED,))
        assert not late.settled
        assert self._turn(engine, "A", "late").state is TurnState.SKIPPED
        assert engine.cancel("A").status == RunStatus.COMPLETED

    # -- the cap ---------------------------------------------------------------------
    def test_the_queue_cap_counts_active_runs_and_ids_dedupe_first(self, engine: Engine) -> None:
        """S15, S16, R3: limit 1 + depth 2 admits three starts; the fourth is
        refused and writes nothing; a start of an existing id returns it."""
        for n in range(3):
            engine.start("conf-capped", {"k": "K"}, run_id=f"c{n}")
        with pytest.raises(SingletonQueueFullError):
            engine.start("conf-capped", {"k": "K"}, run_id="c3")
        assert engine.store.get_run("c3") is None
        assert engine.start("conf-capped", {"k": "K"}, run_id="c0").run_id == "c0"
        assert engine.start("conf-capped", {"k": "other"}, run_id="o0").singleton_key == "other"

    # -- a busy start: on_busy (X1) -----------------------------------------------------
    def test_skip_is_the_cap_at_depth_zero(self, engine: Engine) -> None:
        """X1, S15, R3: with a run active on the key a "skip" start raises
        SingletonBusyError (a SingletonQueueFullError) and writes nothing; an
        existing id is returned; once the key is idle a start is accepted."""
        engine.start("conf-skip", {"k": "K"}, run_id="A")
        with pytest.raises(SingletonBusyError) as caught:
            engine.start("conf-skip", {"k": "K"}, run_id="B")
        assert isinstance(caught.value, SingletonQueueFullError) and caught.value.max_queue_depth == 0
        assert engine.store.get_run("B") is None
        assert engine.start("conf-skip", {"k": "K"}, run_id="A").run_id == "A"
        _settle_all(engine)
        assert engine.start("conf-skip", {"k": "K"}, run_id="B").run_id == "B"

    # -- debounce (X7) -----------------------------------------------------------------
    def test_a_debounce_folds_a_burst_into_one_run(self, engine: Engine) -> None:
        """X7, X7a, X7c: starts of one debounce key are one delayed run holding the
        newest input, its start ``seconds`` after the last start and never past its
        ``debounce_until``; a retried start of a folded id changes nothing; another
        key has its own run. A store without ``supports_debounce`` refuses the start
        with UnsupportedByStoreError and writes nothing."""
        if not engine.store.supports_debounce:
            with pytest.raises(UnsupportedByStoreError):
                engine.start("conf-debounce", {"k": "K"}, run_id="A")
            assert engine.store.get_run("A") is None
            return
        first = engine.start("conf-debounce", {"k": "K", "n": 0}, run_id="A")
        assert first.status == RunStatus.PENDING and first.debounce_key == "K"
        assert first.not_before is not None and first.debounce_until is not None
        assert first.not_before > first.created_at and first.debounce_until >= first.not_before
        for n in (1, 2, 3):
            assert engine.start("conf-debounce", {"k": "K", "n": n}, run_id=f"F{n}").run_id == "A"
        folded = engine.get("A")
        assert folded.input == {"k": "K", "n": 3}
        assert folded.not_before is not None and folded.debounce_until is not None
        assert first.not_before <= folded.not_before <= folded.debounce_until
        assert folded.wake_at == folded.not_before
        assert engine.start("conf-debounce", {"k": "K", "n": 1}, run_id="F1").run_id == "A"
        assert engine.get("A").input == {"k": "K", "n": 3} and engine.get("A").not_before == folded.not_before
        assert engine.store.get_run("F1") is None
        assert engine.start("conf-debounce", {"k": "L", "n": 9}).run_id != "A"
        assert self._turn(engine, "A", "w").state is TurnState.SKIPPED  # not due: no claim (X5)
        assert engine.get("A").status == RunStatus.PENDING and not engine.get("A").admitted

    def test_replace_queued_keeps_one_waiter(self, engine: Engine, bodies: _Bodies) -> None:
        """X1, S6, S7: behind a holder each "replace_queued" start settles the
        waiter before it cancelled with code ``replaced`` and leaves the holder
        alone; the newest runs after the holder. A store without
        ``supports_on_busy`` refuses the start and writes nothing."""
        if _refused_without_on_busy(engine, "conf-replace_queued"):
            return
        engine.start("conf-replace_queued", {"k": "K"}, run_id="A")
        assert self._turn(engine, "A", "w").state is TurnState.RUN
        engine.start("conf-replace_queued", {"k": "K"}, run_id="B")
        engine.start("conf-replace_queued", {"k": "K"}, run_id="C")
        b = engine.get("B")
        assert b.status == RunStatus.CANCELLED and b.error["code"] == "replaced" and not b.admitted
        a = engine.get("A")
        assert a.status == RunStatus.RUNNING and not a.cancel_requested
        assert engine.store.finish(a, "w", RunStatus.COMPLETED, limits=engine.limits()).settled
        _settle_all(engine)
        assert bodies.entered == ["C"] and engine.get("C").status == RunStatus.COMPLETED

    def test_cancel_in_progress_stops_the_holder_and_admits_the_start_next(
        self, engine: Engine, bodies: _Bodies
    ) -> None:
        """X1, D6, S7: a "cancel_in_progress" start asks the running holder to
        stop (its next step boundary answers cancelled) and replaces the waiter;
        the holder's cancelled settle hands its slot to the start, which runs."""
        if _refused_without_on_busy(engine, "conf-cancel_in_progress"):
            return
        engine.start("conf-cancel_in_progress", {"k": "K"}, run_id="A")
        assert self._turn(engine, "A", "w").state is TurnState.RUN
        engine.start("conf-cancel_in_progress", {"k": "K"}, run_id="B")
        engine.start("conf-cancel_in_progress", {"k": "K"}, run_id="C")
        assert engine.get("B").error["code"] == "replaced"
        assert engine.get("A").cancel_requested
        assert engine.store.check_boundary("A", "w", 30) == Verdict.CANCELLED
        a = engine.get("A")
        done = engine.store.finish(a, "w", RunStatus.CANCELLED, error=CANCELLED_ERROR, limits=engine.limits())
        assert done.settled
        _settle_all(engine)
        assert bodies.entered == ["C"] and engine.get("C").status == RunStatus.COMPLETED

    # -- recovery, timeouts, cancel --------------------------------------------------
    def test_an_expired_holder_is_redriven_and_keeps_its_slot(self, engine: Engine, bodies: _Bodies) -> None:
        """S10, D4: a holder whose worker died keeps its slot while its lease is
        live; the tick re-drives it after expiry, before the waiter runs."""
        engine.start("conf-1", {"k": "K"}, run_id="A")
        engine.start("conf-1", {"k": "K"}, run_id="B")
        assert self._turn(engine, "A", "dead-worker", lease=LEASE).state is TurnState.RUN
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert engine.execute("B") == Outcome.PARKED
        time.sleep(LEASE + 0.2)
        report = engine.tick()
        assert "A" in report.recovered
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        _settle_all(engine)
        assert bodies.entered == ["A", "B"] and engine.get("A").recoveries == 1

    def test_a_timeout_settles_a_parked_run_and_stops_a_running_one(self, engine: Engine) -> None:
        """D5, R5a: an overdue parked run is settled cancelled (execution_timeout)
        and its slot handed off; an overdue running run is only asked to stop."""
        engine.start("conf-timeout", {"k": "K"}, run_id="A")
        engine.start("conf-timeout", {"k": "K"}, run_id="B")
        assert self._turn(engine, "A", "w").state is TurnState.RUN
        time.sleep(LEASE + 0.2)
        report = engine.tick()
        assert set(report.timed_out) == {"A", "B"}
        assert engine.get("A").status == RunStatus.RUNNING and engine.get("A").cancel_requested
        b = engine.get("B")
        assert b.status == RunStatus.CANCELLED and b.error["code"] == "execution_timeout"

    def test_cancel_settles_a_parked_run_and_hands_its_slot_off(self, engine: Engine) -> None:
        """D6, S7, F11: cancelling the head waiter passes the next slot on; a
        cancelled run is never admitted."""
        for n in range(3):
            engine.start("conf-1", {"k": "K"}, run_id=f"r{n}")
        assert self._turn(engine, "r0", "w").state is TurnState.RUN
        engine.cancel("r1")
        assert engine.get("r1").status == RunStatus.CANCELLED
        run = engine.get("r0")
        done = engine.store.finish(run, "w", RunStatus.COMPLETED, limits=engine.limits())
        assert [r.run_id for r in done.granted] == ["r2"]

    # -- the queue TTL ---------------------------------------------------------------
    def test_a_waiter_past_its_queue_ttl_ends_and_one_admitted_meanwhile_runs(
        self, engine: Engine, bodies: _Bodies
    ) -> None:
        """X2, R5a, S7: behind the holder H, the waiters A and B outlive the queue
        TTL; the sweep reads A and B; H's settle
        then admits A, so A's expiry, a compare-and-set on a parked waiter,
        writes nothing and A runs; B ends ``cancelled`` with code
        ``queue_ttl_expired`` and is never admitted; the next tick leaves A
        alone."""
        if not engine.store.supports_queue_ttl:
            pytest.skip("the store ends no waiter by its queue_ttl (supports_queue_ttl is False)")
        for run_id in ("H", "A", "B"):
            engine.start("conf-ttl", {"k": "K"}, run_id=run_id)
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert self._turn(engine, "H", "h").state is TurnState.RUN
        assert engine.execute("A") == Outcome.PARKED and engine.execute("B") == Outcome.PARKED
        time.sleep(QUEUE_TTL + 0.2)
        ttls = engine.queue_ttls()
        stale = engine.store.expired_waiters(ttls, 10)
        assert [r.run_id for r in stale] == ["A", "B"]
        done = engine.store.finish(engine.get("H"), "h", RunStatus.COMPLETED, limits=engine.limits())
        assert [r.run_id for r in done.granted] == ["A"]
        assert not engine.store.expire_waiter(stale[0], ttls["conf-ttl"], limits=engine.limits()).settled
        a = engine.get("A")
        assert a.admitted and a.is_parked, "a run admitted after the read was expired"
        ended = engine.store.expire_waiter(stale[1], ttls["conf-ttl"], limits=engine.limits())
        assert ended.settled and ended.granted == ()
        b = engine.get("B")
        assert b.status == RunStatus.CANCELLED and not b.admitted and b.error["code"] == "queue_ttl_expired"
        report = engine.tick()
        assert report.expired == [] and engine.get("A").admitted
        engine.hand_off(done.granted)
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        _settle_all(engine)
        assert bodies.entered == ["A"] and engine.get("A").status == RunStatus.COMPLETED

    def test_the_tick_ends_an_expired_waiter_and_the_next_one_takes_the_slot(
        self, engine: Engine, bodies: _Bodies
    ) -> None:
        """X2, S7, S8: behind the holder H, A outlives the queue TTL and B, started
        later, does not; the tick ends A (``queue_ttl_expired``) and not B; H's
        settle then grants its slot to B, which runs."""
        if not engine.store.supports_queue_ttl:
            pytest.skip("the store ends no waiter by its queue_ttl (supports_queue_ttl is False)")
        engine.start("conf-ttl", {"k": "K"}, run_id="H")
        engine.start("conf-ttl", {"k": "K"}, run_id="A")
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert self._turn(engine, "H", "h").state is TurnState.RUN
        assert engine.execute("A") == Outcome.PARKED
        time.sleep(QUEUE_TTL + 0.2)
        engine.start("conf-ttl", {"k": "K"}, run_id="B")
        assert engine.execute("B") == Outcome.PARKED
        report = engine.tick()
        assert report.expired == ["A"]
        assert engine.get("A").status == RunStatus.CANCELLED and engine.get("A").error["code"] == "queue_ttl_expired"
        assert engine.get("B").status == RunStatus.SUSPENDED
        done = engine.store.finish(engine.get("H"), "h", RunStatus.COMPLETED, limits=engine.limits())
        assert [r.run_id for r in done.granted] == ["B"]
        engine.hand_off(done.granted)
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        _settle_all(engine)
        assert bodies.entered == ["B"] and engine.get("B").status == RunStatus.COMPLETED

    def test_no_grant_admits_a_waiter_past_its_queue_ttl(self, engine: Engine, bodies: _Bodies) -> None:
        """X2, S5, S7, R5a: behind the holder H, A outlives the queue TTL and B,
        started later, does not; with no tick: H's settle (passed the declared
        TTLs, as the engine passes them) grants its slot to B, not A; B's settle
        grants nothing (A is past its TTL), so the slot stays free; A's own
        claim parks it without a slot; A stays a waiter (not cancelled) until
        the tick ends it ``queue_ttl_expired``; A's body never runs."""
        if not engine.store.supports_queue_ttl:
            pytest.skip("the store ends no waiter by its queue_ttl (supports_queue_ttl is False)")
        ttls = engine.queue_ttls()
        engine.start("conf-ttl", {"k": "K"}, run_id="H")
        engine.start("conf-ttl", {"k": "K"}, run_id="A")
        engine.dispatcher.queue.clear()  # type: ignore[attr-defined]
        assert self._turn(engine, "H", "h").state is TurnState.RUN
        assert engine.execute("A") == Outcome.PARKED
        time.sleep(QUEUE_TTL + 0.2)
        engine.start("conf-ttl", {"k": "K"}, run_id="B")
        assert engine.execute("B") == Outcome.PARKED
        done = engine.store.finish(engine.get("H"), "h", RunStatus.COMPLETED, limits=engine.limits(), ttls=ttls)
        assert [r.run_id for r in done.granted] == ["B"], "a handoff admitted a waiter past its queue TTL"
        a = engine.get("A")
        assert not a.admitted and a.is_parked and a.status != RunStatus.CANCELLED
        taken = engine.store.begin_turn(
            "B",
            "b",
            lease_seconds=30.0,
            limits=engine.limits(),
            max_recoveries=engine.settings.MAX_RECOVERIES,
            retry=engine._retry_policy(),
            known=done.granted[0],
            ttls=ttls,
        )
        assert taken.state is TurnState.RUN
        done = engine.store.finish(engine.get("B"), "b", RunStatus.COMPLETED, limits=engine.limits(), ttls=ttls)
        assert done.settled and done.granted == (), "a handoff admitted a waiter past its queue TTL"
        claim = engine.store.begin_turn(
            "A",
            "a",
            lease_seconds=30.0,
            limits=engine.limits(),
            max_recoveries=engine.settings.MAX_RECOVERIES,
            retry=engine._retry_policy(),
            ttls=ttls,
        )
        assert claim.state is TurnState.PARKED and claim.granted == (), "a waiter past its queue TTL took a slot"
        a = engine.get("A")
        assert not a.admitted and a.is_parked and a.status != RunStatus.CANCELLED
        assert [r.run_id for r in engine.store.active_runs_for_key("conf-ttl", "K") if r.admitted] == []
        assert engine.tick().expired == ["A"]
        a = engine.get("A")
        assert a.status == RunStatus.CANCELLED and not a.admitted and a.error["code"] == "queue_ttl_expired"
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        assert "A" not in bodies.entered

    # -- the reads and repairs of the services (O3, O4, K4) -----------------------------
    def test_the_services_reads_count_holders_waiters_and_stranded_runs(self, engine: Engine) -> None:
        """O3, O4, K3, K4, S5, X3j: what the metrics, health and the slot audit read
        through the store. Key K: r0 holds, r1 and r2 wait; key J: j0 waits, never sent
        a turn; quota conf-pool key Q (a store that admits quotas): q0 holds, q1 and q2
        wait, q2 never sent a turn. A repair writes only with ``supports_slot_repairs``, a
        compare-and-set on what was read (R5a), on the store's clock (R8)."""
        from datetime import timedelta

        store = engine.store
        if not store.supports_atomic_admission:
            pytest.skip("the S14 fallback marks no holder: its claims decide by a scan")
        lease = engine.settings.LEASE_SECONDS
        for run_id in ("r0", "r1", "r2"):
            engine.start("conf-1", {"k": "K"}, run_id=run_id)
        engine.start("conf-1", {"k": "J"}, run_id="j0")
        turns = [self._turn(engine, run_id, f"w-{run_id}", lease).state for run_id in ("r0", "r1", "r2")]
        assert turns == [TurnState.RUN, TurnState.PARKED, TurnState.PARKED]
        quotas = store.admits_quotas
        if quotas:
            for run_id in ("q0", "q1", "q2"):
                engine.start("conf-quota", {"k": "Q"}, run_id=run_id)
            turns = [self._turn(engine, run_id, f"w-{run_id}", lease).state for run_id in ("q0", "q1")]
            assert turns == [TurnState.RUN, TurnState.PARKED]
        counts = {c.name: (c.holders, c.waiters, c.oldest_waiter_at) for c in store.slot_counts()}
        assert counts.pop("conf-1") == (1, 3, engine.get("r1").created_at)
        assert counts == ({"quota:conf-pool": (1, 2, engine.get("q1").created_at)} if quotas else {})
        held = [(c.name, c.key, c.count, c.stored_limit) for c in store.key_holder_counts()]
        assert held == [("conf-1", "K", 1, 1)] + ([("quota:conf-pool", "Q", 1, None)] if quotas else [])
        assert [r.run_id for r in store.due_waiters("conf-1", "K", 5)] == ["r1", "r2"]
        assert [r.run_id for r in store.due_waiters("conf-1", "K", 1)] == ["r1"]
        now = store.now()
        hour, later = timedelta(hours=1), now + timedelta(hours=1)
        # Ten minutes on, j0's first turn and r1's retry are overdue; r2 retries after the backlog's hour (S8a).
        soon = now + timedelta(minutes=10)
        overdue = [(c.name, c.key, c.count, c.stored_limit) for c in store.overdue_waiter_keys(soon)]
        assert overdue == [("conf-1", "J", 1, 1), ("conf-1", "K", 1, 1)]
        assert store.overdue_waiter_keys(now - hour) == []
        assert store.count_backlog(later) == (1 if quotas else 0)  # q2: no first turn, no key to wait for
        assert store.count_backlog(now - hour) == 0
        running = ["q0", "r0"] if quotas else ["r0"]
        assert sorted(r.run_id for r in store.unredriven_leases(later, 10)) == running
        assert store.unredriven_leases(now - hour, 10) == []
        assert store.unrenewed_leases(settings=engine.settings, now=now, limit=10) == ({}, [])
        stale, first = store.unrenewed_leases(settings=engine.settings, now=later, limit=1)
        assert stale == ({"conf-1": 1, "conf-quota": 1} if quotas else {"conf-1": 1})
        assert [r.run_id for r in first] == ["r0"]  # the earliest lease expiry first
        assert store.inactive_holders(10) == []
        assert store.key_freed_since("conf-1", "K", now - hour) is False
        r0 = engine.get("r0")
        assert r0.lease_expires_at is not None
        assert store.drop_holder_marker("r0") is False  # active: the marker stays
        assert store.wake_waiter("r0") is False  # running: not a waiter to wake
        assert store.redrive_lease("r0", r0.lease_expires_at + timedelta(seconds=1)) is False
        repairs = store.supports_slot_repairs
        assert store.wake_waiter("j0") is repairs
        assert store.redrive_lease("r0", r0.lease_expires_at) is repairs
        if repairs:
            woken, redriven = engine.get("j0").wake_at, engine.get("r0").wake_at
            assert woken is not None and woken <= store.now()
            assert redriven is not None and redriven <= store.now()

    def test_the_services_reads_count_and_wake_a_throttles_waiters(self, engine: Engine) -> None:
        """O4, K4, X6d, R5a, R8: what the metrics and the slot audit read of a throttle's
        waiters through the store. C, parked over the rate of ``conf-rate`` key K, is a
        waiter over the rate and not due (no overdue key, no due waiter); made due by a
        raised key's wake (``wake_throttled``) it is a due waiter of an overdue key, and a
        repair wakes it only with ``supports_slot_repairs`` and the wake time read."""
        from datetime import timedelta

        store = engine.store
        if not (store.supports_throttles and store.admits_quotas):
            pytest.skip("this store admits no throttle (X6)")
        for run_id in ("A", "B", "C"):
            engine.start("conf-throttle", {"k": "K"}, run_id=run_id)
        turns = [self._turn(engine, run_id, "w").state for run_id in ("A", "B", "C")]
        assert turns == [TurnState.RUN, TurnState.RUN, TurnState.PARKED]
        created = engine.get("C").created_at
        counts = [(c.name, c.waiters, c.over_rate, c.oldest_waiter_at) for c in store.throttle_waiter_counts()]
        assert counts == [("throttle:conf-rate", 1, 1, created)]
        soon = store.now() + timedelta(minutes=10)
        assert store.overdue_throttle_keys(soon) == []  # not due before the window opens (X5)
        assert store.due_throttle_waiters("conf-rate", "K", 5) == []
        assert [r.run_id for r in store.wake_throttled("conf-rate", "K", 1)] == ["C"]
        counts = [(c.name, c.waiters, c.over_rate, c.oldest_waiter_at) for c in store.throttle_waiter_counts()]
        assert counts == [("throttle:conf-rate", 1, 0, created)]
        soon = store.now() + timedelta(minutes=10)
        overdue = [(c.name, c.key, c.count) for c in store.overdue_throttle_keys(soon)]
        assert overdue == [("throttle:conf-rate", "K", 1)]
        assert store.overdue_throttle_keys(store.now() - timedelta(hours=1)) == []
        [due] = store.due_throttle_waiters("conf-rate", "K", 5)
        assert due.run_id == "C" and store.due_throttle_waiters("conf-rate", "K", 0) == []
        assert due.wake_at is not None
        assert store.wake_throttle_waiter("A", engine.get("A").wake_at) is False  # running: not a waiter
        assert store.wake_throttle_waiter("C", due.wake_at - timedelta(seconds=1)) is False  # not as read
        assert store.wake_throttle_waiter("C", due.wake_at) is store.supports_slot_repairs

    # -- the rules: one in Python, its twin in SQL -----------------------------------
    def test_the_rules_agree_in_python_and_sql(self, engine: Engine) -> None:
        """S5, S12, K2 (#16, #17): on every combination of status and markers the run
        table accepts, ``holds_slot`` and ``is_legacy_holder``, their ORM twins
        (``holds_slot_q``, ``legacy_holder_q``) and their SQL text (the raw
        statements' spelling) agree, and the store reads the same holders;
        ``limit_in_force`` / ``free_slots``, their ORM twins and their SQL text
        agree on every declared limit, override, holder count and pause;
        ``is_due`` (X5) and ``waiter_expired`` (X2) agree with their twins."""
        from django.db import connections
        from django.db.models import Value

        from ..admission import (
            free_slots,
            free_slots_sql,
            free_slots_sql_text,
            holds_slot,
            holds_slot_q,
            holds_slot_sql_text,
            is_due_sql_text,
            is_legacy_holder,
            legacy_holder_q,
            legacy_holder_sql_text,
            limit_in_force,
            limit_in_force_sql,
            limit_in_force_sql_text,
        )
        from ..models import Run
        from ..statuses import ACTIVE_STATUSES, TERMINAL_STATUSES, SlotState
        from ..stores.codec import CodecStore
        from ..stores.django import DjangoStore

        store = engine.store
        while isinstance(store, CodecStore):
            store = store.inner
        if not isinstance(store, DjangoStore):
            pytest.skip("this store keeps no Django run table: the rules' SQL twins do not apply")
        runs = Run.objects.using(store.db)
        now = engine.now()
        expected: dict[str, bool] = {}
        legacy: set[str] = set()
        n = 0
        for status in (*ACTIVE_STATUSES, *TERMINAL_STATUSES):
            for slot in (None, SlotState.HOLDER, SlotState.WAITER):
                for tracked in (False, True):
                    for key in (None, "K"):
                        n += 1
                        run_id = f"rule-{n}"
                        if not _plant_row(
                            store,
                            runs,
                            run_id,
                            now,
                            status=status,
                            singleton_key=key,
                            singleton_slot=slot,
                            singleton_tracked=tracked,
                        ):
                            continue
                        admitted = slot == SlotState.HOLDER
                        expected[run_id] = holds_slot(status, key=key, admitted=admitted, tracked=tracked)
                        if is_legacy_holder(status, key=key, tracked=tracked):
                            legacy.add(run_id)
        assert len(expected) > 20 and legacy
        in_sql = set(runs.filter(pk__in=list(expected)).filter(holds_slot_q()).values_list("pk", flat=True))
        assert in_sql == {run_id for run_id, holds in expected.items() if holds}
        assert {r.run_id for r in store.active_runs_for_key("conf-1", "K") if r.holds_slot} == in_sql
        assert set(runs.filter(pk__in=list(expected)).filter(legacy_holder_q()).values_list("pk", flat=True)) == legacy
        connection = connections[store.db]
        table = connection.ops.quote_name(Run._meta.db_table)

        def ids_where(condition: str) -> set[str]:
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT run_id FROM {table} WHERE run_id LIKE 'rule-%%' AND {condition}")
                return {str(row[0]) for row in cursor.fetchall()}

        assert ids_where(holds_slot_sql_text(table)) == in_sql
        assert ids_where(legacy_holder_sql_text(table)) == legacy
        cases = [
            (declared, override, holders, paused)
            for declared in (None, 1, 3)
            for override in (None, 1, 2, 5)
            for holders in (0, 1, 2, 6)
            for paused in (False, True)
        ]
        probe = runs.filter(pk=next(iter(expected)))
        for declared, override, holders, paused in cases:
            limit = limit_in_force(declared, override)
            sql = probe.annotate(
                limit=limit_in_force_sql(declared, Value(override)),
            ).annotate(free=free_slots_sql("limit", Value(holders), Value(paused)))
            got = sql.values_list("limit", "free").get()
            assert got == (limit, free_slots(limit, holders, paused=paused)), (declared, override, holders, paused)
            with connection.cursor() as cursor:
                # The statements pass the holders as a sum (tracked + an older release's, S12).
                free_text = free_slots_sql_text("x.lim", "x.tracked + x.untracked", "x.paused")
                cursor.execute(
                    f"SELECT x.lim, {free_text} FROM (SELECT {limit_in_force_sql_text('%s', '%s')} AS lim,"
                    " %s AS tracked, %s AS untracked, %s AS paused) x",
                    [override, declared, override, declared, holders - holders // 2, holders // 2, paused],
                )
                text = tuple(int(v) for v in cursor.fetchone())
            assert text == got, (declared, override, holders, paused)
        # X5: is_due and its twin is_due_q agree on the database's clock.
        from datetime import timedelta

        from ..admission import is_due, is_due_q
        from ..querysets import PG_NOW_SQL, DbNow

        db_now = store.now()
        moments = {"none": None, "past": db_now - timedelta(hours=1), "future": db_now + timedelta(hours=1)}
        for name, moment in moments.items():
            runs.filter(pk=next(iter(expected))).update(not_before=moment)
            due_in_sql = runs.filter(pk=next(iter(expected))).filter(is_due_q(DbNow())).exists()
            assert due_in_sql == is_due(moment, store.now()) == (name != "future"), name
            if connection.vendor == "postgresql":  # the raw statements' spelling, on PG_NOW_SQL (#17)
                assert ids_where(f"run_id = '{next(iter(expected))}' AND {is_due_sql_text(table, PG_NOW_SQL)}") == (
                    {next(iter(expected))} if name != "future" else set()
                ), name
        # X2: waiter_expired, its ORM twin queue_ttl_expired_q and (on PostgreSQL) its SQL
        # text agree on the database's clock, for no TTL, a TTL passed and one not passed.
        from ..admission import queue_ttl_expired_q, queue_ttl_expired_sql_text, waiter_expired

        probe_id = next(iter(expected))
        runs.filter(pk=probe_id).update(created_at=store.now() - timedelta(seconds=60))
        created = runs.get(pk=probe_id).created_at
        for ttl in (None, 30.0, 3600.0):
            python = waiter_expired(created, ttl, store.now())
            assert python == (ttl == 30.0), ttl
            if ttl is not None:
                assert runs.filter(pk=probe_id).filter(queue_ttl_expired_q(ttl, DbNow())).exists() == python, ttl
            if connection.vendor == "postgresql":
                cond = queue_ttl_expired_sql_text(table, "%s::float8", PG_NOW_SQL)
                with connection.cursor() as cursor:
                    cursor.execute(f"SELECT {cond} FROM {table} WHERE run_id = %s", [ttl, probe_id])
                    assert cursor.fetchone()[0] is python, ttl

    def test_turn_on_its_way_agrees_in_python_and_sql(self, engine: Engine) -> None:
        """S8, S8a (#17): on every status, park reason and ``wake_at`` (none, an
        hour ago, in an hour), ``turn_on_its_way`` and its SQL twin
        ``turn_on_its_way_q`` (on the database's clock) agree."""
        from datetime import timedelta

        from ..admission import turn_on_its_way, turn_on_its_way_q
        from ..models import Run
        from ..querysets import DbNow
        from ..statuses import ACTIVE_STATUSES, TERMINAL_STATUSES
        from ..stores.codec import CodecStore
        from ..stores.django import DjangoStore

        store = engine.store
        while isinstance(store, CodecStore):
            store = store.inner
        if not isinstance(store, DjangoStore):
            pytest.skip("this store keeps no Django run table: the rules' SQL twins do not apply")
        runs = Run.objects.using(store.db)
        now = store.now()
        expected: dict[str, bool] = {}
        for n, (status, reason, wake_at) in enumerate(
            (status, reason, wake_at)
            for status in (*ACTIVE_STATUSES, *TERMINAL_STATUSES)
            for reason in ("", ParkReason.SINGLETON.value, ParkReason.SHUTDOWN.of(1))
            for wake_at in (None, now - timedelta(hours=1), now + timedelta(hours=1))
        ):
            run_id = f"way-{n}"
            if not _plant_row(store, runs, run_id, now, status=status, park_reason=reason, wake_at=wake_at):
                continue
            expected[run_id] = turn_on_its_way(status, reason, wake_at, now)
        assert any(expected.values()) and not all(expected.values())
        in_sql = set(runs.filter(pk__in=list(expected)).filter(turn_on_its_way_q(DbNow())).values_list("pk", flat=True))
        assert in_sql == {run_id for run_id, on_its_way in expected.items() if on_its_way}

    def test_a_store_without_an_atomic_claim_warns_once(self, engine: Engine) -> None:
        """S14: a store that sets ``supports_atomic_admission = False`` gets the
        scan fallback and one SingletonFallbackWarning per engine."""
        if engine.store.supports_atomic_admission:
            pytest.skip("this store claims atomically: the fallback does not apply")
        engine.start("conf-1", {"k": "K"}, run_id="a")
        engine.start("conf-1", {"k": "K"}, run_id="b")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.execute("a")
            engine.execute("b")
        assert len([w for w in caught if issubclass(w.category, SingletonFallbackWarning)]) == 1


def _settle_all(engine: Engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(not r.is_terminal for r in engine.store.list_runs()):
        assert time.monotonic() < deadline, "runs did not finish"
        engine.tick()
        engine.dispatcher.drain()  # type: ignore[attr-defined]
        time.sleep(0.02)


def _plant_row(store: Any, runs: Any, run_id: str, now: Any, **fields: Any) -> bool:
    """Insert one run row of workflow ``conf-1`` with ``fields`` for a rule's
    SQL-twin check; False for a combination the table refuses (its check
    constraints, e.g. ds_run_slot_only_active)."""
    from django.db import IntegrityError, transaction

    try:
        with transaction.atomic(using=store.db):
            runs.create(
                run_id=run_id,
                workflow_name="conf-1",
                workflow_version="1",
                input={},
                created_at=now,
                updated_at=now,
                **fields,
            )
    except IntegrityError:
        return False
    return True
