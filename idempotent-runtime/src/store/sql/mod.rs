//! SQL stores through [sqlx]: [`PostgresStore`], [`MySqlStore`] (MySQL and MariaDB) and
//! [`SqliteStore`], one generic [`SqlStore`] with a small sealed part per database.
//!
//! ```no_run
//! use std::{sync::Arc, time::Duration};
//! use idempotent_runtime::{Error, Guard, Key};
//! use idempotent_runtime::sql::PostgresStore;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Builds a pool and creates the table if it is missing.
//! let store = Arc::new(PostgresStore::connect("postgres://app@db/orders").await?);
//! let _purger = store.spawn_purger(Duration::from_secs(60), 1_000);
//!
//! let guard = Guard::new(Duration::from_secs(3600)).store(store.clone());
//! let key = Key::new("order:consume", 1, &[&"A-1001"])?;
//! let out: Result<(), Error> = guard.run(key, async { Ok(()) }).await;
//! # out?; Ok(()) }
//! ```
//!
//! # Schema
//!
//! One table (default `idempotent_records`, configurable with [`Builder::table`]), one row
//! per key: the key as exact bytes (`BYTEA`, `VARBINARY` or `BLOB`: no collation, no case
//! folding) as the primary key, its readable prefix, the owner's token, the fence, the state
//! (`in_progress`, `completed`, `released`), the lease end, the stored result, the payload
//! fingerprint, and created / updated / expires timestamps, with an index on the expiry.
//! Every time comes from the database's clock (`statement_timestamp()` on PostgreSQL,
//! `UTC_TIMESTAMP(6)` on MySQL, `julianday('now')` in milliseconds on SQLite), never from
//! the client's. A row whose expiry has passed no longer exists for the store; it is deleted
//! by [`SqlStore::purge_expired`] or the task [`SqlStore::spawn_purger`] starts.
//!
//! # Migrations
//!
//! [`SqlStore::connect`] creates the table when it is missing: it runs
//! [`SqlStore::migrate`], which applies the embedded migrations with sqlx's migrator and
//! records them in a table next to the store's, `<table>_migrations` (never in your own
//! `_sqlx_migrations`). To manage the schema with your own migration tool instead, copy the
//! plain SQL files shipped in this crate's `migrations/postgres/`, `migrations/mysql/` and
//! `migrations/sqlite/` directories (written for the default table name) into your
//! migrations, and build the store with [`Builder::migrate`]`(false)`.
//!
//! # Claims
//!
//! Each claim is one statement that takes the key only when its record is free (absent,
//! expired, released, or in progress with a run-out lease and no other payload); nothing
//! ever reads a record and then decides to write it.
//!
//! - **PostgreSQL**: `INSERT ... ON CONFLICT (record_key) DO UPDATE SET ... WHERE <free>
//!   RETURNING ...`, inside a `WITH` whose outer query also returns the record when the
//!   claim did not take it: one round trip whatever the outcome. `ON CONFLICT DO UPDATE`
//!   locks the conflicting row and tests `WHERE` on its latest version, so of any number of
//!   concurrent claims exactly one takes a free record.
//! - **MySQL / MariaDB**: MySQL has no `RETURNING`, so the claim is
//!   `INSERT ... ON DUPLICATE KEY UPDATE` with conditional assignments: InnoDB locks the
//!   duplicate row before the update part runs, the first assignment (`fence`) makes the
//!   "free" test on the record as it was and leaves the new fence, or 0, in
//!   `LAST_INSERT_ID()`, and the later assignments test that value (assignments run left to
//!   right). The statement reports an acquisition in its own reply through
//!   `LAST_INSERT_ID(fence)`: one round trip for every acquisition. A claim that did not take
//!   the key reads the record with a locking read
//!   (a second round trip, for duplicates only).
//! - **SQLite**: `INSERT ... ON CONFLICT DO UPDATE ... WHERE <free> RETURNING ...`; SQLite runs
//!   one writing statement at a time. A claim that did not take the key reads the record.
//!   `sqlite::memory:` is one database shared by the pool's connections, kept alive by a
//!   connection the pool never closes.
//!
//! The fence of an acquisition is [`next_fence`](crate::store::next_fence): one more than
//! the record's when the key has one (live, released, or a run-out lease taken over); the
//! database's clock in microseconds since the Unix epoch when it has none (SQLite's clock
//! counts milliseconds: its fence is those times 1,000); and for a record that expired but is
//! not purged yet, the higher of the two. Fences therefore keep growing across expiry.
//!
//! A record row the store cannot read (an unknown state, a token or fingerprint that is not
//! 16 bytes, a negative fence, a column of another type) is never taken, changed or treated
//! as free: every call on its key, claim, complete, release, renew and read, fails with
//! [`StoreErrorKind::Corrupt`] until it expires or an operator repairs or deletes it. In a
//! batch, only that key's item fails.
//!
//! # Batches
//!
//! [`Store::claim_many`] answers each item as [`Store::claim`] would, in the order given.
//! A key that appears more than once is claimed once, by its first occurrence, in the batch;
//! its later occurrences are then claimed one by one, and meet the first one's claim as
//! separate claims would. The distinct keys are sent in key order, at most 500 per statement.
//!
//! - **PostgreSQL**: one statement per 500 keys, whatever the outcomes: the claim statement
//!   over `unnest` of six bound arrays (`INSERT ... SELECT ... FROM input ON CONFLICT
//!   (record_key) DO UPDATE SET ... WHERE <free> RETURNING record_key, ...`), with a
//!   `UNION ALL` branch that reports the records of the keys it did not take. Sorting the keys
//!   makes concurrent overlapping batches lock their rows in the same order.
//! - **SQLite**: per 500 keys, the claim statement over a `VALUES` list of bound rows, then
//!   one read of the keys it did not take (two statements on one connection, in autocommit
//!   like the single claim: SQLite has one writer at a time and no round trips).
//! - **MySQL / MariaDB**: one claim per key, on one connection at a time.
//!
//! As for a single claim, an item whose reported record is free is claimed again on its own.
//! A batch statement that fails fails all of its items, with the error's kind.
//!
//! When the record a claim reports is free although the claim did not take it (it changed
//! between the write and the report: a concurrent first insert, a release), the claim
//! applied nothing for its token and is sent again. Every other answer is what an atomic
//! claim at the moment of the report returns. A claim sent again with the same token (a retry
//! after a lost reply) finds its own record and answers [`Claim::Acquired`] with its fence.
//!
//! Completion, release and renewal are single `UPDATE`s that check the token (and, for
//! release and renewal, that the record is in progress), so no one else's record is ever
//! changed. A released record keeps its fence.
//!
//! # In the business transaction
//!
//! [`SqlStore::run_in_tx`] (and the primitives [`SqlStore::claim_in`],
//! [`SqlStore::complete_in`], [`SqlStore::release_in`]) claim and complete inside the
//! caller's own sqlx transaction, so the record commits or rolls back with the business
//! change: a rolled-back transaction leaves the key claimable, a committed one makes every
//! later call a duplicate. While the transaction is open its claim holds the record's row
//! lock, so a concurrent duplicate waits for the commit (and then meets the completed record)
//! or the rollback (and then claims the key itself). Use the default `READ COMMITTED`
//! isolation on PostgreSQL: under `REPEATABLE READ` or `SERIALIZABLE` a concurrent duplicate
//! fails with a serialization error instead of waiting.
//!
//! # Durations and results
//!
//! Leases and ttls are sent in whole milliseconds, rounded up and clamped to
//! [`MIN_DURATION`] ..= [`MAX_DURATION`] ([`clamped_millis`](crate::store::clamped_millis)),
//! as on every store: `Duration::MAX` means 36,500 days.
//!
//! A stored result is at most [`Store::max_result_size`] bytes ([`Builder::max_result_size`],
//! 1 MiB by default, never more than the database takes); [`Store::complete`] refuses a
//! larger one with [`StoreErrorKind::Rejected`] without sending it.
//!
//! # Errors
//!
//! A connection that cannot be had (server down, pool exhausted past its acquire timeout) is
//! [`StoreErrorKind::Unavailable`], as is a statement the server aborted (shutdown, deadlock,
//! serialization failure; autocommit statements are retried a few times first). An I/O error
//! after a writing statement was sent is [`StoreErrorKind::OutcomeUnknown`]: the engine reads
//! the record back by token. A statement the database refuses for good is
//! [`StoreErrorKind::Rejected`]: a value too large (MySQL's "packet bigger than
//! `max_allowed_packet`", 1153, although its SQLSTATE is the connection class 08), data too
//! long or out of range (SQLSTATE class 22), a constraint (class 23), a program limit (class
//! 54), SQLite's `TOOBIG`, `CONSTRAINT` and `MISMATCH`. A record that cannot be read is
//! [`StoreErrorKind::Corrupt`]. A read-only database is [`StoreErrorKind::Unsafe`]; any other
//! database error (a missing table, say) is [`StoreErrorKind::Protocol`]. The sqlx error is
//! always the [`source`](std::error::Error::source).

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::{PoolConnection, PoolOptions};
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr, Transaction};

use crate::codec;
use crate::error::{Error, StoreError, StoreErrorKind};
use crate::key::Key;
use crate::policy::default_lease;
use crate::store::{
    BoxFuture, Claim, ClaimRequest, Completion, ConnectError, Record, SharedStore, Store, Token,
    DEFAULT_MAX_RESULT_SIZE, MAX_DURATION, MIN_DURATION,
};

mod driver;
mod error;
mod record;
mod table;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use driver::Statements;
pub use table::DEFAULT_TABLE;

/// The sqlx this crate is built with, so the pools and transactions you pass in have the
/// same type.
pub use sqlx;

use driver::{ticks, Arg, Driver};
use error::{is_conflict, migrate_error, store_error, Phase};
use record::{settle, Stored};
use table::TableName;

/// A database a [`SqlStore`] runs on: sqlx's [`Postgres`](sqlx::Postgres),
/// [`MySql`](sqlx::MySql) or [`Sqlite`](sqlx::Sqlite), as the database features enable them.
/// Sealed.
pub trait Dialect: Driver {}

impl<DB: Driver> Dialect for DB {}

/// The idempotency store on PostgreSQL.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub type PostgresStore = SqlStore<sqlx::Postgres>;

/// The idempotency store on MySQL or MariaDB.
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub type MySqlStore = SqlStore<sqlx::MySql>;

/// The idempotency store on SQLite, in a file or in memory.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

/// How many times an autocommit statement the database rolled back by a conflict (deadlock,
/// serialization failure, busy database) is sent again before the error is returned.
const CONFLICT_RETRIES: u32 = 3;

/// How many times a claim is sent when the record keeps changing under it. Each new attempt
/// needs another writer to have changed the record in between.
const SETTLE_ATTEMPTS: u32 = 16;

/// An idempotency [`Store`] on a SQL database, through an sqlx connection pool. Use it as
/// [`PostgresStore`], [`MySqlStore`] or [`SqliteStore`].
///
/// Cloning is cheap: clones share the pool.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::sql::MySqlStore;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
/// let store = MySqlStore::builder()
///     .table("payments_idempotency")
///     .max_connections(16)
///     .connect("mysql://app@db/payments")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
pub struct SqlStore<DB: Dialect> {
    pool: Pool<DB>,
    table: Arc<TableName>,
    sql: Arc<Statements>,
    runtime: tokio::runtime::Handle,
    max_result_size: usize,
}

impl<DB: Dialect> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        SqlStore {
            pool: self.pool.clone(),
            table: self.table.clone(),
            sql: self.sql.clone(),
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

/// Settings for a [`SqlStore`], from [`SqlStore::builder`].
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::sql::PostgresStore;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
/// let store = PostgresStore::builder()
///     .table("billing.idempotency")
///     .max_connections(8)
///     .acquire_timeout(Duration::from_secs(2))
///     .migrate(false) // the schema is managed by our own migrations
///     .connect("postgres://app@db/billing")
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
#[must_use = "a builder does nothing until `.connect(url)` or `.build(pool)`"]
pub struct Builder<DB: Dialect> {
    table: Cow<'static, str>,
    max_connections: u32,
    acquire_timeout: Duration,
    migrate: bool,
    max_result_size: usize,
    database: PhantomData<fn() -> DB>,
}

impl<DB: Dialect> fmt::Debug for Builder<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("database", &<DB as Database>::NAME)
            .field("table", &self.table)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("migrate", &self.migrate)
            .field("max_result_size", &self.max_result_size)
            .finish()
    }
}

impl<DB: Dialect> Default for Builder<DB> {
    fn default() -> Self {
        Builder {
            table: Cow::Borrowed(DEFAULT_TABLE),
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            migrate: true,
            max_result_size: DEFAULT_MAX_RESULT_SIZE,
            database: PhantomData,
        }
    }
}

impl<DB: Dialect> Builder<DB> {
    /// The table of records (default [`DEFAULT_TABLE`]). It must match
    /// `[A-Za-z_][A-Za-z0-9_]{0,62}`; on PostgreSQL it may be `schema.table` (the schema is
    /// created by the migration if missing). The name is written into SQL unquoted, so it
    /// follows the database's rules for unquoted names (PostgreSQL folds it to lower case)
    /// and may not be a reserved word. An invalid name fails `connect` / `build` with
    /// [`StoreErrorKind::Unsafe`].
    pub fn table(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.table = name.into();
        self
    }

    /// The most connections the pool opens (default 10). Ignored by [`build`](Self::build).
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = max.max(1);
        self
    }

    /// How long a store call waits for a connection before failing with
    /// [`StoreErrorKind::Unavailable`] (default 5 s): the
    /// time a handler waits when the database is down. Ignored by [`build`](Self::build).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether `connect` / `build` run [`SqlStore::migrate`] (default `true`).
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// The largest stored result, in bytes, the store takes (default
    /// [`DEFAULT_MAX_RESULT_SIZE`], 1 MiB): [`Store::max_result_size`]. The engine completes
    /// a record whose result is larger without it (duplicates get [`Error::Duplicate`],
    /// never a re-run), and [`Store::complete`] refuses it with
    /// [`StoreErrorKind::Rejected`].
    ///
    /// A value above what the database takes is lowered to it when the store is built:
    /// about 1 GiB on PostgreSQL (`bytea`), the `MEDIUMBLOB` column (16 MiB) and the server's
    /// `max_allowed_packet` (read once, when the store is built) on MySQL / MariaDB, SQLite's
    /// length limit (10^9 bytes by default), each less 64 KiB for the rest of the statement.
    ///
    /// ```no_run
    /// use idempotent_runtime::Store;
    /// use idempotent_runtime::sql::MySqlStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = MySqlStore::builder()
    ///     .max_result_size(usize::MAX) // as much as the server takes
    ///     .connect("mysql://app@db/payments")
    ///     .await?;
    /// println!("results up to {} bytes are replayed", store.max_result_size());
    /// # Ok(()) }
    /// ```
    pub fn max_result_size(mut self, bytes: usize) -> Self {
        self.max_result_size = bytes;
        self
    }

    /// Opens a pool on `url` and builds the store.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unavailable`] when the database
    /// cannot be reached within the acquire timeout; the migration's error; an invalid table
    /// name.
    pub async fn connect(self, url: &str) -> Result<SqlStore<DB>, StoreError> {
        let table = TableName::parse(&self.table, DB::SCHEMA_QUALIFIED, <DB as Database>::NAME)?;
        let options = PoolOptions::<DB>::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout);
        let pool = DB::open(options, url)
            .await
            .map_err(|e| store_error::<DB>(e, Phase::Connect, "connection"))?;
        self.finish(pool, table).await
    }

    /// Builds the store on an existing pool (its own size and timeouts apply). On MySQL /
    /// MariaDB this reads the server's `max_allowed_packet`, so the database must be
    /// reachable.
    ///
    /// # Errors
    ///
    /// The migration's error; [`StoreErrorKind::Unavailable`] when the database cannot be
    /// reached; an invalid table name.
    pub async fn build(self, pool: Pool<DB>) -> Result<SqlStore<DB>, StoreError> {
        let table = TableName::parse(&self.table, DB::SCHEMA_QUALIFIED, <DB as Database>::NAME)?;
        self.finish(pool, table).await
    }

    async fn finish(self, pool: Pool<DB>, table: TableName) -> Result<SqlStore<DB>, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| {
            StoreError::new(
                StoreErrorKind::Unavailable,
                "SQL stores run on a Tokio runtime; none is running",
            )
            .with_source(e)
        })?;
        let capacity = DB::result_capacity(&pool)
            .await
            .map_err(|e| store_error::<DB>(e, Phase::Read, "limits read"))?;
        let store = SqlStore {
            sql: Arc::new(Statements::render(&DB::SQL, &table)),
            table: Arc::new(table),
            pool,
            runtime,
            max_result_size: self.max_result_size.min(capacity),
        };
        if self.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }
}

impl<DB: Dialect> SqlStore<DB> {
    /// Opens a pool on `url` (10 connections, 5 s acquire timeout), creates the table
    /// [`DEFAULT_TABLE`] if it is missing, and returns the store. Use
    /// [`builder`](Self::builder) for other settings.
    ///
    /// URLs are sqlx's: `postgres://user:password@host:5432/db`,
    /// `mysql://user@host:3306/db` (also for MariaDB), `sqlite:path/to/file.db`,
    /// `sqlite::memory:`.
    ///
    /// ```no_run
    /// use idempotent_runtime::sql::SqliteStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = SqliteStore::connect("sqlite:idempotency.db").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unavailable`] when the database
    /// cannot be reached; the migration's error.
    pub async fn connect(url: &str) -> Result<SqlStore<DB>, StoreError> {
        Builder::default().connect(url).await
    }

    /// Settings for a store: table name, pool size, acquire timeout, migration.
    pub fn builder() -> Builder<DB> {
        Builder::default()
    }

    /// Applies the embedded migrations that are not applied yet (creating the table, its
    /// expiry index and, on PostgreSQL, a missing schema), recording them in
    /// `<table>_migrations`. Safe to run from many processes at once: the migrator takes a
    /// database lock (PostgreSQL, MySQL), and every statement is `IF NOT EXISTS`, so a table
    /// created earlier from the shipped `.sql` files is left as it is.
    ///
    /// ```no_run
    /// use idempotent_runtime::sql::PostgresStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = PostgresStore::builder()
    ///     .migrate(false)
    ///     .connect("postgres://app@db/orders")
    ///     .await?;
    /// store.migrate().await?; // later, for instance from a deployment hook
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The database's error, or sqlx's migrator's (a migration applied earlier with other
    /// contents, say).
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let migrations = DB::MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    AssertSqlSafe(self.table.render(sql)).into_sql_str(),
                    false,
                )
            })
            .collect();
        let mut migrator = Migrator::with_migrations(migrations);
        migrator.dangerous_set_table_name(self.table.migrations_table());
        if let Some(schema) = self.table.schema() {
            migrator.create_schema(schema.to_string());
        }
        let mut conn = self.acquire().await?;
        DB::migrate(&mut conn, &migrator)
            .await
            .map_err(migrate_error::<DB>)
    }

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

    /// Deletes expired records in batches of at most `batch` rows (one statement each, so
    /// no statement holds locks on more than `batch` rows), until a batch deletes fewer;
    /// returns how many rows were deleted. Records are expired for the store as soon as their
    /// expiry passes, purged or not: purging only reclaims space.
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::sql::PostgresStore) -> Result<(), idempotent_runtime::StoreError> {
    /// let deleted = store.purge_expired(1_000).await?;
    /// println!("{deleted} expired idempotency records deleted");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The first failed batch's error; the batches before it stay deleted.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let mut conn = self.acquire().await?;
            let args = [Arg::Int(i64::from(batch))];
            let deleted = write::<DB>(&mut conn, &self.sql.purge, &args, "purge", true).await?;
            drop(conn);
            total += deleted;
            if deleted < u64::from(batch) {
                return Ok(total);
            }
            tokio::task::yield_now().await;
        }
    }

    /// Starts a task that runs [`purge_expired`](Self::purge_expired)`(batch)` now and then
    /// every `every`, on the runtime the store was built on. Failures are logged (`warn`)
    /// and retried at the next interval. The task stops when the returned [`Purger`] is
    /// dropped.
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::sql::PostgresStore) {
    /// use std::time::Duration;
    ///
    /// let purger = store.spawn_purger(Duration::from_secs(60), 1_000);
    /// // ... serve ...
    /// drop(purger); // stops purging
    /// # }
    /// ```
    pub fn spawn_purger(&self, every: Duration, batch: u32) -> Purger {
        let store = self.clone();
        let every = every.max(Duration::from_millis(1));
        let task = self.runtime.spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                match store.purge_expired(batch).await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::debug!(
                        deleted,
                        table = store.table(),
                        "purged expired idempotency records"
                    ),
                    Err(err) => tracing::warn!(
                        error = %err,
                        table = store.table(),
                        "purging expired idempotency records failed; retrying at the next interval"
                    ),
                }
            }
        });
        Purger { task }
    }

    /// Claims `req.key` inside `tx`: [`Store::claim`], with the record written in the
    /// caller's transaction. On [`Claim::Acquired`] the transaction holds the record's row
    /// lock until it ends; complete it with [`complete_in`](Self::complete_in) in the same
    /// transaction before committing. A rollback removes the claim.
    ///
    /// # Errors
    ///
    /// As [`Store::claim`]; a failed statement may have aborted the transaction (on
    /// PostgreSQL it has): roll it back.
    pub async fn claim_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        claim_on::<DB>(&mut **tx, &self.sql, req, false).await
    }

    /// Completes `key` for `token` inside `tx`: [`Store::complete`] in the caller's
    /// transaction, so the record is completed exactly when the transaction commits.
    ///
    /// # Errors
    ///
    /// As [`Store::complete`].
    pub async fn complete_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: &Key,
        token: &Token,
        completion: &Completion,
    ) -> Result<bool, StoreError> {
        refuse_oversized(completion, self.max_result_size)?;
        complete_on::<DB>(&mut **tx, &self.sql, key, token, completion, false).await
    }

    /// Releases `key` for `token` inside `tx`: [`Store::release`] in the caller's
    /// transaction.
    ///
    /// # Errors
    ///
    /// As [`Store::release`].
    pub async fn release_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: &Key,
        token: &Token,
    ) -> Result<bool, StoreError> {
        release_on::<DB>(&mut **tx, &self.sql, key, token, false).await
    }

    /// Runs `body` at most once for `key`, in the caller's transaction `tx`: claims the key,
    /// runs `body` on the transaction's connection, and completes the record in the same
    /// transaction. Commit `tx` afterwards to make both the business change and the record
    /// durable; roll it back (or drop it) and neither happened, so the key can be claimed
    /// again. The record is kept `ttl` after completion.
    ///
    /// Outcomes, as for [`Guard::run`](crate::Guard::run): `body`'s value; `body`'s error
    /// (the claim is released in the transaction: roll back, or commit and the key is free);
    /// [`Error::Duplicate`] when an earlier transaction committed the key (there is no replay
    /// of results here), [`Error::Held`] for a key held by the engine,
    /// [`Error::InProgress`] when a call outside a transaction holds a live claim,
    /// [`Error::Store`] when a statement failed (roll back: the transaction may be aborted),
    /// [`Error::InvalidDuration`] for a `ttl` outside [`MIN_DURATION`] ..= [`MAX_DURATION`]
    /// (nothing is sent).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idempotent_runtime::{Error, Key};
    /// use idempotent_runtime::sql::{sqlx, PostgresStore};
    ///
    /// #[derive(Debug)]
    /// enum AppError { Idempotency(Error), Db(sqlx::Error) }
    /// impl From<Error> for AppError { fn from(e: Error) -> Self { AppError::Idempotency(e) } }
    /// impl From<sqlx::Error> for AppError { fn from(e: sqlx::Error) -> Self { AppError::Db(e) } }
    ///
    /// # async fn f(store: PostgresStore) -> Result<(), AppError> {
    /// let key = Key::new("payment:capture", 1, &[&"pay-42"]).map_err(Error::from)?;
    /// let mut tx = store.pool().begin().await?;
    /// let captured = store
    ///     .run_in_tx(&mut tx, key, Duration::from_secs(86_400), async |conn| {
    ///         sqlx::query("UPDATE payments SET state = 'captured' WHERE id = 'pay-42'")
    ///             .execute(&mut *conn)
    ///             .await?;
    ///         Ok::<_, AppError>(())
    ///     })
    ///     .await;
    /// match captured {
    ///     Ok(()) => tx.commit().await?,
    ///     Err(AppError::Idempotency(e)) if e.is_duplicate() => {} // already captured
    ///     Err(e) => return Err(e), // dropping `tx` rolls everything back
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See above.
    pub async fn run_in_tx<T, E>(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: Key,
        ttl: Duration,
        body: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        if !(MIN_DURATION..=MAX_DURATION).contains(&ttl) {
            return Err(Error::InvalidDuration {
                setting: "ttl",
                value: ttl,
            }
            .into());
        }
        let req = ClaimRequest {
            key,
            token: Token::generate(),
            lease: default_lease(ttl),
            ttl,
            fingerprint: None,
        };
        let fence = match self.claim_in(tx, &req).await.map_err(Error::Store)? {
            Claim::Acquired { fence } => fence,
            Claim::Completed { result, .. } => {
                let held = result.as_deref().and_then(<[u8]>::first) == Some(&codec::HELD);
                let key = req.key;
                return Err(if held {
                    Error::Held { key }
                } else {
                    Error::Duplicate { key }
                }
                .into());
            }
            Claim::InProgress { fence } => {
                return Err(Error::InProgress {
                    key: req.key,
                    fence,
                }
                .into())
            }
            Claim::Mismatch { .. } => return Err(Error::PayloadMismatch { key: req.key }.into()),
        };
        match body(&mut **tx).await {
            Ok(value) => {
                let completion = Completion { result: None, ttl };
                let completed = self
                    .complete_in(tx, &req.key, &req.token, &completion)
                    .await
                    .map_err(Error::Store)?;
                if completed {
                    Ok(value)
                } else {
                    Err(Error::LostOwnership {
                        key: req.key,
                        fence,
                    }
                    .into())
                }
            }
            Err(err) => {
                // If the body's failure aborted the transaction this fails too; the rollback
                // removes the claim then.
                if let Err(release) = self.release_in(tx, &req.key, &req.token).await {
                    tracing::debug!(error = %release, "release in a failed transaction skipped");
                }
                Err(err)
            }
        }
    }

    async fn acquire(&self) -> Result<PoolConnection<DB>, StoreError> {
        self.pool
            .acquire()
            .await
            .map_err(|e| store_error::<DB>(e, Phase::Connect, "connection"))
    }
}

/// The task started by [`SqlStore::spawn_purger`]; dropping it stops the task.
#[derive(Debug)]
#[must_use = "the purger stops when this handle is dropped"]
pub struct Purger {
    task: tokio::task::JoinHandle<()>,
}

impl Purger {
    /// Stops purging (the same as dropping the handle).
    pub fn stop(self) {}
}

impl Drop for Purger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<DB: Dialect> Store for SqlStore<DB> {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let mut conn = self.acquire().await?;
            claim_on::<DB>(&mut conn, &self.sql, req, true).await
        })
    }

    /// On PostgreSQL and SQLite, one claim statement per (at most) 500 distinct keys; see
    /// the module docs. On MySQL / MariaDB, one claim per key.
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
}

/// Sends the claim statement until its outcome settles (see the module docs). In autocommit
/// mode a statement rolled back by a conflict is sent again; in a transaction it is not (the
/// transaction may be aborted).
async fn claim_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    req: &ClaimRequest,
    autocommit: bool,
) -> Result<Claim, StoreError> {
    let mut conflicts = 0;
    let mut attempts = 0;
    loop {
        let step = match DB::claim(conn, sql, req).await {
            Ok(step) => step,
            Err(err) if autocommit && conflicts < CONFLICT_RETRIES && is_conflict::<DB>(&err) => {
                conflicts += 1;
                backoff(conflicts).await;
                continue;
            }
            Err(err) => return Err(store_error::<DB>(err, Phase::Write, "claim")),
        };
        if let Some(claim) = settle(step, req, DB::TICK)? {
            return Ok(claim);
        }
        attempts += 1;
        if attempts >= SETTLE_ATTEMPTS {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!(
                    "{} claim did not settle: the record changed under it {attempts} times",
                    <DB as Database>::NAME
                ),
            ));
        }
    }
}

/// Claims `reqs` in batch statements of distinct keys, then answers the later occurrences of
/// a key one claim at a time (they meet the first occurrence's claim, as separate claims
/// would); a reported record that is free is claimed again on its own, as in [`claim_on`].
async fn claim_many_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    reqs: &[ClaimRequest],
) -> Vec<Result<Claim, StoreError>> {
    let mut claims: Vec<Result<Claim, StoreError>> = reqs
        .iter()
        .map(|_| {
            Err(StoreError::new(
                StoreErrorKind::Protocol,
                "batch claim left an item unanswered",
            ))
        })
        .collect();
    let mut firsts = HashSet::with_capacity(reqs.len());
    let (mut distinct, mut later) = (Vec::with_capacity(reqs.len()), Vec::new());
    for (i, req) in reqs.iter().enumerate() {
        if firsts.insert(req.key.as_bytes()) {
            distinct.push((i, req));
        } else {
            later.push((i, req));
        }
    }
    // One order for every batch, so that overlapping batches lock their rows alike.
    distinct.sort_by(|(_, a), (_, b)| a.key.as_bytes().cmp(b.key.as_bytes()));
    for chunk in distinct.chunks(DB::BATCH.max(1)) {
        let indices: Vec<usize> = chunk.iter().map(|&(i, _)| i).collect();
        let batch: Vec<&ClaimRequest> = chunk.iter().map(|&(_, req)| req).collect();
        let steps = match claim_batch_on::<DB>(conn, sql, &batch).await {
            Ok(steps) if steps.len() == chunk.len() => steps,
            Ok(_) => {
                let err = StoreError::new(
                    StoreErrorKind::Protocol,
                    format!(
                        "{} batch claim did not report every key",
                        <DB as Database>::NAME
                    ),
                );
                place(&mut claims, &indices, err);
                continue;
            }
            Err(err) => {
                place(&mut claims, &indices, err);
                continue;
            }
        };
        for (&(i, req), step) in chunk.iter().zip(steps) {
            let claim = match settle(step, req, DB::TICK) {
                Ok(Some(claim)) => Ok(claim),
                Ok(None) => claim_on::<DB>(conn, sql, req, true).await,
                Err(err) => Err(err),
            };
            put(&mut claims, i, claim);
        }
    }
    for (i, req) in later {
        let claim = claim_on::<DB>(conn, sql, req, true).await;
        put(&mut claims, i, claim);
    }
    claims
}

fn put(claims: &mut [Result<Claim, StoreError>], i: usize, claim: Result<Claim, StoreError>) {
    if let Some(slot) = claims.get_mut(i) {
        *slot = claim;
    }
}

/// Sends one batch claim statement; a statement rolled back by a conflict is sent again.
async fn claim_batch_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    reqs: &[&ClaimRequest],
) -> Result<Vec<record::Step>, StoreError> {
    let mut conflicts = 0;
    loop {
        match DB::claim_batch(conn, sql, reqs).await {
            Ok(steps) => return Ok(steps),
            Err(err) if conflicts < CONFLICT_RETRIES && is_conflict::<DB>(&err) => {
                conflicts += 1;
                backoff(conflicts).await;
            }
            Err(err) => return Err(store_error::<DB>(err, Phase::Write, "batch claim")),
        }
    }
}

/// `err` for every item of a batch that failed as a whole: the first gets the error itself,
/// the others its kind and message.
fn spread(err: StoreError, items: usize) -> Vec<Result<Claim, StoreError>> {
    let mut claims: Vec<_> = (1..items).map(|_| Err(copy_error(&err))).collect();
    if items > 0 {
        claims.insert(0, Err(err));
    }
    claims
}

/// Puts `err` in `claims` at the indices of a failed batch statement.
fn place(claims: &mut [Result<Claim, StoreError>], indices: &[usize], err: StoreError) {
    for &i in indices.iter().skip(1) {
        put(claims, i, Err(copy_error(&err)));
    }
    if let Some(&first) = indices.first() {
        put(claims, first, Err(err));
    }
}

fn copy_error(err: &StoreError) -> StoreError {
    StoreError::new(err.kind(), err.to_string())
}

async fn complete_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    token: &Token,
    completion: &Completion,
    autocommit: bool,
) -> Result<bool, StoreError> {
    let args = [
        Arg::MaybeBytes(completion.result.as_deref()),
        Arg::Int(ticks(completion.ttl, DB::TICK)),
        Arg::Bytes(key.as_bytes()),
        Arg::Bytes(token.as_bytes()),
    ];
    let completed = write::<DB>(conn, &sql.complete, &args, "complete", autocommit).await?;
    owned::<DB>(conn, sql, key, completed).await
}

async fn release_on<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    token: &Token,
    autocommit: bool,
) -> Result<bool, StoreError> {
    let args = [Arg::Bytes(key.as_bytes()), Arg::Bytes(token.as_bytes())];
    let released = write::<DB>(conn, &sql.release, &args, "release", autocommit).await?;
    owned::<DB>(conn, sql, key, released).await
}

/// The answer of an owner-checked write that matched `rows` rows: `true` when it matched the
/// record. When it matched none, the key is someone else's or has no live record, or its
/// record cannot be read (those writes leave such a record alone): the record is read to
/// tell the last apart, which is [`StoreErrorKind::Corrupt`], never a lost owner. A failure
/// of that read leaves the write's answer, `false`.
async fn owned<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Statements,
    key: &Key,
    rows: u64,
) -> Result<bool, StoreError> {
    if rows > 0 {
        return Ok(true);
    }
    let args = [Arg::Bytes(key.as_bytes())];
    let row = match DB::fetch(conn, &sql.read, &args).await {
        Ok(row) => row,
        Err(err) => {
            let err = store_error::<DB>(err, Phase::Read, "read");
            return if err.kind() == StoreErrorKind::Corrupt {
                Err(err)
            } else {
                Ok(false)
            };
        }
    };
    if let Some(row) = row {
        Stored::from_row(row, DB::TICK)?;
    }
    Ok(false)
}

/// Refuses a completion whose result is larger than the store takes, before it is sent.
fn refuse_oversized(completion: &Completion, limit: usize) -> Result<(), StoreError> {
    match completion.result.as_ref().map(Vec::len) {
        Some(len) if len > limit => Err(StoreError::new(
            StoreErrorKind::Rejected,
            format!("a result of {len} bytes is larger than the store takes ({limit} bytes)"),
        )),
        _ => Ok(()),
    }
}

/// Executes a writing statement; returns the rows it matched.
async fn write<DB: Dialect>(
    conn: &mut DB::Connection,
    sql: &Arc<str>,
    args: &[Arg<'_>],
    what: &str,
    autocommit: bool,
) -> Result<u64, StoreError> {
    let mut conflicts = 0;
    loop {
        match DB::execute(conn, sql, args).await {
            Ok(rows) => return Ok(rows),
            Err(err) if autocommit && conflicts < CONFLICT_RETRIES && is_conflict::<DB>(&err) => {
                conflicts += 1;
                backoff(conflicts).await;
            }
            Err(err) => return Err(store_error::<DB>(err, Phase::Write, what)),
        }
    }
}

/// A short, growing pause before a statement rolled back by a conflict is sent again.
async fn backoff(attempt: u32) {
    tokio::time::sleep(Duration::from_millis(2u64 << attempt.min(6))).await;
}

/// Builds the store for a URL given to [`crate::connect`]: `scheme` is the backend's
/// (`postgres`, `mysql` or `sqlite`), `feature` the cargo feature that provides it.
pub(crate) async fn connect(
    url: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    match scheme {
        "postgres" => postgres(url, scheme, feature).await,
        "mysql" => mysql(url, scheme, feature).await,
        "sqlite" => sqlite(url, scheme, feature).await,
        _ => Err(ConnectError::FeatureDisabled { scheme, feature }),
    }
}

#[cfg(feature = "postgres")]
async fn postgres(
    url: &str,
    _: &'static str,
    _: &'static str,
) -> Result<SharedStore, ConnectError> {
    Ok(Arc::new(PostgresStore::connect(url).await?))
}

#[cfg(not(feature = "postgres"))]
async fn postgres(
    _: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled { scheme, feature })
}

#[cfg(feature = "mysql")]
async fn mysql(url: &str, _: &'static str, _: &'static str) -> Result<SharedStore, ConnectError> {
    Ok(Arc::new(MySqlStore::connect(url).await?))
}

#[cfg(not(feature = "mysql"))]
async fn mysql(
    _: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled { scheme, feature })
}

#[cfg(feature = "sqlite")]
async fn sqlite(url: &str, _: &'static str, _: &'static str) -> Result<SharedStore, ConnectError> {
    Ok(Arc::new(SqliteStore::connect(url).await?))
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite(
    _: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled { scheme, feature })
}
