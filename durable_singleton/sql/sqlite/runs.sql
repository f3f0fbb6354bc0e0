-- The SQLite room's statements (durable_singleton.stores.sqlite), one named block
-- each, loaded by name (durable_singleton.sql.statement(name, "sqlite")). Blocks
-- as in sql/postgresql/runs.sql. SQLite has no row locks: a single write
-- statement outside a transaction takes the database's write lock before it
-- reads anything, as BEGIN IMMEDIATE does (check E010), and is its own
-- transaction. A grant's token is written to its run first and the key's
-- counter moved past it by the next statement (bump_token): a key whose counter
-- is behind a holder's token (between the two, or after a crash between them)
-- is left to the ORM path, whose key lock (lock_key) moves it first (K1).
-- The clock: ds_now(seconds), the store's clock (querysets.sqlite_now, the
-- file's host's UTC time in microseconds) plus seconds, as Django writes a
-- time ('YYYY-MM-DD HH:MM:SS.ffffff'), read as the statement runs, after the
-- write lock (R5, R5a, R8).

-- fragment: run_columns
-- The run table's columns a RunRecord is built from, in stores.pg.COLUMNS' order (R1).
r.run_id, r.workflow_name, r.workflow_version, r.namespace, r.status, r.input,
r.created_at, r.updated_at, r.output, r.error, r.tags,
r.singleton_key, r.singleton_limit, r.singleton_slot, r.singleton_tracked,
r.wake_at, r.lease_owner, r.lease_expires_at, r.started_at, r.finished_at, r.admitted_at,
r.attempts, r.recoveries, r.parent_run_id, r.park_reason, r.cancel_requested,
r.deadline_at, r.fencing_token, r.step_count, r.not_before, r.quota_slot, r.trace_parent,
r.quota_keys, r.debounce_key, r.debounce_until, r.throttle_keys, r.priority

-- fragment: returned_columns
-- The same columns in a RETURNING clause, which names them without the table's alias (SQLite).
run_id, workflow_name, workflow_version, namespace, status, input,
created_at, updated_at, output, error, tags,
singleton_key, singleton_limit, singleton_slot, singleton_tracked,
wake_at, lease_owner, lease_expires_at, started_at, finished_at, admitted_at,
attempts, recoveries, parent_run_id, park_reason, cancel_requested,
deadline_at, fencing_token, step_count, not_before, quota_slot, trace_parent,
quota_keys, debounce_key, debounce_until, throttle_keys, priority

-- fragment: finish_owned
-- The owner's compare-and-set of a settle: its lease unexpired by the clock after the lock (R5a).
r.status = 'running'
AND r.lease_owner = %(owner)s
AND r.lease_expires_at > ds_now(0)

-- name: take
-- The confirmation claim of a run without a key (holder 0) or of a holder (holder 1, S6): its
-- lease, one compare-and-set on the run as its turn read it (DjangoStore._as_read, R5a, R6).
UPDATE durable_singleton_run AS r
SET status = 'running',
    lease_owner = %(owner)s,
    lease_expires_at = ds_now(%(lease)s),         -- the lease starts after the write lock (R5)
    wake_at = NULL,                               -- a running run has no wake
    attempts = r.attempts + 1,
    recoveries = r.recoveries + %(recovered)s,    -- 1 when this claim recovers the run (D4)
    started_at = COALESCE(r.started_at, ds_now(0)),
    updated_at = ds_now(0),
    singleton_slot = CASE WHEN %(holder)s THEN 'holder' ELSE r.singleton_slot END,
    singleton_tracked = r.singleton_tracked OR %(holder)s
WHERE r.run_id = %(run_id)s
  AND r.status = %(status)s
  AND r.attempts = %(attempts)s
  AND r.cancel_requested = %(cancel)s
  AND (
      r.status <> 'running'
      -- a running run is taken over only from the owner read, once its lease expired
      OR (r.lease_owner IS %(read_owner)s AND r.lease_expires_at <= ds_now(0))
  )
RETURNING {{returned_columns}}

-- name: settle
-- The settle of a run without a key and without quotas: the owner's compare-and-set alone (S7, R5a).
UPDATE durable_singleton_run AS r
SET status = %(final)s,
    output = %(output)s,
    error = %(error)s,
    singleton_slot = NULL,
    singleton_tracked = FALSE,
    quota_slot = NULL,
    lease_owner = NULL,
    lease_expires_at = NULL,
    wake_at = NULL,
    finished_at = COALESCE(%(finished_at)s, ds_now(0)),
    updated_at = ds_now(0)
WHERE r.run_id = %(run_id)s
  AND {{finish_owned}}
RETURNING {{returned_columns}}

-- fragment: holders_token
-- The highest token a holder of the key {{wf}}, {{key}} was given (K1), NULL if none.
(SELECT max(h.fencing_token)
 FROM durable_singleton_run h
 WHERE h.workflow_name = {{wf}}
   AND h.singleton_key = {{key}}
   AND h.singleton_slot = 'holder')

-- fragment: key_queue
-- The CTEs every grant reads under the write lock (S5, S12, K1, K2, X2): the key's row with its
-- limit in force (the defaults of a new row when it has none), the untracked holders of an
-- older release, the holders and the front of the queue (at most twice the limit rows, one
-- read of ds_run_queue_idx; a waiter past its TTL left out), the free slots, whether the key's
-- counter is behind a holder's token (then nothing is written: the ORM path moves it), and the
-- waiters in admission order. Arguments: wf, key, declared, ttl (SQL of the values); now, the
-- clock, and ttl_since, the clock less ttl (the oldest created_at a waiter keeps its place
-- with); skip_legacy, skip_front: a clause leaving out the run the statement settles, or nothing.
key_row AS MATERIALIZED (                      -- the key's row with its limit in force (K2)
    SELECT COALESCE(max(k0.last_token), 0) AS last_token,
           COALESCE(max(k0.paused), FALSE) AS paused,
           {{limit_in_force: declared = {{declared}}; override = max(k0.limit_override)}} AS lim
    FROM durable_singleton_singletonkey k0
    WHERE k0.workflow_name = {{wf}} AND k0.key = {{key}}
),
legacy_holders AS MATERIALIZED (               -- an older release's untracked holders (S12)
    SELECT count(*) AS n
    FROM durable_singleton_run l0
    WHERE l0.workflow_name = {{wf}} AND l0.singleton_key = {{key}}
      AND {{legacy_holder: run = l0}}
      {{skip_legacy}}
),
front AS MATERIALIZED (                        -- the holders and the queue's front, in its order (S5, X5)
    SELECT q0.run_id, q0.status, q0.singleton_slot, q0.quota_slot, q0.created_at, q0.priority,
           {{holds_slot: run = q0}} AS holds
    FROM durable_singleton_run q0
    WHERE q0.workflow_name = {{wf}} AND q0.singleton_key = {{key}}
      AND q0.singleton_slot IS NOT NULL
      AND (q0.singleton_slot = 'holder' OR q0.not_before IS NULL OR q0.not_before <= {{now}})
      {{skip_front}}
      AND (q0.singleton_slot <> 'waiter' OR {{ttl}} IS NULL OR q0.created_at > {{ttl_since}})  -- X2
    ORDER BY q0.singleton_slot, q0.priority DESC, q0.created_at, q0.run_id   -- S5, X8: QUEUE_ORDER
    LIMIT (SELECT 2 * k.lim FROM key_row k)
),
key_slots AS MATERIALIZED (                    -- the key's free slots (S5, K2), its counter behind (K1)
    SELECT k.last_token, k.lim,
           {{free_slots: lim = k.lim; holders = (SELECT count(*) FROM front q WHERE q.holds) + (SELECT lg.n FROM legacy_holders lg); paused = k.paused}} AS free,
           COALESCE({{holders_token: wf = {{wf}}; key = {{key}}}} > k.last_token, FALSE) AS behind
    FROM key_row k
),
waiters AS MATERIALIZED (                      -- the waiters of the front in admission order (S5, X8)
    SELECT q.run_id, q.status, q.quota_slot, row_number() OVER (ORDER BY q.priority DESC, q.created_at, q.run_id) AS pos
    FROM front q
    WHERE +q.singleton_slot = 'waiter'           -- +: one pass over front, no automatic index
)

-- name: claim
-- A turn's claim without a read first (S4, S5, S6, S9, K1, X5): a parked, due run without a
-- key and without quotas, not cancelled, takes its lease (kind take); a tracked waiter of a
-- declared workflow (its limit in the limits parameter, JSON by workflow name) is admitted
-- within its key's free slots with the next token (admit), the other waiters within them
-- granted their slots (grant), or it is parked with its retry delay (park: front seconds
-- among the first limit waiters, else backlog seconds, S5 step 5, S8a). Each write a
-- compare-and-set on the run as read (R5a, R6). Nothing is written for any other run, when a
-- waiter within the free slots carries quotas (X3h) or the key's counter is behind: the
-- store reads the run and decides on the ORM path.
WITH
claimant AS MATERIALIZED (                     -- the turn's run, if this statement may claim it
    SELECT c0.run_id, c0.workflow_name AS wf, c0.singleton_key AS key, c0.status,
           (SELECT j.value FROM json_each(%(limits)s) j WHERE j.key = c0.workflow_name) AS declared,
           (SELECT j.value FROM json_each(%(ttls)s) j WHERE j.key = c0.workflow_name) AS ttl
    FROM durable_singleton_run c0
    WHERE c0.run_id = %(run_id)s
      AND c0.status IN ('pending', 'suspended', 'blocked')   -- parked: not running, not ended
      AND NOT c0.cancel_requested                            -- R6: a cancel is the ORM path's
      AND (c0.not_before IS NULL OR c0.not_before <= ds_now(0))  -- X5: due
      AND c0.quota_slot IS NULL                              -- X3i: quotas are the ORM path's
      AND (c0.singleton_key IS NULL OR (c0.singleton_tracked AND c0.singleton_slot = 'waiter'))
),
{{key_queue:
    wf = (SELECT c.wf FROM claimant c); key = (SELECT c.key FROM claimant c);
    declared = (SELECT c.declared FROM claimant c); ttl = (SELECT c.ttl FROM claimant c);
    now = ds_now(0); ttl_since = ds_now(-(SELECT c.ttl FROM claimant c));
    skip_legacy = ; skip_front = }},
within_slots AS MATERIALIZED (                 -- the waiters within the free slots (S5)
    SELECT w.run_id, w.status, w.quota_slot, w.pos
    FROM waiters w, key_slots s
    WHERE w.pos <= s.free
),
deciding AS MATERIALIZED (                     -- a waiter this statement decides for
    SELECT c.run_id, c.status
    FROM claimant c, key_slots s
    WHERE c.key IS NOT NULL
      AND c.declared IS NOT NULL               -- a workflow this process declares
      AND NOT s.behind                         -- K1: the key's counter is past every token
      AND NOT EXISTS (SELECT 1 FROM within_slots sg WHERE sg.quota_slot IS NOT NULL)  -- X3h
),
writes AS MATERIALIZED (                       -- each write, with its token (K1)
    SELECT c.run_id, c.status, NULL AS token, 'take' AS kind
    FROM claimant c
    WHERE c.key IS NULL
    UNION ALL
    SELECT sg.run_id, sg.status, s.last_token + sg.pos,
           CASE WHEN sg.run_id = %(run_id)s THEN 'admit' ELSE 'grant' END
    FROM within_slots sg, key_slots s
    WHERE EXISTS (SELECT 1 FROM deciding)
    UNION ALL
    SELECT d.run_id, d.status, NULL,
           CASE WHEN EXISTS (SELECT 1 FROM waiters w, key_slots s WHERE +w.run_id = d.run_id AND w.pos <= s.lim)  -- +: one probe, no automatic index
                THEN 'park_front' ELSE 'park_backlog' END
    FROM deciding d
    WHERE d.run_id NOT IN (SELECT sg.run_id FROM within_slots sg)
)
UPDATE durable_singleton_run AS r
SET status = CASE w.kind WHEN 'grant' THEN r.status WHEN 'park_front' THEN 'suspended'
                         WHEN 'park_backlog' THEN 'suspended' ELSE 'running' END,
    lease_owner = CASE WHEN w.kind IN ('take', 'admit') THEN %(owner)s
                       WHEN w.kind = 'grant' THEN r.lease_owner END,
    lease_expires_at = CASE WHEN w.kind IN ('take', 'admit') THEN ds_now(%(lease)s)   -- R5
                            WHEN w.kind = 'grant' THEN r.lease_expires_at END,
    wake_at = CASE w.kind WHEN 'grant' THEN ds_now(%(redelivery)s)   -- a grant's turn, redelivered (S7a)
                          WHEN 'park_front' THEN ds_now(%(front)s)   -- S5 step 5
                          WHEN 'park_backlog' THEN ds_now(%(backlog)s) END,
    attempts = CASE WHEN w.kind = 'grant' THEN r.attempts ELSE r.attempts + 1 END,
    started_at = CASE WHEN w.kind IN ('take', 'admit') THEN COALESCE(r.started_at, ds_now(0)) ELSE r.started_at END,
    singleton_slot = CASE WHEN w.kind IN ('admit', 'grant') THEN 'holder' ELSE r.singleton_slot END,
    singleton_tracked = CASE WHEN w.kind IN ('admit', 'grant') THEN TRUE ELSE r.singleton_tracked END,
    fencing_token = COALESCE(w.token, r.fencing_token),
    admitted_at = CASE WHEN w.kind IN ('admit', 'grant') THEN ds_now(0) ELSE r.admitted_at END,
    park_reason = CASE WHEN w.kind IN ('park_front', 'park_backlog') THEN 'singleton' ELSE r.park_reason END,
    updated_at = ds_now(0)
FROM writes w
WHERE r.run_id = w.run_id
  AND r.status = w.status                      -- a compare-and-set on the run as read (R5a)
  AND (   (w.kind = 'take' AND NOT r.cancel_requested)                   -- R6
       OR (w.kind <> 'take' AND NOT r.cancel_requested                   -- R6
           AND r.singleton_slot = 'waiter' AND r.quota_slot IS NULL))
  -- Each test of r sits beside a test of w, never alone: a condition on r alone lets SQLite
  -- (3.38 and later, once ANALYZE has run) build a Bloom filter of r before the first row,
  -- a read of every run of the table at every claim (S5, issue 32 item 3).
RETURNING {{returned_columns}}

-- name: finish
-- The handoff of a run with a key and without quotas (S7, S12, R5a, K1): settle it by its
-- owner's compare-and-set and grant its key's freed slots to the oldest waiters, in one UPDATE
-- of the run and its grants (the run's row: run_id = the parameter; the others: the grants);
-- then bump_token. Nothing is written when a waiter within the free slots carries quotas (its
-- own claim decides, X3h) or the key's counter is behind: the ORM path settles that run.
WITH
settling AS MATERIALIZED (                     -- the run, still its owner's with its lease unexpired (R5a)
    SELECT r.run_id
    FROM durable_singleton_run r
    WHERE r.run_id = %(run_id)s
      AND {{finish_owned}}
),
{{key_queue:
    wf = %(wf)s; key = %(key)s; declared = %(declared)s; ttl = %(ttl)s;
    now = ds_now(0); ttl_since = ds_now(-%(ttl)s);
    skip_legacy = AND l0.run_id <> %(run_id)s;
    skip_front = AND q0.run_id <> %(run_id)s}},
within_slots AS MATERIALIZED (                 -- the waiters within the free slots (S5)
    SELECT w.run_id, w.status, w.quota_slot, w.pos
    FROM waiters w, key_slots c
    WHERE w.pos <= c.free AND EXISTS (SELECT 1 FROM settling)
),
writes AS MATERIALIZED (                       -- the settle, then each grant with the next token (K1)
    SELECT s.run_id, NULL AS status, NULL AS token
    FROM settling s
    UNION ALL
    SELECT sg.run_id, sg.status, c.last_token + sg.pos
    FROM within_slots sg, key_slots c
)
UPDATE durable_singleton_run AS r
SET status = CASE WHEN w.token IS NULL THEN %(final)s ELSE r.status END,
    output = CASE WHEN w.token IS NULL THEN %(output)s ELSE r.output END,
    error = CASE WHEN w.token IS NULL THEN %(error)s ELSE r.error END,
    singleton_slot = CASE WHEN w.token IS NULL THEN NULL ELSE 'holder' END,  -- the slot freed, or granted
    singleton_tracked = w.token IS NOT NULL,
    quota_slot = NULL,
    lease_owner = NULL,
    lease_expires_at = NULL,
    wake_at = CASE WHEN w.token IS NULL THEN NULL ELSE ds_now(%(redelivery)s) END,  -- a grant's turn (S7a)
    fencing_token = COALESCE(w.token, r.fencing_token),
    admitted_at = CASE WHEN w.token IS NULL THEN r.admitted_at ELSE ds_now(0) END,
    finished_at = CASE WHEN w.token IS NULL THEN COALESCE(%(finished_at)s, ds_now(0)) ELSE r.finished_at END,
    updated_at = ds_now(0)
FROM writes w
WHERE r.run_id = w.run_id
  AND (w.token IS NULL                         -- the settle: settling read it under the write lock
       OR (r.status = w.status                 -- a grant: a compare-and-set on the waiter as read (R5a)
           AND r.singleton_slot = 'waiter'
           AND NOT r.cancel_requested
           AND r.quota_slot IS NULL))
  AND NOT (SELECT c.behind FROM key_slots c)   -- K1: the ORM path moves a counter behind first
  AND NOT EXISTS (SELECT 1 FROM within_slots sg WHERE sg.quota_slot IS NOT NULL)  -- X3h
RETURNING {{returned_columns}}

-- name: bump_token
-- The key's token counter moves past the tokens a claim or a handoff granted (K1), its row
-- created if missing: the statement after theirs.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
VALUES (%(now)s, %(now)s, %(wf)s, %(key)s, %(token)s, FALSE)
ON CONFLICT (workflow_name, key) DO UPDATE SET last_token = max(last_token, excluded.last_token)

-- name: lock_key
-- The key lock of the ORM path (DjangoStore.lock_key, S13a): one upsert that takes the write
-- lock, creates the row if missing and returns it, its counter moved past every holder's
-- token first (K1: a claim or a handoff of this room that ended before its bump_token).
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
VALUES (%(now)s, %(now)s, %(wf)s, %(key)s, COALESCE({{holders_token: wf = %(wf)s; key = %(key)s}}, 0), FALSE)
ON CONFLICT (workflow_name, key) DO UPDATE
SET last_token = max(last_token, COALESCE({{holders_token: wf = %(wf)s; key = %(key)s}}, 0))
RETURNING id, last_token, paused, limit_override
