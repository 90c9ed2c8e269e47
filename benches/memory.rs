//! The in-memory store, on one core: how many claim + complete cycles per second the store
//! does on its own, through [`Idempotency`] (the builder API), and through the attribute, side
//! by side in one process (one current-thread runtime, alternating passes, medians of 5), and
//! how much each cycle asks of the allocator.
//!
//! It needs nothing but this repository. Run it with:
//!
//! ```text
//! cargo bench --bench memory
//! cargo bench --bench memory --features metrics
//! ```
//!
//! The bench's global allocator is `stats_alloc`'s counting wrapper around the system
//! allocator (the workspace forbids `unsafe_code`, which a hand-written `GlobalAlloc` needs;
//! the wrapper adds a few uncontended atomic additions to each call, about 2% more CPU time
//! than a plain build of this bench). Each pass reads the counters before and after, so what
//! a pass allocated is everything the process allocated meanwhile, divided by its cycles:
//! `alloc` and `realloc` calls, and the bytes they asked for (a `realloc` counts what it grew
//! by). Every pass starts from an empty store, so its cycles also pay for the store's map
//! growing.
//!
//! The last lines are:
//!
//! - `store_cycles_per_s`, `guard_cycles_per_s`, `attribute_cycles_per_s`,
//!   `attribute_over_guard` (the attribute's cost over calling the runtime by hand; 1.0 is
//!   none) and `duplicate_claims_per_s`;
//! - `batch_items_per_s`: items per second through `run_batch` in batches of 100, and
//!   `batch_over_guard`, that over the single calls' rate: the engine's own cost per batch
//!   item, which no round trip hides on this store; `batch_allocs_per_item`;
//! - `store_allocs_per_cycle`, `guard_allocs_per_cycle`, `attribute_allocs_per_cycle` and
//!   `duplicate_allocs_per_claim`: allocator calls per claim + complete cycle (per claim for
//!   duplicates), the median over the rounds;
//! - `store_bytes_per_cycle`, `guard_bytes_per_cycle`, `attribute_bytes_per_cycle` and
//!   `duplicate_bytes_per_claim`: the bytes those calls asked for.
//!
//! With the `metrics` feature the figures above are those of the feature with no recorder
//! installed: what a build that enables the feature and never installs a recorder pays (the
//! two commands side by side give the feature's own cost). Then a Prometheus recorder
//! (`metrics-exporter-prometheus`, not served) is installed, since a global recorder cannot be
//! uninstalled, and the guard and attribute passes run again: a warm-up round and 5 more. The
//! histograms' samples are drained after each round, outside the measurement, as the
//! exporter's upkeep task does. More lines follow: `guard_cycles_per_s_with_recorder`,
//! `attribute_cycles_per_s_with_recorder`, `guard_allocs_per_cycle_with_recorder`,
//! `attribute_allocs_per_cycle_with_recorder`, the same two with `bytes`, and
//! `metrics_recorder_overhead`: the guard's rate with the recorder over its rate without (1.0
//! is none; 0.8 means the recorder takes a fifth of the throughput).

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/stats.rs"]
mod stats;

use std::alloc::System;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::store::{Claim, ClaimRequest, Completion, Store, Token};
use idempotency::{idempotent, Error, Idempotency, Key, MemoryStore};
use stats::{figure, median, per_s};
use stats_alloc::StatsAlloc;

/// Counts every allocation of the process, on top of the system allocator.
#[global_allocator]
static ALLOCATOR: StatsAlloc<System> = StatsAlloc::system();

const OPS: u32 = 400_000;
const ROUNDS: usize = 5;

#[idempotent(prefix = "bench:attr", keys = [round, id], ttl = 3600, store = store)]
async fn handler(store: &Arc<MemoryStore>, round: u32, id: u32) -> Result<u32, Error> {
    Ok(id)
}

/// What one pass measured: its rate, and what each cycle asked the allocator for.
#[derive(Debug, Clone, Copy)]
struct Pass {
    per_s: f64,
    allocs: f64,
    bytes: f64,
}

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0}/s ({:.2} allocs, {:.0} B)",
            self.per_s, self.allocs, self.bytes
        )
    }
}

/// Runs `pass` (`OPS` cycles), timing it and counting the allocations made meanwhile.
async fn measure(pass: impl Future<Output = ()>) -> Pass {
    let before = ALLOCATOR.stats();
    let started = Instant::now();
    pass.await;
    let elapsed = started.elapsed();
    let after = ALLOCATOR.stats();
    let calls =
        (after.allocations + after.reallocations) - (before.allocations + before.reallocations);
    let bytes = after.bytes_allocated - before.bytes_allocated;
    Pass {
        per_s: per_s(OPS as usize, elapsed),
        allocs: calls as f64 / f64::from(OPS),
        bytes: bytes as f64 / f64::from(OPS),
    }
}

/// The passes of one side, round after round.
#[derive(Default)]
struct Side(Vec<Pass>);

impl Side {
    fn push(&mut self, pass: Pass) {
        self.0.push(pass);
    }

    fn median(&self, field: fn(&Pass) -> f64) -> f64 {
        median(&self.0.iter().map(field).collect::<Vec<_>>())
    }

    fn per_s(&self) -> f64 {
        self.median(|p| p.per_s)
    }

    fn allocs(&self) -> f64 {
        self.median(|p| p.allocs)
    }

    fn bytes(&self) -> f64 {
        self.median(|p| p.bytes)
    }
}

async fn store_pass(store: &MemoryStore, round: u32) {
    let done = Completion::new(None, Duration::from_secs(3600));
    for id in 0..OPS {
        let req = ClaimRequest::new(
            Key::new("bench:store", 1, &[&round, &id]).unwrap(),
            Token::generate(),
            Duration::from_secs(30),
            Duration::from_secs(3600),
        );
        let Claim::Acquired { .. } = store.claim(&req).await.unwrap() else {
            panic!("fresh key not acquired")
        };
        assert!(store.complete(&req.key, &req.token, &done).await.unwrap());
    }
}

async fn guard_pass(guard: &Idempotency, round: u32) {
    for id in 0..OPS {
        let key = Key::new("bench:guard", 1, &[&round, &id]).unwrap();
        let out: Result<u32, Error> = guard.run(key, async { Ok(id) }).await;
        out.unwrap();
    }
}

/// Items per batch in the batch pass.
const BATCH: u32 = 100;

/// `OPS` items in batches of `BATCH` through [`Idempotency::run_batch`].
async fn batch_pass(guard: &Idempotency, round: u32) {
    for start in (0..OPS).step_by(BATCH as usize) {
        let items: Vec<(Key, u32)> = (start..start + BATCH)
            .map(|id| (Key::new("bench:batch", 1, &[&round, &id]).unwrap(), id))
            .collect();
        let out: Vec<Result<u32, Error>> = guard.run_batch(items, |id| async move { Ok(id) }).await;
        assert!(out.iter().all(Result::is_ok));
    }
}

async fn attribute_pass(store: &Arc<MemoryStore>, round: u32) {
    for id in 0..OPS {
        handler(store, round, id).await.unwrap();
    }
}

async fn duplicate_pass(store: &Arc<MemoryStore>, round: u32) {
    for id in 0..OPS {
        assert!(matches!(
            handler(store, round, id).await,
            Err(Error::Duplicate { .. })
        ));
    }
}

/// A guard pass and an attribute pass, each on a fresh store, in turns going first; the
/// attribute's store is returned for the duplicates.
async fn guard_and_attribute(round: u32) -> (Pass, Pass, Arc<MemoryStore>) {
    let guard = Idempotency::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
    let attribute_store = Arc::new(MemoryStore::new());
    let (g, a) = if round % 2 == 0 {
        let g = measure(guard_pass(&guard, round)).await;
        (g, measure(attribute_pass(&attribute_store, round)).await)
    } else {
        let a = measure(attribute_pass(&attribute_store, round)).await;
        (measure(guard_pass(&guard, round)).await, a)
    };
    (g, a, attribute_store)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut s, mut g, mut a, mut d, mut b) = (
            Side::default(),
            Side::default(),
            Side::default(),
            Side::default(),
            Side::default(),
        );
        for round in 0..=ROUNDS as u32 {
            // A fresh store per pass, so every pass starts from an empty map; guard and
            // attribute passes take turns going first.
            let store = measure(store_pass(&MemoryStore::new(), round)).await;
            let (guard, attribute, attribute_store) = guard_and_attribute(round).await;
            let duplicate = measure(duplicate_pass(&attribute_store, round)).await;
            let batch_guard =
                Idempotency::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
            let batch = measure(batch_pass(&batch_guard, round)).await;
            println!(
                "round {round}: store {store}, guard {guard}, attribute {attribute}, duplicates {duplicate}, batch items {batch}"
            );
            if round > 0 {
                // Round 0 warms up.
                s.push(store);
                g.push(guard);
                a.push(attribute);
                d.push(duplicate);
                b.push(batch);
            }
        }

        // A global recorder cannot be uninstalled: these passes come last.
        #[cfg(feature = "metrics")]
        let (g_rec, a_rec) = {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).expect("no recorder installed before");
            let (mut g_rec, mut a_rec) = (Side::default(), Side::default());
            for round in 0..=ROUNDS as u32 {
                let (guard, attribute, _) = guard_and_attribute(round).await;
                // Drains the histograms' samples, as the exporter's upkeep task does.
                handle.run_upkeep();
                println!("round {round} with a recorder: guard {guard}, attribute {attribute}");
                if round > 0 {
                    g_rec.push(guard);
                    a_rec.push(attribute);
                }
            }
            (g_rec, a_rec)
        };

        figure("store_cycles_per_s", s.per_s(), 0);
        figure("guard_cycles_per_s", g.per_s(), 0);
        figure("attribute_cycles_per_s", a.per_s(), 0);
        figure("attribute_over_guard", a.per_s() / g.per_s(), 3);
        figure("duplicate_claims_per_s", d.per_s(), 0);
        figure("batch_items_per_s", b.per_s(), 0);
        figure("batch_over_guard", b.per_s() / g.per_s(), 3);
        figure("store_allocs_per_cycle", s.allocs(), 2);
        figure("guard_allocs_per_cycle", g.allocs(), 2);
        figure("attribute_allocs_per_cycle", a.allocs(), 2);
        figure("duplicate_allocs_per_claim", d.allocs(), 2);
        figure("batch_allocs_per_item", b.allocs(), 2);
        figure("store_bytes_per_cycle", s.bytes(), 0);
        figure("guard_bytes_per_cycle", g.bytes(), 0);
        figure("attribute_bytes_per_cycle", a.bytes(), 0);
        figure("duplicate_bytes_per_claim", d.bytes(), 0);
        #[cfg(feature = "metrics")]
        {
            figure("guard_cycles_per_s_with_recorder", g_rec.per_s(), 0);
            figure("attribute_cycles_per_s_with_recorder", a_rec.per_s(), 0);
            figure("guard_allocs_per_cycle_with_recorder", g_rec.allocs(), 2);
            figure("attribute_allocs_per_cycle_with_recorder", a_rec.allocs(), 2);
            figure("guard_bytes_per_cycle_with_recorder", g_rec.bytes(), 0);
            figure("attribute_bytes_per_cycle_with_recorder", a_rec.bytes(), 0);
            figure("metrics_recorder_overhead", g_rec.per_s() / g.per_s(), 3);
        }
    });
}
