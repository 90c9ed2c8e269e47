//! A load like the seed's across a Redis failover, with its effects counted in PostgreSQL.
//!
//! Each run starts its own topology (a primary, two replicas and three sentinels on free
//! loopback ports) and, for every configuration at once (each on its own keys and effects
//! table), delivers `keys` x `copies` identical messages in a shuffled order to `consumers`
//! concurrent consumers; a third of the way through it breaks the primary once:
//!
//! - `kill`: SIGKILL; the sentinels promote a replica;
//! - `pause`: SIGSTOP until a replica is promoted, then SIGCONT (the old primary comes back
//!   and is demoted);
//! - `kill_lagging`: the replicas are paused and their links cut for half a second first
//!   (writes pile up on the primary that no replica has), then the primary is killed and the
//!   replicas resumed: a failover that loses acknowledged writes.
//!
//! A consumer's handler inserts one row per run in an effects table; a delivery that meets a
//! store error or another owner in progress is delivered again (as a broker would) until it
//! is applied or filtered. Configurations: the plain store, the plain store with a `done`
//! check on the effects table, durable writes (`wait_for_replicas(1, ..)`), and the tiered
//! store with PostgreSQL behind Redis.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::redis::{RedisStore, UnsafeConfig};
use idempotency::sql::PostgresStore;
use idempotency::store::TieredStore;
use idempotency::{Error, Idempotency, Key, SharedStore};
use sqlx::PgPool;

use crate::redis_server::SentinelGroup;

/// How the primary is broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    Kill,
    Pause,
    KillLagging,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Kill => "kill",
            Scenario::Pause => "pause",
            Scenario::KillLagging => "kill_lagging",
        }
    }
}

/// What guards the consumers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Config {
    Plain,
    Done,
    Durable,
    Tiered,
}

impl Config {
    pub const ALL: [Config; 4] = [Config::Plain, Config::Done, Config::Durable, Config::Tiered];

    pub fn name(self) -> &'static str {
        match self {
            Config::Plain => "plain",
            Config::Done => "done",
            Config::Durable => "durable",
            Config::Tiered => "tiered_postgres",
        }
    }
}

/// The size of a run.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub keys: usize,
    pub copies: usize,
    /// Consumers per configuration.
    pub consumers: usize,
    /// A consumer's pause between two deliveries: the load lasts long enough for the
    /// failover to happen in its middle.
    pub pace: Duration,
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub scenario: Scenario,
    pub config: Config,
    /// Rows in the effects table.
    pub effects: u64,
    /// Rows beyond one per key: effects applied more than once.
    pub duplicate_effects: u64,
    /// Keys with no effect at the end.
    pub lost: u64,
    /// Deliveries that met a store error (and were delivered again).
    pub store_errors: u64,
    /// From the fault to the sentinels naming the new primary.
    pub failover_ms: u128,
    /// Bytes of the replication stream the old primary had applied (at least) and the
    /// promoted replica did not have: whether the failover lost acknowledged writes.
    pub unreplicated_bytes: i64,
    /// Each key applied more than once, with its effects' times in milliseconds from the
    /// fault: what a duplicate followed (the failover itself, or a lease run out later).
    pub duplicates: Vec<(String, Vec<i64>)>,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "scenario={} config={} effects={} duplicate_effects={} lost={} store_errors={} failover_ms={} unreplicated_bytes={}",
            self.scenario.name(),
            self.config.name(),
            self.effects,
            self.duplicate_effects,
            self.lost,
            self.store_errors,
            self.failover_ms,
            self.unreplicated_bytes
        )?;
        for (key, at) in &self.duplicates {
            write!(f, " {key}@{at:?}ms")?;
        }
        Ok(())
    }
}

/// The PostgreSQL the effects go to: `IDEMPOTENT_POSTGRES_URL`, default the local `test`
/// database.
pub fn postgres_url() -> String {
    std::env::var("IDEMPOTENT_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// One configuration's consumers in a run.
struct Guarded {
    config: Config,
    effects: String,
    records: String,
    store_errors: Arc<AtomicUsize>,
    consumers: Vec<tokio::task::JoinHandle<()>>,
}

/// One run of `scenario`: a fresh topology, every configuration's load at once (each on its
/// own keys and effects table), one fault, and each configuration's count.
pub async fn run(scenario: Scenario, load: Load) -> Vec<Outcome> {
    let mut group = tokio::task::spawn_blocking(|| SentinelGroup::start(2, &[]))
        .await
        .unwrap();
    let pool = PgPool::connect(&postgres_url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {}: {e}", postgres_url()));

    // Every key `copies` times, shuffled (a fixed LCG: the same order every run).
    let mut deliveries: Vec<usize> = (0..load.copies).flat_map(|_| 0..load.keys).collect();
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..deliveries.len()).rev() {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let j = usize::try_from(state >> 33).unwrap() % (i + 1);
        deliveries.swap(i, j);
    }
    let deliveries = Arc::new(deliveries);
    let finished = Arc::new(AtomicUsize::new(0));

    let mut guarded = Vec::new();
    for config in Config::ALL {
        let suffix = format!("{}_{}_{}", std::process::id(), group.name, config.name());
        let effects = format!("failover_effects_{suffix}");
        let records = format!("failover_records_{suffix}");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {effects} (key TEXT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())"
        )))
        .execute(&pool)
        .await
        .unwrap();
        let mut redis = RedisStore::builder(&group.url())
            .on_unsafe_config(UnsafeConfig::Warn)
            .response_timeout(Duration::from_millis(500));
        if config == Config::Durable {
            redis = redis.wait_for_replicas(1, Duration::from_millis(500));
        }
        let redis = Arc::new(redis.build().await.unwrap());
        let store: SharedStore = if config == Config::Tiered {
            let back = PostgresStore::builder(&postgres_url())
                .table(records.clone())
                .build()
                .await
                .unwrap();
            Arc::new(TieredStore::new(redis, Arc::new(back)))
        } else {
            redis
        };
        let store_errors = Arc::new(AtomicUsize::new(0));
        let next = Arc::new(AtomicUsize::new(0));
        let prefix = format!("failover:{}:{}", group.name, config.name());
        let consumers = (0..load.consumers)
            .map(|_| {
                let (deliveries, next, finished, store_errors) = (
                    deliveries.clone(),
                    next.clone(),
                    finished.clone(),
                    store_errors.clone(),
                );
                let (store, pool, effects, prefix) =
                    (store.clone(), pool.clone(), effects.clone(), prefix.clone());
                tokio::spawn(async move {
                    let idem = Idempotency::new(Duration::from_secs(600)).store(store);
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(&k) = deliveries.get(i) else { return };
                        let name = format!("order-{k}");
                        let key = Key::new(&prefix, 1, &[&name]).unwrap();
                        deliver(&idem, key, &name, &pool, &effects, config, &store_errors).await;
                        finished.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(load.pace).await;
                    }
                })
            })
            .collect();
        guarded.push(Guarded {
            config,
            effects,
            records,
            store_errors,
            consumers,
        });
    }

    // The fault, a third of the way through.
    let third = deliveries.len() * Config::ALL.len() / 3;
    while finished.load(Ordering::SeqCst) < third {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let fault_at: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&pool)
        .await
        .unwrap();
    let (group, failover_ms, unreplicated) = tokio::task::spawn_blocking(move || {
        let old = group.primary_port().expect("no primary");
        let others: Vec<u16> = group
            .servers
            .iter()
            .map(|s| s.port())
            .filter(|&p| p != old)
            .collect();
        if scenario == Scenario::KillLagging {
            // The replicas stop, and their links are cut: what the primary applies from now
            // on reaches no replica (not even through a socket's buffer).
            for &r in &others {
                group.server(r).pause();
            }
            group
                .server(old)
                .cli(&["client", "kill", "type", "replica"]);
            std::thread::sleep(Duration::from_millis(500));
        }
        // A lower bound of what the primary applied: writes go on until the fault.
        let applied = offset(
            &group.server(old).cli(&["info", "replication"]),
            "master_repl_offset:",
        );
        let started = Instant::now();
        match scenario {
            Scenario::Kill => group.server_mut(old).kill(),
            Scenario::Pause => group.server(old).pause(),
            Scenario::KillLagging => {
                group.server_mut(old).kill();
                for &r in &others {
                    group.server(r).resume();
                }
            }
        }
        let new = group.wait_promoted(old);
        let failover_ms = started.elapsed().as_millis();
        if scenario == Scenario::Pause {
            group.server(old).resume();
        }
        // The promoted replica had the stream up to `second_repl_offset - 1`.
        let had = offset(
            &group.server(new).cli(&["info", "replication"]),
            "second_repl_offset:",
        ) - 1;
        (group, failover_ms, (applied - had).max(0))
    })
    .await
    .unwrap();

    let mut outcomes = Vec::new();
    for g in guarded {
        for consumer in g.consumers {
            consumer.await.unwrap();
        }
        let (rows, distinct): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT key) FROM {}",
            g.effects
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        let duplicates: Vec<(String, Vec<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT key, array_agg(round((extract(epoch FROM at) - $1) * 1000)::int8 ORDER BY at) \
             FROM {} GROUP BY key HAVING count(*) > 1 ORDER BY key",
            g.effects
        )))
        .bind(fault_at)
        .fetch_all(&pool)
        .await
        .unwrap();
        for table in [&g.effects, &g.records] {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                .execute(&pool)
                .await;
        }
        let keys = i64::try_from(load.keys).unwrap();
        outcomes.push(Outcome {
            scenario,
            config: g.config,
            effects: u64::try_from(rows).unwrap(),
            duplicate_effects: u64::try_from(rows - distinct).unwrap(),
            lost: u64::try_from(keys - distinct).unwrap(),
            store_errors: g.store_errors.load(Ordering::SeqCst) as u64,
            failover_ms,
            unreplicated_bytes: unreplicated,
            duplicates,
        });
    }
    drop(group);
    outcomes
}

/// A numeric field of `INFO replication`.
fn offset(info: &str, field: &str) -> i64 {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.trim().parse::<i64>().ok())
        .unwrap_or(0)
}

/// A consumer's error: the engine's, or the business database's.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idempotency(#[from] Error),
    #[error("business database error")]
    Business(#[from] sqlx::Error),
}

/// One delivery, delivered again until it is applied or filtered (at most two minutes).
async fn deliver(
    idem: &Idempotency,
    key: Key,
    name: &str,
    pool: &PgPool,
    effects: &str,
    config: Config,
    store_errors: &AtomicUsize,
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let insert = format!("INSERT INTO {effects} (key) VALUES ($1)");
    let exists = format!("SELECT EXISTS (SELECT 1 FROM {effects} WHERE key = $1)");
    while Instant::now() < deadline {
        let effect = || async {
            sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                .bind(name)
                .execute(pool)
                .await?;
            Ok::<(), AppError>(())
        };
        let out: Result<(), AppError> = if config == Config::Done {
            idem.operation::<Result<(), AppError>>(key.clone())
                .done(|| async {
                    sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(exists.clone()))
                        .bind(name)
                        .fetch_one(pool)
                        .await
                })
                .run(effect())
                .await
        } else {
            idem.run(key.clone(), effect()).await
        };
        match out {
            Ok(()) | Err(AppError::Idempotency(Error::Duplicate { .. })) => return,
            Err(AppError::Idempotency(Error::Store(_))) => {
                store_errors.fetch_add(1, Ordering::Relaxed);
            }
            Err(AppError::Idempotency(Error::InProgress { .. })) => {}
            Err(other) => panic!("unexpected outcome for {name}: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
