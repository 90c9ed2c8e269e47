//! The real `idempotent-admin` binary against the real Redis at `IDEMPOTENT_REDIS_URL`
//! (default `redis://127.0.0.1:6379`) and PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`, in a schema of the test's own): a stuck key
//! inspected and released, a held key unheld, and every refusal with its exit code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use idempotency::sql::sqlx::{self, Connection, Executor};
use idempotency::store::{Claim, ClaimRequest, OperatorStore, Store, Token};
use idempotency::{Error, Idempotency, Key, OnError};

mod common;

use common::{admin, code, json, redis_url, text};

/// `<prefix>-<random>`: a key prefix no other test or run uses.
fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
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
    assert!(text(&wrong).contains(&format!("fence is {fence}, not 1")));
    // The same owner still holds the key: the message must not say another one does.
    assert!(!text(&wrong).contains("another owner"), "{}", text(&wrong));
    let refused = admin(
        &url,
        &[&["release"][..], &by_parts, &["--fence", &fence_text]].concat(),
        "n\n",
    );
    assert_eq!(code(&refused), 1, "{}", text(&refused));
    assert!(text(&refused).contains("not confirmed"));
    assert!(matches!(
        store.read(&key).await.unwrap().unwrap().state,
        idempotency::store::RecordState::InProgress { .. }
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
            &idempotency::store::Completion::new(None, hour)
        )
        .await
        .unwrap());
    // Nothing left behind on the shared server (a live claim is released before it can be
    // deleted).
    assert!(store.release(&key, &next.token).await.unwrap());
    let expect = idempotency::store::Expect::Token(&next.token);
    assert!(store.delete(&key, expect).await.unwrap());
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
    let no_store = std::process::Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
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

/// On Redis: `list --stuck --older-than` finds the claim that has hung for six seconds and
/// not the fresh one; listings page with `--limit` and go on with the printed `--cursor`;
/// `delete` refuses a live claim (exit 1) and deletes a completed record after confirmation,
/// so the key runs again; `purge` deletes a prefix's records but its live claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_keys_on_redis_are_listed_deleted_and_purged() {
    let url = redis_url();
    let store = Arc::new(idempotency::redis::RedisStore::connect(&url).await.unwrap());
    let prefix = unique("admin-cli-list");
    let hour = Duration::from_secs(3600);
    let claim = |part: &str| {
        let store = store.clone();
        let key = Key::new(&prefix, 1, &[&part]).unwrap();
        async move {
            let owner = ClaimRequest::new(key.clone(), Token::generate(), hour, hour);
            let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
                panic!("not acquired");
            };
            (key, owner, fence)
        }
    };
    // Ages are measured when the listing runs, in a process of its own: the fresh claim's age
    // then is that process's start-up (2.7 s on a loaded machine), so the threshold (5 s)
    // leaves it that much room, and the hung claim is a second older than the threshold.
    let (hung, _, hung_fence) = claim("hung").await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (fresh, _, _) = claim("fresh").await;
    let (done, owner, _) = claim("done").await;
    let completion = idempotency::store::Completion::new(Some(b"receipt".to_vec()), hour);
    assert!(store
        .complete(&done, &owner.token, &completion)
        .await
        .unwrap());

    let stuck = admin(
        &url,
        &["list", "--prefix", &prefix, "--stuck", "--older-than", "5s"],
        "",
    );
    assert_eq!(code(&stuck), 0, "{}", text(&stuck));
    let listed = String::from_utf8_lossy(&stuck.stdout).to_string();
    assert!(listed.contains(&hung.to_string()), "{listed}");
    assert!(listed.contains(&hung_fence.to_string()), "{listed}");
    assert!(!listed.contains(&fresh.to_string()), "{listed}");
    assert!(!listed.contains(&done.to_string()), "{listed}");
    let none = json(&admin(
        &url,
        &["--json", "list", "--prefix", &prefix, "--stuck"],
        "",
    ));
    assert_eq!(none["records"].as_array().unwrap().len(), 0, "{none}");

    // Page by page: every key once, whatever the page size.
    let mut seen = std::collections::BTreeSet::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let mut args = vec!["--json", "list", "--prefix", &prefix, "--limit", "1"];
        if let Some(cursor) = &cursor {
            args.extend(["--cursor", cursor.as_str()]);
        }
        let page = json(&admin(&url, &args, ""));
        for record in page["records"].as_array().unwrap() {
            seen.insert(record["key"].as_str().unwrap().to_string());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => break,
        }
    }
    let want: std::collections::BTreeSet<String> = [&hung, &fresh, &done]
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(seen, want);
    let held = json(&admin(
        &url,
        &[
            "--json",
            "list",
            "--prefix",
            &prefix,
            "--state",
            "completed",
        ],
        "",
    ));
    assert_eq!(held["records"][0]["key"], done.to_string());
    assert_eq!(held["records"][0]["record"]["result_bytes"], 7);

    // Delete: a live claim is refused; a completed record is deleted once confirmed.
    let live = admin(&url, &["delete", "--key", &hung.to_string(), "--yes"], "");
    assert_eq!(code(&live), 1, "{}", text(&live));
    assert!(text(&live).contains("release it first"), "{}", text(&live));
    let refused = admin(&url, &["delete", "--key", &done.to_string()], "n\n");
    assert_eq!(code(&refused), 1, "{}", text(&refused));
    assert!(store.read(&done).await.unwrap().is_some());
    let deleted = admin(&url, &["delete", "--key", &done.to_string()], "y\n");
    assert_eq!(code(&deleted), 0, "{}", text(&deleted));
    assert!(text(&deleted).contains("runs the handler again"));
    assert!(store.read(&done).await.unwrap().is_none());
    let again = admin(&url, &["delete", "--key", &done.to_string(), "--yes"], "");
    assert_eq!(code(&again), 1, "{}", text(&again));

    // Purge: the live claims stay.
    let (released, owner, _) = claim("released").await;
    assert!(store.release(&released, &owner.token).await.unwrap());
    let purged = json(&admin(
        &url,
        &["--json", "purge", "--prefix", &prefix, "--yes"],
        "",
    ));
    assert_eq!(purged["deleted"], 1, "{purged}");
    assert_eq!(purged["live_claims_kept"], 2, "{purged}");
    assert!(store.read(&released).await.unwrap().is_none());
    assert!(store.read(&hung).await.unwrap().is_some());

    let bad_prefix = admin(&url, &["purge", "--prefix", "a b", "--yes"], "");
    assert_eq!(code(&bad_prefix), 2, "{}", text(&bad_prefix));
    let bad_age = admin(
        &url,
        &["list", "--prefix", &prefix, "--older-than", "10"],
        "",
    );
    assert_eq!(code(&bad_age), 2, "{}", text(&bad_age));
    let bad_cursor = admin(&url, &["list", "--prefix", &prefix, "--cursor", "x:y"], "");
    assert_eq!(code(&bad_cursor), 2, "{}", text(&bad_cursor));
    let not_sql = admin(&url, &["outbox", "counts"], "");
    assert_eq!(code(&not_sql), 2, "{}", text(&not_sql));

    // Nothing left behind on the shared server.
    for key in [&hung, &fresh] {
        let seen = store.read(key).await.unwrap().unwrap();
        // A live claim is released before it can be deleted.
        store.release(key, &seen.token).await.unwrap();
        let expect = idempotency::store::Expect::Token(&seen.token);
        assert!(store.delete(key, expect).await.unwrap(), "{key}");
    }
}

/// The outbox of a PostgreSQL schema of the test's own: counts, the dead message listed with
/// its error, `retry` (refused without confirmation, then done; a second time nothing
/// changes), `discard`, `purge-published`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_in_postgres_is_operated() {
    use idempotency::outbox::{Message, PostgresOutbox};

    let base = std::env::var("IDEMPOTENT_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = unique("idem_outbox_cli").replace('-', "_");
    let mut conn = sqlx::PgConnection::connect(&base).await.unwrap();
    conn.execute(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&base).await.unwrap();
    let table = format!("{schema}.idempotent_outbox");
    let outbox = PostgresOutbox::with_table(pool.clone(), &table).unwrap();
    outbox.create_table().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for n in 0..3 {
        let message = Message::new(
            "order",
            format!("o-{n}"),
            "placed",
            "orders",
            b"{}".to_vec(),
        );
        ids.push(outbox.enqueue(&mut tx, &message).await.unwrap());
    }
    tx.commit().await.unwrap();
    let (dead, published) = (ids[0].as_str().to_string(), ids[1].as_str().to_string());
    let set = |assignment: &str, id: &str| {
        let sql = format!("UPDATE {table} SET {assignment} WHERE id = $1");
        let pool = pool.clone();
        let id = id.to_string();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .execute(&pool)
                .await
                .unwrap();
        }
    };
    set(
        "state = 'dead', attempts = 8, last_error = 'broker refused'",
        &dead,
    )
    .await;
    set(
        "state = 'published', published_at = statement_timestamp() - INTERVAL '2 hours'",
        &published,
    )
    .await;
    let outbox_cmd = |args: &[&str], stdin: &str| {
        let args: Vec<&str> = [&["--json", "outbox", "--table", table.as_str()][..], args].concat();
        admin(&base, &args, stdin)
    };

    let counts = json(&outbox_cmd(&["counts"], ""));
    assert_eq!(
        (
            counts["pending"].as_u64(),
            counts["published"].as_u64(),
            counts["dead"].as_u64()
        ),
        (Some(1), Some(1), Some(1)),
        "{counts}"
    );
    let listed = json(&outbox_cmd(&["dead"], ""));
    assert_eq!(listed["dead"][0]["id"], dead.as_str(), "{listed}");
    assert_eq!(listed["dead"][0]["last_error"], "broker refused");
    assert_eq!(listed["dead"][0]["attempts"], 8);

    let refused = outbox_cmd(&["retry", "--id", &dead], "n\n");
    assert_eq!(code(&refused), 1, "{}", text(&refused));
    assert_eq!(outbox.counts().await.unwrap().dead, 1);
    let retried = outbox_cmd(&["retry", "--id", &dead, "--yes"], "");
    assert_eq!(code(&retried), 0, "{}", text(&retried));
    let message = outbox.get(&ids[0]).await.unwrap().unwrap();
    assert_eq!(message.attempts, 0);
    assert_eq!(outbox.counts().await.unwrap().pending, 2);
    let twice = outbox_cmd(&["retry", "--id", &dead, "--yes"], "");
    assert_eq!(code(&twice), 1, "{}", text(&twice));

    set("state = 'dead'", &dead).await;
    let discarded = outbox_cmd(&["discard", "--id", &dead, "--yes"], "");
    assert_eq!(code(&discarded), 0, "{}", text(&discarded));
    assert!(outbox.get(&ids[0]).await.unwrap().is_none());

    let young = json(&outbox_cmd(&["purge-published", "--older-than", "3h"], ""));
    assert_eq!(young["deleted"], 0);
    let old = json(&outbox_cmd(
        &["purge-published", "--older-than", "1h", "--batch", "1"],
        "",
    ));
    assert_eq!(old["deleted"], 1);
    let counts = outbox.counts().await.unwrap();
    assert_eq!((counts.pending, counts.published, counts.dead), (1, 0, 0));
    let bad_table = admin(&base, &["outbox", "--table", "no;table", "counts"], "");
    assert_eq!(code(&bad_table), 2, "{}", text(&bad_table));

    // A pending row another producer wrote with headers the relay cannot read: inspected,
    // refused by a plain discard, deleted by `--force`; a published one is not.
    let stuck = ids[2].as_str().to_string();
    set(
        r#"headers = '{"retries": 3}', attempts = 4, last_error = 'the row cannot be read'"#,
        &stuck,
    )
    .await;
    let inspected = json(&outbox_cmd(&["inspect", "--id", &stuck], ""));
    assert_eq!(inspected["state"], "pending", "{inspected}");
    assert_eq!(inspected["attempts"], 4, "{inspected}");
    assert_eq!(inspected["claimed"], false, "{inspected}");
    assert!(
        inspected["unreadable"]
            .as_str()
            .unwrap()
            .contains("headers"),
        "{inspected}"
    );
    let plain = outbox_cmd(&["discard", "--id", &stuck, "--yes"], "");
    assert_eq!(code(&plain), 1, "{}", text(&plain));
    let dead_listed = json(&outbox_cmd(&["dead"], ""));
    assert_eq!(dead_listed["dead"].as_array().unwrap().len(), 0);
    let forced = json(&outbox_cmd(
        &["discard", "--id", &stuck, "--force", "--yes"],
        "",
    ));
    assert_eq!(forced["outcome"], "done", "{forced}");
    assert!(outbox.inspect(&ids[2]).await.unwrap().is_none());
    let missing = outbox_cmd(&["inspect", "--id", &stuck], "");
    assert_eq!(code(&missing), 1, "{}", text(&missing));

    pool.close().await;
    conn.execute(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .await
        .unwrap();
}
