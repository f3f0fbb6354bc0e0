-- The PostgreSQL fast path's throttle rules (durable_singleton.stores.pg): the throttle
-- keys a claim locks first, their windows and fronts, for claim_quota_admit (X6b, X6c,
-- X6d). A throttle is one more limit of X3: its key rows are the key table's rows
-- throttle:<name>, locked before every quota key, the singleton key and the run's row.
-- Blocks as in admission.sql.

-- fragment: member_throttle_keys
-- The claimant's throttle keys read from its throttle_keys column ([[name, key, declared
-- limit, period seconds], ...], written once at its start), numbered n in the lock order: by
-- (name, key) in code-point order, as Python sorts them on the ORM path (X3e, X6c).
(
    SELECT 'throttle:' || (t0.e ->> 0) AS wf,
           t0.e ->> 0 AS throttle,
           t0.e ->> 1 AS key,
           (t0.e ->> 2)::integer AS declared,
           (t0.e ->> 3)::float8 AS period,
           row_number() OVER (ORDER BY (t0.e ->> 0) COLLATE "C", (t0.e ->> 1) COLLATE "C") AS n
    FROM durable_singleton_run r0
    CROSS JOIN LATERAL jsonb_array_elements(COALESCE(r0.throttle_keys, '[]'::jsonb)) t0(e)
    WHERE r0.run_id = %(run_id)s
) tu

-- fragment: throttle_waiter
-- The throttle membership m of the run mr waits in its throttle key's queue: its run marked a
-- waiter (quota_slot), active, due (X5), not past its workflow's queue_ttl (X2):
-- admission.throttle_waiter_q.
(mr.quota_slot = 'waiter' AND mr.status IN ('pending', 'running', 'suspended', 'blocked') AND (mr.not_before IS NULL OR mr.not_before <= STATEMENT_TIMESTAMP()) AND NOT COALESCE(mr.created_at <= STATEMENT_TIMESTAMP() - make_interval(secs => (%(ttls)s::jsonb ->> mr.workflow_name)::float8), FALSE))

-- fragment: throttle_fronts
-- The CTEs of the claimant's locked throttle keys (X6b, X6c, X6d, K2), judged at the
-- database's clock after the locks (clock: one CLOCK_TIMESTAMP(), R5): throttle_key_rows, each
-- key with its limit in force (the declared one in the limits parameter under
-- throttle:<name>, else the one its start recorded; the key's override), the newest
-- admissions its window counts (at most its limit), its free admissions (none while paused)
-- and its opening for a waiter they do not reach (admission.throttle_room); throttle_fronts,
-- each key's first due waiters, as many as its limit, in the one queue order (X8a: priority
-- descending, then created_at, run_id; queue_place on the membership, ds_throttle_order_idx's).
throttle_key_rows AS (                         -- each throttle key locked, its window and free admissions (X6b, K2)
    SELECT tk.id, tk.n, tk.throttle, tk.key, tk.lim, tk.period,
           CASE WHEN tk.paused THEN 0 WHEN tk.lim > w.counted THEN tk.lim - w.counted ELSE 0 END AS free,
           CASE WHEN tk.paused THEN NULL       -- a paused key has no opening: its waiters retry (K2)
                WHEN tk.lim > w.counted        -- room that older waiters take: its oldest admission, or now
                    THEN COALESCE(w.oldest, (SELECT c.now FROM clock c)) + make_interval(secs => tk.period)
                ELSE w.oldest + make_interval(secs => tk.period)   -- full: the oldest that keeps it full leaves
           END AS opening
    FROM (
        SELECT k0.id, tu.n, tu.throttle, tu.key, tu.period, COALESCE(k0.paused, FALSE) AS paused,
               {{limit_in_force: declared = COALESCE((%(limits)s::jsonb ->> k0.workflow_name)::integer, tu.declared); override = k0.limit_override}} AS lim
        FROM durable_singleton_singletonkey k0
        JOIN {{member_throttle_keys}} ON k0.workflow_name = tu.wf AND k0.key = tu.key
    ) tk
    CROSS JOIN LATERAL (                       -- the newest admissions in (now - period, now], at most lim
        SELECT count(*) AS counted, min(a1.admitted_at) AS oldest
        FROM (
            SELECT a0.admitted_at
            FROM durable_singleton_throttleadmission a0
            WHERE a0.throttle = tk.throttle AND a0.key = tk.key
              AND a0.admitted_at > (SELECT c.now FROM clock c) - make_interval(secs => tk.period)
            ORDER BY a0.admitted_at DESC
            LIMIT tk.lim
        ) a1
    ) w
),
throttle_fronts AS (                           -- each key's first due waiters, up to its limit (X6c, X8a, X5, X2)
    SELECT tk.id, tk.n, f.run_id, f.pos, tk.free
    FROM throttle_key_rows tk
    CROSS JOIN LATERAL (
        SELECT m.run_id, row_number() OVER (ORDER BY {{queue_place: run = m}}) AS pos
        FROM durable_singleton_throttlemembership m
        JOIN durable_singleton_run mr ON mr.run_id = m.run_id
        WHERE m.throttle = tk.throttle AND m.key = tk.key
          AND {{throttle_waiter}}
        ORDER BY {{queue_place: run = m}}
        LIMIT tk.lim
    ) f
),
throttle_reach AS (                            -- within the free admissions of every throttle key; at the front of each (X6c)
    SELECT count(*) FILTER (WHERE tf.pos <= tf.free) = (SELECT count(*) FROM throttle_key_rows) AS reaches,
           count(*) = (SELECT count(*) FROM throttle_key_rows) AS at_front
    FROM throttle_fronts tf
    WHERE tf.run_id = %(run_id)s
),
throttle_opening AS (                          -- over the rate: the latest opening of the keys that deny it (X6d)
    SELECT tk.opening, tk.throttle
    FROM throttle_key_rows tk
    WHERE tk.opening IS NOT NULL
      AND NOT EXISTS (
          SELECT 1 FROM throttle_fronts tf
          WHERE tf.id = tk.id AND tf.run_id = %(run_id)s AND tf.pos <= tf.free
      )
    ORDER BY tk.opening DESC, tk.throttle COLLATE "C" DESC
    LIMIT 1
)

-- name: claim_create_throttle_keys
-- Create the throttle key rows of a claim's candidate throttle carrier if missing, in the lock
-- order (X6c): the first statement of a claim's message, before every other key's.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
SELECT STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), tu.wf, tu.key, 0, FALSE
FROM {{member_throttle_keys}}
JOIN durable_singleton_run r ON r.run_id = %(run_id)s
WHERE {{quota_candidate}}
ORDER BY tu.n
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: claim_lock_throttle_keys
-- Lock the candidate's throttle key rows in the lock order and record them (their ids in that
-- order, ',' between, then ':' and this transaction's id), as claim_lock_quota_keys records its
-- quota keys: the admission writes only when the record names every throttle key of the
-- claimant (X3e, X6c, S13).
SELECT set_config(
           'durable_singleton.claim_throttle_locked',
           string_agg(l.id::text, ',' ORDER BY l.n) || ':' || pg_current_xact_id()::text,
           false)
FROM (
    SELECT k.id, tu.n
    FROM durable_singleton_singletonkey k
    JOIN {{member_throttle_keys}} ON k.workflow_name = tu.wf AND k.key = tu.key
    JOIN durable_singleton_run r ON r.run_id = %(run_id)s
    WHERE {{quota_candidate}}
    ORDER BY tu.n
    FOR UPDATE OF k
) l
HAVING count(*) > 0
