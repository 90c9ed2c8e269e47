//! A store that goes silent under a command (its connection open, nothing answered, no error,
//! as a half-dead connection or a stalled server): the command fails at its `--timeout` with
//! exit 3 and says a change it carried may have been applied, instead of waiting forever.
//! A proxy makes the silence: it never forwards the request that carries a marker.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "../../tests/support/proxy.rs"]
mod proxy;

use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{code, postgres_url, redis_url, text, unique};
use idempotency::sql::sqlx::{self, Connection, Executor};
use proxy::Proxy;

/// The binary on `store` with `args`, killed (and the test failed) if it has not ended within
/// 15 s: a command that waits forever, or for the default timeout (30 s) instead of the one
/// given, fails here instead of hanging the suite.
async fn admin_bounded(store: String, args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
            .arg("--store")
            .arg(&store)
            .args(&args)
            .env_remove("IDEMPOTENT_STORE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > Duration::from_secs(15) {
                child.kill().unwrap();
                panic!("`{}` still waits after 15 s", args.join(" "));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap()
}

/// The host and port of a URL (`scheme://[user@]host:port[/db]`).
fn server_of(url: &str) -> &str {
    let rest = url.split("://").nth(1).unwrap();
    let rest = rest.rsplit('@').next().unwrap();
    rest.split('/').next().unwrap()
}

/// `url` through a new proxy.
async fn proxied(url: &str) -> (Proxy, String) {
    let server = server_of(url);
    let proxy = Proxy::start(server.parse::<SocketAddr>().unwrap()).await;
    let through = url.replacen(server, &proxy.addr().to_string(), 1);
    (proxy, through)
}

/// `retry` of a dead outbox message whose statement is never answered: exit 3 at the timeout,
/// saying the retry may have been applied; the message is still dead (the statement never
/// reached the database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_retry_on_a_silent_database_fails_at_the_timeout() {
    use idempotency::outbox::{Message, PostgresOutbox};

    let base = postgres_url();
    let schema = unique("idem_outbox_silent").replace('-', "_");
    let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&base).await.unwrap();
    let table = format!("{schema}.idempotent_outbox");
    let outbox = PostgresOutbox::with_table(pool.clone(), &table).unwrap();
    outbox.create_table().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let message = Message::new("order", "o-1", "placed", "orders", b"{}".to_vec());
    let id = outbox.enqueue(&mut tx, &message).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {table} SET state = 'dead' WHERE id = $1"
    )))
    .bind(id.as_str())
    .execute(&pool)
    .await
    .unwrap();

    let (proxy, url) = proxied(&base).await;
    proxy.stall_request(schema.as_bytes());
    let args = [
        "--timeout",
        "1s",
        "outbox",
        "--table",
        &table,
        "retry",
        "--id",
    ];
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.extend([id.as_str().to_string(), "--yes".to_string()]);
    let out = admin_bounded(url, args).await;
    assert_eq!(code(&out), 3, "{}", text(&out));
    assert!(text(&out).contains("within 1s"), "{}", text(&out));
    assert!(
        text(&out).contains("may have been applied"),
        "{}",
        text(&out)
    );
    assert_eq!(proxy.stalled(), 1);
    assert_eq!(outbox.counts().await.unwrap().dead, 1);

    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

/// Opening an SQL store whose check for the records table is never answered: exit 3 at the
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_silent_sql_store_fails_at_the_timeout() {
    let (proxy, url) = proxied(&postgres_url()).await;
    let table = unique("idem_silent_open").replace('-', "_");
    proxy.stall_request(table.as_bytes());
    let args = [
        "--timeout",
        "1s",
        "--table",
        &table,
        "inspect",
        "--key",
        "k:v1:{a}",
    ];
    let out = admin_bounded(url, args.iter().map(|s| s.to_string()).collect()).await;
    assert_eq!(code(&out), 3, "{}", text(&out));
    assert!(text(&out).contains("within 1s"), "{}", text(&out));
    assert_eq!(proxy.stalled(), 1);
}

/// A `delete` on a Redis store whose command is never answered: exit 3 at the timeout the
/// operator gave, saying the delete may have been applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_call_on_a_silent_store_fails_at_the_given_timeout() {
    let (proxy, url) = proxied(&redis_url()).await;
    let prefix = unique("silent_delete");
    let key = format!("{prefix}:v1:{{a}}");
    proxy.stall_request(prefix.as_bytes());
    let args = ["--timeout", "1s", "delete", "--key", &key, "--yes"];
    let out = admin_bounded(url, args.iter().map(|s| s.to_string()).collect()).await;
    assert_eq!(code(&out), 3, "{}", text(&out));
    assert!(
        text(&out).contains("may have been applied"),
        "{}",
        text(&out)
    );
    assert_eq!(proxy.stalled(), 1);
}
