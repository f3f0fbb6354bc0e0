-- The MariaDB/MySQL room's throttles (durable_singleton.stores.mysql): the throttle keys a
-- claim locks first, their windows and their fronts, for ds_admit_quota (X6b, X6c, X6d).
-- Shipped by migration 0024_mysql_throttles, only on MySQL/MariaDB; one ``-- name:`` block
-- per procedure, loaded by name (durable_singleton.sql). The rules are the ORM path's
-- (DjangoStore._lock_throttle_keys, DjangoStore._throttle_front, admission.throttle_room);
-- the PostgreSQL twin is sql/postgresql/throttle.sql. A throttle is one more limit of X3: its
-- key rows are the key table's rows throttle:<name>, locked before every quota key, the
-- singleton key and the run's row (X3e, S13). Every time is the database's clock,
-- UTC_TIMESTAMP(6), read once after the locks by the caller (R5, R8).

-- name: ds_throttle_keys_of
-- The throttle keys a run carries (X6), from its throttle_keys column ([[name, key, declared
-- limit, period seconds], ...], written once at its start), in the one lock order: by name
-- then key in code-point order (their UTF-8 bytes compared, as Python sorts the tuples,
-- DjangoStore._lock_throttle_keys; a run names a throttle once), picked one at a time from
-- the few a run carries (no JSON_TABLE: MariaDB 10.5 has none). Read before the caller's
-- transaction starts (ds_claim's read of the run, ``carried`` its column as read: NULL or
-- the JSON), so that no snapshot is taken before the locks (S13a). OUT: a JSON array of
-- [name, key, declared limit, period in microseconds].
CREATE PROCEDURE ds_throttle_keys_of(
    IN carried LONGTEXT CHARACTER SET utf8mb4,
    OUT keys_json LONGTEXT CHARACTER SET utf8mb4
)
NO SQL
BEGIN
    DECLARE carried_count INTEGER DEFAULT 0;
    DECLARE taken LONGTEXT CHARACTER SET utf8mb4 DEFAULT '[]';
    DECLARE place INTEGER;
    DECLARE best INTEGER;
    DECLARE best_name VARBINARY(1024);
    DECLARE best_key VARBINARY(1024);
    DECLARE this_name VARBINARY(1024);
    DECLARE this_key VARBINARY(1024);
    DECLARE period_seconds DOUBLE;
    SET keys_json = JSON_ARRAY();
    SET carried_count = COALESCE(JSON_LENGTH(carried), 0);
    WHILE JSON_LENGTH(keys_json) < carried_count DO
        SET best = IF(carried_count = 1, 0, -1);       -- one key: nothing to order
        SET place = IF(carried_count = 1, 1, 0);
        WHILE place < carried_count DO
            IF NOT JSON_CONTAINS(taken, CAST(place AS CHAR)) THEN
                SET this_name = CAST(JSON_UNQUOTE(JSON_EXTRACT(carried, CONCAT('$[', place, '][0]'))) AS BINARY);
                SET this_key = CAST(JSON_UNQUOTE(JSON_EXTRACT(carried, CONCAT('$[', place, '][1]'))) AS BINARY);
                IF best < 0 OR this_name < best_name OR (this_name = best_name AND this_key < best_key) THEN
                    SET best = place;
                    SET best_name = this_name;
                    SET best_key = this_key;
                END IF;
            END IF;
            SET place = place + 1;
        END WHILE;
        SET taken = JSON_ARRAY_APPEND(taken, '$', best);
        SET period_seconds = JSON_EXTRACT(carried, CONCAT('$[', best, '][3]'));
        SET keys_json = JSON_ARRAY_APPEND(keys_json, '$',
                                          JSON_ARRAY(JSON_UNQUOTE(JSON_EXTRACT(carried, CONCAT('$[', best, '][0]'))),
                                                     JSON_UNQUOTE(JSON_EXTRACT(carried, CONCAT('$[', best, '][1]'))),
                                                     CAST(JSON_EXTRACT(carried, CONCAT('$[', best, '][2]')) AS SIGNED),
                                                     CAST(ROUND(period_seconds * 1000000) AS SIGNED)));
    END WHILE;
END

-- name: ds_throttle_front
-- A locked throttle key's free admissions at ``now_at`` (the database's clock, read by the
-- caller after every lock), its first due waiters and, for a waiter they do not reach, its
-- window's opening (X6b, X6c, X6d, K2, X2, X5, X8a), as DjangoStore._throttle_front reads
-- them inside the caller's transaction after the key's lock; ``limit_in_force`` and
-- ``paused`` are the key's, read by the caller with its lock (ds_admit_quota). The window:
-- the newest admissions in (now - period, now], at most the limit (ds_throttle_window_idx:
-- a count, and only when it passes the limit the limit-th newest); the free admissions: the
-- limit less those, none while the key is paused. The opening (admission.throttle_room):
-- NULL while paused (its waiters retry); with room, the oldest of those admissions (or now)
-- plus the period; full, the oldest plus the period. The waiters: memberships whose run is
-- an active, due waiter (quota_slot) not past its workflow's queue_ttl (``ttls_json``,
-- microseconds by workflow name), in the one queue order (admission.QUEUE_ORDER on the
-- membership: priority DESC, created_at, run_id, read along ds_throttle_order_idx), as many
-- as the limit (read by a cursor only when a probe finds more than one); not read when the
-- key is full and not paused: no waiter is within its free admissions, and the opening
-- parks the claimant whatever its place. OUT: the free
-- admissions, the waiters' run ids (a JSON array, in order), the place of ``claimant``
-- among them (1-based; 0: absent or not read), the opening.
CREATE PROCEDURE ds_throttle_front(
    IN front_throttle VARCHAR(64) CHARACTER SET utf8mb4,
    IN front_key VARCHAR(127) CHARACTER SET utf8mb4,
    IN limit_in_force BIGINT,
    IN paused BOOLEAN,
    IN period_microseconds BIGINT,
    IN ttls_json LONGTEXT CHARACTER SET utf8mb4,
    IN claimant VARCHAR(191) CHARACTER SET utf8mb4,
    IN now_at DATETIME(6),
    OUT front_free INTEGER,
    OUT front_ids LONGTEXT CHARACTER SET utf8mb4,
    OUT claimant_place INTEGER,
    OUT front_opening DATETIME(6)
)
READS SQL DATA
BEGIN
    DECLARE counted BIGINT DEFAULT 0;
    DECLARE oldest DATETIME(6);
    DECLARE waiter_place INTEGER DEFAULT 0;
    DECLARE done BOOLEAN DEFAULT FALSE;
    DECLARE waiter_id VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE is_claimant BOOLEAN;
    DECLARE probed INTEGER DEFAULT 0;
    DECLARE probed_id VARCHAR(191) CHARACTER SET utf8mb4;
    DECLARE waiters CURSOR FOR
        SELECT m.run_id, m.run_id = claimant                                          -- the column's binary collation
          FROM durable_singleton_throttlemembership m
          JOIN durable_singleton_run mr ON mr.run_id = m.run_id
         WHERE m.throttle = front_throttle AND m.`key` = front_key
           AND mr.quota_slot = 'waiter'                                                -- admission.throttle_waiter_q
           AND mr.status IN ('pending', 'running', 'suspended', 'blocked')
           AND (mr.not_before IS NULL OR mr.not_before <= UTC_TIMESTAMP(6))           -- X5: due
           AND NOT COALESCE(mr.created_at <= UTC_TIMESTAMP(6) - INTERVAL             -- X2: not past its TTL
                   CAST(JSON_UNQUOTE(JSON_EXTRACT(ttls_json, CONCAT('$.', JSON_QUOTE(mr.workflow_name)))) AS SIGNED)
                   MICROSECOND, FALSE)
         ORDER BY m.priority DESC, m.created_at, m.run_id                             -- X6c, X8a
         LIMIT limit_in_force;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET done = TRUE;
    -- The admissions the window counts (admission.throttle_room): all of them while they are
    -- within the limit, else the newest limit of them.
    SELECT COUNT(*), MIN(a.admitted_at) INTO counted, oldest
      FROM durable_singleton_throttleadmission a
     WHERE a.throttle = front_throttle AND a.`key` = front_key
       AND a.admitted_at > now_at - INTERVAL period_microseconds MICROSECOND;
    IF counted > limit_in_force THEN
        SELECT MIN(w.admitted_at) INTO oldest
          FROM (SELECT a.admitted_at
                  FROM durable_singleton_throttleadmission a
                 WHERE a.throttle = front_throttle AND a.`key` = front_key
                   AND a.admitted_at > now_at - INTERVAL period_microseconds MICROSECOND
                 ORDER BY a.admitted_at DESC
                 LIMIT limit_in_force) w;
        SET counted = limit_in_force;
    END IF;
    IF paused THEN
        SET front_free = 0;                            -- a paused key: no admission, no opening (K2)
        SET front_opening = NULL;
    ELSEIF limit_in_force > counted THEN
        SET front_free = limit_in_force - counted;     -- room the older waiters take first
        SET front_opening = COALESCE(oldest, now_at) + INTERVAL period_microseconds MICROSECOND;
    ELSE
        SET front_free = 0;                            -- full: the oldest that keeps it full leaves
        SET front_opening = oldest + INTERVAL period_microseconds MICROSECOND;
    END IF;
    SET front_ids = JSON_ARRAY();
    SET claimant_place = 0;
    IF front_free > 0 OR paused THEN
        -- A probe of at most two waiters first (the cursor's rows, in any order): none or one
        -- (an idle key) needs no cursor, whose result MariaDB materializes.
        SELECT COUNT(*), MAX(p.run_id), MAX(p.run_id = claimant) INTO probed, probed_id, is_claimant
          FROM (SELECT m.run_id
                  FROM durable_singleton_throttlemembership m
                  JOIN durable_singleton_run mr ON mr.run_id = m.run_id
                 WHERE m.throttle = front_throttle AND m.`key` = front_key
                   AND mr.quota_slot = 'waiter'
                   AND mr.status IN ('pending', 'running', 'suspended', 'blocked')
                   AND (mr.not_before IS NULL OR mr.not_before <= UTC_TIMESTAMP(6))
                   AND NOT COALESCE(mr.created_at <= UTC_TIMESTAMP(6) - INTERVAL
                           CAST(JSON_UNQUOTE(JSON_EXTRACT(ttls_json, CONCAT('$.', JSON_QUOTE(mr.workflow_name))))
                                AS SIGNED) MICROSECOND, FALSE)
                 LIMIT 2) p;
    END IF;
    IF probed = 1 THEN
        SET front_ids = JSON_ARRAY(probed_id);
        SET claimant_place = IF(is_claimant, 1, 0);
    ELSEIF probed > 1 THEN
        OPEN waiters;
        each_waiter: LOOP
            FETCH waiters INTO waiter_id, is_claimant;
            IF done THEN
                LEAVE each_waiter;
            END IF;
            SET waiter_place = waiter_place + 1;
            SET front_ids = JSON_ARRAY_APPEND(front_ids, '$', waiter_id);
            IF is_claimant THEN
                SET claimant_place = waiter_place;
            END IF;
        END LOOP;
        CLOSE waiters;
    END IF;
END
