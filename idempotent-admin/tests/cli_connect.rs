//! Reaching the store from the real binary: a failure to connect says why (the cause
//! chain), bad input exits 2 (an unknown scheme, a URL that does not parse, a cursor of
//! another store, `--table` on Redis), read commands never create the records table (they
//! say it is missing and how to create it), `migrate` creates it, and `--table` names it.
//! PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (a schema of the test's own), MariaDB at
//! `IDEMPOTENT_MYSQL_URL` (tables of the test's own), Redis at `IDEMPOTENT_REDIS_URL`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use idempotency::sql::sqlx::{self, Connection, Executor};
use idempotency::sql::{MySqlStore, PostgresStore};
use idempotency::{Idempotency, Key};

use common::{admin, code, json, mysql_url, postgres_url, redis_url, text, unique};

#[test]
fn connect_failures_say_why_and_bad_input_exits_2() {
    let inspect = ["inspect", "--prefix", "p", "--part", "x"];
    let refused = admin("postgres://postgres@127.0.0.1:1/test", &inspect, "");
    assert_eq!(code(&refused), 3, "{}", text(&refused));
    assert!(text(&refused).contains("refused"), "{}", text(&refused));
    let no_database = admin(
        &postgres_url().replace("/test", "/no_such_database_here"),
        &inspect,
        "",
    );
    assert_eq!(code(&no_database), 3, "{}", text(&no_database));
    assert!(
        text(&no_database).contains("no_such_database_here"),
        "{}",
        text(&no_database)
    );
    let wrong_password = admin("mysql://root:wrong@127.0.0.1:3306/test", &inspect, "");
    assert_eq!(code(&wrong_password), 3, "{}", text(&wrong_password));
    assert!(
        text(&wrong_password).contains("Access denied"),
        "{}",
        text(&wrong_password)
    );

    let scheme = admin("ftp://example.com", &inspect, "");
    assert_eq!(code(&scheme), 2, "{}", text(&scheme));
    assert!(text(&scheme).contains("unsupported store URL"));
    let malformed = admin("postgres://postgres@[::1/test", &inspect, "");
    assert_eq!(code(&malformed), 2, "{}", text(&malformed));
    let cursor = admin(
        &redis_url(),
        &["list", "--prefix", "p", "--cursor", "not-a-cursor"],
        "",
    );
    assert_eq!(code(&cursor), 2, "{}", text(&cursor));
    assert!(text(&cursor).contains("cursor"), "{}", text(&cursor));
    let table = admin(
        &redis_url(),
        &["--table", "t", "inspect", "--key", "p:v1:{1:x}"],
        "",
    );
    assert_eq!(code(&table), 2, "{}", text(&table));
}

/// On a schema with no table, `inspect` and `list` say the table is missing and how to
/// create it, and create nothing; `migrate` creates it; then a record is found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_postgres_create_nothing() {
    let base = postgres_url();
    let schema = unique("idem_reads").to_lowercase();
    let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let url = format!(
        "{base}{}options=-c%20search_path%3D{schema}",
        if base.contains('?') { "&" } else { "?" }
    );
    let tables = format!("SELECT COUNT(*) FROM pg_tables WHERE schemaname = '{schema}'");
    let key = Key::new("payment:capture", 1, &[&"pay-1"]).unwrap();
    for args in [
        &["inspect", "--key", &key.to_string()][..],
        &["list", "--prefix", "payment:capture"][..],
    ] {
        let out = admin(&url, args, "");
        assert_eq!(code(&out), 3, "{}", text(&out));
        assert!(text(&out).contains("idempotent_records"), "{}", text(&out));
        assert!(text(&out).contains("migrate"), "{}", text(&out));
        let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(tables.clone()))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(count, 0, "a read created tables");
    }
    let migrated = admin(&url, &["migrate"], "");
    assert_eq!(code(&migrated), 0, "{}", text(&migrated));
    let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(tables.clone()))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(count, 2, "the records table and its migrations table");
    let store = PostgresStore::builder(&url)
        .migrate(false)
        .build()
        .await
        .unwrap();
    let guard = Idempotency::new(Duration::from_secs(3600)).store(std::sync::Arc::new(store));
    let done: Result<(), idempotency::Error> = guard.run(key.clone(), async { Ok(()) }).await;
    done.unwrap();
    let shown = json(&admin(
        &url,
        &["--json", "inspect", "--key", &key.to_string()],
        "",
    ));
    assert_eq!(shown["record"]["state"], "completed");
    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

/// `--table` on MariaDB: a read of a table that is missing creates nothing; `migrate
/// --table` creates it; the records the application wrote there are found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_table_on_mariadb() {
    let url = mysql_url();
    let table = unique("idem_cli").to_lowercase();
    let mut conn = sqlx::MySqlConnection::connect(&url).await.unwrap();
    let tables = format!(
        "SELECT COUNT(*) FROM information_schema.tables \
         WHERE table_schema = DATABASE() AND table_name LIKE '{table}%'"
    );
    let key = Key::new("coupon:issue", 2, &[&"u-7"]).unwrap();
    let missing = admin(
        &url,
        &["--table", &table, "inspect", "--key", &key.to_string()],
        "",
    );
    assert_eq!(code(&missing), 3, "{}", text(&missing));
    assert!(text(&missing).contains(&table), "{}", text(&missing));
    let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(tables.clone()))
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(count, 0, "a read created tables");

    let migrated = admin(&url, &["--table", &table, "migrate"], "");
    assert_eq!(code(&migrated), 0, "{}", text(&migrated));
    let store = MySqlStore::builder(&url)
        .table(table.clone())
        .build()
        .await
        .unwrap();
    let guard = Idempotency::new(Duration::from_secs(3600)).store(std::sync::Arc::new(store));
    let done: Result<(), idempotency::Error> = guard.run(key.clone(), async { Ok(()) }).await;
    done.unwrap();
    let shown = json(&admin(
        &url,
        &[
            "--table",
            &table,
            "--json",
            "inspect",
            "--key",
            &key.to_string(),
        ],
        "",
    ));
    assert_eq!(shown["record"]["state"], "completed");
    let default_table = admin(&url, &["inspect", "--key", &key.to_string()], "");
    assert_ne!(code(&default_table), 0, "{}", text(&default_table));
    for name in [table.clone(), format!("{table}_migrations")] {
        conn.execute(sqlx::AssertSqlSafe(format!("DROP TABLE {name}")))
            .await
            .unwrap();
    }
}

/// A read of an SQLite file that does not exist creates no file.
#[test]
fn a_read_creates_no_sqlite_file() {
    let path = std::env::temp_dir().join(format!("{}.db", unique("idem_cli")));
    let url = format!("sqlite:{}", path.display());
    let out = admin(&url, &["list", "--prefix", "p"], "");
    assert_eq!(code(&out), 3, "{}", text(&out));
    assert!(!path.exists(), "{}", text(&out));
}
