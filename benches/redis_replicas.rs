//! The cost of durable Redis writes (`RedisStoreBuilder::wait_for_replicas`) on a primary with
//! one local replica, against the same store without them.
//!
//! The bench starts its own primary and replica (`redis-server` on free loopback ports, no
//! persistence) and runs the claim + complete cycle of an `Idempotency::run` whose body only
//! returns, at 50 concurrent tasks on a multi-thread runtime, on two `RedisStore`s of that
//! primary: **plain** and **durable** (`wait_for_replicas(1, 1 s)`: each claim and completion
//! pipelined with `WAIT 1 1000`). After a warm-up pass of each, every round runs one pass of
//! each, the order alternating; the medians are kept. It prints:
//!
//! - `plain_cycles_per_s`, `durable_cycles_per_s`, `durable_ratio` (durable over plain);
//! - `plain_server_cpu_us_per_cycle`, `durable_server_cpu_us_per_cycle`: the primary's CPU
//!   time (`INFO cpu`) per cycle, which the machine's other load disturbs less than the
//!   throughput.
//!
//! ```text
//! cargo bench --bench redis_replicas --features redis
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/redis_info.rs"]
mod redis_info;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;
#[path = "support/stats.rs"]
mod stats;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::redis::{RedisStore, UnsafeConfig};
use idempotency::{Error, Idempotency, Key, SharedStore};
use redis::aio::ConnectionManager;
use redis_server::RedisServer;
use stats::{figure, median, per_s};

const TASKS: usize = 50;
const CYCLES: usize = 20_000;
const ROUNDS: usize = 5;

/// One pass: `CYCLES` fresh keys at `TASKS` tasks; cycles per second and the server's CPU
/// microseconds per cycle.
async fn pass(store: &SharedStore, server: &mut ConnectionManager, tag: &str) -> (f64, f64) {
    let idem = Idempotency::new(Duration::from_secs(3600)).store(store.clone());
    let next = Arc::new(AtomicU64::new(0));
    let cpu_before = redis_info::server_cpu(server).await.unwrap();
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (idem, next, tag) = (idem.clone(), next.clone(), tag.to_string());
            tokio::spawn(async move {
                loop {
                    let id = next.fetch_add(1, Ordering::Relaxed);
                    if id >= CYCLES as u64 {
                        return;
                    }
                    let key = Key::new(&tag, 1, &[&id]).unwrap();
                    idem.run(key, async { Ok::<(), Error>(()) }).await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let elapsed = started.elapsed();
    let cpu = redis_info::server_cpu(server).await.unwrap() - cpu_before;
    (per_s(CYCLES, elapsed), cpu * 1e6 / CYCLES as f64)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let primary = RedisServer::start(&[]);
    let port = primary.port().to_string();
    let replica = RedisServer::start(&["--replicaof", "127.0.0.1", &port]);
    while !replica
        .cli(&["info", "replication"])
        .contains("master_link_status:up")
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let build = |durable: bool| {
        let mut builder = RedisStore::builder(&primary.url()).on_unsafe_config(UnsafeConfig::Warn);
        if durable {
            builder = builder.wait_for_replicas(1, Duration::from_secs(1));
        }
        builder.build()
    };
    let plain: SharedStore = Arc::new(build(false).await.unwrap());
    let durable: SharedStore = Arc::new(build(true).await.unwrap());
    let mut server = ConnectionManager::new(redis::Client::open(primary.url()).unwrap())
        .await
        .unwrap();

    let run = std::process::id();
    pass(&plain, &mut server, &format!("warm-plain-{run}")).await;
    pass(&durable, &mut server, &format!("warm-durable-{run}")).await;
    let (mut plain_rate, mut plain_cpu, mut durable_rate, mut durable_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        let sides = if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for durable_side in sides {
            let (store, rates, cpus, name) = if durable_side {
                (&durable, &mut durable_rate, &mut durable_cpu, "durable")
            } else {
                (&plain, &mut plain_rate, &mut plain_cpu, "plain")
            };
            let (rate, cpu) = pass(store, &mut server, &format!("{name}-{run}-{round}")).await;
            rates.push(rate);
            cpus.push(cpu);
        }
    }
    let (p, d) = (median(&plain_rate), median(&durable_rate));
    figure("plain_cycles_per_s", p, 0);
    figure("durable_cycles_per_s", d, 0);
    figure("durable_ratio", d / p, 2);
    figure("plain_server_cpu_us_per_cycle", median(&plain_cpu), 1);
    figure("durable_server_cpu_us_per_cycle", median(&durable_cpu), 1);
}
