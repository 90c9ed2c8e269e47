-- Idempotency records of the `idempotent` crate, PostgreSQL.
--
-- `PostgresStore::migrate()` runs this file with `idempotent_records` replaced by the
-- configured table name. To manage the schema with your own migration tool instead, copy this
-- file into your migrations and build the store with `.migrate(false)`.
--
-- Times are the database's clock (`statement_timestamp()`), never a client's.
CREATE TABLE IF NOT EXISTS idempotent_records (
    -- The encoded operation key: exact bytes, compared byte for byte.
    record_key  BYTEA       NOT NULL PRIMARY KEY,
    -- The key's readable prefix (`order:consume`), for operators.
    prefix      TEXT        NOT NULL,
    -- The token of the record's current (or last) owner: 16 bytes.
    token       BYTEA       NOT NULL,
    -- Grows by one on every acquisition of the key; restarts at 1 once the record expired.
    fence       BIGINT      NOT NULL,
    state       TEXT        NOT NULL CHECK (state IN ('in_progress', 'completed', 'released')),
    -- Until when the owner's claim is live (meaningful while in progress).
    lease_until TIMESTAMPTZ NOT NULL,
    -- The stored result of a completed record, opaque to the database.
    result      BYTEA,
    -- The payload fingerprint stored with the claim: 16 bytes, or NULL.
    fingerprint BYTEA,
    created_at  TIMESTAMPTZ NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL,
    -- Once past, the record no longer exists for the store; purged in batches.
    expires_at  TIMESTAMPTZ NOT NULL
);

CREATE INDEX IF NOT EXISTS idempotent_records_expires_at ON idempotent_records (expires_at);
