//! [`Builder`]: a [`SqlStore`]'s settings, connecting, and the embedded migrations.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::pool::PoolOptions;
use sqlx::{AssertSqlSafe, Database, Pool, SqlSafeStr};

#[cfg(doc)]
use crate::error::Error;
use crate::error::{StoreError, StoreErrorKind};
#[cfg(doc)]
use crate::store::Store;
use crate::store::DEFAULT_MAX_RESULT_SIZE;

use crate::store::sql::driver::{Dialect, Statements};
use crate::store::sql::error::{migrate_error, store_error, Phase};
use crate::store::sql::store::SqlStore;
use crate::store::sql::table::{TableName, DEFAULT_TABLE};

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
}
