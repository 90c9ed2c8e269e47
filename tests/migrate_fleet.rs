//! A fleet that starts together opens the store every time: four OS processes open the same
//! fresh target at the same moment (a fresh table on MariaDB and PostgreSQL, a fresh file on
//! SQLite), each building the store with its migration and then claiming a key of its own;
//! ten rounds per database, and every one of the forty opens must succeed.
//!
//! The processes are this test binary run again with `IDEMPOTENT_FLEET_URL` set, which turns
//! [`fleet_member`] into one member of the fleet. Members print `FLEET:ready`, wait for a line on
//! their standard input (the start signal, sent to all four once all four are ready), open
//! the store, and print `FLEET:opened` or `FLEET:failed:` and the error's chain.
//!
//! Needs MariaDB at `IDEMPOTENT_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and
//! PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idempotency::sql::{MySqlStore, PostgresStore, SqliteStore};
use idempotency::store::{Claim, ClaimRequest, Store, StoreError, Token};
use idempotency::Key;

use sql_tables::{Scratch, Server};

const MEMBERS: usize = 4;
const ROUNDS: usize = 10;

/// One member of the fleet when `IDEMPOTENT_FLEET_URL` is set; nothing otherwise.
#[test]
fn fleet_member() {
    let Ok(url) = std::env::var("IDEMPOTENT_FLEET_URL") else {
        return;
    };
    let table = std::env::var("IDEMPOTENT_FLEET_TABLE").unwrap();
    let member = std::env::var("IDEMPOTENT_FLEET_MEMBER").unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("FLEET:ready");
    std::io::stdout().flush().unwrap();
    let mut go = String::new();
    std::io::stdin().lock().read_line(&mut go).unwrap();
    let opened = runtime.block_on(async {
        let key = Key::new("fleet", 1, &[&member]).unwrap();
        let request = ClaimRequest::new(
            key,
            Token::generate(),
            Duration::from_secs(60),
            Duration::from_secs(60),
        );
        let claim = if url.starts_with("mysql:") {
            let store = MySqlStore::builder(&url).table(table).build().await?;
            store.claim(&request).await
        } else if url.starts_with("postgres:") {
            let store = PostgresStore::builder(&url).table(table).build().await?;
            store.claim(&request).await
        } else {
            let store = SqliteStore::builder(&url).table(table).build().await?;
            store.claim(&request).await
        };
        match claim? {
            Claim::Acquired { .. } => Ok(()),
            other => Err(StoreError::new(
                idempotency::store::StoreErrorKind::Protocol,
                format!("a fresh key was not acquired: {other:?}"),
            )),
        }
    });
    match opened {
        Ok(()) => println!("FLEET:opened"),
        Err(err) => println!("FLEET:failed: {}", chain(&err)),
    }
}

fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// Starts the members on `url` and `table`, waits until all are ready, starts them at once,
/// and returns what each printed last.
fn round(url: &str, table: &str) -> Vec<String> {
    let mut members: Vec<(Child, BufReader<std::process::ChildStdout>)> = (0..MEMBERS)
        .map(|member| {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "fleet_member", "--nocapture", "--test-threads=1"])
                .env("IDEMPOTENT_FLEET_URL", url)
                .env("IDEMPOTENT_FLEET_TABLE", table)
                .env("IDEMPOTENT_FLEET_MEMBER", member.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            let out = BufReader::new(child.stdout.take().unwrap());
            (child, out)
        })
        .collect();
    for (_, out) in &mut members {
        let mut line = String::new();
        // libtest writes the test's name before it, on the same line.
        while !line.trim_end().ends_with("FLEET:ready") {
            line.clear();
            assert_ne!(
                out.read_line(&mut line).unwrap(),
                0,
                "a member exited early"
            );
        }
    }
    for (child, _) in &mut members {
        child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    }
    members
        .into_iter()
        .map(|(mut child, mut out)| {
            let mut answer = String::new();
            loop {
                let mut line = String::new();
                if out.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                if let Some(at) = line.find("FLEET:") {
                    answer = line[at + "FLEET:".len()..].trim().to_string();
                }
            }
            assert!(child.wait().unwrap().success());
            answer
        })
        .collect()
}

/// Runs [`ROUNDS`] rounds, each on the target `fresh` names, and asserts every open succeeded.
fn fleet(database: &str, mut fresh: impl FnMut() -> (String, String, Box<dyn FnOnce()>)) {
    let mut failures = Vec::new();
    for _ in 0..ROUNDS {
        let (url, table, cleanup) = fresh();
        failures.extend(
            round(&url, &table)
                .into_iter()
                .filter(|answer| answer != "opened"),
        );
        cleanup();
    }
    assert!(
        failures.is_empty(),
        "{database}: {} of {} opens failed: {failures:#?}",
        failures.len(),
        MEMBERS * ROUNDS
    );
}

#[test]
fn a_fleet_opens_a_fresh_mariadb_table_every_time() {
    fleet("MariaDB", || {
        let scratch = Scratch::table(Server::MySql);
        let (url, table) = (scratch.url().to_string(), scratch.name().to_string());
        (url, table, Box::new(move || drop(scratch)))
    });
}

#[test]
fn a_fleet_opens_a_fresh_postgres_table_every_time() {
    fleet("PostgreSQL", || {
        let scratch = Scratch::table(Server::Postgres);
        let (url, table) = (scratch.url().to_string(), scratch.name().to_string());
        (url, table, Box::new(move || drop(scratch)))
    });
}

#[test]
fn a_fleet_opens_a_fresh_sqlite_file_every_time() {
    fleet("SQLite", || {
        let path = std::env::temp_dir().join(format!("{}.db", sql_tables::unique_name()));
        let url = format!("sqlite:{}", path.display());
        let cleanup = move || {
            for suffix in ["", "-wal", "-shm", "-journal"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        };
        (url, "idempotent_records".to_string(), Box::new(cleanup))
    });
}
