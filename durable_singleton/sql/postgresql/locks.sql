-- The PostgreSQL fast path's key rows and their locks, in the one global lock
-- order: every quota key of a run by (name, key) in code-point order, then its
-- singleton key, then its run row (X3e, S13). Blocks as in runs.sql.

-- fragment: keyed_candidate
-- A claim's first turn of a waiter without a read before it: the run r is a tracked waiter,
-- parked, not cancelled, due (X5), of a workflow in the limits parameter (the declared limits
-- this process knows). Read without a lock: a run's workflow and key never change.
r.run_id = %(run_id)s
AND r.singleton_slot = 'waiter' AND r.singleton_tracked
AND r.status IN ('pending', 'suspended', 'blocked')
AND NOT r.cancel_requested
AND {{is_due}}
AND %(limits)s::jsonb ? r.workflow_name

-- fragment: quota_candidate
-- A claim's first turn of a quota waiter without a read before it: the run r waits in its
-- quotas, parked, not cancelled, due (X5) and, with a singleton key, is its tracked waiter of
-- a workflow in the limits parameter (X3i). A run that carries throttles (and the quota
-- marker with them) is one too: claim_quota_admit admits it under its throttle keys' locks
-- and records the admission (X6c).
r.run_id = %(run_id)s
AND r.quota_slot = 'waiter'
AND r.status IN ('pending', 'suspended', 'blocked')
AND NOT r.cancel_requested
AND {{is_due}}
AND (
    r.singleton_key IS NULL
    OR (r.singleton_slot = 'waiter' AND r.singleton_tracked AND %(limits)s::jsonb ? r.workflow_name)
)

-- fragment: quota_keys
-- A run's quota keys given as two arrays (qwf: the lock names quota:<name>, qkey: the keys),
-- sorted by the caller as the ORM path sorts them, numbered n in that order (X3e).
unnest(%(qwf)s::text[], %(qkey)s::text[]) WITH ORDINALITY qu(wf, key, n)

-- fragment: member_quota_keys
-- A run's quota keys read from its memberships, numbered n in the lock order: by (name, key)
-- in code-point order, as Python sorts them on the ORM path (a UTF-8 database's COLLATE "C").
(
    SELECT 'quota:' || m0.quota AS wf,
           m0.key,
           row_number() OVER (ORDER BY m0.quota COLLATE "C", m0.key COLLATE "C") AS n
    FROM durable_singleton_quotamembership m0
    WHERE m0.run_id = %(run_id)s
) qu

-- name: create_key_if
-- The singleton key's row of a run that has one (the key parameter NULL: none), if missing.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
SELECT STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), %(wf)s::varchar, %(key)s::varchar, 0, FALSE
WHERE %(key)s::varchar IS NOT NULL
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: create_quota_keys
-- Create the run's missing quota key rows, in the lock order.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
SELECT STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), qu.wf, qu.key, 0, FALSE
FROM {{quota_keys}}
ORDER BY qu.n
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: lock_quota_keys
-- Lock the run's quota key rows one by one in the lock order (the sort, then the locks, X3e).
SELECT k.id
FROM durable_singleton_singletonkey k
JOIN {{quota_keys}} ON k.workflow_name = qu.wf AND k.key = qu.key
ORDER BY qu.n
FOR UPDATE OF k

-- name: claim_create_key
-- Create the key row of a claim's candidate waiter if it is missing (its quota keys' come first).
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
SELECT STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), r.workflow_name, r.singleton_key, 0, FALSE
FROM durable_singleton_run r
WHERE {{keyed_candidate}}
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: claim_lock_key
-- Lock the candidate's key row and record that this transaction holds it (S5, S13): each
-- statement of the message takes its own snapshot, so a run that became a candidate after
-- this one is no proof of the lock; the admission writes only for a key row recorded here,
-- as its id, ':', this transaction's id. The record is set for locked rows only (the lock is
-- taken in the subquery, before the outer select list).
SELECT set_config('durable_singleton.claim_locked', l.locked, false)
FROM (
    SELECT (k.id::text || ':' || pg_current_xact_id()::text) AS locked
    FROM durable_singleton_singletonkey k
    JOIN durable_singleton_run r ON k.workflow_name = r.workflow_name AND k.key = r.singleton_key
    WHERE {{keyed_candidate}}
    FOR UPDATE OF k
) l

-- name: claim_create_quota_keys
-- Create the quota key rows of a claim's candidate quota waiter if missing, in the lock order.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
SELECT STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), qu.wf, qu.key, 0, FALSE
FROM {{member_quota_keys}}
JOIN durable_singleton_run r ON r.run_id = %(run_id)s
WHERE {{quota_candidate}}
ORDER BY qu.n
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: claim_lock_quota_keys
-- Lock the candidate's quota key rows in the lock order and record them (their ids in that
-- order, ',' between, then ':' and this transaction's id), as claim_lock_key records its key
-- row: the admission writes only when the record names every quota key of the claimant (X3e).
SELECT set_config(
           'durable_singleton.claim_quota_locked',
           string_agg(l.id::text, ',' ORDER BY l.n) || ':' || pg_current_xact_id()::text,
           false)
FROM (
    SELECT k.id, qu.n
    FROM durable_singleton_singletonkey k
    JOIN {{member_quota_keys}} ON k.workflow_name = qu.wf AND k.key = qu.key
    JOIN durable_singleton_run r ON r.run_id = %(run_id)s
    WHERE {{quota_candidate}}
    ORDER BY qu.n
    FOR UPDATE OF k
) l
HAVING count(*) > 0
