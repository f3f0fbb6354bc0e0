"""The soak's workflows: one body under the audit, keyed with limits 1, 2 and 3.

A run's ``input["plan"]`` lists what its body does, in order:

* ``["work", ms]``: a step that records its execution and works ``ms`` milliseconds;
* ``["flaky", ms]``: the same step, failing the first time it runs for the
  run (the driver retries the failed run through admission, D9);
* ``["sleep", seconds]``: ``ctx.sleep`` (parked with its slot, D1);
* ``["signal"]``: ``ctx.wait_for_signal("go", timeout=SIGNAL_TIMEOUT)`` (D2);
* ``["child", key]``: ``ctx.call_child("soak-child", ...)`` on a limit-1 key (D7);
* ``["retain", prefix, seconds]``: ``ctx.call_child("soak-rchild", ...)`` on
  the limit-1 key ``<prefix>-<run id>`` (its own: the driver purges it by
  key), then ``ctx.sleep(seconds)``; the driver purges the finished
  child meanwhile, so the replay after the sleep finds its child gone and
  must return the outcome it first saw (O2, D7, R4). The audit gets
  ``child_outcome`` with what ``call_child`` returned, on every replay.

``soak-sched`` is fired by the schedule :data:`SCHEDULE`, one window a
second (S17); its run ids name their window.

``soak-timeout`` runs have ``timeout=TIMEOUT_SECONDS`` and a step longer
than that, so the tick's execution timeout ends them (D5).

With the driver's ``quotas`` feature (``SOAK_FEATURES``) three more
workflows carry the shared quotas (X3, X4), keyed by ``input["qkey"]``:
``soak-qa`` only :data:`SHARED`; ``soak-qb`` :data:`SHARED` and a limit-1
singleton key with a ``queue_ttl`` of :data:`QUEUE_TTL` seconds (X2), so its
run carries two limits and its waiters may expire; ``soak-qf`` only
:data:`FAIR`, whose sub-key is the tenant ``input["tenant"]`` (X4).

With the driver's ``controls`` feature three more workflows carry the flow
controls of issue #33: ``soak-th`` only the throttle :data:`RATE`
(:data:`THROTTLE_LIMIT` admissions per :data:`THROTTLE_PERIOD` seconds of each
throttle key ``input["tkey"]``, X6); ``soak-pr`` a limit-1 singleton key whose
runs are started with a priority (X8); ``soak-db`` the debounce
:data:`DEBOUNCE` on ``input["dkey"]`` (X7), whose starts number their input
``input["n"]``.

The audit (:mod:`soak.audit`) gets ``enter`` with the fencing token (K1;
a run without a singleton key has none: its token is then its one quota's,
X3f), the input's number ``n`` when it has one (a debounced run, X7), and,
for a run that carries quotas, ``quotas`` (quota name -> quota key)
and ``qtokens`` (``ctx.quota_tokens``),
``exec`` when a step handler starts, ``stored`` once a step this body executed
was accepted by the store, and ``exit`` with how the body left (``return``,
``park`` or the exception's name). A run returns ``{"done": n, "run": run_id}``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from durable_singleton import (
    BaseWorkflow,
    Debounce,
    Quota,
    Schedule,
    Singleton,
    Throttle,
    WorkflowCtx,
    step,
    workflow,
)
from durable_singleton.context import Suspend

from . import audit

#: The limit of each keyed workflow of the soak.
LIMITS = {
    "soak-l1": 1,
    "soak-l2": 2,
    "soak-l3": 3,
    "soak-timeout": 1,
    "soak-child": 1,
    "soak-retain": 2,
    "soak-rchild": 1,
    "soak-sched": 2,
    "soak-qb": 1,
    "soak-pr": 1,
}
TIMEOUT_SECONDS = 2.0
SIGNAL_TIMEOUT = 30.0
#: The soak's schedule (S17): a window every second, each fired once; a window
#: late by up to ``catch_up_limit`` seconds (a tick held up by a fault) still fires.
SCHEDULE = Schedule(
    "soak-every-second",
    every=1,
    catch_up="all",
    catch_up_limit=60,
    input={"key": "sched", "plan": [["work", 2]]},
)

#: The driver's ``--features`` (``SOAK_FEATURES``, set for the driver and its workers).
FEATURES = frozenset(os.environ.get("SOAK_FEATURES", "").split(","))
#: The slots per quota key of each shared quota (X3).
QUOTA_LIMITS = {"soak-shared": 2, "soak-fair": 2}
#: The ``queue_ttl`` of each workflow that has one, seconds (X2).
QUEUE_TTL = {"soak-qb": 1.2}
#: The slots per round of the fair quota's sub-keys (X4); the others get 1.
FAIR_WEIGHTS = {"big": 2}

#: The throttle of ``soak-th`` (X6): admissions per window of each throttle key, and the window, seconds.
THROTTLE_LIMIT = 3
THROTTLE_PERIOD = 1.0
#: The debounce of ``soak-db`` (X7): its quiet period and its longest hold, seconds.
DEBOUNCE_SECONDS = 0.3
DEBOUNCE_MAX_SECONDS = 1.0

_local = threading.local()


def _qkey(input: dict[str, Any]) -> str:
    return str(input["qkey"])


def _tenant(input: dict[str, Any]) -> str:
    return str(input["tenant"])


#: A quota shared by ``soak-qa`` and ``soak-qb`` (X3).
SHARED = Quota("soak-shared", key=_qkey, limit=QUOTA_LIMITS["soak-shared"])
#: A fair quota of ``soak-qf``: its free slots go round-robin across tenants (X4).
FAIR = Quota("soak-fair", key=_qkey, limit=QUOTA_LIMITS["soak-fair"], fair_key=_tenant, weights=FAIR_WEIGHTS)


def _tkey(input: dict[str, Any]) -> str:
    return str(input["tkey"])


def _dkey(input: dict[str, Any]) -> str:
    return str(input["dkey"])


#: The throttle of ``soak-th`` (X6).
RATE = Throttle("soak-rate", key=_tkey, limit=THROTTLE_LIMIT, period=THROTTLE_PERIOD)
#: The debounce of ``soak-db`` (X7).
DEBOUNCE = Debounce(key=_dkey, seconds=DEBOUNCE_SECONDS, max_seconds=DEBOUNCE_MAX_SECONDS)


class FlakyStepError(RuntimeError):
    """The first execution of a ``flaky`` step for a run."""


@step("soak:work")
def work(args: dict[str, Any]) -> dict[str, Any]:
    """Record the execution (``exec``), fail once if ``flaky``, then work ``ms`` milliseconds."""
    _local.executed = True
    audit.emit("exec", run=args["run"], i=args["i"], token=args["token"], key=args["key"])
    if args.get("flaky"):
        marker = (
            Path(os.environ.get("SOAK_DIR", "/tmp"))
            / "flaky"
            / f"{hashlib.sha1(args['run'].encode()).hexdigest()}-{args['i']}"
        )
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(marker, "x"):
                pass
        except FileExistsError:
            pass
        else:
            raise FlakyStepError(f"step {args['i']} of {args['run']} fails once")
    time.sleep(float(args.get("ms", 0)) / 1000)
    return {"i": args["i"], "pid": os.getpid(), "token": args["token"]}  # the checker's proof of who stored it


def _key(input: dict[str, Any]) -> str:
    return str(input["key"])


def _body(ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
    run_id, key, token = ctx.run_id, ctx.run.singleton_key, ctx.fencing_token
    quotas = {"quotas": dict(ctx.run.quota_keys), "qtokens": ctx.quota_tokens} if ctx.run.quota_keys else {}
    if "n" in input:  # a debounced run's input: the newest start of its burst (X7)
        quotas["n"] = input["n"]
    if token is None and quotas:
        token = min(ctx.quota_tokens.values(), default=None)  # one quota without a singleton key: its token
    audit.emit(
        "enter",
        run=run_id,
        key=key,
        wf=ctx.run.workflow_name,
        token=token,
        attempts=ctx.run.attempts,
        recoveries=ctx.run.recoveries,
        **quotas,
    )
    how = "return"
    try:
        for i, op in enumerate(input["plan"]):
            kind = op[0]
            if kind in ("work", "flaky"):
                _local.executed = False
                args = {"run": run_id, "i": i, "token": token, "key": key, "ms": op[1], "flaky": kind == "flaky"}
                ctx.step("soak:work", args)
                if _local.executed:
                    audit.emit("stored", run=run_id, i=i, token=token)
            elif kind == "sleep":
                ctx.sleep(float(op[1]))
            elif kind == "signal":
                ctx.wait_for_signal("go", timeout=SIGNAL_TIMEOUT)
            elif kind == "child":
                ctx.call_child("soak-child", {"key": op[1], "plan": [["work", 5]]})
            elif kind == "retain":
                outcome = ctx.call_child("soak-rchild", {"key": f"{op[1]}-{run_id}", "plan": [["work", 3]]})
                audit.emit("child_outcome", run=run_id, token=token, outcome=outcome)
                ctx.sleep(float(op[2]))
        return {"done": len(input["plan"]), "run": run_id}
    except Suspend:
        how = "park"
        raise
    except BaseException as exc:
        how = type(exc).__name__
        raise
    finally:
        audit.emit("exit", run=run_id, token=token, how=how)


def _declare(
    name: str,
    limit: int | None,
    timeout: float | None = None,
    schedules: tuple[Schedule, ...] = (),
    quotas: tuple[Quota, ...] = (),
    throttles: tuple[Throttle, ...] = (),
    debounce: Debounce | None = None,
) -> type[BaseWorkflow]:
    singleton = Singleton(key=_key, limit=limit, queue_ttl=QUEUE_TTL.get(name)) if limit is not None else None

    @workflow(
        name=name,
        version="1",
        singleton=singleton,
        timeout=timeout,
        schedules=schedules,
        quotas=quotas,
        throttles=throttles,
        debounce=debounce,
    )
    class SoakWorkflow(BaseWorkflow):
        def run(self, ctx: WorkflowCtx, input: dict[str, Any]) -> dict[str, Any]:
            return _body(ctx, input)

    SoakWorkflow.__name__ = SoakWorkflow.__qualname__ = name.replace("-", "_")
    return SoakWorkflow


SoakL1 = _declare("soak-l1", 1)
SoakL2 = _declare("soak-l2", 2)
SoakL3 = _declare("soak-l3", 3)
SoakTimeout = _declare("soak-timeout", 1, timeout=TIMEOUT_SECONDS)
SoakChild = _declare("soak-child", 1)
SoakRetain = _declare("soak-retain", LIMITS["soak-retain"])
SoakRetainedChild = _declare("soak-rchild", LIMITS["soak-rchild"])
#: Declared with its schedule only when the driver's ``--features`` has ``schedules``
#: (``SOAK_FEATURES``, set for the driver and its workers).
SoakScheduled = _declare(
    "soak-sched",
    LIMITS["soak-sched"],
    schedules=(SCHEDULE,) if "schedules" in FEATURES else (),
)
if "quotas" in FEATURES:  # declared only with the driver's ``quotas`` feature
    SoakQuota = _declare("soak-qa", None, quotas=(SHARED,))
    SoakQuotaKeyed = _declare("soak-qb", LIMITS["soak-qb"], quotas=(SHARED,))
    SoakQuotaFair = _declare("soak-qf", None, quotas=(FAIR,))
if "controls" in FEATURES:  # declared only with the driver's ``controls`` feature
    SoakThrottled = _declare("soak-th", None, throttles=(RATE,))
    SoakPriority = _declare("soak-pr", LIMITS["soak-pr"])
    SoakDebounced = _declare("soak-db", None, debounce=DEBOUNCE)
