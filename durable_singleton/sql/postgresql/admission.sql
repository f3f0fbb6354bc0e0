-- The PostgreSQL fast path's admissions of a singleton key's waiters
-- (durable_singleton.stores.pg): the rule fragments every grant shares (the key's
-- queue front, its limit in force and free slots, who holds a slot, the grants
-- and their tokens) and the admission of a waiter by its own turn. Blocks as in
-- runs.sql; a fragment that takes arguments writes {{<arg>}} where each goes
-- and is spliced as {{<name>: <arg> = <SQL>; ...}}.

-- fragment: limit_in_force
-- The limit in force (K2): the override, else the declared limit, never below 1:
-- admission.limit_in_force_sql_text(declared, override).
(CASE WHEN COALESCE({{override}}, {{declared}}, 1) < 1 THEN 1 ELSE COALESCE({{override}}, {{declared}}, 1) END)

-- fragment: free_slots
-- A key's free slots (S5, K2): none while paused, else limit - holders, never negative (each
-- argument bracketed: holders may be a sum, S12):
-- admission.free_slots_sql_text(lim, holders, paused).
(CASE WHEN COALESCE({{paused}}, FALSE) THEN 0 WHEN ({{lim}}) > ({{holders}}) THEN ({{lim}}) - ({{holders}}) ELSE 0 END)

-- fragment: holds_slot
-- The run {{run}} holds a slot of its key (S5, S12): a tracked holder not ended, or an untracked
-- run of an older release that runs or is parked: admission.holds_slot_sql_text(run).
(({{run}}.singleton_key IS NOT NULL AND {{run}}.singleton_slot = 'holder' AND {{run}}.status IN ('pending', 'running', 'suspended', 'blocked')) OR ({{run}}.singleton_key IS NOT NULL AND NOT {{run}}.singleton_tracked AND {{run}}.status IN ('running', 'suspended', 'blocked')))

-- fragment: legacy_holder
-- The run {{run}} is an older release's untracked holder (S12): admission.legacy_holder_sql_text(run).
({{run}}.singleton_key IS NOT NULL AND NOT {{run}}.singleton_tracked AND {{run}}.status IN ('running', 'suspended', 'blocked'))

-- fragment: queue_ttl_expired
-- The waiter {{run}} is past its workflow's queue_ttl ({{ttl}} seconds, NULL: none) by the
-- database's clock as the row is read (X2): admission.queue_ttl_expired_sql_text.
COALESCE({{run}}.created_at <= CLOCK_TIMESTAMP() - make_interval(secs => {{ttl}}::float8), FALSE)

-- fragment: key_queue
-- The CTEs every grant reads under the key's lock (S5, S12, K2, X2): the key's row with its
-- limit in force, the untracked holders of an older release, the holders and the front of the
-- queue (at most twice the limit rows, one read of ds_run_queue_idx; a waiter past its TTL is
-- left out, so takes no row of the LIMIT), the free slots, and the waiters in admission order.
-- Arguments: wf, key, declared (the declared limit), ttl: SQL of the values (parameters, or
-- read from the claimant's row); skip_legacy, skip_front: a clause leaving out the run the
-- statement settles, or nothing.
key_row AS (                                   -- the key's row with its limit in force (K2)
    SELECT k0.id, k0.last_token, k0.paused,
           {{limit_in_force: declared = {{declared}}; override = k0.limit_override}} AS lim
    FROM durable_singleton_singletonkey k0
    WHERE k0.workflow_name = {{wf}} AND k0.key = {{key}}
),
legacy_holders AS (                            -- an older release's untracked holders (S12)
    SELECT count(*) AS n
    FROM durable_singleton_run l0
    WHERE l0.workflow_name = {{wf}} AND l0.singleton_key = {{key}}
      AND {{legacy_holder: run = l0}}
      {{skip_legacy}}
),
front AS (                                     -- the holders and the queue's front, in its order (S5, X5)
    SELECT q0.run_id, q0.status, q0.singleton_slot, q0.quota_slot, q0.created_at, q0.priority,
           {{holds_slot: run = q0}} AS holds
    FROM durable_singleton_run q0
    WHERE q0.workflow_name = {{wf}} AND q0.singleton_key = {{key}}
      AND {{queue_front}}
      {{skip_front}}
      AND (q0.singleton_slot <> 'waiter' OR NOT {{queue_ttl_expired: run = q0; ttl = {{ttl}}}})  -- X2
    ORDER BY {{queue_order}}
    LIMIT (SELECT 2 * k.lim::bigint FROM key_row k)
),
key_slots AS (                                 -- the key's free slots (S5, K2)
    SELECT k.id, k.last_token, k.lim,
           {{free_slots: lim = k.lim; holders = (SELECT count(*) FROM front q WHERE q.holds) + (SELECT lg.n FROM legacy_holders lg); paused = k.paused}} AS free
    FROM key_row k
),
waiters AS (                                   -- the waiters of the front in admission order (S5, X8)
    SELECT q.run_id, q.status, q.quota_slot, row_number() OVER (ORDER BY {{queue_place: run = q}}) AS pos
    FROM front q
    WHERE q.singleton_slot = 'waiter'
)

-- fragment: singleton_grants
-- The singleton grants (S5, X3h, K1): the waiters within the key's free slots when {{when}}
-- holds; a slot and the next token go to those {{takes}} names (the claimant, those without
-- quotas, the carriers a handoff admits); the others keep their place and are sent a turn.
-- {{carriers}}: the CTEs of a quota handoff read between the two (or nothing).
within_slots AS (                              -- the waiters within the free slots (S5)
    SELECT w.run_id, w.status, w.quota_slot, w.pos
    FROM waiters w, key_slots c
    WHERE w.pos <= c.free AND {{when}}
),
{{carriers}}
grants AS (                                    -- each grant with the next token, in admission order (K1)
    SELECT sg.run_id, sg.status, c.last_token + row_number() OVER (ORDER BY sg.pos) AS token
    FROM within_slots sg, key_slots c
    WHERE {{takes}}
)

-- fragment: grant_set
-- A grant's write: a tracked holder with its token, admitted by the database's clock (S5, K1, R8).
singleton_slot = 'holder',
singleton_tracked = TRUE,
fencing_token = g.token,
admitted_at = CLOCK_TIMESTAMP()

-- fragment: grant_cas
-- Each grant is a compare-and-set on the waiter as read (S7, K1, R5a); a waiter that carries
-- quotas gets no slot here: its own claim decides under the locks of all its limits (X3h).
r.run_id = g.run_id
AND r.status = g.status
AND r.singleton_slot = 'waiter'
AND NOT r.cancel_requested
AND r.quota_slot IS NULL

-- fragment: key_tokens
-- The key's token counter moves past every token the grants handed out (K1).
key_tokens AS (
    UPDATE durable_singleton_singletonkey k1
    SET last_token = c.last_token + (SELECT count(*) FROM grants g)
    FROM key_slots c
    WHERE k1.id = c.id AND EXISTS (SELECT 1 FROM grants g)
)

-- fragment: turn_order
-- The waiters sent a turn as they are (turns: run id and its place), each once at its first
-- place, those granted a slot left out (X3h): the rest of a select list, its place as two
-- columns (the singleton key's front first, then each quota key's in lock order).
t1.o1, t1.o2
FROM durable_singleton_run r
JOIN (
    SELECT DISTINCT ON (tr.run_id) tr.run_id, tr.o1, tr.o2
    FROM turns tr
    ORDER BY tr.run_id, tr.o1, tr.o2
) t1 ON t1.run_id = r.run_id
WHERE r.run_id NOT IN (SELECT g.run_id FROM grants g)

-- fragment: waiter_admission
-- The admission of a waiter by its turn (S5, S8a, K1), under the key's lock, the claimant as
-- read in {{claimant}} (nothing written when it is not: the ORM path decides), the values
-- wf, key, declared, ttl, status, attempts from parameters or its row. The free slots go to
-- the oldest waiters; the claimant takes its lease as a holder if it is among them, else it is
-- parked with its retry wake (the front delay among the first limit waiters, else the
-- backlog's, S5 step 5, S8a). The rows: 0 its lease, 1 the other grants, 2 it parked,
-- 3 the waiters sent a turn as they are (X3h).
WITH claimant AS (
    {{claimant}}
),
{{key_queue: wf = {{wf}}; key = {{key}}; declared = {{declared}}; ttl = {{ttl}}; skip_legacy = ; skip_front = }},
{{singleton_grants: when = EXISTS (SELECT 1 FROM claimant); carriers = ; takes = sg.run_id = %(run_id)s OR sg.quota_slot IS NULL}},
claimant_lease AS (                            -- the claimant granted: its lease as a holder (R5, R6)
    UPDATE durable_singleton_run r
    SET {{take_set}},
        {{grant_set}}
    FROM grants g
    WHERE g.run_id = %(run_id)s
      AND {{grant_cas}}
      AND r.attempts = {{attempts}}            -- R5a: the attempts its turn read
    RETURNING {{run_columns}}
),
other_grants AS (                              -- the other grants, each sent its turn after the redelivery delay
    UPDATE durable_singleton_run r
    SET {{grant_set}},
        wake_at = CLOCK_TIMESTAMP() + make_interval(secs => %(redelivery)s::float8),
        updated_at = STATEMENT_TIMESTAMP()
    FROM grants g
    WHERE g.run_id <> %(run_id)s
      AND {{grant_cas}}
    RETURNING {{run_columns}}
),
claimant_parked AS (                           -- the claimant not granted: parked with its retry wake (S5 step 5, S8a)
    UPDATE durable_singleton_run r
    SET status = 'suspended',
        attempts = r.attempts + 1,
        wake_at = CLOCK_TIMESTAMP() + make_interval(secs => CASE WHEN EXISTS
            (SELECT 1 FROM waiters w, key_slots c WHERE w.run_id = %(run_id)s AND w.pos <= c.lim)
            THEN %(front)s::float8 ELSE %(backlog)s::float8 END),
        lease_owner = NULL,
        lease_expires_at = NULL,
        park_reason = 'singleton',
        updated_at = STATEMENT_TIMESTAMP()
    WHERE r.run_id = %(run_id)s
      AND r.status = {{status}}                -- R5a: as its turn read it
      AND r.attempts = {{attempts}}
      AND NOT r.cancel_requested
      AND EXISTS (SELECT 1 FROM claimant)
      AND NOT EXISTS (SELECT 1 FROM grants g WHERE g.run_id = %(run_id)s)
    RETURNING {{run_columns}}
),
{{key_tokens}},
turns AS (                                     -- the waiters within the slots that carry quotas: sent a turn (X3h)
    SELECT sg.run_id, 0 AS o1, sg.pos AS o2
    FROM within_slots sg
    WHERE sg.quota_slot IS NOT NULL
)
SELECT 0, {{run_columns}}, 0, 0 FROM claimant_lease r
UNION ALL SELECT 1, {{run_columns}}, 0, 0 FROM other_grants r
UNION ALL SELECT 2, {{run_columns}}, 0, 0 FROM claimant_parked r
UNION ALL SELECT 3, {{run_columns}}, {{turn_order}}

-- name: admit
-- The admission of a waiter whose turn read it (S5, S8a, K1): the claimant still a tracked
-- waiter with the status, attempts and cancel flag the turn read (R5a), the values parameters.
{{waiter_admission:
    claimant = SELECT r.run_id
               FROM durable_singleton_run r
               WHERE r.run_id = %(run_id)s
                 AND r.status = %(status)s
                 AND r.attempts = %(attempts)s
                 AND NOT r.cancel_requested
                 AND r.singleton_slot = 'waiter' AND r.singleton_tracked;
    wf = %(wf)s; key = %(key)s; declared = %(declared)s; ttl = %(ttl)s;
    status = %(status)s; attempts = %(attempts)s}}

-- name: claim_admit
-- The admission of a claim's candidate waiter (S5, S13, X3i) whose key row this transaction
-- locked and recorded (claim_lock_key), its values read from its row after the lock (R5a).
{{waiter_admission:
    claimant = SELECT r.run_id, r.status, r.attempts, r.workflow_name AS wf, r.singleton_key AS key,
                      (%(limits)s::jsonb ->> r.workflow_name)::integer AS declared,
                      (%(ttls)s::jsonb ->> r.workflow_name)::float8 AS ttl
               FROM durable_singleton_run r
               WHERE {{keyed_candidate}}
                 AND r.quota_slot IS NULL      -- X3i: a quota waiter takes claim_quota_admit
                 AND EXISTS (                  -- S13: only under the key lock claim_lock_key recorded
                     SELECT 1 FROM durable_singleton_singletonkey k
                     WHERE k.id = NULLIF(split_part(current_setting('durable_singleton.claim_locked', true), ':', 1), '')::bigint
                       AND k.workflow_name = r.workflow_name AND k.key = r.singleton_key
                       AND split_part(current_setting('durable_singleton.claim_locked', true), ':', 2) = pg_current_xact_id()::text
                 );
    wf = (SELECT claimant.wf FROM claimant); key = (SELECT claimant.key FROM claimant);
    declared = (SELECT claimant.declared FROM claimant); ttl = (SELECT claimant.ttl FROM claimant);
    status = (SELECT claimant.status FROM claimant); attempts = (SELECT claimant.attempts FROM claimant)}}
