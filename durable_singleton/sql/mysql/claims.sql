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

-- name: ds_claim
-- A turn's claim without a read first (S4, S5, S9, K1, X5), one CALL; shipped by
-- migration 0017_mysql_settle. The run is read on the database's clock, then:
-- a parked, due run without a key or quotas, not cancelled, takes its lease by
-- one compare-and-set on the run as read, after its row lock (R5, R5a); a
-- tracked, parked, due waiter without quotas, not cancelled, of a workflow
-- in ``limits_json`` (its declared limit by name) is admitted or parked under
-- its key's lock, then its own row's (S13), with the same rules as
-- DjangoStore._admit: the key's free slots go to its oldest due waiters
-- (ds_grant_waiters); the claimant takes its lease as a holder with its token
-- if it is among them, else it is parked with the retry delay of a waiter at
-- the front (within the limit) or of the backlog. A parked, due waiter that
-- carries quotas or throttles, not cancelled (with a singleton key: tracked, of a
-- declared workflow) is admitted, parked with its retry delay or parked until
-- its throttle's window opens by ds_admit_quota (migration 0022_mysql_quotas,
-- sql/mysql/quota.sql; its throttles since 0024_mysql_throttles,
-- sql/mysql/throttle.sql). Every other run is only read: the store's ORM path
-- decides (a holder's confirmation, a cancel, a recovery, a delayed start, a
-- workflow this process does not declare), and so it does when the claimant
-- changed between the read and its lock (nothing written). Result sets: the first
-- row's ``ds_role`` says what happened: 'taken', 'admitted', 'parked',
-- 'skipped' (the park's compare failed), 'refused' (the admission's compare
-- failed: nothing written) or 'read' (with ``ds_due`` and ``ds_expired``;
-- no row: no such run), then the run's columns as stored; then a row per
-- waiter 'granted' a slot and per waiter sent a 'turn' (X3h). An admission's and a
-- park's result sets are sent before their COMMIT: a CALL refused in them
-- (ds_send_runs missing) leaves nothing written, and the ORM path claims.
CREATE PROCEDURE ds_claim(
    IN run_to_claim VARCHAR(191) CHARACTER SET utf8mb4,
    IN new_owner VARCHAR(191) CHARACTER SET utf8mb4,
    IN lease_microseconds BIGINT,
    IN limits_json LONGTEXT CHARACTER SET utf8mb4,
    IN ttls_json LONGTEXT CHARACTER SET utf8mb4,
    IN front_delay_microseconds BIGINT,
    IN backlog_delay_microseconds BIGINT,
    IN redelivery_microseconds BIGINT
)
MODIFIES SQL DATA
BEGIN
    DECLARE found INTEGER DEFAULT 0;
    DECLARE status_read VARCHAR(16) CHARACTER SET utf8mb4;
    DECLARE attempts_read INTEGER;
    DECLARE cancel_read BOOLEAN;
    DECLARE wf VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE key_name VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE slot_read VARCHAR(16) CHARACTER SET utf8mb4;
    DECLARE tracked_read BOOLEAN;
    DECLARE quota_slot_read VARCHAR(16) CHARACTER SET utf8mb4;
    DECLARE due BOOLEAN;
    DECLARE declared_limit INTEGER;
    DECLARE ttl_microseconds BIGINT;
    DECLARE key_id BIGINT;
    DECLARE known_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE changed INTEGER DEFAULT 0;
    DECLARE written INTEGER DEFAULT 0;
    DECLARE claimant_token BIGINT;
    DECLARE claimant_front BOOLEAN;
    DECLARE granted_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE turn_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE quota_keys_read INTEGER;
    DECLARE throttle_keys_read INTEGER;
    DECLARE throttles_read LONGTEXT CHARACTER SET utf8mb4;
    DECLARE decided BOOLEAN DEFAULT FALSE;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;  -- never a transaction left open on the caller's connection
        RESIGNAL;  -- a deadlock or a lock wait timeout reaches the store's retry
    END;
    SELECT COUNT(*), MAX(r.status), MAX(r.attempts), MAX(r.cancel_requested), MAX(r.workflow_name),
           MAX(r.singleton_key), MAX(r.singleton_slot), MAX(r.singleton_tracked), MAX(r.quota_slot),
           MAX(r.not_before IS NULL OR r.not_before <= UTC_TIMESTAMP(6)),             -- X5: admission.is_due
           MAX(COALESCE(JSON_LENGTH(r.quota_keys), 0)), MAX(COALESCE(JSON_LENGTH(r.throttle_keys), 0)),
           MAX(r.throttle_keys)
      INTO found, status_read, attempts_read, cancel_read, wf,
           key_name, slot_read, tracked_read, quota_slot_read, due,
           quota_keys_read, throttle_keys_read, throttles_read
      FROM durable_singleton_run r
     WHERE r.run_id = run_to_claim;
    IF found = 1 AND status_read IN ('pending', 'suspended', 'blocked') AND NOT cancel_read AND due
       AND quota_slot_read IS NULL AND key_name IS NULL THEN
        -- A run without a key: its lease, as ds_take_lease takes it (R5, R5a).
        START TRANSACTION;
        SELECT COUNT(*) INTO changed FROM durable_singleton_run WHERE run_id = run_to_claim FOR UPDATE;
        UPDATE durable_singleton_run
           SET status = 'running',
               lease_owner = new_owner,
               lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL lease_microseconds MICROSECOND,
               wake_at = NULL,
               attempts = attempts_read + 1,
               started_at = COALESCE(started_at, UTC_TIMESTAMP(6)),
               updated_at = UTC_TIMESTAMP(6)
         WHERE run_id = run_to_claim
           AND status = status_read                    -- the compare: the run as read (R5a)
           AND attempts = attempts_read
           AND NOT cancel_requested                    -- a cancel after the read wins (R6)
           AND singleton_key IS NULL
           AND quota_slot IS NULL;
        SET written = ROW_COUNT();
        COMMIT;
        IF written > 0 THEN
            SELECT 'taken' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
        ELSE
            SELECT 'read' AS ds_role, r.not_before IS NULL OR r.not_before <= UTC_TIMESTAMP(6) AS ds_due,
                   COALESCE(r.lease_expires_at <= UTC_TIMESTAMP(6), FALSE) AS ds_expired, r.*
              FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
        END IF;
    ELSE
        IF wf IS NOT NULL THEN
            SET declared_limit = CAST(JSON_UNQUOTE(JSON_EXTRACT(limits_json, CONCAT('$.', JSON_QUOTE(wf)))) AS SIGNED);
            SET ttl_microseconds = CAST(JSON_UNQUOTE(JSON_EXTRACT(ttls_json, CONCAT('$.', JSON_QUOTE(wf)))) AS SIGNED);
        END IF;
        IF found = 1 AND status_read IN ('pending', 'suspended', 'blocked') AND NOT cancel_read AND due
           AND quota_slot_read IS NULL AND key_name IS NOT NULL AND tracked_read AND slot_read = 'waiter'
           AND declared_limit IS NOT NULL THEN
            -- The key's row id before the transaction, then its lock (ds_lock_known_key, S13a), then
            -- the run's row (S13).
            CALL ds_key_ids(JSON_ARRAY(), JSON_ARRAY(), wf, key_name, known_ids);
            START TRANSACTION;
            CALL ds_lock_known_key(wf, key_name, JSON_EXTRACT(known_ids, '$[0]'), key_id);
            SELECT COUNT(*) INTO changed
              FROM durable_singleton_run r
             WHERE r.run_id = run_to_claim
               AND NOT (r.status = status_read AND r.attempts = attempts_read AND NOT r.cancel_requested
                        AND r.singleton_slot = 'waiter' AND r.quota_slot IS NULL)
               FOR UPDATE;
            IF changed > 0 THEN
                ROLLBACK;                              -- changed since the read: the ORM path decides
                SET found = 0;
            ELSE
                CALL ds_grant_waiters(wf, key_name, key_id, declared_limit, ttl_microseconds, run_to_claim,
                                      redelivery_microseconds, JSON_ARRAY(), claimant_token, claimant_front,
                                      granted_ids, turn_ids);
                IF claimant_token > 0 THEN
                    UPDATE durable_singleton_run
                       SET status = 'running',
                           lease_owner = new_owner,
                           lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL lease_microseconds MICROSECOND,
                           wake_at = NULL,
                           attempts = attempts_read + 1,
                           started_at = COALESCE(started_at, UTC_TIMESTAMP(6)),
                           updated_at = UTC_TIMESTAMP(6),
                           singleton_slot = 'holder',
                           singleton_tracked = TRUE,
                           fencing_token = claimant_token,
                           admitted_at = UTC_TIMESTAMP(6)
                     WHERE run_id = run_to_claim
                       AND status = status_read            -- the compare: the run as read (R5a)
                       AND attempts = attempts_read
                       AND NOT cancel_requested
                       AND singleton_slot = 'waiter';
                    IF ROW_COUNT() = 0 THEN
                        ROLLBACK;                      -- changed under us: grant nothing (R5a)
                        SELECT 'refused' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
                    ELSE
                        -- The result sets before the COMMIT: a refused CALL (ds_send_runs missing)
                        -- rolls the whole claim back and the ORM path makes it (S4, R5a).
                        SELECT 'admitted' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
                        CALL ds_send_runs('granted', granted_ids);
                        CALL ds_send_runs('turn', turn_ids);
                        COMMIT;
                    END IF;
                ELSE
                    -- Denied: parked with its retry delay, a compare-and-set on the waiter as read (S5 step 5).
                    UPDATE durable_singleton_run
                       SET status = 'suspended',
                           attempts = attempts_read + 1,
                           wake_at = UTC_TIMESTAMP(6) + INTERVAL
                                     IF(claimant_front, front_delay_microseconds, backlog_delay_microseconds) MICROSECOND,
                           lease_owner = NULL,
                           lease_expires_at = NULL,
                           park_reason = 'singleton',
                           updated_at = UTC_TIMESTAMP(6)
                     WHERE run_id = run_to_claim
                       AND status = status_read
                       AND attempts = attempts_read
                       AND NOT cancel_requested
                       AND singleton_slot = 'waiter';
                    SET written = ROW_COUNT();
                    SELECT IF(written > 0, 'parked', 'skipped') AS ds_role, r.*
                      FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
                    CALL ds_send_runs('granted', granted_ids);
                    CALL ds_send_runs('turn', turn_ids);
                    COMMIT;                            -- after the result sets, as an admission's
                END IF;
            END IF;
        ELSEIF found = 1 AND status_read IN ('pending', 'suspended', 'blocked') AND NOT cancel_read AND due
               AND quota_slot_read = 'waiter' AND (quota_keys_read > 0 OR throttle_keys_read > 0)
               AND (key_name IS NULL
                    OR (tracked_read AND slot_read = 'waiter' AND declared_limit IS NOT NULL)) THEN
            -- A waiter that carries quotas or throttles: admitted or parked under the locks of all
            -- its limits (X3c-X3i, X6b-X6d, sql/mysql/quota.sql and throttle.sql).
            CALL ds_admit_quota(run_to_claim, new_owner, lease_microseconds, limits_json, ttls_json,
                                front_delay_microseconds, backlog_delay_microseconds, redelivery_microseconds,
                                status_read, attempts_read, wf, key_name, declared_limit, ttl_microseconds,
                                quota_keys_read, throttles_read, decided);
            IF NOT decided THEN
                SET found = 0;                         -- changed since the read: the ORM path decides
            END IF;
        ELSE
            SET found = 0;
        END IF;
        IF found = 0 THEN                              -- only read: the ORM path decides
            SELECT 'read' AS ds_role, r.not_before IS NULL OR r.not_before <= UTC_TIMESTAMP(6) AS ds_due,
                   COALESCE(r.lease_expires_at <= UTC_TIMESTAMP(6), FALSE) AS ds_expired, r.*
              FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
        END IF;
    END IF;
END
