"""The soak's independent checker: ``python -m soak.check FOLDER``.

It reads only three files of a soak's output folder, never the product's
code: ``audit.jsonl`` (what the bodies did, appended by every worker process,
see :mod:`soak.audit`), ``events.jsonl`` (what the driver did: starts,
cancels, signals, retries, duplicate deliveries and faults) and
``final.json`` (the database after the drain). It reports figures and a list
of violations, each naming the rule it breaks:

* ``over_admission`` (S9, S5, S6): at some instant a key had more runs holding it
  than its limit. A body holds its key from its ``enter`` until the last
  write the store accepted from it: its exit when the park or settle that
  follows was accepted (the ``parked`` / ``settled`` audit events, sent only
  after an accepted write), else its last accepted step (at its row's
  ``finished_at`` in the final dump when that is earlier than its ``stored``
  line: a process frozen between the commit and the line). A body fenced
  after a freeze or a partition keeps running on its own, but nothing it
  does is accepted: it is counted as a fenced overlap, not a holder. A run
  holds its slot between its bodies too (a sleep, a signal wait, a child, a
  recovery, S6): from its first body's ``enter`` to its last body's last
  accepted write. A ``retry`` event starts a new tenure (D9: the run failed,
  which freed its slot) from the exit of the body that failed before it (the
  driver writes the line after the retry, when the new body may have entered).
* ``fifo``, ``priority_order`` (S5, S9, X8): a run admitted before a run
  ahead of it in its key's queue order (the higher ``priority`` first, then
  ``created_at``, ``run_id``): ``fifo`` when the two share a priority,
  ``priority_order`` when the one passed had the higher; judged by first-admission fencing tokens: a
  first body's, or, for a run never recovered nor retried, the token in the
  final dump (a run granted its slot but cancelled before its body entered).
  Only an older run already in line counts: its row committed (its ``start``
  line, or its parent's ``durable:child`` step in the dump) before the younger
  one's ``admitted_at``; a row created earlier but committed later was not yet
  a waiter (F3), and a run whose commit time is unknown is not judged.
* ``stale_write_accepted`` (K1, R5): a body that entered with a token lower
  than one its run had already entered with (a holder frozen between its
  claim and its body, thawed after a takeover) had a write accepted. Such
  stale bodies hold nothing and are left out of the other rules; the figures
  count them.
* ``token_reused``, ``token_decreased``, ``token_behind_key`` (K1): two runs
  of a key shared a token; a run's token went down among its live bodies (a
  later body with a lower token is stale, above); a key's stored counter
  is below a token a body saw.
* ``step_reexecuted`` (R4, R6): a step of a run executed with a token not
  older than the one whose success was already stored (a stale token's late
  execution is counted as refused by a token-checking store instead, K1). A
  step the final dump holds, with the token that executed it in its result,
  counts as stored from its ``finished_at`` (plus ``CLOCK_MARGIN`` for the
  two clocks) even when its ``stored`` line is missing (the process died
  between the commit and the line, or the commit's reply was lost);
  ``step_stored_twice``: two bodies were both told their result of one step
  was stored.
* ``worked_after_cancel``, ``cancel_undone`` (D6, S9): a body executed a step
  after its run's cancel was stored (a body claimed just before the cancel
  may still enter, but stops at its first boundary), unless its process was
  frozen after passing that boundary (counted apart: nothing can stop a
  paused process's code), or the body is a retry's: the run failed after the
  request and before its boundary and was retried, which clears the request
  (D9; counted apart). The failure answers a cancel sent before its settled
  line while its body ran: its exit line precedes its commit, and so may
  precede the cancel's own line. A run cancelled at once ended otherwise.
* ``terminal_changed`` (R2, D6): a run's accepted settles (``settled`` audit
  lines) wrote more than one terminal status without a ``retry`` between
  them (only a failed or dead run is retried), or its final status is not
  the one its last accepted settle wrote: a resurrected run, a cancel undone.
* ``not_terminal``, ``lost``, ``unexpected_outcome``, ``signal_lost`` (R2, D2,
  D4, D5, D7): a run still active after the drain; a started run missing; a
  run that ended other than its plan says (completed, or cancelled by the
  driver or its execution timeout); a run whose signal was stored but which
  timed out waiting for it.

The workload of issue #18 (the driver's ``--features``) adds:

* ``namespace_leak``, ``namespace_revealed``, ``namespace_own_read``,
  ``child_namespace`` (D10, D7): a scoped engine's probe of a run of
  another namespace (by the final dump's ``namespace``) returned it, or
  raised anything but "no such run" (``get``, ``signal``, ``cancel``,
  ``wake``) or "id in use" (``start`` of its id); its error's text named
  the tenant or its secret; a scoped engine did not find its own run, or
  found it with another namespace or input; a child in another namespace
  than its parent's. A probe that failed on a fault (a killed connection)
  is counted, not judged.
* ``times_off_clock`` (R8): a run the driver started has a ``created_at``
  outside its start request (from the request to the line written after the
  commit, ``TIME_MARGIN`` either side), the stepped engine's included; or
  its ``admitted_at`` or ``finished_at`` is before its ``created_at``.
* ``schedule_early``, ``schedule_window_missed``, ``schedule_duplicate``
  (S17, R8): a window of any schedule recorded, or its run created, before
  the window began; a window of ``SCHEDULE_NAME`` from the first one
  recorded to the pause at the end of the load (and before the cursor the
  pause left: later ones were never due to a tick) with no run started for
  it, unless the catch-up policy dropped it (a "missed" record made when
  the stretch's newest window was ``SCHEDULE_CATCH_UP`` windows old); two
  records for one window.
* ``child_outcome_changed``, ``child_outcome_lost`` (O2, D7, R4): a
  ``soak-retain`` parent's replays saw different outcomes of its
  ``call_child`` (or one that no ``soak-rchild`` body produced); a parent
  that did not end as planned (its child was purged while it slept: it must
  replay the outcome it stored). The figures count the parents that entered
  a body after their child was purged.

The ``quotas`` feature of issue #20 adds (the dump's ``memberships`` give each
run's quota keys with their tag, sub-key and last token; the ``enter`` lines
give each body's quota keys and ``ctx.quota_tokens``; a body's token is its
singleton key's, or its one quota's for a run without a singleton key):

* ``quota_over_admission`` (X3c, X3d): at some instant a quota key had more
  holders than its limit, across all the workflows that share it; a run holds
  its quota slot by the tenure rules of ``over_admission`` (from its first
  body's ``enter`` to its last accepted write, parks included; a retry starts
  a new tenure; a fenced or stale body holds nothing). A body entered with a
  quota token lower than one its run entered with is stale as above.
* ``quota_token_reused``, ``quota_token_decreased``, ``quota_token_behind_key``
  (X3f, K1): two runs entered with (or the dump holds for two runs) one token
  of one quota key; a claim later in its run's order (a takeover, whose
  ``recoveries`` is higher, or a retry's admission) entered with a quota token
  not above an earlier claim's; the quota key's stored counter is below a
  token seen.
* ``quota_fifo`` (X3d, X4b): a run R admitted in a quota key while older runs
  (by the key's order: tag, ``created_at``, ``run_id``; the tag is 0 in a
  quota without ``fair_key``, so oldest first) were in line and admitted after
  it, more of them than its free slots could pass. X3d lets a run pass an
  older waiter (one blocked on its other limit, its busy singleton key, keeps
  its place but takes no slot) only while the free slots reach both, so the
  older waiters passed plus the holders at R's admission plus R must fit the
  limit. What the files prove, and so what is judged: the order of admissions
  by first-admission quota tokens (a quota key's counter moves under its lock);
  an older run W in line at R's read (its start line written before R's start
  request, or before the admission statement of a lower token, which
  committed before R locked the key); the holders at R's admission among the
  runs of a lower first token whose first tenure's last accepted write came
  after R's first ``enter``. This is weaker than X3d (a holder or waiter not
  seen so is not counted), never stronger.
* ``quota_fair`` (X4b, X3d): a waiter S of a fair quota key found more than
  ``limit + 1 + r`` runs of another sub-key b ahead of it in the key's order
  among those in line when S started (their start line written before S's
  start request, not admitted or ended before S's start line), its own sub-key
  idle then (each of its other runs started after S, or ended longer before
  S's start than the longest freeze lasted). The bound, from X4b's tags: S's
  tag is the key's virtual time V, the largest tag among the holders; a run of
  b tagged below V and still waiting was in line ahead of the holder tagged V
  when that holder was admitted, and X3d admitted that holder within the free
  slots, so at most ``limit - 1`` such runs; a run of b that joined while that
  holder held was tagged V or later, and V itself only while b had no other
  active run tagged V, so one such run; one more, a start of b whose probes
  read the key just before an admission moved V (they take no lock; the
  driver starts one run at a time); and ``r``,
  the runs of b that share their tag with a start of b that raced theirs
  (X4c). A retried run keeps its tag (X4c) and is not counted. FIFO tags (all
  0) let a burst of b pass S, and are found. The figures count the waiters
  judged while another sub-key had more than ``limit + 1`` runs in line.
* ``ttl_admitted``, ``ttl_wrong`` (X2): a run ended with the code
  ``queue_ttl_expired`` that had a body entered since its last retry, or an
  ``admitted_at``; or one that never entered and ended so sooner than its
  workflow's ``queue_ttl`` after its creation (both on the database's clock,
  ``CLOCK_MARGIN``), or whose workflow has no TTL. Such a run is no
  ``unexpected_outcome``; the figures give the expiries and the latest one's
  delay past its TTL.

The ``controls`` feature of issue #33 adds (the dump's ``throttle_keys``,
``priority`` and the admission rows retention kept; the driver's ``start``
lines of debounced runs and its ``debounce_fold`` lines, each with its input's
number ``n``; the ``enter`` lines' ``n``):

* ``throttle_over_rate`` (X6b): a throttle key's admissions, on the database's
  clock (each throttled run's ``admitted_at``, and the admission rows not yet
  deleted), hold more than its limit in some half-open interval of its period.
* ``debounce_split`` (X7, X7a): a debounced start created a run while an
  earlier run of its debounce key was open: its body not entered, no cancel
  sent, and its start time (at least the quiet period after its latest start's
  request, at most ``max_seconds`` after its creation) later than the new
  run's creation (or the new start's line): two runs for one burst.
* ``debounce_fold_closed`` (X7a): a start went into a run whose body had
  entered before the start's request, or whose start time (at most the quiet
  period after its latest start's line) had come.
* ``debounce_input``, ``debounce_early`` (X7, X7d, X5): a debounced body
  entered with another input than its burst's newest start's (or one whose
  line never came: a start failed on a fault, perhaps after its commit); or
  before its start time: the newest start's request, and the quiet period
  after the start before it.
"""

from __future__ import annotations

import bisect
import itertools
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TERMINAL = ("completed", "failed", "cancelled", "dead")
LIMIT_OF = {
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
#: The slots per quota key of the soak's shared quotas (soak/workflows.py, X3).
QUOTA_LIMIT_OF = {"soak-shared": 2, "soak-fair": 2}
#: The ``queue_ttl`` of the soak's workflows that have one, seconds (X2).
QUEUE_TTL_OF = {"soak-qb": 1.2}
#: The error code of a waiter ended by its ``queue_ttl`` (X2).
TTL_CODE = "queue_ttl_expired"
#: The soak's throttles (soak/workflows.py, X6): admissions per window, window seconds.
THROTTLE_OF = {"soak-rate": (3, 1.0)}
#: The soak's debounce (soak/workflows.py, X7): its quiet period and longest hold, seconds.
DEBOUNCE_SECONDS = 0.3
DEBOUNCE_MAX_SECONDS = 1.0
#: Exits after which the engine writes a park or a settle (accepted or not).
FENCED_EXITS = ("LeaseLostError",)
#: Exits that never fail the run (the others are the body's exception: the run fails).
NOT_FAILING_EXITS = ("return", "park", "Interrupted", "RunCancelledError")
#: Seconds by which a time of the database's clock (a step's ``finished_at``,
#: a run's ``admitted_at``) and a ``time.time()`` of the audit or the driver
#: must differ to count as "before" (one machine; the engine corrects its
#: clock to the database's).
CLOCK_MARGIN = 0.05
#: Seconds by which a run's ``created_at`` may fall outside its start request
#: (the engine's offset to the database's clock is measured with the
#: round trip's jitter); a stepped process clock moves it by 5 s or more.
TIME_MARGIN = 1.0
#: The soak's schedule (soak/workflows.py): its name and interval, seconds.
SCHEDULE_NAME = "soak-every-second"
SCHEDULE_EVERY = 1.0
#: Its ``catch_up_limit``: a tick later than this many windows drops the older
#: ones as missed, as its catch-up policy says.
SCHEDULE_CATCH_UP = 60
#: Exits of a probe that a fault explains (a killed connection, a restart).
TRANSIENT_PROBE = "error"


@dataclass
class Body:
    """One entry of a body: from ``enter`` to ``exit`` in one process."""

    run: str
    wf: str
    key: str
    token: int | None
    pid: int
    enter_t: float
    recoveries: int
    exit_t: float | None = None
    how: str | None = None
    accepted_exit: bool = False
    #: The time of the body's accepted park or settle line (written after its commit).
    accepted_t: float | None = None
    stored_t: list[float] = field(default_factory=list)
    #: The step position of each ``stored_t``.
    stored_i: list[int] = field(default_factory=list)
    exec_t: list[float] = field(default_factory=list)
    #: The quota key of each quota the run carries, by quota name (X3b).
    quotas: dict[str, str] = field(default_factory=dict)
    #: The body's fencing token in each of them (``ctx.quota_tokens``, X3f).
    qtokens: dict[str, int] = field(default_factory=dict)
    #: The number of the input it entered with (a debounced run's, X7).
    n: int | None = None

    @property
    def tokens(self) -> dict[str, int]:
        """Return the body's fencing token of each limit: ``""`` its singleton
        key's (or, without one, its quota's, K1), and each quota's by name (X3f)."""
        marks = dict(self.qtokens)
        if self.token is not None:
            marks[""] = self.token
        return marks

    @property
    def accepted_end(self) -> float:
        """The time of the last write the store accepted from this body."""
        if self.accepted_exit and self.exit_t is not None:
            return self.exit_t
        return max([self.enter_t, *self.stored_t])


def _read_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    items, bad = [], 0
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                items.append(json.loads(line))
            except ValueError:
                bad += 1
    return items, bad


def bodies_of(audit: list[dict[str, Any]]) -> list[Body]:
    """Pair each ``enter`` with its ``exit``, steps and accepted park/settle, per process."""
    bodies: list[Body] = []
    open_by_pid: dict[int, Body] = {}
    last_exit: dict[tuple[int, str], Body] = {}
    for event in sorted(audit, key=lambda e: e["t"]):
        kind, pid = event["e"], event["pid"]
        if kind == "enter":
            body = Body(
                event["run"], event["wf"], event["key"], event["token"], pid, event["t"], event.get("recoveries", 0),
                quotas=event.get("quotas") or {}, qtokens=event.get("qtokens") or {}, n=event.get("n"),
            )  # fmt: skip
            bodies.append(body)
            open_by_pid[pid] = body
            last_exit.pop((pid, event["run"]), None)
        elif kind == "exec":
            body = open_by_pid.get(pid)
            if body is not None and body.run == event["run"]:
                body.exec_t.append(event["t"])
        elif kind == "stored":
            body = open_by_pid.get(pid)
            if body is not None and body.run == event["run"]:
                body.stored_t.append(event["t"])
                body.stored_i.append(event["i"])
        elif kind == "exit":
            body = open_by_pid.pop(pid, None)
            if body is not None and body.run == event["run"]:
                body.exit_t, body.how = event["t"], event["how"]
                last_exit[(pid, body.run)] = body
        elif kind in ("parked", "settled"):
            body = last_exit.pop((pid, event["run"]), None)
            if body is not None and body.how not in FENCED_EXITS:
                body.accepted_exit, body.accepted_t = True, event["t"]
    return bodies


def _max_overlap(
    intervals: list[tuple[float, float, str]], tenure: dict[tuple[float, str], int] | None = None
) -> tuple[int, float, list[str]]:
    """Return the highest number of distinct runs whose intervals overlap, when, and which.

    With ``tenure`` (the tenure number of each interval, by its (start, run)),
    the intervals of one run's tenure count as one, from the first start to
    the last end: the run held its slot in between (S6).
    """
    by_run: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for start, end, run in intervals:
        by_run[(run, tenure.get((start, run), 0) if tenure is not None else 0)].append((start, end))
    points: list[tuple[float, int, str]] = []
    for (run, _), spans in by_run.items():
        spans.sort()
        merged = [list(spans[0])]
        for start, end in spans[1:]:
            if tenure is not None or start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        for start, end in merged:
            # An entry with no later accepted write still held the key for an instant.
            points += [(start, 1, run), (max(end, start + 1e-6), 0, run)]  # at a tie, an end comes first
    points.sort()
    inside: set[str] = set()
    best, when, who = 0, 0.0, []
    for t, is_start, run in points:
        if is_start:
            inside.add(run)
            if len(inside) > best:
                best, when, who = len(inside), t, sorted(inside)
        else:
            inside.discard(run)
    return best, when, who


def check(out: Path) -> dict[str, Any]:
    """Check the soak in folder ``out``; return figures and ``violations`` (a list of dicts)."""
    audit, bad_audit = _read_lines(out / "audit.jsonl")
    events, bad_events = _read_lines(out / "events.jsonl")
    final = json.loads((out / "final.json").read_text()) if (out / "final.json").exists() else {}
    runs = {r["run_id"]: r for r in final.get("runs", [])}
    violations: list[dict[str, Any]] = []

    def violate(rule: str, **detail: Any) -> None:
        violations.append({"rule": rule, **detail})

    every_body = bodies_of(audit)
    # A ``stored`` line is written after the step's commit returned: a process
    # frozen (SIGSTOP) between the two writes it late, after a takeover. The
    # write was accepted when the step's row was written: its ``finished_at``
    # in the final dump (plus CLOCK_MARGIN for the two clocks), if earlier.
    committed: dict[tuple[str, int], tuple[float, Any]] = {}
    for row in final.get("steps", []):
        result = row.get("result")
        if isinstance(result, dict) and row.get("finished_at") is not None:
            committed[(row["run_id"], result.get("i"))] = (row["finished_at"] + CLOCK_MARGIN, result.get("token"))
    for body in every_body:
        for n, (i, t) in enumerate(zip(body.stored_i, body.stored_t, strict=True)):
            at, token = committed.get((body.run, i), (t, None))
            if token == body.token and at < t:
                body.stored_t[n] = at
    # A stale body: it entered with a token lower than one a body of its run
    # had already entered with (a holder frozen between its claim and its
    # body, thawed after a takeover). It holds nothing (K1, R5): none of its
    # writes may be accepted, and it is left out of the holder and token rules.
    # Each limit counts apart (the singleton key's token and each quota's, X3f).
    stale: list[Body] = []
    highest: dict[tuple[str, str], int] = {}
    for body in sorted(every_body, key=lambda b: b.enter_t):
        marks = body.tokens
        behind = [limit for limit, token in marks.items() if token < highest.get((body.run, limit), -1)]
        if behind:
            stale.append(body)
            if body.stored_t or body.accepted_exit:
                quota = {"quota": behind[0]} if behind[0] else {}
                violate("stale_write_accepted", run=body.run, token=body.token,
                        newer=highest[(body.run, behind[0])], **quota)  # fmt: skip
        else:
            highest.update(((body.run, limit), token) for limit, token in marks.items())
    stale_ids = {id(b) for b in stale}
    bodies = [b for b in every_body if id(b) not in stale_ids]
    by_key: dict[tuple[str, str], list[Body]] = defaultdict(list)
    for body in bodies:
        if body.key is not None:  # a run with quotas only has no singleton key (X3a)
            by_key[(body.wf, body.key)].append(body)

    # A retry's tenure begins after the exit of the body whose exception failed the run (D9).
    failed_exits: dict[str, list[float]] = defaultdict(list)
    for body in bodies:
        if body.exit_t is not None and body.how not in (*NOT_FAILING_EXITS, *FENCED_EXITS):
            failed_exits[body.run].append(body.exit_t)
    # Each retry answers the oldest failure it has not yet answered: the driver
    # writes its line after the retry returns, and by then the retried run may
    # have been admitted and failed again (a failure is retried once, D9).
    accepted_failures: dict[str, list[float]] = defaultdict(list)
    for body in bodies:
        if body.exit_t is not None and body.how == "FlakyStepError" and body.accepted_exit:
            accepted_failures[body.run].append(body.exit_t)
    retries: dict[str, list[float]] = defaultdict(list)
    for event in sorted((e for e in events if e["e"] == "retry"), key=lambda e: e["t"]):
        run_id = event["run"]
        answered = len(retries[run_id])
        unanswered = sorted(t for t in accepted_failures.get(run_id, ()) if t < event["t"])[answered:]
        before = [t for t in failed_exits.get(run_id, ()) if t < event["t"]]
        retries[run_id].append(unanswered[0] if unanswered else max(before, default=event["t"]))

    # -- holders at every instant (S5, S6, S9) ---------------------------------
    max_holders: dict[int, int] = defaultdict(int)
    fenced_overlap_keys = 0
    tenure = {(b.enter_t, b.run): sum(1 for t in retries.get(b.run, ()) if t < b.enter_t) for b in bodies}
    for (wf, key), group in by_key.items():
        limit = LIMIT_OF.get(wf, 1)
        held, when, who = _max_overlap([(b.enter_t, b.accepted_end, b.run) for b in group], tenure)
        max_holders[limit] = max(max_holders[limit], held)
        if held > limit:
            violate("over_admission", workflow=wf, key=key, limit=limit, holders=held, at=when, runs=who)
        raw, _, _ = _max_overlap([(b.enter_t, b.exit_t or b.accepted_end, b.run) for b in group])
        if raw > limit:
            fenced_overlap_keys += 1

    # -- fencing tokens (K1) ---------------------------------------------------
    retried_at: dict[str, float] = {}
    for event in events:
        if event["e"] == "retry":
            retried_at.setdefault(event["run"], event["t"])
    key_tokens = {(k["workflow_name"], k["key"]): k["last_token"] for k in final.get("keys", [])}
    for (wf, key), group in by_key.items():
        owners: dict[int, set[str]] = defaultdict(set)
        for body in group:
            if body.token is not None:
                owners[body.token].add(body.run)
        for token, owned in owners.items():
            if len(owned) > 1:
                violate("token_reused", workflow=wf, key=key, token=token, runs=sorted(owned))
        seen = max(owners, default=0)
        if final and key_tokens.get((wf, key), 0) < seen:
            violate("token_behind_key", workflow=wf, key=key, stored=key_tokens.get((wf, key)), seen=seen)
    per_run: dict[str, list[Body]] = defaultdict(list)
    for body in bodies:
        per_run[body.run].append(body)
    for run_id, group in per_run.items():
        tokens = [b.token for b in sorted(group, key=lambda b: b.enter_t) if b.token is not None]
        retry = retried_at.get(run_id)
        if retry is None and any(later < earlier for earlier, later in itertools.pairwise(tokens)):
            violate("token_decreased", run=run_id, tokens=tokens)

    # -- FIFO admission by first-admission token (S5, S9) ----------------------
    first_token: dict[str, int] = {}
    for run_id, group in per_run.items():
        retry = retried_at.get(run_id, float("inf"))
        first = min(group, key=lambda b: b.enter_t)
        if first.recoveries == 0 and first.enter_t < retry and first.token is not None:
            first_token[run_id] = first.token
    for run_id, run in runs.items():  # granted, never entered: the grant's token is in the dump
        if (
            run_id not in per_run
            and run.get("fencing_token")
            and not run.get("recoveries")
            and run_id not in retried_at
        ):
            first_token[run_id] = run["fencing_token"]
    members: dict[tuple[str, str], set[str]] = defaultdict(set)
    for (wf, key), group in by_key.items():
        members[(wf, key)].update(b.run for b in group)
    for run_id, run in runs.items():
        if run_id not in per_run and run.get("singleton_key") is not None:
            members[(run["workflow_name"], run["singleton_key"])].add(run_id)
    committed_by = {e["run"]: e["t"] for e in events if e["e"] == "start"}  # written after the commit
    for row in final.get("steps", []):
        result = row.get("result")
        if row.get("name") == "durable:child" and isinstance(result, dict) and row.get("finished_at") is not None:
            committed_by.setdefault(str(result.get("run_id")), row["finished_at"])  # recorded after the child's commit
    fifo_checked = fifo_not_in_line = 0
    priorities: Counter[int] = Counter()
    for (wf, key), group_runs in members.items():
        # The key's queue order (X8): the higher priority first, then (created_at, run_id).
        admitted = sorted(
            (r for r in group_runs if r in first_token and r in runs),
            key=lambda r: (-runs[r].get("priority", 0), runs[r]["created_at"], r),
        )
        fifo_checked += len(admitted)
        priorities.update(runs[r].get("priority", 0) for r in admitted)
        highest: tuple[int, str] | None = None
        for n, run_id in enumerate(admitted):
            token = first_token[run_id]
            if highest is not None and token < highest[0]:
                # run_id comes after runs ahead of it in the queue order but was admitted
                # before them: were they in line yet?
                in_line_by = (runs[run_id].get("admitted_at") or runs[run_id]["created_at"]) - CLOCK_MARGIN
                older = next((r for r in admitted[:n] if first_token[r] > token
                              and committed_by.get(r, float("inf")) < in_line_by), None)  # fmt: skip
                if older is None:
                    fifo_not_in_line += 1
                else:
                    ahead, behind = runs[older].get("priority", 0), runs[run_id].get("priority", 0)
                    violate("fifo" if ahead == behind else "priority_order", workflow=wf, key=key, older=older,
                            older_token=first_token[older], younger=run_id, younger_token=token,
                            **({"priority": ahead} if ahead == behind else
                               {"ahead_priority": ahead, "behind_priority": behind}))  # fmt: skip
            if highest is None or token > highest[0]:
                highest = (token, run_id)

    # -- steps (R4, R6) ----------------------------------------------------------
    stored: dict[tuple[str, int], list[float]] = defaultdict(list)
    stored_token: dict[tuple[str, int], int | None] = {}
    body_token: dict[tuple[int, str], int | None] = {}
    for event in sorted(audit, key=lambda e: e["t"]):
        if event["e"] == "stored":
            stored[(event["run"], event["i"])].append(event["t"])
            stored_token.setdefault((event["run"], event["i"]), event["token"])
    for step, times in stored.items():
        if len(times) > 1:
            violate("step_stored_twice", run=step[0], step=step[1], times=times)
    stored_from_dump = 0
    for row in final.get("steps", []):
        result = row.get("result")
        if not isinstance(result, dict) or result.get("token") is None or row.get("finished_at") is None:
            continue
        step_key = (row["run_id"], result.get("i"))
        if step_key not in stored:  # stored, but its ``stored`` line never came
            stored_from_dump += 1
            stored[step_key].append(row["finished_at"] + CLOCK_MARGIN)
            stored_token[step_key] = result["token"]
    executions = refused_late = 0
    for event in audit:
        if event["e"] != "exec":
            continue
        executions += 1
        step = (event["run"], event["i"])
        if step in stored and event["t"] > min(stored[step]):
            winner = stored_token.get(step)
            if winner is not None and event["token"] is not None and event["token"] < winner:
                refused_late += 1  # a stale holder's late side effect: a token-checking store refuses it (K1)
            else:
                violate("step_reexecuted", run=step[0], step=step[1], at=event["t"], token=event["token"],
                        stored_at=min(stored[step]), stored_token=winner)  # fmt: skip
    del body_token

    # -- cancels (D6, S9) ----------------------------------------------------------
    cancels = [e for e in events if e["e"] == "cancel"]
    cancelled_at: dict[str, float] = {}
    requested_from: dict[str, float] = {}  # when the driver sent the first cancel it judges (before its commit)
    for event in cancels:
        if event["status"] == "cancelled" or event.get("requested"):
            cancelled_at.setdefault(event["run"], event["t"])
            requested_from.setdefault(event["run"], event.get("t_req", event["t"]))
            final_run = runs.get(event["run"])
            if event["status"] == "cancelled" and final_run is not None and final_run["status"] != "cancelled":
                violate("cancel_undone", run=event["run"], final=final_run["status"])
    frozen: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event["e"] == "fault" and event["kind"].startswith("freeze"):
            for pid in event.get("pids", []):
                frozen[pid].append((event["t"], event["until"]))
    # A failure the driver retried, by run: its body's exit is a retry's answered failure.
    retried_failures: dict[str, list[Body]] = defaultdict(list)
    for body in bodies:
        if body.how == "FlakyStepError" and body.accepted_exit and body.exit_t in retries.get(body.run, ()):
            retried_failures[body.run].append(body)

    def answered_cancel(failure: Body, requested: float, returned: float, entered: float) -> bool:
        """Tell whether a body that entered at ``entered`` is the retry's of ``failure``,
        whose body was its run's body when a cancel sent at ``requested`` and returned at
        ``returned`` landed, and whose failure was stored after the cancel was sent: the
        failure then ended the run with the request on it (a body fails at once on its
        flaky step, between a boundary and its failure's commit), and the retry cleared
        the request (D9). Its exit line comes before its failure's commit, so it may
        precede the cancel's own line."""
        assert failure.exit_t is not None and failure.accepted_t is not None
        return failure.enter_t <= returned and requested <= failure.accepted_t and failure.exit_t <= entered

    frozen_late_after_cancel = retried_after_cancel = 0
    for body in every_body:
        cancel = cancelled_at.get(body.run)
        if cancel is None:
            continue
        if any(cancel <= retried <= body.enter_t for retried in retries.get(body.run, ())) or any(
            answered_cancel(failure, requested_from[body.run], cancel, body.enter_t)
            for failure in retried_failures.get(body.run, ())
        ):
            # The run failed after the cancel's request and before its boundary, and was retried:
            # the retry cleared the request (D9), and this body is the retry's, not the cancelled one.
            retried_after_cancel += sum(1 for at in body.exec_t if at > cancel)
            continue
        for at in body.exec_t:
            if at <= cancel:
                continue
            if any(body.enter_t <= start <= at for start, _ in frozen.get(body.pid, [])):
                frozen_late_after_cancel += 1
            else:
                violate("worked_after_cancel", run=body.run, executed=at, cancelled=cancel)

    # -- a terminal run never changes status (R2) -------------------------------------
    # Settles are ordered by the fencing token of the admission they ended, then by time:
    # a body's settle by its own entry's token, any other (the tick's, a cancel's) by the
    # run's newest token entered by then. A process frozen between its settle's commit and
    # its audit line writes the line late, after a retry's body settled (K1, D9).
    settles: dict[str, list[tuple[int, float, str]]] = defaultdict(list)
    body_token: dict[tuple[str, object], int] = {}
    newest_token: dict[str, int] = {}
    for event in audit:
        if event["e"] == "enter" and isinstance(event.get("token"), int):
            body_token[(event["run"], event.get("pid"))] = event["token"]
            newest_token[event["run"]] = max(newest_token.get(event["run"], 0), event["token"])
        elif event["e"] == "settled":
            token = body_token.pop((event["run"], event.get("pid")), None)
            if token is None:
                token = newest_token.get(event["run"], 0)
            settles[event["run"]].append((token, event["t"], event.get("status", "")))
    for run_id, written in settles.items():
        statuses = [status for _, _, status in sorted(written)]
        retried = len(retries.get(run_id, ()))
        final_status = runs.get(run_id, {}).get("status")
        if (
            any(status not in ("failed", "dead") for status in statuses[:-1])
            or len(statuses) - 1 > retried
            or (not retried and final_status is not None and final_status != statuses[-1])
        ):
            violate("terminal_changed", run=run_id, settled=statuses, final=final_status, retries=retried)

    # -- every run terminal, nothing lost, outcomes as planned ------------------------
    started = {e["run"]: e for e in events if e["e"] == "start"}
    signalled = Counter(e["run"] for e in events if e["e"] == "signal")
    for run_id in started:
        if run_id not in runs and final:
            violate("lost", run=run_id)
    statuses: Counter[str] = Counter()
    for run_id, run in runs.items():
        status = run["status"]
        statuses[status] += 1
        if status not in TERMINAL:
            violate("not_terminal", run=run_id, status=status)
            continue
        error = run.get("error") or {}
        code = error.get("code") if isinstance(error, dict) else None
        parent = runs.get(run.get("parent_run_id") or "")
        expected = {"completed"}
        if (
            run_id in cancelled_at
            or run["workflow_name"] == "soak-timeout"
            or (code == TTL_CODE and run["workflow_name"] in QUEUE_TTL_OF)  # judged by the ttl rules (X2)
            or (parent is not None and (parent["status"] == "cancelled" or parent["run_id"] in cancelled_at))
        ):
            expected.add("cancelled")
        if status not in expected:
            rule = "signal_lost" if error.get("type") == "SignalTimeoutError" and run_id in signalled else None
            if run["workflow_name"] == "soak-retain":
                rule = "child_outcome_lost"
            violate(rule or "unexpected_outcome", run=run_id, status=status, code=code, error=error.get("type"))

    features = _check_features(audit, events, final, runs, every_body, per_run, started, violate)
    features.update(_check_quotas(events, final, runs, every_body, bodies, retries, retried_at, started, violate))
    features.update(_check_controls(events, final, runs, bodies, violate))
    faults = Counter(e["kind"] for e in events if e["e"] == "fault")
    takeovers = sum(1 for b in bodies if b.recoveries > 0)
    return {
        "runs": len(runs),
        "runs_started_by_driver": len(started),
        "statuses": dict(statuses),
        "bodies_entered": len(bodies),
        "takeovers_seen": takeovers,
        "fenced_bodies": sum(1 for b in bodies if b.how in FENCED_EXITS),
        "stale_bodies": len(stale),
        "bodies_without_exit": sum(1 for b in bodies if b.exit_t is None),
        "keys_with_fenced_overlap": fenced_overlap_keys,
        "step_executions": executions,
        "steps_stored_without_audit_line": stored_from_dump,
        "late_executions_refused_by_token": refused_late,
        "frozen_executions_after_cancel": frozen_late_after_cancel,
        "retried_executions_after_cancel": retried_after_cancel,
        "fifo_runs_checked": fifo_checked,
        "fifo_older_not_yet_in_line": fifo_not_in_line,
        "fifo_runs_by_priority": {str(p): n for p, n in sorted(priorities.items())},
        "max_holders_by_limit": {str(k): v for k, v in sorted(max_holders.items())},
        "faults": dict(sorted(faults.items())),
        "faults_total": sum(faults.values()),
        "cancels": len(cancels),
        "retries": sum(1 for e in events if e["e"] == "retry"),
        "signals": sum(signalled.values()),
        "duplicate_deliveries": sum(1 for e in events if e["e"] == "dup"),
        "unreadable_lines": bad_audit + bad_events,
        "features": features,
        "violations_by_rule": dict(Counter(v["rule"] for v in violations)),
        "violations": violations,
    }


def _check_features(
    audit: list[dict[str, Any]],
    events: list[dict[str, Any]],
    final: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    every_body: list[Body],
    per_run: dict[str, list[Body]],
    started: dict[str, dict[str, Any]],
    violate: Any,
) -> dict[str, Any]:
    """Judge the workload of #18: namespaces, times, schedules, retention; return its figures."""
    # -- namespaces (D10, D7) --------------------------------------------------------
    probes = Counter()
    for event in events:
        if event["e"] != "ns_probe":
            continue
        run_id, ns, op, outcome = event["run"], event["ns"], event["op"], event["outcome"]
        owner = runs.get(run_id, {}).get("namespace", event.get("owner"))
        if owner is None:
            continue
        if outcome == TRANSIENT_PROBE:
            probes["failed on a fault"] += 1
            continue
        got = event.get("got") or {}
        if ns == owner:
            probes["own reads"] += 1
            secret = started.get(run_id, {}).get("secret")
            if outcome != "returned" or (got.get("ns"), got.get("run"), got.get("secret")) != (owner, run_id, secret):
                violate("namespace_own_read", run=run_id, ns=ns, op=op, outcome=outcome, got=got)
            continue
        probes["other namespace"] += 1
        expected = "in_use" if op == "start" else "not_found"
        if outcome != expected:
            violate("namespace_leak", run=run_id, ns=ns, owner=owner, op=op, outcome=outcome, got=got,
                    text=event.get("text"))  # fmt: skip
        text = str(event.get("text", "")).lower()
        if "secret" in text or (owner != "default" and owner.lower() in text):
            violate("namespace_revealed", run=run_id, ns=ns, owner=owner, op=op, text=event.get("text"))
    tenant_runs = sum(1 for run in runs.values() if run.get("namespace", "default") != "default")
    for run_id, run in runs.items():
        parent = runs.get(run.get("parent_run_id") or "")
        if parent is not None and "namespace" in run and run["namespace"] != parent.get("namespace"):
            violate("child_namespace", run=run_id, ns=run["namespace"], parent=parent["run_id"],
                    parent_ns=parent.get("namespace"))  # fmt: skip

    # -- times on the database's clock (R8) --------------------------------------------
    times_checked = stepped_starts = 0
    for run_id, start in started.items():
        run = runs.get(run_id)
        if run is None or run.get("created_at") is None:
            continue
        times_checked += 1
        stepped_starts += "stepped" in start
        created = run["created_at"]
        if not start.get("t_req", created) - TIME_MARGIN <= created <= start["t"] + TIME_MARGIN:
            violate("times_off_clock", run=run_id, field="created_at", created_at=created, requested=start.get("t_req"),
                    committed_by=start["t"], stepped=start.get("stepped"))  # fmt: skip
        for name in ("admitted_at", "finished_at"):
            if run.get(name) is not None and run[name] < created - CLOCK_MARGIN:
                violate("times_off_clock", run=run_id, field=name, at=run[name], created_at=created,
                        stepped=start.get("stepped"))  # fmt: skip

    # -- schedules (S17, R8) ------------------------------------------------------------
    for firing in final.get("firings", []):  # every schedule's, the project's own included
        if firing.get("created_at") is not None and firing["created_at"] < firing["window_at"] - CLOCK_MARGIN:
            violate("schedule_early", schedule=firing.get("schedule__name"), window=firing["window_at"],
                    recorded_at=firing["created_at"], outcome=firing["outcome"])  # fmt: skip
    firings = [f for f in final.get("firings", []) if f.get("schedule__name") == SCHEDULE_NAME]
    per_window: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for firing in firings:
        per_window[round(firing["window_at"], 3)].append(firing)
    lateness: list[float] = []
    for window, records in per_window.items():
        if len(records) > 1:
            violate("schedule_duplicate", window=window, records=len(records))
        for firing in records:
            run = runs.get(firing.get("run_id") or "")
            if firing["outcome"] == "started" and run is not None:
                if run["created_at"] < window - CLOCK_MARGIN:
                    violate("schedule_early", window=window, run=run["run_id"], created_at=run["created_at"])
                lateness.append(run["created_at"] - window)
    fired = {w for w, records in per_window.items() if any(f["outcome"] in ("started", "existed") for f in records)}
    pause = next((e for e in events if e["e"] == "schedule_paused"), None)
    judged = missed = dropped = 0

    def judge_gap(first: float, last: float) -> int:
        """Judge windows ``first``..``last`` that fired nothing; return how many the policy dropped."""
        windows = round((last - first) / SCHEDULE_EVERY) + 1
        record = next((f for f in per_window.get(first, ()) if f["outcome"] == "missed"), None)
        if record is not None and record["created_at"] - last >= SCHEDULE_CATCH_UP * SCHEDULE_EVERY - 1:
            return windows  # the tick came later than the catch-up keeps: dropped as documented
        violate("schedule_window_missed", first=first, last=last, windows=windows,
                recorded=record["created_at"] if record else None)  # fmt: skip
        return 0

    if per_window and pause is not None:
        # Without the cursor (a driver before it was recorded), the last 5 s are left unjudged.
        end = pause["t"] - 5.0 if pause.get("cursor") is None else min(pause["t"], pause["cursor"] - SCHEDULE_EVERY)
        window, gap = min(per_window), None
        while window <= end:
            judged += 1
            if window not in fired:
                missed += 1
                gap = gap if gap is not None else window
            elif gap is not None:
                dropped += judge_gap(gap, round(window - SCHEDULE_EVERY, 3))
                gap = None
            window = round(window + SCHEDULE_EVERY, 3)
        if gap is not None:
            dropped += judge_gap(gap, round(window - SCHEDULE_EVERY, 3))

    # -- retention of children (O2, D7, R4) ---------------------------------------------
    seen: dict[str, set[str]] = defaultdict(set)
    for event in audit:
        if event["e"] == "child_outcome":
            seen[event["run"]].add(json.dumps(event.get("outcome"), sort_keys=True))
    purged_at: dict[str, float] = {}
    purges = Counter()
    for event in events:
        if event["e"] == "purge":
            purges[event["how"]] += event.get("deleted", 0)
            for run_id in event["runs"]:
                purged_at.setdefault(run_id, event["t"])
    children = {b.run for b in every_body if b.wf == "soak-rchild"}
    replayed = 0
    for parent, outcomes in seen.items():
        outcome = json.loads(next(iter(outcomes)))
        child = outcome.get("run") if isinstance(outcome, dict) else None
        if len(outcomes) > 1 or child not in children:
            violate("child_outcome_changed", run=parent, outcomes=sorted(outcomes))
        if child in purged_at and any(b.enter_t > purged_at[child] for b in per_run.get(parent, ())):
            replayed += 1
    return {
        "tenant_runs": tenant_runs,
        "namespace_probes": dict(sorted(probes.items())),
        "times_checked": times_checked,
        "stepped_starts": stepped_starts,
        "clock_steps": Counter(str(e["seconds"]) for e in events if e["e"] == "clock_step"),
        "schedule_windows_judged": judged,
        "schedule_windows_fired": len(fired),
        "schedule_windows_missed": missed,
        "schedule_windows_dropped_by_catch_up": dropped,
        "schedule_lateness_max": round(max(lateness), 3) if lateness else None,
        "retain_parents": sum(1 for r in runs.values() if r["workflow_name"] == "soak-retain"),
        "children_purged": dict(sorted(purges.items())),
        "parents_replayed_after_purge": replayed,
    }


def _check_quotas(
    events: list[dict[str, Any]],
    final: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    every_body: list[Body],
    bodies: list[Body],
    retries: dict[str, list[float]],
    retried_at: dict[str, float],
    started: dict[str, dict[str, Any]],
    violate: Any,
) -> dict[str, Any]:
    """Judge the shared quotas (X3, X4) and the queue TTL (X2); return their figures."""
    members: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in final.get("memberships", []):
        members[(row["quota"], row["key"])][row["run_id"]] = row

    def tenure_of(body: Body) -> int:
        return sum(1 for t in retries.get(body.run, ()) if t < body.enter_t)

    # -- holders per quota key at every instant (X3c, X3d) -------------------------------
    groups: dict[tuple[str, str], list[Body]] = defaultdict(list)
    for body in bodies:
        for name, key in body.quotas.items():
            groups[(name, key)].append(body)
    tenure = {(b.enter_t, b.run): tenure_of(b) for b in bodies}
    holders_max: dict[str, dict[str, int]] = defaultdict(dict)
    for (name, key), group in sorted(groups.items()):
        limit = QUOTA_LIMIT_OF.get(name, 1)
        held, when, who = _max_overlap([(b.enter_t, b.accepted_end, b.run) for b in group], tenure)
        holders_max[name][key] = held
        if held > limit:
            violate("quota_over_admission", quota=name, key=key, limit=limit, holders=held, at=when, runs=who)

    # -- fencing tokens per quota key (X3f, K1) -------------------------------------------
    key_tokens = {(k["workflow_name"], k["key"]): k["last_token"] for k in final.get("keys", [])}
    owners: dict[tuple[str, str], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    entries: dict[tuple[str, str], list[Body]] = defaultdict(list)
    for body in every_body:
        for name, token in body.qtokens.items():
            owners[(name, body.quotas.get(name, ""))][token].add(body.run)
            entries[(body.run, name)].append(body)
    for (name, key), group_runs in members.items():
        for run_id, row in group_runs.items():
            if row.get("fencing_token") is not None:
                owners[(name, key)][row["fencing_token"]].add(run_id)
    for (name, key), by_token in sorted(owners.items()):
        for token, owned in sorted(by_token.items()):
            if len(owned) > 1:
                violate("quota_token_reused", quota=name, key=key, token=token, runs=sorted(owned))
        seen = max(by_token, default=0)
        if final and key_tokens.get((f"quota:{name}", key), 0) < seen:
            violate("quota_token_behind_key", quota=name, key=key, stored=key_tokens.get((f"quota:{name}", key)),
                    seen=seen)  # fmt: skip
    # A takeover stamps new tokens, a retry's admission too (X3f, D9): a claim later
    # in its run's (tenure, recoveries) order enters with higher ones. A stale body (a
    # claim frozen before its body, thawed after a takeover: stale_write_accepted judges
    # it) is no later claim, even if it thawed after the run failed and was retried.
    held = {id(b) for b in bodies}
    for (run_id, name), group in entries.items():
        claims: dict[tuple[int, int], list[int]] = defaultdict(list)
        for body in (b for b in group if id(b) in held):
            claims[(tenure_of(body), body.recoveries)].append(body.qtokens[name])
        before: tuple[tuple[int, int], int] | None = None
        for claim, tokens in sorted(claims.items()):
            if before is not None and min(tokens) <= before[1]:
                violate("quota_token_decreased", run=run_id, quota=name, claim=list(claim), tokens=sorted(tokens),
                        earlier_claim=list(before[0]), earlier_token=before[1])  # fmt: skip
            before = (claim, max(tokens) if before is None else max(before[1], *tokens))

    # -- admission order within a quota key (X3d, X4b) ----------------------------------
    per_run: dict[str, list[Body]] = defaultdict(list)
    for body in bodies:
        per_run[body.run].append(body)

    def first_token(run_id: str, name: str, row: dict[str, Any]) -> int | None:
        """The quota token of the run's first admission, when known: its first
        body's, or the dump's for a run granted and never entered, neither
        taken over nor retried."""
        group = per_run.get(run_id)
        if group:
            first = min(group, key=lambda b: b.enter_t)
            ok = first.recoveries == 0 and first.enter_t < retried_at.get(run_id, float("inf"))
            return first.qtokens.get(name) if ok else None
        if (runs.get(run_id) or {}).get("recoveries") or run_id in retried_at:
            return None
        token = row.get("fencing_token")
        return int(token) if token is not None else None

    def held_until(run_id: str) -> float:
        """The last accepted write of the run's first tenure (its slot held from its first admission)."""
        return max((b.accepted_end for b in per_run.get(run_id, ()) if tenure_of(b) == 0), default=float("-inf"))

    fifo_checked = 0
    for (name, key), group_runs in sorted(members.items()):
        limit = QUOTA_LIMIT_OF.get(name, 1)
        first = {r: t for r, row in group_runs.items() if (t := first_token(r, name, row)) is not None}
        order = {r: (m["tag"], m["created_at"], r) for r, m in group_runs.items()}
        admitted_before = float("-inf")  # the latest admission statement of a lower token, database's clock
        for run_id in sorted(first, key=first.__getitem__):
            fifo_checked += 1
            t_req = (started.get(run_id) or {}).get("t_req", float("-inf"))
            # An older run was in line at this admission's read if its start had returned before this
            # run's start request, or before an admission that committed before this one locked the key.
            ahead = sorted(
                w for w in first
                if order[w] < order[run_id] and first[w] > first[run_id] and w in started
                and (started[w]["t"] < t_req or started[w]["t"] < admitted_before - CLOCK_MARGIN)
            )  # fmt: skip
            if ahead:
                group = per_run.get(run_id)
                entered = min(b.enter_t for b in group) if group else None
                holding = sorted(
                    h for h in first
                    if h != run_id and first[h] < first[run_id] and entered is not None and held_until(h) > entered
                )  # fmt: skip
                if len(holding) + len(ahead) + 1 > limit:
                    violate("quota_fifo", quota=name, key=key, limit=limit, run=run_id, token=first[run_id],
                            older=ahead[:10], older_tokens=[first[w] for w in ahead[:10]], holders=holding)  # fmt: skip
            admitted = (runs.get(run_id) or {}).get("admitted_at")
            if admitted is not None and run_id not in retried_at:  # its one admission (a takeover keeps it, D4)
                admitted_before = max(admitted_before, admitted)

    # -- fairness across sub-keys (X4) ----------------------------------------------------
    # A sub-key is idle at a start if each of its other runs started after it, or ended
    # longer before it than any freeze lasted (a settle frozen before its commit).
    freezes = [e["until"] - e["t"] for e in events if e["e"] == "fault" and e["kind"].startswith("freeze")]
    idle_gap = max(freezes, default=0.0) + 1.0
    fair_judged = fair_bursts = 0
    fair_ahead_max = fair_in_line_max = 0
    for (name, key), group_runs in sorted(members.items()):
        if len({m["sub_key"] for m in group_runs.values()}) < 2:
            continue
        limit = QUOTA_LIMIT_OF.get(name, 1)
        for run_id, row in group_runs.items():
            start = started.get(run_id)
            if start is None or "t_req" not in start:
                continue
            sub = row["sub_key"]
            idle = all(
                (o in started and started[o].get("t_req", 0.0) > start["t"])
                or ((runs.get(o) or {}).get("finished_at") or float("inf")) < start["t_req"] - idle_gap
                for o, m in group_runs.items()
                if o != run_id and m["sub_key"] == sub
            )
            if not idle:
                continue
            fair_judged += 1
            in_line: Counter[str] = Counter()
            ahead: dict[str, list[str]] = defaultdict(list)
            for other, m in group_runs.items():
                committed = started.get(other, {}).get("t", float("inf"))
                if m["sub_key"] == sub or other in retried_at or committed >= start["t_req"]:
                    continue  # its own sub-key's, a retried run (it keeps its tag, X4c), or not yet in line
                run = runs.get(other) or {}
                admitted, finished = run.get("admitted_at"), run.get("finished_at")
                after = start["t"] + CLOCK_MARGIN
                if (admitted if admitted is not None else finished if finished is not None else float("inf")) <= after:
                    continue  # admitted or ended before this run took its tag: not a waiter then
                in_line[m["sub_key"]] += 1
                if (m["tag"], m["created_at"], other) < (row["tag"], row["created_at"], run_id):
                    ahead[m["sub_key"]].append(other)
            fair_in_line_max = max(fair_in_line_max, *in_line.values(), 0)
            fair_bursts += any(n > limit + 1 for n in in_line.values())
            for other_sub, passed in sorted(ahead.items()):
                fair_ahead_max = max(fair_ahead_max, len(passed))
                windows = {r: (started[r].get("t_req", started[r]["t"]), started[r]["t"]) for r in passed}
                raced = sum(
                    1 for r in passed
                    if any(q != r and group_runs[q]["tag"] == group_runs[r]["tag"] and q in started
                           and started[q].get("t_req", started[q]["t"]) <= windows[r][1]
                           and windows[r][0] <= started[q]["t"]
                           for q, mq in group_runs.items() if mq["sub_key"] == other_sub)
                )  # fmt: skip
                bound = limit + 1 + raced
                if len(passed) > bound:
                    violate("quota_fair", quota=name, key=key, run=run_id, sub_key=sub, other=other_sub,
                            ahead=len(passed), bound=bound, tag=row["tag"],
                            runs=sorted(passed)[:10],
                            tags=sorted(group_runs[r]["tag"] for r in passed)[:10])  # fmt: skip

    # -- waiters ended by their queue TTL (X2) ------------------------------------------------
    entered_at: dict[str, list[float]] = defaultdict(list)
    for body in every_body:
        entered_at[body.run].append(body.enter_t)
    expired = 0
    lateness: list[float] = []
    for run_id, run in runs.items():
        error = run.get("error")
        if not isinstance(error, dict) or error.get("code") != TTL_CODE:
            continue
        expired += 1
        ttl = QUEUE_TTL_OF.get(run["workflow_name"])
        last_retry = max(retries.get(run_id, ()), default=float("-inf"))  # a retry puts it back in line (D9)
        entered = [t for t in entered_at.get(run_id, ()) if t > last_retry]
        waited = (run.get("finished_at") or 0.0) - run["created_at"]
        if entered or run.get("admitted_at") is not None:
            violate("ttl_admitted", run=run_id, workflow=run["workflow_name"], entered=entered[:3],
                    admitted_at=run.get("admitted_at"))  # fmt: skip
        elif ttl is None or waited < ttl - CLOCK_MARGIN:
            violate("ttl_wrong", run=run_id, workflow=run["workflow_name"], ttl=ttl, waited=round(waited, 3))
        else:
            lateness.append(waited - ttl)
    quota_runs = {r for group_runs in members.values() for r in group_runs}
    return {
        "quota_runs": len(quota_runs),
        "quota_runs_entered": sum(1 for r in quota_runs if r in per_run),
        "quota_holders_max": {name: dict(sorted(keys.items())) for name, keys in sorted(holders_max.items())},
        "quota_limits": dict(QUOTA_LIMIT_OF),
        "quota_fifo_checked": fifo_checked,
        "fair_waiters_judged": fair_judged,
        "fair_judged_in_a_burst": fair_bursts,
        "fair_ahead_max": fair_ahead_max,
        "fair_in_line_max": fair_in_line_max,
        "ttl_expired": expired,
        "ttl_lateness_max": round(max(lateness), 3) if lateness else None,
    }


def _check_controls(
    events: list[dict[str, Any]],
    final: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    bodies: list[Body],
    violate: Any,
) -> dict[str, Any]:
    """Judge the flow controls of #33: throttles (X6) and debounces (X7); return their figures."""
    # -- admissions per throttle interval (X6b) ----------------------------------------------
    # Each admission's time on the database's clock: a throttled run's admitted_at (written by
    # the transaction that records the admission), and the admission rows retention kept.
    admitted: dict[tuple[str, str], dict[tuple[str, float], float]] = defaultdict(dict)
    rates: dict[tuple[str, str], tuple[int, float]] = {}
    for run_id, run in runs.items():
        for name, key, limit, period in run.get("throttle_keys") or ():
            rates[(name, key)] = THROTTLE_OF.get(name, (int(limit), float(period)))
            if run.get("admitted_at") is not None:
                admitted[(name, key)][(run_id, round(run["admitted_at"], 6))] = run["admitted_at"]
    for row in final.get("throttle_admissions", []):
        pair = (row["throttle"], row["key"])
        admitted[pair][(row["run_id"], round(row["admitted_at"], 6))] = row["admitted_at"]
        rates.setdefault(pair, THROTTLE_OF.get(row["throttle"], (1, 0.0)))
    most_in_window: dict[str, int] = {}
    for pair, times in sorted(admitted.items()):
        limit, period = rates[pair]
        ordered = sorted(times.items(), key=lambda item: item[1])
        at = [t for _, t in ordered]
        most = 0
        for i, t in enumerate(at):
            j = bisect.bisect_left(at, t + period)  # the half-open interval [t, t + period)
            if j - i > most:
                most = j - i
                if most > limit:
                    violate("throttle_over_rate", throttle=pair[0], key=pair[1], limit=limit, period=period,
                            admissions=most, at=t, runs=[r for (r, _), _ in ordered[i:j]][:10])  # fmt: skip
        most_in_window[f"{pair[0]}:{pair[1]}"] = most

    # -- one run per debounce burst (X7, X7a) ---------------------------------------------------
    # A debounced start's line: ``start`` when it created its run, ``debounce_fold`` when it went
    # into an open one. A run's start time after a start S of its burst is at least
    # min(S's request + seconds, its creation + max_seconds) (the start read the database's clock
    # after its request; its creation's time is the creating start's reading), and at most
    # min(S's line + seconds, creation + max_seconds).
    into: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_dkey: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event["e"] == "debounce_fold" or (event["e"] == "start" and "dkey" in event):
            target = event.get("into", event["run"])
            into[target].append(event)
            by_dkey[event["dkey"]].append(event)
    first_enter: dict[str, float] = {}
    for body in bodies:
        first_enter[body.run] = min(first_enter.get(body.run, body.enter_t), body.enter_t)
    cancel_sent: dict[str, float] = {}
    for event in events:
        if event["e"] == "cancel":
            cancel_sent[event["run"]] = min(cancel_sent.get(event["run"], float("inf")), event.get("t_req", event["t"]))
    seconds, max_seconds = DEBOUNCE_SECONDS, DEBOUNCE_MAX_SECONDS

    def starts_by(run_id: str, before: float) -> tuple[float, float] | None:
        """The bounds (earliest, latest) of ``run_id``'s start time after its burst's starts
        whose line was written before ``before``; None if it has none or no row."""
        run = runs.get(run_id)
        done = [e for e in into.get(run_id, ()) if e["t"] < before]
        if run is None or not done:
            return None
        created, cap = run["created_at"], run["created_at"] + max_seconds  # its creating start's clock reading
        earliest = max(created, *(e["t_req"] for e in done)) + seconds
        return (min(earliest, cap), min(max(e["t"] for e in done) + seconds, cap))

    folds = splits_judged = 0
    for _dkey, starts in sorted(by_dkey.items()):
        starts.sort(key=lambda e: e["t_req"])
        for n, event in enumerate(starts):
            target = event.get("into", event["run"])
            folds += event["e"] == "debounce_fold"
            # A start that made a new run while an earlier run of its key was open: two runs for one burst.
            if event["e"] == "start":
                # When it decided: its run's creation on the database's clock, else its line.
                decided = min(event["t"], (runs.get(target) or {}).get("created_at") or float("inf"))
                for earlier in {e.get("into", e["run"]) for e in starts[:n]}:
                    bounds = starts_by(earlier, event["t_req"])
                    if bounds is None or earlier == target:
                        continue
                    splits_judged += 1
                    begun = first_enter.get(earlier, float("inf")) <= decided + CLOCK_MARGIN
                    cancelled = cancel_sent.get(earlier, float("inf")) <= event["t"]
                    if not begun and not cancelled and bounds[0] - CLOCK_MARGIN > decided:
                        violate("debounce_split", dkey=event["dkey"], open_run=earlier, new_run=target,
                                start=event["run"], open_until=bounds[0], at=decided)  # fmt: skip
            # A start that went into a run no longer open: begun, or its start time come.
            else:
                bounds = starts_by(target, event["t_req"])
                begun = first_enter.get(target, float("inf")) < event["t_req"] - CLOCK_MARGIN
                if begun or (bounds is not None and event["t_req"] > bounds[1] + CLOCK_MARGIN):
                    violate("debounce_fold_closed", dkey=event["dkey"], run=target, start=event["run"],
                            at=event["t_req"], began=first_enter.get(target),
                            starts_by=bounds[1] if bounds else None)  # fmt: skip
    # Each debounced body begins at its start time, with its burst's newest input: a start whose
    # line never came (it failed on a fault, perhaps after its commit) may be that input.
    failed_n: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for event in events:
        if event["e"] == "start_failed" and "dkey" in event:
            failed_n[event["dkey"]].append((event.get("t_req", event["t"]), event["n"]))
    runs_judged = 0
    for body in bodies:
        if body.run not in into or body.n is None:
            continue
        runs_judged += body.enter_t == first_enter[body.run]
        burst = sorted(into[body.run], key=lambda e: e["t_req"])
        newest = burst[-1]
        maybe = {newest["n"], *(n for t, n in failed_n.get(newest["dkey"], ()) if t > newest["t_req"])}
        if body.n not in maybe:
            violate("debounce_input", run=body.run, entered_with=body.n, newest=newest["n"], start=newest["run"])
        # Its start time: after the newest start's request, and no earlier than the quiet period
        # after the start before it (the newest may have folded in as a claim took the run, X7d).
        created = runs[body.run]["created_at"] if body.run in runs else float("-inf")
        cap = created + max_seconds if body.run in runs else float("inf")
        before = max(created, burst[-2]["t_req"] if len(burst) > 1 else newest["t_req"]) + seconds
        earliest = max(min(before, cap), newest["t_req"])
        if body.enter_t < earliest - CLOCK_MARGIN:
            violate("debounce_early", run=body.run, entered=body.enter_t, starts_at=earliest)
    per_run = [len(v) for v in into.values()]
    return {
        "throttled_runs": sum(1 for r in runs.values() if r.get("throttle_keys")),
        "throttle_admissions_judged": sum(len(v) for v in admitted.values()),
        "throttle_most_in_a_window": most_in_window,
        "throttle_limits": {name: list(rate) for name, rate in THROTTLE_OF.items()},
        "priority_runs": sum(1 for r in runs.values() if r.get("priority")),
        "debounce_starts": sum(per_run),
        "debounce_folds": folds,
        "debounce_runs": len(per_run),
        "debounce_starts_per_run_max": max(per_run, default=0),
        "debounce_split_pairs_judged": splits_judged,
        "debounce_bodies_judged": runs_judged,
    }


def render(summary: dict[str, Any]) -> str:
    """Return the summary as a plain-text table."""
    rows = [
        ("database", summary.get("db", "")),
        ("seed", summary.get("seed", "")),
        ("commit / load average (min, median, max)", f"{summary.get('commit') or '-'} / "
         + ", ".join(f"{v:.1f}" for v in (summary.get("load_average") or {}).values())),
        ("load / drain (s)", f"{summary.get('load_seconds', 0):.0f} / {summary.get('drain_seconds', 0):.0f}"),
        ("runs (started by the driver)", f"{summary['runs']} ({summary['runs_started_by_driver']})"),
        ("final statuses", ", ".join(f"{k} {v}" for k, v in sorted(summary["statuses"].items()))),
        ("bodies entered / takeovers", f"{summary['bodies_entered']} / {summary['takeovers_seen']}"),
        ("fenced / stale bodies / keys with a fenced overlap", f"{summary['fenced_bodies']} / "
         f"{summary.get('stale_bodies', 0)} / "
         f"{summary['keys_with_fenced_overlap']}"),
        ("step executions (late: refused by token / frozen past a cancel / retried past a cancel)",
         f"{summary['step_executions']} ({summary['late_executions_refused_by_token']} / "
         f"{summary['frozen_executions_after_cancel']} / {summary.get('retried_executions_after_cancel', 0)})"),
        ("highest holders per key, by limit", ", ".join(f"limit {k}: {v}"
         for k, v in summary["max_holders_by_limit"].items())),
        ("runs checked for FIFO (older runs not yet in line)", f"{summary['fifo_runs_checked']} "
         f"({summary.get('fifo_older_not_yet_in_line', 0)})"),
        ("cancels / retries / signals / duplicate deliveries",
         f"{summary['cancels']} / {summary['retries']} / {summary['signals']} / {summary['duplicate_deliveries']}"),
        ("faults injected", f"{summary['faults_total']}: " + ", ".join(f"{k} {v}"
         for k, v in summary["faults"].items())),
    ]  # fmt: skip
    features = summary.get("features") or {}
    if features.get("tenant_runs") or features.get("schedule_windows_judged") or features.get("retain_parents"):
        probes = features["namespace_probes"]
        rows += [
            ("tenant runs / probes of another namespace / own reads / failed on a fault",
             f"{features['tenant_runs']} / {probes.get('other namespace', 0)} / {probes.get('own reads', 0)} / "
             f"{probes.get('failed on a fault', 0)}"),
            ("runs whose times were checked (started on a stepped clock)",
             f"{features['times_checked']} ({features['stepped_starts']})"),
            ("clock steps (seconds: count)",
             ", ".join(f"{k}: {v}" for k, v in sorted(features["clock_steps"].items()))),
            ("schedule windows judged / fired / missed (latest run, s)",
             f"{features['schedule_windows_judged']} / {features['schedule_windows_fired']} / "
             f"{features['schedule_windows_missed']} ({features['schedule_lateness_max']})"),
            ("retain parents / children purged / parents replayed after the purge",
             f"{features['retain_parents']} / "
             + ", ".join(f"{k} {v}" for k, v in features["children_purged"].items()) + f" / "
             f"{features['parents_replayed_after_purge']}"),
        ]  # fmt: skip
    if features.get("quota_runs"):
        holders = "; ".join(
            f"{name} (limit {features['quota_limits'].get(name, '?')}): "
            + ", ".join(f"{key} {n}" for key, n in keys.items())
            for name, keys in features["quota_holders_max"].items()
        )
        rows += [
            ("quota runs (entered a body) / judged for their quota order",
             f"{features['quota_runs']} ({features['quota_runs_entered']}) / {features['quota_fifo_checked']}"),
            ("highest holders per quota key", holders or "-"),
            ("fair waiters judged (in a burst) / most runs ahead of one (most in line)",
             f"{features['fair_waiters_judged']} ({features['fair_judged_in_a_burst']}) / "
             f"{features['fair_ahead_max']} ({features['fair_in_line_max']})"),
            ("waiters ended by their queue TTL (latest past its TTL, s)",
             f"{features['ttl_expired']} ({features['ttl_lateness_max']})"),
        ]  # fmt: skip
    if features.get("throttled_runs") or features.get("debounce_starts") or features.get("priority_runs"):
        rows += [
            ("throttled runs / admissions judged / most in one window (limit, period s)",
             f"{features['throttled_runs']} / {features['throttle_admissions_judged']} / "
             + (", ".join(f"{k} {v}" for k, v in features["throttle_most_in_a_window"].items()) or "-")
             + " (" + ", ".join(f"{k}: {v[0]} per {v[1]:g}" for k, v in features["throttle_limits"].items()) + ")"),
            ("runs with a priority / judged for the queue order, by priority",
             f"{features['priority_runs']} / " + (", ".join(f"{k}: {v}" for k, v in
             (summary.get("fifo_runs_by_priority") or {}).items()) or "-")),
            ("debounced starts / folds / runs (most starts in one) / bodies judged",
             f"{features['debounce_starts']} / {features['debounce_folds']} / {features['debounce_runs']} "
             f"({features['debounce_starts_per_run_max']}) / {features['debounce_bodies_judged']}"),
        ]  # fmt: skip
    rows.append(("violations", sum(summary["violations_by_rule"].values()) or "none"))
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    for violation in summary["violations"][:20]:
        lines.append(f"  VIOLATION {json.dumps(violation, default=str)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Check the folder given; print the table; exit 1 if anything was violated."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m soak.check FOLDER", file=sys.stderr)
        return 2
    report = check(Path(args[0]))
    print(render({"db": "?", "seed": "?", **report}))
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
