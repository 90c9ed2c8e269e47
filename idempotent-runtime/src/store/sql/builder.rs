//! [`SqlStoreBuilder`]: a [`SqlStore`]'s settings, connecting, and the embedded migrations.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};

#[cfg(doc)]
use crate::error::Error;
use crate::error::{StoreError, StoreErrorKind};
use crate::store::redact::redact;
#[cfg(doc)]
use crate::store::Store;
use crate::store::DEFAULT_MAX_RESULT_SIZE;

use crate::database::TableName;
use crate::database::{store_error, Phase};
use crate::store::sql::dialect::{render, Dialect, Statements};
use crate::store::sql::store::SqlStore;
use crate::store::sql::DEFAULT_TABLE;

/// The pool size of a store built from a URL, unless
/// [`max_connections`](SqlStoreBuilder::max_connections) says otherwise.
const DEFAULT_MAX_CONNECTIONS: u32 = 10;

/// How long a store built from a URL waits for a connection, unless
/// [`acquire_timeout`](SqlStoreBuilder::acquire_timeout) says otherwise.
const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// Builds a [`SqlStore`] with non-default settings: from a URL with
/// [`SqlStore::builder`], or on the application's own pool with [`SqlStore::from_pool`].
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::sql::PostgresStore;
///
/// # #[tokio::main]
/// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
/// let store = PostgresStore::builder("postgres://app@db/billing")
///     .table("billing.idempotency")
///     .max_connections(8)
///     .acquire_timeout(Duration::from_secs(2))
///     .migrate(false) // the schema is managed by our own migrations
///     .build()
///     .await?;
/// # let _ = store; Ok(()) }
/// ```
///
/// | option | from a URL | on a pool ([`SqlStore::from_pool`]) |
/// |---|---|---|
/// | [`table`](Self::table) | yes | yes |
/// | [`migrate`](Self::migrate) | yes | yes |
/// | [`max_result_size`](Self::max_result_size) | yes | yes |
/// | [`max_connections`](Self::max_connections) | yes | refused: set it on the pool's `PoolOptions` |
/// | [`acquire_timeout`](Self::acquire_timeout) | yes | refused: set it on the pool's `PoolOptions` |
#[must_use = "a builder does nothing until `.build().await`"]
pub struct SqlStoreBuilder<DB: Dialect> {
    target: Target<DB>,
    table: Cow<'static, str>,
    max_connections: Option<u32>,
    acquire_timeout: Option<Duration>,
    migrate: bool,
    max_result_size: usize,
    asynchronous_claims: bool,
    plain_claims: bool,
}

/// Where a [`SqlStoreBuilder`] gets its connections.
enum Target<DB: Dialect> {
    /// A URL the builder opens its own pool on.
    Url(String),
    /// The application's own pool.
    Pool(Pool<DB>),
}

impl<DB: Dialect> Clone for Target<DB> {
    fn clone(&self) -> Self {
        match self {
            Target::Url(url) => Target::Url(url.clone()),
            Target::Pool(pool) => Target::Pool(pool.clone()),
        }
    }
}

impl<DB: Dialect> Clone for SqlStoreBuilder<DB> {
    fn clone(&self) -> Self {
        SqlStoreBuilder {
            target: self.target.clone(),
            table: self.table.clone(),
            max_connections: self.max_connections,
            acquire_timeout: self.acquire_timeout,
            migrate: self.migrate,
            max_result_size: self.max_result_size,
            asynchronous_claims: self.asynchronous_claims,
            plain_claims: self.plain_claims,
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlStoreBuilder<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("SqlStoreBuilder");
        out.field("database", &<DB as Database>::NAME);
        match &self.target {
            Target::Url(url) => out.field("url", &redact(url)),
            Target::Pool(pool) => out.field("pool", pool),
        };
        out.field("table", &self.table)
            .field("max_connections", &self.max_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("migrate", &self.migrate)
            .field("max_result_size", &self.max_result_size)
            .field("asynchronous_claims", &self.asynchronous_claims)
            .field("plain_claims", &self.plain_claims)
            .finish()
    }
}

impl<DB: Dialect> SqlStoreBuilder<DB> {
    fn new(target: Target<DB>) -> SqlStoreBuilder<DB> {
        SqlStoreBuilder {
            target,
            table: Cow::Borrowed(DEFAULT_TABLE),
            max_connections: None,
            acquire_timeout: None,
            migrate: true,
            max_result_size: DEFAULT_MAX_RESULT_SIZE,
            asynchronous_claims: false,
            plain_claims: false,
        }
    }

    /// The table of records (default [`DEFAULT_TABLE`]). It must match
    /// `[A-Za-z_][A-Za-z0-9_]{0,62}`; on PostgreSQL it may be `schema.table` (the schema is
    /// created by the migration if missing). The name is written into SQL unquoted, so it
    /// follows the database's rules for unquoted names (PostgreSQL folds it to lower case)
    /// and may not be a reserved word. An invalid name fails [`build`](Self::build) with
    /// [`StoreErrorKind::Unsafe`].
    pub fn table(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.table = name.into();
        self
    }

    /// The most connections the pool opens (default 10). Only for a builder from a URL: a
    /// store on the application's pool ([`SqlStore::from_pool`]) uses that pool's size, and
    /// [`build`](Self::build) refuses this option there with [`StoreErrorKind::Unsafe`].
    pub fn max_connections(mut self, max: u32) -> Self {
        self.max_connections = Some(max.max(1));
        self
    }

    /// How long a store call waits for a connection before failing with
    /// [`StoreErrorKind::Unavailable`] (default 5 s): the
    /// time a handler waits when the database is down. Only for a builder from a URL: a
    /// store on the application's pool ([`SqlStore::from_pool`]) uses that pool's timeout,
    /// and [`build`](Self::build) refuses this option there with [`StoreErrorKind::Unsafe`].
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = Some(timeout);
        self
    }

    /// PostgreSQL only, opt-in: claims commit without waiting for their WAL to reach the
    /// disk (`synchronous_commit = off` for the claim statement's own transaction, set by
    /// the statement itself: no extra round trip). Completions, releases and renewals stay
    /// durable, and claims inside the caller's transaction
    /// ([`run_in_tx`](SqlStore::run_in_tx)) follow that transaction's setting.
    ///
    /// The trade-off: a claim the database acknowledged but had not flushed yet (at most
    /// three times `wal_writer_delay`, 600 ms by default) is lost if the **database server**
    /// crashes (an application crash loses nothing). A redelivery after such a crash finds
    /// no record and runs the handler again, as after a Redis failover; the owner's own
    /// completion then finds no record and reports
    /// [`Error::LostOwnership`]. Keep a business-status check
    /// ([`Operation::done`](crate::Operation::done)) or a fenced write at the effect when a
    /// duplicate after a database crash is not acceptable. What it buys: a claim no longer
    /// waits for a WAL flush, the cost of most of a claim on a busy disk.
    ///
    /// [`build`](Self::build) refuses it on MySQL and SQLite with
    /// [`StoreErrorKind::Unsafe`].
    ///
    /// ```no_run
    /// use idempotent_runtime::sql::PostgresStore;
    ///
    /// # async fn f() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = PostgresStore::builder("postgres://app@db/orders")
    ///     .asynchronous_claims(true)
    ///     .build()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn asynchronous_claims(mut self, on: bool) -> Self {
        self.asynchronous_claims = on;
        self
    }

    /// Sends the claims a server without `INSERT ... RETURNING` gets (MySQL), even to a
    /// server that has it (MariaDB 10.5 and later): a claim statement followed by a read of
    /// the record it did not take. On PostgreSQL, the claim statement alone, without the
    /// insert-only claim sent before it. The test suite runs both forms with it; an
    /// application has no reason to set it.
    #[doc(hidden)]
    pub fn plain_claims(mut self, on: bool) -> Self {
        self.plain_claims = on;
        self
    }

    /// Whether [`build`](Self::build) runs [`SqlStore::migrate`] (default `true`).
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
    /// let store = MySqlStore::builder("mysql://app@db/payments")
    ///     .max_result_size(usize::MAX) // as much as the server takes
    ///     .build()
    ///     .await?;
    /// println!("results up to {} bytes are replayed", store.max_result_size());
    /// # Ok(()) }
    /// ```
    pub fn max_result_size(mut self, bytes: usize) -> Self {
        self.max_result_size = bytes;
        self
    }

    /// Builds the store: opens a pool on the URL (from [`SqlStore::builder`]) or takes the
    /// application's pool (from [`SqlStore::from_pool`]), reads the database's limits (on
    /// MySQL / MariaDB the server's `max_allowed_packet`, so the database must be reachable)
    /// and, unless [`migrate`](Self::migrate)`(false)`, runs the migrations.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unavailable`] when the database cannot be reached (within the
    /// acquire timeout); the migration's error; [`StoreErrorKind::Unsafe`] for an invalid
    /// table name, or for [`max_connections`](Self::max_connections) or
    /// [`acquire_timeout`](Self::acquire_timeout) on a builder from a pool.
    pub async fn build(self) -> Result<SqlStore<DB>, StoreError> {
        let table = TableName::parse(&self.table, DB::SCHEMA_QUALIFIED, <DB as Database>::NAME)?;
        let pool = match &self.target {
            Target::Url(url) => {
                let options = PoolOptions::<DB>::new()
                    .max_connections(self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS))
                    .acquire_timeout(self.acquire_timeout.unwrap_or(DEFAULT_ACQUIRE_TIMEOUT));
                DB::open(options, url)
                    .await
                    .map_err(|e| store_error::<DB>(e, Phase::Connect, "connection"))?
            }
            Target::Pool(pool) => {
                let pool_only = [
                    ("max_connections", self.max_connections.is_some()),
                    ("acquire_timeout", self.acquire_timeout.is_some()),
                ];
                if let Some((option, _)) = pool_only.iter().find(|(_, set)| *set) {
                    return Err(StoreError::new(
                        StoreErrorKind::Unsafe,
                        format!(
                            "`{option}` sets the pool the builder opens from a URL; a store on the application's own pool uses that pool's settings (set it on the pool's `PoolOptions`)"
                        ),
                    ));
                }
                pool.clone()
            }
        };
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
        let reporting = DB::reports_claims(&pool)
            .await
            .map_err(|e| store_error::<DB>(e, Phase::Read, "server version read"))?;
        let render = |statements: Statements| {
            Arc::new(if reporting && !self.plain_claims {
                statements
            } else {
                statements.without_reporting()
            })
        };
        let tx_sql = render(Statements::render(&DB::SQL, &table));
        let sql = if self.asynchronous_claims {
            if DB::SQL.claim_async.is_empty() {
                return Err(StoreError::new(
                    StoreErrorKind::Unsafe,
                    format!(
                        "asynchronous claims are a PostgreSQL option; {} commits every claim durably",
                        <DB as Database>::NAME
                    ),
                ));
            }
            render(Statements::render_async_claims(&DB::SQL, &table))
        } else {
            tx_sql.clone()
        };
        let store = SqlStore {
            sql,
            tx_sql,
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
    /// [`DEFAULT_TABLE`] if it is missing, and returns the store: the shorthand for
    /// [`builder`](Self::builder)`(url).build()`. Use the builder for other settings.
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
        SqlStore::builder(url).build().await
    }

    /// A builder for non-default settings (table name, pool size, acquire timeout,
    /// migration, largest result) on a pool it opens on `url` when built.
    pub fn builder(url: &str) -> SqlStoreBuilder<DB> {
        SqlStoreBuilder::new(Target::Url(url.to_string()))
    }

    /// A builder on a pool the application already has, so the store and the business
    /// queries share its connections (its own size and timeouts apply:
    /// [`max_connections`](SqlStoreBuilder::max_connections) and
    /// [`acquire_timeout`](SqlStoreBuilder::acquire_timeout) are refused here).
    ///
    /// ```no_run
    /// use idempotent_runtime::sql::{sqlx, PostgresStore};
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .max_connections(20)
    ///     .connect("postgres://app@db/orders")
    ///     .await?;
    /// let store = PostgresStore::from_pool(pool.clone())
    ///     .table("orders_idempotency")
    ///     .build()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn from_pool(pool: Pool<DB>) -> SqlStoreBuilder<DB> {
        SqlStoreBuilder::new(Target::Pool(pool))
    }

    /// Applies the embedded migrations that are not applied yet (creating the table, its
    /// expiry index and, on PostgreSQL, a missing schema), recording them in
    /// `<table>_migrations`. Safe to run from many processes at once: the migration runs
    /// under a lock that waits for another process's migration (PostgreSQL: an advisory
    /// lock; MySQL / MariaDB: a named `GET_LOCK` of the table, asked again until it is held,
    /// for up to a minute; SQLite: a `BEGIN IMMEDIATE` transaction, waiting through the busy
    /// timeout), so the processes after the first find it applied. Every statement is
    /// `IF NOT EXISTS`, so a table created earlier from the shipped `.sql` files is left as
    /// it is.
    ///
    /// ```no_run
    /// use idempotent_runtime::sql::PostgresStore;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), idempotent_runtime::StoreError> {
    /// let store = PostgresStore::builder("postgres://app@db/orders")
    ///     .migrate(false)
    ///     .build()
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
                    AssertSqlSafe(render(&self.table, sql)).into_sql_str(),
                    false,
                )
            })
            .collect();
        let mut migrator = Migrator::with_migrations(migrations);
        migrator.dangerous_set_table_name(self.table.migrations_table());
        if let Some(schema) = self.table.schema() {
            migrator.create_schema(schema.to_string());
        }
        let migrations_table = self.table.migrations_table();
        let mut conn = self.acquire().await?;
        let migrated = DB::migrate(&mut conn, &mut migrator, &migrations_table).await;
        if migrated.is_err() {
            // A session lock it may still hold goes with the connection.
            conn.close_on_drop();
        }
        migrated
    }
}
