-- The PostgreSQL fast path's handoffs (durable_singleton.stores.pg.FastPath.finish):
-- settle the run by compare-and-set on its owner's unexpired lease, dropping its
-- markers in the same write, then grant its keys' freed slots to the oldest
-- waiters, in one statement (S7, S12, R5a, K1). Blocks as in admission.sql.

-- fragment: settled
-- The run settled by its owner (S7, R5a, X3g): its end written and every marker dropped.
settled AS (
    UPDATE durable_singleton_run r
    SET {{settle_set}}
    WHERE r.run_id = %(run_id)s
      AND {{finish_owned}}                     -- R5a: its owner, lease unexpired after the locks
    RETURNING {{run_columns}}
)

-- name: finish
-- The handoff of a run without quotas (S7, S12, R5a, K1): settle it, then grant its key's freed
-- slots to the oldest waiters. The rows: 0 the run settled, 1 the grants, 2 the waiters sent a
-- turn as they are (their own claims decide, X3h).
WITH {{settled}},
{{key_queue:
    wf = %(wf)s; key = %(key)s; declared = %(declared)s; ttl = %(ttl)s;
    skip_legacy = AND l0.run_id <> %(run_id)s;
    skip_front = AND q0.run_id <> %(run_id)s}},
{{singleton_grants: when = EXISTS (SELECT 1 FROM settled); carriers = ; takes = sg.quota_slot IS NULL}},
granted AS (                                   -- each grant, sent its turn after the redelivery delay (S5, K1)
    UPDATE durable_singleton_run r
    SET {{grant_set}},
        wake_at = CLOCK_TIMESTAMP() + make_interval(secs => %(redelivery)s::float8),
        updated_at = STATEMENT_TIMESTAMP()
    FROM grants g
    WHERE {{grant_cas}}
    RETURNING {{run_columns}}
),
{{key_tokens}},
turns AS (                                     -- the waiters within the slots that carry quotas: sent a turn (X3h)
    SELECT sg.run_id, 0 AS o1, sg.pos AS o2
    FROM within_slots sg
    WHERE sg.quota_slot IS NOT NULL
)
SELECT 0, {{run_columns}}, 0, 0 FROM settled r
UNION ALL SELECT 1, {{run_columns}}, 0, 0 FROM granted r
UNION ALL SELECT 2, {{run_columns}}, {{turn_order}}

-- name: quota_finish
-- The handoff of a run that carries quotas (S7, S12, R5a, K1, X3g, X3h): settle it and free
-- its slot in every limit in the same transaction, read each of its quota keys' waiters within
-- the free slots, and admit those whose every limit this message locked (each decided as its
-- own claim would decide it under the same locks). The rows: 0 the run settled, 1 the grants,
-- 2 the waiters sent a turn as they are.
WITH {{settled}},
settled_memberships AS (                       -- its slot in every quota freed (X3g)
    UPDATE durable_singleton_quotamembership m
    SET slot = NULL
    WHERE m.run_id = %(run_id)s AND EXISTS (SELECT 1 FROM settled)
),
{{quota_fronts: keys = {{quota_keys}}; skip_member = AND m.run_id <> %(run_id)s}},
{{key_queue:
    wf = %(wf)s; key = %(key)s; declared = %(declared)s; ttl = %(ttl)s;
    skip_legacy = AND l0.run_id <> %(run_id)s;
    skip_front = AND q0.run_id <> %(run_id)s}},
{{singleton_grants:
    when = EXISTS (SELECT 1 FROM settled);
    takes = sg.quota_slot IS NULL OR sg.run_id IN (SELECT qa.run_id FROM carriers_admitted qa);
    carriers =
carriers_within AS (                           -- X3h, X3d: within the free slots of every quota key they carry, all locked here
    SELECT qf.run_id
    FROM quota_fronts qf
    WHERE qf.pos <= qf.free AND EXISTS (SELECT 1 FROM settled)
    GROUP BY qf.run_id
    HAVING count(*) = (SELECT count(*) FROM durable_singleton_quotamembership m1 WHERE m1.run_id = qf.run_id)
),
carriers_admitted AS (                         -- of them, parked, not cancelled, granted by their singleton key if any
    SELECT r.run_id, r.status, r.singleton_key IS NOT NULL AS keyed
    FROM carriers_within qc
    JOIN durable_singleton_run r ON r.run_id = qc.run_id
    WHERE r.status IN ('pending', 'suspended', 'blocked')
      AND NOT r.cancel_requested
      AND r.quota_slot = 'waiter'
      AND COALESCE(r.throttle_keys, '[]'::jsonb) = '[]'::jsonb  -- X6: a throttle carrier's own claim admits it
      AND (r.singleton_key IS NULL OR EXISTS (SELECT 1 FROM within_slots sg WHERE sg.run_id = r.run_id))
),}},
all_grants AS (                                -- the singleton grants and the carriers without a singleton key
    SELECT g.run_id, g.status, g.token FROM grants g
    UNION ALL
    SELECT qa.run_id, qa.status, NULL::bigint FROM carriers_admitted qa WHERE NOT qa.keyed
),
granted AS (                                   -- each a compare-and-set on the waiter as read (S7, K1, R5a)
    UPDATE durable_singleton_run r
    SET singleton_slot = CASE WHEN ga.token IS NULL THEN r.singleton_slot ELSE 'holder' END,
        singleton_tracked = r.singleton_tracked OR ga.token IS NOT NULL,
        fencing_token = COALESCE(ga.token, r.fencing_token),
        quota_slot = CASE WHEN r.quota_slot IS NULL THEN NULL ELSE 'holder' END,
        admitted_at = CLOCK_TIMESTAMP(),
        wake_at = CLOCK_TIMESTAMP() + make_interval(secs => %(redelivery)s::float8),
        updated_at = STATEMENT_TIMESTAMP()
    FROM all_grants ga
    WHERE r.run_id = ga.run_id
      AND r.status = ga.status
      AND NOT r.cancel_requested
      AND (ga.token IS NULL OR r.singleton_slot = 'waiter')
      AND (r.quota_slot IS NULL OR (r.quota_slot = 'waiter' AND r.run_id IN (SELECT qa.run_id FROM carriers_admitted qa)))
    RETURNING {{run_columns}}
),
carrier_places AS (                            -- each admitted carrier's place in each quota key, in order (X3f)
    SELECT qf.id, qf.run_id, row_number() OVER (PARTITION BY qf.id ORDER BY qf.pos) AS rk
    FROM quota_fronts qf
    WHERE qf.run_id IN (SELECT qa.run_id FROM carriers_admitted qa)
      AND qf.run_id IN (SELECT u.run_id FROM granted u)
),
carrier_tokens AS (                            -- a slot and the next token of each of its quota keys (X3f, K1)
    UPDATE durable_singleton_quotamembership m
    SET slot = 'holder', fencing_token = qk.last_token + qt0.rk
    FROM carrier_places qt0
    JOIN quota_key_rows qk ON qk.id = qt0.id
    WHERE m.run_id = qt0.run_id AND m.quota = qk.quota AND m.key = qk.key
),
quota_tokens AS (                              -- each quota key's counter moves past them (K1)
    UPDATE durable_singleton_singletonkey k2
    SET last_token = qk.last_token + x.n
    FROM quota_key_rows qk
    JOIN (SELECT qt0.id, count(*) AS n FROM carrier_places qt0 GROUP BY qt0.id) x ON x.id = qk.id
    WHERE k2.id = qk.id
),
{{key_tokens}},
turns AS (                                     -- the waiters sent a turn as they are (X3h)
    SELECT sg.run_id, 0 AS o1, sg.pos AS o2
    FROM within_slots sg
    WHERE sg.quota_slot IS NOT NULL
    UNION ALL
    SELECT qf.run_id, qf.n, qf.pos
    FROM quota_fronts qf
    WHERE qf.pos <= qf.free AND EXISTS (SELECT 1 FROM settled)
)
SELECT 0, {{run_columns}}, 0, 0 FROM settled r
UNION ALL SELECT 1, {{run_columns}}, 0, 0 FROM granted r
UNION ALL SELECT 2, {{run_columns}}, {{turn_order}}
  AND r.run_id NOT IN (SELECT qa.run_id FROM carriers_admitted qa)
