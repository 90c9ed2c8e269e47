//! The SQL stores against the seed's idempotency-table design written by hand, and against
//! raw sqlx sending the store's very own statements.
//!
//! For PostgreSQL and MariaDB, in one process, 50 concurrent tasks share one pool of 8
//! connections and run claim + complete cycles on fresh keys. Every side uses the same key
//! bytes (`Key::new("bench:sql", 1, &[&pass, &i])`, encoded as the framework encodes keys),
//! the same 16-byte tokens (`Token::generate()`), the same pool and the same task count:
//!
//! - **seed**: the seed's idempotency-table design, what a user writes by hand without the
//!   library. A table of its own, created with plain SQL: PostgreSQL `(key BYTEA PRIMARY KEY,
//!   token BYTEA NOT NULL, state TEXT NOT NULL, result BYTEA, created_at TIMESTAMPTZ NOT NULL
//!   DEFAULT now())`, MariaDB the same with `VARBINARY(512)`, `BINARY(16)`, `VARCHAR(16)`,
//!   `BLOB`, `DATETIME(6)` on InnoDB (the column is written `` `key` `` there: `KEY` is a
//!   reserved word). Claim: `INSERT INTO t (key, token, state) VALUES ($1, $2,
//!   'in_progress') ON CONFLICT DO NOTHING` (MariaDB: `INSERT IGNORE INTO ...`), one row
//!   affected meaning acquired. Complete: `UPDATE t SET state = 'completed', result = $1 WHERE
//!   key = $2 AND token = $3`, which must affect one row. No lease, expiry, fence, takeover
//!   of a crashed owner or payload check: the baseline the framework is held to.
//! - **raw**: raw sqlx sending the store's own claim and completion SQL text to the store's
//!   table, bound and checked by hand: the framework without its client-side work. The
//!   claim is the insert-only statement the store sends first on PostgreSQL and MariaDB
//!   (`Statements::claim_fresh`), which acquires every fresh key alone.
//! - **framework**: `Idempotency::run` on the `SqlStore`, with a body that returns `Ok(())`.
//!
//! A warm-up pass of each side (1,500 cycles) comes first; then 6 rounds of one pass of each
//! side (6,000 cycles each), the order rotating round by round (seed, raw, framework; raw,
//! framework, seed; framework, seed, raw; ...) so that each side goes first, second and third
//! equally often. The tables a pass writes are emptied (`TRUNCATE`) before it; the median pass
//! of each side counts (the upper middle of 6). A summary line before the figures also gives
//! the median of the per-round ratios, which the machine's noise moves less than the ratio of
//! medians.
//!
//! On PostgreSQL alone, a second pair of passes shows that inside the caller's transaction the
//! claim, the business write and the completion cost one commit, by hand as through
//! `SqlStore::run_in_tx`. Each operation inserts one row into a business table
//! (`INSERT INTO <business> (id) VALUES ($1)`):
//!
//! - **seed_tx**: by hand, one transaction per operation: `BEGIN`, the seed claim, the
//!   business insert, the seed completion, `COMMIT`.
//! - **framework_tx**: `store.run_in_tx(&mut tx, key, ttl, async |conn| { <business insert on
//!   conn> })` on a transaction from the store's pool, then `tx.commit()`: the same five
//!   round trips (`BEGIN`, the store's claim, the insert, the store's completion, `COMMIT`).
//!
//! A warm-up pass of each, then 6 rounds, the two taking turns going first; medians as above.
//!
//! The last lines are the figures, one `name=value` per line, for `postgres` and `mysql`:
//!
//! - `<db>_seed_design_ops_per_s`, `<db>_framework_ops_per_s`: median cycles per second;
//!   `<db>_ratio_vs_seed_design`, framework over seed. Target: at least 0.9 on both databases
//!   at 50 tasks on a pool of 8.
//! - `<db>_raw_ops_per_s`: median cycles per second of the raw side; `<db>_ratio`, framework
//!   over raw: what the framework's client side costs.
//! - `postgres_tx_seed_ops_per_s`, `postgres_tx_framework_ops_per_s`: median transactions per
//!   second; `postgres_tx_ratio`, framework over seed. Both commit once per operation, so the
//!   ratio shows the cost of the store's statements inside one transaction.
//! - `<db>_combined_seed_ops_per_s`, `<db>_combined_framework_ops_per_s`,
//!   `<db>_combined_ratio_vs_seed_design`: the seed design against the framework on the same
//!   store behind a `CombiningStore` with at most 8 batches on their way (concurrent claims
//!   and completions sent as `claim_many` / `complete_many` batches), 6 more rounds of the
//!   two taking turns, on both databases. Every statement commits durably.
//! - `<db>_<side>_allocations` (`seed`, `raw`, `framework`): this process's allocations per
//!   cycle, median pass.
//! - with valgrind installed, `<db>_seed_instructions`, `<db>_framework_instructions` and
//!   `<db>_instructions_ratio` (seed's count over the framework's: read as the throughput
//!   ratio is, the higher the better): this process's instructions per cycle under callgrind
//!   (see `support/instructions.rs`), a figure the machine's load does not move and that
//!   leaves out the server's work. `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it.
//! - `<db>_server_us_per_cycle_seed_design`, `<db>_server_us_per_cycle_framework`,
//!   `<db>_server_us_per_cycle_combined`: the database server's CPU time (from
//!   `/proc/<pid>/task/*/schedstat`, of every process named `postgres`, or `mariadbd` /
//!   `mysqld`) per cycle, the median of the measured passes of the seed design (rounds and
//!   combined rounds together), of the framework and of the framework behind a
//!   `CombiningStore`. It moves less with the machine's noise than cycles per second do;
//!   NaN when the server does not run on this machine.
//! - `postgres_async_claims_seed_ops_per_s`, `postgres_async_claims_framework_ops_per_s`,
//!   `postgres_async_claims_ratio_vs_seed_design`: the seed design against the framework on a
//!   store with `asynchronous_claims(true)` (claims commit without waiting for the WAL flush;
//!   completions stay durable), 6 more rounds of the two taking turns. The seed design's
//!   statements commit durably.
//!
//! Needs PostgreSQL at `IDEMPOTENT_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and MariaDB at `IDEMPOTENT_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`). Every table the run creates has a unique scratch name
//! and is dropped at the end (a killed run's tables are dropped by a later run once they are
//! an hour old).
//!
//! Run: `cargo bench --bench sql --features postgres,mysql` (2 to 3 minutes on a shared
//! 2-core machine).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
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
use idempotency::store::{CombiningStore, Token};
use idempotency::{Error, Idempotency, Key};
use sql_tables::{Scratch, Server};
use stats::{figure, median, per_s, processes_cpu};

const TASKS: usize = 50;
const POOL: u32 = 8;
/// Cycles per measured pass.
const OPS: usize = 6_000;
const WARMUP_OPS: usize = 1_500;
/// Measured rounds: a multiple of 3 and of 2, so that each side takes each place in the
/// order equally often, in the three-side rounds as in the two-side transaction rounds.
const ROUNDS: usize = 6;
/// Cycles a side runs under callgrind (and twice as many in the second count).
const INSTRUCTION_OPS: usize = 1_000;
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);

/// The SQL text every side sends, held as the store holds its own.
struct Statements {
    /// The store's claim of a fresh key: the insert-only claim where the store sends one
    /// first (MariaDB), else its claim.
    claim: Arc<str>,
    /// The store's completion.
    complete: Arc<str>,
    /// The seed design's claim.
    seed_claim: Arc<str>,
    /// The seed design's completion.
    seed_complete: Arc<str>,
}

/// What a database's sides send, by hand.
trait Db: Dialect {
    /// The seed design's table.
    fn seed_schema(table: &str) -> String;
    /// The seed design's claim: one row affected when it acquired the key.
    fn seed_claim(table: &str) -> String;
    /// The seed design's completion: one row affected when the token still owns the key.
    fn seed_complete(table: &str) -> String;
    /// Runs one statement on the store's pool.
    fn run_sql(store: &SqlStore<Self>, sql: String) -> impl Future<Output = ()> + Send;
    /// One claim + complete cycle on a fresh key with the store's own statements.
    fn raw_cycle(
        store: &SqlStore<Self>,
        sql: &Statements,
        key: Key,
    ) -> impl Future<Output = ()> + Send;
    /// One claim + complete cycle on a fresh key with the seed design's statements.
    fn seed_cycle(
        store: &SqlStore<Self>,
        sql: &Statements,
        key: Key,
    ) -> impl Future<Output = ()> + Send;
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

impl Db for sqlx::Postgres {
    fn seed_schema(table: &str) -> String {
        format!(
            "CREATE TABLE {table} (key BYTEA PRIMARY KEY, token BYTEA NOT NULL, \
             state TEXT NOT NULL, result BYTEA, created_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
    }

    fn seed_claim(table: &str) -> String {
        format!(
            "INSERT INTO {table} (key, token, state) VALUES ($1, $2, 'in_progress') \
             ON CONFLICT DO NOTHING"
        )
    }

    fn seed_complete(table: &str) -> String {
        format!("UPDATE {table} SET state = 'completed', result = $1 WHERE key = $2 AND token = $3")
    }

    async fn run_sql(store: &SqlStore<Self>, sql: String) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }

    async fn raw_cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
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

    async fn seed_cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
        let token = Token::generate();
        let claimed = sqlx::query(AssertSqlSafe(sql.seed_claim.clone()))
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(claimed.rows_affected(), 1, "seed claim not acquired");
        let done = sqlx::query(AssertSqlSafe(sql.seed_complete.clone()))
            .bind(None::<&[u8]>)
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "seed completion refused");
    }
}

impl Db for sqlx::MySql {
    fn seed_schema(table: &str) -> String {
        format!(
            "CREATE TABLE {table} (`key` VARBINARY(512) PRIMARY KEY, token BINARY(16) NOT NULL, \
             state VARCHAR(16) NOT NULL, result BLOB, \
             created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB"
        )
    }

    fn seed_claim(table: &str) -> String {
        format!("INSERT IGNORE INTO {table} (`key`, token, state) VALUES (?, ?, 'in_progress')")
    }

    fn seed_complete(table: &str) -> String {
        format!("UPDATE {table} SET state = 'completed', result = ? WHERE `key` = ? AND token = ?")
    }

    async fn run_sql(store: &SqlStore<Self>, sql: String) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .unwrap();
    }

    async fn raw_cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
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
        // The claim leaves the new fence in LAST_INSERT_ID(), 0 when it did not take the key.
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

    async fn seed_cycle(store: &SqlStore<Self>, sql: &Statements, key: Key) {
        let token = Token::generate();
        let claimed = sqlx::query(AssertSqlSafe(sql.seed_claim.clone()))
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(claimed.rows_affected(), 1, "seed claim not acquired");
        let done = sqlx::query(AssertSqlSafe(sql.seed_complete.clone()))
            .bind(None::<&[u8]>)
            .bind(key.as_bytes())
            .bind(&token.as_bytes()[..])
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1, "seed completion refused");
    }
}

/// The error of the `run_in_tx` body: the framework's or the business write's.
#[derive(Debug, thiserror::Error)]
enum TxError {
    #[error(transparent)]
    Idempotency(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The business table of the PostgreSQL transaction passes.
struct Business {
    table: String,
    /// `INSERT INTO <table> (id) VALUES ($1)`.
    insert: Arc<str>,
}

/// One seed_tx operation: the seed claim, the business insert and the seed completion in one
/// transaction of their own.
async fn seed_tx_cycle(bench: &Bench<sqlx::Postgres>, key: Key, id: i64) {
    let (store, sql) = (&bench.store, &bench.sql);
    let token = Token::generate();
    let mut tx = store.pool().begin().await.unwrap();
    let claimed = sqlx::query(AssertSqlSafe(sql.seed_claim.clone()))
        .bind(key.as_bytes())
        .bind(&token.as_bytes()[..])
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(claimed.rows_affected(), 1, "seed claim not acquired");
    sqlx::query(AssertSqlSafe(bench.business().insert.clone()))
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let done = sqlx::query(AssertSqlSafe(sql.seed_complete.clone()))
        .bind(None::<&[u8]>)
        .bind(key.as_bytes())
        .bind(&token.as_bytes()[..])
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), 1, "seed completion refused");
    tx.commit().await.unwrap();
}

/// One framework_tx operation: `run_in_tx` with the business insert as its body, then the
/// commit.
async fn framework_tx_cycle(bench: &Bench<sqlx::Postgres>, key: Key, id: i64) {
    let (store, insert) = (&bench.store, &bench.business().insert);
    let mut tx = store.pool().begin().await.unwrap();
    store
        .run_in_tx(&mut tx, key, TTL, async |conn| {
            sqlx::query(AssertSqlSafe(insert.clone()))
                .bind(id)
                .execute(&mut *conn)
                .await?;
            Ok::<_, TxError>(())
        })
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// The sides of the claim + complete rounds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Seed,
    Raw,
    Framework,
}

/// The order of the first round; later rounds rotate it.
const SIDES: [Side; 3] = [Side::Seed, Side::Raw, Side::Framework];

/// The sides of the PostgreSQL transaction rounds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TxSide {
    Seed,
    Framework,
}

const TX_SIDES: [TxSide; 2] = [TxSide::Seed, TxSide::Framework];

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Seed => "seed",
            Side::Raw => "raw",
            Side::Framework => "framework",
        }
    }
}

impl TxSide {
    fn name(self) -> &'static str {
        match self {
            TxSide::Seed => "seed_tx",
            TxSide::Framework => "framework_tx",
        }
    }
}

/// `sides` rotated left by `turn`: turn by turn, each side takes each place.
fn rotation<S: Copy, const N: usize>(sides: [S; N], turn: usize) -> [S; N] {
    std::array::from_fn(|i| sides[(i + turn) % N])
}

/// The database server's CPU time, read from `/proc` when the server runs on this machine:
/// the time of every thread of every process named as the server's (`postgres`, `mariadbd`
/// or `mysqld`; [`processes_cpu`]), whose connections the pool keeps open across passes. A
/// pass's figure is the time the server spent during it over its cycles; warm-up passes are
/// not recorded.
struct ServerCpu {
    names: &'static [&'static str],
    /// Microseconds per cycle of each measured pass, by side.
    passes: std::sync::Mutex<std::collections::HashMap<&'static str, Vec<f64>>>,
}

impl ServerCpu {
    fn new(server: Server) -> ServerCpu {
        let names: &'static [&'static str] = match server {
            Server::Postgres => &["postgres"],
            Server::MySql => &["mariadbd", "mysqld"],
        };
        ServerCpu {
            names,
            passes: Default::default(),
        }
    }

    /// The server's processes' CPU seconds so far (0 where `/proc` shows none).
    fn seconds(&self) -> f64 {
        processes_cpu(self.names)
    }

    /// Records a measured pass of `side` of `ops` cycles that started at `before` seconds.
    fn record(&self, side: &'static str, before: f64, ops: usize) {
        let spent = self.seconds() - before;
        if ops != OPS || spent <= 0.0 {
            return;
        }
        self.passes
            .lock()
            .unwrap()
            .entry(side)
            .or_default()
            .push(spent * 1e6 / ops as f64);
    }

    /// The median microseconds per cycle of `side`'s measured passes, NaN where the server's
    /// CPU time could not be read.
    fn per_cycle(&self, side: &str) -> f64 {
        self.passes
            .lock()
            .unwrap()
            .get(side)
            .map_or(f64::NAN, |passes| median(passes))
    }
}

/// What every pass of one database shares.
struct Bench<DB: Db> {
    store: SqlStore<DB>,
    guard: Idempotency,
    sql: Statements,
    seed_table: String,
    /// On PostgreSQL, for the transaction passes.
    business: Option<Business>,
    /// On PostgreSQL, the framework on a store of the same table whose claims commit
    /// asynchronously (`SqlStoreBuilder::asynchronous_claims`).
    async_guard: Option<Idempotency>,
    /// The framework on the same store behind a `CombiningStore` (at most `POOL` batches on
    /// their way).
    combined_guard: Idempotency,
    /// The server's CPU time per cycle of each measured pass, by side.
    server_cpu: ServerCpu,
    /// This process's allocations per cycle of each measured pass, by side.
    allocations: std::sync::Mutex<std::collections::HashMap<&'static str, Vec<f64>>>,
    /// The store's, the seed design's and the business tables, dropped with the bench.
    _tables: Vec<Scratch>,
}

impl<DB: Db> Bench<DB> {
    /// The store on a fresh table and the seed design's table; with `business`, also the
    /// business table of the transaction passes (its insert is written for PostgreSQL).
    async fn open(server: Server, business: bool) -> Arc<Bench<DB>> {
        let mut tables = vec![Scratch::table(server), Scratch::table(server)];
        let store = SqlStore::<DB>::builder(tables[0].url())
            .table(tables[0].name().to_string())
            .max_connections(POOL)
            .build()
            .await
            .unwrap();
        let seed_table = tables[1].name().to_string();
        DB::run_sql(&store, DB::seed_schema(&seed_table)).await;
        let business = if business {
            let scratch = Scratch::table(server);
            let table = scratch.name().to_string();
            tables.push(scratch);
            DB::run_sql(
                &store,
                format!("CREATE TABLE {table} (id BIGINT PRIMARY KEY)"),
            )
            .await;
            Some(Business {
                insert: format!("INSERT INTO {table} (id) VALUES ($1)").into(),
                table,
            })
        } else {
            None
        };
        let guard = Idempotency::new(TTL)
            .lease(LEASE)
            .store(Arc::new(store.clone()));
        let async_guard = if business.is_some() {
            let store = SqlStore::<DB>::builder(tables[0].url())
                .table(tables[0].name().to_string())
                .max_connections(POOL)
                .asynchronous_claims(true)
                .build()
                .await
                .unwrap();
            Some(Idempotency::new(TTL).lease(LEASE).store(Arc::new(store)))
        } else {
            None
        };
        let combined_guard =
            Idempotency::new(TTL)
                .lease(LEASE)
                .store(Arc::new(CombiningStore::new(
                    Arc::new(store.clone()),
                    POOL as usize,
                )));
        let sql = Statements {
            claim: store
                .statements()
                .claim_fresh()
                .unwrap_or(store.statements().claim())
                .into(),
            complete: store.statements().complete().into(),
            seed_claim: DB::seed_claim(&seed_table).into(),
            seed_complete: DB::seed_complete(&seed_table).into(),
        };
        Arc::new(Bench {
            store,
            guard,
            sql,
            seed_table,
            business,
            async_guard,
            combined_guard,
            server_cpu: ServerCpu::new(server),
            allocations: Default::default(),
            _tables: tables,
        })
    }

    /// Empties `table` with `TRUNCATE`, so every pass starts from a fresh table: the store's
    /// table, which more passes write, carries no more dead rows than the seed design's.
    async fn empty(&self, table: &str) {
        DB::run_sql(&self.store, format!("TRUNCATE TABLE {table}")).await;
    }

    /// One pass of `side`: `ops` cycles with `TASKS` tasks; returns operations per second.
    async fn pass(self: &Arc<Self>, side: Side, ops: usize, run: usize) -> f64 {
        let table = match side {
            Side::Seed => self.seed_table.clone(),
            Side::Raw | Side::Framework => self.store.table().to_string(),
        };
        self.empty(&table).await;
        let before = self.server_cpu.seconds();
        let allocated = allocations::so_far();
        let rate = match side {
            Side::Seed => {
                drive(self, ops, run, |b, key, _| async move {
                    DB::seed_cycle(&b.store, &b.sql, key).await;
                })
                .await
            }
            Side::Raw => {
                drive(self, ops, run, |b, key, _| async move {
                    DB::raw_cycle(&b.store, &b.sql, key).await;
                })
                .await
            }
            Side::Framework => {
                drive(self, ops, run, |b, key, _| async move {
                    let out: Result<(), Error> = b.guard.run(key, async { Ok(()) }).await;
                    out.unwrap();
                })
                .await
            }
        };
        self.server_cpu.record(side.name(), before, ops);
        if ops == OPS {
            let per_cycle = (allocations::so_far() - allocated) as f64 / ops as f64;
            let mut all = self.allocations.lock().unwrap();
            all.entry(side.name()).or_default().push(per_cycle);
        }
        rate
    }

    /// The median allocations per cycle of the measured passes of `side`.
    fn allocations_per_cycle(&self, side: Side) -> f64 {
        self.allocations
            .lock()
            .unwrap()
            .get(side.name())
            .map_or(f64::NAN, |passes| median(passes))
    }

    async fn combined_pass(self: &Arc<Self>, ops: usize, run: usize) -> f64 {
        self.empty(self.store.table()).await;
        let before = self.server_cpu.seconds();
        let rate = drive(self, ops, run, |b, key, _| async move {
            let out: Result<(), Error> = b.combined_guard.run(key, async { Ok(()) }).await;
            out.unwrap();
        })
        .await;
        self.server_cpu.record("combined", before, ops);
        rate
    }

    /// The seed design against the framework on a `CombiningStore`: a warm-up, then
    /// `ROUNDS` rounds, the two taking turns going first; returns the medians (seed,
    /// combined).
    async fn combined_rounds(self: &Arc<Self>, name: &str, run: &mut usize) -> [f64; 2] {
        *run += 1;
        self.pass(Side::Seed, WARMUP_OPS, *run).await;
        *run += 1;
        self.combined_pass(WARMUP_OPS, *run).await;
        let (mut seeds, mut combined) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            for turn in 0..2 {
                *run += 1;
                if (round + turn) % 2 == 0 {
                    seeds.push(self.pass(Side::Seed, OPS, *run).await);
                } else {
                    combined.push(self.combined_pass(OPS, *run).await);
                }
            }
            println!(
                "{name} combined round {}: seed {:.0}, framework_combined {:.0} ops/s",
                round + 1,
                seeds[round],
                combined[round]
            );
        }
        [median(&seeds), median(&combined)]
    }

    /// Warm-up, then `ROUNDS` rotating rounds; returns the medians, in `SIDES`' order.
    async fn rounds(self: &Arc<Self>, name: &str, run: &mut usize) -> [f64; 3] {
        for side in SIDES {
            *run += 1;
            self.pass(side, WARMUP_OPS, *run).await;
        }
        let mut rates: [Vec<f64>; 3] = Default::default();
        let (mut vs_seed, mut vs_raw) = (Vec::new(), Vec::new());
        for round in 1..=ROUNDS {
            let mut this = [0.0; 3];
            let order = rotation(SIDES, round - 1);
            for side in order {
                *run += 1;
                this[side as usize] = self.pass(side, OPS, *run).await;
            }
            let [seed, raw, framework] = this;
            let order = order.map(Side::name).join(", ");
            println!(
                "{name} round {round} ({order}): seed {seed:.0}, raw {raw:.0}, \
                 framework {framework:.0} ops/s; framework/seed {:.3}, framework/raw {:.3}",
                framework / seed,
                framework / raw
            );
            vs_seed.push(framework / seed);
            vs_raw.push(framework / raw);
            for (all, rate) in rates.iter_mut().zip(this) {
                all.push(rate);
            }
        }
        let medians = rates.map(|all| median(&all));
        let [seed, raw, framework] = medians;
        println!(
            "{name} medians over {ROUNDS} rounds: seed {seed:.0}, raw {raw:.0}, \
             framework {framework:.0} ops/s; median of per-round ratios: framework/seed {:.3}, \
             framework/raw {:.3}",
            median(&vs_seed),
            median(&vs_raw)
        );
        medians
    }
}

impl Bench<sqlx::Postgres> {
    fn business(&self) -> &Business {
        self.business
            .as_ref()
            .expect("opened without the business table")
    }

    /// One transaction pass of `side`: `ops` operations with `TASKS` tasks; returns
    /// operations per second.
    async fn tx_pass(self: &Arc<Self>, side: TxSide, ops: usize, run: usize) -> f64 {
        self.empty(&self.business().table).await;
        match side {
            TxSide::Seed => {
                self.empty(&self.seed_table).await;
                drive(self, ops, run, |b, key, id| async move {
                    seed_tx_cycle(&b, key, id).await;
                })
                .await
            }
            TxSide::Framework => {
                self.empty(self.store.table()).await;
                drive(self, ops, run, |b, key, id| async move {
                    framework_tx_cycle(&b, key, id).await;
                })
                .await
            }
        }
    }

    /// One pass of the framework on the store with asynchronous claims (PostgreSQL).
    async fn async_pass(self: &Arc<Self>, ops: usize, run: usize) -> f64 {
        self.empty(self.store.table()).await;
        drive(self, ops, run, |b, key, _| async move {
            let guard = b.async_guard.as_ref().unwrap();
            let out: Result<(), Error> = guard.run(key, async { Ok(()) }).await;
            out.unwrap();
        })
        .await
    }

    /// The seed design against the framework with asynchronous claims: a warm-up, then
    /// `ROUNDS` rounds, the two taking turns going first; returns the medians (seed, async).
    async fn async_rounds(self: &Arc<Self>, run: &mut usize) -> [f64; 2] {
        *run += 1;
        self.pass(Side::Seed, WARMUP_OPS, *run).await;
        *run += 1;
        self.async_pass(WARMUP_OPS, *run).await;
        let (mut seeds, mut asyncs) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            for turn in 0..2 {
                *run += 1;
                if (round + turn) % 2 == 0 {
                    seeds.push(self.pass(Side::Seed, OPS, *run).await);
                } else {
                    asyncs.push(self.async_pass(OPS, *run).await);
                }
            }
            println!(
                "postgres async-claim round {}: seed {:.0}, framework_async {:.0} ops/s",
                round + 1,
                seeds[round],
                asyncs[round]
            );
        }
        [median(&seeds), median(&asyncs)]
    }

    /// Warm-up, then `ROUNDS` alternating rounds; returns the medians, in `TX_SIDES`' order.
    async fn tx_rounds(self: &Arc<Self>, run: &mut usize) -> [f64; 2] {
        for side in TX_SIDES {
            *run += 1;
            self.tx_pass(side, WARMUP_OPS, *run).await;
        }
        let mut rates: [Vec<f64>; 2] = Default::default();
        let mut ratios = Vec::new();
        for round in 1..=ROUNDS {
            let mut this = [0.0; 2];
            let order = rotation(TX_SIDES, round - 1);
            for side in order {
                *run += 1;
                this[side as usize] = self.tx_pass(side, OPS, *run).await;
            }
            let [seed, framework] = this;
            let order = order.map(TxSide::name).join(", ");
            println!(
                "postgres tx round {round} ({order}): seed_tx {seed:.0}, \
                 framework_tx {framework:.0} ops/s; framework/seed {:.3}",
                framework / seed
            );
            ratios.push(framework / seed);
            for (all, rate) in rates.iter_mut().zip(this) {
                all.push(rate);
            }
        }
        let medians = rates.map(|all| median(&all));
        let [seed, framework] = medians;
        println!(
            "postgres tx medians over {ROUNDS} rounds: seed_tx {seed:.0}, \
             framework_tx {framework:.0} ops/s; median of per-round ratios: framework/seed {:.3}",
            median(&ratios)
        );
        medians
    }
}

/// Runs `ops` cycles of `cycle` (given the bench, the key and the cycle's number) on `TASKS`
/// tasks, on the keys of pass `run`; returns operations per second.
async fn drive<DB, F, Fut>(bench: &Arc<Bench<DB>>, ops: usize, run: usize, cycle: F) -> f64
where
    DB: Db,
    F: Fn(Arc<Bench<DB>>, Key, i64) -> Fut + Copy + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (bench, next) = (bench.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ops {
                        return;
                    }
                    let key = Key::new("bench:sql", 1, &[&run, &i]).unwrap();
                    cycle(bench.clone(), key, i64::try_from(i).unwrap()).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    per_s(ops, started.elapsed())
}

/// `IDEMPOTENT_BENCH_ONLY=<db>_<side>` (`postgres_seed`, `mysql_framework`, ...): a warm-up
/// and `ops` cycles of that side alone, nothing printed: what callgrind counts.
async fn one_side<DB: Db>(server: Server, side: &str, ops: usize) {
    let side = SIDES
        .into_iter()
        .find(|s| s.name() == side)
        .unwrap_or_else(|| panic!("no side {side}: seed, raw or framework"));
    let bench = Bench::<DB>::open(server, false).await;
    bench.pass(side, 300, 1).await;
    bench.pass(side, ops, 2).await;
    bench.store.pool().close().await;
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if let Some((only, ops)) = instructions::only(INSTRUCTION_OPS).unwrap() {
        runtime.block_on(async {
            match only.split_once('_') {
                Some(("postgres", side)) => {
                    one_side::<sqlx::Postgres>(Server::Postgres, side, ops).await;
                }
                Some(("mysql", side)) => one_side::<sqlx::MySql>(Server::MySql, side, ops).await,
                _ => panic!("no side {only}: postgres_<side> or mysql_<side>"),
            }
        });
        return;
    }
    runtime.block_on(async {
        println!(
            "claim + complete on fresh keys: {TASKS} tasks, pool of {POOL}, {OPS} ops per pass, \
             {ROUNDS} rounds"
        );
        let mut run = 0;
        let bench = Bench::<sqlx::Postgres>::open(Server::Postgres, true).await;
        let postgres = bench.rounds("postgres", &mut run).await;
        let [tx_seed, tx_framework] = bench.tx_rounds(&mut run).await;
        let [async_seed, async_framework] = bench.async_rounds(&mut run).await;
        let postgres_combined = bench.combined_rounds("postgres", &mut run).await;
        let postgres_cpu =
            ["seed", "framework", "combined"].map(|side| bench.server_cpu.per_cycle(side));
        let postgres_allocs = SIDES.map(|side| bench.allocations_per_cycle(side));
        bench.store.pool().close().await;
        drop(bench);
        let bench = Bench::<sqlx::MySql>::open(Server::MySql, false).await;
        let mysql = bench.rounds("mysql", &mut run).await;
        let mysql_combined = bench.combined_rounds("mysql", &mut run).await;
        let mysql_cpu =
            ["seed", "framework", "combined"].map(|side| bench.server_cpu.per_cycle(side));
        let mysql_allocs = SIDES.map(|side| bench.allocations_per_cycle(side));
        bench.store.pool().close().await;
        drop(bench);
        for (name, [seed, raw, framework]) in [("postgres", postgres), ("mysql", mysql)] {
            figure(&format!("{name}_seed_design_ops_per_s"), seed, 0);
            figure(&format!("{name}_framework_ops_per_s"), framework, 0);
            figure(&format!("{name}_ratio_vs_seed_design"), framework / seed, 3);
            figure(&format!("{name}_raw_ops_per_s"), raw, 0);
            figure(&format!("{name}_ratio"), framework / raw, 3);
        }
        for (name, [seed, combined]) in [("postgres", postgres_combined), ("mysql", mysql_combined)]
        {
            figure(&format!("{name}_combined_seed_ops_per_s"), seed, 0);
            figure(&format!("{name}_combined_framework_ops_per_s"), combined, 0);
            figure(
                &format!("{name}_combined_ratio_vs_seed_design"),
                combined / seed,
                3,
            );
        }
        for (name, [seed, framework, combined]) in
            [("postgres", postgres_cpu), ("mysql", mysql_cpu)]
        {
            figure(&format!("{name}_server_us_per_cycle_seed_design"), seed, 1);
            figure(
                &format!("{name}_server_us_per_cycle_framework"),
                framework,
                1,
            );
            figure(&format!("{name}_server_us_per_cycle_combined"), combined, 1);
        }
        figure("postgres_tx_seed_ops_per_s", tx_seed, 0);
        figure("postgres_tx_framework_ops_per_s", tx_framework, 0);
        figure("postgres_tx_ratio", tx_framework / tx_seed, 3);
        figure("postgres_async_claims_seed_ops_per_s", async_seed, 0);
        figure(
            "postgres_async_claims_framework_ops_per_s",
            async_framework,
            0,
        );
        figure(
            "postgres_async_claims_ratio_vs_seed_design",
            async_framework / async_seed,
            3,
        );
        for (name, allocs) in [("postgres", postgres_allocs), ("mysql", mysql_allocs)] {
            for (side, per_cycle) in SIDES.into_iter().zip(allocs) {
                figure(&format!("{name}_{}_allocations", side.name()), per_cycle, 1);
            }
        }
        if instructions::enabled() {
            for name in ["postgres", "mysql"] {
                let count = |side: &str| {
                    instructions::per_cycle(&format!("{name}_{side}"), INSTRUCTION_OPS).unwrap()
                };
                let (seed, framework) = (count("seed"), count("framework"));
                figure(&format!("{name}_seed_instructions"), seed, 0);
                figure(&format!("{name}_framework_instructions"), framework, 0);
                figure(&format!("{name}_instructions_ratio"), seed / framework, 3);
            }
        }
    });
}
