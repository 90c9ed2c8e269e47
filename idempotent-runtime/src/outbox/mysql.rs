//! The outbox on MySQL and MariaDB: MySQL's `UPDATE` returns no rows, so a claim is an
//! `UPDATE ... ORDER BY ... LIMIT` that writes the relay's token on the due rows it takes
//! (InnoDB locks each row it changes, and a concurrent claim waits for the lock, then sees
//! the row claimed and passes it by), then a read of the rows that carry the token.

use sqlx::mysql::MySql;

use crate::outbox::dialect::{outbox_fns, OutboxDialectImpl, OutboxTemplates, COUNTS};

/// The message columns, as every dialect reads them.
macro_rules! columns {
    () => {
        "id, aggregate_type, aggregate_id, event_type, destination, payload, headers, \
         CAST(attempts AS SIGNED) AS attempts"
    };
}

const TEMPLATES: OutboxTemplates = OutboxTemplates {
    create: include_str!("../../migrations/outbox/mysql/0001_create_idempotent_outbox.sql"),
    enqueue: "INSERT INTO idempotent_outbox (id, aggregate_type, aggregate_id, event_type, \
              destination, payload, headers, created_at, next_attempt_at) \
              VALUES (?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
    claim: "UPDATE idempotent_outbox SET claim_token = ?, \
            claimed_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
            attempts = attempts + 1 \
            WHERE state = 'pending' AND next_attempt_at <= UTC_TIMESTAMP(6) \
              AND (claimed_until IS NULL OR claimed_until < UTC_TIMESTAMP(6)) \
            ORDER BY created_at, id LIMIT ?",
    claimed: concat!(
        "SELECT ",
        columns!(),
        " FROM idempotent_outbox WHERE claim_token = ? ORDER BY created_at, id"
    ),
    published: "UPDATE idempotent_outbox SET state = 'published', \
                published_at = UTC_TIMESTAMP(6), claim_token = NULL, \
                claimed_until = NULL, last_error = NULL \
                WHERE claim_token = ? AND id IN ({ids})",
    failed: "UPDATE idempotent_outbox SET last_error = ?, \
             state = CASE WHEN attempts >= ? THEN 'dead' ELSE 'pending' END, \
             next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, \
             claim_token = NULL, claimed_until = NULL \
             WHERE id = ? AND claim_token = ?",
    get: concat!(
        "SELECT ",
        columns!(),
        " FROM idempotent_outbox WHERE id = ?"
    ),
    dead: concat!(
        "SELECT ",
        columns!(),
        ", last_error, \
         CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) AS DOUBLE) / 1000000 \
         AS age \
         FROM idempotent_outbox WHERE state = 'dead' ORDER BY created_at, id LIMIT ?"
    ),
    retry: "UPDATE idempotent_outbox SET state = 'pending', attempts = 0, \
            next_attempt_at = UTC_TIMESTAMP(6) WHERE id = ? AND state = 'dead'",
    discard: "DELETE FROM idempotent_outbox WHERE id = ? AND state = 'dead'",
    force_discard: "DELETE FROM idempotent_outbox WHERE id = ? AND state IN ('pending', 'dead') \
                    AND (claimed_until IS NULL OR claimed_until < UTC_TIMESTAMP(6))",
    inspect: concat!(
        "SELECT ",
        columns!(),
        ", state, last_error, \
         CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) AS DOUBLE) / 1000000 \
         AS age, \
         CAST(CASE WHEN claimed_until >= UTC_TIMESTAMP(6) THEN 1 ELSE 0 END AS SIGNED) \
         AS claimed FROM idempotent_outbox WHERE id = ?"
    ),
    release: "UPDATE idempotent_outbox SET attempts = GREATEST(attempts, 1) - 1, \
              claim_token = NULL, claimed_until = NULL \
              WHERE claim_token = ? AND state = 'pending'",
    purge: "DELETE FROM idempotent_outbox WHERE state = 'published' \
            AND published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
            ORDER BY published_at LIMIT ?",
    counts: COUNTS,
};

impl OutboxDialectImpl for MySql {
    const OUTBOX: OutboxTemplates = TEMPLATES;
    const NOTIFIES: bool = false;
    const NUMBERED: bool = false;

    outbox_fns!(MySql);
}
