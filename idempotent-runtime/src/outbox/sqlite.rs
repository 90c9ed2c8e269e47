//! The outbox on SQLite: one writer at a time, so a claim is an `UPDATE` of the oldest due
//! rows that writes the relay's token, then a read of the rows that carry it.

use sqlx::sqlite::Sqlite;

use crate::outbox::dialect::{outbox_fns, OutboxDialectImpl, OutboxTemplates, COUNTS};

/// The database's clock in milliseconds since the Unix epoch, as the SQLite store reads it.
macro_rules! now {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

/// The message columns, as every dialect reads them.
macro_rules! columns {
    () => {
        "id, aggregate_type, aggregate_id, event_type, destination, payload, headers, attempts"
    };
}

const TEMPLATES: OutboxTemplates = OutboxTemplates {
    create: include_str!("../../migrations/outbox/sqlite/0001_create_idempotent_outbox.sql"),
    enqueue: concat!(
        "INSERT INTO idempotent_outbox (id, aggregate_type, aggregate_id, event_type, \
         destination, payload, headers, created_at, next_attempt_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ",
        now!(),
        ", ",
        now!(),
        ")"
    ),
    claim: concat!(
        "UPDATE idempotent_outbox SET claim_token = ?, claimed_until = ",
        now!(),
        " + ?, attempts = attempts + 1 \
         WHERE id IN (SELECT id FROM idempotent_outbox \
                      WHERE state = 'pending' AND next_attempt_at <= ",
        now!(),
        " AND (claimed_until IS NULL OR claimed_until < ",
        now!(),
        ") ORDER BY created_at, id LIMIT ?)"
    ),
    claimed: concat!(
        "SELECT ",
        columns!(),
        " FROM idempotent_outbox WHERE claim_token = ? ORDER BY created_at, id"
    ),
    published: concat!(
        "UPDATE idempotent_outbox SET state = 'published', published_at = ",
        now!(),
        ", claim_token = NULL, claimed_until = NULL, last_error = NULL \
         WHERE claim_token = ? AND id IN ({ids})"
    ),
    failed: concat!(
        "UPDATE idempotent_outbox SET last_error = ?, \
         state = CASE WHEN attempts >= ? THEN 'dead' ELSE 'pending' END, \
         next_attempt_at = ",
        now!(),
        " + ?, claim_token = NULL, claimed_until = NULL \
         WHERE id = ? AND claim_token = ?"
    ),
    get: concat!(
        "SELECT ",
        columns!(),
        " FROM idempotent_outbox WHERE id = ?"
    ),
    dead: concat!(
        "SELECT ",
        columns!(),
        ", last_error, (",
        now!(),
        " - created_at) / 1000.0 AS age \
         FROM idempotent_outbox WHERE state = 'dead' ORDER BY created_at, id LIMIT ?"
    ),
    retry: concat!(
        "UPDATE idempotent_outbox SET state = 'pending', attempts = 0, next_attempt_at = ",
        now!(),
        " WHERE id = ? AND state = 'dead'"
    ),
    discard: "DELETE FROM idempotent_outbox WHERE id = ? AND state = 'dead'",
    force_discard: concat!(
        "DELETE FROM idempotent_outbox WHERE id = ? AND state IN ('pending', 'dead') \
         AND (claimed_until IS NULL OR claimed_until < ",
        now!(),
        ")"
    ),
    inspect: concat!(
        "SELECT ",
        columns!(),
        ", state, last_error, (",
        now!(),
        " - created_at) / 1000.0 AS age, CASE WHEN claimed_until >= ",
        now!(),
        " THEN 1 ELSE 0 END AS claimed FROM idempotent_outbox WHERE id = ?"
    ),
    release: "UPDATE idempotent_outbox SET attempts = MAX(attempts - 1, 0), \
              claim_token = NULL, claimed_until = NULL \
              WHERE claim_token = ? AND state = 'pending'",
    purge: concat!(
        "DELETE FROM idempotent_outbox WHERE id IN (SELECT id FROM idempotent_outbox \
         WHERE state = 'published' AND published_at < ",
        now!(),
        " - ? ORDER BY published_at LIMIT ?)"
    ),
    counts: COUNTS,
};

impl OutboxDialectImpl for Sqlite {
    const OUTBOX: OutboxTemplates = TEMPLATES;
    const NOTIFIES: bool = false;
    const NUMBERED: bool = false;

    outbox_fns!(Sqlite);
}
