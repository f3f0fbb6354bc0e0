-- The MariaDB/MySQL room's stored procedures (durable_singleton.stores.mysql).
-- Shipped by migration 0016_mysql_procedures, only on MySQL/MariaDB; one
-- ``-- name:`` block per statement, loaded by name. A CALL is one round trip,
-- whatever the procedure runs inside; the slow-query log and
-- performance_schema show its statements under the procedure's name.

-- name: ds_take_lease
-- The claim of a run that needs no admission: a run without a key, or the
-- confirmation of a holder a handoff or an earlier claim admitted (S6).
-- One transaction: the run's row lock first, so that the lease is counted on
-- the database's clock from after any wait for it (R5, R8); then one
-- compare-and-set on the run as the turn read it, its cancel flag included
-- (R5a, R6, S9). Returns one row, ``runs_taken``: 1 if the lease is ours,
-- 0 if the run changed under the turn (nothing written). The text
-- parameters are utf8mb4, the run id's column a binary utf8mb4 collation:
-- the comparison is exact, whatever the database's default character set.
CREATE PROCEDURE ds_take_lease(
    IN run_to_take VARCHAR(191) CHARACTER SET utf8mb4,
    IN status_as_read VARCHAR(16) CHARACTER SET utf8mb4,
    IN attempts_as_read INTEGER,
    IN cancel_as_read BOOLEAN,
    IN owner_as_read VARCHAR(191) CHARACTER SET utf8mb4,
    IN new_owner VARCHAR(191) CHARACTER SET utf8mb4,
    IN lease_microseconds BIGINT,
    IN recoveries_after INTEGER,
    IN takes_slot BOOLEAN
)
MODIFIES SQL DATA
BEGIN
    DECLARE rows_locked INTEGER DEFAULT 0;
    DECLARE runs_taken INTEGER DEFAULT 0;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;  -- never a transaction left open on the caller's connection
        RESIGNAL;  -- a deadlock or a lock wait timeout reaches the store's retry
    END;
    START TRANSACTION;
    -- The row lock: the UPDATE below starts after it, so its clock does too (R5).
    SELECT COUNT(*) INTO rows_locked
      FROM durable_singleton_run
     WHERE run_id = run_to_take
       FOR UPDATE;
    UPDATE durable_singleton_run
       SET status = 'running',
           lease_owner = new_owner,
           lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL lease_microseconds MICROSECOND,
           wake_at = NULL,
           attempts = attempts_as_read + 1,
           recoveries = recoveries_after,
           started_at = COALESCE(started_at, UTC_TIMESTAMP(6)),
           updated_at = UTC_TIMESTAMP(6),
           singleton_slot = IF(takes_slot, 'holder', singleton_slot),      -- a holder keeps its slot (S6)
           singleton_tracked = IF(takes_slot, TRUE, singleton_tracked)
     WHERE run_id = run_to_take
       AND status = status_as_read                                         -- the compare: the run as read (R5a)
       AND attempts = attempts_as_read
       AND cancel_requested = cancel_as_read                               -- a cancel after the read wins (R6)
       AND (status_as_read <> 'running'                                    -- a recovery: the lease it read, expired
            OR (lease_owner <=> owner_as_read AND lease_expires_at <= UTC_TIMESTAMP(6)));
    SET runs_taken = ROW_COUNT();
    COMMIT;
    SELECT runs_taken;
END
