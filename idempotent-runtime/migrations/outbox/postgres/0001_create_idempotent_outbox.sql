-- The transactional outbox of the `idempotency` crate, PostgreSQL.
--
-- `Outbox::create_table()` runs this file with `idempotent_outbox` replaced by the configured
-- table name. Rows are written in the application's business transaction and published by
-- the relay after commit; the message id (`id`) travels with every message, so consumers
-- can key their idempotency on it.
--
-- Times are the database's clock (`statement_timestamp()`), never a client's.
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    -- The message id: 32 hex characters, unique, sent as AMQP `message_id` / `Nats-Msg-Id`.
    id              TEXT        NOT NULL PRIMARY KEY,
    -- What the message is about (Debezium's outbox columns).
    aggregate_type  TEXT        NOT NULL,
    aggregate_id    TEXT        NOT NULL,
    event_type      TEXT        NOT NULL,
    -- Where it goes: a routing key (RabbitMQ) or a subject (NATS).
    destination     TEXT        NOT NULL,
    payload         BYTEA       NOT NULL,
    -- Message headers, a JSON object of strings.
    headers         TEXT        NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
    state           TEXT        NOT NULL DEFAULT 'pending'
                    CHECK (state IN ('pending', 'published', 'dead')),
    -- Publication attempts so far; at the relay's maximum a failing row goes `dead`.
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT statement_timestamp(),
    last_error      TEXT,
    published_at    TIMESTAMPTZ,
    -- The relay that claimed the row, and until when its claim holds.
    claim_token     BYTEA,
    claimed_until   TIMESTAMPTZ
);

CREATE INDEX IF NOT EXISTS idempotent_outbox_due
    ON idempotent_outbox (next_attempt_at) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS idempotent_outbox_published
    ON idempotent_outbox (published_at) WHERE state = 'published';
