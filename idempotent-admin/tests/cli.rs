//! The real `idempotent-admin` binary against the real Redis at `IDEMPOTENT_REDIS_URL`
//! (default `redis://127.0.0.1:6379`) and PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`, in a schema of the test's own): a stuck key
//! inspected and released, a held key unheld, and every refusal with its exit code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idempotency::sql::sqlx::{self, Connection, Executor};
use idempotency::{Claim, ClaimRequest, Error, Idempotency, Key, OnError, Store, Token};

fn redis_url() -> String {
    std::env::var("IDEMPOTENT_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
}

/// Runs the binary with `args`, `stdin` as its input.
fn admin(store: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("IDEMPOTENT_STORE_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)))
}

/// A stuck owner on Redis: seen in progress with its fence; a wrong fence and a refused
/// confirmation change nothing (exit 1); the right fence with `--yes` frees the key
/// (exit 0), and the next claim takes it with a higher fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_key_on_redis_is_inspected_and_released() {
    let url = redis_url();
    let store = Arc::new(idempotency::redis::RedisStore::connect(&url).await.unwrap());
    let prefix = unique("admin-cli");
    let key = Key::new(&prefix, 1, &[&"pay-42"]).unwrap();
    let hour = Duration::from_secs(3600);
    let stuck = ClaimRequest::new(key.clone(), Token::generate(), hour, hour);
    let Claim::Acquired { fence } = store.claim(&stuck).await.unwrap() else {
        panic!("not acquired");
    };
    let by_parts = ["--prefix", prefix.as_str(), "--part", "pay-42"];
    let fence_text = fence.to_string();

    let shown = admin(&url, &[&["inspect"][..], &by_parts].concat(), "");
    assert_eq!(code(&shown), 0, "{}", text(&shown));
    let shown_text = text(&shown);
    assert!(shown_text.contains("in_progress"), "{shown_text}");
    assert!(shown_text.contains(&fence_text), "{shown_text}");
    let as_json = json(&admin(
        &url,
        &["--json", "inspect", "--key", &key.to_string()],
        "",
    ));
    assert_eq!(as_json["record"]["state"], "in_progress");
    assert_eq!(as_json["record"]["fence"], fence);
    assert!(as_json["record"]["lease_left_seconds"].as_f64().unwrap() > 3000.0);

    let wrong = admin(
        &url,
        &[&["release"][..], &by_parts, &["--fence", "1", "--yes"]].concat(),
        "",
    );
    assert_eq!(code(&wrong), 1, "{}", text(&wrong));
    assert!(text(&wrong).contains(&format!("fence is {fence}")));
    let refused = admin(
        &url,
        &[&["release"][..], &by_parts, &["--fence", &fence_text]].concat(),
        "n\n",
    );
    assert_eq!(code(&refused), 1, "{}", text(&refused));
    assert!(text(&refused).contains("not confirmed"));
    assert!(matches!(
        store.read(&key).await.unwrap().unwrap().state,
        idempotency::RecordState::InProgress { .. }
    ));

    let released = admin(
        &url,
        &[
            &["--json", "release"][..],
            &by_parts,
            &["--fence", &fence_text],
        ]
        .concat(),
        "y\n",
    );
    assert_eq!(code(&released), 0, "{}", text(&released));
    assert_eq!(json(&released)["outcome"], "done");
    let next = ClaimRequest::new(key.clone(), Token::generate(), hour, hour);
    let Claim::Acquired { fence: next_fence } = store.claim(&next).await.unwrap() else {
        panic!("the released key was not free");
    };
    assert!(next_fence > fence);
    assert!(!store
        .complete(
            &key,
            &stuck.token,
            &idempotency::Completion::new(None, hour)
        )
        .await
        .unwrap());
    store.release(&key, &next.token).await.unwrap();
}

/// A held key in PostgreSQL (a schema of the test's own) is unheld, and the next delivery
/// runs the handler once; unholding it again changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_in_postgres_is_unheld() {
    let base = std::env::var("IDEMPOTENT_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = unique("idem_admin").replace('-', "_");
    let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let url = format!(
        "{base}{}options=-c%20search_path%3D{schema}",
        if base.contains('?') { "&" } else { "?" }
    );
    let store = idempotency::connect(&url).await.unwrap();
    let key = Key::new("payment:capture", 1, &[&"pay-7"]).unwrap();
    let guard = Idempotency::new(Duration::from_secs(3600)).store(store.clone());
    let failed: Result<(), Error> = guard
        .operation(key.clone())
        .on_error(|_| OnError::Hold)
        .run(async { Err(Error::NoStore) })
        .await;
    assert!(failed.is_err());
    let shown = json(&admin(
        &url,
        &["--json", "inspect", "--key", &key.to_string()],
        "",
    ));
    assert_eq!(shown["record"]["state"], "completed");
    assert_eq!(shown["record"]["held"], true);

    let unheld = admin(&url, &["unhold", "--key", &key.to_string(), "--yes"], "");
    assert_eq!(code(&unheld), 0, "{}", text(&unheld));
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let again: Result<(), Error> = guard
        .run(key.clone(), async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        })
        .await;
    again.unwrap();
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    let twice = admin(&url, &["unhold", "--key", &key.to_string(), "--yes"], "");
    assert_eq!(code(&twice), 1, "{}", text(&twice));
    assert!(text(&twice).contains("is completed"));

    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}

/// Bad input and a failing store: no key, a malformed key, no store, a key with no record,
/// a store that is down, a record the store cannot read. Nothing is changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_store_failures_have_their_exit_codes() {
    let url = redis_url();
    let prefix = unique("admin-cli");
    let no_key = admin(&url, &["inspect"], "");
    assert_eq!(code(&no_key), 2, "{}", text(&no_key));
    let malformed = admin(&url, &["inspect", "--key", "not a key"], "");
    assert_eq!(code(&malformed), 2, "{}", text(&malformed));
    assert!(text(&malformed).contains("bad key"));
    let bad_prefix = admin(&url, &["inspect", "--prefix", "a{b", "--part", "x"], "");
    assert_eq!(code(&bad_prefix), 2, "{}", text(&bad_prefix));
    let no_store = Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
        .args(["inspect", "--prefix", "p", "--part", "x"])
        .env_remove("IDEMPOTENT_STORE_URL")
        .output()
        .unwrap();
    assert_eq!(code(&no_store), 2, "{}", text(&no_store));
    assert!(text(&no_store).contains("IDEMPOTENT_STORE_URL"));
    let usage = admin(&url, &["release", "--prefix", "p", "--part", "x"], "");
    assert_eq!(code(&usage), 2, "--fence is required: {}", text(&usage));

    let missing = admin(
        &url,
        &["inspect", "--prefix", &prefix, "--part", "none"],
        "",
    );
    assert_eq!(code(&missing), 1, "{}", text(&missing));
    assert!(text(&missing).contains("has no record"));
    let down = admin(
        "redis://127.0.0.1:1",
        &["inspect", "--prefix", &prefix, "--part", "x"],
        "",
    );
    assert_eq!(code(&down), 3, "{}", text(&down));

    let key = Key::new(&prefix, 1, &[&"corrupt"]).unwrap();
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(key.as_bytes())
        .arg("not a record")
        .arg("EX")
        .arg(60)
        .query(&mut conn)
        .unwrap();
    let corrupt = admin(&url, &["inspect", "--key", &key.to_string()], "");
    assert_eq!(code(&corrupt), 3, "{}", text(&corrupt));
    let left: String = redis::cmd("GET")
        .arg(key.as_bytes())
        .query(&mut conn)
        .unwrap();
    assert_eq!(left, "not a record");
    let _: () = redis::cmd("DEL")
        .arg(key.as_bytes())
        .query(&mut conn)
        .unwrap();
}
