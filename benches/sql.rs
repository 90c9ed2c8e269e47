//! The SQL stores against raw sqlx sending the very same statements.
//!
//! For PostgreSQL and MariaDB, side by side in one process: 50 concurrent tasks on a pool of
//! 8 connections run claim + complete cycles on fresh keys, once as raw sqlx (the store's own
//! claim and completion SQL text, bound and checked by hand) and once through the framework
//! (`Idempotency::run` on the store). A warm-up pass of each comes first; then five measured passes
//! of each, alternating, with the table emptied before every pass; the median pass counts.
//! The last lines are `<db>_raw_ops_per_s`, `<db>_framework_ops_per_s` and `<db>_ratio`
//! (framework / raw) for `postgres` and `mysql`.
//!
//! Needs PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and MariaDB at `IDEMPOTENT_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`).
//!
//! Run: `cargo bench --bench sql --features postgres,mysql`

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/support/sql_tables.rs"]
mod sql_tables;
#[path = "support/stats.rs"]
mod stats;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::sql::sqlx::{self, AssertSqlSafe, Row};
use idempotency::sql::{Dialect, SqlStore};
use idempotency::{Error, Idempotency, Key, Token};
use sql_tables::{Scratch, Server};
use stats::{figure, median, per_s};

const TASKS: usize = 50;
const POOL: u32 = 8;
const OPS: usize = 20_000;
const WARMUP_OPS: usize = 4_000;
const ROUNDS: usize = 5;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

/// The store's claim and completion SQL, held as the store holds it.
#[derive(Clone)]
struct Statements {
    claim: Arc<str>,
    complete: Arc<str>,
}

/// One claim + complete cycle on a fresh key, as raw sqlx.
trait Raw: Dialect {
    fn cycle(store: &SqlStore<Self>, sql: &Statements, key: Key)
        -> impl Future<Output = ()> + Send;
    /// Deletes every record, so every pass starts from the same table.
    fn empty(store: &SqlStore<Self>) -> impl Future<Output = ()> + Send;
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

impl Raw for sqlx::Postgres {
    async fn empty(store: &SqlStore<Self>) {
        let sql = format!("DELETE FROM {}", store.table());
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }

    async fn cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
        let token = Token::generate();
        let row = sqlx::query(AssertSqlSafe(sql.claim.clone()))
            .bind(key.as_bytes())
            .bind(key.prefix())
            .bind(&token.as_bytes()[..])
            .bind(micros(LEASE))
            .bind(None::<&[u8]>)
            .bind(micros(TTL))
            .fetch_optional(store.pool())
            .await
            .unwrap()
            .unwrap();
        let owner: Vec<u8> = row.try_get(1).unwrap();
        assert_eq!(owner, token.as_bytes(), "not acquired");
        let done = sqlx::query(AssertSqlSafe(sql.complete.clone()))
            .bind(None::<&[u8]>)
            .bind(micros(TTL))
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "not completed");
    }
}

impl Raw for sqlx::MySql {
    async fn empty(store: &SqlStore<Self>) {
        let sql = format!("DELETE FROM {}", store.table());
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }

    async fn cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
        let token = Token::generate();
        let claimed = sqlx::query(AssertSqlSafe(sql.claim.clone()))
            .bind(key.as_bytes())
            .bind(key.prefix())
            .bind(&token.as_bytes()[..])
            .bind(micros(LEASE))
            .bind(None::<&[u8]>)
            .bind(micros(TTL))
            .execute(store.pool())
            .await
            .unwrap();
        // The claim leaves the new fence in LAST_INSERT_ID(), 0 when the key was not free.
        assert_ne!(claimed.last_insert_id(), 0, "not acquired");
        let done = sqlx::query(AssertSqlSafe(sql.complete.clone()))
            .bind(None::<&[u8]>)
            .bind(micros(TTL))
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "not completed");
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Raw,
    Framework,
}

/// Runs `ops` cycles with `TASKS` tasks; returns operations per second.
async fn pass<DB: Raw>(store: &SqlStore<DB>, mode: Mode, ops: usize, run: usize) -> f64 {
    DB::empty(store).await;
    let guard = Idempotency::new(TTL)
        .lease(LEASE)
        .store(Arc::new(store.clone()));
    let sql = Statements {
        claim: store.statements().claim().into(),
        complete: store.statements().complete().into(),
    };
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, guard, next, sql) =
                (store.clone(), guard.clone(), next.clone(), sql.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ops {
                        return;
                    }
                    let key = Key::new("bench:sql", 1, &[&run, &i]).unwrap();
                    match mode {
                        Mode::Raw => DB::cycle(&store, &sql, key).await,
                        Mode::Framework => {
                            let out: Result<(), Error> = guard.run(key, async { Ok(()) }).await;
                            out.unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    per_s(ops, started.elapsed())
}

/// Warm-up, then alternating measured passes; returns (raw, framework) ops/s.
async fn measure<DB: Raw>(name: &str, server: Server) -> (f64, f64) {
    let table = Scratch::table(server);
    let store = SqlStore::<DB>::builder(table.url())
        .table(table.name().to_string())
        .max_connections(POOL)
        .build()
        .await
        .unwrap();
    let mut run = 0;
    let mut next_run = || {
        run += 1;
        run
    };
    pass(&store, Mode::Raw, WARMUP_OPS, next_run()).await;
    pass(&store, Mode::Framework, WARMUP_OPS, next_run()).await;
    let (mut raw, mut framework) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        let r = pass(&store, Mode::Raw, OPS, next_run()).await;
        let f = pass(&store, Mode::Framework, OPS, next_run()).await;
        println!("{name} round {round}: raw {r:.0} ops/s, framework {f:.0} ops/s");
        raw.push(r);
        framework.push(f);
    }
    store.pool().close().await;
    (median(&raw), median(&framework))
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        println!(
            "claim + complete on fresh keys: {TASKS} tasks, pool of {POOL}, {OPS} ops per pass"
        );
        let postgres = measure::<sqlx::Postgres>("postgres", Server::Postgres).await;
        let mysql = measure::<sqlx::MySql>("mysql", Server::MySql).await;
        for (name, (raw, framework)) in [("postgres", postgres), ("mysql", mysql)] {
            figure(&format!("{name}_raw_ops_per_s"), raw, 0);
            figure(&format!("{name}_framework_ops_per_s"), framework, 0);
            figure(&format!("{name}_ratio"), framework / raw, 3);
        }
    });
}
