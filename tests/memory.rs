//! The in-memory store: the conformance suite, plus what only a store with a manual clock can
//! show exactly.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/claim_rule.rs"]
mod claim_rule;
mod conformance;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency::memory::{Clock, ManualClock};
use idempotency::store::{
    next_fence, BoxFuture, Claim, ClaimRequest, Completion, RecordState, SharedOperatorStore,
    Store, Token, DEFAULT_MAX_RESULT_SIZE, MAX_DURATION,
};
use idempotency::{Key, MemoryStore, SharedStore};

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

impl conformance::OperatorBackend for Memory {
    fn operator_store(&self) -> SharedOperatorStore {
        self.0.clone()
    }
}

async fn memory() -> Memory {
    Memory(Arc::new(MemoryStore::new()))
}

conformance_suite!(memory);

/// `store::claim_answer`, which every store decides its claims by, answers each case of the
/// rule's table as the table says.
#[test]
fn a_claim_answers_every_record_by_the_rule_table() {
    claim_rule::check_claim_answer();
}

fn claim_req(key: &Key, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(key.clone(), Token::generate(), lease, ttl)
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

    let done = Completion::new(None, ttl);
    assert!(store.complete(&key, &second.token, &done).await.unwrap());
    clock.advance(ttl - Duration::from_nanos(1));
    assert!(matches!(
        store.claim(&claim_req(&key, lease, ttl)).await.unwrap(),
        Claim::Completed { fence: 2, .. }
    ));
    clock.advance(Duration::from_nanos(1));
    assert!(store.read(&key).await.unwrap().is_none());
    // No record left: the fence is the clock's time in microseconds, past every earlier one.
    assert_eq!(
        store.claim(&claim_req(&key, lease, ttl)).await.unwrap(),
        Claim::Acquired {
            fence: (lease + ttl).as_micros() as u64
        }
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

#[tokio::test]
async fn fence_is_one_more_than_the_records_or_the_clock_in_microseconds() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    let key = Key::new("fence-rule", 1, &[&1u8]).unwrap();
    let lease = Duration::from_secs(10);
    let ttl = Duration::from_secs(100);
    let acquire = |req: ClaimRequest| {
        let store = &store;
        async move {
            match store.claim(&req).await.unwrap() {
                Claim::Acquired { fence } => (fence, req.token),
                other => panic!("not acquired: {other:?}"),
            }
        }
    };

    // A manual clock at zero: the first fence is 1, as `next_fence(None, 0)` says.
    assert_eq!(clock.unix_micros(), 0);
    let (first, token) = acquire(claim_req(&key, lease, ttl)).await;
    assert_eq!(first, next_fence(None, 0));
    assert_eq!(first, 1);

    // A released record and an expired lease both count up from the record's fence.
    assert!(store.release(&key, &token).await.unwrap());
    let (second, _) = acquire(claim_req(&key, lease, ttl)).await;
    assert_eq!(second, 2);
    clock.advance(lease);
    let (third, token) = acquire(claim_req(&key, lease, ttl)).await;
    assert_eq!(third, 3);

    // Once the record has expired, the clock takes over: 10 s + 3 s + 100 s in microseconds.
    clock.advance(Duration::from_secs(3));
    let done = Completion::new(None, ttl);
    assert!(store.complete(&key, &token, &done).await.unwrap());
    clock.advance(ttl);
    assert!(store.read(&key).await.unwrap().is_none());
    assert_eq!(clock.unix_micros(), 113_000_000);
    let (fourth, _) = acquire(claim_req(&key, lease, ttl)).await;
    assert_eq!(fourth, next_fence(None, clock.unix_micros()));
    assert_eq!(fourth, 113_000_000);
    assert!(fourth > third);

    // A key never seen also starts at the clock.
    let other = Key::new("fence-rule", 1, &[&2u8]).unwrap();
    let (fresh, _) = acquire(claim_req(&other, lease, ttl)).await;
    assert_eq!(fresh, 113_000_000);
}

#[tokio::test]
async fn fences_on_the_system_clock_are_unix_microseconds_and_grow_across_expiry() {
    let store = MemoryStore::new();
    let key = Key::new("fence-system", 1, &[&1u8]).unwrap();
    let unix_micros = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as u64
    };
    let mut fences = Vec::new();
    for _ in 0..3 {
        let before = unix_micros();
        let req = claim_req(&key, Duration::from_secs(30), Duration::from_millis(1));
        let Claim::Acquired { fence } = store.claim(&req).await.unwrap() else {
            panic!("not acquired")
        };
        // The store's clock follows the wall clock from the moment it was created.
        let slack = 1_000_000;
        assert!(
            (before - slack..=unix_micros() + slack).contains(&fence),
            "{fence} is not the time of the claim"
        );
        assert!(
            fences.iter().all(|earlier| *earlier < fence),
            "{fence} after {fences:?}"
        );
        fences.push(fence);
        // Released: the next acquisition counts up from the record.
        assert!(store.release(&key, &req.token).await.unwrap());
        let again = claim_req(&key, Duration::from_secs(30), Duration::from_millis(1));
        assert_eq!(
            store.claim(&again).await.unwrap(),
            Claim::Acquired { fence: fence + 1 }
        );
        fences.push(fence + 1);
        let done = Completion::new(None, Duration::from_millis(1));
        assert!(store.complete(&key, &again.token, &done).await.unwrap());
        // Wait (bounded) for the record to expire.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while store.read(&key).await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "never expired");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[tokio::test]
async fn huge_and_tiny_durations_are_clamped_to_whole_milliseconds() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    let key = Key::new("durations", 1, &[&1u8]).unwrap();
    clock.advance(Duration::from_secs(1));

    let owner = claim_req(&key, Duration::MAX, Duration::MAX);
    assert!(matches!(
        store.claim(&owner).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let state = store.read(&key).await.unwrap().unwrap().state;
    assert_eq!(
        state,
        RecordState::InProgress {
            lease_left: MAX_DURATION
        }
    );
    clock.advance(Duration::from_secs(1));
    assert!(store
        .renew(&key, &owner.token, Duration::MAX)
        .await
        .unwrap());
    let state = store.read(&key).await.unwrap().unwrap().state;
    assert_eq!(
        state,
        RecordState::InProgress {
            lease_left: MAX_DURATION
        }
    );
    let done = Completion::new(None, Duration::MAX);
    assert!(store.complete(&key, &owner.token, &done).await.unwrap());
    clock.advance(MAX_DURATION - Duration::from_millis(1));
    assert_eq!(
        store.read(&key).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    clock.advance(Duration::from_millis(1));
    assert!(store.read(&key).await.unwrap().is_none());

    // A sub-millisecond lease is rounded up to whole milliseconds, zero to one.
    let short = Key::new("durations", 1, &[&2u8]).unwrap();
    let owner = claim_req(&short, Duration::from_micros(1500), Duration::ZERO);
    store.claim(&owner).await.unwrap();
    assert_eq!(
        store.read(&short).await.unwrap().unwrap().state,
        RecordState::InProgress {
            lease_left: Duration::from_millis(2)
        }
    );
    assert!(store
        .renew(&short, &owner.token, Duration::ZERO)
        .await
        .unwrap());
    assert_eq!(
        store.read(&short).await.unwrap().unwrap().state,
        RecordState::InProgress {
            lease_left: Duration::from_millis(1)
        }
    );
}

#[test]
fn max_result_size_defaults_to_the_shared_default_and_is_configurable() {
    assert_eq!(
        Store::max_result_size(&MemoryStore::new()),
        DEFAULT_MAX_RESULT_SIZE
    );
    let store = MemoryStore::builder().max_result_size(8 << 20).build();
    assert_eq!(store.max_result_size(), 8 << 20);
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_result_size(100)
        .build();
    assert_eq!(store.max_result_size(), 100);
    let shared: SharedStore = Arc::new(store);
    assert_eq!(shared.max_result_size(), 100);
}

#[tokio::test]
async fn fresh_key_traffic_keeps_the_store_bounded_by_its_live_records() {
    // Four waves of new keys, each expiring 1 s after it completes, 1.5 s apart: after each
    // wave only that wave is live. The store may hold at most twice its live records plus a
    // constant (64 shards, each swept no later than at 1,024 records).
    const WAVE: u32 = 300_000;
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::with_clock(clock.clone());
    let ttl = Duration::from_secs(1);
    let done = Completion::new(None, ttl);
    let bound = 2 * WAVE as usize + 64 * 1024;
    for wave in 0..4u32 {
        for i in 0..WAVE {
            let key = Key::new("waves", 1, &[&wave, &i]).unwrap();
            let req = claim_req(&key, ttl, ttl);
            assert!(matches!(
                store.claim(&req).await.unwrap(),
                Claim::Acquired { .. }
            ));
            assert!(store.complete(&key, &req.token, &done).await.unwrap());
        }
        let held = store.len();
        assert!(
            held <= bound,
            "after wave {wave}: {held} records held for {WAVE} live (bound {bound})"
        );
        clock.advance(Duration::from_millis(1500));
    }
}

#[tokio::test]
async fn boxed_and_static_stores_are_stores() {
    use idempotency::store::Store;
    use idempotency::{Idempotency, Key};
    async fn run_on(store: impl Store) -> Result<u32, idempotency::Error> {
        let key = Key::new("pointer", 1, &[&1u8])?;
        Idempotency::new(Duration::from_secs(60))
            .store(Arc::new(store))
            .run(key, async { Ok(7) })
            .await
    }
    assert_eq!(run_on(Box::new(MemoryStore::new())).await.unwrap(), 7);
    let leaked: &'static MemoryStore = Box::leak(Box::new(MemoryStore::new()));
    assert_eq!(run_on(leaked).await.unwrap(), 7);
    // The leaked store saw the call: a second one is a duplicate.
    assert!(run_on(leaked).await.unwrap_err().is_duplicate());
}

/// A large handler future: `SIZE` bytes held across an await.
macro_rules! large_body {
    ($size:expr) => {
        async {
            let buffer = [7u8; $size];
            tokio::task::yield_now().await;
            Ok::<u8, idempotency::Error>(buffer[$size - 1])
        }
    };
}

#[idempotency::idempotent(prefix = "future-size:small", keys = [id], ttl = 60, store = store)]
async fn small_handler(store: &Arc<MemoryStore>, id: u32) -> Result<u8, idempotency::Error> {
    Ok(7)
}

#[idempotency::idempotent(prefix = "future-size:large", keys = [id], ttl = 60, store = store)]
async fn large_handler(store: &Arc<MemoryStore>, id: u32) -> Result<u8, idempotency::Error> {
    let buffer = [7u8; 4096];
    tokio::task::yield_now().await;
    Ok(buffer[4095])
}

/// A guarded call's future holds the handler's future a bounded number of times, whatever
/// its size: once when the body is made from the claim (`run_with`, the attribute), at most
/// three times when it was made before (`run`: it waits in the call while the key is
/// claimed, then runs in place). Each further copy would cost every spawned handler its size
/// again in memory and in copying. Every call runs, so the bodies are real.
#[tokio::test]
async fn a_call_holds_its_handler_future_a_bounded_number_of_times() {
    const SIZE: usize = 4096;
    let store = Arc::new(MemoryStore::new());
    let (small, large) = (small_handler(&store, 1), large_handler(&store, 1));
    let (small_size, large_size) = (std::mem::size_of_val(&small), std::mem::size_of_val(&large));
    assert!(
        large_size < small_size + 2 * SIZE,
        "attribute: {large_size} bytes for a {SIZE}-byte body over {small_size}"
    );
    assert_eq!((small.await.unwrap(), large.await.unwrap()), (7, 7));
    let guard =
        idempotency::Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    let key = |id: u32| Key::new("future-size", 1, &[&id]).unwrap();
    let small = guard.run(key(0), async { Ok::<u8, idempotency::Error>(7) });
    let made_before = guard.run(key(1), large_body!(SIZE));
    let made_from_claim = guard.operation(key(2)).run_with(|_| large_body!(SIZE));
    let base = std::mem::size_of_val(&small);
    let before = std::mem::size_of_val(&made_before);
    let from_claim = std::mem::size_of_val(&made_from_claim);
    assert!(
        from_claim < base + 2 * SIZE,
        "run_with: {from_claim} bytes for a {SIZE}-byte body over {base}"
    );
    assert!(
        before < base + 4 * SIZE,
        "run: {before} bytes for a {SIZE}-byte body over {base}"
    );
    assert_eq!(small.await.unwrap(), 7);
    assert_eq!(made_before.await.unwrap(), 7);
    assert_eq!(made_from_claim.await.unwrap(), 7);
}

/// A call dropped before its first poll has done nothing: what starts it (the operation and
/// its body) is dropped with it, so no claim was sent (the key is free at once for the next
/// call) and no body ran. For a body made before the call (`run`) and one made from the
/// claim (`run_with`).
#[tokio::test]
async fn a_call_dropped_before_its_first_poll_claims_nothing_and_runs_nothing() {
    let store = Arc::new(MemoryStore::new());
    let guard = idempotency::Idempotency::new(Duration::from_secs(60)).store(store.clone());
    let key = Key::new("unpolled", 1, &[&1u32]).unwrap();
    let ran = AtomicUsize::new(0);
    let made_before = guard.run(key.clone(), async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok::<u8, idempotency::Error>(1)
    });
    let made_from_claim = guard.operation(key.clone()).run_with(|_| async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok::<u8, idempotency::Error>(2)
    });
    drop(made_before);
    drop(made_from_claim);
    tokio::task::yield_now().await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert!(store.read(&key).await.unwrap().is_none());
    let next = guard.run(key.clone(), async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok::<u8, idempotency::Error>(3)
    });
    assert_eq!(next.await.unwrap(), 3);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// Each new span's name, with its parent's.
type SpansSeen = Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

/// Records each new span's name with its parent's.
struct Parents(SpansSeen);

impl<S> tracing_subscriber::Layer<S> for Parents
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        _: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            let parent = span.parent().map(|parent| parent.name().to_string());
            self.0
                .lock()
                .unwrap()
                .push((span.name().to_string(), parent));
        }
    }
}

/// A call's span (`idempotency`) is opened when the call first runs, as a child of the span
/// it runs in, not of wherever its future was made: a consumer that makes the call and then
/// instruments it sees the call inside its own span.
#[tokio::test]
async fn the_call_span_is_a_child_of_the_span_the_call_runs_in() {
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::Registry::default().with(Parents(seen.clone()));
    let _default = tracing::subscriber::set_default(subscriber);
    let guard =
        idempotency::Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    let call = guard.run(Key::new("span", 1, &[&1u32]).unwrap(), async {
        Ok::<u8, idempotency::Error>(7)
    });
    let with = guard
        .operation(Key::new("span", 1, &[&2u32]).unwrap())
        .run_with(|_| async { Ok::<u8, idempotency::Error>(8) });
    let consumer = tracing::info_span!("consumer");
    assert_eq!(call.instrument(consumer.clone()).await.unwrap(), 7);
    assert_eq!(with.instrument(consumer).await.unwrap(), 8);
    let seen = seen.lock().unwrap();
    let calls: Vec<_> = seen
        .iter()
        .filter(|(name, _)| name == "idempotency")
        .collect();
    assert_eq!(calls.len(), 2, "{seen:?}");
    for (_, parent) in calls {
        assert_eq!(parent.as_deref(), Some("consumer"), "{seen:?}");
    }
}

/// Records the names of the spans fields were recorded into after they opened.
struct Recorded(Arc<std::sync::Mutex<Vec<String>>>);

impl<S> tracing_subscriber::Layer<S> for Recorded
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_record(
        &self,
        id: &tracing::span::Id,
        _: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if let Some(span) = ctx.span(id) {
            self.0.lock().unwrap().push(span.name().to_string());
        }
    }
}

/// A call records its key, fence and outcome into its own span: when the subscriber does not
/// record that span (its level is `DEBUG`), they go nowhere, never into the span of the code
/// that made the call, which may have fields of the same names.
#[tokio::test]
async fn a_call_whose_span_is_off_records_nothing_into_its_callers_span() {
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;
    let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::Registry::default()
        .with(Recorded(recorded.clone()))
        .with(tracing_subscriber::filter::LevelFilter::INFO);
    let _default = tracing::subscriber::set_default(subscriber);
    let guard =
        idempotency::Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    let consumer = tracing::info_span!(
        "consumer",
        key = tracing::field::Empty,
        fence = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let key = |n: u32| Key::new("quiet", 1, &[&n]).unwrap();
    let calls = async {
        guard
            .run(key(1), async { Ok::<u8, idempotency::Error>(7) })
            .await
            .unwrap();
        let batch: Vec<Result<u32, idempotency::Error>> = guard
            .run_batch(vec![(key(2), 2), (key(3), 3)], |n| async move { Ok(n) })
            .await;
        assert!(batch.iter().all(Result::is_ok));
        let lock =
            idempotency::lock::Lock::new(Arc::new(MemoryStore::new()), Duration::from_secs(5));
        drop(lock.try_lock(key(4)).await.unwrap());
    };
    calls.instrument(consumer).await;
    let recorded = recorded.lock().unwrap();
    assert!(recorded.is_empty(), "fields recorded into {recorded:?}");
}

/// `OnInProgress::Wait(Duration::MAX)` (wait as long as it takes) runs the handler on a free key
/// and, on a held one, waits for the owner and then answers as for a completed key, instead of
/// overflowing the clock on every call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_wait_policy_runs_and_waits() {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let idem = idempotency::Idempotency::new(Duration::from_secs(60))
        .store(store.clone())
        .on_in_progress(idempotency::OnInProgress::Wait(Duration::MAX));
    let runs = AtomicUsize::new(0);
    let free = Key::new("wait-max", 1, &[&"free"]).unwrap();
    let out: Result<(), idempotency::Error> = idem
        .run(free, async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    out.unwrap();

    let held = Key::new("wait-max", 1, &[&"held"]).unwrap();
    let owner = claim_req(&held, Duration::from_secs(30), Duration::from_secs(60));
    assert!(matches!(
        store.claim(&owner).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let waiter = tokio::spawn({
        let idem = idem.clone();
        async move {
            let out: Result<(), idempotency::Error> =
                idem.run(held, async { panic!("the duplicate ran") }).await;
            out
        }
    });
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(store
        .complete(&owner.key, &owner.token, &done)
        .await
        .unwrap());
    assert!(matches!(
        waiter.await.unwrap(),
        Err(idempotency::Error::Duplicate { .. })
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
