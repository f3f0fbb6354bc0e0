-- The MariaDB/MySQL room's shared quotas (durable_singleton.stores.mysql): how a quota
-- waiter is admitted on MariaDB, by its own claim (ds_admit_quota, called by ds_claim)
-- or by the handoff of a run that carries quotas (ds_settle_quotas), and how a quota
-- holder confirms its lease (ds_take_quota_lease). Shipped by migration
-- 0022_mysql_quotas, only on MySQL/MariaDB; one ``-- name:`` block per procedure, loaded
-- by name (durable_singleton.sql). The rules are the ORM path's (DjangoStore._quota_turn,
-- DjangoStore._finish, admission.handoff_admits), carried out here in one CALL; the
-- PostgreSQL twin is sql/postgresql/quota.sql. The lock order of every path: the quota
-- keys sorted by (quota, key), then the singleton key, then the run's row (X3e, S13).
-- Every time is the database's clock, UTC_TIMESTAMP(6) (R5, R8). A waiter that carries
-- throttles (X6) is claimed by ds_admit_quota too, its throttle keys locked before all these
-- (sql/mysql/throttle.sql, migration 0024_mysql_throttles); a handoff never admits it.

-- name: ds_lock_key
-- Lock a key's row inside the caller's transaction, created if missing, the caller having
-- read no id for it: ds_lock_known_key with none (its OUT: the row's id). Kept with the
-- signature of migration 0022 for a procedure of an older release still calling it during
-- a rolling deploy; this release's procedures call ds_lock_known_key.
CREATE PROCEDURE ds_lock_key(
    IN lock_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN lock_key_name VARCHAR(191) CHARACTER SET utf8mb4,
    OUT locked_id BIGINT
)
MODIFIES SQL DATA
BEGIN
    CALL ds_lock_known_key(lock_name, lock_key_name, NULL, locked_id);
END

-- name: ds_lock_known_key
-- Lock a key's row inside the caller's transaction, created if missing: a singleton key
-- (its workflow's name) or a quota or throttle key (``quota:<name>``, ``throttle:<name>``,
-- X3b, X6). ``known_id``: the row's id as the caller read it before its transaction
-- (ds_key_ids; 0 or NULL: no row then). A known row is locked by its primary key: the record
-- alone, as DjangoStore.lock_key locks a row it knows. A row not known is locked by an
-- upsert, which creates a missing row without the gap lock a SELECT ... FOR UPDATE of a
-- missing row takes at REPEATABLE READ (S13a). Not the upsert for a row the caller saw: on
-- a row that exists its duplicate check takes a next-key lock, whose wait covers the gap
-- before the row in the key table's unique index, and a holder of the row that creates a
-- key row in that gap (the next key by name) then deadlocks with the waiter (the upsert
-- meets that only for a row created since the caller's read). OUT: the row's id.
CREATE PROCEDURE ds_lock_known_key(
    IN lock_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN lock_key_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN known_id BIGINT,
    OUT locked_id BIGINT
)
MODIFIES SQL DATA
BEGIN
    SET locked_id = NULL;
    IF known_id > 0 THEN
        SELECT MAX(k.id) INTO locked_id
          FROM durable_singleton_singletonkey k
         WHERE k.id = known_id AND k.workflow_name = lock_name AND k.`key` = lock_key_name
           FOR UPDATE;
    END IF;
    IF locked_id IS NULL THEN                      -- not known, or deleted since: the upsert
        INSERT INTO durable_singleton_singletonkey (created, modified, workflow_name, `key`, last_token, paused)
        VALUES (UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), lock_name, lock_key_name, 0, FALSE)
        ON DUPLICATE KEY UPDATE last_token = last_token;
        SELECT MAX(k.id) INTO locked_id
          FROM durable_singleton_singletonkey k
         WHERE k.workflow_name = lock_name AND k.`key` = lock_key_name
           FOR UPDATE;                              -- ours already: no wait
    END IF;
END

-- name: ds_key_ids
-- The ids of the key rows a claim or a settle locks, in its lock order (X3e, X6c): its
-- throttle keys (``throttles_json``, [[name, key, ...], ...] in order, as
-- ds_throttle_keys_of returns them), its quota keys (``quota_keys_json``, [[quota, key],
-- ...] in order, as ds_quota_keys_of returns them), then its singleton key (``wf``,
-- ``key_name``; NULL: none). Read before the caller's transaction starts: each a
-- consistent read of its own statement, no lock, and no snapshot left for the
-- transaction (its reads after its locks see what was committed before them, S13a).
-- OUT ``ids_json``: their ids in that order (the ``known_id`` each ds_lock_known_key is
-- given), 0 for a row that does not exist (no JSON_TABLE: MariaDB 10.5 has none).
CREATE PROCEDURE ds_key_ids(
    IN throttles_json LONGTEXT CHARACTER SET utf8mb4,
    IN quota_keys_json LONGTEXT CHARACTER SET utf8mb4,
    IN wf VARCHAR(191) CHARACTER SET utf8mb4,
    IN key_name VARCHAR(191) CHARACTER SET utf8mb4,
    OUT ids_json LONGTEXT CHARACTER SET utf8mb4
)
READS SQL DATA
BEGIN
    DECLARE names_json LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';   -- [[lock name, key], ...]
    DECLARE place INTEGER DEFAULT 0;
    DECLARE found_id BIGINT;
    WHILE place < COALESCE(JSON_LENGTH(throttles_json), 0) DO
        SET names_json = JSON_ARRAY_APPEND(names_json, '$', JSON_ARRAY(
            CONCAT('throttle:', JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', place, '][0]')))),
            JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', place, '][1]')))));
        SET place = place + 1;
    END WHILE;
    SET place = 0;
    WHILE place < COALESCE(JSON_LENGTH(quota_keys_json), 0) DO
        SET names_json = JSON_ARRAY_APPEND(names_json, '$', JSON_ARRAY(
            CONCAT('quota:', JSON_UNQUOTE(JSON_EXTRACT(quota_keys_json, CONCAT('$[', place, '][0]')))),
            JSON_UNQUOTE(JSON_EXTRACT(quota_keys_json, CONCAT('$[', place, '][1]')))));
        SET place = place + 1;
    END WHILE;
    IF key_name IS NOT NULL THEN
        SET names_json = JSON_ARRAY_APPEND(names_json, '$', JSON_ARRAY(wf, key_name));
    END IF;
    SET ids_json = JSON_ARRAY();
    SET place = 0;
    WHILE place < JSON_LENGTH(names_json) DO
        SELECT COALESCE(MAX(k.id), 0) INTO found_id
          FROM durable_singleton_singletonkey k
         WHERE k.workflow_name = JSON_UNQUOTE(JSON_EXTRACT(names_json, CONCAT('$[', place, '][0]')))
           AND k.`key` = JSON_UNQUOTE(JSON_EXTRACT(names_json, CONCAT('$[', place, '][1]')));
        SET ids_json = JSON_ARRAY_APPEND(ids_json, '$', found_id);
        SET place = place + 1;
    END WHILE;
END

-- name: ds_quota_keys_of
-- The quota keys a run carries (X3b), from its memberships, in the one lock order: sorted
-- by quota then key, binary (the columns' utf8mb4 binary collation sorts by code point, as
-- Python sorts the pairs, DjangoStore._lock_quota_keys). Read before the caller's
-- transaction starts, so that no snapshot is taken before the locks (S13a). OUT: a JSON
-- array of [quota, key] pairs.
CREATE PROCEDURE ds_quota_keys_of(
    IN member_run VARCHAR(191) CHARACTER SET utf8mb4,
    OUT keys_json LONGTEXT CHARACTER SET utf8mb4
)
READS SQL DATA
BEGIN
    DECLARE done BOOLEAN DEFAULT FALSE;
    DECLARE member_quota VARCHAR(64) CHARACTER SET utf8mb4;
    DECLARE member_key VARCHAR(127) CHARACTER SET utf8mb4;
    DECLARE members CURSOR FOR
        SELECT m.quota, m.`key`
          FROM durable_singleton_quotamembership m
         WHERE m.run_id = member_run
         ORDER BY m.quota, m.`key`;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
    SET keys_json = JSON_ARRAY();
    OPEN members;
    each_member: LOOP
        FETCH members INTO member_quota, member_key;
        IF done THEN
            LEAVE each_member;
        END IF;
        SET keys_json = JSON_ARRAY_APPEND(keys_json, '$', JSON_ARRAY(member_quota, member_key));
    END LOOP;
    CLOSE members;
END

-- name: ds_quota_front
-- A locked quota key's free slots and its first due waiters (X3c, X3d, X4, X5, X2, K2),
-- as DjangoStore._quota_front reads them, inside the caller's transaction after the key's
-- lock. The limit in force: the key's override, else the declared one in ``limits_json``
-- under ``quota:<name>``, 1 if absent, never below 1; no free slot while paused. The
-- holders: memberships marked 'holder' of an active run. The waiters: memberships marked
-- 'waiter' of an active, due run not past its workflow's queue_ttl (``ttls_json``,
-- microseconds by workflow name), in admission order (admission.QUOTA_ORDER, read along
-- ds_quota_order_idx), as many as the limit. OUT: the free slots, the waiters' run ids (a
-- JSON array, in order), and the place of ``claimant`` among them (1-based; 0: absent).
CREATE PROCEDURE ds_quota_front(
    IN front_quota VARCHAR(64) CHARACTER SET utf8mb4,
    IN front_key VARCHAR(127) CHARACTER SET utf8mb4,
    IN front_key_id BIGINT,
    IN limits_json LONGTEXT CHARACTER SET utf8mb4,
    IN ttls_json LONGTEXT CHARACTER SET utf8mb4,
    IN claimant VARCHAR(191) CHARACTER SET utf8mb4,
    OUT front_free INTEGER,
    OUT front_ids LONGTEXT CHARACTER SET utf8mb4,
    OUT claimant_place INTEGER
)
READS SQL DATA
BEGIN
    DECLARE declared INTEGER;
    DECLARE override_read INTEGER;
    DECLARE paused_read BOOLEAN;
    DECLARE limit_in_force INTEGER DEFAULT 1;
    DECLARE holders INTEGER DEFAULT 0;
    DECLARE waiter_place INTEGER DEFAULT 0;
    DECLARE done BOOLEAN DEFAULT FALSE;
    DECLARE waiter_id VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE waiters CURSOR FOR
        SELECT m.run_id
          FROM durable_singleton_quotamembership m
          JOIN durable_singleton_run mr ON mr.run_id = m.run_id
         WHERE m.quota = front_quota AND m.`key` = front_key
           AND m.slot = 'waiter'
           AND mr.status IN ('pending', 'running', 'suspended', 'blocked')
           AND (mr.not_before IS NULL OR mr.not_before <= UTC_TIMESTAMP(6))           -- X5: due
           AND NOT COALESCE(mr.created_at <= UTC_TIMESTAMP(6) - INTERVAL             -- X2: not past its TTL
                   CAST(JSON_UNQUOTE(JSON_EXTRACT(ttls_json, CONCAT('$.', JSON_QUOTE(mr.workflow_name)))) AS SIGNED)
                   MICROSECOND, FALSE)
         ORDER BY m.tag, m.priority DESC, m.created_at, m.run_id                      -- X3d, X4, X8
         LIMIT limit_in_force;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
    SET declared = CAST(JSON_UNQUOTE(JSON_EXTRACT(limits_json, CONCAT('$.', JSON_QUOTE(CONCAT('quota:', front_quota)))))
                        AS SIGNED);
    SELECT k.limit_override, k.paused INTO override_read, paused_read
      FROM durable_singleton_singletonkey k
     WHERE k.id = front_key_id;
    SET limit_in_force = CASE WHEN COALESCE(override_read, declared, 1) < 1 THEN 1
                              ELSE COALESCE(override_read, declared, 1) END;          -- admission.limit_in_force
    SELECT COUNT(*) INTO holders                                                      -- admission.holds_quota_slot_q
      FROM durable_singleton_quotamembership m
      JOIN durable_singleton_run mr ON mr.run_id = m.run_id
     WHERE m.quota = front_quota AND m.`key` = front_key
       AND m.slot = 'holder'
       AND mr.status IN ('pending', 'running', 'suspended', 'blocked');
    SET front_free = IF(paused_read, 0, GREATEST(limit_in_force - holders, 0));       -- admission.free_slots
    SET front_ids = JSON_ARRAY();
    SET claimant_place = 0;
    OPEN waiters;
    each_waiter: LOOP
        FETCH waiters INTO waiter_id;
        IF done THEN
            LEAVE each_waiter;
        END IF;
        SET waiter_place = waiter_place + 1;
        SET front_ids = JSON_ARRAY_APPEND(front_ids, '$', waiter_id);
        IF waiter_id = claimant THEN
            SET claimant_place = waiter_place;
        END IF;
    END LOOP;
    CLOSE waiters;
END

-- name: ds_admit_quota
-- The claim of a waiter that carries quotas or throttles (X3c, X3d, X3e, X3f, X3i, X6b-X6d,
-- S5, K1), called by ds_claim with the run as it read it (a parked, due, uncancelled waiter;
-- with a singleton key, a tracked waiter of a declared workflow), as DjangoStore._quota_turn
-- admits it. One transaction: its throttle keys locked in order (ds_throttle_keys_of, only a
-- claim locks them), then its quota keys in order, then its singleton key, then its row,
-- unchanged since the read (else nothing is decided here: ``decided`` FALSE, the ORM path
-- decides; so too when its quota memberships and its quota_keys column disagree). The
-- database's clock is read once after the locks (``now_at``) when it carries throttles: each
-- throttle key's window is counted at it (ds_throttle_front, sql/mysql/throttle.sql) and its
-- admission is recorded at it. It is admitted when it is within the free slots of each of
-- its quota keys and the free admissions of each of its throttle keys (X3d, X6c) and, with a
-- singleton key, the key's grant reaches it (ds_grant_waiters, whose other grants are written
-- whenever its other limits admit it); then it takes its lease, a slot and the next token of
-- each quota key by a compare-and-set on the run as read (R5a), and a ThrottleAdmission row
-- per throttle key at ``now_at`` (its admitted_at too). Else, when a throttle key's free
-- admissions do not reach it and the key has an opening, it is parked until the latest such
-- opening (ties: the larger throttle name), its wake_at and not_before there and its park
-- reason throttled:<name> (X6d, DjangoStore._park_throttled); else it is parked with the
-- retry delay of a waiter at the front (within the first limit waiters of its singleton key
-- once its other limits admit it, else of each quota and throttle key) or of the backlog
-- (S5 step 5). Result sets, as ds_claim's: 'admitted' (with ``ds_tokens``, its token by quota
-- name), 'parked', 'skipped' (the park's compare failed) or 'refused' (the admission's
-- compare failed: nothing written), with the run's columns as stored; then the waiters
-- 'granted' a slot and those sent a 'turn' as they are (X3h), the waiters behind it within
-- its quota keys' free slots and its throttle keys' free admissions among them (X3d). Sent
-- before the COMMIT. Shipped by migration 0022_mysql_quotas; its throttles by
-- 0024_mysql_throttles.
CREATE PROCEDURE ds_admit_quota(
    IN run_to_claim VARCHAR(191) CHARACTER SET utf8mb4,
    IN new_owner VARCHAR(191) CHARACTER SET utf8mb4,
    IN lease_microseconds BIGINT,
    IN limits_json LONGTEXT CHARACTER SET utf8mb4,
    IN ttls_json LONGTEXT CHARACTER SET utf8mb4,
    IN front_delay_microseconds BIGINT,
    IN backlog_delay_microseconds BIGINT,
    IN redelivery_microseconds BIGINT,
    IN status_read VARCHAR(16) CHARACTER SET utf8mb4,
    IN attempts_read INTEGER,
    IN wf VARCHAR(191) CHARACTER SET utf8mb4,
    IN key_name VARCHAR(191) CHARACTER SET utf8mb4,
    IN declared_limit INTEGER,
    IN ttl_microseconds BIGINT,
    IN quotas_carried INTEGER,
    IN throttles_carried LONGTEXT CHARACTER SET utf8mb4,
    OUT decided BOOLEAN
)
MODIFIES SQL DATA
admit: BEGIN
    DECLARE keys_json LONGTEXT CHARACTER SET utf8mb4;
    DECLARE key_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE keys_count INTEGER DEFAULT 0;
    DECLARE key_place INTEGER DEFAULT 0;
    DECLARE member_quota VARCHAR(64) CHARACTER SET utf8mb4;
    DECLARE member_key VARCHAR(127) CHARACTER SET utf8mb4;
    DECLARE member_key_id BIGINT;
    DECLARE single_key_id BIGINT;
    DECLARE throttles_json LONGTEXT CHARACTER SET utf8mb4;
    DECLARE throttle_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE throttles_count INTEGER DEFAULT 0;
    DECLARE throttle_name VARCHAR(64) CHARACTER SET utf8mb4;
    DECLARE throttle_limit BIGINT;
    DECLARE override_read INTEGER;
    DECLARE paused_read BOOLEAN;
    DECLARE front_opening DATETIME(6);
    DECLARE opening DATETIME(6) DEFAULT NULL;           -- over the rate: the latest opening that denies it
    DECLARE opening_throttle VARCHAR(64) CHARACTER SET utf8mb4 DEFAULT NULL;
    DECLARE now_at DATETIME(6) DEFAULT NULL;
    DECLARE changed INTEGER DEFAULT 0;
    DECLARE front_free INTEGER;
    DECLARE front_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE claimant_place INTEGER;
    DECLARE reaches BOOLEAN DEFAULT TRUE;
    DECLARE at_front BOOLEAN DEFAULT TRUE;
    DECLARE behind_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE behind_taken INTEGER;
    DECLARE id_place INTEGER;
    DECLARE waiter_id VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE claimant_token BIGINT DEFAULT 0;
    DECLARE claimant_front BOOLEAN DEFAULT FALSE;
    DECLARE granted_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE known_ids LONGTEXT CHARACTER SET utf8mb4;                -- their ids before the transaction (ds_key_ids)
    DECLARE turn_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE more_turn_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE token_read BIGINT;
    DECLARE tokens LONGTEXT CHARACTER SET utf8mb4 DEFAULT '{}';
    DECLARE written INTEGER DEFAULT 0;
    SET decided = FALSE;
    CALL ds_throttle_keys_of(throttles_carried, throttles_json);
    SET throttles_count = JSON_LENGTH(throttles_json);
    SET keys_json = JSON_ARRAY();
    IF quotas_carried > 0 THEN
        CALL ds_quota_keys_of(run_to_claim, keys_json);
    END IF;
    SET keys_count = JSON_LENGTH(keys_json);
    IF (keys_count = 0 AND throttles_count = 0) OR (keys_count > 0) <> (quotas_carried > 0) THEN
        LEAVE admit;                                   -- its memberships and its columns disagree: the ORM path (X3b)
    END IF;
    -- The ids of the key rows it locks, read before the transaction (ds_lock_known_key, S13a).
    CALL ds_key_ids(throttles_json, keys_json, wf, key_name, known_ids);
    START TRANSACTION;
    -- The locks of all its limits: its throttle keys in order, its quota keys in order, its
    -- singleton key, its row (X3e, X6c, S13).
    -- Each throttle key's row is locked by ds_lock_known_key (S13a), its controls read with the
    -- lock (K2): its limit in force, the key's override, else
    -- the declared one in ``limits_json`` under throttle:<name>, else the one the run's start
    -- recorded, never below 1 (admission.declared_limit, admission.limit_in_force); its pause.
    SET key_place = 0;
    WHILE key_place < throttles_count DO
        SET throttle_name = JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][1]')));
        CALL ds_lock_known_key(CONCAT('throttle:', throttle_name), member_key,
                               JSON_EXTRACT(known_ids, CONCAT('$[', key_place, ']')), member_key_id);
        SELECT MAX(k.limit_override), MAX(k.paused) INTO override_read, paused_read
          FROM durable_singleton_singletonkey k
         WHERE k.id = member_key_id
           FOR UPDATE;                                  -- ours already: its values as committed
        SET throttle_limit = COALESCE(
            override_read,
            CAST(JSON_UNQUOTE(JSON_EXTRACT(limits_json, CONCAT('$.', JSON_QUOTE(CONCAT('throttle:', throttle_name)))))
                 AS SIGNED),
            CAST(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][2]')) AS SIGNED),
            1);
        SET throttle_ids = JSON_ARRAY_APPEND(throttle_ids, '$',
                                             JSON_ARRAY(IF(throttle_limit < 1, 1, throttle_limit), IF(paused_read, 1, 0)));
        SET key_place = key_place + 1;
    END WHILE;
    SET key_place = 0;
    WHILE key_place < keys_count DO
        SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][1]')));
        CALL ds_lock_known_key(CONCAT('quota:', member_quota), member_key,
                               JSON_EXTRACT(known_ids, CONCAT('$[', throttles_count + key_place, ']')), member_key_id);
        SET key_ids = JSON_ARRAY_APPEND(key_ids, '$', member_key_id);
        SET key_place = key_place + 1;
    END WHILE;
    IF key_name IS NOT NULL THEN
        CALL ds_lock_known_key(wf, key_name, JSON_EXTRACT(known_ids, CONCAT('$[', throttles_count + keys_count, ']')),
                               single_key_id);
    END IF;
    SELECT COUNT(*) INTO changed
      FROM durable_singleton_run r
     WHERE r.run_id = run_to_claim
       AND NOT (r.status = status_read AND r.attempts = attempts_read AND NOT r.cancel_requested
                AND r.quota_slot = 'waiter')
       FOR UPDATE;
    IF changed > 0 THEN
        ROLLBACK;                                      -- changed since the read: the ORM path decides
        LEAVE admit;
    END IF;
    SET decided = TRUE;
    -- Each quota key's front: within the free slots of every one, at the front of each (X3c, X3d).
    SET key_place = 0;
    WHILE key_place < keys_count DO
        SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][1]')));
        SET member_key_id = JSON_EXTRACT(key_ids, CONCAT('$[', key_place, ']'));
        CALL ds_quota_front(member_quota, member_key, member_key_id, limits_json, ttls_json, run_to_claim,
                            front_free, front_ids, claimant_place);
        IF NOT (front_free > 0 AND claimant_place > 0 AND claimant_place <= front_free) THEN
            SET reaches = FALSE;                       -- admission.quota_front_reaches
        END IF;
        IF claimant_place = 0 THEN
            SET at_front = FALSE;
        END IF;
        -- The waiters behind it within the key's free slots less the one it takes (X3d).
        SET id_place = 0;
        SET behind_taken = 0;
        WHILE id_place < JSON_LENGTH(front_ids) AND behind_taken < front_free - 1 DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(front_ids, CONCAT('$[', id_place, ']')));
            IF CAST(waiter_id AS BINARY) <> CAST(run_to_claim AS BINARY) THEN      -- exact, as the run ids' column
                SET behind_taken = behind_taken + 1;
                IF NOT JSON_CONTAINS(behind_ids, JSON_QUOTE(waiter_id)) THEN
                    SET behind_ids = JSON_ARRAY_APPEND(behind_ids, '$', waiter_id);
                END IF;
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        SET key_place = key_place + 1;
    END WHILE;
    -- Each throttle key's window at the database's clock after the locks, and its front: within
    -- the free admissions of every one, oldest first (X6b, X6c); the openings of those that do
    -- not reach it (X6d).
    IF throttles_count > 0 THEN
        SET now_at = UTC_TIMESTAMP(6);
    END IF;
    SET key_place = 0;
    WHILE key_place < throttles_count DO
        SET throttle_name = JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][1]')));
        CALL ds_throttle_front(throttle_name, member_key,
                               CAST(JSON_EXTRACT(throttle_ids, CONCAT('$[', key_place, '][0]')) AS SIGNED),
                               CAST(JSON_EXTRACT(throttle_ids, CONCAT('$[', key_place, '][1]')) AS SIGNED) = 1,
                               CAST(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][3]')) AS SIGNED),
                               ttls_json, run_to_claim, now_at,
                               front_free, front_ids, claimant_place, front_opening);
        IF NOT (front_free > 0 AND claimant_place > 0 AND claimant_place <= front_free) THEN
            SET reaches = FALSE;                       -- admission.quota_front_reaches
            IF front_opening IS NOT NULL
               AND (opening IS NULL OR front_opening > opening
                    OR (front_opening = opening AND CAST(throttle_name AS BINARY) > CAST(opening_throttle AS BINARY))) THEN
                SET opening = front_opening;           -- max((opening, name)) over the keys that deny it
                SET opening_throttle = throttle_name;
            END IF;
        END IF;
        IF claimant_place = 0 THEN
            SET at_front = FALSE;
        END IF;
        SET id_place = 0;
        SET behind_taken = 0;
        WHILE id_place < JSON_LENGTH(front_ids) AND behind_taken < front_free - 1 DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(front_ids, CONCAT('$[', id_place, ']')));
            IF CAST(waiter_id AS BINARY) <> CAST(run_to_claim AS BINARY) THEN      -- exact, as the run ids' column
                SET behind_taken = behind_taken + 1;
                IF NOT JSON_CONTAINS(behind_ids, JSON_QUOTE(waiter_id)) THEN
                    SET behind_ids = JSON_ARRAY_APPEND(behind_ids, '$', waiter_id);
                END IF;
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        SET key_place = key_place + 1;
    END WHILE;
    IF reaches AND key_name IS NOT NULL THEN
        -- Its other limits admit it: its singleton key's grant decides, and its other grants are written (S5, X3i).
        CALL ds_grant_waiters(wf, key_name, single_key_id, declared_limit, ttl_microseconds, run_to_claim,
                              redelivery_microseconds, JSON_ARRAY(), claimant_token, claimant_front,
                              granted_ids, turn_ids);
        SET reaches = claimant_token > 0;
        SET at_front = claimant_front;
    END IF;
    IF reaches THEN
        -- Admitted: its lease and a slot in each limit, a compare-and-set on the run as read (R5, R5a, R6, X3f);
        -- a throttled admission's time is the one its throttle keys record (X6).
        UPDATE durable_singleton_run
           SET status = 'running',
               lease_owner = new_owner,
               lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL lease_microseconds MICROSECOND,
               wake_at = NULL,
               attempts = attempts_read + 1,
               started_at = COALESCE(started_at, UTC_TIMESTAMP(6)),
               updated_at = UTC_TIMESTAMP(6),
               quota_slot = 'holder',
               admitted_at = COALESCE(now_at, UTC_TIMESTAMP(6)),
               singleton_slot = IF(key_name IS NULL, singleton_slot, 'holder'),
               singleton_tracked = IF(key_name IS NULL, singleton_tracked, TRUE),
               fencing_token = IF(claimant_token > 0, claimant_token, fencing_token)
         WHERE run_id = run_to_claim
           AND status = status_read                    -- the compare: the run as read (R5a)
           AND attempts = attempts_read
           AND NOT cancel_requested
           AND quota_slot = 'waiter';
        IF ROW_COUNT() = 0 THEN
            ROLLBACK;                                  -- changed under us: grant nothing (R5a)
            SELECT 'refused' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
            LEAVE admit;
        END IF;
        -- Its membership in each quota key takes the key's next token (X3f, K1).
        SET key_place = 0;
        WHILE key_place < keys_count DO
            SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
            SET member_key_id = JSON_EXTRACT(key_ids, CONCAT('$[', key_place, ']'));
            SELECT k.last_token INTO token_read FROM durable_singleton_singletonkey k WHERE k.id = member_key_id;
            UPDATE durable_singleton_quotamembership
               SET slot = 'holder', fencing_token = token_read + 1
             WHERE run_id = run_to_claim AND quota = member_quota;
            UPDATE durable_singleton_singletonkey SET last_token = token_read + 1 WHERE id = member_key_id;
            SET tokens = JSON_SET(tokens, CONCAT('$.', JSON_QUOTE(member_quota)), token_read + 1);
            SET key_place = key_place + 1;
        END WHILE;
        -- The admission counts in each throttle key's window from now on (X6).
        SET key_place = 0;
        WHILE key_place < throttles_count DO
            INSERT INTO durable_singleton_throttleadmission (throttle, `key`, run_id, admitted_at)
            VALUES (JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][0]'))),
                    JSON_UNQUOTE(JSON_EXTRACT(throttles_json, CONCAT('$[', key_place, '][1]'))),
                    run_to_claim, now_at);
            SET key_place = key_place + 1;
        END WHILE;
        -- The waiters behind it, less those the grant named (X3d).
        SET id_place = 0;
        WHILE id_place < JSON_LENGTH(behind_ids) DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(behind_ids, CONCAT('$[', id_place, ']')));
            IF NOT JSON_CONTAINS(granted_ids, JSON_QUOTE(waiter_id)) AND NOT JSON_CONTAINS(turn_ids, JSON_QUOTE(waiter_id)) THEN
                SET more_turn_ids = JSON_ARRAY_APPEND(more_turn_ids, '$', waiter_id);
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        SELECT 'admitted' AS ds_role, tokens AS ds_tokens, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
        CALL ds_send_runs('granted', granted_ids);
        CALL ds_send_runs('turn', turn_ids);
        IF JSON_LENGTH(more_turn_ids) > 0 THEN
            CALL ds_send_runs('turn', more_turn_ids);
        END IF;
        COMMIT;
    ELSE
        IF opening IS NOT NULL THEN
            -- Over the rate: not due until the window lets it in, so it blocks no waiter of its
            -- other limits meanwhile (X5), and the tick sends it then (X6d, S8); a compare-and-set
            -- on the waiter as read (R5a).
            UPDATE durable_singleton_run
               SET status = 'suspended',
                   attempts = attempts_read + 1,
                   wake_at = opening,
                   not_before = opening,
                   lease_owner = NULL,
                   lease_expires_at = NULL,
                   park_reason = CONCAT('throttled:', opening_throttle),
                   updated_at = UTC_TIMESTAMP(6)
             WHERE run_id = run_to_claim
               AND status = status_read
               AND attempts = attempts_read
               AND NOT cancel_requested
               AND quota_slot = 'waiter';
        ELSE
            -- Denied: parked with its retry delay, a compare-and-set on the waiter as read (S5 step 5).
            UPDATE durable_singleton_run
               SET status = 'suspended',
                   attempts = attempts_read + 1,
                   wake_at = UTC_TIMESTAMP(6) + INTERVAL
                             IF(at_front, front_delay_microseconds, backlog_delay_microseconds) MICROSECOND,
                   lease_owner = NULL,
                   lease_expires_at = NULL,
                   park_reason = 'singleton',
                   updated_at = UTC_TIMESTAMP(6)
             WHERE run_id = run_to_claim
               AND status = status_read
               AND attempts = attempts_read
               AND NOT cancel_requested
               AND quota_slot = 'waiter';
        END IF;
        SET written = ROW_COUNT();
        SELECT IF(written > 0, 'parked', 'skipped') AS ds_role, r.*
          FROM durable_singleton_run r WHERE r.run_id = run_to_claim;
        CALL ds_send_runs('granted', granted_ids);
        CALL ds_send_runs('turn', turn_ids);
        COMMIT;
    END IF;
END

-- name: ds_take_quota_lease
-- The confirmation of a quota holder (a run a handoff or an earlier claim admitted, X3f,
-- S6): one transaction, the run's row lock first so that the lease is counted from after
-- any wait (R5, R8), then one compare-and-set on the run as the turn read it, its cancel
-- flag included, still a quota holder (R5a, R6); no key's lock: its memberships change
-- only by a recovery, which changes the run's attempts first (as DjangoStore._quota_turn).
-- One result row: ``runs_taken`` 1 and ``tokens`` (its token by quota name, JSON) if the
-- lease is ours, 0 and NULL if the run changed under the turn (nothing written).
CREATE PROCEDURE ds_take_quota_lease(
    IN run_to_take VARCHAR(191) CHARACTER SET utf8mb4,
    IN status_as_read VARCHAR(16) CHARACTER SET utf8mb4,
    IN attempts_as_read INTEGER,
    IN cancel_as_read BOOLEAN,
    IN new_owner VARCHAR(191) CHARACTER SET utf8mb4,
    IN lease_microseconds BIGINT,
    IN takes_slot BOOLEAN
)
MODIFIES SQL DATA
BEGIN
    DECLARE rows_locked INTEGER DEFAULT 0;
    DECLARE runs_taken INTEGER DEFAULT 0;
    DECLARE tokens LONGTEXT CHARACTER SET utf8mb4;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;  -- never a transaction left open on the caller's connection
        RESIGNAL;  -- a deadlock or a lock wait timeout reaches the store's retry
    END;
    START TRANSACTION;
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
           started_at = COALESCE(started_at, UTC_TIMESTAMP(6)),
           updated_at = UTC_TIMESTAMP(6),
           singleton_slot = IF(takes_slot, 'holder', singleton_slot),      -- a holder keeps its slot (S6)
           singleton_tracked = IF(takes_slot, TRUE, singleton_tracked)
     WHERE run_id = run_to_take
       AND status = status_as_read                                         -- the compare: the run as read (R5a)
       AND status <> 'running'                                             -- a recovery: the ORM path (K1, X3f)
       AND attempts = attempts_as_read
       AND cancel_requested = cancel_as_read                               -- a cancel after the read wins (R6)
       AND quota_slot = 'holder';
    SET runs_taken = ROW_COUNT();
    IF runs_taken > 0 THEN
        SELECT COALESCE(JSON_OBJECTAGG(m.quota, COALESCE(m.fencing_token, 0)), '{}') INTO tokens
          FROM durable_singleton_quotamembership m
         WHERE m.run_id = run_to_take;
    END IF;
    COMMIT;
    SELECT runs_taken, tokens;
END

-- name: ds_send_granted
-- The result sets of a handoff's grants in the quota path, inside the caller's transaction
-- before its COMMIT: one row per run id of the JSON array ``ids``, headed by 'granted' and
-- ``ds_tokens`` (its quota tokens by name, JSON, NULL if it holds none), then its columns.
CREATE PROCEDURE ds_send_granted(
    IN ids LONGTEXT CHARACTER SET utf8mb4
)
READS SQL DATA
BEGIN
    DECLARE place INTEGER DEFAULT 0;
    WHILE place < JSON_LENGTH(ids) DO
        SELECT 'granted' AS ds_role,
               (SELECT JSON_OBJECTAGG(m.quota, m.fencing_token)
                  FROM durable_singleton_quotamembership m
                 WHERE m.run_id = r.run_id AND m.slot = 'holder') AS ds_tokens,
               r.*
          FROM durable_singleton_run r
         WHERE r.run_id = JSON_UNQUOTE(JSON_EXTRACT(ids, CONCAT('$[', place, ']')));
        SET place = place + 1;
    END WHILE;
END

-- name: ds_settle_quotas
-- The settle of a run that carries quotas, and the handoff of its slots, in one transaction
-- (S7, S12, R5a, K1, X3g, X3h, S13), as DjangoStore._finish: its quota keys locked in order,
-- then its singleton key (if it has one, ``key_name``); the settle, a compare-and-set on the
-- owner's unexpired lease judged after the locks, every marker dropped and every quota slot
-- freed in the same write (X3g); then each quota key's front read (ds_quota_front). The
-- waiters within a front's free slots whose every quota key is locked here and reached
-- (admission.handoff_admits), parked, not cancelled, without throttles and without a
-- singleton key or with this run's, are admitted as their own claims would be: with this
-- key's grant (ds_grant_waiters, ``carrier_ids``), or without a key by a compare-and-set that
-- takes their quota slot with a turn due after the redelivery window (S7a); each takes the
-- next token of each quota key in its place's order (X3f). The others within the free slots
-- are sent a turn as they are (X3h). Result sets, sent before the COMMIT: none when the
-- compare failed (nothing written); else one 'settled' row, a row per waiter 'granted'
-- (ds_send_granted, with its tokens), a row per waiter sent a 'turn'.
CREATE PROCEDURE ds_settle_quotas(
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
    IN limits_json LONGTEXT CHARACTER SET utf8mb4,
    IN ttls_json LONGTEXT CHARACTER SET utf8mb4,
    IN redelivery_microseconds BIGINT
)
MODIFIES SQL DATA
settle: BEGIN
    DECLARE keys_json LONGTEXT CHARACTER SET utf8mb4;
    DECLARE key_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE keys_count INTEGER DEFAULT 0;
    DECLARE key_place INTEGER DEFAULT 0;
    DECLARE member_quota VARCHAR(64) CHARACTER SET utf8mb4;
    DECLARE member_key VARCHAR(127) CHARACTER SET utf8mb4;
    DECLARE member_key_id BIGINT;
    DECLARE single_key_id BIGINT;
    DECLARE front_free INTEGER;
    DECLARE front_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE claimant_place INTEGER;
    DECLARE withins LONGTEXT CHARACTER SET utf8mb4 DEFAULT '';   -- each key's ids within its free slots
    DECLARE within_ids LONGTEXT CHARACTER SET utf8mb4;
    DECLARE candidates LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE carrier_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE keyless_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE admitted_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE id_place INTEGER;
    DECLARE waiter_id VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE carried INTEGER;
    DECLARE reached INTEGER;
    DECLARE fits INTEGER;
    DECLARE keyless BOOLEAN;
    DECLARE status_read VARCHAR(16) CHARACTER SET utf8mb4;
    DECLARE claimant_token BIGINT;
    DECLARE claimant_front BOOLEAN;
    DECLARE granted_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE turn_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE more_turn_ids LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE token_read BIGINT;
    DECLARE token BIGINT;
    DECLARE known_ids LONGTEXT CHARACTER SET utf8mb4;                -- their ids before the transaction (ds_key_ids)
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;  -- never a transaction left open on the caller's connection
        RESIGNAL;  -- a deadlock or a lock wait timeout reaches the store's retry
    END;
    CALL ds_quota_keys_of(run_to_settle, keys_json);
    SET keys_count = JSON_LENGTH(keys_json);
    -- The ids of the key rows it locks, read before the transaction (ds_lock_known_key, S13a).
    CALL ds_key_ids(JSON_ARRAY(), keys_json, wf, key_name, known_ids);
    START TRANSACTION;
    -- The lock order of every path: the quota keys sorted, then the singleton key (X3e, S13).
    WHILE key_place < keys_count DO
        SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][1]')));
        CALL ds_lock_known_key(CONCAT('quota:', member_quota), member_key,
                               JSON_EXTRACT(known_ids, CONCAT('$[', key_place, ']')), member_key_id);
        SET key_ids = JSON_ARRAY_APPEND(key_ids, '$', member_key_id);
        SET key_place = key_place + 1;
    END WHILE;
    IF key_name IS NOT NULL THEN
        CALL ds_lock_known_key(wf, key_name, JSON_EXTRACT(known_ids, CONCAT('$[', keys_count, ']')), single_key_id);
    END IF;
    UPDATE durable_singleton_run
       SET status = final_status,
           output = output_json,
           error = error_json,
           singleton_slot = NULL,                      -- the key's slot is free
           singleton_tracked = FALSE,
           quota_slot = NULL,                          -- and every quota slot (X3g)
           lease_owner = NULL,
           lease_expires_at = NULL,
           wake_at = NULL,
           finished_at = COALESCE(finished, UTC_TIMESTAMP(6)),
           updated_at = UTC_TIMESTAMP(6)
     WHERE run_id = run_to_settle
       AND status = 'running'                          -- R5a: its owner, lease unexpired after the locks
       AND lease_owner = owner
       AND lease_expires_at > UTC_TIMESTAMP(6);
    IF ROW_COUNT() = 0 THEN
        ROLLBACK;
        LEAVE settle;
    END IF;
    UPDATE durable_singleton_quotamembership SET slot = NULL WHERE run_id = run_to_settle;
    -- Each quota key's front, and the waiters within its free slots, in order of first place.
    SET key_place = 0;
    WHILE key_place < keys_count DO
        SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
        SET member_key = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][1]')));
        SET member_key_id = JSON_EXTRACT(key_ids, CONCAT('$[', key_place, ']'));
        CALL ds_quota_front(member_quota, member_key, member_key_id, limits_json, ttls_json, NULL,
                            front_free, front_ids, claimant_place);
        SET within_ids = JSON_ARRAY();
        SET id_place = 0;
        WHILE id_place < LEAST(JSON_LENGTH(front_ids), front_free) DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(front_ids, CONCAT('$[', id_place, ']')));
            SET within_ids = JSON_ARRAY_APPEND(within_ids, '$', waiter_id);
            IF NOT JSON_CONTAINS(candidates, JSON_QUOTE(waiter_id)) THEN
                SET candidates = JSON_ARRAY_APPEND(candidates, '$', waiter_id);
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        SET withins = CONCAT(withins, IF(key_place > 0, ',', ''), within_ids);
        SET key_place = key_place + 1;
    END WHILE;
    SET withins = CONCAT('[', withins, ']');
    -- The carriers this handoff admits: every quota key each carries is locked here and
    -- reaches it (admission.handoff_admits), and its run may be admitted here (X3h).
    SET id_place = 0;
    WHILE id_place < JSON_LENGTH(candidates) DO
        SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(candidates, CONCAT('$[', id_place, ']')));
        SELECT COUNT(*) INTO carried FROM durable_singleton_quotamembership m WHERE m.run_id = waiter_id;
        SET reached = 0;
        SET key_place = 0;
        WHILE key_place < keys_count DO
            IF JSON_CONTAINS(JSON_EXTRACT(withins, CONCAT('$[', key_place, ']')), JSON_QUOTE(waiter_id)) THEN
                SET reached = reached + 1;
            END IF;
            SET key_place = key_place + 1;
        END WHILE;
        IF carried = reached THEN
            SELECT COUNT(*), MAX(r.singleton_key IS NULL), MAX(r.status) INTO fits, keyless, status_read
              FROM durable_singleton_run r
             WHERE r.run_id = waiter_id
               AND r.status IN ('pending', 'suspended', 'blocked')
               AND NOT r.cancel_requested
               AND r.quota_slot = 'waiter'
               AND COALESCE(JSON_LENGTH(r.throttle_keys), 0) = 0          -- X6: its own claim admits it
               AND (r.singleton_key IS NULL OR (r.workflow_name = wf AND r.singleton_key = key_name));
            IF fits > 0 THEN
                SET carrier_ids = JSON_ARRAY_APPEND(carrier_ids, '$', waiter_id);
                IF keyless THEN
                    SET keyless_ids = JSON_ARRAY_APPEND(keyless_ids, '$', JSON_ARRAY(waiter_id, status_read));
                END IF;
            END IF;
        END IF;
        SET id_place = id_place + 1;
    END WHILE;
    -- The singleton key's free slots, the carriers among its waiters admitted with their grant (S5, S7, K1).
    IF key_name IS NOT NULL THEN
        CALL ds_grant_waiters(wf, key_name, single_key_id, declared_limit, ttl_microseconds, NULL,
                              redelivery_microseconds, carrier_ids, claimant_token, claimant_front,
                              granted_ids, turn_ids);
    END IF;
    SET id_place = 0;
    WHILE id_place < JSON_LENGTH(granted_ids) DO
        SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(granted_ids, CONCAT('$[', id_place, ']')));
        IF JSON_CONTAINS(carrier_ids, JSON_QUOTE(waiter_id)) THEN
            SET admitted_ids = JSON_ARRAY_APPEND(admitted_ids, '$', waiter_id);
        END IF;
        SET id_place = id_place + 1;
    END WHILE;
    -- The carriers without a singleton key: their quota slot, a turn after the redelivery window (S7a).
    SET id_place = 0;
    WHILE id_place < JSON_LENGTH(keyless_ids) DO
        SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(keyless_ids, CONCAT('$[', id_place, '][0]')));
        SET status_read = JSON_UNQUOTE(JSON_EXTRACT(keyless_ids, CONCAT('$[', id_place, '][1]')));
        UPDATE durable_singleton_run
           SET quota_slot = 'holder',
               admitted_at = UTC_TIMESTAMP(6),
               wake_at = UTC_TIMESTAMP(6) + INTERVAL redelivery_microseconds MICROSECOND,
               updated_at = UTC_TIMESTAMP(6)
         WHERE run_id = waiter_id
           AND status = status_read                    -- the compare: the waiter as read (R5a)
           AND quota_slot = 'waiter'
           AND NOT cancel_requested;
        IF ROW_COUNT() > 0 THEN
            SET granted_ids = JSON_ARRAY_APPEND(granted_ids, '$', waiter_id);
            SET admitted_ids = JSON_ARRAY_APPEND(admitted_ids, '$', waiter_id);
        END IF;
        SET id_place = id_place + 1;
    END WHILE;
    -- Each admitted carrier takes the next token of each quota key, in its place's order there (X3f, K1).
    SET key_place = 0;
    WHILE key_place < keys_count DO
        SET member_quota = JSON_UNQUOTE(JSON_EXTRACT(keys_json, CONCAT('$[', key_place, '][0]')));
        SET member_key_id = JSON_EXTRACT(key_ids, CONCAT('$[', key_place, ']'));
        SET within_ids = JSON_EXTRACT(withins, CONCAT('$[', key_place, ']'));
        SELECT k.last_token INTO token_read FROM durable_singleton_singletonkey k WHERE k.id = member_key_id;
        SET token = token_read;
        SET id_place = 0;
        WHILE id_place < JSON_LENGTH(within_ids) DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(within_ids, CONCAT('$[', id_place, ']')));
            IF JSON_CONTAINS(admitted_ids, JSON_QUOTE(waiter_id)) THEN
                SET token = token + 1;
                UPDATE durable_singleton_quotamembership
                   SET slot = 'holder', fencing_token = token
                 WHERE run_id = waiter_id AND quota = member_quota;
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        IF token <> token_read THEN
            UPDATE durable_singleton_singletonkey SET last_token = token WHERE id = member_key_id;
        END IF;
        SET key_place = key_place + 1;
    END WHILE;
    -- The others within the free slots: a turn as they are (X3h), each once.
    SET key_place = 0;
    WHILE key_place < keys_count DO
        SET within_ids = JSON_EXTRACT(withins, CONCAT('$[', key_place, ']'));
        SET id_place = 0;
        WHILE id_place < JSON_LENGTH(within_ids) DO
            SET waiter_id = JSON_UNQUOTE(JSON_EXTRACT(within_ids, CONCAT('$[', id_place, ']')));
            IF NOT JSON_CONTAINS(granted_ids, JSON_QUOTE(waiter_id)) AND NOT JSON_CONTAINS(turn_ids, JSON_QUOTE(waiter_id))
               AND NOT JSON_CONTAINS(more_turn_ids, JSON_QUOTE(waiter_id)) THEN
                SET more_turn_ids = JSON_ARRAY_APPEND(more_turn_ids, '$', waiter_id);
            END IF;
            SET id_place = id_place + 1;
        END WHILE;
        SET key_place = key_place + 1;
    END WHILE;
    -- The result sets before the COMMIT: a refused CALL rolls the settle and its grants back (S7, R5a).
    SELECT 'settled' AS ds_role, r.* FROM durable_singleton_run r WHERE r.run_id = run_to_settle;
    CALL ds_send_granted(granted_ids);
    CALL ds_send_runs('turn', turn_ids);
    CALL ds_send_runs('turn', more_turn_ids);
    COMMIT;
END
