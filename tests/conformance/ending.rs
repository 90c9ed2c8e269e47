//! Conformance cases for the end of a claim: once the body returned its outcome is recorded
//! and the claim is never given back; before that, a dropped call gives it back; the body
//! sees its claim; durations and results the store cannot take are handled the same on every
//! backend.
//!
//! [`Faulty`] stands in for the faults a healthy server does not produce on demand (a reply
//! held back at a chosen moment, one failed completion): it wraps the backend's real store and
//! every command that is applied is applied by that store.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Record, RecordState, Store, StoreError,
    StoreErrorKind, Token,
};
use idempotency::{current, Error, Idempotency, Key, OnError, OnLostLease, SharedStore};
use tokio::sync::Notify;

use super::{key, unique_prefix, Backend, TestError};

/// A point where a command waits until the test opens it.
#[derive(Default)]
pub struct Gate {
    closed: AtomicBool,
    reached: AtomicUsize,
    changed: Notify,
}

impl Gate {
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }
    pub fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
    /// Returns once `n` commands have reached the gate.
    pub async fn reached(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.reached.load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }
    async fn pass(&self) {
        if !self.closed.load(Ordering::SeqCst) {
            return;
        }
        self.reached.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        loop {
            let changed = self.changed.notified();
            if !self.closed.load(Ordering::SeqCst) {
                return;
            }
            changed.await;
        }
    }
}

/// The backend's store with faults injected on command.
pub struct Faulty {
    inner: SharedStore,
    /// How many of the next completions fail before reaching the store.
    pub fail_completes: AtomicUsize,
    /// How many of the next completions are applied but their reply is lost.
    pub lose_completes: AtomicUsize,
    /// How many of the next completions never answer (a silent connection): not sent, no
    /// reply, no error.
    pub stall_completes: AtomicUsize,
    /// How many of the next reads fail.
    pub fail_reads: AtomicUsize,
    /// Renewals fail while set.
    pub fail_renewals: AtomicBool,
    /// Completions carrying a result are refused for good while set.
    pub reject_results: AtomicBool,
    /// Claims are applied, then wait here before answering.
    pub claim_reply: Gate,
    /// Completions wait here before reaching the store.
    pub complete_sent: Gate,
    pub releases: AtomicUsize,
    pub commands: AtomicUsize,
}

impl Faulty {
    pub fn new(inner: SharedStore) -> Arc<Faulty> {
        Arc::new(Faulty {
            inner,
            fail_completes: AtomicUsize::new(0),
            lose_completes: AtomicUsize::new(0),
            stall_completes: AtomicUsize::new(0),
            fail_reads: AtomicUsize::new(0),
            fail_renewals: AtomicBool::new(false),
            reject_results: AtomicBool::new(false),
            claim_reply: Gate::default(),
            complete_sent: Gate::default(),
            releases: AtomicUsize::new(0),
            commands: AtomicUsize::new(0),
        })
    }
}

fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn unavailable<T>() -> Result<T, StoreError> {
    Err(StoreError::new(
        StoreErrorKind::Unavailable,
        "injected: connection reset",
    ))
}

impl Store for Faulty {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.commands.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            let claim = self.inner.claim(req).await;
            self.claim_reply.pass().await;
            claim
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.commands.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            self.complete_sent.pass().await;
            if take(&self.stall_completes) {
                std::future::pending::<()>().await;
            }
            if take(&self.fail_completes) {
                return unavailable();
            }
            if completion.result.is_some() && self.reject_results.load(Ordering::SeqCst) {
                return Err(StoreError::new(
                    StoreErrorKind::Rejected,
                    "injected: value too large",
                ));
            }
            let applied = self.inner.complete(key, token, completion).await?;
            if take(&self.lose_completes) {
                return Err(StoreError::new(
                    StoreErrorKind::OutcomeUnknown,
                    "injected: reply lost",
                ));
            }
            Ok(applied)
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.commands.fetch_add(1, Ordering::SeqCst);
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.commands.fetch_add(1, Ordering::SeqCst);
        if self.fail_renewals.load(Ordering::SeqCst) {
            return Box::pin(async { unavailable() });
        }
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.commands.fetch_add(1, Ordering::SeqCst);
        if take(&self.fail_reads) {
            return Box::pin(async { unavailable() });
        }
        self.inner.read(key)
    }
    fn max_result_size(&self) -> usize {
        self.inner.max_result_size()
    }
}

fn guard(store: SharedStore) -> Idempotency {
    Idempotency::new(Duration::from_secs(60))
        .lease(Duration::from_secs(3))
        .store(store)
}

/// Reads until the record's state satisfies `pred`; fails after ten seconds.
async fn until_state(store: &SharedStore, k: &Key, pred: impl Fn(Option<RecordState>) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let state = store.read(k).await.unwrap().map(|r| r.state);
        if pred(state) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the record never reached the expected state; last: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `call`'s answer once the store's completion is visible to claims: a layered store
/// completes its back first and its front a moment later, so a call made as soon as the
/// back shows the record completed may still meet the front's claim in progress. Sent again
/// while it does, for at most five seconds; any other answer is returned at once.
async fn once_settled<T, F, Fut>(mut call: F) -> Result<T, TestError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TestError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match call().await {
            Err(TestError::Idem(Error::InProgress { .. }))
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => return other,
        }
    }
}

/// A duplicate's outcome, and whether it ran its body.
async fn duplicate(store: &SharedStore, k: &Key, runs: &AtomicUsize) -> Result<(), TestError> {
    guard(store.clone())
        .run(k.clone(), async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await
}

pub async fn failed_completion_never_gives_the_claim_back(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let prefix = unique_prefix(&b, "complete-fails");
    let runs = AtomicUsize::new(0);

    // A completion that fails outright, and one whose reply is lost and whose read-back fails.
    for (n, fault) in ["fails", "reply lost, read fails"].into_iter().enumerate() {
        let k = key(&prefix, &[&n]);
        if n == 0 {
            faulty.fail_completes.store(1, Ordering::SeqCst);
        } else {
            faulty.lose_completes.store(1, Ordering::SeqCst);
            faulty.fail_reads.store(1, Ordering::SeqCst);
        }
        let first: Result<(), TestError> = guard(store.clone())
            .run(k.clone(), async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await;
        // The effect is applied: the caller is told so.
        first.unwrap();
        // The very next duplicate must not run it again.
        match duplicate(&store, &k, &runs).await {
            Err(TestError::Idem(Error::InProgress { .. } | Error::Duplicate { .. })) => {}
            other => panic!("{fault}: duplicate after a failed completion: {other:?}"),
        }
        until_state(&inner, &k, |s| s == Some(RecordState::Completed)).await;
        assert!(matches!(
            once_settled(|| duplicate(&store, &k, &runs)).await,
            Err(TestError::Idem(Error::Duplicate { .. }))
        ));
        assert_eq!(
            runs.load(Ordering::SeqCst),
            n + 1,
            "{fault}: the effect ran again"
        );
    }
    assert_eq!(
        faulty.releases.load(Ordering::SeqCst),
        0,
        "a claim was given back"
    );
}

pub async fn dropped_call_after_the_body_completes_its_outcome(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "drop-ending"), &[&"order-11"]);
    let runs = AtomicUsize::new(0);

    faulty.complete_sent.close();
    let call = guard(store.clone())
        .operation(k.clone())
        .replay()
        .run(async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TestError>(17u32)
        });
    // A timeout around the call fires while the completion is in flight.
    let mut call = Box::pin(call);
    tokio::select! {
        out = &mut call => panic!("the call finished past a closed gate: {out:?}"),
        () = faulty.complete_sent.reached(1) => {}
    }
    drop(call);
    faulty.complete_sent.open();

    until_state(&inner, &k, |s| s == Some(RecordState::Completed)).await;
    let replay: Result<u32, TestError> = once_settled(|| {
        guard(store.clone())
            .operation(k.clone())
            .replay()
            .run(async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(99)
            })
    })
    .await;
    assert_eq!(replay.unwrap(), 17);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        faulty.releases.load(Ordering::SeqCst),
        0,
        "the claim was given back"
    );
}

pub async fn dropped_call_during_the_claim_gives_it_back(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "drop-claiming"), &[&"order-12"]);
    let runs = AtomicUsize::new(0);

    faulty.claim_reply.close();
    let g = guard(store.clone());
    let mut call = Box::pin(g.run(k.clone(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, TestError>(())
    }));
    tokio::select! {
        out = &mut call => panic!("the call finished past a closed gate: {out:?}"),
        () = faulty.claim_reply.reached(1) => {}
    }
    // The claim is applied on the store; its reply has not arrived when the call is dropped.
    assert!(matches!(
        inner.read(&k).await.unwrap().map(|r| r.state),
        Some(RecordState::InProgress { .. })
    ));
    drop(call);
    faulty.claim_reply.open();

    // Given back as soon as the claim lands, not after the 3 s lease.
    until_state(&inner, &k, |s| s == Some(RecordState::Released)).await;
    let retry = tokio::time::timeout(Duration::from_secs(2), duplicate(&store, &k, &runs))
        .await
        .expect("the retry waited for the lease");
    retry.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

pub async fn held_failure_survives_a_store_blip(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "hold-blip"), &[&"pay-3"]);
    let runs = AtomicUsize::new(0);

    faulty.fail_completes.store(1, Ordering::SeqCst);
    let first: Result<(), TestError> = guard(store.clone())
        .operation(k.clone())
        .on_error(|_| OnError::Hold)
        .run(async {
            runs.fetch_add(1, Ordering::SeqCst);
            Err(TestError::Business(
                "gateway timed out after charging".into(),
            ))
        })
        .await;
    assert!(matches!(first, Err(TestError::Business(_))));
    until_state(&inner, &k, |s| s == Some(RecordState::Completed)).await;
    assert!(matches!(
        once_settled(|| duplicate(&store, &k, &runs)).await,
        Err(TestError::Idem(Error::Held { .. }))
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(faulty.releases.load(Ordering::SeqCst), 0);
}

pub async fn result_the_store_cannot_take_completes_without_it(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let prefix = unique_prefix(&b, "big-result");
    let runs = AtomicUsize::new(0);
    let replayed = |k: Key, value: String| {
        let (store, runs) = (store.clone(), &runs);
        async move {
            guard(store)
                .operation(k)
                .replay()
                .run(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, TestError>(value)
                })
                .await
        }
    };

    // Larger than the store's limit.
    let k = key(&prefix, &[&"over-limit"]);
    let big = "x".repeat(inner.max_result_size() + 1);
    assert_eq!(
        replayed(k.clone(), big.clone()).await.unwrap().len(),
        big.len()
    );
    let record = inner.read(&k).await.unwrap().unwrap();
    assert_eq!(
        (record.state, record.result),
        (RecordState::Completed, None)
    );
    assert!(matches!(
        replayed(k, "small".into()).await,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));

    // Refused by the store for good.
    faulty.reject_results.store(true, Ordering::SeqCst);
    let k = key(&prefix, &[&"refused"]);
    replayed(k.clone(), "refused result".into()).await.unwrap();
    assert_eq!(
        inner.read(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );
    assert!(matches!(
        replayed(k, "again".into()).await,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

pub async fn out_of_range_durations_are_refused_before_the_store(b: impl Backend) {
    let faulty = Faulty::new(b.store());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "durations"), &[&1u8]);
    let cases = [
        (Idempotency::new(Duration::MAX), "ttl"),
        (Idempotency::new(Duration::ZERO), "ttl"),
        (
            Idempotency::new(Duration::from_secs(60)).lease(Duration::MAX),
            "lease",
        ),
        (
            Idempotency::new(Duration::from_secs(60)).lease(Duration::from_micros(10)),
            "lease",
        ),
    ];
    for (g, which) in cases {
        let out: Result<(), TestError> = g
            .store(store.clone())
            .run(k.clone(), async { panic!("ran with an invalid {which}") })
            .await;
        match out {
            Err(TestError::Idem(Error::InvalidDuration { setting, .. })) => {
                assert_eq!(setting, which)
            }
            other => panic!("{which}: {other:?}"),
        }
    }
    assert_eq!(
        faulty.commands.load(Ordering::SeqCst),
        0,
        "the store was called"
    );
    // The bounds themselves are accepted.
    let edge: Result<(), TestError> = Idempotency::new(idempotency::store::MAX_DURATION)
        .lease(idempotency::store::MIN_DURATION * 1000)
        .store(store.clone())
        .run(k, async { Ok(()) })
        .await;
    edge.unwrap();
}

pub async fn body_reads_its_key_and_fence(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "current"), &[&"stock-1"]);
    let seen: Result<(Key, u64), TestError> = guard(store.clone())
        .run(k.clone(), async {
            let claim = current().expect("no claim inside the body");
            Ok((claim.key().clone(), claim.fence()))
        })
        .await;
    let (seen_key, fence) = seen.unwrap();
    assert_eq!(seen_key, k);
    assert_eq!(store.read(&k).await.unwrap().unwrap().fence, fence);
    assert!(current().is_none());

    // `run_with` hands the claim to the body; a later owner of the key has a higher fence.
    let k2 = key(&unique_prefix(&b, "current"), &[&"stock-2"]);
    let first: Result<u64, TestError> = guard(store.clone())
        .operation(k2.clone())
        .run_with(|claim| async move {
            let _ = claim;
            Err(TestError::Business("released so the key runs again".into()))
        })
        .await;
    assert!(first.is_err());
    let f1 = store.read(&k2).await.unwrap().unwrap().fence;
    let second: Result<u64, TestError> = guard(store.clone())
        .operation(k2)
        .run_with(|claim| async move { Ok(claim.fence()) })
        .await;
    assert_eq!(second.unwrap(), f1 + 1);
}

pub async fn lost_lease_is_signalled_to_the_body(b: impl Backend) {
    let inner = b.store();
    let faulty = Faulty::new(inner.clone());
    let store: SharedStore = faulty.clone();
    let prefix = unique_prefix(&b, "lost-lease");
    let lease = Duration::from_secs(1);

    // Renewals fail for longer than the lease: the body is told, and carries on.
    faulty.fail_renewals.store(true, Ordering::SeqCst);
    let k = key(&prefix, &[&"continue"]);
    let out: Result<&str, TestError> = guard(store.clone())
        .lease(lease)
        .run(k.clone(), async {
            let claim = current().unwrap();
            tokio::time::timeout(lease * 10, claim.lost())
                .await
                .map_err(|_| TestError::Business("the lost lease was never signalled".into()))?;
            assert!(claim.is_lost());
            Ok("finished anyway")
        })
        .await;
    // Nobody took the key over, so the completion still lands.
    assert_eq!(out.unwrap(), "finished anyway");
    assert_eq!(
        inner.read(&k).await.unwrap().unwrap().state,
        RecordState::Completed
    );

    // With `Cancel`, the body is stopped and the claim given back.
    let k = key(&prefix, &[&"cancel"]);
    let finished = AtomicBool::new(false);
    let out: Result<(), TestError> = guard(store.clone())
        .lease(lease)
        .on_lost_lease(OnLostLease::Cancel)
        .run(k.clone(), async {
            tokio::time::sleep(lease * 10).await;
            finished.store(true, Ordering::SeqCst);
            Ok(())
        })
        .await;
    assert!(matches!(
        out,
        Err(TestError::Idem(Error::LostOwnership { .. }))
    ));
    assert!(!finished.load(Ordering::SeqCst));
    assert_eq!(
        inner.read(&k).await.unwrap().unwrap().state,
        RecordState::Released
    );
}
