//! SQLite: the claim is one `INSERT ... ON CONFLICT DO UPDATE ... WHERE <free> RETURNING`;
//! a claim that did not take the key reads the record.

use std::str::FromStr;
use std::time::Duration;

use sqlx::pool::PoolOptions;
use sqlx::sqlite::{Sqlite, SqliteConnectOptions, SqliteConnection};
use sqlx::{AssertSqlSafe, Pool, Row};

use crate::database::SqlDatabase;
use crate::store::sql::bind::{bind_claims, bind_endings, bind_keys, statement_fns, with_rows};
use crate::store::sql::by_key::{claim_keys, ended_in_order, in_request_order};
use crate::store::sql::dialect::{ticks, Arg, DialectImpl, Statements, Templates, HEADROOM};
use crate::store::sql::record::{RecordRow, Step};
use crate::store::{BoxFuture, ClaimRequest, Ending};

/// The database's clock in milliseconds since the Unix epoch. SQLite evaluates `'now'` once
/// per statement step, so every use in one statement sees the same instant.
macro_rules! now {
    () => {
        "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"
    };
}

/// The database's clock in microseconds since the Unix epoch (SQLite's clock has
/// milliseconds): the fence of a key that has no record
/// ([`next_fence`](crate::store::next_fence)).
macro_rules! clock_fence {
    () => {
        concat!(now!(), " * 1000")
    };
}

/// The columns of a record row (`$r` is `r.` or empty) hold what the store can read (SQLite
/// stores any type in any column): an integer fence that is not negative, a 16-byte token, a
/// 16-byte fingerprint or none. Claims never take, and owner-checked writes never change, a
/// row that fails this: it is reported as corrupt.
macro_rules! readable {
    ($r:literal) => {
        concat!(
            "typeof(",
            $r,
            "fence) = 'integer' AND ",
            $r,
            "fence >= 0
       AND typeof(",
            $r,
            "token) IN ('blob', 'text') AND length(CAST(",
            $r,
            "token AS BLOB)) = 16
       AND (",
            $r,
            "fingerprint IS NULL OR (typeof(",
            $r,
            "fingerprint) IN ('blob', 'text')
            AND length(CAST(",
            $r,
            "fingerprint AS BLOB)) = 16))"
        )
    };
}

/// The `ON CONFLICT` part of both claim statements: takes the record when it is free
/// (expired, or readable and released, or readable, in progress with a run-out lease and no
/// other payload). The fence is one more than the record's, or, once the record expired, the
/// clock's fence (`excluded.fence`) if that is higher, so fences never repeat for a key.
macro_rules! take_if_free {
    () => {
        concat!(
            "ON CONFLICT (record_key) DO UPDATE SET
    token = excluded.token,
    fence = CASE WHEN r.expires_at <= ",
            now!(),
            " THEN MAX(r.fence + 1, excluded.fence) ELSE r.fence + 1 END,
    state = 'in_progress',
    lease_until = excluded.lease_until,
    result = NULL,
    fingerprint = excluded.fingerprint,
    created_at = CASE WHEN r.expires_at <= ",
            now!(),
            " THEN excluded.created_at ELSE r.created_at END,
    updated_at = excluded.updated_at,
    expires_at = excluded.expires_at
WHERE r.expires_at <= ",
            now!(),
            "
   OR (",
            readable!("r."),
            "
       AND (r.state = 'released'
            OR (r.state = 'in_progress' AND r.lease_until <= ",
            now!(),
            "
                AND NOT (r.fingerprint IS NOT NULL AND excluded.fingerprint IS NOT NULL
                         AND r.fingerprint <> excluded.fingerprint))))"
        )
    };
}

/// Takes the key when its record is free (absent, expired, released, or in progress with a
/// run-out lease and no other payload) and returns it; returns nothing otherwise.
///
/// SQLite runs one writing statement at a time on a database, so the test and the write
/// are atomic.
const CLAIM: &str = concat!(
    "INSERT INTO idempotent_records AS r
    (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
     created_at, updated_at, expires_at)
VALUES (?1, ?2, ?3, ",
    clock_fence!(),
    ", 'in_progress', ",
    now!(),
    " + ?4, NULL, ?5, ",
    now!(),
    ", ",
    now!(),
    ", ",
    now!(),
    " + ?6)
",
    take_if_free!(),
    "
RETURNING state, token, fence, fingerprint, result, 0"
);

/// The claim of a batch of distinct keys: [`CLAIM`] over a `VALUES` list whose `{rows}`
/// marker the store replaces with one `(?, ?, ?, ?, ?, ?)` per key (key, prefix, token,
/// lease, fingerprint, ttl). Returns the taken records, `record_key` first. (`WHERE true`
/// keeps SQLite's parser from reading `ON CONFLICT` as a join constraint.)
const CLAIM_MANY: &str = concat!(
    "INSERT INTO idempotent_records AS r
    (record_key, prefix, token, fence, state, lease_until, result, fingerprint,
     created_at, updated_at, expires_at)
SELECT column1, column2, column3, ",
    clock_fence!(),
    ", 'in_progress', ",
    now!(),
    " + column4, NULL, column5, ",
    now!(),
    ", ",
    now!(),
    ", ",
    now!(),
    " + column6
FROM (VALUES {rows}) WHERE true
",
    take_if_free!(),
    "
RETURNING record_key, state, token, fence, fingerprint, result, 0"
);

/// Reads the live records of the keys a batch claim did not take; the store replaces the
/// `{keys}` marker with one `?` per key.
const SEEN_MANY: &str = concat!(
    "SELECT record_key, state, token, fence, fingerprint, result, MAX(0, lease_until - ",
    now!(),
    ")
FROM idempotent_records
WHERE record_key IN ({keys}) AND expires_at > ",
    now!()
);

/// The record columns, then how long the record has been in its state and how long it has
/// left, in milliseconds.
macro_rules! listed_columns {
    () => {
        concat!(
            "state, token, fence, fingerprint, result, MAX(0, lease_until - ",
            now!(),
            "), MAX(0, ",
            now!(),
            " - updated_at), MAX(0, expires_at - ",
            now!(),
            ")"
        )
    };
}

const READ: &str = concat!(
    "SELECT ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key = ? AND expires_at > ",
    now!()
);

/// A page of live records with the prefix given third, by key after the first parameter and
/// below the second (a range of the primary key), at most the fourth.
const SCAN: &str = concat!(
    "SELECT record_key, ",
    listed_columns!(),
    "
FROM idempotent_records
WHERE record_key > ? AND record_key < ? AND prefix = ? AND expires_at > ",
    now!(),
    "
ORDER BY record_key
LIMIT ?"
);

/// Completes and releases a batch, each item as [`COMPLETE`] or [`RELEASE`] would, and
/// returns the keys it ended; the store replaces the `{rows}` marker with one row of
/// `(key, token, result, ttl, complete?)` placeholders per item.
const COMPLETE_MANY: &str = concat!(
    "UPDATE idempotent_records AS r SET
    result = CASE WHEN i.complete = 1 AND r.state = 'in_progress' THEN i.result ELSE r.result END,
    expires_at = CASE WHEN i.complete = 1 AND r.state = 'in_progress' THEN ",
    now!(),
    " + i.ttl ELSE r.expires_at END,
    updated_at = CASE WHEN r.state = 'in_progress' THEN ",
    now!(),
    " ELSE r.updated_at END,
    state = CASE WHEN i.complete = 1 THEN 'completed' ELSE 'released' END
FROM (SELECT column1 AS record_key, column2 AS token, column3 AS result, column4 AS ttl,
             column5 AS complete
      FROM (VALUES {rows})) AS i
WHERE r.record_key = i.record_key AND r.token = i.token
  AND (r.state = 'in_progress' OR (i.complete = 1 AND r.state = 'completed'))
  AND ",
    readable!("r."),
    " AND r.expires_at > ",
    now!(),
    "
RETURNING record_key"
);

const DELETE: &str = concat!(
    "DELETE FROM idempotent_records WHERE record_key = ? AND token = ? AND expires_at > ",
    now!(),
    " AND NOT (state = 'in_progress' AND lease_until > ",
    now!(),
    ") AND state IN ('in_progress', 'completed', 'released') AND ",
    readable!("")
);

const DELETE_CORRUPT: &str = concat!(
    "DELETE FROM idempotent_records WHERE record_key = ?
  AND NOT (state IN ('in_progress', 'completed', 'released') AND ",
    readable!(""),
    ")"
);

const COMPLETE: &str = concat!(
    "UPDATE idempotent_records SET
    result = CASE WHEN state = 'in_progress' THEN ? ELSE result END,
    expires_at = CASE WHEN state = 'in_progress' THEN ",
    now!(),
    " + ? ELSE expires_at END,
    updated_at = CASE WHEN state = 'in_progress' THEN ",
    now!(),
    " ELSE updated_at END,
    state = 'completed'
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed')
  AND ",
    readable!(""),
    " AND expires_at > ",
    now!()
);

const REOPEN: &str = concat!(
    "UPDATE idempotent_records SET state = 'released', result = NULL, updated_at = ",
    now!(),
    "
WHERE record_key = ? AND token = ? AND state IN ('in_progress', 'completed', 'released')
  AND ",
    readable!(""),
    " AND expires_at > ",
    now!()
);

const RELEASE: &str = concat!(
    "UPDATE idempotent_records SET state = 'released', updated_at = ",
    now!(),
    "
WHERE record_key = ? AND token = ? AND state = 'in_progress'
  AND ",
    readable!(""),
    " AND expires_at > ",
    now!()
);

const RENEW: &str = concat!(
    "UPDATE idempotent_records SET
    lease_until = ",
    now!(),
    " + ?,
    expires_at = MAX(expires_at, ",
    now!(),
    " + ?)
WHERE record_key = ? AND token = ? AND state = 'in_progress'
  AND ",
    readable!(""),
    " AND expires_at > ",
    now!()
);

const PURGE: &str = concat!(
    "DELETE FROM idempotent_records
WHERE record_key IN (SELECT record_key FROM idempotent_records
                     WHERE expires_at <= ",
    now!(),
    "
                     ORDER BY expires_at LIMIT ?)
  AND expires_at <= ",
    now!()
);

/// SQLite's default length limit on a string or blob (`SQLITE_MAX_LENGTH`).
const DEFAULT_MAX_LENGTH: usize = 1_000_000_000;

/// How long a statement waits for another connection's lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

impl DialectImpl for Sqlite {
    const SQL: Templates = Templates {
        claim: CLAIM,
        seen: READ,
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
        seen_many: SEEN_MANY,
        claim_fresh: "",
        claim_fresh_async: "",
        claim_many_fresh: "",
        claim_many_fresh_async: "",
        claim_reporting: "",
        claim_many_reporting: "",
    };
    const MIGRATIONS: &'static [(i64, &'static str, &'static str)] = &[(
        1,
        "create idempotent_records",
        include_str!("../../../migrations/sqlite/0001_create_idempotent_records.sql"),
    )];

    /// A file database gets write-ahead logging (readers never wait for the writer; switched
    /// on once, waiting out other processes' switches) and a busy timeout. An in-memory database (`sqlite::memory:`, `mode=memory`) is shared by
    /// the pool's connections (sqlx opens it in shared-cache mode under a unique name) and
    /// lives as long as one of them: the pool keeps one connection open for good.
    fn open(
        options: PoolOptions<Self>,
        url: &str,
    ) -> BoxFuture<'_, Result<Pool<Self>, sqlx::Error>> {
        Box::pin(async move {
            let connect = SqliteConnectOptions::from_str(url)?.busy_timeout(BUSY_TIMEOUT);
            let in_memory = url.contains(":memory:") || url.contains("mode=memory");
            if in_memory {
                let options = options
                    .min_connections(1)
                    .idle_timeout(None)
                    .max_lifetime(None);
                options.connect_with(connect).await
            } else {
                // Write-ahead logging is switched on once, for the file, by one connection
                // that waits out other processes' switches: a switch on every connection
                // fails when processes open the file together.
                let pool = options
                    .connect_with(connect.create_if_missing(true))
                    .await?;
                crate::store::sql::migrate::sqlite_wal(&pool).await?;
                Ok(pool)
            }
        })
    }

    fn claim<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'c Statements,
        req: &'c ClaimRequest,
        _fresh: bool,
    ) -> BoxFuture<'c, Result<Step, sqlx::Error>> {
        Box::pin(async move {
            let taken = sqlx::query(AssertSqlSafe(sql.claim.clone()))
                .bind(req.key.as_bytes())
                .bind(req.key.prefix())
                .bind(&req.token.as_bytes()[..])
                .bind(ticks(req.lease, Self::TICK))
                .bind(req.fingerprint.as_ref().map(|f| &f.as_bytes()[..]))
                .bind(ticks(req.record_lifetime(), Self::TICK))
                .fetch_optional(&mut *conn)
                .await?;
            if let Some(row) = taken {
                return Ok(Step::Seen(Some(RecordRow::decode(&row)?)));
            }
            let key = [Arg::Bytes(req.key.as_bytes())];
            Ok(Step::Seen(Self::fetch(conn, &sql.seen, &key).await?))
        })
    }

    const BATCH: usize = 500;

    /// Two statements on the connection: the batch claim, then one read of the keys it did
    /// not take (SQLite has one writer at a time, and no round trips). As for a single claim,
    /// a record that changed between the two is read as it is then.
    fn claim_batch<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'c Statements,
        reqs: &'c [&'c ClaimRequest],
    ) -> BoxFuture<'c, Result<Vec<Step>, sqlx::Error>> {
        Box::pin(async move {
            let row = "(?, ?, ?, ?, ?, ?)";
            let claim = with_rows(&sql.claim_many, "{rows}", reqs.len(), (row, ", ", row));
            let query = bind_claims::<Sqlite>(AssertSqlSafe(claim), reqs, Self::TICK)?;
            let mut seen = claim_keys(reqs);
            for row in &query.fetch_all(&mut *conn).await? {
                let (key, step) = RecordRow::decode_keyed(row)?;
                seen.insert(&key, step);
            }
            let rest: Vec<&[u8]> = seen.missing().collect();
            if !rest.is_empty() {
                let read = with_rows(&sql.seen_many, "{keys}", rest.len(), ("?", ", ", "?"));
                let query = bind_keys::<Sqlite>(AssertSqlSafe(read), rest.iter().copied())?;
                for row in &query.fetch_all(&mut *conn).await? {
                    let (key, step) = RecordRow::decode_keyed(row)?;
                    seen.insert(&key, step);
                }
            }
            Ok(in_request_order(seen))
        })
    }

    const COMPLETE_BATCH: usize = 500;

    fn complete_batch<'c>(
        conn: &'c mut SqliteConnection,
        sql: &'c Statements,
        items: &'c [&'c Ending],
    ) -> BoxFuture<'c, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            let row = "(?, ?, ?, ?, ?)";
            let end = with_rows(&sql.complete_many, "{rows}", items.len(), (row, ", ", row));
            let query = bind_endings::<Sqlite>(AssertSqlSafe(end), items, Self::TICK)?;
            let mut ended = Vec::with_capacity(items.len());
            for row in query.fetch_all(&mut *conn).await? {
                ended.push(row.try_get::<Vec<u8>, _>(0)?);
            }
            Ok(ended_in_order(items, &ended))
        })
    }

    /// SQLite's length limit on a string or blob, which also bounds a row (`MAX_LENGTH` in
    /// `PRAGMA compile_options` when the library was built with another one than the
    /// default, 10^9 bytes), less [`HEADROOM`].
    fn result_capacity(pool: &Pool<Self>) -> BoxFuture<'_, Result<usize, sqlx::Error>> {
        Box::pin(async move {
            let options: Vec<String> = sqlx::query_scalar("PRAGMA compile_options")
                .fetch_all(pool)
                .await?;
            let limit = options
                .iter()
                .find_map(|option| option.strip_prefix("MAX_LENGTH="))
                .and_then(|limit| limit.parse::<usize>().ok())
                .unwrap_or(DEFAULT_MAX_LENGTH);
            Ok(limit.saturating_sub(HEADROOM))
        })
    }

    statement_fns!(SqliteConnection);
}
