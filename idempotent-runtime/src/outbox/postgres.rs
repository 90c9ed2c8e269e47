//! The outbox's statements on PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

use crate::outbox::{DeadMessage, Message, MessageId, OutboxCounts, OutboxMessage};
use crate::store::sql::table::TableName;
use crate::store::Token;

const CREATE: &str =
    include_str!("../../migrations/outbox/postgres/0001_create_idempotent_outbox.sql");

/// `template` with `idempotent_outbox` (and the index names derived from it) replaced by
/// `table`'s.
fn render(table: &TableName, template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 64);
    let mut rest = template;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        out.push_str(&rest[..start]);
        let len = rest[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len() - start);
        let word = &rest[start..start + len];
        match word.strip_prefix("idempotent_outbox") {
            Some("") => out.push_str(table.as_str()),
            Some(suffix @ ("_due" | "_published")) => out.push_str(&table.with_suffix(suffix)),
            _ => out.push_str(word),
        }
        rest = &rest[start + len..];
    }
    out.push_str(rest);
    out
}

/// Seconds as PostgreSQL takes them in `make_interval(secs => ...)`.
fn secs(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

pub(crate) async fn create_table(pool: &PgPool, table: &TableName) -> Result<(), sqlx::Error> {
    let sql = render(table, CREATE);
    let mut conn = pool.acquire().await?;
    if let Some(schema) = table.schema() {
        sqlx::query(AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {schema}"
        )))
        .execute(&mut *conn)
        .await?;
    }
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Inserts the row and notifies `channel` (delivered when the transaction commits), in one
/// round trip.
pub(crate) async fn enqueue(
    conn: &mut PgConnection,
    table: &TableName,
    channel: &str,
    id: &MessageId,
    message: &Message,
    headers: &str,
) -> Result<(), sqlx::Error> {
    let sql = format!(
        "WITH queued AS (INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, \
         destination, payload, headers) VALUES ($1, $2, $3, $4, $5, $6, $7)) \
         SELECT pg_notify($8, '')",
        t = table.as_str()
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .bind(&message.aggregate_type)
        .bind(&message.aggregate_id)
        .bind(&message.event_type)
        .bind(&message.destination)
        .bind(&message.payload)
        .bind(headers)
        .bind(channel)
        .execute(conn)
        .await?;
    Ok(())
}

const COLUMNS: &str = "id, aggregate_type, aggregate_id, event_type, destination, payload, \
                       headers, attempts";

fn message(row: &PgRow) -> Result<OutboxMessage, sqlx::Error> {
    let headers: String = row.try_get("headers")?;
    let headers: BTreeMap<String, String> =
        serde_json::from_str(&headers).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let attempts: i32 = row.try_get("attempts")?;
    Ok(OutboxMessage {
        id: MessageId::from_string(row.try_get("id")?),
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        event_type: row.try_get("event_type")?,
        destination: row.try_get("destination")?,
        payload: row.try_get("payload")?,
        headers,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

/// Claims at most `batch` due rows for `token` until `lease` from now, counting an attempt
/// on each; rows other relays hold are skipped, not waited for.
pub(crate) async fn claim(
    pool: &PgPool,
    table: &TableName,
    token: &Token,
    lease: Duration,
    batch: u32,
) -> Result<Vec<OutboxMessage>, sqlx::Error> {
    let sql = format!(
        "UPDATE {t} SET claim_token = $1, \
                claimed_until = statement_timestamp() + make_interval(secs => $2), \
                attempts = attempts + 1 \
         WHERE id IN (SELECT id FROM {t} \
                      WHERE state = 'pending' AND next_attempt_at <= statement_timestamp() \
                        AND (claimed_until IS NULL OR claimed_until < statement_timestamp()) \
                      ORDER BY created_at, id LIMIT $3 FOR UPDATE SKIP LOCKED) \
         RETURNING {COLUMNS}, EXTRACT(EPOCH FROM created_at)::float8 AS created",
        t = table.as_str()
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(&token.as_bytes()[..])
        .bind(secs(lease))
        .bind(i64::from(batch))
        .fetch_all(pool)
        .await?;
    let mut messages = rows
        .iter()
        .map(|row| Ok((row.try_get::<f64, _>("created")?, message(row)?)))
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    // `RETURNING` keeps no order: publish oldest first, as claimed.
    messages.sort_by(|(a, x), (b, y)| a.total_cmp(b).then_with(|| x.id.cmp(&y.id)));
    Ok(messages.into_iter().map(|(_, message)| message).collect())
}

/// Marks `id` published, if `token` still holds it.
pub(crate) async fn published(
    pool: &PgPool,
    table: &TableName,
    id: &MessageId,
    token: &Token,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE {t} SET state = 'published', published_at = statement_timestamp(), \
                claim_token = NULL, claimed_until = NULL, last_error = NULL \
         WHERE id = $1 AND claim_token = $2",
        t = table.as_str()
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .bind(&token.as_bytes()[..])
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Records a failed attempt on `id` (if `token` still holds it): due again after
/// `retry_in`, or `dead` once it has had `max_attempts`.
pub(crate) async fn failed(
    pool: &PgPool,
    table: &TableName,
    id: &MessageId,
    token: &Token,
    error: &str,
    max_attempts: u32,
    retry_in: Duration,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE {t} SET claim_token = NULL, claimed_until = NULL, last_error = $3, \
                state = CASE WHEN attempts >= $4 THEN 'dead' ELSE 'pending' END, \
                next_attempt_at = statement_timestamp() + make_interval(secs => $5) \
         WHERE id = $1 AND claim_token = $2",
        t = table.as_str()
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .bind(&token.as_bytes()[..])
        .bind(error)
        .bind(i64::from(max_attempts))
        .bind(secs(retry_in))
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

pub(crate) async fn get(
    pool: &PgPool,
    table: &TableName,
    id: &MessageId,
) -> Result<Option<OutboxMessage>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM {t} WHERE id = $1",
        t = table.as_str()
    );
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .fetch_optional(pool)
        .await?;
    row.as_ref().map(message).transpose()
}

pub(crate) async fn dead(
    pool: &PgPool,
    table: &TableName,
    limit: u32,
) -> Result<Vec<DeadMessage>, sqlx::Error> {
    let sql = format!(
        "SELECT {COLUMNS}, last_error, \
                EXTRACT(EPOCH FROM statement_timestamp() - created_at)::float8 AS age \
         FROM {t} WHERE state = 'dead' ORDER BY created_at, id LIMIT $1",
        t = table.as_str()
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|row| {
            Ok(DeadMessage {
                message: message(row)?,
                last_error: row.try_get("last_error")?,
                age_seconds: row.try_get("age")?,
            })
        })
        .collect()
}

pub(crate) async fn retry(
    pool: &PgPool,
    table: &TableName,
    id: &MessageId,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "UPDATE {t} SET state = 'pending', attempts = 0, \
                next_attempt_at = statement_timestamp() \
         WHERE id = $1 AND state = 'dead'",
        t = table.as_str()
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

pub(crate) async fn discard(
    pool: &PgPool,
    table: &TableName,
    id: &MessageId,
) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "DELETE FROM {t} WHERE id = $1 AND state = 'dead'",
        t = table.as_str()
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(id.as_str())
        .execute(pool)
        .await?;
    Ok(done.rows_affected() == 1)
}

pub(crate) async fn purge_published(
    pool: &PgPool,
    table: &TableName,
    older_than: Duration,
    limit: u32,
) -> Result<u64, sqlx::Error> {
    let sql = format!(
        "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} \
             WHERE state = 'published' \
               AND published_at < statement_timestamp() - make_interval(secs => $1) \
             LIMIT $2 FOR UPDATE SKIP LOCKED)",
        t = table.as_str()
    );
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(secs(older_than))
        .bind(i64::from(limit))
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}

pub(crate) async fn counts(pool: &PgPool, table: &TableName) -> Result<OutboxCounts, sqlx::Error> {
    let sql = format!(
        "SELECT COUNT(*) FILTER (WHERE state = 'pending') AS pending, \
                COUNT(*) FILTER (WHERE state = 'published') AS published, \
                COUNT(*) FILTER (WHERE state = 'dead') AS dead \
         FROM {t}",
        t = table.as_str()
    );
    let row = sqlx::query(AssertSqlSafe(sql)).fetch_one(pool).await?;
    let count = |name: &str| -> Result<u64, sqlx::Error> {
        let n: i64 = row.try_get(name)?;
        Ok(u64::try_from(n).unwrap_or(0))
    };
    Ok(OutboxCounts {
        pending: count("pending")?,
        published: count("published")?,
        dead: count("dead")?,
    })
}
