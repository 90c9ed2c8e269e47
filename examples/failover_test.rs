//! Redis failovers under load, measured: what each configuration of the store does when the
//! primary behind Sentinel is killed, paused, or killed while its replicas lag.
//!
//! Each round of a scenario starts its own topology on free loopback ports (a primary, two
//! replicas and three `redis-server --sentinel`), runs the seed's load for every
//! configuration at once (`--keys` keys x 3 identical deliveries, 24 consumers per
//! configuration, one effect row per handler run in PostgreSQL), breaks the primary once a
//! third of the way through, and prints one line per configuration:
//!
//! ```text
//! scenario=kill_lagging config=plain effects=2131 duplicate_effects=131 lost=0 store_errors=3419 failover_ms=2183 unreplicated_bytes=121330
//! ```
//!
//! `duplicate_effects` counts handler runs beyond one per key, `lost` keys with no effect,
//! `store_errors` deliveries that failed closed and were delivered again, `failover_ms` the
//! time from the fault to the sentinels naming a new primary, `unreplicated_bytes` the part
//! of the old primary's replication stream the promoted replica did not have (zero: the
//! failover lost no acknowledged write). A summary per scenario and configuration follows.
//!
//! Needs `redis-server` (started by the example) and PostgreSQL (`IDEMPOTENT_POSTGRES_URL`,
//! default `postgres://postgres@127.0.0.1:5432/test`).
//!
//! ```text
//! cargo run --release --example failover_test -- [--rounds 3] [--keys 2000] [--scenario pause]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../tests/support/failover.rs"]
mod failover;
#[path = "../tests/support/redis_server.rs"]
mod redis_server;

use std::collections::BTreeMap;
use std::time::Duration;

use failover::{Config, Load, Scenario};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let rounds = arg("--rounds", 3);
    let load = Load {
        keys: arg("--keys", 2_000),
        copies: 3,
        consumers: 24,
        pace: Duration::from_millis(60),
    };
    // (scenario, config) -> (runs, effects, duplicates, lost, store errors, failover ms, runs that lost writes)
    let mut summary: BTreeMap<(&str, &str), [u128; 7]> = BTreeMap::new();
    let only = std::env::args().skip_while(|a| a != "--scenario").nth(1);
    let scenarios = [Scenario::Kill, Scenario::Pause, Scenario::KillLagging];
    if let Some(name) = &only {
        assert!(
            scenarios.iter().any(|s| s.name() == name),
            "--scenario takes kill, pause or kill_lagging"
        );
    }
    for scenario in scenarios {
        if only.as_deref().is_some_and(|name| name != scenario.name()) {
            continue;
        }
        for _ in 0..rounds {
            for outcome in failover::run(scenario, load).await {
                println!("{outcome}");
                let row = summary
                    .entry((scenario.name(), outcome.config.name()))
                    .or_default();
                row[0] += 1;
                row[1] += u128::from(outcome.effects);
                row[2] += u128::from(outcome.duplicate_effects);
                row[3] += u128::from(outcome.lost);
                row[4] += u128::from(outcome.store_errors);
                row[5] += outcome.failover_ms;
                row[6] += u128::from(outcome.unreplicated_bytes > 0);
            }
        }
    }
    println!();
    println!("| scenario | config | runs | effects | duplicate effects | lost | store errors | failover ms (mean) | runs that lost writes |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for config in Config::ALL {
        for scenario in ["kill", "pause", "kill_lagging"] {
            if let Some(r) = summary.get(&(scenario, config.name())) {
                println!(
                    "| {scenario} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    config.name(),
                    r[0],
                    r[1],
                    r[2],
                    r[3],
                    r[4],
                    r[5] / r[0].max(1),
                    r[6]
                );
            }
        }
    }
}
