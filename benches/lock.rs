//! `Lock` on Redis against the lock a user writes by hand with redis-rs.
//!
//! Uncontended lock + unlock cycles (every cycle a fresh key) at 50 concurrent tasks, in one
//! process against one Redis server:
//!
//! - **raw**: `SET key token NX PX lease` to lock, a Lua compare-and-delete
//!   (`if GET == token then DEL`) to unlock, on one shared `ConnectionManager`;
//! - **renewed**: the same, with the renewal task a lease lock needs (a spawned task that
//!   extends the key with a Lua compare-and-`PEXPIRE` every third of the lease, aborted at
//!   unlock): the hand-written equivalent of `Lock`, and the baseline of `lock_ratio`;
//! - **fenced**: the renewed lock with the fencing token a lock needs before a resource can
//!   refuse a stalled holder's late writes (`Lock` hands one out): a Lua script that takes the
//!   key with `SET NX PX` and then `INCR`s the key's fence counter, kept (with an expiry, as
//!   keys here are unbounded) past the unlock, so that the next holder's fence is higher;
//! - **lock**: `Lock::new(RedisStore, lease).lock(key)` then `guard.unlock()`: the store's claim
//!   and release scripts, with the guard's lease renewal started and stopped.
//!
//! After a warm-up pass of each, the sides take turns (5 rounds, each starting with the next
//! side); the median of each side is kept, with the Redis CPU and this process's allocations
//! per cycle. With valgrind installed it then counts each side's instructions per cycle under
//! callgrind (see `support/instructions.rs`), a figure the machine's load does not move;
//! `IDEMPOTENT_BENCH_INSTRUCTIONS=0` skips it.
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
//! The last lines are the figures: `<side>_cycles_per_s`, `lock_ratio` (lock over renewed, the
//! goal is at least 0.9), `lock_raw_ratio` (lock over raw), `lock_fenced_ratio` (lock over
//! fenced: what the lock costs beyond the rule it keeps), `<side>_redis_cpu_us`,
//! `<side>_allocations` (per cycle), and with valgrind `<side>_instructions` (per cycle) and
//! `lock_instructions_ratio` (renewed's count over lock's: read as the throughput ratio is,
//! the higher the better), `lock_fenced_instructions_ratio` (fenced's over lock's), with
//! `<side>_counted_scripts_per_cycle`: the scripts Redis ran
//! per cycle of the counted runs (the lock: 1.0 when its claims were the fast `SET ... NX
//! GET`, 2.0 when, slowed down under callgrind, they went through the script).

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/allocations.rs"]
mod allocations;
#[path = "support/instructions.rs"]
mod instructions;
#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "support/stats.rs"]
mod stats;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::lock::Lock;
use idempotency::Key;
use redis::aio::ConnectionManager;
use redis::Script;
use redis_info::server_cpu;
use stats::{figure, median, per_s};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TASKS: usize = 50;
const CYCLES: usize = 10_000;
const ROUNDS: usize = 5;
/// Cycles a side runs under callgrind (and twice as many in the second count).
const INSTRUCTION_OPS: usize = 2_000;
const LEASE: Duration = Duration::from_secs(30);

/// The hand-written renewal: extend the key only if this token still holds it.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// The hand-written fenced lock: take the key, then raise its fence, a counter that outlives
/// the lock (for a day: keys here are never taken twice, but the counter must outlive every
/// holder's writes).
const FENCED: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], 86400000)
  return fence
end
return false
";

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
    Renewed,
    Fenced,
    Lock,
}

const SIDES: [Side; 4] = [Side::Raw, Side::Renewed, Side::Fenced, Side::Lock];

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::Renewed => "renewed",
            Side::Fenced => "fenced",
            Side::Lock => "lock",
        }
    }
}

struct Bench {
    conn: ConnectionManager,
    renew: Arc<Script>,
    fenced: Arc<Script>,
    unlock: Arc<Script>,
    locks: Lock,
    run: String,
}

impl Bench {
    /// One pass of `cycles` lock + unlock cycles over `TASKS` tasks: cycles per second.
    async fn pass(&self, side: Side, tag: &str, cycles: usize) -> Result<f64, BoxError> {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|task| {
                let (mut conn, renew, fenced, unlock, locks) = (
                    self.conn.clone(),
                    self.renew.clone(),
                    self.fenced.clone(),
                    self.unlock.clone(),
                    self.locks.clone(),
                );
                let prefix = format!("bench:lock:{}:{tag}", self.run);
                tokio::spawn(async move {
                    for i in (task..cycles).step_by(TASKS) {
                        match side {
                            Side::Raw | Side::Renewed | Side::Fenced => {
                                let key = format!("{prefix}:raw:{i}");
                                let token = format!("{task}-{i}");
                                if side == Side::Fenced {
                                    let fence: Option<u64> = fenced
                                        .key(&key)
                                        .key(format!("{key}:fence"))
                                        .arg(&token)
                                        .arg(LEASE.as_millis() as u64)
                                        .invoke_async(&mut conn)
                                        .await?;
                                    assert!(fence.is_some(), "a fresh key was held");
                                } else {
                                    let locked: Option<String> = redis::cmd("SET")
                                        .arg(&key)
                                        .arg(&token)
                                        .arg("NX")
                                        .arg("PX")
                                        .arg(LEASE.as_millis() as u64)
                                        .query_async(&mut conn)
                                        .await?;
                                    assert!(locked.is_some(), "a fresh key was held");
                                }
                                let renewal = (side != Side::Raw).then(|| {
                                    let (mut conn, renew) = (conn.clone(), renew.clone());
                                    let (key, token) = (key.clone(), token.clone());
                                    tokio::spawn(async move {
                                        loop {
                                            tokio::time::sleep(LEASE / 3).await;
                                            let _: Result<i64, _> = renew
                                                .key(&key)
                                                .arg(&token)
                                                .arg(LEASE.as_millis() as u64)
                                                .invoke_async(&mut conn)
                                                .await;
                                        }
                                    })
                                });
                                if let Some(renewal) = renewal {
                                    renewal.abort();
                                }
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
        Ok(per_s(cycles, start.elapsed()))
    }
}

/// Warm-up cycles of a side run alone.
const WARM_ONLY: usize = 500;

/// `IDEMPOTENT_BENCH_ONLY=<side>`: a warm-up and `ops` cycles of that side alone, nothing
/// printed: what callgrind counts.
async fn one_side(bench: &Bench, name: &str, ops: usize) -> Result<(), BoxError> {
    let side = SIDES
        .into_iter()
        .find(|side| side.name() == name)
        .ok_or_else(|| format!("no side {name}: raw, renewed, fenced or lock"))?;
    bench.pass(side, "warm", WARM_ONLY).await?;
    bench.pass(side, "only", ops).await?;
    Ok(())
}

async fn run(url: &str) -> Result<(), BoxError> {
    let conn = ConnectionManager::new(redis::Client::open(url)?).await?;
    let store = redis_info::store(url, instructions::COUNTED_CLOCK_ERROR).await?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let bench = Bench {
        conn: conn.clone(),
        renew: Arc::new(Script::new(RENEW)),
        fenced: Arc::new(Script::new(FENCED)),
        unlock: Arc::new(Script::new(UNLOCK)),
        locks: Lock::new(Arc::new(store), LEASE).wait(Duration::from_secs(5)),
        run: format!("{:08x}", (nanos ^ u64::from(std::process::id())) as u32),
    };
    if let Some((name, ops)) = instructions::only(INSTRUCTION_OPS)? {
        return one_side(&bench, &name, ops).await;
    }
    println!("lock bench: {TASKS} tasks, {CYCLES} cycles a pass");
    let mut info = conn.clone();
    for side in SIDES {
        bench.pass(side, "warm", CYCLES).await?;
    }
    let mut rates: [Vec<f64>; 4] = Default::default();
    let mut cpu: [Vec<f64>; 4] = Default::default();
    let mut allocs: [Vec<f64>; 4] = Default::default();
    for round in 0..ROUNDS {
        for step in 0..SIDES.len() {
            let at = (round + step) % SIDES.len();
            let side = SIDES[at];
            let before = server_cpu(&mut info).await?;
            let allocated = allocations::so_far();
            let rate = bench.pass(side, &format!("r{round}"), CYCLES).await?;
            let per_cycle = (allocations::so_far() - allocated) as f64 / CYCLES as f64;
            let cpu_us = (server_cpu(&mut info).await? - before) * 1e6 / CYCLES as f64;
            println!(
                "round {round} {:>7}: {rate:>8.0} cycles/s, redis {cpu_us:.1} us/cycle, \
                 {per_cycle:.1} allocations/cycle",
                side.name()
            );
            rates[at].push(rate);
            cpu[at].push(cpu_us);
            allocs[at].push(per_cycle);
        }
    }
    for (at, side) in SIDES.into_iter().enumerate() {
        figure(
            &format!("{}_cycles_per_s", side.name()),
            median(&rates[at]),
            0,
        );
    }
    figure("lock_ratio", median(&rates[3]) / median(&rates[1]), 3);
    figure("lock_raw_ratio", median(&rates[3]) / median(&rates[0]), 3);
    figure(
        "lock_fenced_ratio",
        median(&rates[3]) / median(&rates[2]),
        3,
    );
    for (at, side) in SIDES.into_iter().enumerate() {
        figure(
            &format!("{}_redis_cpu_us", side.name()),
            median(&cpu[at]),
            1,
        );
        figure(
            &format!("{}_allocations", side.name()),
            median(&allocs[at]),
            1,
        );
    }
    if instructions::enabled() {
        let mut counts = Vec::new();
        let mut scripts = redis_info::script_calls(url)?;
        // One script a cycle on every side, its unlock, and the fenced side's lock. A run
        // whose claims fell back to the script is taken again.
        for side in SIDES {
            let expected = instructions::Expected {
                warm_cycles: WARM_ONLY,
                per_cycle: if side == Side::Fenced { 2.0 } else { 1.0 },
            };
            let (count, ran) = instructions::per_cycle_expected(
                side.name(),
                INSTRUCTION_OPS,
                &mut scripts,
                Some(expected),
            )?;
            figure(&format!("{}_instructions", side.name()), count, 0);
            figure(
                &format!("{}_counted_scripts_per_cycle", side.name()),
                ran,
                2,
            );
            counts.push(count);
        }
        figure("lock_instructions_ratio", counts[1] / counts[3], 3);
        figure("lock_fenced_instructions_ratio", counts[2] / counts[3], 3);
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let url = std::env::var("IDEMPOTENT_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
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
