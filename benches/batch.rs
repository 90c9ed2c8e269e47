//! Batches end to end: a consumer handling 100 messages with one `run_batch`, against the
//! seed's design batched by hand (what a user writes without the library: see `Seed`) and
//! against 100 single calls, on Redis, PostgreSQL and MariaDB, in one process.
//!
//! 1. **Round trips per batch of 100.** The store's connection goes through a TCP proxy in
//!    this process that counts client bursts: bytes from the client after the server last
//!    sent something on that connection (a Redis pipeline is one). One task runs 10 batches
//!    of 100 fresh keys with `Idempotency::run_batch` (a body that returns `Ok(())`), then 10
//!    rounds of 100 single calls (`Idempotency::run`, 100 at a time concurrently): bursts per
//!    100 messages. The SQL pool's connection checks (sqlx pings a connection each time it is
//!    taken from the pool, its default) count too, and sqlx's statements show as two bursts
//!    each on PostgreSQL and MariaDB (400 for 200 statements with the checks off), so the
//!    SQL figures are also given through a pool without the checks, and on MariaDB the
//!    statements themselves are counted by the server (`Questions`).
//! 2. **Messages per second.** Without the proxy: after a warm-up, 6 rounds of one pass of
//!    each side (20 batches of 100 through the framework, 20 batches of 100 by hand, and 20
//!    rounds of 100 concurrent single calls), the order rotating so that each side goes
//!    first, second and third equally often; the median pass of each side counts. On
//!    PostgreSQL and MariaDB a fourth side, the batch by hand on the store's row (see
//!    `Row::Store`), makes it 8 rounds of 4 passes. The SQL tables are filled with 5,000
//!    completed records each and analyzed first (see `prefill`), so that every statement
//!    runs on the plan a deployment's table has. A line before the figures gives the median
//!    of the ratios within each round, whose sides ran next to each other: the machine's
//!    noise moves it less than the ratio of the sides' medians.
//!
//! Run it with:
//!
//! ```text
//! cargo bench --bench batch --features redis,postgres,mysql
//! ```
//!
//! It needs Redis at `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`), PostgreSQL at
//! `IDEMPOTENT_POSTGRES_URL` and MariaDB at `IDEMPOTENT_MYSQL_URL` (see `tests/support`).
//! Redis keys carry a tag unique to the run and are deleted at the end; SQL tables are
//! scratch tables dropped at the end.
//!
//! Figures, for `redis`, `postgres` and `mysql`:
//!
//! - `<db>_batch_round_trips_per_100`: bursts of one `run_batch` of 100 (target: 2 round
//!   trips: one claim, one ending); `<db>_seed_batch_round_trips_per_100`: the same for
//!   the batch by hand;
//! - `<db>_seed_batch_msgs_per_s`, `<db>_batch_ratio_vs_seed_design`: the batch by hand, and
//!   the framework's batch over it;
//! - on PostgreSQL and MariaDB, `<db>_seed_on_store_row_batch_msgs_per_s`: the batch by hand
//!   on a table of the store's layout, writing the columns the rules need;
//!   `<db>_seed_on_store_row_ratio`, it over the batch by hand on its own table (what the row
//!   costs: the highest `<db>_batch_ratio_vs_seed_design` these statements could reach on
//!   this row); `<db>_batch_ratio_vs_seed_on_store_row`, the framework's batch over it (what
//!   the store's statements and the client cost on the same row);
//!   `<db>_seed_on_store_row_server_cpu_us_per_item`, the server's CPU time per message.
//!   With `IDEMPOTENT_BENCH_STORE_ROW_EXPIRY_INDEX=0` that table has no `expires_at` index:
//!   what the index costs, apart from the rest of the row;
//! - `<db>_single_round_trips_per_100`: bursts of 100 single calls;
//! - `postgres_` and `mysql_batch_round_trips_per_100_unchecked_pool`, `..._single_...`:
//!   the same through a pool that does not ping connections;
//! - `mysql_batch_statements_per_100`, `mysql_single_statements_per_100`: statements the
//!   server received;
//! - `<db>_batch_msgs_per_s`, `<db>_single_msgs_per_s`, `<db>_batch_over_single`;
//! - `<db>_batch_allocations_per_item`, `<db>_seed_batch_allocations_per_item`: this
//!   process's allocations per message (median pass);
//! - `<db>_batch_client_cpu_us_per_item`, `<db>_seed_batch_client_cpu_us_per_item`: this
//!   process's CPU time per message (median pass; Linux); `<db>_batch_server_cpu_us_per_item`
//!   and `<db>_seed_batch_server_cpu_us_per_item`, the server's (Redis: `INFO cpu`;
//!   PostgreSQL and MariaDB: their processes' CPU time in `/proc`, printed when the server
//!   runs on this machine): a batch's wall time is mostly the two added up, so they say which
//!   side of the connection a gap is on;
//! - with valgrind installed, `<db>_batch_instructions_per_item`,
//!   `<db>_seed_batch_instructions_per_item` and `<db>_batch_instructions_ratio` (the batch by
//!   hand's count over the framework's: read as the throughput ratio is, the higher the
//!   better): this process's instructions per message under callgrind (see
//!   `support/instructions.rs`), a figure the machine's load does not move and that leaves
//!   out the server's work. `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it. On Redis,
//!   `redis_batch_counted_scripts_per_item` says which claim the counted runs took: 1.0
//!   when every claim was the fast `SET ... NX GET` (the completion is the one script), 2.0
//!   when every claim went through the script. Under callgrind this process runs many times
//!   slower, so its reading of the server's clock can be too imprecise for the fast claim
//!   (see `RedisStoreBuilder::fast_claims`), and the count is then of the script's path,
//!   which a client at full speed does not take.

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "../tests/support/sql_tables.rs"]
mod sql_tables;
#[path = "support/stats.rs"]
mod stats;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idempotency::redis::RedisStore;
use idempotency::sql::{sqlx, Dialect, SqlStore};
use idempotency::store::Token;
use idempotency::{Error, Idempotency, Key, SharedStore};
use sql_tables::{Scratch, Server};
use stats::{figure, median, per_s, processes_cpu};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BATCH: usize = 100;
/// Batches of 100 a side runs under callgrind (and twice as many in the second count).
const INSTRUCTION_BATCHES: usize = 20;

/// A TCP proxy counting round trips (see the module docs).
struct Counter {
    addr: SocketAddr,
    round_trips: Arc<AtomicUsize>,
}

impl Counter {
    async fn start(upstream: SocketAddr) -> Result<Counter, BoxError> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let round_trips = Arc::new(AtomicUsize::new(0));
        let counted = round_trips.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(relay(client, server, counted.clone()));
            }
        });
        Ok(Counter { addr, round_trips })
    }

    fn count(&self) -> usize {
        self.round_trips.load(Ordering::SeqCst)
    }
}

/// Forwards both ways; a client burst after a server answer is one more round trip.
async fn relay(client: TcpStream, server: TcpStream, round_trips: Arc<AtomicUsize>) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Whether the server answered since the client last sent.
    let answered = Arc::new(AtomicBool::new(true));
    let up = {
        let answered = answered.clone();
        async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if answered.swap(false, Ordering::SeqCst) {
                    round_trips.fetch_add(1, Ordering::SeqCst);
                }
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            answered.store(true, Ordering::SeqCst);
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(up, down);
}

/// `url` with its host and port replaced by `addr`.
fn through(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(a, p)| (a, p));
    let userinfo = authority.rsplit_once('@').map(|(u, _)| format!("{u}@"));
    format!("{scheme}://{}{addr}/{path}", userinfo.unwrap_or_default())
}

/// The address `url` points to.
async fn address(url: &str) -> Result<SocketAddr, BoxError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or_default();
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let host = host.split('?').next().unwrap_or_default();
    let mut addrs = tokio::net::lookup_host(host).await?;
    addrs
        .next()
        .ok_or_else(|| format!("`{host}` resolves to no address").into())
}

struct Side {
    guard: Idempotency,
    run: String,
    next: AtomicUsize,
}

impl Side {
    fn keys(&self) -> Result<Vec<(Key, ())>, BoxError> {
        let pass = self.next.fetch_add(1, Ordering::Relaxed);
        (0..BATCH)
            .map(|i| {
                Ok((
                    Key::new("bench:batch", 1, &[&self.run.as_str(), &pass, &i])?,
                    (),
                ))
            })
            .collect()
    }

    async fn batch(&self) -> Result<(), BoxError> {
        let results: Vec<Result<(), Error>> = self
            .guard
            .run_batch(self.keys()?, |()| async { Ok(()) })
            .await;
        for result in results {
            result.map_err(|e| format!("a batch item failed: {e}"))?;
        }
        Ok(())
    }

    async fn singles(&self) -> Result<(), BoxError> {
        let calls = self
            .keys()?
            .into_iter()
            .map(|(key, ())| self.guard.run(key, async { Ok::<(), Error>(()) }));
        for result in join_all(calls).await {
            result.map_err(|e| format!("a single call failed: {e}"))?;
        }
        Ok(())
    }
}

/// The seed's design written by hand, batched the way a user would batch it without the
/// library: Redis, one pipeline of `SET key token NX PX lease`, then one pipeline of the
/// compare-and-set script (`done` if the key still holds the token) for the keys it took;
/// PostgreSQL, on the seed's idempotency table, one `INSERT ... SELECT FROM unnest(..) ON
/// CONFLICT DO NOTHING RETURNING key` and one `UPDATE ... FROM unnest(..)`; MariaDB, one
/// multi-row `INSERT IGNORE`, one read of the batch's tokens (it reports no row by row
/// outcome) and one `UPDATE ... JOIN`. No lease takeover, fence, expiry or payload check.
enum Seed {
    Redis {
        conn: redis::aio::MultiplexedConnection,
        complete: redis::Script,
        lease_ms: u64,
        ttl_ms: u64,
    },
    Postgres {
        pool: sqlx::PgPool,
        table: String,
        row: Row,
    },
    MySql {
        pool: sqlx::MySqlPool,
        table: String,
        row: Row,
    },
}

/// The table a hand-written SQL batch writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    /// The seed's idempotency table (key, token, state, result, creation time).
    Seed,
    /// A table the store's own migration made: the same statements, also writing what a
    /// record holds for the rules (the prefix, a fence, the lease's end, the expiry, the time
    /// of the last write; the completion moves the expiry, a record expiring `ttl` after it
    /// was last written), in the store's row with its `expires_at` index. What the row costs
    /// apart from the store's statements: the lease takeover, the fence from the clock, the
    /// payload and corrupt-row checks and the report of the keys not taken are left out.
    Store,
}

impl Row {
    /// The key column, the insert's other columns and their values, and the completion's
    /// other assignments, on `server`.
    fn sql(self, server: Server) -> (&'static str, &'static str, &'static str, &'static str) {
        match (self, server) {
            (Row::Seed, Server::Postgres) => ("key", "", "", ""),
            (Row::Seed, Server::MySql) => ("`key`", "", "", ""),
            (Row::Store, Server::Postgres) => (
                "record_key",
                ", prefix, fence, lease_until, created_at, updated_at, expires_at",
                ", 'bench:batch', 1, now() + INTERVAL '30 seconds', now(), now(), \
                 now() + INTERVAL '1 hour'",
                ", updated_at = now(), expires_at = now() + INTERVAL '1 hour'",
            ),
            (Row::Store, Server::MySql) => (
                "record_key",
                ", prefix, fence, lease_until, created_at, updated_at, expires_at",
                ", 'bench:batch', 1, UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, UTC_TIMESTAMP(6), \
                 UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
                ", r.updated_at = UTC_TIMESTAMP(6), \
                 r.expires_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR",
            ),
        }
    }
}

/// The seed design's completion script, as `benches/redis.rs` runs it.
const SEED_COMPLETE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 else return 0 end";

impl Seed {
    async fn redis(url: &str) -> Result<Seed, BoxError> {
        let mut conn = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        let complete = redis::Script::new(SEED_COMPLETE);
        complete.prepare_invoke().load_async(&mut conn).await?;
        let ttl = Duration::from_secs(3600);
        Ok(Seed::Redis {
            conn,
            complete,
            lease_ms: u64::try_from(Idempotency::new(ttl).lease_duration().as_millis())?,
            ttl_ms: u64::try_from(ttl.as_millis())?,
        })
    }

    /// The hand-written batch on `table`, on a pool of its own as large as the store's:
    /// with [`Row::Seed`], the seed's idempotency table (as `benches/sql.rs` creates it),
    /// created here; with [`Row::Store`], a table the store's migration made.
    async fn sql(server: Server, url: &str, table: &str, row: Row) -> Result<Seed, BoxError> {
        let table = table.to_string();
        Ok(match server {
            Server::Postgres => {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(8)
                    .connect(url)
                    .await?;
                if row == Row::Seed {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "CREATE TABLE {table} (key BYTEA PRIMARY KEY, token BYTEA NOT NULL, \
                         state TEXT NOT NULL, result BYTEA, \
                         created_at TIMESTAMPTZ NOT NULL DEFAULT now())"
                    )))
                    .execute(&pool)
                    .await?;
                }
                Seed::Postgres { pool, table, row }
            }
            Server::MySql => {
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(8)
                    .connect(url)
                    .await?;
                if row == Row::Seed {
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "CREATE TABLE {table} (`key` VARBINARY(512) PRIMARY KEY, \
                         token BINARY(16) NOT NULL, state VARCHAR(16) NOT NULL, result BLOB, \
                         created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) \
                         ENGINE = InnoDB"
                    )))
                    .execute(&pool)
                    .await?;
                }
                Seed::MySql { pool, table, row }
            }
        })
    }

    /// Drops the `expires_at` index of a [`Row::Store`] table
    /// (`IDEMPOTENT_BENCH_STORE_ROW_EXPIRY_INDEX=0`): what the index costs, apart from the
    /// rest of the row.
    async fn drop_expiry_index(&self) -> Result<(), BoxError> {
        match self {
            Seed::Postgres { pool, table, .. } => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP INDEX {table}_expires_at"
                )))
                .execute(pool)
                .await?;
            }
            Seed::MySql { pool, table, .. } => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP INDEX {table}_expires_at ON {table}"
                )))
                .execute(pool)
                .await?;
            }
            Seed::Redis { .. } => return Err("the Redis seed has no table".into()),
        }
        Ok(())
    }

    /// The same hand-written batch on `table` through another connection string (the
    /// round-trip counter's).
    async fn through(&self, url: &str) -> Result<Seed, BoxError> {
        Ok(match self {
            Seed::Postgres { table, row, .. } => Seed::Postgres {
                pool: sqlx::PgPool::connect(url).await?,
                table: table.clone(),
                row: *row,
            },
            Seed::MySql { table, row, .. } => Seed::MySql {
                pool: sqlx::MySqlPool::connect(url).await?,
                table: table.clone(),
                row: *row,
            },
            Seed::Redis { .. } => return Err("the Redis seed has no connection string".into()),
        })
    }

    /// One batch of fresh keys: claim them all, run a body that does nothing for those it
    /// took, complete them all.
    async fn batch(&self, keys: Vec<Vec<u8>>) -> Result<(), BoxError> {
        let tokens: Vec<Vec<u8>> = keys
            .iter()
            .map(|_| Token::generate().as_bytes().to_vec())
            .collect();
        let taken = match self {
            Seed::Redis {
                conn,
                complete,
                lease_ms,
                ttl_ms,
            } => {
                let mut conn = conn.clone();
                let mut claims = redis::pipe();
                for (key, token) in keys.iter().zip(&tokens) {
                    claims
                        .cmd("SET")
                        .arg(key)
                        .arg(token)
                        .arg("NX")
                        .arg("PX")
                        .arg(*lease_ms);
                }
                let claimed: Vec<redis::Value> = claims.query_async(&mut conn).await?;
                let taken: Vec<usize> = claimed
                    .iter()
                    .enumerate()
                    .filter(|(_, reply)| matches!(reply, redis::Value::Okay))
                    .map(|(i, _)| i)
                    .collect();
                let mut invocations = Vec::with_capacity(taken.len());
                for &i in &taken {
                    let mut invocation = complete.prepare_invoke();
                    invocation
                        .key(&keys[i])
                        .arg(&tokens[i])
                        .arg("done")
                        .arg(*ttl_ms);
                    invocations.push(invocation);
                }
                let mut completions = redis::pipe();
                for invocation in &invocations {
                    completions.invoke_script(invocation);
                }
                let done: Vec<i64> = completions.query_async(&mut conn).await?;
                (taken.len(), done.iter().filter(|&&n| n == 1).count())
            }
            Seed::Postgres { pool, table, row } => {
                let (key, columns, values, set) = row.sql(Server::Postgres);
                let taken: Vec<Vec<u8>> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {table} ({key}, token, state{columns}) \
                     SELECT k, t, 'in_progress'{values} \
                     FROM unnest($1::bytea[], $2::bytea[]) AS i(k, t) \
                     ON CONFLICT DO NOTHING RETURNING {key}"
                )))
                .bind(&keys)
                .bind(&tokens)
                .fetch_all(pool)
                .await?;
                let taken: std::collections::HashSet<Vec<u8>> = taken.into_iter().collect();
                let (keys, tokens): (Vec<&Vec<u8>>, Vec<&Vec<u8>>) = keys
                    .iter()
                    .zip(&tokens)
                    .filter(|(key, _)| taken.contains(*key))
                    .unzip();
                let done = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {table} SET state = 'completed'{set} \
                     FROM unnest($1::bytea[], $2::bytea[]) AS i(k, t) \
                     WHERE {table}.{key} = i.k AND {table}.token = i.t"
                )))
                .bind(&keys)
                .bind(&tokens)
                .execute(pool)
                .await?
                .rows_affected();
                (taken.len(), usize::try_from(done)?)
            }
            Seed::MySql { pool, table, row } => {
                let (key, columns, values, set) = row.sql(Server::MySql);
                let rows = vec![format!("(?, ?, 'in_progress'{values})"); keys.len()].join(", ");
                let mut insert = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT IGNORE INTO {table} ({key}, token, state{columns}) VALUES {rows}"
                )));
                for (key, token) in keys.iter().zip(&tokens) {
                    insert = insert.bind(key).bind(token);
                }
                insert.execute(pool).await?;
                let marks = vec!["?"; keys.len()].join(", ");
                let mut read = sqlx::query_as::<_, (Vec<u8>, Vec<u8>)>(sqlx::AssertSqlSafe(
                    format!("SELECT {key}, token FROM {table} WHERE {key} IN ({marks})"),
                ));
                for key in &keys {
                    read = read.bind(key);
                }
                let held: std::collections::HashMap<Vec<u8>, Vec<u8>> =
                    read.fetch_all(pool).await?.into_iter().collect();
                let taken: Vec<usize> = (0..keys.len())
                    .filter(|&i| held.get(&keys[i]) == Some(&tokens[i]))
                    .collect();
                let select = (0..taken.len())
                    .map(|i| {
                        if i == 0 {
                            "SELECT ? AS k, ? AS t"
                        } else {
                            "SELECT ?, ?"
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(" UNION ALL ");
                let mut update = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "UPDATE {table} AS r JOIN ({select}) AS i ON r.{key} = i.k AND r.token = i.t \
                     SET r.state = 'completed'{set}"
                )));
                for &i in &taken {
                    update = update.bind(&keys[i]).bind(&tokens[i]);
                }
                let done = update.execute(pool).await?.rows_affected();
                (taken.len(), usize::try_from(done)?)
            }
        };
        match taken {
            (taken, done) if taken == keys.len() && done == taken => Ok(()),
            (taken, done) => Err(format!(
                "the seed design took {taken} of {} fresh keys and completed {done}",
                keys.len()
            )
            .into()),
        }
    }
}

/// Batches of 100 each SQL side writes before it is measured or counted (see [`prefill`]).
const PREFILL_BATCHES: usize = 50;

/// Fills the store's table and each hand-written batch's with [`PREFILL_BATCHES`] batches
/// of completed records, every side through its own statements, then has the database
/// analyze the `tables`: the statements measured then run on the plans a deployment's table
/// has once autovacuum (PostgreSQL) or InnoDB's statistics have seen it. A new table has no
/// statistics, and PostgreSQL's generic plan for a statement that joins a batch to it can be
/// a sequential scan, which costs more on every batch as the table grows until an
/// autoanalyze in the middle of a run replans it: before this prefill, 3 M of the
/// hand-written batch's 8.4 M server instructions a batch (`scripts/pg-bench-backend-instructions`).
async fn prefill(store: SharedStore, seeds: &[&Seed], tables: &[&str]) -> Result<(), BoxError> {
    let side = Side {
        guard: Idempotency::new(Duration::from_secs(3600)).store(store),
        run: tag(),
        next: AtomicUsize::new(0),
    };
    let seed_run = tag();
    for pass in 0..PREFILL_BATCHES {
        side.batch().await?;
        for seed in seeds {
            seed.batch(seed_keys(&seed_run, pass)?).await?;
        }
    }
    let Some(seed) = seeds.first() else {
        return Ok(());
    };
    for table in tables {
        match seed {
            Seed::Postgres { pool, .. } => {
                sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
                    .execute(pool)
                    .await?;
            }
            Seed::MySql { pool, .. } => {
                // `ANALYZE TABLE` answers with a result set, errors included.
                let rows: Vec<(String, String, String, String)> =
                    sqlx::query_as(sqlx::AssertSqlSafe(format!("ANALYZE TABLE {table}")))
                        .fetch_all(pool)
                        .await?;
                if let Some((_, _, _, text)) = rows.iter().find(|row| row.2 == "error") {
                    return Err(format!("ANALYZE TABLE {table}: {text}").into());
                }
            }
            Seed::Redis { .. } => return Err("no tables to analyze on Redis".into()),
        }
    }
    Ok(())
}

/// The database server's CPU seconds so far: Redis's from `INFO` (`redis`: its connection),
/// PostgreSQL's and MariaDB's from their processes in `/proc` (`None` when the server does not
/// run on this machine).
async fn server_seconds(
    name: &str,
    redis: Option<&mut redis::aio::ConnectionManager>,
) -> Result<Option<f64>, BoxError> {
    let processes: &[&str] = match name {
        "postgres" => &["postgres"],
        "mysql" => &["mariadbd", "mysqld"],
        _ => &[],
    };
    Ok(match redis {
        Some(conn) => Some(redis_info::server_cpu(conn).await?),
        None => Some(processes_cpu(processes)).filter(|&seconds| seconds > 0.0),
    })
}

/// Round trips of a batch of 100 and of 100 single calls on `store` (whose connections go
/// through `counter`), per 100 messages.
async fn round_trips(store: SharedStore, counter: &Counter) -> Result<(f64, f64), BoxError> {
    let slow = Side {
        guard: Idempotency::new(Duration::from_secs(3600)).store(store),
        run: tag(),
        next: AtomicUsize::new(0),
    };
    // Warm-up: connections, prepared statements, scripts.
    slow.batch().await?;
    slow.singles().await?;
    let rounds = 10;
    let before = counter.count();
    for _ in 0..rounds {
        slow.batch().await?;
    }
    let batch = (counter.count() - before) as f64 / f64::from(rounds);
    let before = counter.count();
    for _ in 0..rounds {
        slow.singles().await?;
    }
    let single = (counter.count() - before) as f64 / f64::from(rounds);
    Ok((batch, single))
}

/// A key part unique to one side of one run.
fn tag() -> String {
    Token::generate()
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Fresh key bytes for a hand-written batch: the framework's encoding, a tag of their own.
fn seed_keys(run: &str, pass: usize) -> Result<Vec<Vec<u8>>, BoxError> {
    (0..BATCH)
        .map(|i| {
            Ok(Key::new("bench:batch", 1, &[&run, &pass, &i])?
                .as_bytes()
                .to_vec())
        })
        .collect()
}

/// The hand-written batches of a run.
struct Seeds<'a> {
    /// The seed's design.
    seed: &'a Seed,
    /// The same through the round-trip counter.
    counted: &'a Seed,
    /// The seed's design on the store's row ([`Row::Store`]), on the SQL stores.
    on_store_row: Option<&'a Seed>,
}

async fn measure(
    name: &str,
    direct: SharedStore,
    counted: SharedStore,
    counter: &Counter,
    seeds: Seeds<'_>,
    server: Option<(redis::aio::ConnectionManager, &str)>,
) -> Result<(), BoxError> {
    let Seeds {
        seed,
        counted: seed_counted,
        on_store_row,
    } = seeds;
    // Redis: a connection for `INFO`, and the server's address for the counted runs' probe.
    let (mut server, scripts_url) = match server {
        Some((conn, url)) => (Some(conn), Some(url)),
        None => (None, None),
    };
    // `IDEMPOTENT_BENCH_ONLY=<db>_batch`, `<db>_seed` or `<db>_seed_on_store_row`: a warm-up
    // batch and `batches` batches of that side alone: what callgrind counts.
    if let Some((only, batches)) = instructions::only(INSTRUCTION_BATCHES)? {
        let seed_run = tag();
        if only == format!("{name}_batch") {
            let side = Side {
                guard: Idempotency::new(Duration::from_secs(3600)).store(direct),
                run: tag(),
                next: AtomicUsize::new(0),
            };
            for _ in 0..=batches {
                side.batch().await?;
            }
        } else if only == format!("{name}_seed") {
            for pass in 0..=batches {
                seed.batch(seed_keys(&seed_run, pass)?).await?;
            }
        } else if let (true, Some(on_store_row)) =
            (only == format!("{name}_seed_on_store_row"), on_store_row)
        {
            for pass in 0..=batches {
                on_store_row.batch(seed_keys(&seed_run, pass)?).await?;
            }
        } else {
            return Err(format!(
                "no side {only}: {name}_batch, {name}_seed or {name}_seed_on_store_row"
            )
            .into());
        }
        return Ok(());
    }
    let (batch_trips, single_trips) = round_trips(counted, counter).await?;
    let seed_run = tag();
    let mut seed_pass = 0;
    seed_counted.batch(seed_keys(&seed_run, seed_pass)?).await?;
    seed_pass += 1;
    let rounds = 10;
    let before = counter.count();
    for _ in 0..rounds {
        seed_counted.batch(seed_keys(&seed_run, seed_pass)?).await?;
        seed_pass += 1;
    }
    let seed_trips = (counter.count() - before) as f64 / f64::from(rounds);
    let fast = Side {
        guard: Idempotency::new(Duration::from_secs(3600)).store(direct),
        run: tag(),
        next: AtomicUsize::new(0),
    };
    fast.batch().await?;
    fast.singles().await?;
    seed.batch(seed_keys(&seed_run, seed_pass)?).await?;
    if let Some(on_store_row) = on_store_row {
        on_store_row.batch(seed_keys(&seed_run, seed_pass)?).await?;
    }
    seed_pass += 1;
    let passes = 20;
    let (mut batches, mut seeds, mut singles) = (Vec::new(), Vec::new(), Vec::new());
    let mut on_row = Vec::new();
    let (mut batch_allocs, mut seed_allocs) = (Vec::new(), Vec::new());
    // CPU microseconds per message: this process's, and the server's where it says (Redis).
    let (mut batch_client, mut seed_client) = (Vec::new(), Vec::new());
    let (mut batch_server, mut seed_server) = (Vec::new(), Vec::new());
    let mut on_row_server = Vec::new();
    let per_item = |since: u64| (allocations::so_far() - since) as f64 / (passes * BATCH) as f64;
    let us_per_item = |seconds: f64| seconds * 1e6 / (passes * BATCH) as f64;
    // Each side goes in each place equally often: 6 rounds of 3 sides, or 8 rounds of 4 when
    // the hand-written batch also runs on the store's row.
    let (sides, rounds) = if on_store_row.is_some() {
        (4, 8)
    } else {
        (3, 6)
    };
    for round in 0..rounds {
        for turn in 0..sides {
            let server_before = server_seconds(name, server.as_mut()).await?;
            let client_before = redis_info::client_cpu();
            let start = Instant::now();
            let allocated = allocations::so_far();
            let side = (round + turn) % sides;
            match side {
                0 => {
                    for _ in 0..passes {
                        fast.batch().await?;
                    }
                    batches.push(per_s(passes * BATCH, start.elapsed()));
                    batch_allocs.push(per_item(allocated));
                }
                1 => {
                    for _ in 0..passes {
                        seed.batch(seed_keys(&seed_run, seed_pass)?).await?;
                        seed_pass += 1;
                    }
                    seeds.push(per_s(passes * BATCH, start.elapsed()));
                    seed_allocs.push(per_item(allocated));
                }
                2 => {
                    for _ in 0..passes {
                        fast.singles().await?;
                    }
                    singles.push(per_s(passes * BATCH, start.elapsed()));
                }
                _ => {
                    if let Some(on_store_row) = on_store_row {
                        for _ in 0..passes {
                            on_store_row.batch(seed_keys(&seed_run, seed_pass)?).await?;
                            seed_pass += 1;
                        }
                    }
                    on_row.push(per_s(passes * BATCH, start.elapsed()));
                }
            }
            let (client, server_cpu) = match side {
                0 => (Some(&mut batch_client), &mut batch_server),
                1 => (Some(&mut seed_client), &mut seed_server),
                3 => (None, &mut on_row_server),
                _ => continue,
            };
            if let (Some(client), Some(before), Some(after)) =
                (client, client_before, redis_info::client_cpu())
            {
                client.push(us_per_item(after - before));
            }
            let server_after = server_seconds(name, server.as_mut()).await?;
            if let (Some(before), Some(after)) = (server_before, server_after) {
                server_cpu.push(us_per_item(after - before));
            }
        }
    }
    let (batch, seed_rate, single) = (median(&batches), median(&seeds), median(&singles));
    // The sides of a round ran next to each other: the ratios within each round, whose median
    // the machine's noise moves less than the ratio of the sides' medians.
    let per_round = |ours: &[f64], theirs: &[f64]| {
        let ratios: Vec<f64> = ours.iter().zip(theirs).map(|(a, b)| a / b).collect();
        median(&ratios)
    };
    let mut summary = format!(
        "{name} medians of per-round ratios: batch/seed {:.3}",
        per_round(&batches, &seeds)
    );
    if !on_row.is_empty() {
        summary += &format!(
            ", seed on store row/seed {:.3}, batch/seed on store row {:.3}",
            per_round(&on_row, &seeds),
            per_round(&batches, &on_row)
        );
    }
    println!("{summary}");
    figure(
        &format!("{name}_seed_batch_round_trips_per_100"),
        seed_trips,
        1,
    );
    figure(&format!("{name}_seed_batch_msgs_per_s"), seed_rate, 0);
    figure(
        &format!("{name}_batch_ratio_vs_seed_design"),
        batch / seed_rate,
        3,
    );
    figure(&format!("{name}_batch_round_trips_per_100"), batch_trips, 1);
    figure(
        &format!("{name}_single_round_trips_per_100"),
        single_trips,
        1,
    );
    figure(&format!("{name}_batch_msgs_per_s"), batch, 0);
    figure(&format!("{name}_single_msgs_per_s"), single, 0);
    figure(&format!("{name}_batch_over_single"), batch / single, 2);
    figure(
        &format!("{name}_batch_allocations_per_item"),
        median(&batch_allocs),
        1,
    );
    figure(
        &format!("{name}_seed_batch_allocations_per_item"),
        median(&seed_allocs),
        1,
    );
    if !on_row.is_empty() {
        let on_row = median(&on_row);
        figure(
            &format!("{name}_seed_on_store_row_batch_msgs_per_s"),
            on_row,
            0,
        );
        figure(
            &format!("{name}_seed_on_store_row_ratio"),
            on_row / seed_rate,
            3,
        );
        figure(
            &format!("{name}_batch_ratio_vs_seed_on_store_row"),
            batch / on_row,
            3,
        );
        if !on_row_server.is_empty() {
            figure(
                &format!("{name}_seed_on_store_row_server_cpu_us_per_item"),
                median(&on_row_server),
                2,
            );
        }
    }
    let sides = [
        ("batch", &batch_client, &batch_server),
        ("seed_batch", &seed_client, &seed_server),
    ];
    for (side, client, server_cpu) in sides {
        if !client.is_empty() {
            figure(
                &format!("{name}_{side}_client_cpu_us_per_item"),
                median(client),
                2,
            );
        }
        if !server_cpu.is_empty() {
            figure(
                &format!("{name}_{side}_server_cpu_us_per_item"),
                median(server_cpu),
                2,
            );
        }
    }
    if instructions::enabled() {
        let item = BATCH as f64;
        let side = format!("{name}_batch");
        let ours = match scripts_url {
            Some(url) => {
                let mut scripts = redis_info::script_calls(url)?;
                // One script per item: its completion. A run whose claims fell back to the
                // script is taken again.
                let expected = instructions::Expected {
                    warm_cycles: 1,
                    per_cycle: BATCH as f64,
                };
                let (count, scripts) = instructions::per_cycle_expected(
                    &side,
                    INSTRUCTION_BATCHES,
                    &mut scripts,
                    Some(expected),
                )?;
                figure(
                    &format!("{name}_batch_counted_scripts_per_item"),
                    scripts / item,
                    2,
                );
                count
            }
            None => instructions::per_cycle(&side, INSTRUCTION_BATCHES)?,
        } / item;
        let by_hand = instructions::per_cycle(&format!("{name}_seed"), INSTRUCTION_BATCHES)? / item;
        figure(&format!("{name}_batch_instructions_per_item"), ours, 0);
        figure(
            &format!("{name}_seed_batch_instructions_per_item"),
            by_hand,
            0,
        );
        figure(
            &format!("{name}_batch_instructions_ratio"),
            by_hand / ours,
            3,
        );
    }
    Ok(())
}

async fn redis() -> Result<(), BoxError> {
    let url =
        std::env::var("IDEMPOTENT_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let counter = Counter::start(address(&url).await?).await?;
    let direct = redis_info::store(&url, instructions::COUNTED_CLOCK_ERROR).await?;
    let direct = Arc::new(direct);
    let counted = Arc::new(RedisStore::connect(&through(&url, counter.addr)).await?);
    let seed = Seed::redis(&url).await?;
    let seed_counted = Seed::redis(&through(&url, counter.addr)).await?;
    let info = redis::Client::open(url.as_str())?
        .get_connection_manager()
        .await?;
    let server = Some((info, url.as_str()));
    measure(
        "redis",
        direct,
        counted,
        &counter,
        Seeds {
            seed: &seed,
            counted: &seed_counted,
            on_store_row: None,
        },
        server,
    )
    .await?;
    if std::env::var("IDEMPOTENT_BENCH_ONLY").is_ok() {
        // Counted under callgrind: the bench that started this run removes its keys with its
        // own, once the count is taken (removing them here would count the other run's too).
        return Ok(());
    }
    // The keys of the run expire in an hour; remove them now.
    let client = redis::Client::open(url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("bench:batch:v1:*")
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: () = redis::cmd("DEL").arg(keys).query_async(&mut conn).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The statements MariaDB's clients sent so far, server-wide (`Questions`; pings are not
/// counted). The query itself counts one.
async fn statements(url: &str) -> Result<u64, BoxError> {
    use sqlx::Connection as _;
    let mut conn = sqlx::MySqlConnection::connect(url).await?;
    let (_, n): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Questions'")
        .fetch_one(&mut conn)
        .await?;
    Ok(n.parse()?)
}

/// Statements per batch of 100 and per 100 single calls on `store`, from the server's
/// counters (other clients of the server during the run skew them).
async fn statement_counts(store: SharedStore, url: &str) -> Result<(f64, f64), BoxError> {
    let side = Side {
        guard: Idempotency::new(Duration::from_secs(3600)).store(store),
        run: tag(),
        next: AtomicUsize::new(0),
    };
    side.batch().await?;
    side.singles().await?;
    let rounds = 10u32;
    let count = |before: u64, after: u64| {
        // The counting query itself, once per reading.
        (after.saturating_sub(before).saturating_sub(1)) as f64 / f64::from(rounds)
    };
    let before = statements(url).await?;
    for _ in 0..rounds {
        side.batch().await?;
    }
    let batch = count(before, statements(url).await?);
    let before = statements(url).await?;
    for _ in 0..rounds {
        side.singles().await?;
    }
    let single = count(before, statements(url).await?);
    Ok((batch, single))
}

async fn sql<DB: Dialect>(name: &str, server: Server) -> Result<(), BoxError> {
    let table = Scratch::table(server);
    let counter = Counter::start(address(table.url()).await?).await?;
    let build = |url: String| {
        let table = table.name().to_string();
        async move {
            SqlStore::<DB>::builder(&url)
                .table(table)
                .max_connections(8)
                .build()
                .await
        }
    };
    let direct = Arc::new(build(table.url().to_string()).await?);
    let counted = Arc::new(build(through(table.url(), counter.addr)).await?);
    // MariaDB counts the statements clients send (`Questions`) at once; PostgreSQL's
    // counters are reported by its backends late and in bulk.
    let counting = std::env::var("IDEMPOTENT_BENCH_ONLY").is_err();
    let statements = match server {
        Server::MySql if counting => Some(statement_counts(direct.clone(), table.url()).await?),
        _ => None,
    };
    let seed_table = Scratch::table(server);
    let seed = Seed::sql(server, seed_table.url(), seed_table.name(), Row::Seed).await?;
    let seed_counted = seed
        .through(&through(seed_table.url(), counter.addr))
        .await?;
    // The store's migration makes the table the hand-written batch on the store's row writes.
    let row_table = Scratch::table(server);
    SqlStore::<DB>::builder(row_table.url())
        .table(row_table.name().to_string())
        .max_connections(1)
        .build()
        .await
        .map(drop)?;
    let on_store_row = Seed::sql(server, row_table.url(), row_table.name(), Row::Store).await?;
    if std::env::var("IDEMPOTENT_BENCH_STORE_ROW_EXPIRY_INDEX").is_ok_and(|v| v == "0") {
        on_store_row.drop_expiry_index().await?;
    }
    prefill(
        direct.clone(),
        &[&seed, &on_store_row],
        &[table.name(), seed_table.name(), row_table.name()],
    )
    .await?;
    let seeds = Seeds {
        seed: &seed,
        counted: &seed_counted,
        on_store_row: Some(&on_store_row),
    };
    measure(name, direct, counted, &counter, seeds, None).await?;
    if let Some((batch, single)) = statements {
        figure(&format!("{name}_batch_statements_per_100"), batch, 1);
        figure(&format!("{name}_single_statements_per_100"), single, 1);
    }
    if !counting {
        return Ok(());
    }
    // The same through a pool that does not check a connection each time it is taken
    // (sqlx's `test_before_acquire(false)`): the store's own statements alone.
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(8)
        .test_before_acquire(false)
        .connect(&through(table.url(), counter.addr))
        .await?;
    let unchecked = SqlStore::<DB>::from_pool(pool)
        .table(table.name().to_string())
        .build()
        .await?;
    let (batch, single) = round_trips(Arc::new(unchecked), &counter).await?;
    figure(
        &format!("{name}_batch_round_trips_per_100_unchecked_pool"),
        batch,
        1,
    );
    figure(
        &format!("{name}_single_round_trips_per_100_unchecked_pool"),
        single,
        1,
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let mut failed = false;
    // Under callgrind only the database of the side counted runs.
    let only = std::env::var("IDEMPOTENT_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|side| side.starts_with(name));
    let mut runs = Vec::new();
    if wanted("redis") {
        runs.push(("redis", redis().await));
    }
    if wanted("postgres") {
        let run = sql::<sqlx::Postgres>("postgres", Server::Postgres).await;
        runs.push(("postgres", run));
    }
    if wanted("mysql") {
        runs.push(("mysql", sql::<sqlx::MySql>("mysql", Server::MySql).await));
    }
    for (name, run) in runs {
        if let Err(err) = run {
            eprintln!("{name}: {err}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
