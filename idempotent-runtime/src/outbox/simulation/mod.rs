//! The relay's rounds under faults, in a deterministic simulation: a seeded scheduler runs
//! several relays' rounds ([`Settings::round`], the code `Relay::run_once` runs) at once over
//! one table of rows in memory, on Tokio's paused clock, and decides everything a deployment
//! leaves to chance:
//!
//! - at every statement: answered, refused before being applied, applied with its answer lost,
//!   or applied and never answered (the relay abandons it at the lease), each after a delay;
//! - at every publication: confirmed, refused (the row's fault), the broker unreachable, never
//!   confirmed, or confirmed after the claim ran out (the relay gives up at its deadline);
//! - a relay that dies: its round dropped at any point;
//! - between rounds: how long a relay waits.
//!
//! The rows in memory follow the outbox's statements (`claim`, `failed`, `release`,
//! `published`), which `tests/outbox.rs` and `tests/outbox_faults.rs` check on the real
//! databases: what a real database cannot do is run a hundred thousand of these schedules, so
//! the table here stands in for it. After every schedule it checks:
//!
//! 1. every publication, from its start to its end (confirmed, failed or abandoned), is made
//!    while the publishing relay's claim on the row is live: no two relays ever publish a row
//!    at the same time;
//! 2. a row is marked published only by a relay that the broker confirmed it to, under the
//!    token of that claim; a failed attempt is recorded only for a publication that was not
//!    confirmed (refused, or abandoned at the deadline) or a row that cannot be read;
//! 3. every round ends (a round the scheduler does not drop), however the database and the
//!    broker answer;
//! 4. once the faults stop and a last relay runs, every row ends published (confirmed at least
//!    once) or dead (after a failure of its own), and none is held.
//!
//! `RELAY_SIM_SCHEDULES` sets how many schedules run (default 3,000), `RELAY_SIM_SEED` replays
//! one with a trace of every step. A violation prints its seed.

mod table_and_broker;
mod world;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::StoreError;
use crate::outbox::round::Settings;
use table_and_broker::{Broker, Source};
use world::{lock, Rng, Row, State, World};

/// Runs `round`, or drops it after `crash` if one is given; a round that ends neither way
/// within `bound` is a violation.
async fn bounded_round(
    world: &Mutex<World>,
    relay: usize,
    round: impl Future<Output = Result<crate::outbox::RelayStats, StoreError>>,
    crash: Option<Duration>,
    bound: Duration,
) {
    let crash = async {
        match crash {
            Some(after) => tokio::time::sleep(after).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = crash => lock(world).note(|| format!("relay {relay} dies")),
        ended = tokio::time::timeout(bound, round) => match ended {
            Ok(stats) => lock(world).note(|| format!("relay {relay} round: {stats:?}")),
            Err(_) => lock(world)
                .violations
                .push(format!("relay {relay}'s round did not end within {bound:?}")),
        },
    }
}

/// One schedule from `seed`: its violations and, when `traced`, its trace.
fn schedule(seed: u64, traced: bool) -> (Vec<String>, Vec<String>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("a runtime: {e}"));
    runtime.block_on(async move {
        let mut rng = Rng(seed);
        let lease = Duration::from_millis(1_000);
        let settings = Settings {
            batch: 1 + rng.below(4) as u32,
            lease,
            max_attempts: 1 + rng.below(3) as u32,
            first_backoff: Duration::from_millis(10 + rng.below(100)),
            max_backoff: Duration::from_millis(200),
            poll: Duration::from_millis(50),
            dead_letter: (rng.below(2) == 0).then(|| "dead-letters".to_owned()),
        };
        let now = Instant::now();
        let rows = (0..1 + rng.below(6))
            .map(|n| Row {
                id: format!("{n:02}"),
                state: State::Pending,
                attempts: 0,
                next_at: now,
                token: None,
                claimed_until: None,
                unreadable: rng.below(8) == 0,
            })
            .collect();
        let relays = 1 + rng.below(3) as usize;
        let plans: Vec<Vec<(Duration, Option<Duration>)>> = (0..relays)
            .map(|_| {
                (0..1 + rng.below(5))
                    .map(|_| {
                        let wait = rng.millis(lease);
                        let crash = (rng.below(5) == 0).then(|| rng.millis(lease * 2));
                        (wait, crash)
                    })
                    .collect()
            })
            .collect();
        let world = Arc::new(Mutex::new(World {
            rows,
            rng,
            owner: BTreeMap::new(),
            confirmed: BTreeSet::new(),
            unconfirmed: BTreeSet::new(),
            faults: true,
            lease,
            violations: Vec::new(),
            trace: traced.then(Vec::new),
        }));
        // Every statement is bounded by the lease, every publication by the claim's deadline.
        let bound = lease * (settings.batch + 4) * 2;

        let mut tasks = tokio::task::JoinSet::new();
        for (relay, plan) in plans.into_iter().enumerate() {
            let (world, settings) = (world.clone(), settings.clone());
            tasks.spawn(async move {
                let source = Source {
                    world: world.clone(),
                    relay,
                };
                let broker = Broker {
                    world: world.clone(),
                    relay,
                };
                for (wait, crash) in plan {
                    tokio::time::sleep(wait).await;
                    let round = settings.round(&source, &broker);
                    bounded_round(&world, relay, round, crash, bound).await;
                }
            });
        }
        while tasks.join_next().await.is_some() {}

        // The faults stop; a last relay runs until nothing is due or held.
        lock(&world).faults = false;
        let last = relays;
        let source = Source {
            world: world.clone(),
            relay: last,
        };
        let broker = Broker {
            world: world.clone(),
            relay: last,
        };
        for _ in 0..50 {
            if lock(&world).rows.iter().all(|r| r.state != State::Pending) {
                break;
            }
            tokio::time::sleep(lease * 2).await;
            bounded_round(&world, last, settings.round(&source, &broker), None, bound).await;
        }
        let mut w = lock(&world);
        let mut ended = Vec::new();
        for row in &w.rows {
            let confirmed = w.confirmed.iter().any(|(_, id)| *id == row.id);
            let failed = row.unreadable || w.unconfirmed.iter().any(|(_, id)| *id == row.id);
            match row.state {
                State::Pending => ended.push(format!("row {} never delivered", row.id)),
                State::Published if !confirmed => {
                    ended.push(format!("row {} published, never confirmed", row.id));
                }
                State::Dead if !failed => {
                    ended.push(format!("row {} dead without a failure", row.id));
                }
                _ => {}
            }
        }
        w.violations.extend(ended);
        (
            std::mem::take(&mut w.violations),
            w.trace.take().unwrap_or_default(),
        )
    })
}

#[test]
fn relays_keep_their_invariants_under_every_schedule() {
    if let Ok(seed) = std::env::var("RELAY_SIM_SEED") {
        let seed: u64 = seed
            .parse()
            .unwrap_or_else(|e| panic!("RELAY_SIM_SEED: {e}"));
        let (violations, trace) = schedule(seed, true);
        for step in trace {
            println!("{step}");
        }
        assert!(violations.is_empty(), "seed {seed}: {violations:#?}");
        return;
    }
    let schedules: u64 = std::env::var("RELAY_SIM_SCHEDULES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3_000);
    let started = std::time::Instant::now();
    for seed in 0..schedules {
        let (violations, _) = schedule(seed, false);
        assert!(
            violations.is_empty(),
            "seed {seed} (replay with RELAY_SIM_SEED={seed}): {violations:#?}"
        );
    }
    println!(
        "schedules={schedules} violations=0 seconds={:.1}",
        started.elapsed().as_secs_f64()
    );
}
