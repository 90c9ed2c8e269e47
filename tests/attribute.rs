//! The attribute's arguments, end to end: each changes behaviour the way its documentation
//! says, on a real (in-memory) store named with `store = ...`.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::store::{RecordState, Store};
use idempotency::{idempotent, Error, Key, MemoryStore, OnError};
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum AppError {
    #[serde(skip)]
    Idem(String),
    Rejected(String),
    Transient,
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(format!("{e:?}"))
    }
}

fn is(err: &Result<impl std::fmt::Debug, AppError>, variant: &str) -> bool {
    matches!(err, Err(AppError::Idem(s)) if s.starts_with(variant))
}

#[derive(Debug, Clone)]
struct Order {
    id: String,
    activity: u32,
    amount: u64,
}

struct Consumer {
    store: Arc<MemoryStore>,
    tenant: &'static str,
    runs: AtomicUsize,
}

impl Consumer {
    fn new() -> Consumer {
        Consumer {
            store: Arc::new(MemoryStore::new()),
            tenant: "acme",
            runs: AtomicUsize::new(0),
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    #[idempotent(prefix = "order:consume", keys = [self.tenant, order.id, order.activity], ttl = 3600, store = self.store)]
    async fn consume(&self, order: &Order) -> Result<u32, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(order.activity)
    }

    #[idempotent(prefix = "order:consume", keys = [self.tenant, order.id, order.activity], ttl = 3600, version = 2, store = self.store)]
    async fn consume_v2(&self, order: &Order) -> Result<u32, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(order.activity)
    }

    #[idempotent(prefix = "payment", keys = [order.id], ttl = 3600, store = self.store, fingerprint = [order.amount], replay)]
    async fn pay(&self, order: &Order) -> Result<String, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(format!("paid {}", order.amount))
    }

    #[idempotent(prefix = "fragile", keys = [order.id], ttl = 3600, store = self.store, on_error = hold)]
    async fn fragile(&self, order: &Order, fail: bool) -> Result<(), AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if fail {
            return Err(AppError::Transient);
        }
        Ok(())
    }

    #[idempotent(prefix = "validate", keys = [order.id], ttl = 3600, store = self.store, on_error = store)]
    async fn validate(&self, order: &Order) -> Result<(), AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Err(AppError::Rejected(format!(
            "amount {} too large",
            order.amount
        )))
    }

    #[idempotent(prefix = "classified", keys = [order.id], ttl = 3600, store = self.store, on_error = classify)]
    async fn classified(&self, order: &Order, err: AppError) -> Result<(), AppError> {
        let _ = order;
        self.runs.fetch_add(1, Ordering::SeqCst);
        Err(err)
    }

    #[idempotent(prefix = "skip", keys = [order.id], ttl = 3600, store = self.store, on_in_progress = skip)]
    async fn skipping(&self, order: &Order) -> Result<(), AppError> {
        let _ = order;
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    #[idempotent(prefix = "with-done", keys = [order.id], ttl = 3600, store = self.store, done = self.already_cooked(&order.id))]
    async fn with_done(&self, order: &Order) -> Result<(), AppError> {
        let _ = order;
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn already_cooked(&self, id: &str) -> Result<bool, AppError> {
        Ok(id.starts_with("cooked-"))
    }
}

fn classify(err: &AppError) -> OnError {
    match err {
        AppError::Transient => OnError::Release,
        _ => OnError::Hold,
    }
}

fn order(id: &str) -> Order {
    Order {
        id: id.to_string(),
        activity: 9,
        amount: 100,
    }
}

#[tokio::test]
async fn method_keys_come_from_self_and_parameters() {
    let c = Consumer::new();
    assert_eq!(c.consume(&order("A-1")).await.unwrap(), 9);
    assert!(is(&c.consume(&order("A-1")).await, "Duplicate"));
    assert_eq!(c.consume(&order("A-2")).await.unwrap(), 9);
    assert_eq!(c.runs(), 2);
    let key = Key::new("order:consume", 1, &[&"acme", &"A-1", &9u32]).unwrap();
    let record = c.store.read(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
}

#[tokio::test]
async fn a_new_version_is_a_new_key() {
    let c = Consumer::new();
    c.consume(&order("A-1")).await.unwrap();
    c.consume_v2(&order("A-1")).await.unwrap();
    assert!(is(&c.consume_v2(&order("A-1")).await, "Duplicate"));
    assert_eq!(c.runs(), 2);
}

#[tokio::test]
async fn fingerprint_and_replay() {
    let c = Consumer::new();
    assert_eq!(c.pay(&order("P-1")).await.unwrap(), "paid 100");
    assert_eq!(c.pay(&order("P-1")).await.unwrap(), "paid 100");
    let mut changed = order("P-1");
    changed.amount = 999;
    assert!(is(&c.pay(&changed).await, "PayloadMismatch"));
    assert_eq!(c.runs(), 1);
}

#[tokio::test]
async fn on_error_hold_blocks_the_key() {
    let c = Consumer::new();
    assert_eq!(
        c.fragile(&order("F-1"), true).await,
        Err(AppError::Transient)
    );
    assert!(is(&c.fragile(&order("F-1"), false).await, "Held"));
    assert_eq!(c.runs(), 1);
}

#[tokio::test]
async fn on_error_store_replays_the_error() {
    let c = Consumer::new();
    let first = c.validate(&order("V-1")).await;
    assert_eq!(
        first,
        Err(AppError::Rejected("amount 100 too large".into()))
    );
    assert_eq!(c.validate(&order("V-1")).await, first);
    assert_eq!(c.runs(), 1);
}

#[tokio::test]
async fn on_error_classifier_decides_per_error() {
    let c = Consumer::new();
    // A transient error releases: the retry runs.
    assert_eq!(
        c.classified(&order("C-1"), AppError::Transient).await,
        Err(AppError::Transient)
    );
    let rejected = AppError::Rejected("no".into());
    assert_eq!(
        c.classified(&order("C-1"), rejected.clone_for_test()).await,
        Err(rejected)
    );
    // That one was held.
    assert!(is(
        &c.classified(&order("C-1"), AppError::Transient).await,
        "Held"
    ));
    assert_eq!(c.runs(), 2);
}

impl AppError {
    fn clone_for_test(&self) -> AppError {
        match self {
            AppError::Idem(s) => AppError::Idem(s.clone()),
            AppError::Rejected(s) => AppError::Rejected(s.clone()),
            AppError::Transient => AppError::Transient,
        }
    }
}

#[tokio::test]
async fn on_in_progress_skip() {
    let c = Consumer::new();
    let key = Key::new("skip", 1, &[&"S-1"]).unwrap();
    let live = idempotency::store::ClaimRequest::new(
        key,
        idempotency::store::Token::generate(),
        std::time::Duration::from_secs(30),
        std::time::Duration::from_secs(60),
    );
    c.store.claim(&live).await.unwrap();
    assert!(is(&c.skipping(&order("S-1")).await, "Skipped"));
    assert_eq!(c.runs(), 0);
}

#[tokio::test]
async fn done_consults_the_business() {
    let c = Consumer::new();
    assert!(is(&c.with_done(&order("cooked-1")).await, "Duplicate"));
    c.with_done(&order("raw-1")).await.unwrap();
    assert_eq!(c.runs(), 1);
}

#[tokio::test]
async fn invalid_key_is_a_typed_error_and_runs_nothing() {
    let c = Consumer::new();
    assert!(is(
        &c.consume(&order("")).await,
        "InvalidKey(EmptyPart { index: 1 })"
    ));
    assert_eq!(c.runs(), 0);
}

static FREE_RUNS: AtomicUsize = AtomicUsize::new(0);

/// A free function with an owned parameter, `?` and an early `return`.
#[idempotent(prefix = "free", keys = [id], ttl = 60, store = STORE.clone())]
async fn free(id: String, fail: bool) -> Result<usize, AppError> {
    FREE_RUNS.fetch_add(1, Ordering::SeqCst);
    if fail {
        return Err(AppError::Transient);
    }
    let n: usize = id.len();
    Ok(n)
}

static STORE: std::sync::LazyLock<Arc<MemoryStore>> =
    std::sync::LazyLock::new(|| Arc::new(MemoryStore::new()));

#[tokio::test]
async fn free_function_with_owned_parameters() {
    assert_eq!(free("x-1".into(), true).await, Err(AppError::Transient));
    assert_eq!(free("x-1".into(), false).await, Ok(3));
    assert!(is(&free("x-1".into(), false).await, "Duplicate"));
    assert_eq!(FREE_RUNS.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_duplicates_through_the_attribute() {
    let c = Arc::new(Consumer::new());
    let start = Arc::new(tokio::sync::Barrier::new(100));
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let (c, start) = (c.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                c.consume(&order("H-1")).await
            })
        })
        .collect();
    let mut ok = 0;
    let mut filtered = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(AppError::Idem(s)) if s.starts_with("Duplicate") || s.starts_with("InProgress") => {
                filtered += 1
            }
            Err(other) => panic!("unexpected: {other:?}"),
        }
    }
    assert_eq!((ok, filtered), (1, 99));
    assert_eq!(c.runs(), 1);
}
