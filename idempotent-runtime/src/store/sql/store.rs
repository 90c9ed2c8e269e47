//! [`SqlStore`]: the pool, the rendered statements, and the [`Store`] primitives.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Database, Pool};

use crate::database::TableName;
use crate::database::{store_error, Phase};
use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::sql::dialect::{ticks, Arg, Dialect, Statements};
use crate::store::sql::exec::{
    claim_many_on, claim_on, complete_many_on, complete_on, owned, refuse_oversized, release_on,
    reopen_on, spread, write,
};
use crate::store::sql::record::Stored;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Expect, OperatorStore, Record, ScanCursor,
    ScanPage, Store, Token,
};

/// An idempotency [`Store`] on a SQL database, through an sqlx connection pool. Use it as
/// [`PostgresStore`](super::PostgresStore), [`MySqlStore`](super::MySqlStore) or
/// [`SqliteStore`](super::SqliteStore).
///
/// Cloning is cheap: clones share the pool.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::sql::MySqlStore;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
/// let store = MySqlStore::builder("mysql://app@db/payments")
///     .table("payments_idempotency")
///     .max_connections(16)
///     .build()
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
pub struct SqlStore<DB: Dialect> {
    pub(super) pool: Pool<DB>,
    pub(super) table: Arc<TableName>,
    /// The statements of autocommit calls (with asynchronous claims when they are on).
    pub(super) sql: Arc<Statements>,
    /// The statements of calls in the caller's transaction: claims commit with it.
    pub(super) tx_sql: Arc<Statements>,
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) max_result_size: usize,
}

impl<DB: Dialect> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        SqlStore {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
            tx_sql: self.tx_sql.clone(),
            runtime: self.runtime.clone(),
            max_result_size: self.max_result_size,
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlStore<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlStore")
            .field("database", &<DB as Database>::NAME)
            .field("table", &self.table.as_str())
            .field("max_result_size", &self.max_result_size)
            .finish_non_exhaustive()
    }
}

impl<DB: Dialect> SqlStore<DB> {
    /// The pool, for the business queries that run next to the store's (and for
    /// [`run_in_tx`](Self::run_in_tx)'s transactions).
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The table of records, as written into SQL.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The SQL this store sends, for review, logs and benchmarks.
    pub fn statements(&self) -> &Statements {
        &self.sql
    }

    pub(super) async fn acquire(&self) -> Result<PoolConnection<DB>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| store_error::<DB>(e, Phase::Connect, "connection"))
    }
}

impl<DB: Dialect> Store for SqlStore<DB> {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            claim_on::<DB>(&mut conn, &self.sql, req, true, true).await
        })
    }

    /// On PostgreSQL and SQLite, one claim statement per (at most) 500 distinct keys; see
    /// the module docs. On MySQL / MariaDB too, one multi-row claim and one read.
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            if DB::BATCH == 0 || reqs.len() < 2 {
                let mut claims = Vec::with_capacity(reqs.len());
                for req in reqs {
                    claims.push(self.claim(req).await);
                }
                return claims;
            }
            match self.acquire().await {
                Ok(mut conn) => claim_many_on::<DB>(&mut conn, &self.sql, reqs).await,
                Err(err) => spread(err, reqs.len()),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            refuse_oversized(completion, self.max_result_size)?;
            let mut conn = self.acquire().await?;
            complete_on::<DB>(&mut conn, &self.sql, key, token, completion, true).await
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            release_on::<DB>(&mut conn, &self.sql, key, token, true).await
        })
    }

    /// On every database, one statement per (at most) 500 distinct keys; see the module
    /// docs.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            match self.acquire().await {
                Ok(mut conn) => {
                    complete_many_on::<DB>(&mut conn, &self.sql, items, self.max_result_size).await
                }
                Err(err) => {
                    let mut answers: Vec<_> = (1..items.len())
                        .map(|_| Err(StoreError::new(err.kind(), err.to_string())))
                        .collect();
                    if !items.is_empty() {
                        answers.insert(0, Err(err));
                    }
                    answers
                }
            }
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            let lease = ticks(lease, DB::TICK);
            let args = [
                Arg::Int(lease),
                Arg::Int(lease),
                Arg::Bytes(key.as_bytes()),
                Arg::Bytes(token.as_bytes()),
            ];
            let renewed = write::<DB>(&mut conn, &self.sql.renew, &args, "renew", true).await?;
            owned::<DB>(&mut conn, &self.sql, key, renewed).await
        })
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            let args = [Arg::Bytes(key.as_bytes())];
            let row = DB::fetch(&mut conn, &self.sql.read, &args)
                .await
                .map_err(|e| store_error::<DB>(e, Phase::Read, "read"))?;
            match row {
                None => Ok(None),
                Some(row) => Ok(Some(Stored::from_row(row, DB::TICK)?.into_record())),
            }
        })
    }

    fn max_result_size(&self) -> usize {
        self.max_result_size
    }

    fn name(&self) -> &'static str {
        match <DB as sqlx::Database>::NAME {
            "PostgreSQL" => "postgresql",
            "MySQL" => "mysql",
            "SQLite" => "sqlite",
            _ => "sql",
        }
    }
}

impl<DB: Dialect> OperatorStore for SqlStore<DB> {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            reopen_on::<DB>(&mut conn, &self.sql, key, token).await
        })
    }

    /// Pages in key order over the primary key's range of the prefix; the cursor is the last
    /// key returned, in hex.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(async move {
            // Every key of the prefix starts with `<prefix>:v`, and sorts below `<prefix>:w`.
            let after = if cursor.is_start() {
                format!("{prefix}:v").into_bytes()
            } else {
                crate::key::parse_hex(cursor.as_str()).ok_or_else(|| {
                    StoreError::new(
                        StoreErrorKind::Rejected,
                        format!("`{cursor}` is not a cursor of an SQL store"),
                    )
                })?
            };
            let below = format!("{prefix}:w").into_bytes();
            let limit = limit.clamp(1, 10_000);
            let args = [
                Arg::Bytes(&after),
                Arg::Bytes(&below),
                Arg::Text(prefix),
                Arg::Int(i64::try_from(limit).unwrap_or(i64::MAX)),
            ];
            let mut conn = self.acquire().await?;
            let rows = DB::fetch_keyed(&mut conn, &self.sql.scan, &args)
                .await
                .map_err(|e| store_error::<DB>(e, Phase::Read, "scan"))?;
            let next = match rows.last() {
                Some((last, _)) if rows.len() == limit => {
                    Some(ScanCursor::new(crate::key::hex_string(last)))
                }
                _ => None,
            };
            let mut records = Vec::with_capacity(rows.len());
            for (bytes, row) in rows {
                // A row under a key this crate did not write is not an operation's record.
                let Ok(key) = Key::parse_bytes(&bytes) else {
                    continue;
                };
                let record = row
                    .map_err(|e| store_error::<DB>(e, Phase::Read, "scan"))
                    .and_then(|row| Stored::from_row(row, DB::TICK))
                    .map(Stored::into_record);
                records.push((key, record));
            }
            Ok(ScanPage::new(records, next))
        })
    }

    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            match expect {
                // A record that is not readable is left alone, and reported as corrupt.
                Expect::Token(token) => {
                    let args = [Arg::Bytes(key.as_bytes()), Arg::Bytes(token.as_bytes())];
                    let rows =
                        write::<DB>(&mut conn, &self.sql.delete, &args, "delete", true).await?;
                    owned::<DB>(&mut conn, &self.sql, key, rows).await
                }
                Expect::Corrupt => {
                    let args = [Arg::Bytes(key.as_bytes())];
                    let rows =
                        write::<DB>(&mut conn, &self.sql.delete_corrupt, &args, "delete", true)
                            .await?;
                    Ok(rows > 0)
                }
            }
        })
    }
}
