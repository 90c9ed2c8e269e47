//! The Redis backend against plain redis-rs doing the same round trips.
//!
//! What it measures, in one process against one Redis server:
//!
//! 1. **Throughput** of a claim + complete cycle at 50 concurrent tasks on a multi-thread
//!    runtime. "raw" is redis-rs alone: one shared `ConnectionManager` (one multiplexed
//!    connection, as the store uses) calling the backend's own script (`record.lua`) by
//!    `EVALSHA`, first `claim`, then `complete`, with the arguments the store sends (16-byte
//!    token, lease and ttl in ms, empty fingerprint, the 5-byte result `replay` stores for
//!    `Ok(())`). "framework" is an `#[idempotent(..., replay)]` handler that only returns
//!    `Ok(())`, on a `RedisStore`. After a warm-up pass of each, raw and framework passes
//!    alternate (5 rounds) and the median of each side is kept; every pass uses fresh keys.
//!    Each pass also reports the CPU time per cycle of this process (all its threads) and of
//!    the server, which machine noise disturbs much less than the throughput.
//! 2. **Round trips per duplicate**: every key arrives three times at a handler without
//!    `replay` (each duplicate must come back as `Error::Duplicate`); the `EVALSHA` calls the
//!    server counted (`INFO commandstats`) during the second and third arrivals, divided by
//!    their number.
//! 3. **Latency** of one task doing the cycle sequentially, raw and framework taking turns
//!    cycle by cycle: p50 and p99 of each.
//! 4. **Redis memory per completed record**: `used_memory` (`INFO memory`) before and after
//!    completing 100,000 records with a realistic key (`order:consume` + order id + activity
//!    id), without a stored result and with a replayed result of about 50 bytes.
//!
//! It needs a Redis server it may write to, at `IDEMPOTENT_REDIS_URL` (default
//! `redis://127.0.0.1:6379`). `INFO` figures are server-wide: other clients of the same
//! server during the run skew the round-trip and memory figures. Every key the run writes
//! carries a tag unique to the run and is deleted before it exits (and expires after an hour
//! if the run is killed).
//!
//! Run it with:
//!
//! ```text
//! cargo bench --bench redis --features redis
//! ```
//!
//! The last lines are the figures, one `name=value` per line: `raw_ops_per_s`,
//! `framework_ops_per_s`, `ratio`, `duplicate_round_trips`, `bytes_per_completed_record`.

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

use idempotency::{idempotent, Idempotency, Key, RedisStore};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Script, Value};
use redis_info::{client_cpu, info_field, server_cpu};
use serde::{Deserialize, Serialize};
use stats::{figure, median, per_s, percentile};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The backend's script, byte for byte.
const SCRIPT: &str = include_str!("../idempotent-runtime/src/store/redis/record.lua");
const DEFAULT_URL: &str = "redis://127.0.0.1:6379";
const START_REDIS: &str =
    "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no";

/// Concurrent tasks in the throughput passes.
const TASKS: usize = 50;
/// Distinct keys per throughput pass (and per warm-up pass).
const OPS: usize = 50_000;
/// Measured rounds; each round is one raw and one framework pass.
const ROUNDS: usize = 5;
/// Keys in the duplicates pass; each arrives three times.
const DUPLICATE_KEYS: usize = 20_000;
/// Sequential cycles per side in the latency pass (raw and framework take turns).
const LATENCY_OPS: usize = 5_000;
/// Records completed per memory pass.
const MEMORY_RECORDS: usize = 100_000;
/// The handlers' `ttl`, in seconds.
const TTL_SECS: u64 = 3600;
/// What `replay` stores for `Ok(())`: the `o` tag and the JSON `null`.
const UNIT_RESULT: &[u8] = b"onull";
/// Same length as the framework's prefix `bench:fwk`, so both sides send the same bytes.
const RAW_PREFIX: &str = "bench:raw";
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
// The raw side.

/// What both sides share: the store, a plain connection, the script and the run's tag.
#[derive(Clone)]
struct Bench {
    store: Arc<RedisStore>,
    conn: ConnectionManager,
    script: Arc<Script>,
    /// 8 hex digits, unique to this run; the start of the first key part of every key.
    run: String,
    /// The framework's lease for `TTL_SECS`, which the raw side sends too.
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

/// The key the framework would build for `bench:raw` with parts `[tag, id]`.
fn raw_key(tag: &str, id: u64) -> Vec<u8> {
    let id = id.to_string();
    format!("{RAW_PREFIX}:v1:{{{}:{tag},{}:{id}}}", tag.len(), id.len()).into_bytes()
}

/// One claim + complete cycle in plain redis-rs: two `EVALSHA` round trips.
async fn raw_cycle(
    conn: &mut ConnectionManager,
    script: &Script,
    key: &[u8],
    token: &[u8; 16],
    lease_ms: u64,
    ttl_ms: u64,
) -> Result<(), BoxError> {
    let mut claim = script.prepare_invoke();
    claim
        .key(key)
        .arg("claim")
        .arg(&token[..])
        .arg(lease_ms)
        .arg(ttl_ms)
        .arg(&b""[..]);
    match claim.invoke_async::<Value>(conn).await? {
        Value::Array(items) if items.first() == Some(&Value::Int(1)) => {}
        other => return Err(format!("raw claim not acquired: {other:?}").into()),
    }
    let mut complete = script.prepare_invoke();
    complete
        .key(key)
        .arg("complete")
        .arg(&token[..])
        .arg(ttl_ms)
        .arg(UNIT_RESULT);
    let completed: i64 = complete.invoke_async(conn).await?;
    if completed != 1 {
        return Err("raw completion refused".into());
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Raw,
    Framework,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::Framework => "framework",
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Side::Raw => RAW_PREFIX,
            Side::Framework => "bench:fwk",
        }
    }
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

    /// `ops` cycles on distinct keys, split over `tasks` tasks; returns the elapsed time.
    async fn throughput(
        &self,
        side: Side,
        tag: &str,
        ops: usize,
        tasks: usize,
    ) -> Result<Duration, BoxError> {
        let salt = u64::from_str_radix(&self.run, 16)?;
        let start = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for first in 0..tasks {
            let bench = self.clone();
            let tag = tag.to_string();
            set.spawn(async move {
                let mut conn = bench.conn.clone();
                for id in (first..ops).step_by(tasks) {
                    let id = id as u64;
                    match side {
                        Side::Raw => {
                            let key = raw_key(&tag, id);
                            let token = raw_token(salt);
                            raw_cycle(
                                &mut conn,
                                &bench.script,
                                &key,
                                &token,
                                bench.lease_ms,
                                bench.ttl_ms,
                            )
                            .await?;
                        }
                        Side::Framework => framework_cycle(&bench.store, &tag, id).await?,
                    }
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
        let calls_before = evalsha_calls(&mut conn).await?;
        let server_before = server_cpu(&mut conn).await?;
        let client_before = client_cpu();
        let elapsed = self.throughput(side, tag, ops, TASKS).await?;
        let client_after = client_cpu();
        let server = server_cpu(&mut conn).await? - server_before;
        let calls = evalsha_calls(&mut conn).await? - calls_before;
        let figures = PassFigures {
            ops_per_s: per_s(ops, elapsed),
            client_us: client_before
                .zip(client_after)
                .map_or(f64::NAN, |(b, a)| (a - b) * 1e6 / ops as f64),
            server_us: server * 1e6 / ops as f64,
        };
        println!(
            "{label:<9} {:<9} {ops} cycles, {TASKS} tasks: {:>6.3} s, {:>6.0} ops/s, \
             {:.2} EVALSHA/cycle, CPU/cycle: client {:.1} us, server {:.1} us",
            side.name(),
            elapsed.as_secs_f64(),
            figures.ops_per_s,
            calls as f64 / ops as f64,
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

    /// Sequential cycles on one task, raw and framework taking turns so that machine noise
    /// hits both; returns each side's cycle times in microseconds, sorted.
    async fn latency(&self, tag: &str) -> Result<(Vec<f64>, Vec<f64>), BoxError> {
        let bench = self.clone();
        let tag = tag.to_string();
        let salt = u64::from_str_radix(&self.run, 16)?;
        tokio::spawn(async move {
            let mut conn = bench.conn.clone();
            let mut raw = Vec::with_capacity(LATENCY_OPS);
            let mut framework = Vec::with_capacity(LATENCY_OPS);
            for id in 0..LATENCY_OPS as u64 {
                let key = raw_key(&tag, id);
                let token = raw_token(salt);
                let start = Instant::now();
                raw_cycle(
                    &mut conn,
                    &bench.script,
                    &key,
                    &token,
                    bench.lease_ms,
                    bench.ttl_ms,
                )
                .await?;
                raw.push(start.elapsed().as_secs_f64() * 1e6);

                let start = Instant::now();
                framework_cycle(&bench.store, &tag, id).await?;
                framework.push(start.elapsed().as_secs_f64() * 1e6);
            }
            raw.sort_by(f64::total_cmp);
            framework.sort_by(f64::total_cmp);
            Ok::<_, BoxError>((raw, framework))
        })
        .await?
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

    /// Completes `MEMORY_RECORDS` records through `on_order` (or `on_order_receipt`) and
    /// returns the growth of `used_memory` per record; deletes them afterwards.
    async fn memory(&self, variant: char, with_result: bool) -> Result<f64, BoxError> {
        let mut conn = self.conn.clone();
        let before = self.settled_memory().await?;
        let mut set = tokio::task::JoinSet::new();
        for first in 0..TASKS {
            let bench = self.clone();
            set.spawn(async move {
                for i in (first..MEMORY_RECORDS).step_by(TASKS) {
                    let msg = OrderMessage {
                        order_id: format!("{}{variant}{i:07}", bench.run),
                        activity_id: ACTIVITY_ID,
                    };
                    if with_result {
                        on_order_receipt(&bench.store, &msg).await?;
                    } else {
                        on_order(&bench.store, &msg).await?;
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
            if with_result {
                "replayed result"
            } else {
                "no result"
            },
            key.as_bytes().len(),
            key,
            value.len(),
        );
        Ok(per_record)
    }
}

/// How many `EVALSHA` calls the server has counted since its start or `CONFIG RESETSTAT`.
async fn evalsha_calls(conn: &mut ConnectionManager) -> Result<u64, BoxError> {
    info_field(conn, "commandstats", "cmdstat_evalsha:calls=").await
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
    let mut conn = ConnectionManager::new_with_config(client, config)
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
        conn,
        script: Arc::new(Script::new(SCRIPT)),
        run,
        lease_ms: Idempotency::new(ttl).lease_duration().as_millis() as u64,
        ttl_ms: ttl.as_millis() as u64,
    })
}

/// Checks that both sides write the same record for the same shape of key.
async fn compare_records(
    bench: &Bench,
    raw_tag: &str,
    framework_tag: &str,
) -> Result<(), BoxError> {
    let mut conn = bench.conn.clone();
    let raw = raw_key(raw_tag, 0);
    let framework = Key::new("bench:fwk", 1, &[&framework_tag, &0u64])?;
    let expected = Key::new(RAW_PREFIX, 1, &[&raw_tag, &0u64])?;
    if raw != expected.as_bytes() {
        return Err(format!(
            "raw key {} differs from the framework's encoding {expected}",
            String::from_utf8_lossy(&raw)
        )
        .into());
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
    println!(
        "records   same shape on both sides: key {} bytes, value {} bytes",
        raw.len(),
        raw_value.len()
    );
    Ok(())
}

async fn run(bench: &Bench) -> Result<(), BoxError> {
    let mut conn = bench.conn.clone();
    let mut pass = 0;
    let mut next_tag = || {
        pass += 1;
        bench.tag(pass)
    };

    // Warm-up: connections, the script cache on the server, allocators, the runtime.
    let raw_tag = next_tag();
    bench.pass(Side::Raw, "warm-up", &raw_tag, OPS).await?;
    let framework_tag = next_tag();
    bench
        .pass(Side::Framework, "warm-up", &framework_tag, OPS)
        .await?;
    compare_records(bench, &raw_tag, &framework_tag).await?;
    bench
        .delete_matching(&bench.pattern(Side::Raw, &raw_tag))
        .await?;
    bench
        .delete_matching(&bench.pattern(Side::Framework, &framework_tag))
        .await?;

    // Measured rounds, alternating which side goes first.
    let mut raw = Vec::new();
    let mut framework = Vec::new();
    let mut paired = Vec::new();
    let (mut raw_client, mut framework_client) = (Vec::new(), Vec::new());
    let (mut raw_server, mut framework_server) = (Vec::new(), Vec::new());
    for round in 1..=ROUNDS {
        let order = if round % 2 == 1 {
            [Side::Raw, Side::Framework]
        } else {
            [Side::Framework, Side::Raw]
        };
        for side in order {
            let tag = next_tag();
            let figures = bench
                .pass(side, &format!("round {round}"), &tag, OPS)
                .await?;
            let (ops, client, server) = match side {
                Side::Raw => (&mut raw, &mut raw_client, &mut raw_server),
                Side::Framework => (&mut framework, &mut framework_client, &mut framework_server),
            };
            ops.push(figures.ops_per_s);
            client.push(figures.client_us);
            server.push(figures.server_us);
            bench.delete_matching(&bench.pattern(side, &tag)).await?;
        }
        paired.push(framework[round - 1] / raw[round - 1]);
    }
    let raw_ops = median(&raw);
    let framework_ops = median(&framework);
    println!(
        "median    raw {raw_ops:.0} ops/s, framework {framework_ops:.0} ops/s over {ROUNDS} rounds; \
         median of per-round ratios {:.3}",
        median(&paired)
    );
    println!(
        "median    CPU/cycle: client raw {:.1} us, framework {:.1} us; server raw {:.1} us, framework {:.1} us",
        median(&raw_client),
        median(&framework_client),
        median(&raw_server),
        median(&framework_server),
    );

    // Duplicates: each key arrives three times; the second and third are duplicates.
    let tag = next_tag();
    let started = Instant::now();
    let firsts = bench.arrivals(&tag, false).await?;
    let first_elapsed = started.elapsed();
    let calls_before = evalsha_calls(&mut conn).await?;
    let started = Instant::now();
    let duplicates = bench.arrivals(&tag, true).await? + bench.arrivals(&tag, true).await?;
    let elapsed = started.elapsed();
    let calls = evalsha_calls(&mut conn).await? - calls_before;
    let round_trips = calls as f64 / duplicates as f64;
    println!(
        "dupes     {DUPLICATE_KEYS} keys x 3 arrivals, {TASKS} tasks: {firsts} first arrivals {:.0} ops/s; \
         {duplicates} duplicates {:.0} ops/s, {calls} EVALSHA = {round_trips:.3} round trips/duplicate",
        per_s(firsts as usize, first_elapsed),
        per_s(duplicates as usize, elapsed),
    );
    bench
        .delete_matching(&bench.pattern(Side::Framework, &tag))
        .await?;

    // Latency: one task, sequential cycles, the two sides taking turns.
    let tag = next_tag();
    let (raw_micros, framework_micros) = bench.latency(&tag).await?;
    for (side, micros) in [(Side::Raw, raw_micros), (Side::Framework, framework_micros)] {
        println!(
            "latency   {:<9} 1 task, {LATENCY_OPS} cycles: p50 {:.0} us, p99 {:.0} us",
            side.name(),
            percentile(&micros, 0.50),
            percentile(&micros, 0.99),
        );
        bench.delete_matching(&bench.pattern(side, &tag)).await?;
    }

    // Memory per completed record.
    let bytes_per_record = bench.memory('a', false).await?;
    bench.memory('b', true).await?;

    figure("raw_ops_per_s", raw_ops, 0);
    figure("framework_ops_per_s", framework_ops, 0);
    figure("ratio", framework_ops / raw_ops, 3);
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
    let outcome = run(&bench).await;

    // Whatever happened, remove every key of this run.
    let mut removed = 0;
    let tag_len = bench.tag(0).len();
    for pattern in [
        format!("{RAW_PREFIX}:v1:{{{tag_len}:{}*", bench.run),
        format!("bench:fwk:v1:{{{tag_len}:{}*", bench.run),
        format!("order:consume:v1:{{{}:{}*", bench.run.len() + 8, bench.run),
    ] {
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
