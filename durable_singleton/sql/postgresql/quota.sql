-- The PostgreSQL fast path's quota rules (durable_singleton.stores.pg): the quota
-- keys a run locked, their fronts, and the admission of a quota waiter by a claim
-- (X3c, X3d, X3e, X3f, X3i). Blocks as in admission.sql.

-- fragment: holds_quota_slot
-- The membership m of the run mr holds its quota key's slot (X3g): admission.holds_quota_slot_sql_text("m", "mr").
(m.slot = 'holder' AND mr.status IN ('pending', 'running', 'suspended', 'blocked'))

-- fragment: quota_waiter
-- The membership m of the run mr waits in its quota key's front: parked, due (X5), not past
-- its workflow's queue_ttl (X2): admission.quota_waiter_sql_text("m", "mr", NOW, ttls).
(m.slot = 'waiter' AND mr.status IN ('pending', 'running', 'suspended', 'blocked') AND (mr.not_before IS NULL OR mr.not_before <= STATEMENT_TIMESTAMP()) AND NOT COALESCE(mr.created_at <= STATEMENT_TIMESTAMP() - make_interval(secs => (%(ttls)s::jsonb ->> mr.workflow_name)::float8), FALSE))

-- fragment: quota_order
-- A quota key's admission order (X3c, X3d, X8): admission.QUOTA_ORDER on m, ds_quota_order_idx's.
m.tag, m.priority DESC, m.created_at, m.run_id

-- fragment: quota_name
-- The quota's name of the quota key row k0 (its workflow_name is quota:<name>, X3b).
substr(k0.workflow_name, 7)

-- fragment: quota_limit
-- The limit in force of the quota key row k0 (K2): its override, else the declared one in the
-- limits parameter under quota:<name>, 1 if absent.
{{limit_in_force: declared = (%(limits)s::jsonb ->> k0.workflow_name)::integer; override = k0.limit_override}}

-- fragment: quota_fronts
-- The CTEs of the run's locked quota keys (X3c, X3d, X4, X5, X2, K2): quota_key_rows, each key
-- with its limit in force and free slots (none while paused); quota_fronts, each key's first
-- due waiters, as many as its limit, with their place in admission order, none past its TTL.
-- Arguments: keys, the source of the quota keys (a qu of wf, key, n, n the lock order);
-- skip_member, a clause whose membership counts as no holder (the run settled, X3g), or nothing.
quota_key_rows AS (                            -- each quota key locked, its limit and free slots (K2, X3c)
    SELECT k0.id, qu.n, k0.last_token, {{quota_name}} AS quota, k0.key, {{quota_limit}} AS lim,
           {{free_slots:
               lim = {{quota_limit}};
               holders = (SELECT count(*) FROM durable_singleton_quotamembership m JOIN durable_singleton_run mr ON mr.run_id = m.run_id
                          WHERE m.quota = {{quota_name}} AND m.key = k0.key AND {{holds_quota_slot}}
                          {{skip_member}});
               paused = k0.paused}} AS free
    FROM durable_singleton_singletonkey k0
    JOIN {{keys}} ON k0.workflow_name = qu.wf AND k0.key = qu.key
),
quota_fronts AS (                              -- each key's first due waiters, up to its limit (X3c, X3d, X5, X2)
    SELECT qk.id, qk.n, f.run_id, f.pos, qk.free
    FROM quota_key_rows qk
    CROSS JOIN LATERAL (
        SELECT m.run_id, row_number() OVER (ORDER BY {{quota_order}}) AS pos
        FROM durable_singleton_quotamembership m
        JOIN durable_singleton_run mr ON mr.run_id = m.run_id
        WHERE m.quota = qk.quota AND m.key = qk.key
          AND {{quota_waiter}}
        ORDER BY {{quota_order}}
        LIMIT qk.lim
    ) f
)

-- name: claim_quota_admit
-- The admission of a claim's candidate quota waiter or throttle carrier (X3c, X3d, X3f, X3i,
-- X6b, X6c, X6d, S5, K1) whose throttle keys, quota keys (and singleton key, if it has one)
-- this transaction locked and recorded (claim_lock_throttle_keys, claim_lock_quota_keys,
-- claim_lock_key), its values read from its row after the locks (R5a); if it is none, nothing
-- is written and the ORM path decides. It is admitted when it is within the free admissions of
-- each of its throttle keys, the free slots of each of its quota keys and, with a singleton
-- key, the key's grant reaches it; then it takes its lease, a slot and the next token in each
-- limit, and its admission is recorded in each throttle key at the clock's time, the time its
-- run's admitted_at says. Else, denied by a throttle key with an opening, it is parked until
-- the latest such opening (its wake_at and not_before, X6d); otherwise with its retry wake:
-- the front delay among the first limit waiters (of its singleton key once its other limits
-- admit it, else of each quota and throttle key), the backlog's if not (S5 step 5). The
-- singleton grants are written whenever its quotas and throttles admit it, as the ORM path's
-- _quota_turn. The rows: 0 its lease (with its quota tokens as JSON), 1 the other grants, 2 it
-- parked (with the name of the throttle that parked it in a JSON array, if one did), 3 the
-- waiters sent a turn as they are (X3h).
WITH claimant AS (
    SELECT r.run_id, r.status, r.attempts, r.workflow_name AS wf, r.singleton_key AS key,
           (%(limits)s::jsonb ->> r.workflow_name)::integer AS declared,
           (%(ttls)s::jsonb ->> r.workflow_name)::float8 AS ttl
    FROM durable_singleton_run r
    WHERE {{quota_candidate}}
      -- X3e, S13: only under the quota key locks claim_lock_quota_keys recorded, every one of its keys
      AND (                                    -- none to lock, or every one recorded
          NOT EXISTS (SELECT 1 FROM durable_singleton_quotamembership m0 WHERE m0.run_id = %(run_id)s)
          OR (split_part(current_setting('durable_singleton.claim_quota_locked', true), ':', 2) = pg_current_xact_id()::text
              AND split_part(current_setting('durable_singleton.claim_quota_locked', true), ':', 1) = (
                  SELECT string_agg(k.id::text, ',' ORDER BY qu.n)
                  FROM durable_singleton_singletonkey k
                  JOIN {{member_quota_keys}} ON k.workflow_name = qu.wf AND k.key = qu.key
              ))
      )
      AND (                                    -- X6c, S13: and the throttle key locks claim_lock_throttle_keys recorded
          COALESCE(r.throttle_keys, '[]'::jsonb) = '[]'::jsonb
          OR (split_part(current_setting('durable_singleton.claim_throttle_locked', true), ':', 2) = pg_current_xact_id()::text
              AND split_part(current_setting('durable_singleton.claim_throttle_locked', true), ':', 1) = (
                  SELECT string_agg(k.id::text, ',' ORDER BY tu.n)
                  FROM durable_singleton_singletonkey k
                  JOIN {{member_throttle_keys}} ON k.workflow_name = tu.wf AND k.key = tu.key
              ))
      )
      AND (                                    -- S13: and the singleton key lock claim_lock_key recorded
          r.singleton_key IS NULL
          OR EXISTS (
              SELECT 1 FROM durable_singleton_singletonkey k
              WHERE k.id = NULLIF(split_part(current_setting('durable_singleton.claim_locked', true), ':', 1), '')::bigint
                AND k.workflow_name = r.workflow_name AND k.key = r.singleton_key
                AND split_part(current_setting('durable_singleton.claim_locked', true), ':', 2) = pg_current_xact_id()::text
          )
      )
),
clock AS MATERIALIZED (                        -- the database's clock after the locks: the window's now and the admission's time (R5)
    SELECT CLOCK_TIMESTAMP() AS now
),
{{quota_fronts: keys = {{member_quota_keys}}; skip_member = }},
{{throttle_fronts}},
quota_reach AS (                               -- within the free slots of every quota key; at the front of each (X3c)
    SELECT count(*) FILTER (WHERE qf.pos <= qf.free) = (SELECT count(*) FROM quota_key_rows qk) AS reaches,
           count(*) = (SELECT count(*) FROM quota_key_rows qk) AS at_front
    FROM quota_fronts qf
    WHERE qf.run_id = %(run_id)s
),
{{key_queue:
    wf = (SELECT claimant.wf FROM claimant); key = (SELECT claimant.key FROM claimant);
    declared = (SELECT claimant.declared FROM claimant); ttl = (SELECT claimant.ttl FROM claimant);
    skip_legacy = ; skip_front = }},
limits_reach AS (                              -- its quotas and throttles admit it (X3d, X6c)
    SELECT qr.reaches AND tr.reaches AS reaches, qr.at_front AND tr.at_front AS at_front
    FROM quota_reach qr, throttle_reach tr
),
{{singleton_grants:
    when = (SELECT lr.reaches FROM limits_reach lr) AND EXISTS (SELECT 1 FROM claimant);
    carriers = ;
    takes = sg.run_id = %(run_id)s OR sg.quota_slot IS NULL}},
admitted AS (                                  -- its quotas admit it and, with a singleton key, its grant (X3i)
    SELECT EXISTS (SELECT 1 FROM claimant) AND (SELECT lr.reaches FROM limits_reach lr)
           AND ((SELECT claimant.key FROM claimant) IS NULL OR EXISTS (SELECT 1 FROM grants g WHERE g.run_id = %(run_id)s)) AS yes
),
claimant_lease AS (                            -- admitted: its lease, a slot in each limit (R5, R6, X3f)
    UPDATE durable_singleton_run r
    SET {{take_set}},
        quota_slot = 'holder',
        admitted_at = (SELECT c.now FROM clock c),   -- the time its throttle keys record (X6b)
        singleton_slot = CASE WHEN r.singleton_key IS NULL THEN r.singleton_slot ELSE 'holder' END,
        singleton_tracked = r.singleton_tracked OR r.singleton_key IS NOT NULL,
        fencing_token = COALESCE((SELECT g.token FROM grants g WHERE g.run_id = %(run_id)s), r.fencing_token)
    WHERE r.run_id = %(run_id)s               -- R5a, S9: as its turn read it
      AND r.status = (SELECT claimant.status FROM claimant)
      AND r.attempts = (SELECT claimant.attempts FROM claimant)
      AND NOT r.cancel_requested
      AND r.quota_slot = 'waiter'
      AND (SELECT ad.yes FROM admitted ad)
    RETURNING {{run_columns}}
),
claimant_tokens AS (                           -- its membership in each quota key takes the next token (X3f, K1)
    UPDATE durable_singleton_quotamembership m
    SET slot = 'holder', fencing_token = qk.last_token + 1
    FROM quota_key_rows qk
    WHERE m.run_id = %(run_id)s AND m.quota = qk.quota AND m.key = qk.key
      AND EXISTS (SELECT 1 FROM claimant_lease)
    RETURNING m.quota, m.fencing_token
),
throttle_admissions AS (                       -- its admission counts in each throttle key's window from now on (X6b)
    INSERT INTO durable_singleton_throttleadmission (throttle, key, run_id, admitted_at)
    SELECT tk.throttle, tk.key, %(run_id)s, (SELECT c.now FROM clock c)
    FROM throttle_key_rows tk
    WHERE EXISTS (SELECT 1 FROM claimant_lease)
),
quota_tokens AS (                              -- each quota key's counter moves past its token (K1)
    UPDATE durable_singleton_singletonkey k2
    SET last_token = qk.last_token + 1
    FROM quota_key_rows qk
    WHERE k2.id = qk.id AND EXISTS (SELECT 1 FROM claimant_lease)
),
other_grants AS (                              -- the singleton key's other grants (S5, K1)
    UPDATE durable_singleton_run r
    SET {{grant_set}},
        wake_at = CLOCK_TIMESTAMP() + make_interval(secs => %(redelivery)s::float8),
        updated_at = STATEMENT_TIMESTAMP()
    FROM grants g
    WHERE g.run_id <> %(run_id)s
      AND {{grant_cas}}
    RETURNING {{run_columns}}
),
claimant_parked AS (                           -- not admitted: over the rate until the opening (X6d), else its retry wake (S5 step 5)
    UPDATE durable_singleton_run r
    SET status = 'suspended',
        attempts = r.attempts + 1,
        wake_at = COALESCE((SELECT o.opening FROM throttle_opening o), CLOCK_TIMESTAMP() + make_interval(secs => CASE WHEN
            CASE WHEN (SELECT lr.reaches FROM limits_reach lr) AND (SELECT claimant.key FROM claimant) IS NOT NULL
                THEN EXISTS (SELECT 1 FROM waiters w, key_slots c WHERE w.run_id = %(run_id)s AND w.pos <= c.lim)
                ELSE (SELECT lr.at_front FROM limits_reach lr) END
            THEN %(front)s::float8 ELSE %(backlog)s::float8 END)),
        not_before = COALESCE((SELECT o.opening FROM throttle_opening o), r.not_before),   -- not due before it (X5)
        lease_owner = NULL,
        lease_expires_at = NULL,
        -- over a throttle's rate: ParkReason.THROTTLED, throttled:<name> (X6d); else a waiter's
        park_reason = COALESCE((SELECT 'throttled:' || o.throttle FROM throttle_opening o), 'singleton'),
        updated_at = STATEMENT_TIMESTAMP()
    WHERE r.run_id = %(run_id)s
      AND r.status = (SELECT claimant.status FROM claimant)
      AND r.attempts = (SELECT claimant.attempts FROM claimant)
      AND NOT r.cancel_requested
      AND EXISTS (SELECT 1 FROM claimant)
      AND NOT (SELECT ad.yes FROM admitted ad)
    RETURNING {{run_columns}}
),
{{key_tokens}},
turns AS (                                     -- the waiters sent a turn as they are (X3h)
    SELECT sg.run_id, 0 AS o1, sg.pos AS o2
    FROM within_slots sg
    WHERE sg.quota_slot IS NOT NULL AND sg.run_id <> %(run_id)s
    UNION ALL
    SELECT qf.run_id, qf.n, qf.pos
    FROM quota_fronts qf
    WHERE (SELECT ad.yes FROM admitted ad) AND qf.pos <= qf.free AND qf.run_id <> %(run_id)s
    UNION ALL
    SELECT tf.run_id, (SELECT count(*) FROM quota_key_rows) + tf.n, tf.pos
    FROM throttle_fronts tf
    WHERE (SELECT ad.yes FROM admitted ad) AND tf.pos <= tf.free AND tf.run_id <> %(run_id)s
)
SELECT 0, {{run_columns}}, (SELECT json_object_agg(mt.quota, mt.fencing_token) FROM claimant_tokens mt), 0, 0 FROM claimant_lease r
UNION ALL SELECT 1, {{run_columns}}, NULL, 0, 0 FROM other_grants r
UNION ALL SELECT 2, {{run_columns}}, (SELECT json_build_array(o.throttle) FROM throttle_opening o), 0, 0 FROM claimant_parked r
UNION ALL SELECT 3, {{run_columns}}, NULL, {{turn_order}}
