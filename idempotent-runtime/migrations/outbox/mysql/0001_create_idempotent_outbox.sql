-- The transactional outbox of the `idempotency` crate, MySQL and MariaDB (InnoDB).
--
-- `Outbox::create_table()` runs this file with `idempotent_outbox` replaced by the configured
-- table name. Rows are written in the application's business transaction and published by
-- the relay after commit; the message id (`id`) travels with every message, so consumers
-- can key their idempotency on it.
--
-- Times are the database's clock in UTC (`UTC_TIMESTAMP(6)`), never a client's, and do not
-- depend on the session's time zone.
CREATE TABLE IF NOT EXISTS idempotent_outbox (
    -- The message id: 32 hex characters, unique, sent as AMQP `message_id` / `Nats-Msg-Id`.
    id              VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    -- What the message is about (Debezium's outbox columns).
    aggregate_type  TEXT        CHARACTER SET utf8mb4 NOT NULL,
    aggregate_id    TEXT        CHARACTER SET utf8mb4 NOT NULL,
    event_type      TEXT        CHARACTER SET utf8mb4 NOT NULL,
    -- Where it goes: a routing key (RabbitMQ) or a subject (NATS).
    destination     TEXT        CHARACTER SET utf8mb4 NOT NULL,
    payload         LONGBLOB    NOT NULL,
    -- Message headers, a JSON object of strings.
    headers         MEDIUMTEXT  CHARACTER SET utf8mb4 NOT NULL,
    created_at      DATETIME(6) NOT NULL,
    state           VARCHAR(9)  CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'pending',
    -- Publication attempts so far; at the relay's maximum a failing row goes `dead`.
    attempts        INT         NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6) NOT NULL,
    last_error      TEXT        CHARACTER SET utf8mb4 NULL,
    published_at    DATETIME(6) NULL,
    -- The relay that claimed the row, and until when its claim holds.
    claim_token     VARBINARY(16) NULL,
    claimed_until   DATETIME(6) NULL,
    PRIMARY KEY (id),
    -- The relay's claim walks pending rows oldest first.
    KEY idempotent_outbox_due (state, created_at, id),
    KEY idempotent_outbox_published (state, published_at),
    CHECK (state IN ('pending', 'published', 'dead'))
) ENGINE = InnoDB;
