//! The outbox on PostgreSQL: due rows claimed with `FOR UPDATE SKIP LOCKED` in one statement
//! that returns them; `enqueue` notifies the table's channel, delivered at commit.

use sqlx::postgres::{PgListener, PgPool, Postgres};

use crate::outbox::dialect::{outbox_fns, Listener, OutboxDialectImpl, OutboxTemplates, COUNTS};
use crate::store::BoxFuture;

/// The message columns, as every dialect reads them.
macro_rules! columns {
    () => {
        "id, aggregate_type, aggregate_id, event_type, destination, payload, headers, \
         attempts::bigint AS attempts"
    };
}

const TEMPLATES: OutboxTemplates = OutboxTemplates {
    create: include_str!("../../migrations/outbox/postgres/0001_create_idempotent_outbox.sql"),
    enqueue: "WITH queued AS (INSERT INTO idempotent_outbox (id, aggregate_type, aggregate_id, \
              event_type, destination, payload, headers) VALUES ($1, $2, $3, $4, $5, $6, $7)) \
              SELECT pg_notify($8, '')",
    claim: concat!(
        "WITH claimed AS (UPDATE idempotent_outbox SET claim_token = $1, \
                claimed_until = statement_timestamp() + $2 * interval '1 microsecond', \
                attempts = attempts + 1 \
         WHERE id IN (SELECT id FROM idempotent_outbox \
                      WHERE state = 'pending' AND next_attempt_at <= statement_timestamp() \
                        AND (claimed_until IS NULL OR claimed_until < statement_timestamp()) \
                      ORDER BY created_at, id LIMIT $3 FOR UPDATE SKIP LOCKED) \
         RETURNING created_at, ",
        columns!(),
        ") SELECT * FROM claimed ORDER BY created_at, id"
    ),
    claimed: "",
    published: "UPDATE idempotent_outbox SET state = 'published', \
                published_at = statement_timestamp(), claim_token = NULL, \
                claimed_until = NULL, last_error = NULL \
                WHERE claim_token = $1 AND id IN ({ids})",
    failed: "UPDATE idempotent_outbox SET last_error = $1, \
             state = CASE WHEN attempts >= $2 THEN 'dead' ELSE 'pending' END, \
             next_attempt_at = statement_timestamp() + $3 * interval '1 microsecond', \
             claim_token = NULL, claimed_until = NULL \
             WHERE id = $4 AND claim_token = $5",
    get: concat!(
        "SELECT ",
        columns!(),
        " FROM idempotent_outbox WHERE id = $1"
    ),
    dead: concat!(
        "SELECT ",
        columns!(),
        ", last_error, \
         EXTRACT(EPOCH FROM statement_timestamp() - created_at)::float8 AS age \
         FROM idempotent_outbox WHERE state = 'dead' ORDER BY created_at, id LIMIT $1"
    ),
    retry: "UPDATE idempotent_outbox SET state = 'pending', attempts = 0, \
            next_attempt_at = statement_timestamp() WHERE id = $1 AND state = 'dead'",
    discard: "DELETE FROM idempotent_outbox WHERE id = $1 AND state = 'dead'",
    force_discard: "DELETE FROM idempotent_outbox WHERE id = $1 AND state IN ('pending', 'dead') \
                    AND (claimed_until IS NULL OR claimed_until < statement_timestamp())",
    inspect: concat!(
        "SELECT ",
        columns!(),
        ", state, last_error, \
         EXTRACT(EPOCH FROM statement_timestamp() - created_at)::float8 AS age, \
         CASE WHEN claimed_until >= statement_timestamp() THEN 1::bigint ELSE 0::bigint END \
         AS claimed FROM idempotent_outbox WHERE id = $1"
    ),
    release: "UPDATE idempotent_outbox SET attempts = GREATEST(attempts - 1, 0), \
              claim_token = NULL, claimed_until = NULL \
              WHERE claim_token = $1 AND state = 'pending'",
    purge: "DELETE FROM idempotent_outbox WHERE id IN (SELECT id FROM idempotent_outbox \
            WHERE state = 'published' \
              AND published_at < statement_timestamp() - $1 * interval '1 microsecond' \
            LIMIT $2 FOR UPDATE SKIP LOCKED)",
    counts: COUNTS,
};

struct PgWake(PgListener);

impl Listener for PgWake {
    fn recv(&mut self) -> BoxFuture<'_, Result<(), sqlx::Error>> {
        Box::pin(async move { self.0.recv().await.map(drop) })
    }
}

impl OutboxDialectImpl for Postgres {
    const OUTBOX: OutboxTemplates = TEMPLATES;
    const NOTIFIES: bool = true;
    const NUMBERED: bool = true;

    outbox_fns!(Postgres);

    fn listen<'p>(
        pool: &'p PgPool,
        channel: &'p str,
    ) -> BoxFuture<'p, Result<Option<Box<dyn Listener>>, sqlx::Error>> {
        Box::pin(async move {
            let mut listener = PgListener::connect_with(pool).await?;
            listener.listen(channel).await?;
            Ok(Some(Box::new(PgWake(listener)) as Box<dyn Listener>))
        })
    }
}
