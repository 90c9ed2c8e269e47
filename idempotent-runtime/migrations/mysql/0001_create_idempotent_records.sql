-- Idempotency records of the `idempotent` crate, MySQL and MariaDB (InnoDB).
--
-- `MySqlStore::migrate()` runs this file with `idempotent_records` replaced by the configured
-- table name. To manage the schema with your own migration tool instead, copy this file into
-- your migrations and build the store with `.migrate(false)`.
--
-- Times are the database's clock in UTC (`UTC_TIMESTAMP(6)`), never a client's, and do not
-- depend on the session's time zone.
CREATE TABLE IF NOT EXISTS idempotent_records (
    -- The encoded operation key: exact bytes (VARBINARY has no collation, so no case folding
    -- or trailing-space rules). Keys are at most 271 bytes.
    record_key  VARBINARY(512) NOT NULL,
    -- The key's readable prefix (`order:consume`), for operators.
    prefix      VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    -- The token of the record's current (or last) owner.
    token       BINARY(16) NOT NULL,
    -- Grows by one on every acquisition of the key; restarts at 1 once the record expired.
    fence       BIGINT NOT NULL,
    state       VARCHAR(11) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    -- Until when the owner's claim is live (meaningful while in progress).
    lease_until DATETIME(6) NOT NULL,
    -- The stored result of a completed record, opaque to the database.
    result      MEDIUMBLOB NULL,
    -- The payload fingerprint stored with the claim, or NULL.
    fingerprint BINARY(16) NULL,
    created_at  DATETIME(6) NOT NULL,
    updated_at  DATETIME(6) NOT NULL,
    -- Once past, the record no longer exists for the store; purged in batches.
    expires_at  DATETIME(6) NOT NULL,
    PRIMARY KEY (record_key),
    KEY idempotent_records_expires_at (expires_at),
    CHECK (state IN ('in_progress', 'completed', 'released'))
) ENGINE = InnoDB;
