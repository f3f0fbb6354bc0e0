-- The MariaDB/MySQL room's grants and handoffs (durable_singleton.stores.mysql).
-- Shipped by migration 0017_mysql_settle (again by 0021 and 0022), only on MySQL/MariaDB; one
-- ``-- name:`` block per procedure, loaded by name (durable_singleton.sql). The
-- rules are the ORM path's (DjangoStore._grant, DjangoStore._finish), carried
-- out here in one CALL: the decision who is admitted is the same, the SQL
-- spells it for this database. Every time is the database's clock,
-- UTC_TIMESTAMP(6), read per statement inside a procedure (R5, R8).

-- name: ds_grant_waiters
-- Give a locked key's free slots to its first due waiters (S5, S7, S12, K1, K2, X2, X5, X8),
-- inside the caller's transaction, after the caller locked the key's row (S13).
-- The queue's front is one read of ds_run_queue_idx, at most twice the limit in force
-- rows: the holders first ('holder' sorts before 'waiter'), then the due waiters in
-- admission order (priority DESC, created_at, run_id: admission.QUEUE_ORDER, X8; re-created
-- by migration 0019_run_priority), a waiter past its queue_ttl left out (X2). Each grant is a
-- compare-and-set on the waiter as read with the next token of the key (K1); a waiter
-- that carries quotas keeps its place and is only named, its own claim decides under
-- the locks of all its limits (X3h), unless it is one of ``carrier_ids`` (a JSON array:
-- the carriers a handoff admits, ds_settle_quotas), which takes its quota slot with the
-- grant (the caller gives its quota tokens). OUT: the claimant's token if it is within the
-- free slots (0: not; it is not written here), whether it is at the queue's front
-- (within the limit: its retry delay), and the run ids granted and sent a turn, as
-- JSON arrays, for the caller to send before its COMMIT.
CREATE PROCEDURE ds_grant_waiters(
    IN wf VARCHAR(191) CHARACTER SET utf8mb4,
    IN key_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN key_id BIGINT,
    IN declared_limit INTEGER,
    IN ttl_microseconds BIGINT,
    IN claimant VARCHAR(191) CHARACTER SET utf8mb4,
    IN redelivery_microseconds BIGINT,
    IN carrier_ids LONGTEXT CHARACTER SET utf8mb4,
    OUT claimant_token BIGINT,
    OUT claimant_front BOOLEAN,
    OUT granted_ids LONGTEXT CHARACTER SET utf8mb4,
    OUT turn_ids LONGTEXT CHARACTER SET utf8mb4
)
MODIFIES SQL DATA
BEGIN
    DECLARE last_token_read BIGINT;
    DECLARE token BIGINT;
    DECLARE paused_read BOOLEAN;
    DECLARE limit_in_force INTEGER;
    DECLARE legacy_holders INTEGER DEFAULT 0;
    DECLARE front_holders INTEGER DEFAULT 0;
    DECLARE free_slots INTEGER DEFAULT -1;             -- -1: not counted yet (no waiter reached)
    DECLARE waiter_place INTEGER DEFAULT 0;
    SET claimant_token = 0;
    SET claimant_front = FALSE;
    SET granted_ids = JSON_ARRAY();
    SET turn_ids = JSON_ARRAY();
    -- The key's row, locked by the caller, with its limit in force (K2):
    -- admission.limit_in_force: the override, else the declared limit, never below 1.
    SELECT k.last_token, k.paused,
           CASE WHEN COALESCE(k.limit_override, declared_limit, 1) < 1 THEN 1
                ELSE COALESCE(k.limit_override, declared_limit, 1) END
      INTO last_token_read, paused_read, limit_in_force
      FROM durable_singleton_singletonkey k
     WHERE k.id = key_id;
    SET token = last_token_read;
    -- An older release's untracked holders (S12): admission.legacy_holder_q.
    SELECT COUNT(*) INTO legacy_holders
      FROM durable_singleton_run l
     WHERE l.workflow_name = wf AND l.singleton_key = key_name
       AND NOT l.singleton_tracked
       AND l.status IN ('running', 'suspended', 'blocked');
    front: BEGIN
        DECLARE done BOOLEAN DEFAULT FALSE;
        DECLARE row_id VARCHAR(191) CHARACTER SET utf8mb4;
        DECLARE row_status VARCHAR(16) CHARACTER SET utf8mb4;
        DECLARE row_slot VARCHAR(16) CHARACTER SET utf8mb4;
        DECLARE row_quota_slot VARCHAR(16) CHARACTER SET utf8mb4;
        DECLARE row_holds BOOLEAN;
        DECLARE front_rows BIGINT DEFAULT 2 * limit_in_force;   -- BIGINT: a limit up to MAX_LIMIT doubles past INT
        -- The holders and the queue's front, in its order (S5, X5, X8; QuerySet.queue_front).
        DECLARE queue CURSOR FOR
            SELECT q.run_id, q.status, q.singleton_slot, q.quota_slot,
                   (q.singleton_slot = 'holder' AND q.status IN ('pending', 'running', 'suspended', 'blocked'))
                   OR (NOT q.singleton_tracked AND q.status IN ('running', 'suspended', 'blocked'))
              FROM durable_singleton_run q
             WHERE q.workflow_name = wf AND q.singleton_key = key_name
               AND q.singleton_slot IS NOT NULL
               AND (q.singleton_slot = 'holder' OR q.not_before IS NULL OR q.not_before <= UTC_TIMESTAMP(6))
               AND (q.singleton_slot <> 'waiter' OR ttl_microseconds IS NULL     -- X2: past its TTL, no slot
                    OR q.created_at > UTC_TIMESTAMP(6) - INTERVAL ttl_microseconds MICROSECOND)
             ORDER BY q.singleton_slot, q.priority DESC, q.created_at, q.run_id
             LIMIT front_rows;
        DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
        OPEN queue;
        each_row: LOOP
            FETCH queue INTO row_id, row_status, row_slot, row_quota_slot, row_holds;
            IF done THEN
                LEAVE each_row;
            END IF;
            IF row_holds THEN
                SET front_holders = front_holders + 1;
            END IF;
            IF row_slot = 'waiter' THEN
                IF free_slots < 0 THEN                 -- the holders sort first: all counted (S5, K2)
                    SET free_slots = IF(paused_read, 0,
                                        GREATEST(limit_in_force - front_holders - legacy_holders, 0));
                END IF;
                SET waiter_place = waiter_place + 1;
                IF row_id = claimant AND waiter_place <= limit_in_force THEN
                    SET claimant_front = TRUE;
                END IF;
                IF waiter_place <= free_slots THEN
                    IF row_id = claimant THEN
                        SET token = token + 1;
                        SET claimant_token = token;     -- written by the caller's compare-and-set
                    ELSEIF row_quota_slot IS NOT NULL
                           AND NOT COALESCE(JSON_CONTAINS(carrier_ids, JSON_QUOTE(row_id)), FALSE) THEN
                        SET turn_ids = JSON_ARRAY_APPEND(turn_ids, '$', row_id);   -- X3h
                    ELSE
                        SET token = token + 1;          -- as DjangoStore._grant: a lost compare skips it
                        UPDATE durable_singleton_run
                           SET singleton_slot = 'holder',
                               singleton_tracked = TRUE,
                               fencing_token = token,
                               admitted_at = UTC_TIMESTAMP(6),
                               wake_at = UTC_TIMESTAMP(6) + INTERVAL redelivery_microseconds MICROSECOND,
                               updated_at = UTC_TIMESTAMP(6),
                               quota_slot = IF(row_quota_slot IS NULL, NULL, 'holder')   -- a carrier's quota slot
                         WHERE run_id = row_id
                           AND status = row_status               -- the compare: the waiter as read (R5a)
                           AND singleton_slot = 'waiter'
                           AND NOT cancel_requested
                           AND IF(row_quota_slot IS NULL, quota_slot IS NULL, quota_slot = 'waiter');
                        IF ROW_COUNT() > 0 THEN
                            SET granted_ids = JSON_ARRAY_APPEND(granted_ids, '$', row_id);
                        END IF;
                    END IF;
                END IF;
            END IF;
        END LOOP;
        CLOSE queue;
    END front;
    IF token <> last_token_read THEN                   -- the key's counter moves past every token (K1)
        UPDATE durable_singleton_singletonkey SET last_token = token WHERE id = key_id;
    END IF;
END

-- name: ds_send_runs
-- The result sets of a grant, inside the caller's transaction, before its COMMIT (a refused
-- CALL of it rolls the caller's writes back): one row per run id of the JSON array ``ids``,
-- its columns as stored, headed by ``role`` ('granted' or 'turn').
CREATE PROCEDURE ds_send_runs(
    IN role VARCHAR(16) CHARACTER SET utf8mb4,
    IN ids LONGTEXT CHARACTER SET utf8mb4
)
READS SQL DATA
BEGIN
    DECLARE place INTEGER DEFAULT 0;
    WHILE place < JSON_LENGTH(ids) DO
        SELECT role AS ds_role, r.*
          FROM durable_singleton_run r
         WHERE r.run_id = JSON_UNQUOTE(JSON_EXTRACT(ids, CONCAT('$[', place, ']')));
        SET place = place + 1;
    END WHILE;
END

-- name: ds_settle_handoff
-- The settle of a run with a singleton key and no quotas, and the handoff of its slot,
-- in one transaction (S7, S12, R5a, K1, S13): the key's row locked first (created if a
-- run of an older release left none), then the settle, a compare-and-set on the owner's
-- unexpired lease judged after the lock, every marker dropped in the same write; then
-- the key's free slots granted (ds_grant_waiters); the result sets are sent before the
-- COMMIT, so a refused CALL in them leaves nothing written. Result sets: none with a row when
-- the compare failed (nothing written: another owner, a lost lease); else one
-- 'settled' row, then a row per waiter 'granted' a slot, then a row per waiter sent a
-- 'turn' as it is (it carries quotas, X3h), each with the run's columns as stored.
CREATE PROCEDURE ds_settle_handoff(
    IN run_to_settle VARCHAR(191) CHARACTER SET utf8mb4,
    IN owner VARCHAR(191) CHARACTER SET utf8mb4,
    IN final_status VARCHAR(16) CHARACTER SET utf8mb4,
    IN output_json LONGTEXT CHARACTER SET utf8mb4,
    IN error_json LONGTEXT CHARACTER SET utf8mb4,
    IN finished DATETIME(6),
    IN wf VARCHAR(191) CHARACTER SET utf8mb4,
    IN key_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN declared_limit INTEGER,
    IN ttl_microseconds BIGINT,
    IN redelivery_microseconds BIGINT
)
MODIFIES SQL DATA
BEGIN
    DECLARE key_id BIGINT;
    DECLARE known_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE settled INTEGER DEFAULT 0;
    DECLARE claimant_token BIGINT;
    DECLARE claimant_front BOOLEAN;
    DECLARE granted_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE turn_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;  -- never a transaction left open on the caller's connection
        RESIGNAL;  -- a deadlock or a lock wait timeout reaches the store's retry
    END;
    -- The key's row id before the transaction, then its lock first: the lock order of every
    -- path (S13), no gap lock (ds_lock_known_key, S13a; a run of an older release may have left no row).
    CALL ds_key_ids(JSON_ARRAY(), JSON_ARRAY(), wf, key_name, known_ids);
    START TRANSACTION;
    CALL ds_lock_known_key(wf, key_name, JSON_EXTRACT(known_ids, '$[0]'), key_id);
    UPDATE durable_singleton_run
       SET status = final_status,
           output = output_json,
           error = error_json,
           singleton_slot = NULL,                      -- the key's slot is free
           singleton_tracked = FALSE,
           quota_slot = NULL,
           lease_owner = NULL,
           lease_expires_at = NULL,
           wake_at = NULL,
           finished_at = COALESCE(finished, UTC_TIMESTAMP(6)),
           updated_at = UTC_TIMESTAMP(6)
     WHERE run_id = run_to_settle
       AND status = 'running'                          -- R5a: its owner, lease unexpired after the lock
       AND lease_owner = owner
       AND lease_expires_at > UTC_TIMESTAMP(6);
    SET settled = ROW_COUNT();
    IF settled = 0 THEN
        ROLLBACK;
    ELSE
        CALL ds_grant_waiters(wf, key_name, key_id, declared_limit, ttl_microseconds, NULL,
                              redelivery_microseconds, JSON_ARRAY(), claimant_token, claimant_front,
                              granted_ids, turn_ids);
        -- The result sets before the COMMIT: a refused CALL (ds_send_runs missing) rolls the
        -- settle and its grants back and the ORM path settles (S7, R5a).
        SELECT 'settled' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_settle;
        CALL ds_send_runs('granted', granted_ids);
        CALL ds_send_runs('turn', turn_ids);
        COMMIT;
    END IF;
END
