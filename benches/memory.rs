//! The in-memory store, on one core: how many claim + complete cycles per second the store
//! does on its own, through [`Idempotency`] (the builder API), and through the attribute, side by side in one
//! process (one current-thread runtime, alternating passes, medians of 5).
//!
//! It needs nothing but this repository. Run it with:
//!
//! ```text
//! cargo bench --bench memory
//! ```
//!
//! The last lines are `store_cycles_per_s`, `guard_cycles_per_s`, `attribute_cycles_per_s`,
//! `attribute_over_guard` (the attribute's cost over calling the runtime by hand; 1.0 is none)
//! and `duplicate_claims_per_s`.

// A measurement program: failing loudly on a broken setup is the right behaviour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/stats.rs"]
mod stats;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency::{
    idempotent, Claim, ClaimRequest, Completion, Error, Idempotency, Key, MemoryStore, Store, Token,
};
use stats::{figure, median, per_s};

const OPS: u32 = 400_000;
const ROUNDS: usize = 5;

#[idempotent(prefix = "bench:attr", keys = [round, id], ttl = 3600, store = store)]
async fn handler(store: &Arc<MemoryStore>, round: u32, id: u32) -> Result<u32, Error> {
    Ok(id)
}

async fn store_pass(store: &MemoryStore, round: u32) -> Duration {
    let started = Instant::now();
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
    started.elapsed()
}

async fn guard_pass(guard: &Idempotency, round: u32) -> Duration {
    let started = Instant::now();
    for id in 0..OPS {
        let key = Key::new("bench:guard", 1, &[&round, &id]).unwrap();
        let out: Result<u32, Error> = guard.run(key, async { Ok(id) }).await;
        out.unwrap();
    }
    started.elapsed()
}

async fn attribute_pass(store: &Arc<MemoryStore>, round: u32) -> Duration {
    let started = Instant::now();
    for id in 0..OPS {
        handler(store, round, id).await.unwrap();
    }
    started.elapsed()
}

async fn duplicate_pass(store: &Arc<MemoryStore>, round: u32) -> Duration {
    let started = Instant::now();
    for id in 0..OPS {
        assert!(matches!(
            handler(store, round, id).await,
            Err(Error::Duplicate { .. })
        ));
    }
    started.elapsed()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (mut s, mut g, mut a, mut d) = (vec![], vec![], vec![], vec![]);
        for round in 0..=ROUNDS as u32 {
            // A fresh store per pass, so every pass starts from an empty map; guard and
            // attribute passes take turns going first.
            let fresh = || Arc::new(MemoryStore::new());
            let store_rate = per_s(OPS as usize, store_pass(&fresh(), round).await);
            let guard_store = fresh();
            let guard = Idempotency::new(Duration::from_secs(3600)).store(guard_store.clone());
            let attribute_store = fresh();
            let (guard_rate, attribute_rate) = if round % 2 == 0 {
                let g = per_s(OPS as usize, guard_pass(&guard, round).await);
                (g, per_s(OPS as usize, attribute_pass(&attribute_store, round).await))
            } else {
                let a = per_s(OPS as usize, attribute_pass(&attribute_store, round).await);
                (per_s(OPS as usize, guard_pass(&guard, round).await), a)
            };
            let duplicate_rate = per_s(OPS as usize, duplicate_pass(&attribute_store, round).await);
            let passes = [store_rate, guard_rate, attribute_rate, duplicate_rate];
            println!(
                "round {round}: store {:.0}/s, guard {:.0}/s, attribute {:.0}/s, duplicates {:.0}/s",
                passes[0], passes[1], passes[2], passes[3]
            );
            if round > 0 {
                // Round 0 warms up.
                s.push(passes[0]);
                g.push(passes[1]);
                a.push(passes[2]);
                d.push(passes[3]);
            }
        }
        let (s, g, a, d) = (median(&s), median(&g), median(&a), median(&d));
        figure("store_cycles_per_s", s, 0);
        figure("guard_cycles_per_s", g, 0);
        figure("attribute_cycles_per_s", a, 0);
        figure("attribute_over_guard", a / g, 3);
        figure("duplicate_claims_per_s", d, 0);
    });
}
