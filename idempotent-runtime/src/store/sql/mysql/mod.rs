//! MySQL and MariaDB: the claim is one `INSERT ... ON DUPLICATE KEY UPDATE` with conditional
//! assignments, which reports an acquisition through `LAST_INSERT_ID(expr)` in the same
//! reply. On MariaDB 10.5 and later, a shorter insert-only statement goes first (a fresh key
//! is acquired by it alone), and the full claim that follows it when the key had a row
//! returns the record (`RETURNING`); on MySQL, a claim that did not take the key reads the
//! record with a locking read. A batch claim is one insert-only statement on MariaDB,
//! followed by the full claim for the keys that had a row, and a statement and a read on
//! MySQL.

use sqlx::mysql::{MySql, MySqlArguments, MySqlConnection};
use sqlx::pool::PoolOptions;
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Pool, Row};

use crate::database::SqlDatabase;
use crate::store::sql::bind::{bind_claims, bind_endings, bind_keys, statement_fns, with_rows};
use crate::store::sql::by_key::{claim_keys, in_request_order, ByKey};
use crate::store::sql::dialect::{Arg, DialectImpl, Statements, Templates, HEADROOM};
use crate::store::sql::record::{RecordRow, Step, Stored};
use crate::store::{BoxFuture, ClaimRequest, Ending};

mod statements;

use statements::{
    CLAIM, CLAIM_FRESH, CLAIM_MANY, CLAIM_MANY_FRESH, CLAIM_MANY_REPORTING, CLAIM_REPORTING,
    CLAIM_ROW, COMPLETE, COMPLETE_MANY, DELETE, DELETE_CORRUPT, PURGE, READ, RELEASE, RENEW,
    REOPEN, SCAN, SEEN, SEEN_MANY,
};

/// The capacity of the `result` column, `MEDIUMBLOB`.
const MEDIUMBLOB: usize = (1 << 24) - 1;

// The migration's column sizes hold every key and prefix the key module can produce.
const _: () = assert!(crate::key::MAX_KEY_LEN <= 512 && crate::key::MAX_PREFIX_LEN <= 128);

impl DialectImpl for MySql {
    const SQL: Templates = Templates {
        claim: CLAIM,
        seen: SEEN,
        complete: COMPLETE,
        release: RELEASE,
        reopen: REOPEN,
        renew: RENEW,
        read: READ,
        purge: PURGE,
        scan: SCAN,
        delete: DELETE,
        delete_corrupt: DELETE_CORRUPT,
        complete_many: COMPLETE_MANY,
        claim_async: "",
        claim_many_async: "",
        claim_many: CLAIM_MANY,
        // Read after a batch claim, and after a batch ending that did not resolve every
        // item.
        seen_many: SEEN_MANY,
        claim_fresh: CLAIM_FRESH,
        claim_fresh_async: "",
        claim_many_fresh: CLAIM_MANY_FRESH,
        claim_many_fresh_async: "",
        claim_reporting: CLAIM_REPORTING,
        claim_many_reporting: CLAIM_MANY_REPORTING,
    };
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)] = &[(
        1,
        "create idempotent_records",
        include_str!("../../../../migrations/mysql/0001_create_idempotent_records.sql"),
    )];

    fn open(
        options: PoolOptions<Self>,
        url: &str,
    ) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(options.connect(url))
    }

    /// MariaDB 10.5 and later, whose `INSERT` takes a `RETURNING` clause; MySQL has none.
    fn reports_claims(pool: &Pool<Self>) -> BoxFuture<'_, Result<bool, sqlx::Error>> {
        Box::pin(async move {
            let version: String = sqlx::query_scalar("SELECT VERSION()")
                .fetch_one(pool)
                .await?;
            Ok(returns_from_insert(&version))
        })
    }

    /// On MariaDB, [`CLAIM_FRESH`], and when it met a row, [`CLAIM_REPORTING`]: an absent
    /// key is acquired in one round trip, any other claim is answered in two (the second
    /// one returns the record), or in one when the caller already saw the key's record
    /// (`fresh` is false: [`CLAIM_REPORTING`] alone). On MySQL, [`CLAIM`]: it reports an
    /// acquisition in its reply (one round trip), and a claim that did not take the key
    /// reads the record with a locking read (two).
    fn claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
        fresh: bool,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>> {
        Box::pin(async move {
            let reporting = !sql.claim_reporting.is_empty();
            if reporting && !fresh {
                return claim_reporting(conn, sql, req).await;
            }
            let first = if reporting {
                &sql.claim_fresh
            } else {
                &sql.claim
            };
            let done = bind_claims::<MySql>(AssertSqlSafe(first.clone()), &[req], Self::TICK)?
                .execute(&mut *conn)
                .await?;
            if done.last_insert_id() > 0 {
                return Ok(Step::Acquired(done.last_insert_id()));
            }
            if reporting {
                return claim_reporting(conn, sql, req).await;
            }
            let key = [Arg::Bytes(req.key.as_bytes())];
            Ok(Step::Seen(Self::fetch(conn, &sql.seen, &key).await?))
        })
    }

    const BATCH: usize = 500;

    /// One multi-row claim. On MariaDB it returns every key's record; on MySQL one read of
    /// the batch's records follows it. A record in progress with the item's token is its
    /// acquisition, any other is reported as the single claim reports the record it did
    /// not take.
    fn claim_batch<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Step>, sqlx::Error>> {
        Box::pin(async move {
            let mut seen = claim_keys(reqs);
            if !sql.claim_many_reporting.is_empty() {
                let query = multi_row_claim(&sql.claim_many_reporting, reqs)?;
                for row in &query.fetch_all(&mut *conn).await? {
                    let (key, step) = RecordRow::decode_keyed(row)?;
                    seen.insert(&key, step);
                }
                return Ok(in_request_order(seen));
            }
            multi_row_claim(&sql.claim_many, reqs)?
                .execute(&mut *conn)
                .await?;
            let read = with_rows(&sql.seen_many, "{keys}", reqs.len(), ("?", ", ", "?"));
            let query = bind_keys::<MySql>(
                AssertSqlSafe(read),
                reqs.iter().map(|req| req.key.as_bytes()),
            )?;
            for row in &query.fetch_all(&mut *conn).await? {
                let (key, step) = RecordRow::decode_keyed(row)?;
                seen.insert(&key, step);
            }
            Ok(in_request_order(seen))
        })
    }

    /// [`CLAIM_MANY_FRESH`] (MariaDB): a batch of fresh keys is claimed in one round trip;
    /// the store sends [`CLAIM_MANY_REPORTING`] for the keys it did not take.
    fn claim_batch_fresh<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Option<Step>>, sqlx::Error>> {
        Box::pin(async move {
            let query = multi_row_claim(&sql.claim_many_fresh, reqs)?;
            let rows = query.fetch_all(&mut *conn).await?;
            let mut found = ByKey::new(reqs.iter().map(|req| req.key.as_bytes()));
            // Read in place: the key and the token are compared, never kept.
            for row in &rows {
                let key: &[u8] = row.try_get(0)?;
                let token: &[u8] = row.try_get(1)?;
                let fence: i64 = row.try_get(2)?;
                let inserted: u64 = row.try_get(3)?;
                found.insert(key, (token, fence, inserted));
            }
            Ok(found
                .into_found()
                .into_iter()
                .zip(reqs)
                .map(|(found, req)| match found {
                    Some((token, fence, inserted))
                        if inserted != 0
                            && u64::try_from(fence) == Ok(inserted)
                            && token == req.token.as_bytes() =>
                    {
                        Some(Step::Acquired(inserted))
                    }
                    _ => None,
                })
                .collect())
        })
    }

    const COMPLETE_BATCH: usize = 500;

    /// A multiple-table `UPDATE` does not say which rows it changed, and the read after it
    /// cannot tell a record this statement released from one its owner had released before
    /// (a single release answers `false` for that one): releases, the rare ending of a
    /// batch, go one by one.
    const BATCH_RELEASES: bool = false;

    /// One multiple-table `UPDATE`; when it changed fewer rows than it was given, the
    /// records are read to tell which items it ended (a record of the item's token in the
    /// state the item leaves).
    fn complete_batch<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        items: &'c [&'c Ending],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            let rows = (
                "SELECT ? AS k, ? AS t, ? AS res, ? AS ttl, ? AS c",
                " UNION ALL ",
                "SELECT ?, ?, ?, ?, ?",
            );
            let end = with_rows(&sql.complete_many, "{rows}", items.len(), rows);
            let query = bind_endings::<MySql>(AssertSqlSafe(end), items, Self::TICK)?;
            let changed = query.execute(&mut *conn).await?.rows_affected();
            if changed == items.len() as u64 {
                return Ok(vec![true; items.len()]);
            }
            let read = with_rows(&sql.seen_many, "{keys}", items.len(), ("?", ", ", "?"));
            let query = bind_keys::<MySql>(
                AssertSqlSafe(read),
                items.iter().map(|item| item.key.as_bytes()),
            )?;
            let mut records = ByKey::new(items.iter().map(|item| item.key.as_bytes()));
            for row in &query.fetch_all(&mut *conn).await? {
                // A record that is not readable was left alone: the item is answered as
                // corrupt by reading it again.
                if let (key, Step::Seen(Some(record))) = RecordRow::decode_keyed(row)? {
                    if Stored::from_row(record.clone(), Self::TICK).is_ok() {
                        records.insert(&key, (record.token, record.state));
                    }
                }
            }
            Ok(items
                .iter()
                .zip(records.into_found())
                .map(|(item, record)| {
                    let left = match item.action {
                        crate::store::End::Complete(_) => "completed",
                        _ => "released",
                    };
                    record.is_some_and(|(token, state)| {
                        token.as_slice() == item.token.as_bytes() && state == left
                    })
                })
                .collect())
        })
    }

    /// The `MEDIUMBLOB` column's capacity, and the server's `max_allowed_packet` (the whole
    /// statement must fit in one packet) less [`HEADROOM`].
    fn result_capacity(pool: &Pool<Self>) -> BoxFuture<'_, Result<usize, sqlx::Error>> {
        Box::pin(async move {
            let packet: u64 = sqlx::query_scalar("SELECT CAST(@@max_allowed_packet AS UNSIGNED)")
                .fetch_one(pool)
                .await?;
            let packet = usize::try_from(packet).unwrap_or(usize::MAX);
            Ok(MEDIUMBLOB.min(packet.saturating_sub(HEADROOM)))
        })
    }

    statement_fns!(MySqlConnection);
}

/// [`CLAIM_REPORTING`] for `req`: the record it takes or leaves.
async fn claim_reporting(
    conn: &mut MySqlConnection,
    sql: &Statements,
    req: &ClaimRequest,
) -> Result<Step, sqlx::Error> {
    let query = AssertSqlSafe(sql.claim_reporting.clone());
    let row = bind_claims::<MySql>(query, &[req], MySql::TICK)?
        .fetch_optional(&mut *conn)
        .await?;
    Ok(Step::Seen(row.as_ref().map(RecordRow::decode).transpose()?))
}

/// Whether the server whose `VERSION()` is `version` takes `INSERT ... RETURNING`: MariaDB
/// 10.5 and later (`10.11.19-MariaDB-0+deb12u1`, or with the `5.5.5-` some proxies put
/// first). MySQL (`8.4.3`) has no such clause, nor has an unknown version.
fn returns_from_insert(version: &str) -> bool {
    if !version.contains("MariaDB") {
        return false;
    }
    let version = version.strip_prefix("5.5.5-").unwrap_or(version);
    let mut parts = version.split(['.', '-']).map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (10, 5),
        _ => false,
    }
}

/// `template` (a claim with a `{rows}` marker) with one [`CLAIM_ROW`] per request, bound to
/// `reqs`.
fn multi_row_claim<'q>(
    template: &str,
    reqs: &[&ClaimRequest],
) -> Result<Query<'q, MySql, MySqlArguments>, sqlx::Error> {
    let claim = with_rows(template, "{rows}", reqs.len(), (CLAIM_ROW, ", ", CLAIM_ROW));
    bind_claims(AssertSqlSafe(claim), reqs, MySql::TICK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returning_is_used_on_mariadb_10_5_and_later_only() {
        for version in [
            "10.11.19-MariaDB-0+deb12u1",
            "10.5.0-MariaDB",
            "11.4.2-MariaDB-ubu2404",
            "5.5.5-10.6.12-MariaDB-log",
        ] {
            assert!(returns_from_insert(version), "{version}");
        }
        for version in [
            "10.4.32-MariaDB",
            "5.5.5-10.3.39-MariaDB",
            "8.4.3",
            "8.0.36-0ubuntu0.22.04.1",
            "9.1.0-commercial",
            "MariaDB",
            "",
        ] {
            assert!(!returns_from_insert(version), "{version}");
        }
    }
}
