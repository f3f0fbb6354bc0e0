-- The SQLite room's claim of a run that carries a throttle (durable_singleton.stores.sqlite,
-- Room.claim_throttled, X6): the ORM path's rules (DjangoStore._quota_turn, _throttle_front,
-- _park_throttled) in two statements and the key's bump_token, inside one BEGIN ... COMMIT the
-- room sends. Its first statement, claim_throttled, is a write: it takes the database's write
-- lock before it reads anything (S13, as the room's plain claim does), and the transaction keeps
-- it, so every statement reads and writes under it and the admission's record is written with
-- the run's admission or not at all (X6b). Its text is compiled before the lock (a new
-- connection compiles it again: BEGIN IMMEDIATE first would compile it under the lock). Blocks
-- as in runs.sql; sql/postgresql/throttle.sql is the PostgreSQL spelling of the same rules.
-- The clock: one call of ds_now(0) after the lock (R5, the ORM path reads it after its key
-- locks), and every time written or compared is that reading plus whole microseconds, in SQL:
-- a Python SQL function called for each row would wait for Python's lock of the process's
-- other threads while the write lock is held.

-- fragment: time_us
-- The time {{time}} ('YYYY-MM-DD HH:MM:SS[.ffffff]', as Django writes a time on SQLite) in whole
-- microseconds since the epoch: its whole seconds (exact: julianday of a whole second, rounded)
-- and its fraction's digits.
(CAST(round((julianday(substr({{time}}, 1, 19)) - 2440587.5) * 86400) AS INTEGER) * 1000000
 + CAST(substr({{time}} || '.000000', 21, 6) AS INTEGER))

-- fragment: us_time
-- The whole microseconds since the epoch {{us}} (bracketed here: it may be a sum) as a time
-- 'YYYY-MM-DD HH:MM:SS.ffffff' (time_us's inverse).
(datetime(({{us}}) / 1000000, 'unixepoch') || '.' || substr(1000000 + ({{us}}) - ({{us}}) / 1000000 * 1000000, 2))

-- fragment: throttle_waiter
-- The throttle membership {{member}} waits in its throttle key's queue: its run marked a waiter
-- (quota_slot), active, due by the clock (X5), not past its workflow's queue_ttl (X2: the
-- ttl_us parameter, microseconds by workflow): admission.throttle_waiter_q. The run is read by
-- its key alone, inside EXISTS (no join: a join's test of the run alone lets SQLite read every
-- run into a Bloom filter).
EXISTS (
    SELECT 1
    FROM durable_singleton_run mr
    WHERE mr.run_id = {{member}}.run_id
      AND mr.quota_slot = 'waiter'
      AND mr.status IN ('pending', 'running', 'suspended', 'blocked')
      AND (mr.not_before IS NULL OR mr.not_before <= (SELECT k.now FROM clock k))
      AND NOT COALESCE({{time_us: time = mr.created_at}}
                       <= (SELECT k.now_us FROM clock k) - (SELECT j.value FROM json_each(%(ttl_us)s) j WHERE j.key = mr.workflow_name),
                       FALSE)
)

-- name: claim_throttled
-- A turn's claim of a parked, due waiter that carries one throttle and no quota (X6b, X6c, X6d,
-- X3d, S5, K1, K2, X2, R5a), without a singleton key or a tracked waiter of a workflow the
-- limits parameter declares. Its throttle key's window is counted at the clock's reading; its limit in force is
-- the one declared in limits under throttle:<name>, else the one its start recorded, or the
-- key's override; a paused key has no room. Admitted (admit) when the key's free admissions
-- reach it in the key's queue order (X8a) and its singleton key's free slots do: it takes its
-- slots (the next token, K1), its admitted_at the reading; the other waiters within the singleton key's
-- free slots are granted theirs (grant) or, carrying limits, sent a turn (turn, X3h); the
-- throttle key's other waiters within its free admissions are sent a turn (turn, X6c). Else
-- parked: the throttle denying it, until its window's opening (park_throttled, park reason
-- throttled:<name>, X6d); a paused throttle key or a full singleton key, with its retry delay
-- (park_front, park_backlog, S5 step 5). A turn is the waiter returned as read, nothing
-- changed. Nothing is written for any other run, a keyed run of a workflow limits does not
-- declare, or a key's counter behind (K1): the ORM path decides.
WITH
clock_read AS MATERIALIZED (                   -- one reading of the clock, after the write lock (X6b, R5)
    SELECT ds_now(0) AS now
),
clock AS MATERIALIZED (                        -- that reading, and in microseconds since the epoch
    SELECT k0.now, {{time_us: time = k0.now}} AS now_us
    FROM clock_read k0
),
claimant AS MATERIALIZED (                     -- the turn's run, if this statement may claim it
    SELECT c0.run_id, c0.workflow_name AS wf, c0.singleton_key AS key, c0.status,
           json_extract(c0.throttle_keys, '$[0][0]') AS throttle,   -- [[name, key, limit, period]]
           json_extract(c0.throttle_keys, '$[0][1]') AS throttle_key,
           COALESCE((SELECT j.value FROM json_each(%(limits)s) j
                     WHERE j.key = 'throttle:' || json_extract(c0.throttle_keys, '$[0][0]')),
                    NULLIF(json_extract(c0.throttle_keys, '$[0][2]'), 0)) AS throttle_declared,  -- else recorded
           CAST(round(json_extract(c0.throttle_keys, '$[0][3]') * 1000000) AS INTEGER) AS period_us,
           (SELECT j.value FROM json_each(%(limits)s) j WHERE j.key = c0.workflow_name) AS declared,
           (SELECT j.value FROM json_each(%(ttl_us)s) j WHERE j.key = c0.workflow_name) AS ttl_us,
           k.now, k.now_us
    FROM clock k CROSS JOIN durable_singleton_run c0
    WHERE c0.run_id = %(run_id)s
      AND c0.status IN ('pending', 'suspended', 'blocked')   -- parked: not running, not ended
      AND NOT c0.cancel_requested                            -- R6: a cancel is the ORM path's
      AND (c0.not_before IS NULL OR c0.not_before <= k.now)  -- X5: due
      AND c0.quota_slot = 'waiter'                           -- a limits carrier waiting
      AND json_array_length(c0.throttle_keys) = 1            -- one throttle key
      AND COALESCE(json_array_length(c0.quota_keys), 0) = 0  -- X3i: quotas are the ORM path's
      AND (c0.singleton_key IS NULL OR (c0.singleton_tracked AND c0.singleton_slot = 'waiter'))
),
throttle_key AS MATERIALIZED (                 -- the throttle key: its limit in force, paused (K2), its window (X6b)
    SELECT t.*,
           (SELECT count(*)                    -- the admissions in (now - period, now]
            FROM durable_singleton_throttleadmission a0
            WHERE a0.throttle = t.throttle AND a0.key = t.throttle_key AND a0.admitted_at > t.since) AS counted,
           (SELECT min(a1.admitted_at)         -- the oldest of the newest lim of them
            FROM (SELECT a0.admitted_at, row_number() OVER (ORDER BY a0.admitted_at DESC) AS n
                  FROM durable_singleton_throttleadmission a0
                  WHERE a0.throttle = t.throttle AND a0.key = t.throttle_key AND a0.admitted_at > t.since) a1
            WHERE a1.n <= t.lim) AS oldest
    FROM (
        SELECT c.*, {{us_time: us = c.now_us - c.period_us}} AS since,
               {{limit_in_force:
                   declared = c.throttle_declared;
                   override = (SELECT max(t0.limit_override) FROM durable_singleton_singletonkey t0
                               WHERE t0.workflow_name = 'throttle:' || c.throttle AND t0.key = c.throttle_key)}} AS lim,
               COALESCE((SELECT max(t0.paused) FROM durable_singleton_singletonkey t0
                         WHERE t0.workflow_name = 'throttle:' || c.throttle AND t0.key = c.throttle_key), FALSE) AS paused
        FROM claimant c
    ) t
),
throttle_front AS MATERIALIZED (               -- the key's first due waiters, as many as its limit, in the queue order (X6c, X8a)
    SELECT f.run_id, row_number() OVER (ORDER BY f.priority DESC, f.created_at, f.run_id) AS pos
    FROM (
        SELECT m.run_id, m.priority, m.created_at
        FROM durable_singleton_throttlemembership m
        WHERE m.throttle = (SELECT t.throttle FROM throttle_key t) AND m.key = (SELECT t.throttle_key FROM throttle_key t)
          AND {{throttle_waiter: member = m}}
        ORDER BY m.priority DESC, m.created_at, m.run_id               -- QUEUE_ORDER, ds_throttle_order_idx
        LIMIT COALESCE((SELECT t.lim FROM throttle_key t), 0)
    ) f
),
{{key_queue:
    wf = (SELECT c.wf FROM claimant c); key = (SELECT c.key FROM claimant c);
    declared = (SELECT c.declared FROM claimant c); ttl = (SELECT c.ttl_us FROM claimant c);
    now = (SELECT k.now FROM clock k);
    ttl_since = (SELECT {{us_time: us = c.now_us - c.ttl_us}} FROM claimant c);
    skip_legacy = ; skip_front = }},
slot_ranks AS MATERIALIZED (                   -- the singleton key's waiters within its free slots; n: the tokens up to each (K1)
    SELECT w.run_id, w.status, w.quota_slot, w.pos, s.last_token,
           sum(CASE WHEN w.run_id = %(run_id)s OR w.quota_slot IS NULL THEN 1 ELSE 0 END) OVER (ORDER BY w.pos) AS n
    FROM waiters w CROSS JOIN key_slots s
    WHERE w.pos <= s.free
),
verdict AS MATERIALIZED (                      -- the claimant's write, when this statement decides for it (one row)
    SELECT v.*,
           CASE WHEN v.key IS NOT NULL AND v.reaches THEN              -- the singleton key decides (S5)
                     CASE WHEN v.slot_token IS NOT NULL THEN 'admit'
                          WHEN v.slot_pos <= v.slot_lim THEN 'park_front'
                          ELSE 'park_backlog' END
                WHEN v.reaches THEN 'admit'
                WHEN NOT v.paused THEN 'park_throttled'                 -- over the rate (X6d)
                WHEN v.at_front THEN 'park_front'                       -- paused: its retry delay (K2)
                ELSE 'park_backlog' END AS kind
    FROM (
        SELECT u.*,
               u.throttle_pos IS NOT NULL AND u.throttle_pos <= u.free AS reaches,   -- X6c
               u.throttle_pos IS NOT NULL AS at_front                              -- within the first lim
        FROM (
            SELECT t.run_id, t.status, t.key, t.throttle, t.paused,
                   CASE WHEN t.paused THEN 0 WHEN t.lim > t.counted THEN t.lim - t.counted ELSE 0 END AS free,
                   {{us_time: us = {{time_us: time = COALESCE(t.oldest, t.now)}} + t.period_us}} AS opening,
                   -- One probe each of a small materialized table: "+" keeps SQLite from building an
                   -- automatic index on it for the one lookup (a scan costs less than the build).
                   (SELECT f.pos FROM throttle_front f WHERE +f.run_id = t.run_id) AS throttle_pos,
                   (SELECT w.pos FROM waiters w WHERE +w.run_id = t.run_id) AS slot_pos,
                   (SELECT g.last_token + g.n FROM slot_ranks g WHERE +g.run_id = t.run_id) AS slot_token,
                   s.lim AS slot_lim
            FROM throttle_key t CROSS JOIN key_slots s
            WHERE t.key IS NULL
               OR (t.declared IS NOT NULL      -- a workflow this process declares
                   AND NOT s.behind)           -- K1: the key's counter is past every token
        ) u
    ) v
),
writes AS MATERIALIZED (                       -- each write: the claimant's, the grants with their tokens, the turns
    SELECT x.run_id, x.status, x.token, x.kind, x.opening, x.reason
    FROM (
        SELECT u.run_id, v.opening, 'throttled:' || v.throttle AS reason,
               CASE WHEN u.src = 0 THEN v.status ELSE u.status END AS status,
               CASE WHEN u.src = 0 AND v.kind = 'admit' THEN v.slot_token
                    WHEN u.src = 1 AND u.quota_slot IS NULL THEN u.token END AS token,
               CASE WHEN u.src = 0 THEN v.kind
                    WHEN u.src = 1 AND NOT (v.key IS NOT NULL AND v.reaches) THEN NULL
                    WHEN u.src = 1 AND u.quota_slot IS NULL THEN 'grant'
                    WHEN u.src = 1 THEN 'turn'                   -- X3h: a carrier's own claim decides
                    WHEN v.kind = 'admit' AND u.pos <= v.free THEN 'turn'   -- the throttle key's (X6c)
               END AS kind
        FROM verdict v CROSS JOIN (            -- src: 0 the claimant, 1 a singleton waiter, 2 a throttle waiter
            SELECT 0 AS src, %(run_id)s AS run_id, NULL AS status, NULL AS quota_slot, NULL AS token, NULL AS pos
            UNION ALL
            SELECT 1, g.run_id, g.status, g.quota_slot, g.last_token + g.n, g.pos
            FROM slot_ranks g
            WHERE g.run_id <> %(run_id)s
            UNION ALL
            SELECT 2, f.run_id, NULL, NULL, NULL, f.pos
            FROM throttle_front f
            WHERE f.run_id <> %(run_id)s AND f.run_id NOT IN (SELECT g.run_id FROM slot_ranks g)
        ) u
    ) x
    WHERE x.kind IS NOT NULL
)
UPDATE durable_singleton_run AS r
SET status = CASE w.kind WHEN 'admit' THEN 'running' WHEN 'grant' THEN r.status WHEN 'turn' THEN r.status
                         ELSE 'suspended' END,
    lease_owner = CASE w.kind WHEN 'admit' THEN %(owner)s WHEN 'grant' THEN r.lease_owner
                              WHEN 'turn' THEN r.lease_owner END,
    lease_expires_at = CASE w.kind WHEN 'admit' THEN (SELECT {{us_time: us = k.now_us + %(lease_us)s}} FROM clock k)   -- R5
                                   WHEN 'grant' THEN r.lease_expires_at WHEN 'turn' THEN r.lease_expires_at END,
    wake_at = CASE w.kind WHEN 'admit' THEN NULL
                          WHEN 'grant' THEN (SELECT {{us_time: us = k.now_us + %(redelivery_us)s}} FROM clock k)   -- S7a
                          WHEN 'park_throttled' THEN w.opening   -- X6d
                          WHEN 'park_front' THEN (SELECT {{us_time: us = k.now_us + %(front_us)s}} FROM clock k)   -- S5 step 5
                          WHEN 'park_backlog' THEN (SELECT {{us_time: us = k.now_us + %(backlog_us)s}} FROM clock k)
                          ELSE r.wake_at END,
    not_before = CASE w.kind WHEN 'park_throttled' THEN w.opening  -- X5 until it
                             ELSE r.not_before END,
    attempts = CASE WHEN w.kind IN ('grant', 'turn') THEN r.attempts ELSE r.attempts + 1 END,
    started_at = CASE WHEN w.kind = 'admit' THEN COALESCE(r.started_at, (SELECT k.now FROM clock k)) ELSE r.started_at END,
    singleton_slot = CASE WHEN w.kind = 'grant' OR (w.kind = 'admit' AND r.singleton_key IS NOT NULL) THEN 'holder'
                          ELSE r.singleton_slot END,
    singleton_tracked = CASE WHEN w.kind = 'grant' OR (w.kind = 'admit' AND r.singleton_key IS NOT NULL) THEN TRUE
                             ELSE r.singleton_tracked END,
    quota_slot = CASE WHEN w.kind = 'admit' THEN 'holder' ELSE r.quota_slot END,
    fencing_token = COALESCE(w.token, r.fencing_token),
    admitted_at = CASE WHEN w.kind IN ('admit', 'grant') THEN (SELECT k.now FROM clock k)   -- the window's clock (X6b)
                       ELSE r.admitted_at END,
    park_reason = CASE w.kind WHEN 'park_throttled' THEN w.reason
                              WHEN 'park_front' THEN 'singleton' WHEN 'park_backlog' THEN 'singleton'
                              ELSE r.park_reason END,
    updated_at = CASE w.kind WHEN 'turn' THEN r.updated_at ELSE (SELECT k.now FROM clock k) END
FROM writes w
WHERE r.run_id = w.run_id
  AND (w.kind = 'turn'                         -- returned as read, nothing changed
       OR (r.status = w.status                 -- a compare-and-set on the run as read (R5a)
           AND NOT r.cancel_requested          -- R6
           AND (   (w.kind = 'grant' AND r.singleton_slot = 'waiter' AND r.quota_slot IS NULL)
                OR (w.kind <> 'grant' AND r.quota_slot = 'waiter'))))
  -- Each test of r sits beside a test of w, never alone (claim's note: no Bloom filter of r).
RETURNING {{returned_columns}}

-- name: record_throttle_admission
-- The record of a run's throttled admission (X6b), after claim_throttled in its transaction:
-- one row per throttle key it carries, at its admitted_at (the reading its window was counted at).
INSERT INTO durable_singleton_throttleadmission (throttle, key, run_id, admitted_at)
SELECT json_extract(t.value, '$[0]'), json_extract(t.value, '$[1]'), r.run_id, r.admitted_at
FROM durable_singleton_run r, json_each(r.throttle_keys) t
WHERE r.run_id = %(run_id)s
  AND r.quota_slot = 'holder'
