"""The soak's checker judges shared quotas, fair quotas and queue TTLs (soak/check.py, issue #20).

Each rule of the ``quotas`` feature is shown to fire on a small hand-written
history that breaks it, and to stay quiet on the same history without the
break (X2, X3c, X3d, X3f, X4b). Files only: no database, no workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from soak.check import QUEUE_TTL_OF, QUOTA_LIMIT_OF, check, render
from tests.model.soak_history import write_history

pytestmark = pytest.mark.vendor_agnostic

T0 = 1_800_000_000.0
SHARED, FAIR = "soak-shared", "soak-fair"


def _body(run: str, pid: int, qtoken: int, enter: float, leave: float, *, wf: str = "soak-qa", qkey: str = "q0",
          quota: str = SHARED, key: str | None = None, token: int | None = None, recoveries: int = 0,
          how: str = "return", steps: int = 1) -> list[dict[str, Any]]:  # fmt: skip
    """One body of a run that carries ``quota``: enter (with its quota key and
    token), ``steps`` executed and stored steps, exit, and its accepted settle
    (none after a LeaseLostError). Without a singleton ``key`` its token is its quota's."""
    token = qtoken if key is None else token
    events = [{"e": "enter", "t": T0 + enter, "pid": pid, "run": run, "key": key, "wf": wf, "token": token,
               "attempts": 1, "recoveries": recoveries, "quotas": {quota: qkey},
               "qtokens": {quota: qtoken}}]  # fmt: skip
    span = (leave - enter) / (steps + 1)
    for i in range(steps):
        at = T0 + enter + span * (i + 0.5)
        events.append({"e": "exec", "t": at, "pid": pid, "run": run, "i": i, "token": token, "key": key})
        events.append({"e": "stored", "t": at + span / 4, "pid": pid, "run": run, "i": i, "token": token})
    events.append({"e": "exit", "t": T0 + leave, "pid": pid, "run": run, "token": token, "how": how})
    if how != "LeaseLostError":
        events.append({"e": "settled", "t": T0 + leave + 0.001, "pid": pid, "run": run, "status": "completed"})
    return events


def _run(run_id: str, created: float, *, wf: str = "soak-qa", key: str | None = None, status: str = "completed",
         admitted: float | None = None, finished: float | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"run_id": run_id, "workflow_name": wf, "singleton_key": key, "status": status, "error": None,
            "created_at": T0 + created, "parent_run_id": None, "recoveries": 0,
            "admitted_at": None if admitted is None else T0 + admitted,
            "finished_at": None if finished is None else T0 + finished, **extra}  # fmt: skip


def _member(run_id: str, created: float, token: int | None, *, quota: str = SHARED, qkey: str = "q0", tag: int = 0,
            sub_key: str = "") -> dict[str, Any]:  # fmt: skip
    return {"run_id": run_id, "quota": quota, "key": qkey, "slot": None, "fencing_token": token, "tag": tag,
            "sub_key": sub_key, "weight": 1, "created_at": T0 + created}  # fmt: skip


def _start(run: str, t_req: float, *, wf: str = "soak-qa", key: str = "qa") -> dict[str, Any]:
    return {"e": "start", "t": T0 + t_req + 0.005, "t_req": T0 + t_req, "run": run, "wf": wf, "key": key,
            "plan": [], "ns": "default"}  # fmt: skip


def _write(folder: Path, audit: list[dict[str, Any]], events: list[dict[str, Any]], runs: list[dict[str, Any]],
           memberships: list[dict[str, Any]], keys: list[dict[str, Any]] | None = None) -> Path:  # fmt: skip
    """Write the three files; the key rows' counters default to the highest token seen."""
    return write_history(folder, audit, events, runs, keys, memberships=memberships)


def _rules(folder: Path) -> set[str]:
    return {v["rule"] for v in check(folder)["violations"]}


def _shared(c_holds_with_a: bool) -> tuple[list[dict[str, Any]], ...]:
    """a (soak-qa: the quota only) and b (soak-qb: the quota and its singleton key)
    share q0 (limit 2); c (soak-qb on another key) enters while a holds if
    ``c_holds_with_a``, else after a settled."""
    c_enter = 1.8 if c_holds_with_a else 2.2
    audit = (
        _body("a", 10, 1, 1.0, 2.0)
        + _body("b", 11, 2, 1.5, 3.0, wf="soak-qb", key="k1", token=1)
        + _body("c", 12, 3, c_enter, c_enter + 0.5, wf="soak-qb", key="k2", token=1)
    )
    events = [_start("a", 0.1), _start("b", 0.2, wf="soak-qb", key="k1"), _start("c", 0.3, wf="soak-qb", key="k2")]
    runs = [
        _run("a", 0.1, admitted=0.99, finished=2.01),
        _run("b", 0.2, wf="soak-qb", key="k1", admitted=1.49, finished=3.01),
        _run("c", 0.3, wf="soak-qb", key="k2", admitted=c_enter - 0.01, finished=c_enter + 0.51),
    ]
    memberships = [_member("a", 0.1, 1), _member("b", 0.2, 2), _member("c", 0.3, 3)]
    return audit, events, runs, memberships


def test_runs_of_two_workflows_within_their_quota_s_limit_break_nothing(tmp_path: Path) -> None:
    """X3c, X3d: a quota-only run (no singleton key, judged by no key's rule)
    and two runs that also carry a singleton key, two at a time in q0."""
    report = check(_write(tmp_path, *_shared(c_holds_with_a=False)))
    assert report["violations"] == []
    features = report["features"]
    assert (features["quota_runs"], features["quota_runs_entered"], features["quota_fifo_checked"]) == (3, 3, 3)
    assert features["quota_holders_max"] == {SHARED: {"q0": 2}}
    assert features["quota_limits"] == QUOTA_LIMIT_OF
    assert "highest holders per quota key" in render({"db": "x", "seed": 1, **report})


def test_three_holders_of_a_limit_2_quota_key_across_workflows_are_over_admission(tmp_path: Path) -> None:
    """X3d: c (soak-qb) enters while a (soak-qa) and b (soak-qb) hold q0 of
    limit 2: each singleton key had one holder, the shared quota three."""
    report = check(_write(tmp_path, *_shared(c_holds_with_a=True)))
    assert [v["rule"] for v in report["violations"]] == ["quota_over_admission"]
    assert (report["violations"][0]["holders"], report["violations"][0]["runs"]) == (3, ["a", "b", "c"])


def _taken_over(second_token: int) -> tuple[list[dict[str, Any]], ...]:
    """a's body is frozen past its lease (its exit a LeaseLostError, nothing
    accepted after its first step); the takeover (recoveries 1) enters with
    ``second_token``; b follows."""
    audit = _body("a", 10, 1, 1.0, 6.1, how="LeaseLostError")[:1]
    audit += _body("a", 11, second_token, 5.0, 7.0, recoveries=1)
    audit += _body("b", 12, second_token + 1, 7.5, 8.0)
    events = [_start("a", 0.1), _start("b", 0.2)]
    runs = [_run("a", 0.1, admitted=0.99, recoveries=1), _run("b", 0.2, admitted=7.49)]
    memberships = [_member("a", 0.1, second_token), _member("b", 0.2, second_token + 1)]
    return audit, events, runs, memberships


def test_a_takeover_with_a_new_quota_token_breaks_nothing(tmp_path: Path) -> None:
    """X3f, K1: the baseline of the next test."""
    assert check(_write(tmp_path, *_taken_over(2)))["violations"] == []


@pytest.mark.parametrize("rule", ["quota_token_reused", "quota_token_decreased", "quota_token_behind_key"])
def test_quota_token_faults_are_found(tmp_path: Path, rule: str) -> None:
    """X3f: b enters with a's token; a's takeover keeps its old token (a
    takeover stamps a new one); the quota key's counter is behind a token seen."""
    audit, events, runs, memberships = _taken_over(2)
    keys = None
    if rule == "quota_token_reused":
        audit = [a for a in audit if a["run"] != "b"] + _body("b", 12, 2, 7.5, 8.0)
        memberships[1]["fencing_token"] = 2
    elif rule == "quota_token_decreased":
        audit, events, runs, memberships = _taken_over(1)
        audit = [a for a in audit if a["run"] != "b"] + _body("b", 12, 3, 7.5, 8.0)
        memberships[1]["fencing_token"] = 3
    else:
        keys = [{"workflow_name": f"quota:{SHARED}", "key": "q0", "last_token": 2}]
    assert _rules(_write(tmp_path, audit, events, runs, memberships, keys)) == {rule}


def test_a_stale_body_of_a_quota_only_run_is_judged_by_its_quota_token(tmp_path: Path) -> None:
    """K1, X3f: a run without a singleton key has only its quota token; a body
    that enters with a lower one after a takeover holds nothing, and a write of
    it accepted is found."""
    audit = _body("a", 11, 2, 1.0, 2.0, recoveries=1, steps=0)
    audit += _body("a", 10, 1, 2.5, 3.0, steps=0)[:1]  # frozen before its body, thawed after the takeover
    audit.append({"e": "exit", "t": T0 + 3.0, "pid": 10, "run": "a", "token": 1, "how": "LeaseLostError"})
    runs, memberships = [_run("a", 0.1, admitted=0.5, recoveries=1)], [_member("a", 0.1, 2)]
    report = check(_write(tmp_path, audit, [_start("a", 0.1)], runs, memberships))
    assert (report["violations"], report["stale_bodies"]) == ([], 1)
    audit.insert(-1, {"e": "stored", "t": T0 + 2.8, "pid": 10, "run": "a", "i": 0, "token": 1})
    assert _rules(_write(tmp_path, audit, [_start("a", 0.1)], runs, memberships)) == {"stale_write_accepted"}


def test_a_stale_body_thawed_after_the_takeover_failed_the_run_is_no_later_claim(tmp_path: Path) -> None:
    """X3f, D9, K1 (the PostgreSQL soak of a side-by-side CI run, s001774): a's claim
    (quota token 1) is frozen before its body; the takeover (token 2, recoveries 1)
    fails the run; the stale body thaws after that failure, enters with token 1 and is
    fenced (LeaseLostError); the retry's body enters with token 3. The stale body holds
    nothing and is no claim of the retry's tenure: no quota token decreased. Before,
    the token order was judged over every body, the stale one counted in the retry's
    tenure ("claim [1, 0], tokens [1, 3] after token 2")."""
    audit = _body("a", 11, 2, 1.0, 2.0, recoveries=1, how="FlakyStepError", steps=0)
    audit[-1]["status"] = "failed"
    audit += _body("a", 10, 1, 2.5, 3.0, how="LeaseLostError", steps=0)
    audit += _body("a", 10, 3, 4.0, 4.5)
    events = [_start("a", 0.1), {"e": "retry", "t": T0 + 3.2, "run": "a"}]
    runs, memberships = [_run("a", 0.1, admitted=3.99, finished=4.51, recoveries=1)], [_member("a", 0.1, 3)]
    report = check(_write(tmp_path, audit, events, runs, memberships))
    assert (report["violations"], report["stale_bodies"]) == ([], 1)


def _passed(holder_leaves: float) -> tuple[list[dict[str, Any]], ...]:
    """q0, limit 2. h holds from 1.0 to ``holder_leaves``. w (soak-qb, older)
    waits for its singleton key k, which x holds until 3.8; r (younger) is
    admitted at 2.0, before w (token 3 against 2)."""
    audit = (
        _body("x", 13, 1, 0.5, 3.8, wf="soak-qb", key="k", token=1, qkey="q1")
        + _body("h", 10, 1, 1.0, holder_leaves)
        + _body("r", 11, 2, 2.0, 3.0)
        + _body("w", 12, 3, 4.0, 4.5, wf="soak-qb", key="k", token=2)
    )
    events = [_start("x", 0.05, wf="soak-qb", key="k"), _start("h", 0.1), _start("w", 0.2, wf="soak-qb", key="k"),
              _start("r", 0.3)]  # fmt: skip
    runs = [
        _run("x", 0.05, wf="soak-qb", key="k", admitted=0.49, finished=3.81),
        _run("h", 0.1, admitted=0.99, finished=holder_leaves + 0.01),
        _run("w", 0.2, wf="soak-qb", key="k", admitted=3.99, finished=4.51),
        _run("r", 0.3, admitted=1.99, finished=3.01),
    ]
    memberships = [_member("x", 0.05, 1, qkey="q1"), _member("h", 0.1, 1), _member("w", 0.2, 3),
                   _member("r", 0.3, 2)]  # fmt: skip
    return audit, events, runs, memberships


def test_a_run_may_pass_an_older_waiter_blocked_on_its_singleton_key_within_the_free_slots(tmp_path: Path) -> None:
    """X3d: w waits for its busy singleton key and keeps its place in q0 without
    its slot; with h gone, q0's two free slots reach w and r, so r is admitted."""
    report = check(_write(tmp_path, *_passed(holder_leaves=1.5)))
    assert report["violations"] == []
    assert report["features"]["quota_fifo_checked"] == 4


def test_a_run_admitted_past_an_older_waiter_beyond_the_free_slots_breaks_the_quota_order(tmp_path: Path) -> None:
    """X3d: h still holds q0 when r is admitted, so its one free slot reached
    only w, the older waiter; r passed it."""
    violations = check(_write(tmp_path, *_passed(holder_leaves=5.0)))["violations"]
    assert [(v["rule"], v["run"], v["older"], v["holders"]) for v in violations] == [("quota_fifo", "r", ["w"], ["h"])]


def _burst(fifo_tags: bool) -> tuple[list[dict[str, Any]], ...]:
    """The fair quota's key f, limit 2: big starts 8 runs back to back (tags a
    turn of 500 apart: weight 2), then small-0 starts s while b1 and b2 hold (s
    gets the virtual time 500). With ``fifo_tags`` every tag is 0 and s is
    admitted after the whole burst; else right after the holders."""
    big = [f"b{i}" for i in range(1, 9)]
    tags = {r: 0 if fifo_tags else 500 * i for i, r in enumerate(big)}
    tags["s"] = 0 if fifo_tags else 500
    created = {r: 0.01 * i for i, r in enumerate(big, start=1)} | {"s": 0.2}
    order = [*big, "s"] if fifo_tags else ["b1", "b2", "s", *big[2:]]
    audit: list[dict[str, Any]] = []
    runs, memberships = [], []
    for n, run_id in enumerate(order):
        enter = 0.1 + 0.35 * (n // 2) + 0.01 * (n % 2)
        audit += _body(run_id, 10 + n, n + 1, enter, enter + 0.3, wf="soak-qf", quota=FAIR, qkey="f")
        runs.append(_run(run_id, created[run_id], wf="soak-qf", admitted=enter - 0.005, finished=enter + 0.31))
        sub = "small-0" if run_id == "s" else "big"
        memberships.append(_member(run_id, created[run_id], n + 1, quota=FAIR, qkey="f", tag=tags[run_id], sub_key=sub))
    events = [_start(r, created[r] - 0.001, wf="soak-qf", key="qf") for r in [*big, "s"]]
    return audit, events, runs, memberships


def test_a_small_tenant_s_run_goes_ahead_of_a_burst_in_a_fair_quota(tmp_path: Path) -> None:
    """X4b: s's tag is the virtual time, so no run of the burst still in line is ahead of it."""
    features = check(_write(tmp_path, *_burst(fifo_tags=False)))
    assert features["violations"] == []
    figures = features["features"]
    assert (figures["fair_waiters_judged"], figures["fair_judged_in_a_burst"]) == (2, 1)
    assert (figures["fair_ahead_max"], figures["fair_in_line_max"]) == (0, 6)


def test_a_burst_that_passes_another_tenant_s_run_in_a_fair_quota_is_unfair(tmp_path: Path) -> None:
    """X4b: with every tag 0 (oldest first) the six runs of big still in line
    when s started are all ahead of it, more than limit + 1 = 3."""
    violations = check(_write(tmp_path, *_burst(fifo_tags=True)))["violations"]
    assert [(v["rule"], v["run"], v["other"], v["ahead"], v["bound"]) for v in violations] == [
        ("quota_fair", "s", "big", 6, 3)
    ]


@pytest.mark.parametrize("fault", [None, "ttl_admitted", "ttl_wrong"])
def test_a_waiter_ended_by_its_queue_ttl_never_entered_and_waited_its_ttl(tmp_path: Path, fault: str | None) -> None:
    """X2: e waited on its busy key (a holds it) and ended ``queue_ttl_expired``
    after its TTL: no violation, no unexpected outcome. Found: a body of e
    entered; e ended so before its TTL had passed."""
    ttl = QUEUE_TTL_OF["soak-qb"]
    waited = ttl / 2 if fault == "ttl_wrong" else ttl + 0.1
    a_leaves = 0.9 if fault == "ttl_admitted" else 3.0  # then e is admitted at 1.0, and expires anyway
    audit = _body("a", 10, 1, 0.5, a_leaves, wf="soak-qb", key="k", token=1)
    if fault == "ttl_admitted":
        audit += _body("e", 11, 2, 1.0, 1.1, wf="soak-qb", key="k", token=2, qkey="q1", steps=0, how="park")[:-1]
    error = {"code": "queue_ttl_expired", "message": "not admitted within the queue_ttl of its creation"}
    runs = [
        _run("a", 0.1, wf="soak-qb", key="k", admitted=0.49, finished=a_leaves + 0.01),
        _run("e", 0.2, wf="soak-qb", key="k", status="cancelled", error=error, finished=0.2 + waited),
    ]
    memberships = [_member("a", 0.1, 1), _member("e", 0.2, 2 if fault == "ttl_admitted" else None, qkey="q1")]
    events = [_start("a", 0.1, wf="soak-qb", key="k"), _start("e", 0.2, wf="soak-qb", key="k")]
    report = check(_write(tmp_path, audit, events, runs, memberships))
    assert {v["rule"] for v in report["violations"]} == ({fault} if fault else set())
    assert report["features"]["ttl_expired"] == 1
    if fault is None:
        assert report["features"]["ttl_lateness_max"] == pytest.approx(0.1)
