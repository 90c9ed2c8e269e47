//! The Redis backend against the seed design written by hand and against plain redis-rs
//! doing the backend's own round trips.
//!
//! Three sides run the same claim + complete cycle on the same shape of key (a 9-byte prefix,
//! `:v1:`, the run's tag and the id, as the framework encodes keys), with the same 16-byte owner
//! token, the framework's lease for a one-hour `ttl` and that `ttl`, over one shared
//! `ConnectionManager` (one multiplexed connection, as the store uses):
//!
//! - **seed**: the design of the articles this project grew from, what a user writes by hand
//!   without the library. Claim with one native command, `SET key token NX PX lease` (`OK`:
//!   acquired; nil: a duplicate or a call in flight); complete with a short Lua
//!   compare-and-set run by `EVALSHA` (`redis::Script`): if the key still holds the token, it
//!   becomes `done` with the `ttl`.
//! - **raw**: redis-rs sending the backend's own commands: the fast claim, `SET key <in-progress
//!   record> NX PX <ttl> GET`, then the completion script (`ending.lua`) by `EVALSHA`, with
//!   the arguments the store sends for a claim it wrote itself (the ttl, the claimed record
//!   as written, the completed record with the 5-byte result `replay` stores for `Ok(())`).
//!   It writes the very records the framework writes, so it is the framework without the
//!   framework's client-side work.
//! - **framework**: an `#[idempotent(..., replay)]` handler that only returns `Ok(())`, on a
//!   `RedisStore`. Its completed record carries the token, a fence and the result.
//!
//! What it measures, in one process against one Redis server:
//!
//! 1. **Throughput** of the cycle at 50 concurrent tasks on a multi-thread runtime. After a
//!    warm-up pass of each side, every round runs one pass of each side, the order rotating
//!    round by round so that each side goes first, second and third equally often; the median
//!    of each side is kept, and every pass uses fresh keys. Each pass also reports the commands
//!    per cycle the server executed (`INFO commandstats`, scripts' own calls included) and the
//!    CPU time per cycle of this process (all its threads) and of the server, which machine
//!    noise disturbs much less than the throughput.
//! 2. **Round trips per duplicate**: every key arrives three times at a framework handler
//!    without `replay` (each duplicate must come back as `Error::Duplicate`). During the
//!    second arrivals, the commands the server executed (the `calls=` of all the `cmdstat_*`
//!    lines of `INFO commandstats` but the bench's own `INFO`) per duplicate; Redis counts
//!    there the commands a script runs itself (`redis.call`) too, so this is server work, not
//!    round trips. During the third arrivals, the commands clients sent, seen through
//!    `MONITOR`: every line but those of scripts' own calls (`[0 lua]`) and the bench's end
//!    marker, per duplicate: the round trips. Native commands and scripts count alike (a
//!    pipelined command counts as one; `MONITOR` does not show admin commands).
//! 3. **Latency** of one task doing the cycle sequentially, the three sides taking turns cycle
//!    by cycle (the order rotating too): p50 and p99 of each.
//! 4. **Redis memory per completed record**: `used_memory` (`INFO memory`) before and after
//!    completing 100,000 records with a realistic key (`order:consume` + order id + activity
//!    id), without a stored result and with a replayed result of about 50 bytes; and, as a
//!    reference, the seed design's `done` records under the same keys.
//!
//! It needs a Redis server it may write to, at `IDEMPOTENT_REDIS_URL` (default
//! `redis://127.0.0.1:6379`). `INFO` and `MONITOR` figures are server-wide: other clients of
//! the same server during the run skew the command, round-trip, CPU and memory figures. Every
//! key the run writes carries a tag unique to the run and is deleted before it exits (and
//! expires after an hour if the run is killed).
//!
//! Run it with:
//!
//! ```text
//! cargo bench --bench redis --features redis
//! ```
//!
//! With `IDEMPOTENT_BENCH_ONLY=seed` (or `raw`, `framework`) it runs only
//! `IDEMPOTENT_BENCH_OPS` cycles of that side and prints nothing, for a profiler; the keys
//! are deleted as after a whole run.
//!
//! The last lines are the figures, one `name=value` per line:
//!
//! - `seed_design_cycles_per_s`, `framework_cycles_per_s`: median cycles per second at 50
//!   tasks; `ratio_vs_seed_design`, framework over seed. Target: at least 0.9.
//! - `server_us_per_cycle_seed_design`, `server_us_per_cycle_framework`: median Redis CPU
//!   time per cycle at 50 tasks, in microseconds. Target: the framework's at most 1.2 times
//!   the seed's.
//! - `raw_ops_per_s`: median cycles per second of the raw side (the same script);
//!   `ratio`, framework over raw: what the framework's client side costs.
//! - `seed_latency_p99_us`, `framework_latency_p99_us`: p99 of one cycle at 1 task, in
//!   microseconds; `latency_p99_ratio_vs_seed_design`, framework over seed. Target: the
//!   framework at 1 task at least 0.9 times as fast as the seed, so this ratio at most
//!   1 / 0.9, about 1.11.
//! - `duplicate_round_trips`: commands a client sends per duplicate arrival (`MONITOR`).
//! - `bytes_per_completed_record`: Redis memory per completed framework record without a
//!   stored result.

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "support/stats.rs"]
mod stats;

use std::fmt::Display;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idempotency::redis::RedisStore;
use idempotency::{idempotent, Idempotency, Key};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script, Value};
use redis_info::{client_cpu, info_field, server_cpu};
use serde::{Deserialize, Serialize};
use stats::{figure, median, per_s, percentile};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The backend's script, byte for byte.
const SCRIPT: &str = include_str!("../idempotent-runtime/src/store/redis/ending.lua");
/// The seed design's completion: a compare-and-set from the owner's token to `done`.
const SEED_COMPLETE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) and 1 else return 0 end";
/// What a completed seed-design key holds.
const SEED_DONE: &str = "done";
const DEFAULT_URL: &str = "redis://127.0.0.1:6379";
const START_REDIS: &str =
    "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no";

/// Concurrent tasks in the throughput passes.
const TASKS: usize = 50;
/// Distinct keys per throughput pass (and per warm-up pass).
const OPS: usize = 50_000;
/// Measured rounds; each round is one pass of each side. A multiple of the number of sides,
/// so that each side takes each place in the order equally often, and odd, so that the
/// median is one pass.
const ROUNDS: usize = 9;
/// Keys in the duplicates pass; each arrives three times.
const DUPLICATE_KEYS: usize = 20_000;
/// Sequential cycles per side in the latency pass (the sides take turns).
const LATENCY_OPS: usize = 5_000;
/// Records completed per memory pass.
const MEMORY_RECORDS: usize = 100_000;
/// The handlers' `ttl`, in seconds.
const TTL_SECS: u64 = 3600;
/// What `replay` stores for `Ok(())`: the `o` tag and the JSON `null`.
const UNIT_RESULT: &[u8] = b"onull";
/// Same length as the framework's prefix `bench:fwk`, so all sides send the same key bytes.
const RAW_PREFIX: &str = "bench:raw";
const SEED_PREFIX: &str = "bench:sed";
const FRAMEWORK_PREFIX: &str = "bench:fwk";
/// `INFO commandstats` entries the bench sends itself to measure: not counted as commands.
const MEASURING: &[&str] = &["info"];
const ACTIVITY_ID: &str = "free-meal-2026";

// ---------------------------------------------------------------------------------------
// The framework side.

/// The throughput and latency handler: the whole cost is the framework's.
#[idempotent(prefix = "bench:fwk", keys = [tag, id], ttl = 3600, store = store, replay)]
async fn framework_cycle(
    store: &Arc<RedisStore>,
    tag: &str,
    id: u64,
) -> Result<(), idempotency::Error> {
    Ok(())
}

/// The duplicates handler: no result stored, so a duplicate is `Error::Duplicate`.
#[idempotent(prefix = "bench:fwk", keys = [tag, id], ttl = 3600, store = store)]
async fn consume_cycle(
    store: &Arc<RedisStore>,
    tag: &str,
    id: u64,
) -> Result<(), idempotency::Error> {
    Ok(())
}

/// A consumer message, as in the quickstart.
#[derive(Debug)]
struct OrderMessage {
    order_id: String,
    activity_id: &'static str,
}

/// A consumer that stores no result: duplicates get `Error::Duplicate`.
#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600, store = store)]
async fn on_order(store: &Arc<RedisStore>, msg: &OrderMessage) -> Result<(), idempotency::Error> {
    Ok(())
}

/// A result of about 50 bytes once encoded for replay.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    meal: u64,
    kitchen: String,
    status: String,
}

impl Receipt {
    fn sample() -> Receipt {
        Receipt {
            meal: 1_234_567,
            kitchen: "north-7".into(),
            status: "cooked".into(),
        }
    }
}

/// A consumer whose result is replayed to duplicates.
#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600, store = store, replay)]
async fn on_order_receipt(
    store: &Arc<RedisStore>,
    msg: &OrderMessage,
) -> Result<Receipt, idempotency::Error> {
    Ok(Receipt::sample())
}

// ---------------------------------------------------------------------------------------
// The hand-written sides: the seed design and the raw same-script cycle.

/// What all sides share: the store, a plain connection, the scripts and the run's tag.
#[derive(Clone)]
struct Bench {
    store: Arc<RedisStore>,
    /// For the `MONITOR` connection of the round-trip count.
    client: Client,
    conn: ConnectionManager,
    /// The backend's `ending.lua` (its completion script), for the raw side.
    script: Arc<Script>,
    /// The seed design's compare-and-set completion.
    seed_complete: Arc<Script>,
    /// 8 hex digits, unique to this run; the start of the first key part of every key.
    run: String,
    /// The framework's lease for `TTL_SECS`, which the hand-written sides send too.
    lease_ms: u64,
    ttl_ms: u64,
}

static RAW_TOKENS: AtomicU64 = AtomicU64::new(1);

/// A 16-byte owner token, made the way the runtime makes its own (salt + counter).
fn raw_token(salt: u64) -> [u8; 16] {
    let mut token = [0u8; 16];
    token[..8].copy_from_slice(&salt.to_le_bytes());
    token[8..].copy_from_slice(&RAW_TOKENS.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    token
}

/// The key the framework would build for `prefix` with parts `[tag, id]`.
fn record_key(prefix: &str, tag: &str, id: u64) -> Vec<u8> {
    let id = id.to_string();
    format!("{prefix}:v1:{{{}:{tag},{}:{id}}}", tag.len(), id.len()).into_bytes()
}

/// One claim + complete cycle in plain redis-rs, the commands the store sends: the fast
/// claim (`SET key <in-progress record> NX PX <ttl> GET`, nil: acquired), then the completion
/// script by `EVALSHA`.
async fn raw_cycle(
    conn: &mut ConnectionManager,
    script: &Script,
    key: &[u8],
    token: &[u8; 16],
    lease_ms: u64,
    ttl_ms: u64,
) -> Result<(), BoxError> {
    let fence = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_micros();
    // The record's head, up to the fence's `:`; claimed at the fence's millisecond.
    let mut head = Vec::with_capacity(40);
    head.push(b'P');
    head.extend_from_slice(token);
    head.push(b'-');
    head.extend_from_slice(format!("{fence}:").as_bytes());
    let mut record = head.clone();
    let at_ms = fence / 1000;
    record.extend_from_slice(format!("{}:{at_ms}", at_ms + u128::from(lease_ms)).as_bytes());
    // The completed record: the head's fields after the state, no lease, the result.
    let mut completed = b"C".to_vec();
    completed.extend_from_slice(&head[1..]);
    completed.extend_from_slice(b"0:");
    completed.extend_from_slice(UNIT_RESULT);
    let claimed: Value = redis::cmd("SET")
        .arg(key)
        .arg(&record)
        .arg("NX")
        .arg("PX")
        .arg(lease_ms.max(ttl_ms))
        .arg("GET")
        .query_async(conn)
        .await?;
    if claimed != Value::Nil {
        return Err(format!("raw claim not acquired: {claimed:?}").into());
    }
    let mut complete = script.prepare_invoke();
    complete.key(key).arg(ttl_ms).arg(record).arg(completed);
    let completed: i64 = complete.invoke_async(conn).await?;
    if completed != 1 {
        return Err("raw completion refused".into());
    }
    Ok(())
}

/// One cycle of the seed design: `SET key token NX PX lease` to claim (nil: a duplicate or
/// in flight), then the compare-and-set to `done` by `EVALSHA`.
async fn seed_cycle(
    conn: &mut ConnectionManager,
    complete: &Script,
    key: &[u8],
    token: &[u8; 16],
    lease_ms: u64,
    ttl_ms: u64,
) -> Result<(), BoxError> {
    let claimed: Value = redis::cmd("SET")
        .arg(key)
        .arg(&token[..])
        .arg("NX")
        .arg("PX")
        .arg(lease_ms)
        .query_async(conn)
        .await?;
    match claimed {
        Value::Okay => {}
        other => return Err(format!("seed claim not acquired: {other:?}").into()),
    }
    let completed: i64 = complete
        .key(key)
        .arg(&token[..])
        .arg(SEED_DONE)
        .arg(ttl_ms)
        .invoke_async(conn)
        .await?;
    if completed != 1 {
        return Err("seed completion refused".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Passes.

/// What one throughput pass measured.
#[derive(Clone, Copy)]
struct PassFigures {
    ops_per_s: f64,
    /// CPU time of this process per cycle, in microseconds (NaN where unknown).
    client_us: f64,
    /// CPU time of the Redis server per cycle, in microseconds.
    server_us: f64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Seed,
    Raw,
    Framework,
}

/// Every side, in the order of the first round; later rounds rotate it.
const SIDES: [Side; 3] = [Side::Seed, Side::Raw, Side::Framework];

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Seed => "seed",
            Side::Raw => "raw",
            Side::Framework => "framework",
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Side::Seed => SEED_PREFIX,
            Side::Raw => RAW_PREFIX,
            Side::Framework => FRAMEWORK_PREFIX,
        }
    }

    /// The side's place in `SIDES`, to index per-side figures.
    fn index(self) -> usize {
        self as usize
    }

    /// `SIDES` rotated left by `turn`: turn by turn, each side goes first, second and third.
    fn rotation(turn: usize) -> [Side; 3] {
        std::array::from_fn(|i| SIDES[(i + turn) % SIDES.len()])
    }
}

/// The records a memory pass completes.
#[derive(Clone, Copy)]
enum Record {
    /// `on_order`: no stored result.
    NoResult,
    /// `on_order_receipt`: a replayed result of about 50 bytes.
    Replayed,
    /// The seed design by hand under the same keys: `done`.
    Seed,
}

impl Bench {
    /// The first key part of pass `pass`: the run's tag and the pass number, 11 bytes.
    fn tag(&self, pass: usize) -> String {
        format!("{}p{pass:02}", self.run)
    }

    /// The `SCAN` pattern of one side's keys in one pass.
    fn pattern(&self, side: Side, tag: &str) -> String {
        format!("{}:v1:{{{}:{tag},*", side.prefix(), tag.len())
    }

    /// The salt of the hand-written sides' tokens.
    fn salt(&self) -> Result<u64, BoxError> {
        Ok(u64::from_str_radix(&self.run, 16)?)
    }

    /// One claim + complete cycle of `side` on key `[tag, id]`.
    async fn cycle(
        &self,
        conn: &mut ConnectionManager,
        side: Side,
        tag: &str,
        id: u64,
        salt: u64,
    ) -> Result<(), BoxError> {
        match side {
            Side::Seed => {
                let key = record_key(SEED_PREFIX, tag, id);
                let token = raw_token(salt);
                seed_cycle(
                    conn,
                    &self.seed_complete,
                    &key,
                    &token,
                    self.lease_ms,
                    self.ttl_ms,
                )
                .await
            }
            Side::Raw => {
                let key = record_key(RAW_PREFIX, tag, id);
                let token = raw_token(salt);
                raw_cycle(conn, &self.script, &key, &token, self.lease_ms, self.ttl_ms).await
            }
            Side::Framework => Ok(framework_cycle(&self.store, tag, id).await?),
        }
    }

    /// `ops` cycles on distinct keys, split over `tasks` tasks; returns the elapsed time.
    async fn throughput(
        &self,
        side: Side,
        tag: &str,
        ops: usize,
        tasks: usize,
    ) -> Result<Duration, BoxError> {
        let salt = self.salt()?;
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for first in 0..tasks {
            let bench = self.clone();
            let tag = tag.to_string();
            set.spawn(async move {
                let mut conn = bench.conn.clone();
                for id in (first..ops).step_by(tasks) {
                    bench.cycle(&mut conn, side, &tag, id as u64, salt).await?;
                }
                Ok::<(), BoxError>(())
            });
        }
        while let Some(joined) = set.join_next().await {
            joined??;
        }
        Ok(start.elapsed())
    }

    /// One measured throughput pass, printed.
    async fn pass(
        &self,
        side: Side,
        label: &str,
        tag: &str,
        ops: usize,
    ) -> Result<PassFigures, BoxError> {
        let mut conn = self.conn.clone();
        let commands_before = commands_executed(&mut conn).await?;
        let server_before = server_cpu(&mut conn).await?;
        let client_before = client_cpu();
        let elapsed = self.throughput(side, tag, ops, TASKS).await?;
        let client_after = client_cpu();
        let server = server_cpu(&mut conn).await? - server_before;
        let commands = commands_executed(&mut conn).await? - commands_before;
        let figures = PassFigures {
            ops_per_s: per_s(ops, elapsed),
            client_us: client_before
                .zip(client_after)
                .map_or(f64::NAN, |(b, a)| (a - b) * 1e6 / ops as f64),
            server_us: server * 1e6 / ops as f64,
        };
        println!(
            "{label:<9} {:<9} {ops} cycles, {TASKS} tasks: {:>6.3} s, {:>6.0} cycles/s, \
             {:.2} server commands/cycle, CPU/cycle: client {:.1} us, server {:.1} us",
            side.name(),
            elapsed.as_secs_f64(),
            figures.ops_per_s,
            commands as f64 / ops as f64,
            figures.client_us,
            figures.server_us,
        );
        Ok(figures)
    }

    /// One arrival of every key of the duplicates pass through `consume_cycle`: first
    /// arrivals must run, later ones must be filtered. Returns how many calls were made.
    async fn arrivals(&self, tag: &str, duplicate: bool) -> Result<u64, BoxError> {
        let mut set = tokio::task::JoinSet::new();
        for first in 0..TASKS {
            let bench = self.clone();
            let tag = tag.to_string();
            set.spawn(async move {
                let mut calls = 0u64;
                for id in (first..DUPLICATE_KEYS).step_by(TASKS) {
                    match (
                        consume_cycle(&bench.store, &tag, id as u64).await,
                        duplicate,
                    ) {
                        (Ok(()), false) => {}
                        (Err(e), true) if e.is_duplicate() => {}
                        (outcome, _) => {
                            return Err(format!(
                                "key {id}, {}: unexpected {outcome:?}",
                                if duplicate {
                                    "duplicate"
                                } else {
                                    "first arrival"
                                }
                            )
                            .into())
                        }
                    }
                    calls += 1;
                }
                Ok::<u64, BoxError>(calls)
            });
        }
        let mut calls = 0;
        while let Some(joined) = set.join_next().await {
            calls += joined??;
        }
        Ok(calls)
    }

    /// Sequential cycles on one task, the sides taking turns (in an order rotating cycle by
    /// cycle) so that machine noise hits all of them; returns each side's cycle times in
    /// microseconds, sorted, indexed by `Side::index`.
    async fn latency(&self, tag: &str) -> Result<[Vec<f64>; 3], BoxError> {
        let bench = self.clone();
        let tag = tag.to_string();
        let salt = self.salt()?;
        tokio::spawn(async move {
            let mut conn = bench.conn.clone();
            let mut micros: [Vec<f64>; 3] =
                std::array::from_fn(|_| Vec::with_capacity(LATENCY_OPS));
            for id in 0..LATENCY_OPS as u64 {
                for side in Side::rotation(id as usize) {
                    let start = Instant::now();
                    bench.cycle(&mut conn, side, &tag, id, salt).await?;
                    micros[side.index()].push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
            for side in &mut micros {
                side.sort_by(f64::total_cmp);
            }
            Ok::<_, BoxError>(micros)
        })
        .await?
    }

    /// Runs `work` while a `MONITOR` connection watches the server; returns its outcome and
    /// the commands clients sent meanwhile: every line but those of scripts' own calls
    /// (`[0 lua]`) and of the marker that ends the count, and of them, those naming `tag`.
    async fn client_commands<T>(
        &self,
        tag: &str,
        work: impl std::future::Future<Output = Result<T, BoxError>>,
    ) -> Result<(T, u64, u64), BoxError> {
        let marker = format!("round-trip-count-end-{}", self.run);
        // Once this returns, the server has answered `MONITOR`: it shows every later command.
        let monitor = self.client.get_async_monitor().await?;
        let counting = {
            let marker = marker.clone();
            let tag = format!("{{{}:{tag},", tag.len());
            tokio::spawn(async move {
                let mut lines = monitor.into_on_message::<String>();
                let (mut commands, mut naming) = (0u64, 0u64);
                while let Some(line) = lines.next().await {
                    if line.contains(&marker) {
                        return Ok((commands, naming));
                    }
                    // `<time> [<db> <client address, or lua>] "<command>" "<argument>" ...`
                    let source = line
                        .split_once('[')
                        .and_then(|(_, rest)| rest.split_once(']'))
                        .map(|(source, _)| source);
                    match source {
                        Some(source) if source.split_whitespace().nth(1) == Some("lua") => {}
                        Some(_) => {
                            commands += 1;
                            naming += u64::from(line.contains(&tag));
                        }
                        None => return Err(format!("unexpected MONITOR line {line:?}").into()),
                    }
                }
                Err::<(u64, u64), BoxError>("the MONITOR connection closed".into())
            })
        };
        let outcome = work.await;
        let _: String = redis::cmd("ECHO")
            .arg(&marker)
            .query_async(&mut self.conn.clone())
            .await?;
        let (commands, naming) = tokio::time::timeout(Duration::from_secs(60), counting)
            .await
            .map_err(|_| "MONITOR: no end marker within 60 s")???;
        Ok((outcome?, commands, naming))
    }

    /// Deletes every key matching `pattern` (`SCAN` + `UNLINK` in batches); returns how many.
    async fn delete_matching(&self, pattern: &str) -> Result<u64, BoxError> {
        let mut conn = self.conn.clone();
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            for batch in keys.chunks(500) {
                let n: u64 = redis::cmd("UNLINK")
                    .arg(batch)
                    .query_async(&mut conn)
                    .await?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }

    /// `used_memory` once the server has shrunk its hash tables after earlier deletions
    /// (its cron does that within a second or so), so that each memory pass pays for the
    /// table growth its records cause, like a server that holds that many records.
    async fn settled_memory(&self) -> Result<u64, BoxError> {
        let mut conn = self.conn.clone();
        let mut last = used_memory(&mut conn).await?;
        let mut stable = 0;
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = used_memory(&mut conn).await?;
            stable = if now + 4096 >= last { stable + 1 } else { 0 };
            last = last.min(now);
            if stable == 2 {
                break;
            }
        }
        Ok(last)
    }

    /// Completes `MEMORY_RECORDS` records of kind `record` and returns the growth of
    /// `used_memory` per record; deletes them afterwards.
    async fn memory(&self, variant: char, record: Record) -> Result<f64, BoxError> {
        let mut conn = self.conn.clone();
        let salt = self.salt()?;
        let before = self.settled_memory().await?;
        let mut set = tokio::task::JoinSet::new();
        for first in 0..TASKS {
            let bench = self.clone();
            set.spawn(async move {
                let mut conn = bench.conn.clone();
                for i in (first..MEMORY_RECORDS).step_by(TASKS) {
                    let msg = OrderMessage {
                        order_id: format!("{}{variant}{i:07}", bench.run),
                        activity_id: ACTIVITY_ID,
                    };
                    match record {
                        Record::NoResult => on_order(&bench.store, &msg).await?,
                        Record::Replayed => {
                            on_order_receipt(&bench.store, &msg).await?;
                        }
                        Record::Seed => {
                            let key =
                                Key::new("order:consume", 1, &[&msg.order_id, &msg.activity_id])?;
                            seed_cycle(
                                &mut conn,
                                &bench.seed_complete,
                                key.as_bytes(),
                                &raw_token(salt),
                                bench.lease_ms,
                                bench.ttl_ms,
                            )
                            .await?;
                        }
                    }
                }
                Ok::<(), BoxError>(())
            });
        }
        while let Some(joined) = set.join_next().await {
            joined??;
        }
        let after = used_memory(&mut conn).await?;
        let sample = OrderMessage {
            order_id: format!("{}{variant}{:07}", self.run, 0),
            activity_id: ACTIVITY_ID,
        };
        let key = Key::new("order:consume", 1, &[&sample.order_id, &sample.activity_id])?;
        let value: Vec<u8> = redis::cmd("GET")
            .arg(key.as_bytes())
            .query_async(&mut conn)
            .await?;
        let pattern = format!(
            "order:consume:v1:{{{}:{}{variant}*",
            sample.order_id.len(),
            self.run
        );
        let deleted = self.delete_matching(&pattern).await?;
        if deleted != MEMORY_RECORDS as u64 {
            return Err(format!(
                "memory pass: deleted {deleted} records, expected {MEMORY_RECORDS}"
            )
            .into());
        }
        let per_record = after.saturating_sub(before) as f64 / MEMORY_RECORDS as f64;
        println!(
            "memory    {MEMORY_RECORDS} completed records ({}): key {} bytes ({}), value {} bytes; \
             used_memory {before} -> {after}: {per_record:.1} bytes/record",
            match record {
                Record::NoResult => "no result",
                Record::Replayed => "replayed result",
                Record::Seed => "seed design, `done`, for reference",
            },
            key.as_bytes().len(),
            key,
            value.len(),
        );
        Ok(per_record)
    }
}

/// Commands the server has executed since its start or `CONFIG RESETSTAT`: the `calls=` of
/// every `cmdstat_*` line of `INFO commandstats`, native commands and scripts alike, but the
/// ones the bench sends itself to measure (`MEASURING`).
async fn commands_executed(conn: &mut ConnectionManager) -> Result<u64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut total = 0;
    for line in info.lines() {
        let Some((command, stats)) = line
            .strip_prefix("cmdstat_")
            .and_then(|rest| rest.split_once(':'))
        else {
            continue;
        };
        if MEASURING.contains(&command) {
            continue;
        }
        let calls = stats
            .split(',')
            .find_map(|field| field.strip_prefix("calls="))
            .ok_or_else(|| format!("no calls= in {line:?}"))?;
        total += calls.trim().parse::<u64>()?;
    }
    Ok(total)
}

async fn used_memory(conn: &mut ConnectionManager) -> Result<u64, BoxError> {
    info_field(conn, "memory", "used_memory:").await
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***{}", &url[..scheme], &url[at..])
        }
        _ => url.to_string(),
    }
}

fn unreachable(url: &str, err: impl Display) -> BoxError {
    format!(
        "cannot reach Redis at {} ({err}).\n\
         Start a local server with\n    {START_REDIS}\n\
         or set IDEMPOTENT_REDIS_URL to a server this benchmark may write to.",
        redact(url)
    )
    .into()
}

async fn connect(url: &str) -> Result<Bench, BoxError> {
    let client = Client::open(url).map_err(|e| unreachable(url, e))?;
    // The same settings as the store's connection.
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(Duration::from_secs(1)))
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_number_of_retries(2);
    let mut conn = ConnectionManager::new_with_config(client.clone(), config)
        .await
        .map_err(|e| unreachable(url, e))?;
    let _: String = redis::cmd("PING")
        .query_async(&mut conn)
        .await
        .map_err(|e| unreachable(url, e))?;
    let store = RedisStore::connect(url)
        .await
        .map_err(|e| format!("RedisStore::connect({}): {e}", redact(url)))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let run = format!(
        "{:08x}",
        (nanos ^ (u64::from(std::process::id()) << 20)) as u32
    );
    let ttl = Duration::from_secs(TTL_SECS);
    Ok(Bench {
        store: Arc::new(store),
        client,
        conn,
        script: Arc::new(Script::new(SCRIPT)),
        seed_complete: Arc::new(Script::new(SEED_COMPLETE)),
        run,
        lease_ms: Idempotency::new(ttl).lease_duration().as_millis() as u64,
        ttl_ms: ttl.as_millis() as u64,
    })
}

/// Checks that the raw side writes the framework's record for the same shape of key, and
/// that the seed side leaves `done` with the `ttl` under a key of the same length.
async fn compare_records(bench: &Bench, tags: &[String; 3]) -> Result<(), BoxError> {
    let mut conn = bench.conn.clone();
    let [seed_tag, raw_tag, framework_tag] = tags;
    let seed = record_key(SEED_PREFIX, seed_tag, 0);
    let raw = record_key(RAW_PREFIX, raw_tag, 0);
    let framework = Key::new(FRAMEWORK_PREFIX, 1, &[&framework_tag, &0u64])?;
    for (key, prefix, tag) in [(&seed, SEED_PREFIX, seed_tag), (&raw, RAW_PREFIX, raw_tag)] {
        let expected = Key::new(prefix, 1, &[&tag, &0u64])?;
        if *key != expected.as_bytes() {
            return Err(format!(
                "key {} differs from the framework's encoding {expected}",
                String::from_utf8_lossy(key)
            )
            .into());
        }
    }
    if seed.len() != framework.as_bytes().len() || raw.len() != framework.as_bytes().len() {
        return Err("the sides' keys differ in length".into());
    }
    let raw_value: Vec<u8> = redis::cmd("GET").arg(&raw).query_async(&mut conn).await?;
    let framework_value: Vec<u8> = redis::cmd("GET")
        .arg(framework.as_bytes())
        .query_async(&mut conn)
        .await?;
    let same_shape = raw_value.len() == framework_value.len()
        && raw_value.first() == Some(&b'C')
        && framework_value.first() == Some(&b'C')
        && raw_value.ends_with(UNIT_RESULT)
        && framework_value.ends_with(UNIT_RESULT);
    if !same_shape {
        return Err(format!(
            "records differ: raw {:?}, framework {:?}",
            raw_value.escape_ascii().to_string(),
            framework_value.escape_ascii().to_string()
        )
        .into());
    }
    let seed_value: Vec<u8> = redis::cmd("GET").arg(&seed).query_async(&mut conn).await?;
    let seed_pttl: i64 = redis::cmd("PTTL").arg(&seed).query_async(&mut conn).await?;
    if seed_value != SEED_DONE.as_bytes() || seed_pttl <= bench.lease_ms as i64 {
        return Err(format!(
            "seed record {:?} with PTTL {seed_pttl} ms, expected {SEED_DONE:?} with the ttl",
            seed_value.escape_ascii().to_string()
        )
        .into());
    }
    println!(
        "records   raw and framework the same shape: key {} bytes, value {} bytes; \
         seed: key {} bytes, value {} bytes ({SEED_DONE:?})",
        raw.len(),
        raw_value.len(),
        seed.len(),
        seed_value.len(),
    );
    Ok(())
}

/// Per-side figures, indexed by `Side::index`.
type PerSide<T> = [T; 3];

async fn run(bench: &Bench) -> Result<(), BoxError> {
    let mut conn = bench.conn.clone();
    let mut pass = 0;
    let mut next_tag = || {
        pass += 1;
        bench.tag(pass)
    };

    // Warm-up: connections, the scripts in the server's cache, allocators, the runtime.
    let warm_tags: PerSide<String> = std::array::from_fn(|_| next_tag());
    for side in SIDES {
        bench
            .pass(side, "warm-up", &warm_tags[side.index()], OPS)
            .await?;
    }
    compare_records(bench, &warm_tags).await?;
    for side in SIDES {
        bench
            .delete_matching(&bench.pattern(side, &warm_tags[side.index()]))
            .await?;
    }

    // Measured rounds, the order rotating round by round.
    let mut ops: PerSide<Vec<f64>> = Default::default();
    let mut client: PerSide<Vec<f64>> = Default::default();
    let mut server: PerSide<Vec<f64>> = Default::default();
    let (mut vs_seed, mut vs_raw) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        let mut rates = [0.0; 3];
        for side in Side::rotation(round - 1) {
            let tag = next_tag();
            let figures = bench
                .pass(side, &format!("round {round}"), &tag, OPS)
                .await?;
            let i = side.index();
            rates[i] = figures.ops_per_s;
            ops[i].push(figures.ops_per_s);
            client[i].push(figures.client_us);
            server[i].push(figures.server_us);
            bench.delete_matching(&bench.pattern(side, &tag)).await?;
        }
        let [seed, raw, framework] = rates;
        vs_seed.push(framework / seed);
        vs_raw.push(framework / raw);
        println!(
            "round {round:<3} framework/seed {:.3}, framework/raw {:.3}",
            framework / seed,
            framework / raw
        );
    }
    let [seed_ops, raw_ops, framework_ops] = ops.each_ref().map(|v| median(v));
    let [seed_server, raw_server, framework_server] = server.each_ref().map(|v| median(v));
    let [seed_client, raw_client, framework_client] = client.each_ref().map(|v| median(v));
    println!(
        "median    seed {seed_ops:.0}, raw {raw_ops:.0}, framework {framework_ops:.0} cycles/s \
         over {ROUNDS} rounds; median of per-round ratios: framework/seed {:.3}, \
         framework/raw {:.3}",
        median(&vs_seed),
        median(&vs_raw),
    );
    println!(
        "median    CPU/cycle: client seed {seed_client:.1} us, raw {raw_client:.1} us, \
         framework {framework_client:.1} us; server seed {seed_server:.1} us, \
         raw {raw_server:.1} us, framework {framework_server:.1} us",
    );

    // Duplicates: each key arrives three times; the second and third are duplicates. The
    // second arrivals count the server's commands, the third ones the clients' (`MONITOR`,
    // which slows the server, so they are not timed).
    let tag = next_tag();
    let started = Instant::now();
    let firsts = bench.arrivals(&tag, false).await?;
    let first_elapsed = started.elapsed();
    let commands_before = commands_executed(&mut conn).await?;
    let started = Instant::now();
    let duplicates = bench.arrivals(&tag, true).await?;
    let elapsed = started.elapsed();
    let commands = commands_executed(&mut conn).await? - commands_before;
    let (monitored, sent, naming) = bench
        .client_commands(&tag, bench.arrivals(&tag, true))
        .await?;
    let round_trips = sent as f64 / monitored as f64;
    println!(
        "dupes     {DUPLICATE_KEYS} keys x 3 arrivals, {TASKS} tasks: {firsts} first arrivals {:.0} ops/s; \
         {duplicates} duplicates {:.0} ops/s, {commands} server commands (scripts' own calls \
         included) = {:.3}/duplicate; {monitored} duplicates under MONITOR: {sent} client \
         commands ({naming} naming this pass's keys) = {round_trips:.3} round trips/duplicate",
        per_s(firsts as usize, first_elapsed),
        per_s(duplicates as usize, elapsed),
        commands as f64 / duplicates as f64,
    );
    bench
        .delete_matching(&bench.pattern(Side::Framework, &tag))
        .await?;

    // Latency: one task, sequential cycles, the sides taking turns.
    let tag = next_tag();
    let micros = bench.latency(&tag).await?;
    for side in SIDES {
        let micros = &micros[side.index()];
        println!(
            "latency   {:<9} 1 task, {LATENCY_OPS} cycles: p50 {:.0} us, p99 {:.0} us",
            side.name(),
            percentile(micros, 0.50),
            percentile(micros, 0.99),
        );
        bench.delete_matching(&bench.pattern(side, &tag)).await?;
    }
    let seed_p99 = percentile(&micros[Side::Seed.index()], 0.99);
    let framework_p99 = percentile(&micros[Side::Framework.index()], 0.99);

    // Memory per completed record.
    let bytes_per_record = bench.memory('a', Record::NoResult).await?;
    bench.memory('b', Record::Replayed).await?;
    bench.memory('c', Record::Seed).await?;

    figure("seed_design_cycles_per_s", seed_ops, 0);
    figure("framework_cycles_per_s", framework_ops, 0);
    figure("ratio_vs_seed_design", framework_ops / seed_ops, 3);
    figure("server_us_per_cycle_seed_design", seed_server, 1);
    figure("server_us_per_cycle_framework", framework_server, 1);
    figure("raw_ops_per_s", raw_ops, 0);
    figure("ratio", framework_ops / raw_ops, 3);
    figure("seed_latency_p99_us", seed_p99, 0);
    figure("framework_latency_p99_us", framework_p99, 0);
    figure(
        "latency_p99_ratio_vs_seed_design",
        framework_p99 / seed_p99,
        3,
    );
    // A whole number of round trips prints as one.
    let whole = (round_trips - round_trips.round()).abs() < 0.0005;
    figure(
        "duplicate_round_trips",
        round_trips,
        if whole { 0 } else { 3 },
    );
    figure("bytes_per_completed_record", bytes_per_record, 0);
    Ok(())
}

/// `IDEMPOTENT_BENCH_ONLY=seed|raw|framework`: only `IDEMPOTENT_BENCH_OPS` (default 2,000)
/// cycles of one side at 50 tasks, nothing printed; for a profiler (`valgrind
/// --tool=callgrind` counts this process's instructions: the difference of two runs with
/// different counts, divided by the difference of the counts, is the client's work per cycle).
async fn one_side(bench: &Bench, side: &str) -> Result<(), BoxError> {
    let side = SIDES
        .into_iter()
        .find(|s| s.name() == side)
        .ok_or_else(|| format!("IDEMPOTENT_BENCH_ONLY={side}: not seed, raw or framework"))?;
    let ops = match std::env::var("IDEMPOTENT_BENCH_OPS") {
        Ok(ops) => ops.parse()?,
        Err(_) => 2_000,
    };
    bench.throughput(side, &bench.tag(1), ops, TASKS).await?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let url = std::env::var("IDEMPOTENT_REDIS_URL").unwrap_or_else(|_| DEFAULT_URL.to_string());
    let bench = match connect(&url).await {
        Ok(bench) => bench,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "redis bench: {} (run tag {}), lease {} ms, ttl {} ms",
        redact(&url),
        bench.run,
        bench.lease_ms,
        bench.ttl_ms
    );
    let outcome = match std::env::var("IDEMPOTENT_BENCH_ONLY") {
        Ok(side) => one_side(&bench, &side).await,
        Err(_) => run(&bench).await,
    };

    // Whatever happened, remove every key of this run.
    let mut removed = 0;
    let tag_len = bench.tag(0).len();
    let mut patterns: Vec<String> = SIDES
        .iter()
        .map(|side| format!("{}:v1:{{{tag_len}:{}*", side.prefix(), bench.run))
        .collect();
    patterns.push(format!(
        "order:consume:v1:{{{}:{}*",
        bench.run.len() + 8,
        bench.run
    ));
    for pattern in patterns {
        match bench.delete_matching(&pattern).await {
            Ok(n) => removed += n,
            Err(err) => eprintln!("cleanup of {pattern} failed: {err}"),
        }
    }
    if removed > 0 {
        eprintln!(
            "cleanup: removed {removed} leftover keys of run {}",
            bench.run
        );
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
