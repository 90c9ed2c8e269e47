//! Keys whose parts are not UTF-8 or hold special characters, through the real binary on
//! real servers: what `list` prints, `inspect` and `delete` take back with `--key`, and
//! `purge` deletes them all (exact counts). Redis at `IDEMPOTENT_REDIS_URL`, PostgreSQL at
//! `IDEMPOTENT_POSTGRES_URL` (a schema of the test's own), MariaDB at `IDEMPOTENT_MYSQL_URL`
//! (a table of the test's own).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use idempotency::sql::sqlx::{self, Connection, Executor};
use idempotency::store::SharedOperatorStore;
use idempotency::{Idempotency, Key};

use common::{admin, code, json, postgres_url, redis_url, text, unique};

/// The parts of the keys: invalid UTF-8, UTF-8 outside ASCII, braces, a backslash, quotes,
/// white space and controls, separators.
fn parts() -> Vec<Vec<u8>> {
    vec![
        vec![0xff, 0x00, 0x80],
        "café".into(),
        b"a}b{c%7D".to_vec(),
        br"back\slash\x41".to_vec(),
        br#"quotes ' and ""#.to_vec(),
        b"tab\tnl\n sp".to_vec(),
        b"comma,colon:".to_vec(),
    ]
}

/// Completes one record per part under `prefix`, then: `list` prints every key (JSON and
/// table alike); each printed key is inspected by `--key`; the first three are deleted by
/// `--key`, the rest purged; nothing is left. `extra` goes before the command (`--table`).
async fn round_trip(url: &str, store: SharedOperatorStore, prefix: &str, extra: &[&str]) {
    let guard = Idempotency::new(Duration::from_secs(3600)).store(store.clone());
    let keys: Vec<Key> = parts()
        .iter()
        .map(|part| Key::new(prefix, 1, &[part]).unwrap())
        .collect();
    for key in &keys {
        let done: Result<(), idempotency::Error> = guard.run(key.clone(), async { Ok(()) }).await;
        done.unwrap();
    }
    let expected: BTreeSet<String> = keys.iter().map(Key::to_string).collect();
    let run = |args: &[&str]| admin(url, &[extra, args].concat(), "");

    let listed = run(&["--json", "list", "--prefix", prefix]);
    assert_eq!(code(&listed), 0, "{}", text(&listed));
    let printed: BTreeSet<String> = json(&listed)["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|record| record["key"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(printed, expected);
    let table = run(&["list", "--prefix", prefix]);
    assert_eq!(code(&table), 0, "{}", text(&table));
    let table_text = String::from_utf8(table.stdout.clone()).unwrap();
    assert_eq!(table_text.lines().count(), keys.len() + 1, "{table_text}");
    for key in &printed {
        assert!(table_text.contains(key.as_str()), "{key} in {table_text}");
        let shown = run(&["--json", "inspect", "--key", key]);
        assert_eq!(code(&shown), 0, "{key}: {}", text(&shown));
        assert_eq!(json(&shown)["key"], key.as_str());
        assert_eq!(json(&shown)["record"]["state"], "completed");
    }

    for key in &keys[..3] {
        let deleted = run(&["delete", "--key", &key.to_string(), "--yes"]);
        assert_eq!(code(&deleted), 0, "{key}: {}", text(&deleted));
        assert_eq!(store.read(key).await.unwrap(), None, "{key}");
    }
    let purged = run(&["--json", "purge", "--prefix", prefix, "--yes"]);
    assert_eq!(code(&purged), 0, "{}", text(&purged));
    assert_eq!(
        json(&purged)["deleted"],
        keys.len() - 3,
        "{}",
        text(&purged)
    );
    for key in &keys {
        assert_eq!(store.read(key).await.unwrap(), None, "{key}");
    }
    let after = run(&["--json", "list", "--prefix", prefix]);
    assert_eq!(json(&after)["records"].as_array().unwrap().len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_keys_round_trip_on_redis() {
    let url = redis_url();
    let store = idempotency::connect(&url).await.unwrap();
    round_trip(&url, store, &unique("admin-keys"), &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_keys_round_trip_on_postgres() {
    let base = postgres_url();
    let schema = unique("idem_keys").to_lowercase();
    let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let url = format!(
        "{base}{}options=-c%20search_path%3D{schema}",
        if base.contains('?') { "&" } else { "?" }
    );
    let store = idempotency::connect(&url).await.unwrap();
    round_trip(&url, store, "payment:capture", &[]).await;
    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_keys_round_trip_on_mariadb() {
    let url = common::mysql_url();
    let table = unique("idem_keys").to_lowercase();
    let store = idempotency::sql::MySqlStore::builder(&url)
        .table(table.clone())
        .build()
        .await
        .unwrap();
    round_trip(
        &url,
        std::sync::Arc::new(store),
        "payment:capture",
        &["--table", &table],
    )
    .await;
    let mut conn = sqlx::MySqlConnection::connect(&url).await.unwrap();
    for name in [table.clone(), format!("{table}_migrations")] {
        conn.execute(sqlx::AssertSqlSafe(format!("DROP TABLE {name}")))
            .await
            .unwrap();
    }
}
