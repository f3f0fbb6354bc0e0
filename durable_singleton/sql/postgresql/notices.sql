-- The PostgreSQL fast path's turn notices under DISPATCH "worker" (O1, O7):
-- durable_singleton.stores.turns.take_notices. Blocks as in runs.sql.

-- name: take_notices
-- Take up to %(count)s notices of the queues %(queues)s (NULL: every queue), oldest first, and
-- delete them, in one statement and one commit: notices another fetcher holds are skipped, so
-- fetchers never wait on each other (O7). A notice only names a run: its claim decides (S5, R6).
WITH taken AS MATERIALIZED (                   -- locked once, before the delete
    SELECT n0.id
    FROM durable_singleton_turnnotice n0
    WHERE %(queues)s::varchar[] IS NULL OR n0.queue = ANY(%(queues)s::varchar[])
    ORDER BY n0.id
    LIMIT %(count)s::bigint
    FOR UPDATE SKIP LOCKED                     -- another fetcher's notices are left to it
)
DELETE FROM durable_singleton_turnnotice n
USING taken
WHERE n.id = taken.id
RETURNING n.id, n.run_id, n.queue

-- name: fetch_without_flush
-- The first statement of a fetch sent outside a transaction: the message's implicit transaction
-- commits without waiting for its WAL flush (the setting %(flush_setting)s, synchronous_commit,
-- set to %(flush_value)s, off, for this transaction only). A delete of notices lost in a server
-- crash only gives the runs another turn that their claim decides (S5, R6); the claim that
-- follows the fetch commits synchronously and flushes it.
SELECT set_config(%(flush_setting)s, %(flush_value)s, true)
