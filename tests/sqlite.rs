//! The SQLite store: the conformance suite twice, on a temporary file (a pool of several
//! connections) and in memory (`sqlite::memory:`, one connection that keeps the database
//! alive), plus the business-transaction API, batched expiry, exact-byte keys, fences from the
//! database's clock, corrupt rows, refused results and the longest durations.
//!
//! Needs no server.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod conformance;
#[path = "support/sql_cases.rs"]
mod sql_cases;

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::SqliteStore;
use idempotency::store::{BoxFuture, Claim, SharedOperatorStore, Store, StoreErrorKind};
use idempotency::{Key, SharedStore};

use sql_cases::{acquired, req, Harness};

/// A database file in the temporary directory, removed (with its journal files) on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new() -> TempFile {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let token = format!("{:?}", idempotency::store::Token::generate());
        let name = format!(
            "idempotent-{}-{}-{}.db",
            std::process::id(),
            &token[6..14],
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        TempFile(std::env::temp_dir().join(name))
    }

    fn url(&self) -> String {
        format!("sqlite:{}", self.0.display())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

struct Sqlite {
    store: Arc<SqliteStore>,
    namespace: String,
    // Dropped after the store; `None` in memory.
    _file: Option<TempFile>,
}

impl conformance::Backend for Sqlite {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!(
                "DELETE FROM {} WHERE substr(record_key, 1, ?) = ?",
                self.store.table()
            );
            sqlx::query(AssertSqlSafe(sql))
                .bind(i64::try_from(prefix.len()).unwrap())
                .bind(prefix.as_bytes())
                .execute(self.store.pool())
                .await
                .unwrap();
        })
    }
}

impl conformance::OperatorBackend for Sqlite {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
    }
}

async fn on_file() -> Sqlite {
    let file = TempFile::new();
    Sqlite {
        store: Arc::new(SqliteStore::connect(&file.url()).await.unwrap()),
        namespace: conformance::unique_namespace(),
        _file: Some(file),
    }
}

async fn in_memory() -> Sqlite {
    Sqlite {
        store: Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap()),
        namespace: conformance::unique_namespace(),
        _file: None,
    }
}

mod file {
    use super::conformance;
    crate::conformance_suite!(super::on_file);
}

mod memory {
    use super::conformance;
    crate::conformance_suite!(super::in_memory);
}

struct Lite;

impl Harness for Lite {
    type Db = sqlx::Sqlite;
    fn count<'a>(store: &'a SqliteStore, table: &'a str) -> BoxFuture<'a, i64> {
        Box::pin(async move {
            let sql = format!("SELECT COUNT(*) FROM {table}");
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(store.pool())
                .await
                .unwrap()
        })
    }
    fn create_payments<'a>(store: &'a SqliteStore, table: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let sql = format!("CREATE TABLE {table} (payment TEXT PRIMARY KEY, amount INTEGER)");
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn corruptions() -> &'static [&'static str] {
        &[
            "fence = -5",
            "state = 'done'",
            "token = x'0102'",
            "fingerprint = x'01'",
            "fence = 'abc'",
        ]
    }
    fn corrupt<'a>(store: &'a SqliteStore, key: &'a Key, assignment: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // On one connection: the pragma is the connection's.
            let mut conn = store.pool().acquire().await.unwrap();
            sqlx::query("PRAGMA ignore_check_constraints = ON")
                .execute(&mut *conn)
                .await
                .unwrap();
            let sql = format!(
                "UPDATE {} SET {assignment} WHERE record_key = ?",
                store.table()
            );
            let done = sqlx::query(AssertSqlSafe(sql))
                .bind(key.as_bytes())
                .execute(&mut *conn)
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1, "{assignment}");
            sqlx::query("PRAGMA ignore_check_constraints = OFF")
                .execute(&mut *conn)
                .await
                .unwrap();
        })
    }
    fn limit_results<'a>(store: &'a SqliteStore) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let table = store.table();
            let sql = format!(
                "CREATE TRIGGER {table}_small_result BEFORE UPDATE OF result ON {table} \
                 WHEN length(NEW.result) > 100 \
                 BEGIN SELECT RAISE(ABORT, 'result too long'); END"
            );
            sqlx::query(AssertSqlSafe(sql))
                .execute(store.pool())
                .await
                .unwrap();
        })
    }
    fn insert_payment<'c>(
        conn: &'c mut sqlx::SqliteConnection,
        table: &'c str,
        payment: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {table} (payment, amount) VALUES (?, 1250)");
            sqlx::query(AssertSqlSafe(sql))
                .bind(payment)
                .execute(conn)
                .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn business_transaction_commits_or_rolls_back_with_its_record() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    sql_cases::business_transaction_commits_or_rolls_back_with_its_record::<Lite>(
        &store, "payments",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_transactions_on_one_key_wait_for_the_first() {
    let file = TempFile::new();
    let store = SqliteStore::connect(&file.url()).await.unwrap();
    sql_cases::concurrent_transactions_on_one_key_wait_for_the_first::<Lite>(&store, "payments")
        .await;
}

#[tokio::test]
async fn expired_records_are_purged_in_batches() {
    let file = TempFile::new();
    let store = SqliteStore::connect(&file.url()).await.unwrap();
    sql_cases::expired_records_are_purged_in_batches::<Lite>(&store).await;
}

/// A store on a database of its own, in memory.
async fn fresh() -> ((), SqliteStore) {
    ((), SqliteStore::connect("sqlite::memory:").await.unwrap())
}

fresh_store_cases!(Lite, fresh);

#[tokio::test]
async fn batch_answers_as_single_claims_would() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    sql_cases::batch_answers_as_single_claims_would::<Lite>(&store).await;
}

#[tokio::test]
async fn records_survive_reopening_the_file() {
    let file = TempFile::new();
    let key = Key::new("reopen", 1, &[&1u8]).unwrap();
    let fence = {
        let store = SqliteStore::connect(&file.url()).await.unwrap();
        let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
        let fence = acquired(store.claim(&r).await);
        store.pool().close().await;
        fence
    };
    let store = SqliteStore::connect(&file.url()).await.unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::InProgress { fence });
}

#[tokio::test]
async fn store_urls_pick_the_sqlite_store() {
    let store = idempotency::connect("sqlite::memory:").await.unwrap();
    let key = Key::new("url", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
}

#[tokio::test]
async fn corrupt_records_are_reported_as_corrupt() {
    let file = TempFile::new();
    let store = SqliteStore::connect(&file.url()).await.unwrap();
    sql_cases::corrupt_records_are_reported_as_corrupt::<Lite>(&store).await;
}

#[tokio::test]
async fn result_above_the_store_limit_is_rejected() {
    let store = SqliteStore::builder("sqlite::memory:")
        .max_result_size(1024)
        .build()
        .await
        .unwrap();
    assert_eq!(store.max_result_size(), 1024);
    sql_cases::result_above_the_store_limit_is_rejected::<Lite>(&store).await;
}

#[tokio::test]
async fn result_size_limit_defaults_and_is_clamped_to_the_length_limit() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    assert_eq!(
        store.max_result_size(),
        idempotency::store::DEFAULT_MAX_RESULT_SIZE
    );
    let store = SqliteStore::builder("sqlite::memory:")
        .max_result_size(usize::MAX)
        .build()
        .await
        .unwrap();
    // SQLite's default length limit, 10^9 bytes, less 64 KiB for the rest of the row.
    assert_eq!(store.max_result_size(), 1_000_000_000 - (64 << 10));
}

/// The application's own pool, on `file`, as an application would open it.
async fn application_pool(file: &TempFile) -> sqlx::SqlitePool {
    let options = sqlx::sqlite::SqliteConnectOptions::from_str(&file.url())
        .unwrap()
        .create_if_missing(true);
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap()
}

#[tokio::test]
async fn store_on_the_application_pool_writes_through_it() {
    let file = TempFile::new();
    let pool = application_pool(&file).await;
    let store = SqliteStore::from_pool(pool.clone())
        .table("app_records")
        .max_result_size(2048)
        .build()
        .await
        .unwrap();
    assert_eq!(store.table(), "app_records");
    assert_eq!(store.max_result_size(), 2048);
    let key = Key::new("from-pool", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    acquired(store.claim(&r).await);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM app_records")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn pool_settings_are_refused_on_the_application_pool() {
    let file = TempFile::new();
    let pool = application_pool(&file).await;
    let refused = [
        (
            "max_connections",
            SqliteStore::from_pool(pool.clone()).max_connections(4),
        ),
        (
            "acquire_timeout",
            SqliteStore::from_pool(pool.clone()).acquire_timeout(Duration::from_secs(1)),
        ),
    ];
    for (option, builder) in refused {
        let err = builder.build().await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Unsafe, "{option}");
        assert!(err.to_string().contains(option), "{option}: {err}");
    }
    // Refused before the migration: no table was created.
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE name = 'idempotent_records'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(tables, 0);
}

/// Asynchronous claims are a PostgreSQL option: SQLite refuses it when the store is built.
#[tokio::test]
async fn asynchronous_claims_are_refused() {
    let refused = idempotency::sql::SqliteStore::builder("sqlite::memory:")
        .asynchronous_claims(true)
        .build()
        .await;
    let Err(err) = refused else {
        panic!("a SQLite store with asynchronous claims was built");
    };
    assert_eq!(
        err.kind(),
        idempotency::store::StoreErrorKind::Unsafe,
        "{err}"
    );
    assert!(err.to_string().contains("PostgreSQL"), "{err}");
}
