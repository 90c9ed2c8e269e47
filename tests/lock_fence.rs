//! The fenced lease lock (`idempotency::lock::Lock`) across real processes. A holder is this test
//! binary re-run as a child process that takes the lock on the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`); the test then SIGSTOPs it past
//! its lease, or SIGKILLs it, and takes the lock over. The resource the lock protects is a row
//! of a PostgreSQL table (`IDEMPOTENT_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`) whose update refuses a fence that is not higher
//! than the last one it accepted: a paused holder's late write is refused, and a crashed
//! holder's lock is taken after its lease with a higher fence.
//!
//! Needs Redis and PostgreSQL; fails (never skips) without them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idempotency::lock::Lock;
use idempotency::sql::sqlx::{self, AssertSqlSafe, Connection, PgConnection};
use idempotency::store::Token;
use idempotency::Key;
use redis_server::{connect, delete_matching, redis_url};
use sql_tables::{Scratch, Server};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The lease of every holder, child and parent.
const LEASE: Duration = Duration::from_millis(1500);
/// The child test every holder process runs.
const CHILD_TEST: &str = "lock_holder_child";
/// The lock keys' namespace (every key of a test starts with it and `:`).
const NAMESPACE_VAR: &str = "LOCK_FENCE_NAMESPACE";
/// The protected table, and the PostgreSQL URL it is on.
const TABLE_VAR: &str = "LOCK_FENCE_TABLE";
const POSTGRES_VAR: &str = "LOCK_FENCE_POSTGRES_URL";
/// What the child prints: its fence once it holds the lock; after the parent's line, whether
/// it saw its lease lost, how many rows its fenced write changed, and what `unlock` said.
const FENCE: &str = "fence=";
const LOST: &str = "lost=";
const ROWS: &str = "rows=";
const RELEASED: &str = "released=";

/// The one lock key of a test.
fn lock_key(namespace: &str) -> Key {
    Key::new(&format!("{namespace}:balance"), 1, &[&"account-1"]).unwrap()
}

/// A namespace no other test or run uses.
fn unique_namespace() -> String {
    let token = format!("{:?}", Token::generate());
    format!("lockfence:{}", &token[6..token.len() - 1])
}

/// Deletes the namespace's Redis keys when dropped, whatever ended the test.
struct RedisKeys(String);

impl Drop for RedisKeys {
    fn drop(&mut self) {
        let pattern = format!("{}:*", self.0);
        // A plain thread: the runtime may be shutting down.
        let _ = std::thread::spawn(move || delete_matching(&redis_url(), &pattern)).join();
    }
}

/// The fenced write on the protected row: `fence` must be higher than the row's.
fn fenced_update(table: &str) -> String {
    format!("UPDATE {table} SET balance = balance - 10, fence = $1 WHERE id = 1 AND fence < $1")
}

/// The Redis server's clock (`TIME`), in milliseconds since the Unix epoch.
fn redis_now_ms() -> u64 {
    let client = redis::Client::open(redis_url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    secs * 1000 + micros / 1000
}

/// A holder process: this test binary re-run as [`lock_holder_child`], its stdout lines
/// coming through `lines`. SIGKILLed on drop (a stopped one too).
struct Holder {
    child: Child,
    /// Kept open: the child exits when it closes (this process died first).
    stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
}

impl Holder {
    fn spawn(env: &[(&str, &str)]) -> Holder {
        let exe = std::env::current_exe().expect("no path to the test binary");
        let mut command = Command::new(exe);
        command
            .args([
                CHILD_TEST,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .expect("cannot re-run the test binary as a lock holder");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Holder {
            child,
            stdin,
            lines,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits (30 s at most) until the child prints `marker`; returns the rest of its line.
    async fn wait_for(&mut self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("the child did not print {marker:?} within 30 s"))
                .unwrap_or_else(|| panic!("the child exited before printing {marker:?}"));
            // libtest may have printed the test's name on the same line.
            if let Some((_, rest)) = line.split_once(marker) {
                return rest.trim().to_owned();
            }
        }
    }

    /// Sends `signal` (`STOP`, `CONT`) with `kill`.
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.pid().to_string()])
            .status()
            .expect("cannot run kill");
        assert!(status.success(), "kill -{signal} {} failed", self.pid());
    }

    /// Waits (5 s at most) until every thread of the child is stopped (`T` in `/proc`).
    fn wait_stopped(&self) {
        let pid = self.pid();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
            let all_stopped = tasks.into_iter().all(|task| {
                let stat =
                    std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap_or_default();
                // The state follows the command name, which is in parentheses.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
                    == Some('T')
            });
            if all_stopped {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the child {pid} did not stop within 5 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends the line the child waits for before its late write.
    fn go(&mut self) {
        self.stdin.write_all(b"go\n").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Waits (30 s at most) until the child closed its stdout, then for its exit.
    async fn exited(&mut self) -> ExitStatus {
        tokio::time::timeout(Duration::from_secs(30), async {
            while self.lines.recv().await.is_some() {}
        })
        .await
        .expect("the child did not exit within 30 s");
        self.child.wait().unwrap()
    }

    /// SIGKILL; returns how the process ended.
    fn kill(&mut self) -> ExitStatus {
        let _ = self.child.kill();
        self.child.wait().unwrap()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // SIGKILL ends a stopped process too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The protected row: `(id 1, balance 100, fence 0)` in a fresh table.
async fn protected_row(scratch: &Scratch) -> PgConnection {
    let mut conn = PgConnection::connect(scratch.url()).await.unwrap();
    let create = format!(
        "CREATE TABLE {} (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, fence BIGINT NOT NULL)",
        scratch.name()
    );
    sqlx::query(AssertSqlSafe(create))
        .execute(&mut conn)
        .await
        .unwrap();
    let insert = format!(
        "INSERT INTO {} (id, balance, fence) VALUES (1, 100, 0)",
        scratch.name()
    );
    sqlx::query(AssertSqlSafe(insert))
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// A holder SIGSTOPped while it holds the lock loses it when its lease runs out: the parent
/// takes the lock then (not before) with a higher fence and writes; the holder, continued,
/// sees its lease lost, and its write with the old fence changes no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holders_late_write_is_refused_by_the_fence() {
    let namespace = unique_namespace();
    let _keys = RedisKeys(namespace.clone());
    let scratch = Scratch::table(Server::Postgres);
    let mut conn = protected_row(&scratch).await;
    let locks =
        Lock::new(Arc::new(connect(&redis_url()).await), LEASE).wait(Duration::from_secs(10));

    let mut holder = Holder::spawn(&[
        (NAMESPACE_VAR, &namespace),
        (TABLE_VAR, scratch.name()),
        (POSTGRES_VAR, scratch.url()),
    ]);
    let f1: u64 = holder.wait_for(FENCE).await.parse().unwrap();
    holder.signal("STOP");
    holder.wait_stopped();

    // The stopped holder's lease is live: the key is held.
    assert!(
        locks
            .try_lock(lock_key(&namespace))
            .await
            .unwrap()
            .is_none(),
        "the lock was free while the stopped holder's lease was live"
    );
    let guard = locks.lock(lock_key(&namespace)).await.unwrap();
    let f2 = guard.fence();
    // Taken only once the holder's lease ran out, by the store's clock: a fresh key's first
    // fence is the store's clock in microseconds, and the lease ends `LEASE` after it.
    let now_ms = redis_now_ms();
    assert!(
        now_ms >= f1 / 1000 + LEASE.as_millis() as u64,
        "the lock was taken at {now_ms} ms, before the stopped holder's lease (from {f1} us) ran out"
    );
    assert!(f2 > f1, "the new holder's fence {f2} is not above {f1}");

    let rows = sqlx::query(AssertSqlSafe(fenced_update(scratch.name())))
        .bind(i64::try_from(f2).unwrap())
        .execute(&mut conn)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(rows, 1, "the new holder's fenced write was refused");

    holder.signal("CONT");
    holder.go();
    assert_eq!(
        holder.wait_for(LOST).await,
        "true",
        "the continued holder did not see its lease lost"
    );
    assert_eq!(
        holder.wait_for(ROWS).await,
        "0",
        "the paused holder's late write with fence {f1} was accepted after fence {f2}"
    );
    assert_eq!(
        holder.wait_for(RELEASED).await,
        "false",
        "the paused holder's unlock released a lock it no longer held"
    );
    let status = holder.exited().await;
    assert!(status.success(), "the holder process failed: {status:?}");

    assert!(!guard.is_lost(), "the new holder lost its lease");
    assert!(
        guard.unlock().await.unwrap(),
        "the new holder no longer held the lock at its unlock"
    );
    let row: (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT balance, fence FROM {} WHERE id = 1",
        scratch.name()
    )))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        row,
        (90, i64::try_from(f2).unwrap()),
        "the row is not the new holder's single write"
    );
    conn.close().await.unwrap();
}

/// A holder SIGKILLed while it holds the lock keeps it until its lease runs out; then
/// `lock()` takes it over with the next fence: the holder died within its first lease, and a
/// lock's record lives twice the lease from its claim, so the takeover finds the holder's
/// record and gives its fence + 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_holders_lock_is_taken_after_its_lease_with_the_next_fence() {
    let namespace = unique_namespace();
    let _keys = RedisKeys(namespace.clone());
    let locks =
        Lock::new(Arc::new(connect(&redis_url()).await), LEASE).wait(Duration::from_secs(10));

    let mut holder = Holder::spawn(&[(NAMESPACE_VAR, &namespace)]);
    let f1: u64 = holder.wait_for(FENCE).await.parse().unwrap();
    let status = holder.kill();
    assert_eq!(
        status.signal(),
        Some(9),
        "the holder was not SIGKILLed: {status:?}"
    );

    assert!(
        locks
            .try_lock(lock_key(&namespace))
            .await
            .unwrap()
            .is_none(),
        "the crashed holder's lock was free before its lease ran out"
    );
    let guard = locks.lock(lock_key(&namespace)).await.unwrap();
    let now_ms = redis_now_ms();
    assert!(
        now_ms >= f1 / 1000 + LEASE.as_millis() as u64,
        "the lock was taken at {now_ms} ms, before the crashed holder's lease (from {f1} us) ran out"
    );
    assert_eq!(guard.fence(), f1 + 1, "not the next fence after {f1}");
    assert!(guard.unlock().await.unwrap());
}

/// A lock holder: takes the lock in [`NAMESPACE_VAR`], prints its fence, and waits for a line
/// on stdin; then waits (5 s at most) for its lease to be lost, prints whether it was, writes
/// the protected row with its fence, prints how many rows changed, unlocks and prints what
/// `unlock` said. Does nothing when run without the parent's environment.
#[test]
#[ignore = "a child process of the tests in this file"]
fn lock_holder_child() {
    let Ok(namespace) = std::env::var(NAMESPACE_VAR) else {
        return;
    };
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut line = String::new();
        if stdin.read_line(&mut line).is_ok_and(|n| n > 0) {
            let _ = go_tx.send(());
            // Gone with the parent, whatever ended it: the parent's end of stdin closes.
            let _ = std::io::copy(&mut stdin, &mut std::io::sink());
        }
        std::process::exit(1);
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let locks = Lock::new(Arc::new(connect(&redis_url()).await), LEASE);
        let guard = locks.lock(lock_key(&namespace)).await.unwrap();
        println!("{FENCE}{}", guard.fence());
        go_rx.await.unwrap();

        let _ = tokio::time::timeout(Duration::from_secs(5), guard.lost()).await;
        println!("{LOST}{}", guard.is_lost());
        // The late write: as a holder paused between its last check and its write would.
        let table = std::env::var(TABLE_VAR).unwrap();
        let mut conn = PgConnection::connect(&std::env::var(POSTGRES_VAR).unwrap())
            .await
            .unwrap();
        let rows = sqlx::query(AssertSqlSafe(fenced_update(&table)))
            .bind(i64::try_from(guard.fence()).unwrap())
            .execute(&mut conn)
            .await
            .unwrap()
            .rows_affected();
        println!("{ROWS}{rows}");
        println!("{RELEASED}{}", guard.unlock().await.unwrap());
        conn.close().await.unwrap();
    });
}
