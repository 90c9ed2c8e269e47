//! `Lock` on Redis against the lock a user writes by hand with redis-rs.
//!
//! Uncontended lock + unlock cycles (every cycle a fresh key) at 50 concurrent tasks, in one
//! process against one Redis server:
//!
//! - **raw**: `SET key token NX PX lease` to lock, a Lua compare-and-delete
//!   (`if GET == token then DEL`) to unlock, on one shared `ConnectionManager`;
//! - **lock**: `Lock::new(RedisStore, lease).lock(key)` then `guard.unlock()`: the store's claim
//!   and release scripts, with the guard's watchdog task started and stopped.
//!
//! After a warm-up pass of each, raw and lock passes alternate (5 rounds); the median of each
//! side is kept, with the Redis CPU per cycle (`INFO cpu`).
//!
//! Needs a Redis server this benchmark may write to, at `IDEMPOTENT_REDIS_URL` (default
//! `redis://127.0.0.1:6379`); every key carries a tag unique to the run: the raw side's are
//! deleted by their unlock, the lock's released records expire within two leases (a minute).
//! Run it with:
//!
//! ```text
//! cargo bench --bench lock --features redis
//! ```
//!
//! The last lines are the figures: `raw_cycles_per_s`, `lock_cycles_per_s`, `lock_ratio`
//! (lock over raw), `raw_redis_cpu_us`, `lock_redis_cpu_us` (per cycle).

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "support/stats.rs"]
mod stats;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::lock::Lock;
use idempotency::redis::RedisStore;
use idempotency::Key;
use redis::aio::ConnectionManager;
use redis::Script;
use redis_info::server_cpu;
use stats::{figure, median, per_s};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TASKS: usize = 50;
const CYCLES: usize = 10_000;
const ROUNDS: usize = 5;
const LEASE: Duration = Duration::from_secs(30);

/// The hand-written unlock: delete the key only if this token still holds it.
const UNLOCK: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Raw,
    Lock,
}

struct Bench {
    conn: ConnectionManager,
    unlock: Arc<Script>,
    locks: Lock,
    run: String,
}

impl Bench {
    /// One pass of `CYCLES` lock + unlock cycles over `TASKS` tasks: cycles per second.
    async fn pass(&self, side: Side, tag: &str) -> Result<f64, BoxError> {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let (mut conn, unlock, locks) =
                    (self.conn.clone(), self.unlock.clone(), self.locks.clone());
                let prefix = format!("bench:lock:{}:{tag}", self.run);
                tokio::spawn(async move {
                    for i in (task..CYCLES).step_by(TASKS) {
                        match side {
                            Side::Raw => {
                                let key = format!("{prefix}:raw:{i}");
                                let token = format!("{task}-{i}");
                                let locked: Option<String> = redis::cmd("SET")
                                    .arg(&key)
                                    .arg(&token)
                                    .arg("NX")
                                    .arg("PX")
                                    .arg(LEASE.as_millis() as u64)
                                    .query_async(&mut conn)
                                    .await?;
                                assert!(locked.is_some(), "a fresh key was held");
                                let released: i64 =
                                    unlock.key(&key).arg(&token).invoke_async(&mut conn).await?;
                                assert_eq!(released, 1);
                            }
                            Side::Lock => {
                                let key = Key::new(&prefix, 1, &[&i])?;
                                let guard = locks.lock(key).await?;
                                assert!(guard.unlock().await?);
                            }
                        }
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .collect();
        for task in tasks {
            task.await??;
        }
        Ok(per_s(CYCLES, start.elapsed()))
    }
}

async fn run(url: &str) -> Result<(), BoxError> {
    let conn = ConnectionManager::new(redis::Client::open(url)?).await?;
    let store = RedisStore::connect(url).await?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let bench = Bench {
        conn: conn.clone(),
        unlock: Arc::new(Script::new(UNLOCK)),
        locks: Lock::new(Arc::new(store), LEASE).wait(Duration::from_secs(5)),
        run: format!("{:08x}", (nanos ^ u64::from(std::process::id())) as u32),
    };
    let mut info = conn.clone();
    bench.pass(Side::Raw, "warm").await?;
    bench.pass(Side::Lock, "warm").await?;
    let (mut raw, mut lock, mut raw_cpu, mut lock_cpu) = (vec![], vec![], vec![], vec![]);
    for round in 0..ROUNDS {
        let order = if round % 2 == 0 {
            [Side::Raw, Side::Lock]
        } else {
            [Side::Lock, Side::Raw]
        };
        for side in order {
            let before = server_cpu(&mut info).await?;
            let rate = bench.pass(side, &format!("r{round}")).await?;
            let cpu_us = (server_cpu(&mut info).await? - before) * 1e6 / CYCLES as f64;
            let (rates, cpu, name) = match side {
                Side::Raw => (&mut raw, &mut raw_cpu, "raw"),
                Side::Lock => (&mut lock, &mut lock_cpu, "lock"),
            };
            println!("round {round} {name:>4}: {rate:>8.0} cycles/s, redis {cpu_us:.1} us/cycle");
            rates.push(rate);
            cpu.push(cpu_us);
        }
    }
    let (raw_rate, lock_rate) = (median(&raw), median(&lock));
    figure("raw_cycles_per_s", raw_rate, 0);
    figure("lock_cycles_per_s", lock_rate, 0);
    figure("lock_ratio", lock_rate / raw_rate, 3);
    figure("raw_redis_cpu_us", median(&raw_cpu), 1);
    figure("lock_redis_cpu_us", median(&lock_cpu), 1);
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let url = std::env::var("IDEMPOTENT_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
    println!("lock bench: {TASKS} tasks, {CYCLES} cycles a pass");
    match run(&url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!(
                "error: {err}\n(needs a Redis server at {url}: start one with\n  \
                 redis-server --daemonize yes\nor set IDEMPOTENT_REDIS_URL)"
            );
            ExitCode::FAILURE
        }
    }
}
