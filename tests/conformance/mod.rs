//! The conformance suite: every rule of the semantics (design.md section 2), written once,
//! generic over the store. Each backend's test file instantiates it with
//! `conformance_suite!(make_backend)`, where `make_backend` is an async fn returning a
//! [`Backend`].
//!
//! Every case uses its own key prefix, so backends that share a server (Redis, SQL) can run
//! cases in parallel; the backend cleans its prefix up when dropped.
//!
//! Two wrappers inject faults a healthy store never produces on demand: [`Down`] (the store
//! refuses every command) and [`LostReplies`] (the store applies a command and the reply is
//! lost). Each backend's own test file also produces these cases with the real server
//! (killing it, cutting the connection) where that is possible.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::{
    BoxFuture, Claim, ClaimRequest, Completion, Error, Guard, InProgress, Key, OnError,
    OnStoreError, Record, RecordState, SharedStore, Store, StoreError, StoreErrorKind, Token,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Barrier, Notify};

mod settle;
pub use settle::*;

/// A backend under test.
pub trait Backend: Send + Sync + 'static {
    /// A key prefix that only this backend instance uses; the backend deletes everything
    /// under it when dropped.
    fn namespace(&self) -> &str;
    /// The store under test.
    fn store(&self) -> SharedStore;
    /// Loses every record whose key starts with `prefix`, as a restarted server without
    /// persistence would.
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()>;
    /// Whether in-progress, completed and mismatch answers carry the owner's fence. A tiered
    /// store answers duplicates from its front, whose fences are its own (only an acquired
    /// claim carries the authoritative back's fence): there only the kind of answer is checked.
    fn answers_carry_the_owners_fence(&self) -> bool {
        true
    }
}

/// Whether an answer's fence `seen` is the owner's fence `owner`, as far as `b` reports it.
fn same_fence(b: &impl Backend, seen: u64, owner: u64) -> bool {
    seen == owner || !b.answers_carry_the_owners_fence()
}

/// Asserts that `got` is `want`, fences included where `b` reports the owner's fence.
#[track_caller]
fn assert_answer(b: &impl Backend, got: Claim, want: Claim) {
    if b.answers_carry_the_owners_fence() {
        assert_eq!(got, want);
    } else {
        assert_eq!(
            std::mem::discriminant(&got),
            std::mem::discriminant(&want),
            "{got:?} is not {want:?}"
        );
    }
}

/// The handler error used by the suite.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
pub enum AppError {
    #[error("idempotency: {0}")]
    #[serde(skip)]
    Idem(String),
    #[error("business: {0}")]
    Business(String),
}

/// Keeps the framework's error inspectable in assertions.
#[derive(Debug, thiserror::Error)]
pub enum TestError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("business: {0}")]
    Business(String),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(format!("{e:?}"))
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A prefix no other case uses, under the backend's namespace.
pub fn unique_prefix(b: &impl Backend, case: &str) -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{}:{case}:{n}", b.namespace())
}

/// A namespace no other backend instance (in this run or another) uses.
pub fn unique_namespace() -> String {
    let token = format!("{:?}", Token::generate());
    format!("conf:{}", &token[6..token.len() - 1])
}

pub fn key(prefix: &str, parts: &[&dyn idempotency::KeyPart]) -> Key {
    Key::new(prefix, 1, parts).unwrap()
}

fn guard(store: &SharedStore) -> Guard {
    Guard::new(Duration::from_secs(60)).store(store.clone())
}

fn req(key: &Key, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        token: Token::generate(),
        lease,
        ttl: Duration::from_secs(60),
        fingerprint: None,
    }
}

/// Reads until `pred` holds, for effects that a store applies on a background task (a
/// release after cancellation). Fails after five seconds.
async fn eventually(store: &SharedStore, key: &Key, pred: impl Fn(&Option<Record>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let record = store.read(key).await.unwrap();
        if pred(&record) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition never held; last record: {record:?}"
        );
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Rule 1: claim is one atomic operation; fences grow by one per acquisition.

pub async fn concurrent_duplicates_run_the_handler_exactly_once(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "hundred");
    let k = key(&prefix, &[&"order-1", &"activity-9"]);
    let executions = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(100));
    let finished_others = Arc::new(Notify::new());
    let others_done = Arc::new(AtomicUsize::new(0));

    let mut tasks = Vec::new();
    for _ in 0..100 {
        let (g, k) = (guard(&store), k.clone());
        let (executions, start) = (executions.clone(), start.clone());
        let (finished_others, others_done) = (finished_others.clone(), others_done.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let out: Result<(), TestError> = g
                .run(k, async {
                    executions.fetch_add(1, Ordering::SeqCst);
                    // Hold the claim until all 99 others have been turned away, so every one
                    // of them meets a live claim.
                    let wait = finished_others.notified();
                    if others_done.load(Ordering::SeqCst) < 99 {
                        wait.await;
                    }
                    Ok(())
                })
                .await;
            if out.is_err() && others_done.fetch_add(1, Ordering::SeqCst) + 1 == 99 {
                finished_others.notify_one();
            }
            out
        }));
    }
    let mut ok = 0;
    let mut in_progress = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(()) => ok += 1,
            Err(TestError::Idem(Error::InProgress { fence, .. })) => in_progress.push(fence),
            Err(other) => panic!("unexpected outcome: {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!((ok, in_progress.len()), (1, 99));
    // Every duplicate met the one owner's claim.
    let owner = store.read(&k).await.unwrap().unwrap().fence;
    assert!(
        in_progress.iter().all(|f| same_fence(&b, *f, owner)),
        "owner fence {owner}, duplicates saw {in_progress:?}"
    );

    let again: Result<(), TestError> = guard(&store).run(k, async { Ok(()) }).await;
    assert!(matches!(
        again,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

pub async fn concurrent_store_claims_acquire_exactly_once(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "raw-claims");
    for round in 0..20u32 {
        let k = key(&prefix, &[&round]);
        let start = Arc::new(Barrier::new(32));
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (store, k, start) = (store.clone(), k.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    store
                        .claim(&req(&k, Duration::from_secs(30)))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut acquired = Vec::new();
        let mut in_progress = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Claim::Acquired { fence } => acquired.push(fence),
                Claim::InProgress { fence } => in_progress.push(fence),
                other => panic!("unexpected claim: {other:?}"),
            }
        }
        assert_eq!(acquired.len(), 1, "round {round}");
        assert!(
            in_progress.iter().all(|f| same_fence(&b, *f, acquired[0])),
            "round {round}: acquired {acquired:?}, in progress {in_progress:?}"
        );
    }
}

pub async fn fence_grows_by_one_on_every_acquisition(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fence"), &[&1u8]);
    let first = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: f } = store.claim(&first).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    assert!(f >= 1);
    assert!(store.release(&k, &first.token).await.unwrap());
    for expected in f + 1..=f + 4 {
        let r = req(&k, Duration::from_secs(30));
        assert_eq!(
            store.claim(&r).await.unwrap(),
            Claim::Acquired { fence: expected }
        );
        assert!(store.release(&k, &r.token).await.unwrap());
    }
    let r = req(&k, Duration::from_secs(30));
    assert_eq!(
        store.claim(&r).await.unwrap(),
        Claim::Acquired { fence: f + 5 }
    );
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!((record.fence, record.token), (f + 5, r.token));
}

pub async fn fences_grow_across_record_expiry(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fence-expiry"), &[&1u8]);
    let first = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: f } = store.claim(&first).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    assert!(store.release(&k, &first.token).await.unwrap());
    let second = req(&k, Duration::from_secs(30));
    assert_eq!(
        store.claim(&second).await.unwrap(),
        Claim::Acquired { fence: f + 1 }
    );
    let done = Completion {
        result: None,
        ttl: Duration::from_millis(300),
    };
    assert!(store.complete(&k, &second.token, &done).await.unwrap());

    // Wait (bounded) for the record to expire: its fence is gone with it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while store.read(&k).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The next owner's fence is still above every earlier one, so a stalled earlier owner's
    // write is refused by `... WHERE fence < $fence`.
    let third = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: g } = store.claim(&third).await.unwrap() else {
        panic!("an expired key was not acquired")
    };
    assert!(g > f + 1, "fence {g} after {f} and {}", f + 1);
}

pub async fn completed_key_is_a_duplicate_and_replays_its_result(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "replay"), &[&"pay-1"]);
    let executions = AtomicUsize::new(0);
    let run = |amount: u64| {
        let (g, k, executions) = (guard(&store), k.clone(), &executions);
        async move {
            g.operation(k)
                .replay()
                .run(async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, TestError>(format!("receipt for {amount}"))
                })
                .await
        }
    };
    assert_eq!(run(10).await.unwrap(), "receipt for 10");
    let f = store.read(&k).await.unwrap().unwrap().fence;
    // The duplicate gets the first run's result, not its own.
    assert_eq!(run(99).await.unwrap(), "receipt for 10");
    assert_eq!(executions.load(Ordering::SeqCst), 1);

    // Without replay, the duplicate is reported as such.
    let plain: Result<String, TestError> =
        guard(&store).run(k.clone(), async { Ok("x".into()) }).await;
    assert!(matches!(
        plain,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));

    let claim = store.claim(&req(&k, Duration::from_secs(1))).await.unwrap();
    assert!(
        matches!(claim, Claim::Completed { fence, result: Some(_) } if same_fence(&b, fence, f)),
        "{claim:?}, first fence {f}"
    );
}

pub async fn expired_lease_is_taken_over_with_the_next_fence(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "takeover"), &[&"order-7"]);
    let lease = Duration::from_millis(300);
    let old = req(&k, lease);
    let Claim::Acquired { fence: f } = store.claim(&old).await.unwrap() else {
        panic!("a new key was not acquired")
    };

    // While the lease is live, a claim meets it.
    let early = req(&k, lease);
    assert_answer(
        &b,
        store.claim(&early).await.unwrap(),
        Claim::InProgress { fence: f },
    );

    // The old owner stops renewing (crashed); once the lease ran out, the key is taken over.
    tokio::time::sleep(lease * 2).await;
    let new = req(&k, lease);
    assert_eq!(
        store.claim(&new).await.unwrap(),
        Claim::Acquired { fence: f + 1 }
    );

    // The old owner's writes are all refused; the new owner's record is untouched.
    let done = Completion {
        result: None,
        ttl: Duration::from_secs(60),
    };
    assert!(!store.complete(&k, &old.token, &done).await.unwrap());
    assert!(!store.release(&k, &old.token).await.unwrap());
    assert!(!store.renew(&k, &old.token, lease).await.unwrap());
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!((record.fence, record.token), (f + 1, new.token));
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    assert!(store.complete(&k, &new.token, &done).await.unwrap());
}

// ---------------------------------------------------------------------------------------
// Rule 2: the watchdog renews while the handler runs; a handler that outlives its lease
// without renewal loses ownership and its completion is refused.

pub async fn watchdog_keeps_a_slow_handler_owner(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "watchdog"), &[&"slow"]);
    let lease = Duration::from_millis(600);
    let g = guard(&store).lease(lease);
    let probe = {
        let (store, k) = (store.clone(), k.clone());
        async move {
            let mut seen = Vec::new();
            for _ in 0..4 {
                tokio::time::sleep(lease / 2).await;
                seen.push(store.claim(&req(&k, lease)).await.unwrap());
            }
            seen
        }
    };
    let handler = g.run(k.clone(), async {
        // Runs for three leases; only renewal keeps the claim alive.
        tokio::time::sleep(lease * 3).await;
        Ok::<_, TestError>("done")
    });
    let (out, seen) = tokio::join!(handler, probe);
    assert_eq!(out.unwrap(), "done");
    let f = store.read(&k).await.unwrap().unwrap().fence;
    assert!(
        seen.iter()
            .all(|c| matches!(c, Claim::InProgress { fence } if same_fence(&b, *fence, f))),
        "the live claim (fence {f}) was taken over: {seen:?}"
    );
}

pub async fn handler_that_outlives_its_lease_loses_ownership(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "lost"), &[&"order-3"]);
    let lease = Duration::from_millis(300);
    let started = Arc::new(Notify::new());
    let resume = Arc::new(Notify::new());

    // The old owner's future is not polled between `started` and `resume`: a paused process
    // (a stop-the-world stall, a suspended VM). Its watchdog lives in that future, so its
    // lease runs out.
    let old_guard = guard(&store).lease(lease);
    let mut old = {
        let (started, resume) = (started.clone(), resume.clone());
        Box::pin(old_guard.run(k.clone(), async move {
            started.notify_one();
            resume.notified().await;
            Ok::<_, TestError>("old")
        }))
    };
    tokio::select! {
        out = &mut old => panic!("the old owner finished before its pause: {out:?}"),
        () = started.notified() => {}
    }
    let f = store.read(&k).await.unwrap().unwrap().fence;

    // A redelivery waits for the lease to run out, takes over with the next fence and
    // completes.
    let new: Result<&str, TestError> = guard(&store)
        .lease(lease)
        .on_in_progress(InProgress::Wait(Duration::from_secs(10)))
        .run(k.clone(), async { Ok("new") })
        .await;
    assert_eq!(new.unwrap(), "new");

    resume.notify_one();
    match old.await {
        Err(TestError::Idem(Error::LostOwnership { fence, .. })) if fence == f => {}
        other => panic!("the old owner's completion (fence {f}) was accepted: {other:?}"),
    }
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(
        (record.fence, record.state),
        (f + 1, RecordState::Completed)
    );
}

// ---------------------------------------------------------------------------------------
// Rule 3: complete is compare-and-set on the token.

pub async fn complete_and_renew_check_the_token(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "cas"), &[&"x"]);
    let owner = req(&k, Duration::from_secs(30));
    store.claim(&owner).await.unwrap();
    let stranger = Token::generate();
    let done = Completion {
        result: Some(b"r".to_vec()),
        ttl: Duration::from_secs(60),
    };
    assert!(!store.complete(&k, &stranger, &done).await.unwrap());
    assert!(!store
        .renew(&k, &stranger, Duration::from_secs(30))
        .await
        .unwrap());
    assert!(store
        .renew(&k, &owner.token, Duration::from_secs(30))
        .await
        .unwrap());
    assert!(store.complete(&k, &owner.token, &done).await.unwrap());
    // A retried completion by the same owner is harmless.
    assert!(store.complete(&k, &owner.token, &done).await.unwrap());
    // A completed record cannot be released or renewed.
    assert!(!store.release(&k, &owner.token).await.unwrap());
    assert!(!store
        .renew(&k, &owner.token, Duration::from_secs(30))
        .await
        .unwrap());
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.result.as_deref(), Some(&b"r"[..]));
}

pub async fn completing_a_missing_record_is_refused(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "missing"), &[&"x"]);
    let done = Completion {
        result: None,
        ttl: Duration::from_secs(60),
    };
    assert!(!store.complete(&k, &Token::generate(), &done).await.unwrap());
    assert!(store.read(&k).await.unwrap().is_none());
}

// ---------------------------------------------------------------------------------------
// Rule 4: an error releases the claim (only if still ours) and the retry runs.

pub async fn error_releases_and_the_retry_runs(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "release"), &[&"order-2"]);
    let executions = AtomicUsize::new(0);
    let first: Result<(), TestError> = guard(&store)
        .run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Err(TestError::Business("stock service timed out".into()))
        })
        .await;
    assert!(matches!(first, Err(TestError::Business(_))));
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    let f = record.fence;

    let retry: Result<(), TestError> = guard(&store)
        .run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    retry.unwrap();
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.fence),
        (RecordState::Completed, f + 1)
    );
}

pub async fn release_never_removes_another_owners_claim(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "foreign"), &[&"x"]);
    let lease = Duration::from_millis(200);
    let old = req(&k, lease);
    let Claim::Acquired { fence: f } = store.claim(&old).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    tokio::time::sleep(lease * 2).await;
    let new = req(&k, Duration::from_secs(30));
    assert_eq!(
        store.claim(&new).await.unwrap(),
        Claim::Acquired { fence: f + 1 }
    );
    assert!(!store.release(&k, &old.token).await.unwrap());
    assert_answer(
        &b,
        store.claim(&req(&k, lease)).await.unwrap(),
        Claim::InProgress { fence: f + 1 },
    );
}

pub async fn held_error_blocks_the_key(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "hold"), &[&"pay-9"]);
    let first: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .on_error(|_| OnError::Hold)
        .run(async {
            Err(TestError::Business(
                "gateway answered 500 after charging".into(),
            ))
        })
        .await;
    assert!(matches!(first, Err(TestError::Business(_))));
    let executions = AtomicUsize::new(0);
    let again: Result<(), TestError> = guard(&store)
        .run(k, async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    assert!(matches!(again, Err(TestError::Idem(Error::Held { .. }))));
    assert_eq!(executions.load(Ordering::SeqCst), 0);
}

pub async fn stored_error_is_replayed(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "store-err"), &[&"req-1"]);
    let run = |msg: &'static str| {
        let (g, k) = (guard(&store), k.clone());
        async move {
            g.operation(k)
                .store_errors()
                .run(async move { Err::<(), _>(AppError::Business(msg.into())) })
                .await
        }
    };
    assert_eq!(
        run("amount must be positive").await,
        Err(AppError::Business("amount must be positive".into()))
    );
    assert_eq!(
        run("other").await,
        Err(AppError::Business("amount must be positive".into()))
    );
}

// ---------------------------------------------------------------------------------------
// Rule 5: store errors fail closed; fail open is an opt-in.

pub async fn store_outage_fails_closed(b: impl Backend) {
    let store: SharedStore = Arc::new(Down::new(b.store()));
    let k = key(&unique_prefix(&b, "down"), &[&"order-5"]);
    let executions = AtomicUsize::new(0);
    let out: Result<(), TestError> = guard(&store)
        .run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    match out {
        Err(TestError::Idem(err @ Error::Store(_))) => {
            assert_eq!(err.action(), idempotency::Action::Redeliver)
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(executions.load(Ordering::SeqCst), 0);

    // Fail open runs the handler, unguarded.
    let open: Result<(), TestError> = guard(&store)
        .on_store_error(OnStoreError::FailOpen)
        .run(k, async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    open.unwrap();
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

pub async fn store_outage_releases_nothing(b: impl Backend) {
    let inner = b.store();
    let k = key(&unique_prefix(&b, "down-release"), &[&"order-6"]);
    // A live claim by someone else, then the store goes down for our call.
    let other = req(&k, Duration::from_secs(30));
    inner.claim(&other).await.unwrap();
    let down: SharedStore = Arc::new(Down::new(inner.clone()));
    let out: Result<(), TestError> = guard(&down)
        .run(k.clone(), async {
            Err(TestError::Business("never runs".into()))
        })
        .await;
    assert!(matches!(out, Err(TestError::Idem(Error::Store(_)))));
    let record = inner.read(&k).await.unwrap().unwrap();
    assert_eq!(record.token, other.token);
    assert!(matches!(record.state, RecordState::InProgress { .. }));
}

// ---------------------------------------------------------------------------------------
// Rule 6: the business-status fallback keeps effects exactly-once when the store lost data.

/// A business table: the set of orders whose effect is applied.
#[derive(Default, Clone)]
pub struct Ledger(Arc<Mutex<HashSet<String>>>);

impl Ledger {
    fn apply(&self, order: &str) -> bool {
        self.0.lock().unwrap().insert(order.to_string())
    }
    async fn is_applied(&self, order: &str) -> Result<bool, TestError> {
        Ok(self.0.lock().unwrap().contains(order))
    }
}

pub async fn done_fallback_survives_lost_store_data(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "done");
    let ledger = Ledger::default();
    let executions = AtomicUsize::new(0);
    let consume = |order: &'static str| {
        let (g, k, ledger, executions) = (
            guard(&store),
            key(&prefix, &[&order]),
            ledger.clone(),
            &executions,
        );
        async move {
            g.operation(k)
                .done(|| ledger.is_applied(order))
                .run(async {
                    executions.fetch_add(1, Ordering::SeqCst);
                    assert!(ledger.apply(order), "effect applied twice");
                    Ok::<_, TestError>(())
                })
                .await
        }
    };
    consume("A-1").await.unwrap();
    b.lose_data(&prefix).await;
    assert!(store
        .read(&key(&prefix, &[&"A-1"]))
        .await
        .unwrap()
        .is_none());

    // The store forgot the key; the business check catches the duplicate.
    match consume("A-1").await {
        Err(TestError::Idem(Error::Duplicate { .. })) => {}
        other => panic!("expected a filtered duplicate, got {other:?}"),
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // ... and marked the record completed, so the next duplicate is filtered by the store.
    let record = store.read(&key(&prefix, &[&"A-1"])).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);

    // A new order still runs.
    consume("A-2").await.unwrap();
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

pub async fn done_fallback_answers_an_in_progress_claim(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "done-in-progress");
    let k = key(&prefix, &[&"A-3"]);
    // An owner that crashed after applying the effect: its lease is still live.
    let crashed = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: f } = store.claim(&crashed).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    let ledger = Ledger::default();
    ledger.apply("A-3");

    let out: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .done(|| ledger.is_applied("A-3"))
        .run(async { panic!("the handler must not run") })
        .await;
    assert!(matches!(out, Err(TestError::Idem(Error::Duplicate { .. }))));

    // Without the fallback the same call is an in-progress duplicate.
    let out: Result<(), TestError> = guard(&store).run(k, async { Ok(()) }).await;
    assert!(
        matches!(out, Err(TestError::Idem(Error::InProgress { fence, .. })) if same_fence(&b, fence, f)),
        "{out:?}, owner fence {f}"
    );
}

pub async fn failing_done_check_runs_nothing(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "done-fails"), &[&"A-4"]);
    let out: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .done(|| async { Err(TestError::Business("orders database down".into())) })
        .run(async { panic!("the handler must not run") })
        .await;
    assert!(matches!(out, Err(TestError::Business(_))));
    // The claim was given back: the redelivery can run.
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
}

// ---------------------------------------------------------------------------------------
// Rule 7: a duplicate key with a different payload is refused.

pub async fn payload_mismatch_is_refused(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fingerprint"), &[&"pay-3"]);
    let call = |amount: u64| {
        let (g, k) = (guard(&store), k.clone());
        async move {
            g.operation(k)
                .fingerprint(&[&"EUR", &amount])
                .replay()
                .run(async move { Ok::<_, TestError>(amount) })
                .await
        }
    };
    assert_eq!(call(1250).await.unwrap(), 1250);
    assert_eq!(call(1250).await.unwrap(), 1250);
    match call(9999).await {
        Err(TestError::Idem(err @ Error::PayloadMismatch { .. })) => {
            assert_eq!(err.action(), idempotency::Action::DeadLetter)
        }
        other => panic!("someone else's result was replayed: {other:?}"),
    }
}

pub async fn payload_mismatch_is_refused_while_in_progress(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fingerprint-live"), &[&"pay-4"]);
    let mut first = req(&k, Duration::from_secs(30));
    first.fingerprint = Some(idempotency::Fingerprint::of(&[&1u8]));
    let Claim::Acquired { fence: f } = store.claim(&first).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    let mut same = req(&k, Duration::from_secs(30));
    same.fingerprint = first.fingerprint;
    assert_answer(
        &b,
        store.claim(&same).await.unwrap(),
        Claim::InProgress { fence: f },
    );
    let mut other = req(&k, Duration::from_secs(30));
    other.fingerprint = Some(idempotency::Fingerprint::of(&[&2u8]));
    assert_answer(
        &b,
        store.claim(&other).await.unwrap(),
        Claim::Mismatch { fence: f },
    );
}

// ---------------------------------------------------------------------------------------
// Rule 8: a dropped handler future gives its claim back.

pub async fn dropped_future_gives_its_claim_back(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "cancel"), &[&"order-8"]);
    let entered = Arc::new(Notify::new());
    let call = {
        let (g, k, entered) = (guard(&store), k.clone(), entered.clone());
        tokio::spawn(async move {
            g.run(k, async move {
                entered.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, TestError>(())
            })
            .await
        })
    };
    entered.notified().await;
    let record = store.read(&k).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    let f = record.fence;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    eventually(&store, &k, |r| {
        r.as_ref().is_some_and(|r| r.state == RecordState::Released)
    })
    .await;

    // The redelivery runs at once, with the next fence.
    let retry: Result<(), TestError> = guard(&store).run(k.clone(), async { Ok(()) }).await;
    retry.unwrap();
    assert_eq!(store.read(&k).await.unwrap().unwrap().fence, f + 1);
}

// ---------------------------------------------------------------------------------------
// Rule 9: a lost reply is resolved by reading the record back by token.

pub async fn lost_claim_reply_is_resolved_as_ours(b: impl Backend) {
    let inner = b.store();
    let lossy = Arc::new(LostReplies::new(inner.clone()));
    lossy.lose_next_claim_reply();
    let store: SharedStore = lossy.clone();
    let k = key(&unique_prefix(&b, "lost-claim"), &[&"order-9"]);
    let executions = AtomicUsize::new(0);
    let out: Result<(), TestError> = guard(&store)
        .run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    out.unwrap();
    assert_eq!(lossy.lost(), 1, "the fault was not injected");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // The record is the lost claim's own acquisition, not a second one.
    let Some(Claim::Acquired { fence: f }) = lossy.lost_claim() else {
        panic!(
            "the lost claim was not an acquisition: {:?}",
            lossy.lost_claim()
        )
    };
    let record = inner.read(&k).await.unwrap().unwrap();
    assert_eq!((record.state, record.fence), (RecordState::Completed, f));
}

pub async fn lost_complete_reply_is_resolved_as_completed(b: impl Backend) {
    let inner = b.store();
    let lossy = Arc::new(LostReplies::new(inner.clone()));
    lossy.lose_next_complete_reply();
    let store: SharedStore = lossy.clone();
    let k = key(&unique_prefix(&b, "lost-complete"), &[&"order-10"]);
    let out: Result<u32, TestError> = guard(&store)
        .operation(k.clone())
        .replay()
        .run(async { Ok(7) })
        .await;
    assert_eq!(out.unwrap(), 7);
    assert_eq!(lossy.lost(), 1, "the fault was not injected");
    let replay: Result<u32, TestError> = guard(&store)
        .operation(k)
        .replay()
        .run(async { Ok(8) })
        .await;
    assert_eq!(replay.unwrap(), 7);
}

// ---------------------------------------------------------------------------------------
// In-progress policies and expiry.

pub async fn wait_policy_returns_the_owners_result(b: impl Backend) {
    let observed = Arc::new(Observed::new(b.store()));
    let store: SharedStore = observed.clone();
    let k = key(&unique_prefix(&b, "wait"), &[&"req-2"]);
    let release = Arc::new(Notify::new());
    let entered = Arc::new(Notify::new());
    let first = {
        let (g, k, release, entered) = (guard(&store), k.clone(), release.clone(), entered.clone());
        tokio::spawn(async move {
            g.operation(k)
                .replay()
                .run(async move {
                    entered.notify_one();
                    release.notified().await;
                    Ok::<_, TestError>(41)
                })
                .await
        })
    };
    entered.notified().await;
    let waiter = {
        let (g, k) = (guard(&store), k.clone());
        tokio::spawn(async move {
            g.on_in_progress(InProgress::Wait(Duration::from_secs(10)))
                .operation(k)
                .replay()
                .run(async { Ok::<_, TestError>(0) })
                .await
        })
    };
    // Let the owner finish only once the waiter has met its live claim.
    observed.claims_reached(2).await;
    release.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), 41);
    assert_eq!(waiter.await.unwrap().unwrap(), 41);
}

pub async fn wait_policy_gives_up_after_its_bound(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "wait-bound"), &[&"req-3"]);
    let Claim::Acquired { fence: f } = store
        .claim(&req(&k, Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a new key was not acquired")
    };
    let started = tokio::time::Instant::now();
    let out: Result<(), TestError> = guard(&store)
        .on_in_progress(InProgress::Wait(Duration::from_millis(200)))
        .run(k, async { Ok(()) })
        .await;
    assert!(
        matches!(out, Err(TestError::Idem(Error::InProgress { fence, .. })) if same_fence(&b, fence, f)),
        "{out:?}, owner fence {f}"
    );
    assert!(started.elapsed() >= Duration::from_millis(200));
}

pub async fn skip_policy_drops_the_duplicate(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "skip"), &[&"req-4"]);
    store
        .claim(&req(&k, Duration::from_secs(30)))
        .await
        .unwrap();
    let out: Result<(), TestError> = guard(&store)
        .on_in_progress(InProgress::Skip)
        .run(k, async { panic!("the handler must not run") })
        .await;
    match out {
        Err(TestError::Idem(err @ Error::Skipped { .. })) => {
            assert_eq!(err.action(), idempotency::Action::Ack)
        }
        other => panic!("expected a skip, got {other:?}"),
    }
}

pub async fn completed_record_expires_after_its_ttl(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "ttl"), &[&"order-11"]);
    let ttl = Duration::from_secs(1);
    let g = Guard::new(ttl)
        .lease(Duration::from_millis(300))
        .store(store.clone());
    let executions = AtomicUsize::new(0);
    let run = || {
        g.run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TestError>(())
        })
    };
    run().await.unwrap();
    assert!(matches!(
        run().await,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    assert!(store.read(&k).await.unwrap().is_none());
    run().await.unwrap();
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

pub async fn keys_with_separators_stay_distinct(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "separator");
    let executions = AtomicUsize::new(0);
    for parts in [["1:2", "3"], ["1", "2:3"], ["1,2", ":3"], ["1}", "{2"]] {
        let k = key(&prefix, &[&parts[0], &parts[1]]);
        let out: Result<(), TestError> = guard(&store)
            .run(k, async {
                executions.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await;
        out.unwrap();
    }
    assert_eq!(executions.load(Ordering::SeqCst), 4);
}

// ---------------------------------------------------------------------------------------
// Batches and retried claims.

pub async fn retried_claim_by_the_same_owner_is_acquired_again(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "retry-claim"), &[&"x"]);
    let r = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: f } = store.claim(&r).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired { fence: f });
    assert_answer(
        &b,
        store
            .claim(&req(&k, Duration::from_secs(30)))
            .await
            .unwrap(),
        Claim::InProgress { fence: f },
    );
}

pub async fn batch_settles_each_item_by_its_own_outcome(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "batch");
    let g = guard(&store);
    // Item 1 is completed, item 2 is held by a live owner, items 3 and 4 are new.
    let done: Result<(), TestError> = g.run(key(&prefix, &[&1u32]), async { Ok(()) }).await;
    done.unwrap();
    let Claim::Acquired { fence: f } = store
        .claim(&req(&key(&prefix, &[&2u32]), Duration::from_secs(30)))
        .await
        .unwrap()
    else {
        panic!("a new key was not acquired")
    };

    let executions = AtomicUsize::new(0);
    let items: Vec<(Key, u32)> = (1..=4u32).map(|id| (key(&prefix, &[&id]), id)).collect();
    let results: Vec<Result<u32, TestError>> = g
        .run_batch(items, |id| {
            let executions = &executions;
            async move {
                executions.fetch_add(1, Ordering::SeqCst);
                if id == 4 {
                    Err(TestError::Business("stock service down".into()))
                } else {
                    Ok(id)
                }
            }
        })
        .await;
    assert!(
        matches!(results[0], Err(TestError::Idem(Error::Duplicate { .. }))),
        "{results:?}"
    );
    assert!(
        matches!(
            results[1],
            Err(TestError::Idem(Error::InProgress { fence, .. })) if same_fence(&b, fence, f)
        ),
        "{results:?}, owner fence {f}"
    );
    assert_eq!(results[2].as_ref().unwrap(), &3);
    assert!(
        matches!(results[3], Err(TestError::Business(_))),
        "{results:?}"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 2);
    let three = store.read(&key(&prefix, &[&3u32])).await.unwrap().unwrap();
    assert_eq!(three.state, RecordState::Completed);
    let four = store.read(&key(&prefix, &[&4u32])).await.unwrap().unwrap();
    assert_eq!(four.state, RecordState::Released);
}

pub async fn concurrent_overlapping_batches_run_each_key_once(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "batches");
    let executions = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(8));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (g, prefix, executions, start) = (
                guard(&store),
                prefix.clone(),
                executions.clone(),
                start.clone(),
            );
            tokio::spawn(async move {
                let items: Vec<(Key, u32)> =
                    (0..50u32).map(|id| (key(&prefix, &[&id]), id)).collect();
                start.wait().await;
                let results: Vec<Result<u32, TestError>> = g
                    .run_batch(items, |id| {
                        let executions = executions.clone();
                        async move {
                            executions.fetch_add(1, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            Ok(id)
                        }
                    })
                    .await;
                results
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        for r in t.await.unwrap() {
            match r {
                Ok(_) => ok += 1,
                Err(TestError::Idem(Error::Duplicate { .. } | Error::InProgress { .. })) => {}
                Err(other) => panic!("unexpected: {other:?}"),
            }
        }
    }
    assert_eq!(ok, 50);
    assert_eq!(executions.load(Ordering::SeqCst), 50);
}

// ---------------------------------------------------------------------------------------
// Fault injection over a real store.

/// A store that is down: every command fails before reaching the inner store.
pub struct Down {
    inner: SharedStore,
}

impl Down {
    pub fn new(inner: SharedStore) -> Down {
        Down { inner }
    }
    fn refuse<T: Send + 'static>(&self) -> BoxFuture<'_, Result<T, StoreError>> {
        let _ = &self.inner;
        Box::pin(async {
            Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "connection refused",
            ))
        })
    }
}

impl Store for Down {
    fn claim<'a>(&'a self, _: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.refuse()
    }
    fn complete<'a>(
        &'a self,
        _: &'a Key,
        _: &'a Token,
        _: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn release<'a>(&'a self, _: &'a Key, _: &'a Token) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn renew<'a>(
        &'a self,
        _: &'a Key,
        _: &'a Token,
        _: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.refuse()
    }
    fn read<'a>(&'a self, _: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.refuse()
    }
}

/// A store that counts claims, so a case can wait for a caller to reach the store.
pub struct Observed {
    inner: SharedStore,
    claims: AtomicUsize,
    changed: Notify,
}

impl Observed {
    pub fn new(inner: SharedStore) -> Observed {
        Observed {
            inner,
            claims: AtomicUsize::new(0),
            changed: Notify::new(),
        }
    }
    /// Returns once at least `n` claims have been answered.
    pub async fn claims_reached(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.claims.load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }
}

impl Store for Observed {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let claim = self.inner.claim(req).await;
            self.claims.fetch_add(1, Ordering::SeqCst);
            self.changed.notify_waiters();
            claim
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }
}

/// A store whose next claim or complete reply is lost after the inner store applied it.
pub struct LostReplies {
    inner: SharedStore,
    lose_claim: std::sync::atomic::AtomicBool,
    lose_complete: std::sync::atomic::AtomicBool,
    lost: AtomicUsize,
    lost_claim: Mutex<Option<Claim>>,
}

impl LostReplies {
    pub fn new(inner: SharedStore) -> LostReplies {
        LostReplies {
            inner,
            lose_claim: false.into(),
            lose_complete: false.into(),
            lost: AtomicUsize::new(0),
            lost_claim: Mutex::new(None),
        }
    }
    pub fn lose_next_claim_reply(&self) {
        self.lose_claim.store(true, Ordering::SeqCst);
    }
    pub fn lose_next_complete_reply(&self) {
        self.lose_complete.store(true, Ordering::SeqCst);
    }
    pub fn lost(&self) -> usize {
        self.lost.load(Ordering::SeqCst)
    }
    /// The claim the store applied whose reply was lost last.
    pub fn lost_claim(&self) -> Option<Claim> {
        self.lost_claim.lock().unwrap().clone()
    }
    fn lost_reply<T>(
        &self,
        flag: &std::sync::atomic::AtomicBool,
        applied: T,
    ) -> Result<T, StoreError> {
        if flag.swap(false, Ordering::SeqCst) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            drop(applied);
            Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                "reply lost",
            ))
        } else {
            Ok(applied)
        }
    }
}

impl Store for LostReplies {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let applied = self.inner.claim(req).await?;
            if self.lose_claim.load(Ordering::SeqCst) {
                *self.lost_claim.lock().unwrap() = Some(applied.clone());
            }
            self.lost_reply(&self.lose_claim, applied)
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let applied = self.inner.complete(key, token, completion).await?;
            self.lost_reply(&self.lose_complete, applied)
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }
}

/// Calls `$callback!($($args)*; <every case name>)`: the one list of the suite's cases.
#[macro_export]
macro_rules! conformance_cases {
    ($callback:ident!($($args:tt)*)) => {
        $crate::$callback!($($args)*;
            concurrent_duplicates_run_the_handler_exactly_once,
            concurrent_store_claims_acquire_exactly_once,
            fence_grows_by_one_on_every_acquisition,
            fences_grow_across_record_expiry,
            completed_key_is_a_duplicate_and_replays_its_result,
            expired_lease_is_taken_over_with_the_next_fence,
            watchdog_keeps_a_slow_handler_owner,
            handler_that_outlives_its_lease_loses_ownership,
            complete_and_renew_check_the_token,
            completing_a_missing_record_is_refused,
            error_releases_and_the_retry_runs,
            release_never_removes_another_owners_claim,
            held_error_blocks_the_key,
            stored_error_is_replayed,
            store_outage_fails_closed,
            store_outage_releases_nothing,
            done_fallback_survives_lost_store_data,
            done_fallback_answers_an_in_progress_claim,
            failing_done_check_runs_nothing,
            payload_mismatch_is_refused,
            payload_mismatch_is_refused_while_in_progress,
            dropped_future_gives_its_claim_back,
            lost_claim_reply_is_resolved_as_ours,
            lost_complete_reply_is_resolved_as_completed,
            wait_policy_returns_the_owners_result,
            wait_policy_gives_up_after_its_bound,
            skip_policy_drops_the_duplicate,
            completed_record_expires_after_its_ttl,
            keys_with_separators_stay_distinct,
            retried_claim_by_the_same_owner_is_acquired_again,
            batch_settles_each_item_by_its_own_outcome,
            concurrent_overlapping_batches_run_each_key_once,
            failed_completion_never_gives_the_claim_back,
            dropped_call_after_the_body_completes_its_outcome,
            dropped_call_during_the_claim_gives_it_back,
            held_failure_survives_a_store_blip,
            result_the_store_cannot_take_completes_without_it,
            out_of_range_durations_are_refused_before_the_store,
            body_reads_its_key_and_fence,
            lost_lease_is_signalled_to_the_body
        );
    };
}

/// One `#[tokio::test]` per conformance case: `conformance_suite!(make)` where `make` is an
/// async fn returning an `impl Backend`.
#[macro_export]
macro_rules! conformance_suite {
    ($make:path) => {
        $crate::conformance_cases!(conformance_tests!($make));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! conformance_tests {
    ($make:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                conformance::$case($make().await).await;
            }
        )*
    };
}

/// Every conformance case, one after another, inside one async context: for backends whose
/// server is expensive to start (a cluster), started once for the whole sequence.
#[macro_export]
macro_rules! conformance_sequence {
    ($make:expr) => {
        $crate::conformance_cases!(conformance_sequence_of!($make));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! conformance_sequence_of {
    ($make:expr; $($case:ident),* $(,)?) => {
        $(
            eprintln!("conformance case: {}", stringify!($case));
            conformance::$case($make.await).await;
        )*
    };
}
