-- The transactional outbox of the `idempotency` crate, SQLite.
--
-- `Outbox::create_table()` runs this file with `idempotent_outbox` replaced by the configured
-- table name. Rows are written in the application's business transaction and published by
-- the relay after commit; the message id (`id`) travels with every message, so consumers
-- can key their idempotency on it.
--
-- Times are the database's clock in milliseconds since the Unix epoch
-- (`julianday('now')`), never a client's.
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    -- The message id: 32 hex characters, unique, sent as AMQP `message_id` / `Nats-Msg-Id`.
    id              TEXT    NOT NULL PRIMARY KEY,
    -- What the message is about (Debezium's outbox columns).
    aggregate_type  TEXT    NOT NULL,
    aggregate_id    TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    -- Where it goes: a routing key (RabbitMQ) or a subject (NATS).
    destination     TEXT    NOT NULL,
    payload         BLOB    NOT NULL,
    -- Message headers, a JSON object of strings.
    headers         TEXT    NOT NULL,
    created_at      INTEGER NOT NULL,
    state           TEXT    NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'published', 'dead')),
    -- Publication attempts so far; at the relay's maximum a failing row goes `dead`.
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    last_error      TEXT,
    published_at    INTEGER,
    -- The relay that claimed the row, and until when its claim holds.
    claim_token     BLOB,
    claimed_until   INTEGER
);

CREATE INDEX IF NOT EXISTS idempotent_outbox_due
    ON idempotent_outbox (created_at, id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS idempotent_outbox_published
    ON idempotent_outbox (published_at) WHERE state = 'published';
