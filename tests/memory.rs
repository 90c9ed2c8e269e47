//! The in-memory store: the conformance suite, plus what only a store with a manual clock can
//! show exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod conformance;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotent::memory::{ManualClock, MemoryStore};
use idempotent::{
    BoxFuture, Claim, ClaimRequest, Completion, Key, RecordState, SharedStore, Store, Token,
};

struct Memory(Arc<MemoryStore>);

impl conformance::Backend for Memory {
    fn namespace(&self) -> &str {
        "memory"
    }
    fn store(&self) -> SharedStore {
        self.0.clone()
    }
    fn lose_data<'a>(&'a self, _prefix: &'a str) -> BoxFuture<'a, ()> {
        self.0.clear();
        Box::pin(async {})
    }
}

async fn memory() -> Memory {
    Memory(Arc::new(MemoryStore::new()))
}

conformance_suite!(memory);

fn claim_req(key: &Key, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        token: Token::generate(),
        lease,
        ttl,
        fingerprint: None,
    }
}

#[tokio::test]
async fn lease_and_ttl_follow_the_stores_own_clock_exactly() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    let key = Key::new("clock", 1, &[&1u8]).unwrap();
    let lease = Duration::from_secs(10);
    let ttl = Duration::from_secs(100);

    let first = claim_req(&key, lease, ttl);
    assert_eq!(
        store.claim(&first).await.unwrap(),
        Claim::Acquired { fence: 1 }
    );
    clock.advance(lease - Duration::from_nanos(1));
    assert_eq!(
        store.claim(&claim_req(&key, lease, ttl)).await.unwrap(),
        Claim::InProgress { fence: 1 }
    );
    clock.advance(Duration::from_nanos(1));
    let second = claim_req(&key, lease, ttl);
    assert_eq!(
        store.claim(&second).await.unwrap(),
        Claim::Acquired { fence: 2 }
    );

    let done = Completion { result: None, ttl };
    assert!(store.complete(&key, &second.token, &done).await.unwrap());
    clock.advance(ttl - Duration::from_nanos(1));
    assert!(matches!(
        store.claim(&claim_req(&key, lease, ttl)).await.unwrap(),
        Claim::Completed { fence: 2, .. }
    ));
    clock.advance(Duration::from_nanos(1));
    assert!(store.read(&key).await.unwrap().is_none());
    assert_eq!(
        store.claim(&claim_req(&key, lease, ttl)).await.unwrap(),
        Claim::Acquired { fence: 1 }
    );
}

#[tokio::test]
async fn renewal_outlives_the_ttl_without_losing_the_record() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    let key = Key::new("renew", 1, &[&1u8]).unwrap();
    let owner = claim_req(&key, Duration::from_secs(10), Duration::from_secs(20));
    store.claim(&owner).await.unwrap();
    for _ in 0..10 {
        clock.advance(Duration::from_secs(5));
        assert!(store
            .renew(&key, &owner.token, Duration::from_secs(10))
            .await
            .unwrap());
    }
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::InProgress {
            lease_left: Duration::from_secs(10)
        }
    );
}

#[tokio::test]
async fn expired_records_are_swept() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    for i in 0..10_000u32 {
        let key = Key::new("sweep", 1, &[&i]).unwrap();
        store
            .claim(&claim_req(
                &key,
                Duration::from_secs(1),
                Duration::from_secs(2),
            ))
            .await
            .unwrap();
    }
    assert_eq!(store.len(), 10_000);
    clock.advance(Duration::from_secs(3));
    // New traffic pays for sweeping the old records, a little at a time.
    for i in 0..200_000u32 {
        let key = Key::new("sweep-new", 1, &[&i]).unwrap();
        store
            .claim(&claim_req(
                &key,
                Duration::from_secs(1),
                Duration::from_secs(2),
            ))
            .await
            .unwrap();
        clock.advance(Duration::from_micros(50));
    }
    assert!(
        store.len() < 200_000,
        "expired records were never swept: {}",
        store.len()
    );
    store.purge_expired();
    assert!(
        store.len() <= 200_000 / 5,
        "live records only: {}",
        store.len()
    );
}

#[test]
fn claims_from_many_threads_on_many_keys_acquire_each_key_once() {
    let store = Arc::new(MemoryStore::new());
    let acquired = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (store, acquired) = (store.clone(), acquired.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    for i in 0..5_000u32 {
                        let key = Key::new("threads", 1, &[&i]).unwrap();
                        let req = claim_req(&key, Duration::from_secs(30), Duration::from_secs(60));
                        if let Claim::Acquired { .. } = store.claim(&req).await.unwrap() {
                            acquired.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(acquired.load(Ordering::SeqCst), 5_000);
    assert_eq!(store.len(), 5_000);
}
