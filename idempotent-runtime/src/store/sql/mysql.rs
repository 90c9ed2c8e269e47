//! MySQL and MariaDB: the claim is one `INSERT ... ON DUPLICATE KEY UPDATE` with conditional
//! assignments, which reports an acquisition through `LAST_INSERT_ID(expr)` in the same
//! reply. On MariaDB 10.5 and later, a shorter insert-only statement goes first (a fresh key
//! is acquired by it alone), and the full claim that follows it when the key had a row
//! returns the record (`RETURNING`); on MySQL, a claim that did not take the key reads the
//! record with a locking read. A batch claim is one statement on MariaDB, a statement and
//! a read on MySQL.

use std::collections::HashMap;
use std::time::Duration;

use sqlx::error::DatabaseError;
use sqlx::mysql::{MySql, MySqlConnection, MySqlDatabaseError};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Pool};

use crate::store::sql::driver::{
    bind_claims, bind_settlements, in_request_order, statement_fns, Arg, Driver, Statements,
    Templates, HEADROOM,
};
use crate::store::sql::failure::{sqlstate, DbFailure};
use crate::store::sql::record::{RecordRow, Step, Stored};
use crate::store::{BoxFuture, ClaimRequest, Settlement};

/// The database's clock in microseconds since the Unix epoch, in UTC whatever the session's
/// time zone: the fence of a key that has no record
/// ([`next_fence`](crate::store::next_fence)). `UTC_TIMESTAMP(6)` is one instant for the
/// whole statement.
macro_rules! clock_fence {
    () => {
        "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
    };
}

/// A free record: expired, or readable (a fence that is not negative; `token` and
/// `fingerprint` are `BINARY(16)`) and released or in progress with a run-out lease and no
/// other payload. A record that is not readable is never taken: it is reported as corrupt.
macro_rules! free {
    () => {
        "expires_at <= UTC_TIMESTAMP(6)
           OR (fence >= 0
               AND (state = 'released'
                    OR (state = 'in_progress' AND lease_until <= UTC_TIMESTAMP(6)
                        AND NOT (fingerprint IS NOT NULL AND VALUES(fingerprint) IS NOT NULL
                                 AND fingerprint <> VALUES(fingerprint)))))"
    };
}

/// The head of every claim: the table and its columns, up to `VALUES`.
macro_rules! insert_into {
    () => {
        "INSERT INTO idempotent_records
    (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
     created_at, updated_at, expires_at)
VALUES "
    };
}

/// One row of the claim's `VALUES`: key, prefix, token, lease, fingerprint, ttl.
macro_rules! claim_row {
    () => {
        concat!(
            "(?, ?, ?, LAST_INSERT_ID(",
            clock_fence!(),
            "), 'in_progress',
        UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, NULL, ?,
        UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)"
        )
    };
}

/// The `ON DUPLICATE KEY UPDATE` of both claims (see [`CLAIM`]).
macro_rules! take_if_free {
    () => {
        concat!(
            "ON DUPLICATE KEY UPDATE
    fence = IF(",
            free!(),
            ",
               LAST_INSERT_ID(IF(expires_at <= UTC_TIMESTAMP(6),
                                 GREATEST(fence + 1, ",
            clock_fence!(),
            "),
                                 fence + 1)),
               fence + CAST(LAST_INSERT_ID(0) AS SIGNED)),
    created_at = IF(LAST_INSERT_ID() <> 0 AND expires_at <= UTC_TIMESTAMP(6),
                    VALUES(created_at), created_at),
    token = IF(LAST_INSERT_ID() <> 0, VALUES(token), token),
    result = IF(LAST_INSERT_ID() <> 0, NULL, result),
    updated_at = IF(LAST_INSERT_ID() <> 0, VALUES(updated_at), updated_at),
    lease_until = IF(LAST_INSERT_ID() <> 0, VALUES(lease_until), lease_until),
    fingerprint = IF(LAST_INSERT_ID() <> 0, VALUES(fingerprint), fingerprint),
    expires_at = IF(LAST_INSERT_ID() <> 0, VALUES(expires_at), expires_at),
    state = IF(LAST_INSERT_ID() <> 0, 'in_progress', state)"
        )
    };
}

/// Takes the key when its record is free (absent, expired, released, or in progress with a
/// run-out lease and no other payload); leaves any other record unchanged.
///
/// InnoDB locks the duplicate row exclusively before the `UPDATE` part runs, so exactly one
/// of any number of concurrent claims takes a free record. The `UPDATE` part's assignments
/// run left to right and each sees the columns assigned before it, so the "free" test is
/// made once, by the first assignment (`fence`), on the record as it was: it leaves the new
/// fence in `LAST_INSERT_ID()` when it takes the record, and 0 when it does not. Every later
/// assignment tests `LAST_INSERT_ID() <> 0` (within a statement, `LAST_INSERT_ID()` returns
/// the value last given to `LAST_INSERT_ID(expr)`), so a record that is not free, the
/// caller's own included, is left exactly as it was.
///
/// The new fence is one more than the record's, or, for an absent record, the clock's fence;
/// for an expired one, the higher of the two, so fences never repeat for a key.
///
/// `LAST_INSERT_ID(n)` makes the reply carry `n`: the fence when the record was inserted or
/// taken over, and 0 when it was left alone. A 0 is answered by a locking read of the
/// record, so a server that did not report the value would cost a round trip, never a wrong
/// answer.
const CLAIM: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
",
    take_if_free!()
);

/// The claim of a batch of distinct keys: [`CLAIM`] with one row per key (the driver
/// replaces `{rows}` with [`CLAIM_ROW`] once per key). Each row's `ON DUPLICATE KEY UPDATE`
/// makes its own "free" test with its first assignment, which sets `LAST_INSERT_ID()` for
/// that row's later assignments, exactly as for a single claim. The statement reports
/// nothing per row: the driver reads the batch's records after it ([`SEEN_MANY`]), and a
/// record that holds the item's token in progress is the item's acquisition.
const CLAIM_MANY: &str = concat!(
    insert_into!(),
    "{rows}
",
    take_if_free!()
);

/// One row of [`CLAIM_MANY`].
const CLAIM_ROW: &str = claim_row!();

/// The record columns a claim returns: those [`SEEN`] reads.
macro_rules! claimed_columns {
    () => {
        "state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until))"
    };
}

/// The first claim MariaDB gets (see [`MySql::claim`](Driver::claim)): [`CLAIM`]'s row,
/// inserted when the key has no row; a row that exists is left exactly as it was (the
/// assignment writes the value the column holds). The row's `LAST_INSERT_ID(fence)` is
/// evaluated before the duplicate is found, so the assignment resets it to 0: the reply
/// carries the new fence when the row was inserted, 0 when the key had one.
///
/// A fresh key, the common case, is claimed by this statement alone, which is shorter for
/// the server to run than [`CLAIM`] (whose `UPDATE` part is set up on every execution).
/// Like [`CLAIM`], it locks the duplicate row exclusively.
const CLAIM_FRESH: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
ON DUPLICATE KEY UPDATE fence = fence + CAST(LAST_INSERT_ID(0) AS SIGNED)"
);

/// [`CLAIM`], returning the record it leaves: taken for the request (its token, in
/// progress) or the record it did not take, which is live (an expired record is always
/// free, so always taken). MariaDB 10.5 and later; what follows a [`CLAIM_FRESH`] that met
/// a row.
const CLAIM_REPORTING: &str = concat!(
    insert_into!(),
    claim_row!(),
    "
",
    take_if_free!(),
    "
RETURNING ",
    claimed_columns!()
);

/// [`CLAIM_MANY`], returning `record_key` and the record columns of every key: each row as
/// [`CLAIM_REPORTING`] returns it, so that no read follows the claim. MariaDB 10.5 and
/// later.
const CLAIM_MANY_REPORTING: &str = concat!(
    insert_into!(),
    "{rows}
",
    take_if_free!(),
    "
RETURNING record_key, ",
    claimed_columns!()
);

/// The record columns, then how long the record has been in its state and how long it has
/// left, in microseconds.
macro_rules! listed_columns {
    () => {
        "state, token, fence, fingerprint, result,
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), lease_until)),
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, updated_at, UTC_TIMESTAMP(6))),
       GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at))"
    };
}

const READ: &str = concat!(
    "SELECT ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)"
);

/// A page of live records with the prefix given third, by key after the first parameter and
/// below the second (a range of the primary key), at most the fourth.
const SCAN: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key > ? AND record_key < ? AND prefix = ? AND expires_at > UTC_TIMESTAMP(6)
ORDER BY record_key
LIMIT ?"
);

/// Completes and releases a batch of in-progress records: the driver replaces the `{rows}`
/// marker with one `SELECT ? ...` of `(key, token, result, ttl, complete?)` per item, joined
/// by `UNION ALL`. Only in-progress records are settled (a multiple-table `UPDATE` assigns in
/// no particular order, so no assignment may read a column another one writes): an item
/// whose record is already settled is answered by reading its record.
const SETTLE_MANY: &str = "\
UPDATE idempotent_records AS r
JOIN ({rows}) AS i ON r.record_key = i.k AND r.token = i.t
SET r.result = IF(i.c = 1, i.res, r.result),
    r.expires_at = IF(i.c = 1, UTC_TIMESTAMP(6) + INTERVAL i.ttl MICROSECOND, r.expires_at),
    r.updated_at = UTC_TIMESTAMP(6),
    r.state = IF(i.c = 1, 'completed', 'released')
WHERE r.state = 'in_progress' AND r.fence >= 0 AND r.expires_at > UTC_TIMESTAMP(6)";

/// The live records of a batch's keys, `record_key` first; the driver replaces `{keys}` with
/// one `?` per key.
const SEEN_MANY: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key IN ({keys}) AND expires_at > UTC_TIMESTAMP(6)"
);

const DELETE: &str = "\
DELETE FROM idempotent_records
WHERE record_key = ? AND token = ? AND expires_at > UTC_TIMESTAMP(6)
  AND NOT (state = 'in_progress' AND lease_until > UTC_TIMESTAMP(6))
  AND fence >= 0 AND state IN ('in_progress', 'completed', 'released')";

/// `token` and `fingerprint` are `BINARY(16)`: a negative fence or an unknown state (a table
/// whose check was dropped) is what makes a record unreadable.
const DELETE_CORRUPT: &str = "\
DELETE FROM idempotent_records
WHERE record_key = ? AND NOT (fence >= 0 AND state IN ('in_progress', 'completed', 'released'))";

/// A locking read: it returns the latest committed version (not a transaction's snapshot)
/// and, inside a transaction, keeps the row locked like the claim did.
const SEEN: &str = concat!(
    "SELECT ",
    claimed_columns!(),
    "
FROM idempotent_records
WHERE record_key = ? AND expires_at > UTC_TIMESTAMP(6)
FOR UPDATE"
);

/// `state` is assigned last: the assignments before it test the old state. A record that is
/// not readable (an unknown state, a negative fence) is left alone, and reported as corrupt.
const COMPLETE: &str = "\
UPDATE idempotent_records SET
    result = IF(state = 'in_progress', ?, result),
    expires_at = IF(state = 'in_progress', UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, expires_at),
    updated_at = IF(state = 'in_progress', UTC_TIMESTAMP(6), updated_at),
    state = 'completed'
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed') AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

const REOPEN: &str = "\
UPDATE idempotent_records SET state = 'released', result = NULL, updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed', 'released')
  AND fence >= 0 AND expires_at > UTC_TIMESTAMP(6)";

const RELEASE: &str = "\
UPDATE idempotent_records SET state = 'released', updated_at = UTC_TIMESTAMP(6)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

const RENEW: &str = "\
UPDATE idempotent_records SET
    lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
    expires_at = GREATEST(expires_at, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND)
WHERE record_key = ? AND token = ? AND state = 'in_progress' AND fence >= 0
  AND expires_at > UTC_TIMESTAMP(6)";

/// Each row is deleted only if it is still expired when the delete reaches it.
const PURGE: &str = "\
DELETE FROM idempotent_records
WHERE expires_at <= UTC_TIMESTAMP(6)
ORDER BY expires_at
LIMIT ?";

/// The capacity of the `result` column, `MEDIUMBLOB`.
const MEDIUMBLOB: usize = (1 << 24) - 1;

// The migration's column sizes hold every key and prefix the key module can produce.
const _: () = assert!(crate::key::MAX_KEY_LEN <= 512 && crate::key::MAX_PREFIX_LEN <= 128);

impl Driver for MySql {
    const SCHEMA_QUALIFIED: bool = false;
    const TICK: Duration = Duration::from_micros(1);
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
        settle_many: SETTLE_MANY,
        claim_async: "",
        claim_many_async: "",
        claim_many: CLAIM_MANY,
        // Read after a batch claim, and after a batch settlement that did not settle every
        // item.
        seen_many: SEEN_MANY,
        claim_fresh: CLAIM_FRESH,
        claim_reporting: CLAIM_REPORTING,
        claim_many_reporting: CLAIM_MANY_REPORTING,
    };
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)] = &[(
        1,
        "create idempotent_records",
        include_str!("../../../migrations/mysql/0001_create_idempotent_records.sql"),
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
    /// one returns the record). On MySQL, [`CLAIM`]: it reports an acquisition in its reply
    /// (one round trip), and a claim that did not take the key reads the record with a
    /// locking read (two).
    fn claim<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>> {
        Box::pin(async move {
            let reporting = !sql.claim_reporting.is_empty();
            let first = if reporting {
                &sql.claim_fresh
            } else {
                &sql.claim
            };
            let done = bind_claims(
                sqlx::query(AssertSqlSafe(first.clone())),
                &[req],
                Self::TICK,
            )
            .execute(&mut *conn)
            .await?;
            if done.last_insert_id() > 0 {
                return Ok(Step::Acquired(done.last_insert_id()));
            }
            if reporting {
                let query = sqlx::query(AssertSqlSafe(sql.claim_reporting.clone()));
                let row = bind_claims(query, &[req], Self::TICK)
                    .fetch_optional(&mut *conn)
                    .await?;
                return Ok(Step::Seen(row.as_ref().map(RecordRow::decode).transpose()?));
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
            let rows = vec![CLAIM_ROW; reqs.len()].join(", ");
            let mut seen = HashMap::with_capacity(reqs.len());
            if !sql.claim_many_reporting.is_empty() {
                let claim = sql.claim_many_reporting.replace("{rows}", &rows);
                let query = bind_claims(sqlx::query(AssertSqlSafe(claim)), reqs, Self::TICK);
                for row in &query.fetch_all(&mut *conn).await? {
                    let (key, step) = RecordRow::decode_keyed(row)?;
                    seen.insert(key, step);
                }
                return Ok(in_request_order(reqs, seen));
            }
            let claim = sql.claim_many.replace("{rows}", &rows);
            let query = bind_claims(sqlx::query(AssertSqlSafe(claim)), reqs, Self::TICK);
            query.execute(&mut *conn).await?;
            let keys = vec!["?"; reqs.len()].join(", ");
            let read = sql.seen_many.replace("{keys}", &keys);
            let mut query = sqlx::query(AssertSqlSafe(read));
            for req in reqs {
                query = query.bind(req.key.as_bytes());
            }
            for row in &query.fetch_all(&mut *conn).await? {
                let (key, step) = RecordRow::decode_keyed(row)?;
                seen.insert(key, step);
            }
            Ok(in_request_order(reqs, seen))
        })
    }

    const SETTLE_BATCH: usize = 500;

    /// A multiple-table `UPDATE` does not say which rows it changed, and the read after it
    /// cannot tell a record this statement released from one its owner had released before
    /// (a single release answers `false` for that one): releases, the rare settlement of a
    /// batch, go one by one.
    const BATCH_RELEASES: bool = false;

    /// One multiple-table `UPDATE`; when it changed fewer rows than it was given, the
    /// records are read to tell which items it settled (a record of the item's token in the
    /// state the item leaves).
    fn settle_batch<'c>(
        conn: &'c mut MySqlConnection,
        sql: &'c Statements,
        items: &'c [&'c Settlement],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            let first = "SELECT ? AS k, ? AS t, ? AS res, ? AS ttl, ? AS c";
            let mut rows = String::with_capacity(items.len() * 40);
            for i in 0..items.len() {
                rows.push_str(if i == 0 {
                    first
                } else {
                    " UNION ALL SELECT ?, ?, ?, ?, ?"
                });
            }
            let settle = sql.settle_many.replace("{rows}", &rows);
            let query = bind_settlements(sqlx::query(AssertSqlSafe(settle)), items, Self::TICK);
            let changed = query.execute(&mut *conn).await?.rows_affected();
            if changed == items.len() as u64 {
                return Ok(vec![true; items.len()]);
            }
            let keys = vec!["?"; items.len()].join(", ");
            let read = sql.seen_many.replace("{keys}", &keys);
            let mut query = sqlx::query(AssertSqlSafe(read));
            for item in items {
                query = query.bind(item.key.as_bytes());
            }
            let mut records: HashMap<Vec<u8>, (Vec<u8>, String)> = HashMap::new();
            for row in &query.fetch_all(&mut *conn).await? {
                // A record that is not readable was left alone: the item is answered as
                // corrupt by reading it again.
                if let (key, Step::Seen(Some(record))) = RecordRow::decode_keyed(row)? {
                    if Stored::from_row(record.clone(), Self::TICK).is_ok() {
                        records.insert(key, (record.token, record.state));
                    }
                }
            }
            Ok(items
                .iter()
                .map(|item| {
                    let left = match item.action {
                        crate::store::Settle::Complete(_) => "completed",
                        _ => "released",
                    };
                    records
                        .get(item.key.as_bytes())
                        .is_some_and(|(token, state)| {
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

    fn classify(err: &dyn DatabaseError) -> DbFailure {
        let number = err
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number);
        number
            .and_then(by_number)
            .unwrap_or_else(|| err.code().map_or(DbFailure::Other, |code| sqlstate(&code)))
    }
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

/// The server error numbers whose SQLSTATE does not say what they mean.
fn by_number(number: u16) -> Option<DbFailure> {
    Some(match number {
        // ER_LOCK_WAIT_TIMEOUT (the statement was rolled back), ER_LOCK_DEADLOCK
        1205 | 1213 => DbFailure::Conflict,
        // ER_OPTION_PREVENTS_STATEMENT (--read-only), ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION
        1290 | 1792 => DbFailure::ReadOnly,
        // ER_SERVER_SHUTDOWN, ER_QUERY_INTERRUPTED, ER_CON_COUNT_ERROR,
        // ER_CONNECTION_KILLED (MariaDB)
        1053 | 1317 | 1040 | 1927 => DbFailure::Unavailable,
        // ER_NET_PACKET_TOO_LARGE: the statement is larger than `max_allowed_packet` (SQLSTATE
        // 08S01, as for a lost connection; the server closes the connection after it).
        // ER_WARN_ALLOWED_PACKET_OVERFLOWED, ER_TOO_BIG_ROWSIZE,
        // ER_TRUNCATED_WRONG_VALUE_FOR_FIELD, ER_CHECK_CONSTRAINT_VIOLATED (MySQL; MariaDB's
        // ER_CONSTRAINT_FAILED is SQLSTATE 23000)
        1153 | 1301 | 1118 | 1366 | 3819 => DbFailure::Rejected,
        _ => return None,
    })
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

    #[test]
    fn permanent_errors_are_rejections() {
        // Seen from MariaDB 10.11: a result above `max_allowed_packet` is 1153 with SQLSTATE
        // 08S01, which alone would read as a lost connection.
        assert_eq!(by_number(1153), Some(DbFailure::Rejected));
        assert_eq!(sqlstate("08S01"), DbFailure::Unavailable);
        assert_eq!(by_number(1213), Some(DbFailure::Conflict));
        assert_eq!(by_number(1406), None);
        assert_eq!(sqlstate("22001"), DbFailure::Rejected);
    }
}
