-- Idempotency records of the `idempotent` crate, SQLite.
--
-- `SqliteStore::migrate()` runs this file with `idempotent_records` replaced by the configured
-- table name. To manage the schema with your own migration tool instead, copy this file into
-- your migrations and build the store with `.migrate(false)`.
--
-- Times are milliseconds since the Unix epoch on the database's clock
-- (`julianday('now')`), never a client's.
CREATE TABLE IF NOT EXISTS idempotent_records (
    -- The encoded operation key: exact bytes, compared byte for byte.
    record_key  BLOB    NOT NULL PRIMARY KEY,
    -- The key's readable prefix (`order:consume`), for operators.
    prefix      TEXT    NOT NULL,
    -- The token of the record's current (or last) owner: 16 bytes.
    token       BLOB    NOT NULL,
    -- Grows by one on every acquisition of the key; restarts at 1 once the record expired.
    fence       INTEGER NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_progress', 'completed', 'released')),
    -- Until when the owner's claim is live (meaningful while in progress).
    lease_until INTEGER NOT NULL,
    -- The stored result of a completed record, opaque to the database.
    result      BLOB,
    -- The payload fingerprint stored with the claim: 16 bytes, or NULL.
    fingerprint BLOB,
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    -- Once past, the record no longer exists for the store; purged in batches.
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS idempotent_records_expires_at ON idempotent_records (expires_at);
