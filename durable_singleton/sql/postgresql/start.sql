-- The PostgreSQL fast path's starts (durable_singleton.stores.pg.FastPath.start):
-- one INSERT of the run, and of its quota memberships when it carries quotas, in
-- one statement. Blocks as in runs.sql.

-- fragment: queue_front
-- The run q0 is in its key's queue front: a holder, or a waiter whose delayed start has come
-- (S5, X5): RunQuerySet.queue_front_sql_text("q0")'s condition.
q0.singleton_slot IS NOT NULL
AND (q0.singleton_slot = 'holder' OR (q0.not_before IS NULL OR q0.not_before <= STATEMENT_TIMESTAMP()))

-- fragment: queue_place
-- A key's waiters' order (S5 step 3, X8): the higher priority first, then the oldest by
-- (created_at, run_id), on the run {{run}}: admission.queue_order_sql_text(run).
{{run}}.priority DESC, {{run}}.created_at, {{run}}.run_id

-- fragment: queue_order
-- The queue's order: holders before waiters, then queue_place (S5, X8): queue_front_sql_text's
-- order, ds_run_queue_idx's.
q0.singleton_slot, {{queue_place: run = q0}}

-- fragment: started_key_limit
-- The limit in force on the started run's key: the key's runtime override, else the declared
-- deep_limit, never below 1 (K2): admission.limit_in_force_sql_text. The casts: the INSERT
-- types these parameters as its columns (varchar) when prepared.
(CASE WHEN COALESCE(
    (SELECT d0.limit_override
     FROM durable_singleton_singletonkey d0
     WHERE d0.workflow_name = %(workflow_name)s::varchar
       AND d0.key = %(singleton_key)s::varchar),
    %(deep_limit)s::integer,
    1
) < 1 THEN 1 ELSE COALESCE(
    (SELECT d0.limit_override
     FROM durable_singleton_singletonkey d0
     WHERE d0.workflow_name = %(workflow_name)s::varchar
       AND d0.key = %(singleton_key)s::varchar),
    %(deep_limit)s::integer,
    1
) END)

-- fragment: queue_is_deep
-- Is the started run's key's queue deep: limit holders and limit waiters that come before it
-- (a priority at least its own, X8) in the first 2 * limit rows of its queue front, limit the
-- limit in force (S8a, K2): queue_is_deep.
SELECT count(*) FILTER (WHERE front.singleton_slot = 'holder') >= {{started_key_limit}}
       AND count(*) FILTER (WHERE front.singleton_slot = 'waiter'
                            AND front.priority >= %(priority)s) >= {{started_key_limit}}
FROM (
    SELECT q0.singleton_slot, q0.priority
    FROM durable_singleton_run q0
    WHERE q0.workflow_name = %(workflow_name)s::varchar
      AND q0.singleton_key = %(singleton_key)s::varchar
      AND {{queue_front}}                       -- S5, X5
    ORDER BY {{queue_order}}                    -- S5
    LIMIT 2 * {{started_key_limit}}::bigint     -- in bigint: a limit up to MAX_LIMIT (int4) doubles past it
) front

-- fragment: start_columns
-- The columns a start writes from its parameters, as given (wake_at and park_reason follow).
run_id, workflow_name, workflow_version, namespace, status, input,
created_at, updated_at, output, error, tags,
singleton_key, singleton_limit, singleton_slot, singleton_tracked,
lease_owner, lease_expires_at, started_at, finished_at, admitted_at,
attempts, recoveries, parent_run_id, cancel_requested,
deadline_at, fencing_token, step_count, not_before, quota_slot, trace_parent,
quota_keys, debounce_key, debounce_until, throttle_keys, priority

-- fragment: start_values
-- Their values, in start_columns' order. A time is as given or, given NULL, the database's
-- now plus its <name>_in seconds (R8: a start reads no clock first).
%(run_id)s, %(workflow_name)s, %(workflow_version)s, %(namespace)s, %(status)s, %(input)s::jsonb,
COALESCE(%(created_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(created_at_in)s::float8)),
COALESCE(%(updated_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(updated_at_in)s::float8)),
%(output)s::jsonb, %(error)s::jsonb, %(tags)s::jsonb,
%(singleton_key)s, %(singleton_limit)s, %(singleton_slot)s, %(singleton_tracked)s,
%(lease_owner)s, %(lease_expires_at)s, %(started_at)s, %(finished_at)s, %(admitted_at)s,
%(attempts)s, %(recoveries)s, %(parent_run_id)s, %(cancel_requested)s,
COALESCE(%(deadline_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(deadline_at_in)s::float8)),
%(fencing_token)s, %(step_count)s, %(not_before)s, %(quota_slot)s, %(trace_parent)s,
%(quota_keys)s::jsonb, %(debounce_key)s, %(debounce_until)s, %(throttle_keys)s::jsonb, %(priority)s

-- fragment: insert_run
-- Insert a run without a key's backlog check, unless its run_id exists (R3, S16).
INSERT INTO durable_singleton_run AS r (
    {{start_columns}},
    wake_at,
    park_reason
)
VALUES (
    {{start_values}},
    COALESCE(%(wake_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(wake_at_in)s::float8)),
    %(park_reason)s
)
ON CONFLICT (run_id) DO NOTHING                 -- an existing run_id: nothing inserted (R3, S16)
RETURNING {{run_columns}}

-- fragment: insert_keyed_run
-- Insert a run with a key, parked with the backlog's wake when its key's queue is deep
-- (S8a), unless its run_id exists (R3, S16).
INSERT INTO durable_singleton_run AS r (
    {{start_columns}},
    wake_at,
    park_reason
)
VALUES (
    {{start_values}},
    CASE WHEN ({{queue_is_deep}})               -- S8a: a deep queue parks the start
        THEN COALESCE(%(backlog_wake_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(backlog_wake_at_in)s::float8))
        ELSE COALESCE(%(wake_at)s, STATEMENT_TIMESTAMP() + make_interval(secs => %(wake_at_in)s::float8))
    END,
    CASE WHEN ({{queue_is_deep}})               -- S8a: parked for its key
        THEN 'singleton'
        ELSE %(park_reason)s
    END
)
ON CONFLICT (run_id) DO NOTHING                 -- an existing run_id: nothing inserted (R3, S16)
RETURNING {{run_columns}}

-- fragment: insert_members
-- The inserted run's memberships: one per quota key (the mquota and mkey arrays), a waiter,
-- in its quota's order by the run's priority and creation time (X3b, X8). Nothing when nothing
-- was inserted.
INSERT INTO durable_singleton_quotamembership (run_id, quota, key, slot, fencing_token, created_at, sub_key, weight, tag, priority)
SELECT inserted.run_id, mq.quota, mq.key, 'waiter', NULL, inserted.created_at, '', 1, 0, inserted.priority
FROM inserted,
     unnest(%(mquota)s::text[], %(mkey)s::text[]) mq(quota, key)

-- fragment: insert_throttle_members
-- The inserted run's throttle memberships: one per throttle key of its throttle_keys column
-- ([[name, key, limit, period], ...]), at its priority and creation time, its place in the
-- throttle key's queue (X6c, X8a). Nothing when nothing was inserted or it carries no throttle.
INSERT INTO durable_singleton_throttlemembership (run_id, throttle, key, created_at, priority)
SELECT inserted.run_id, t0.e ->> 0, t0.e ->> 1, inserted.created_at, inserted.priority
FROM inserted
CROSS JOIN LATERAL jsonb_array_elements(COALESCE(inserted.throttle_keys, '[]'::jsonb)) t0(e)

-- name: start
-- Start a run without a key (or whose key has no declared limit here): one INSERT (R3, S16).
{{insert_run}}

-- name: start_keyed
-- Start a run with a key: one INSERT, parked when its key's queue is deep (R3, S16, S8a, K2).
{{insert_keyed_run}}

-- name: start_quotas
-- Start a run without a key that carries quotas or throttles: the INSERT and its memberships
-- (R3, X3b, X6c).
WITH inserted AS (
    {{insert_run}}
),
members AS (
    {{insert_members}}
),
throttle_members AS (
    {{insert_throttle_members}}
)
SELECT {{run_columns}}
FROM inserted r

-- name: start_keyed_quotas
-- Start a run with a key that carries quotas or throttles: the keyed INSERT and its
-- memberships (R3, S8a, X3b, X6c).
WITH inserted AS (
    {{insert_keyed_run}}
),
members AS (
    {{insert_members}}
),
throttle_members AS (
    {{insert_throttle_members}}
)
SELECT {{run_columns}}
FROM inserted r

-- fragment: insert_notice
-- The inserted run's turn notice under DISPATCH "worker", for the queue %(notice_queue)s,
-- unless the start created it parked behind a deep queue (S8a); nothing when nothing was
-- inserted (R3). Its trigger NOTIFYs at the start's commit (O1a, O7).
INSERT INTO durable_singleton_turnnotice (run_id, queue)
SELECT inserted.run_id, %(notice_queue)s
FROM inserted
WHERE inserted.park_reason IS DISTINCT FROM 'singleton'

-- name: start_notice
-- Start a run without a key under DISPATCH "worker": the INSERT and its turn notice, one
-- statement and one commit (R3, O1a, O7).
WITH inserted AS (
    {{insert_run}}
),
notice AS (
    {{insert_notice}}
)
SELECT {{run_columns}}
FROM inserted r

-- name: start_keyed_notice
-- Start a run with a key under DISPATCH "worker": the keyed INSERT and, unless it parked
-- the run behind a deep queue, its turn notice, one statement and one commit (R3, S8a, O1a, O7).
WITH inserted AS (
    {{insert_keyed_run}}
),
notice AS (
    {{insert_notice}}
)
SELECT {{run_columns}}
FROM inserted r
