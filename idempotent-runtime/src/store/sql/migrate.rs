//! Running the migrations safely from many processes at once, and SQLite's switch to
//! write-ahead logging, which a fleet of processes may all attempt at the same moment.
//!
//! sqlx's migrator locks the database on PostgreSQL (`pg_advisory_lock`, which waits), but
//! on MySQL its `GET_LOCK(name, -1)` has its answer ignored (MariaDB answers `NULL` at once
//! rather than wait) and on SQLite it takes no lock: processes starting together all apply
//! the migration and all but one fail (a duplicate version row, a migration seen half
//! applied). Here MySQL / MariaDB takes a named lock of its own, checks the answer and asks
//! again until it holds it, on the one connection that then migrates; SQLite migrates inside
//! a `BEGIN IMMEDIATE` transaction, which takes the database's write lock (waiting through
//! the busy timeout) before anything is read. Either way the second process finds the
//! migration applied and does nothing.

use sqlx::migrate::Migrator;

use crate::database::migrate_error;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
use crate::database::{store_error, Phase};
use crate::error::StoreError;
#[cfg(feature = "mysql")]
use crate::error::StoreErrorKind;
use crate::store::BoxFuture;

/// How long a process waits for another one's migration (or WAL switch) before failing.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
const WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A connection the migrations run on, with the lock its database needs.
pub(crate) trait LockedMigrate: Sized {
    /// Runs `migrator`, whose migrations table is `migrations_table`, holding a lock that
    /// keeps other processes' migrations of the same table out until it is done.
    fn migrate_locked<'c>(
        &'c mut self,
        migrator: &'c mut Migrator,
        migrations_table: &'c str,
    ) -> BoxFuture<'c, Result<(), StoreError>>;
}

/// PostgreSQL: sqlx's own lock (`pg_advisory_lock`) waits for other migrators.
#[cfg(feature = "postgres")]
impl LockedMigrate for sqlx::PgConnection {
    fn migrate_locked<'c>(
        &'c mut self,
        migrator: &'c mut Migrator,
        _: &'c str,
    ) -> BoxFuture<'c, Result<(), StoreError>> {
        Box::pin(async move {
            migrator
                .run_direct(None, self, false)
                .await
                .map_err(migrate_error::<sqlx::Postgres>)
        })
    }
}

/// The named lock of a migrations table in the current database (a lock name is at most 64
/// characters: the table's name is hashed).
#[cfg(feature = "mysql")]
const MYSQL_LOCK_NAME: &str =
    "CONCAT('idempotency:', SHA1(CONCAT(COALESCE(DATABASE(), ''), '.', ?)))";

/// MySQL / MariaDB: `GET_LOCK` on this connection, asked again until it answers 1 (it
/// answers 0 after its own timeout, and MariaDB may answer `NULL` at once), then released
/// whether the migration succeeded or not.
#[cfg(feature = "mysql")]
impl LockedMigrate for sqlx::MySqlConnection {
    fn migrate_locked<'c>(
        &'c mut self,
        migrator: &'c mut Migrator,
        migrations_table: &'c str,
    ) -> BoxFuture<'c, Result<(), StoreError>> {
        use sqlx::MySql;
        use std::time::{Duration, Instant};

        Box::pin(async move {
            let lock = format!("SELECT GET_LOCK({MYSQL_LOCK_NAME}, ?)");
            let unlock = format!("SELECT RELEASE_LOCK({MYSQL_LOCK_NAME})");
            let lock_error = |e| store_error::<MySql>(e, Phase::Read, "migration lock");
            let deadline = Instant::now() + WAIT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let wait = left.as_secs().clamp(1, 5);
                let held: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(lock.as_str()))
                    .bind(migrations_table)
                    .bind(wait)
                    .fetch_one(&mut *self)
                    .await
                    .map_err(lock_error)?;
                if held == Some(1) {
                    break;
                }
                if left.is_zero() {
                    return Err(StoreError::new(
                        StoreErrorKind::Unavailable,
                        format!(
                            "another process held the migration lock of `{migrations_table}` for {} s",
                            WAIT.as_secs()
                        ),
                    ));
                }
                if held.is_none() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            // Ours replaces sqlx's, whose answer sqlx does not check.
            migrator.set_locking(false);
            let migrated = migrator
                .run_direct(None, &mut *self, false)
                .await
                .map_err(migrate_error::<MySql>);
            let released = sqlx::query(sqlx::AssertSqlSafe(unlock))
                .bind(migrations_table)
                .execute(&mut *self)
                .await
                .map_err(lock_error);
            migrated?;
            released.map(|_| ())
        })
    }
}

/// SQLite: the migration runs inside `BEGIN IMMEDIATE`, which takes the write lock first
/// (waiting for another process's migration through the busy timeout), so the migrations
/// table is read under the lock and the whole migration commits or rolls back as one.
#[cfg(feature = "sqlite")]
impl LockedMigrate for sqlx::SqliteConnection {
    fn migrate_locked<'c>(
        &'c mut self,
        migrator: &'c mut Migrator,
        _: &'c str,
    ) -> BoxFuture<'c, Result<(), StoreError>> {
        use sqlx::{Connection, Sqlite};

        Box::pin(async move {
            let lock_error = |e| store_error::<Sqlite>(e, Phase::Write, "migration lock");
            let mut tx = self
                .begin_with("BEGIN IMMEDIATE")
                .await
                .map_err(lock_error)?;
            migrator.set_locking(false);
            migrator
                .run_direct(None, &mut *tx, false)
                .await
                .map_err(migrate_error::<Sqlite>)?;
            tx.commit().await.map_err(lock_error)
        })
    }
}

/// Switches a file database to write-ahead logging, once: the switch needs a lock that the
/// busy timeout does not wait for, so a switch that meets another connection's lock (another
/// process switching, or migrating) is tried again with a growing pause, for at most
/// [`WAIT`]. A database already in WAL mode answers at once. A database that stays in another
/// mode (a file system without shared memory, say) is left in it, as SQLite answers.
#[cfg(feature = "sqlite")]
pub(crate) async fn sqlite_wal(pool: &sqlx::Pool<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
    use std::time::{Duration, Instant};

    let mut conn = pool.acquire().await?;
    let deadline = Instant::now() + WAIT;
    let mut pause = Duration::from_millis(5);
    loop {
        match sqlx::query_scalar::<_, String>("PRAGMA journal_mode = WAL")
            .fetch_one(&mut *conn)
            .await
        {
            Ok(_) => return Ok(()),
            Err(err)
                if crate::database::is_conflict::<sqlx::Sqlite>(&err)
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(err) => return Err(err),
        }
    }
}
