-- The PostgreSQL fast path's statements on one run and one key row
-- (durable_singleton.stores.pg), one named block each, loaded by name
-- (durable_singleton.sql.statements). A block starts with "-- name: <name>"
-- (a statement) or "-- fragment: <name>" (a piece several statements share,
-- spliced where a statement writes {{<name>}}), then one line that says what it
-- does. Parameters are written %(name)s; the fast path prepares each
-- statement with them as $1, $2, ... Each statement is sent with a leading
-- /* durable_singleton:<name> */ comment, so a line of pg_stat_statements,
-- auto_explain or a slow-query log leads back here.
-- The clocks: STATEMENT_TIMESTAMP() is the message's arrival; CLOCK_TIMESTAMP()
-- is the database's clock as a row is compared or written, after the locks
-- (R5, R5a, R8).

-- fragment: run_columns
-- The run table's columns a RunRecord is built from, in stores.pg.COLUMNS' order (R1).
r.run_id, r.workflow_name, r.workflow_version, r.namespace, r.status, r.input,
r.created_at, r.updated_at, r.output, r.error, r.tags,
r.singleton_key, r.singleton_limit, r.singleton_slot, r.singleton_tracked,
r.wake_at, r.lease_owner, r.lease_expires_at, r.started_at, r.finished_at, r.admitted_at,
r.attempts, r.recoveries, r.parent_run_id, r.park_reason, r.cancel_requested,
r.deadline_at, r.fencing_token, r.step_count, r.not_before, r.quota_slot, r.trace_parent,
r.quota_keys, r.debounce_key, r.debounce_until, r.throttle_keys, r.priority

-- fragment: is_due
-- The run r's delayed start has come by the message's clock (X5): admission.is_due_sql_text.
(r.not_before IS NULL OR r.not_before <= STATEMENT_TIMESTAMP())

-- fragment: take_set
-- A claim's lease: running, owned by the owner parameter until lease seconds after the write (R5, R6).
status = 'running',
lease_owner = %(owner)s,
lease_expires_at = CLOCK_TIMESTAMP() + make_interval(secs => %(lease)s::float8),
wake_at = NULL,                                -- a running run has no wake
attempts = r.attempts + 1,
recoveries = r.recoveries + %(recovered)s,     -- 1 when this claim recovers the run (D4)
started_at = COALESCE(r.started_at, STATEMENT_TIMESTAMP()),
updated_at = STATEMENT_TIMESTAMP()

-- fragment: as_read
-- The compare of a claim on what its turn read (DjangoStore._as_read, R5a, R6, S9).
r.run_id = %(run_id)s
AND r.status = %(status)s
AND r.attempts = %(attempts)s
AND r.cancel_requested = %(cancel)s
AND (
    r.status <> 'running'
    -- a running run is taken over only from the owner read, once its lease expired
    OR (r.lease_owner IS NOT DISTINCT FROM %(read_owner)s AND r.lease_expires_at <= CLOCK_TIMESTAMP())
)

-- fragment: settle_set
-- A settle's write: the end, its output and error, every marker dropped in the same write (S7, X3g).
status = %(final)s,
output = %(output)s::jsonb,
error = %(error)s::jsonb,
singleton_slot = NULL,                         -- the key's slot is free
singleton_tracked = FALSE,
quota_slot = NULL,                             -- and each quota's slot (X3g)
lease_owner = NULL,
lease_expires_at = NULL,
wake_at = NULL,
finished_at = COALESCE(%(finished_at)s, STATEMENT_TIMESTAMP()),
updated_at = STATEMENT_TIMESTAMP()

-- fragment: finish_owned
-- The owner's compare-and-set of a settle: its lease judged after the locks (R5a).
r.status = 'running'
AND r.lease_owner = %(owner)s
AND r.lease_expires_at > CLOCK_TIMESTAMP()

-- name: create_key
-- Create the key's row if it is missing (S13): the first statement of a message that locks it.
INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, key, last_token, paused)
VALUES (STATEMENT_TIMESTAMP(), STATEMENT_TIMESTAMP(), %(wf)s, %(key)s, 0, FALSE)
ON CONFLICT (workflow_name, key) DO NOTHING

-- name: lock_key
-- Lock the key's row (S13): every grant of its slots happens under this lock.
SELECT k.id
FROM durable_singleton_singletonkey k
WHERE k.workflow_name = %(wf)s
  AND k.key = %(key)s
FOR UPDATE

-- name: lock_run
-- Lock the claimant's row in a statement of its own, after its key's (S13), before the
-- statement that writes its lease (R5): an UPDATE that waits for a row another transaction
-- only locked writes the row it computed before the wait, and its lease would come short.
SELECT 1
FROM durable_singleton_run r
WHERE r.run_id = %(run_id)s
FOR UPDATE

-- name: read
-- One read of a run for its turn: its columns, whether its lease expired and whether it is due (R5, X5).
SELECT {{run_columns}},
       r.lease_expires_at <= STATEMENT_TIMESTAMP(),    -- its lease expired
       {{is_due}}                                      -- its delayed start has come
FROM durable_singleton_run r
WHERE r.run_id = %(run_id)s

-- name: get
-- A run's row as stored (R1).
SELECT {{run_columns}}
FROM durable_singleton_run r
WHERE r.run_id = %(run_id)s

-- name: take
-- The confirmation claim of a run without a key (holder false) or of a holder (S6), on the row as read.
UPDATE durable_singleton_run r
SET {{take_set}},
    singleton_slot = CASE WHEN %(holder)s THEN 'holder' ELSE r.singleton_slot END,
    singleton_tracked = r.singleton_tracked OR %(holder)s
WHERE {{as_read}}
RETURNING {{run_columns}}

-- name: take_quota
-- The confirmation claim of a quota holder (X3c, X3f): take's, on a run still marked a quota
-- holder, returning its quota tokens by quota name. No quota key's lock: its memberships change
-- only by a recovery, which changes the run's attempts first, so the compare refuses this claim.
UPDATE durable_singleton_run r
SET {{take_set}},
    singleton_slot = CASE WHEN %(holder)s THEN 'holder' ELSE r.singleton_slot END,
    singleton_tracked = r.singleton_tracked OR %(holder)s
WHERE {{as_read}}
  AND r.quota_slot = 'holder'
RETURNING {{run_columns}},
    (SELECT json_object_agg(m.quota, COALESCE(m.fencing_token, 0))
     FROM durable_singleton_quotamembership m
     WHERE m.run_id = r.run_id)

-- name: claim_take
-- A claim's first turn of a run without a key and without quotas (X3i): its lease, one
-- compare-and-set on the row as the update finds it (no key: no lock, no admission; S4, S6, R5a, R6).
UPDATE durable_singleton_run r
SET {{take_set}}
WHERE r.run_id = %(run_id)s
  AND r.singleton_key IS NULL
  AND r.quota_slot IS NULL
  AND r.status IN ('pending', 'suspended', 'blocked')   -- parked: not running, not ended
  AND NOT r.cancel_requested
  AND {{is_due}}
RETURNING {{run_columns}}

-- name: settle
-- The settle of a run without a key and without quotas: the owner's compare-and-set alone (S7, R5a).
UPDATE durable_singleton_run r
SET {{settle_set}}
WHERE r.run_id = %(run_id)s
  AND {{finish_owned}}
RETURNING 0, {{run_columns}}
