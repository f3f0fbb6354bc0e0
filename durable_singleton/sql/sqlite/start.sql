-- The SQLite room's start (durable_singleton.stores.sqlite.Room.start): one INSERT of a run
-- without quotas, parked at creation behind its key's deep queue. Blocks as in runs.sql. The
-- times are the caller's, stamped by the store's clock (R8).

-- name: start
-- Insert a run without quotas unless its run_id exists (R3, S16); with deep_limit (a keyed
-- start's declared limit), parked with the backlog's wake when its key already has limit
-- holders and limit waiters in the first 2 * limit rows of its queue front, limit the limit
-- in force (S8a, K2). The SELECT's WHERE: SQLite's upsert after INSERT ... SELECT needs one.
WITH
key_limit AS MATERIALIZED (                    -- the limit in force on the key (K2)
    SELECT {{limit_in_force: declared = %(deep_limit)s; override = max(d0.limit_override)}} AS lim
    FROM durable_singleton_singletonkey d0
    WHERE d0.workflow_name = %(workflow_name)s AND d0.key = %(singleton_key)s
),
deep AS MATERIALIZED (                         -- S8a: is the key's queue deep
    SELECT %(deep_limit)s IS NOT NULL
           AND count(CASE WHEN front.singleton_slot = 'holder' THEN 1 END) >= (SELECT k.lim FROM key_limit k)
           AND count(CASE WHEN front.singleton_slot = 'waiter' AND front.priority >= %(priority)s THEN 1 END)
               >= (SELECT k.lim FROM key_limit k)   -- the waiters before it (X8)
           AS parks
    FROM (
        SELECT q0.singleton_slot, q0.priority
        FROM durable_singleton_run q0
        WHERE %(deep_limit)s IS NOT NULL
          AND q0.workflow_name = %(workflow_name)s AND q0.singleton_key = %(singleton_key)s
          AND q0.singleton_slot IS NOT NULL
          AND (q0.singleton_slot = 'holder' OR q0.not_before IS NULL OR q0.not_before <= %(now)s)
        ORDER BY q0.singleton_slot, q0.priority DESC, q0.created_at, q0.run_id   -- S5, X8
        LIMIT 2 * (SELECT k.lim FROM key_limit k)
    ) front
)
INSERT INTO durable_singleton_run (
    run_id, workflow_name, workflow_version, namespace, status, input,
    created_at, updated_at, output, error, tags,
    singleton_key, singleton_limit, singleton_slot, singleton_tracked,
    lease_owner, lease_expires_at, started_at, finished_at, admitted_at,
    attempts, recoveries, parent_run_id, cancel_requested,
    deadline_at, fencing_token, step_count, not_before, quota_slot, trace_parent,
    quota_keys, debounce_key, debounce_until, throttle_keys, priority, wake_at, park_reason
)
SELECT %(run_id)s, %(workflow_name)s, %(workflow_version)s, %(namespace)s, %(status)s, %(input)s,
       %(created_at)s, %(updated_at)s, %(output)s, %(error)s, %(tags)s,
       %(singleton_key)s, %(singleton_limit)s, %(singleton_slot)s, %(singleton_tracked)s,
       NULL, NULL, NULL, NULL, NULL,
       0, 0, %(parent_run_id)s, FALSE,
       %(deadline_at)s, NULL, 0, %(not_before)s, %(quota_slot)s, %(trace_parent)s,
       %(quota_keys)s, %(debounce_key)s, %(debounce_until)s, %(throttle_keys)s, %(priority)s,
       CASE WHEN d.parks THEN %(backlog_wake_at)s ELSE %(wake_at)s END,     -- S8a: parked for its key
       CASE WHEN d.parks THEN 'singleton' ELSE %(park_reason)s END
FROM deep d
WHERE TRUE
ON CONFLICT (run_id) DO NOTHING                 -- an existing run_id: nothing inserted (R3, S16)
RETURNING {{returned_columns}}

-- name: get
-- A run's row as stored (R1).
SELECT {{run_columns}}
FROM durable_singleton_run r
WHERE r.run_id = %(run_id)s
