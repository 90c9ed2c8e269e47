//! `CombiningStore`: concurrent single calls sent as batches. The conformance suite runs on
//! it over PostgreSQL and MariaDB (`tests/postgres.rs`, `tests/mysql.rs`); these cases hold a
//! batch on its way to see what waits behind it, which no real store can be made to do on
//! demand: the wrapped store is a real in-memory store whose batch calls wait at a gate the
//! case opens.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/forward.rs"]
#[macro_use]
mod forward;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, CombiningStore, Completion, End, Ending, RecordState, Store,
    StoreError, StoreErrorKind, Token,
};
use idempotency::{Key, MemoryStore};
use tokio::sync::Semaphore;

/// A batch call as the wrapped store saw it: claims or endings, by key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Batch {
    Claims(Vec<String>),
    Endings(Vec<(String, &'static str)>),
}

/// A real in-memory store whose batch calls wait for the case to let them through.
struct Gated {
    inner: MemoryStore,
    batches: Mutex<Vec<Batch>>,
    entered: Semaphore,
    gate: Semaphore,
    released: Semaphore,
    /// The next batch ending panics once through the gate.
    panic_next: AtomicBool,
    /// The next batch call never answers (a silent connection): not held at the gate, not
    /// sent to the store.
    stall_next: AtomicBool,
}

impl Gated {
    fn new() -> Arc<Gated> {
        Arc::new(Gated {
            inner: MemoryStore::new(),
            batches: Mutex::new(Vec::new()),
            entered: Semaphore::new(0),
            gate: Semaphore::new(0),
            released: Semaphore::new(0),
            panic_next: AtomicBool::new(false),
            stall_next: AtomicBool::new(false),
        })
    }
    /// Returns once a batch call reached this store, and holds it there.
    async fn batch_entered(&self) {
        let entered = tokio::time::timeout(Duration::from_secs(10), self.entered.acquire());
        entered
            .await
            .expect("no batch reached the store")
            .unwrap()
            .forget();
    }
    /// Returns once a release reached this store.
    async fn release_done(&self) {
        let released = tokio::time::timeout(Duration::from_secs(10), self.released.acquire());
        released
            .await
            .expect("no release reached the store")
            .unwrap()
            .forget();
    }
    /// Lets one held batch call through.
    fn let_through(&self) {
        self.gate.add_permits(1);
    }
    fn batches(&self) -> Vec<Batch> {
        self.batches.lock().unwrap().clone()
    }
    async fn held(&self, batch: Batch) {
        self.batches.lock().unwrap().push(batch);
        if self.stall_next.swap(false, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.entered.add_permits(1);
        self.gate.acquire().await.unwrap().forget();
    }
}

fn name(key: &Key) -> String {
    String::from_utf8(key.as_bytes().to_vec()).unwrap()
}

impl Store for Gated {
    forward_store!(claim, complete, renew, read);

    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            let keys = reqs.iter().map(|req| name(&req.key)).collect();
            self.held(Batch::Claims(keys)).await;
            self.inner.claim_many(reqs).await
        })
    }
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            let items_seen = items
                .iter()
                .map(|item| {
                    let what = match item.action {
                        End::Complete(_) => "complete",
                        End::Release => "release",
                        _ => "other",
                    };
                    (name(&item.key), what)
                })
                .collect();
            self.held(Batch::Endings(items_seen)).await;
            assert!(
                !self.panic_next.swap(false, Ordering::SeqCst),
                "the store panics mid-batch"
            );
            self.inner.complete_many(items).await
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let released = self.inner.release(key, token).await;
            self.released.add_permits(1);
            released
        })
    }
}

// The operator's calls are not gated: a `CombiningStore` sends them straight through.
forward_operator_store!(Gated);

fn key(name: &str) -> Key {
    Key::new("combining", 1, &[&name]).unwrap()
}

fn request(key: &Key) -> ClaimRequest {
    let minute = Duration::from_secs(60);
    ClaimRequest::new(key.clone(), Token::generate(), minute, minute)
}

/// `fut`'s output, or a failure after ten seconds (a call that is never answered).
async fn within<F: Future>(fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .expect("the call was never answered")
}

/// Polls `fut` once: a call on a `CombiningStore` is queued by its first poll.
fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    fut.poll(&mut Context::from_waker(Waker::noop()))
}

/// Calls made while a batch is on its way wait, and go together in the next batch: one per
/// key for claims (a second claim of a key waits for the batch after), answered each as the
/// store answers it alone.
#[tokio::test]
async fn calls_made_while_a_batch_is_on_its_way_go_together() {
    let inner = Gated::new();
    let store = CombiningStore::new(inner.clone(), 1);
    let first = request(&key("a"));
    let mut claim_first = pin!(store.claim(&first));
    assert!(poll_once(claim_first.as_mut()).is_pending());
    inner.batch_entered().await;
    let b = request(&key("b"));
    let c = request(&key("c"));
    let b_again = request(&key("b"));
    // Queued, in this order, behind the first batch.
    let mut claim_b = pin!(store.claim(&b));
    let mut claim_c = pin!(store.claim(&c));
    let mut claim_b_again = pin!(store.claim(&b_again));
    assert!(poll_once(claim_b.as_mut()).is_pending());
    assert!(poll_once(claim_c.as_mut()).is_pending());
    assert!(poll_once(claim_b_again.as_mut()).is_pending());
    inner.let_through();
    assert!(matches!(
        within(claim_first).await.unwrap(),
        Claim::Acquired { .. }
    ));
    inner.batch_entered().await;
    inner.let_through();
    inner.batch_entered().await;
    inner.let_through();
    let answers = [
        within(claim_b).await.unwrap(),
        within(claim_c).await.unwrap(),
        within(claim_b_again).await.unwrap(),
    ];
    assert!(matches!(answers[0], Claim::Acquired { .. }), "{answers:?}");
    assert!(matches!(answers[1], Claim::Acquired { .. }), "{answers:?}");
    let Claim::Acquired { fence } = answers[0] else {
        unreachable!()
    };
    assert_eq!(answers[2], Claim::InProgress { fence }, "{answers:?}");
    assert_eq!(
        inner.batches(),
        vec![
            Batch::Claims(vec![name(&first.key)]),
            Batch::Claims(vec![name(&b.key), name(&c.key)]),
            Batch::Claims(vec![name(&b_again.key)]),
        ]
    );
}

/// A claim whose caller went away before its batch was sent is not sent: its key stays free.
#[tokio::test]
async fn a_claim_whose_caller_went_away_before_its_batch_is_not_sent() {
    let inner = Gated::new();
    let store = CombiningStore::new(inner.clone(), 1);
    let first = request(&key("first"));
    let gone = request(&key("gone"));
    {
        let mut claim_first = pin!(store.claim(&first));
        assert!(poll_once(claim_first.as_mut()).is_pending());
        inner.batch_entered().await;
        {
            let mut claim_gone = pin!(store.claim(&gone));
            assert!(poll_once(claim_gone.as_mut()).is_pending());
        }
        inner.let_through();
        assert!(matches!(
            within(claim_first).await.unwrap(),
            Claim::Acquired { .. }
        ));
    }
    // The next batch is the one after this claim: nothing else was queued.
    let later = request(&key("later"));
    let mut claim_later = pin!(store.claim(&later));
    assert!(poll_once(claim_later.as_mut()).is_pending());
    inner.batch_entered().await;
    inner.let_through();
    assert!(matches!(
        within(claim_later).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert_eq!(
        inner.batches(),
        vec![
            Batch::Claims(vec![name(&first.key)]),
            Batch::Claims(vec![name(&later.key)]),
        ]
    );
    assert_eq!(inner.read(&gone.key).await.unwrap(), None);
}

/// A claim acquired for a caller that went away while its batch was on its way is released
/// at once: the next delivery is acquired with the next fence, not told "in progress" until
/// the lease runs out.
#[tokio::test]
async fn a_claim_acquired_for_a_caller_that_went_away_is_released() {
    let inner = Gated::new();
    let store = Arc::new(CombiningStore::new(inner.clone(), 1));
    let owner = request(&key("k"));
    let claim = tokio::spawn({
        let (store, owner) = (store.clone(), owner.clone());
        async move { store.claim(&owner).await }
    });
    inner.batch_entered().await;
    claim.abort();
    assert!(claim.await.unwrap_err().is_cancelled());
    inner.let_through();
    inner.release_done().await;
    let record = inner.read(&owner.key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    let next = request(&owner.key);
    let mut claim_next = pin!(store.claim(&next));
    assert!(poll_once(claim_next.as_mut()).is_pending());
    inner.batch_entered().await;
    inner.let_through();
    assert_eq!(
        within(claim_next).await.unwrap(),
        Claim::Acquired {
            fence: record.fence + 1
        }
    );
}

/// The endings of one key are sent in the order they were made, never two batches of
/// them on their way at once; other keys' endings do not wait for them.
#[tokio::test]
async fn endings_of_one_key_go_in_order_one_batch_after_another() {
    let inner = Gated::new();
    let store = Arc::new(CombiningStore::new(inner.clone(), 2));
    let (k, j) = (request(&key("k")), request(&key("j")));
    for req in [&k, &j] {
        assert!(matches!(
            inner.inner.claim(req).await.unwrap(),
            Claim::Acquired { .. }
        ));
    }
    let end = |req: &ClaimRequest, complete: bool| {
        let (store, key, token) = (store.clone(), req.key.clone(), req.token);
        tokio::spawn(async move {
            if complete {
                let completion = Completion::new(None, Duration::from_secs(60));
                store.complete(&key, &token, &completion).await
            } else {
                store.release(&key, &token).await
            }
        })
    };
    let complete_k = end(&k, true);
    inner.batch_entered().await;
    let release_k = end(&k, false);
    let complete_j = end(&j, true);
    // The second batch carries `j` alone: `k` has an ending on its way.
    inner.batch_entered().await;
    assert_eq!(
        inner.batches(),
        vec![
            Batch::Endings(vec![(name(&k.key), "complete")]),
            Batch::Endings(vec![(name(&j.key), "complete")]),
        ]
    );
    inner.let_through();
    inner.let_through();
    inner.batch_entered().await;
    inner.let_through();
    assert!(within(complete_k).await.unwrap().unwrap());
    assert!(within(complete_j).await.unwrap().unwrap());
    // Released after its completion: refused, and the key stays completed.
    assert!(!within(release_k).await.unwrap().unwrap());
    assert_eq!(
        inner.batches()[2],
        Batch::Endings(vec![(name(&k.key), "release")])
    );
    let record = inner.read(&k.key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
}

/// A batch the wrapped store never answers (it panicked) answers its calls "outcome
/// unknown", and the calls queued behind it are still sent and answered.
#[tokio::test]
async fn calls_behind_a_batch_that_never_returns_are_still_answered() {
    let inner = Gated::new();
    let store = CombiningStore::new(inner.clone(), 1);
    let (k, j) = (request(&key("k")), request(&key("j")));
    for req in [&k, &j] {
        assert!(matches!(
            inner.inner.claim(req).await.unwrap(),
            Claim::Acquired { .. }
        ));
    }
    let completion = Completion::new(None, Duration::from_secs(60));
    let mut complete_k = pin!(store.complete(&k.key, &k.token, &completion));
    assert!(poll_once(complete_k.as_mut()).is_pending());
    inner.batch_entered().await;
    let mut complete_j = pin!(store.complete(&j.key, &j.token, &completion));
    let mut retry_k = pin!(store.complete(&k.key, &k.token, &completion));
    assert!(poll_once(complete_j.as_mut()).is_pending());
    assert!(poll_once(retry_k.as_mut()).is_pending());
    inner.panic_next.store(true, Ordering::SeqCst);
    inner.let_through();
    let lost = within(complete_k).await.unwrap_err();
    assert_eq!(lost.kind(), StoreErrorKind::OutcomeUnknown, "{lost}");
    inner.batch_entered().await;
    inner.let_through();
    assert!(within(complete_j).await.unwrap());
    assert!(within(retry_k).await.unwrap());
    assert_eq!(
        inner.batches()[1],
        Batch::Endings(vec![(name(&j.key), "complete"), (name(&k.key), "complete")])
    );
}

/// A batch that never answers holds its place among the batches in flight for a bounded time
/// only: with one batch in flight, a claim whose batch is silent is answered `Unavailable`
/// after half its lease (nothing was acquired, so nothing is released) and the claims of
/// other keys go on being served; a silent batch of endings is answered `OutcomeUnknown`
/// after half the lease its completion names, and the endings behind it go.
#[tokio::test]
async fn a_batch_that_never_answers_does_not_hold_the_other_keys() {
    let inner = Gated::new();
    let store = CombiningStore::new(inner.clone(), 1);
    let lease = Duration::from_millis(400);
    let req = |name: &str| ClaimRequest::new(key(name), Token::generate(), lease, lease * 100);

    inner.stall_next.store(true, Ordering::SeqCst);
    let silent = req("silent");
    let refused = within(store.claim(&silent)).await.unwrap_err();
    assert_eq!(refused.kind(), StoreErrorKind::Unavailable, "{refused}");
    let other = req("other");
    let mut claim = pin!(store.claim(&other));
    assert!(poll_once(claim.as_mut()).is_pending());
    inner.batch_entered().await;
    inner.let_through();
    assert!(matches!(
        within(claim).await.unwrap(),
        Claim::Acquired { .. }
    ));

    let completion = Completion::new(None, lease * 100)
        .for_claim(idempotency::store::AcquiredClaim::new(1, None).with_lease(lease));
    inner.stall_next.store(true, Ordering::SeqCst);
    let unknown = within(store.complete(&other.key, &other.token, &completion))
        .await
        .unwrap_err();
    assert_eq!(unknown.kind(), StoreErrorKind::OutcomeUnknown, "{unknown}");
    let mut again = pin!(store.complete(&other.key, &other.token, &completion));
    assert!(poll_once(again.as_mut()).is_pending());
    inner.batch_entered().await;
    inner.let_through();
    assert!(within(again).await.unwrap());
    assert_eq!(inner.inner.read(&silent.key).await.unwrap(), None);
}

/// Outside a Tokio runtime, calls go to the wrapped store directly.
#[test]
fn calls_outside_a_tokio_runtime_go_to_the_store_directly() {
    let store = CombiningStore::new(Arc::new(MemoryStore::new()), 4);
    let req = request(&key("outside"));
    let mut claim = pin!(store.claim(&req));
    let Poll::Ready(claim) = poll_once(claim.as_mut()) else {
        panic!("the in-memory store answers at once");
    };
    assert!(matches!(claim.unwrap(), Claim::Acquired { .. }));
    let completion = Completion::new(None, Duration::from_secs(60));
    let mut complete = pin!(store.complete(&req.key, &req.token, &completion));
    let Poll::Ready(completed) = poll_once(complete.as_mut()) else {
        panic!("the in-memory store answers at once");
    };
    assert!(completed.unwrap());
}
