//! Conformance cases for batches and retried claims: each item of a batch is ended by its own
//! outcome, and a claim retried by its owner is acquired again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Record, RecordState, Store, StoreError,
    Token,
};
use idempotency::{Error, Key, SharedStore};
use tokio::sync::Barrier;

use super::{
    assert_answer, guard, key, req, same_fence, unique_prefix, AppError, Backend, TestError,
};

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

/// What an [`Instrumented`] store does besides counting.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Quirk {
    /// Nothing: every call goes to the store under test.
    None,
    /// Its batch ending never answers (a hung connection).
    HungEndings,
    /// Its batch ending fails for every item, applying nothing (the store down for that
    /// one call).
    FailingEndings,
    /// Its batch claim leaves the last item out of what it sends and answers (a misbehaving
    /// third-party store).
    ShortClaims,
    /// Its batch ending is sent only once every item's lease was renewed since it arrived
    /// (a slow store, slow for exactly as long as the test needs).
    EndingsWaitForRenewals,
}

/// The store under test, counting the endings that reach it (single completions and
/// releases, and batches with their sizes), and with a [`Quirk`] that no real backend
/// produces on demand.
struct Instrumented {
    inner: SharedStore,
    quirk: Quirk,
    singles: AtomicUsize,
    batches: std::sync::Mutex<Vec<usize>>,
    renewals: AtomicUsize,
    renewed: tokio::sync::Notify,
}

impl Store for Instrumented {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.inner.claim(req)
    }
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        match self.quirk {
            Quirk::ShortClaims => self.inner.claim_many(&reqs[..reqs.len().saturating_sub(1)]),
            _ => self.inner.claim_many(reqs),
        }
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.singles.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, token)
    }
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        self.batches.lock().unwrap().push(items.len());
        match self.quirk {
            Quirk::HungEndings => Box::pin(std::future::pending()),
            Quirk::EndingsWaitForRenewals => Box::pin(async move {
                let from = self.renewals.load(Ordering::SeqCst);
                loop {
                    let renewed = self.renewed.notified();
                    let mut renewed = std::pin::pin!(renewed);
                    renewed.as_mut().enable();
                    if self.renewals.load(Ordering::SeqCst) >= from + items.len() {
                        break;
                    }
                    renewed.await;
                }
                self.inner.complete_many(items).await
            }),
            Quirk::FailingEndings => Box::pin(std::future::ready(
                items
                    .iter()
                    .map(|_| {
                        Err(StoreError::new(
                            idempotency::store::StoreErrorKind::Unavailable,
                            "the batch ending failed",
                        ))
                    })
                    .collect(),
            )),
            _ => self.inner.complete_many(items),
        }
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let renewed = self.inner.renew(key, token, lease).await;
            if renewed.as_ref().is_ok_and(|&ours| ours) {
                self.renewals.fetch_add(1, Ordering::SeqCst);
                self.renewed.notify_waiters();
            }
            renewed
        })
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }
    fn max_result_size(&self) -> usize {
        self.inner.max_result_size()
    }
}

fn instrumented(b: &impl Backend, quirk: Quirk) -> Arc<Instrumented> {
    Arc::new(Instrumented {
        inner: b.store(),
        quirk,
        singles: AtomicUsize::new(0),
        batches: std::sync::Mutex::new(Vec::new()),
        renewals: AtomicUsize::new(0),
        renewed: tokio::sync::Notify::new(),
    })
}

/// A batch's items are ended together: 30 items whose handlers all return (27 completed,
/// 3 failed and released) reach the store as one `complete_many` of 30 and no single
/// completion or release; each record ends as its own outcome says, and a second delivery of
/// the batch runs nothing and replays the stored results.
pub async fn a_batch_is_completed_in_one_call(b: impl Backend) {
    let store = instrumented(&b, Quirk::None);
    let prefix = unique_prefix(&b, "batch-end");
    let g = guard(&(store.clone() as SharedStore));
    let items = || -> Vec<(Key, u32)> { (0..30u32).map(|id| (key(&prefix, &[&id]), id)).collect() };
    let runs = AtomicUsize::new(0);
    let handler = |id: u32| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if id % 10 == 9 {
                Err(TestError::Business(format!("item {id} failed")))
            } else {
                Ok(id * 2)
            }
        }
    };
    let first: Vec<Result<u32, TestError>> = g.run_batch(items(), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 30);
    assert_eq!(*store.batches.lock().unwrap(), vec![30]);
    assert_eq!(store.singles.load(Ordering::SeqCst), 0);
    for (id, out) in (0..30u32).zip(&first) {
        let record = store.read(&key(&prefix, &[&id])).await.unwrap().unwrap();
        if id % 10 == 9 {
            assert!(matches!(out, Err(TestError::Business(_))), "{id}: {out:?}");
            assert_eq!(record.state, RecordState::Released, "{id}");
        } else {
            assert_eq!(out.as_ref().unwrap(), &(id * 2));
            assert_eq!(record.state, RecordState::Completed, "{id}");
        }
    }
    // The failed items run again; the others are duplicates.
    let second: Vec<Result<u32, TestError>> = g.run_batch(items(), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 33);
    for (id, out) in (0..30u32).zip(&second) {
        if id % 10 == 9 {
            assert!(matches!(out, Err(TestError::Business(_))), "{id}: {out:?}");
        } else {
            assert!(
                matches!(out, Err(TestError::Idem(Error::Duplicate { .. }))),
                "{id}: {out:?}"
            );
        }
    }
    assert_eq!(*store.batches.lock().unwrap(), vec![30, 3]);
}

/// A slow item never holds its siblings' completions: the fast items' records are completed
/// while the slow one still runs (it waits until they are), then it completes on its own.
pub async fn a_slow_batch_item_does_not_hold_the_others(b: impl Backend) {
    let store = instrumented(&b, Quirk::None);
    let prefix = unique_prefix(&b, "batch-slow");
    let g = guard(&(store.clone() as SharedStore));
    let items: Vec<(Key, u32)> = (0..5u32).map(|id| (key(&prefix, &[&id]), id)).collect();
    let fast: Vec<Key> = (1..5u32).map(|id| key(&prefix, &[&id])).collect();
    let observer = store.clone();
    let results: Vec<Result<u32, TestError>> = g
        .run_batch(items, |id| {
            let (observer, fast) = (observer.clone(), fast.clone());
            async move {
                if id == 0 {
                    // Finishes only once every fast item's record is completed.
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                    loop {
                        let mut done = 0;
                        for k in &fast {
                            let record = observer.read(k).await.unwrap();
                            done += usize::from(
                                record.is_some_and(|r| r.state == RecordState::Completed),
                            );
                        }
                        if done == fast.len() {
                            break;
                        }
                        assert!(
                            tokio::time::Instant::now() < deadline,
                            "the fast items waited for the slow one"
                        );
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
                Ok(id)
            }
        })
        .await;
    assert_eq!(
        results.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    let record = store.read(&key(&prefix, &[&0u32])).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    let batches = store.batches.lock().unwrap().clone();
    assert_eq!(
        batches.iter().sum::<usize>() + store.singles.load(Ordering::SeqCst),
        5,
        "{batches:?}"
    );
    assert!(batches.len() >= 2, "{batches:?}");
}

/// A batch dropped while its ending hangs (the caller's timeout) still records every
/// item's outcome: each body ran once, and each owner completes on its own in the background,
/// so no key is left claimed and a redelivery runs nothing.
pub async fn a_batch_dropped_while_settling_still_records_every_outcome(b: impl Backend) {
    let store: SharedStore = instrumented(&b, Quirk::HungEndings);
    let prefix = unique_prefix(&b, "batch-dropped");
    let g = guard(&store);
    let items = || -> Vec<(Key, u32)> { (0..6u32).map(|id| (key(&prefix, &[&id]), id)).collect() };
    let runs = AtomicUsize::new(0);
    let handler = |id: u32| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TestError>(id)
        }
    };
    let dropped =
        tokio::time::timeout(Duration::from_millis(300), g.run_batch(items(), handler)).await;
    assert!(dropped.is_err(), "the hung ending answered");
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    for (k, _) in items() {
        super::eventually(&store, &k, |r| {
            r.as_ref()
                .is_some_and(|r| r.state == RecordState::Completed)
        })
        .await;
    }
    let again: Vec<Result<u32, TestError>> = g.run_batch(items(), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 6, "{again:?}");
}

/// `complete_many` answers each item, in order, as the single `complete` or `release` would
/// have: its own completion, a stale token, a completion retried by its owner, a release, a
/// release by someone else, a key without a record, a lease that ran out but is still the
/// owner's, two endings of one key (the second meets the first's outcome, a completion
/// then a release and a release then a completion), and a release retried by its owner.
pub async fn complete_many_answers_as_single_endings_would(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "end-many");
    let minute = Duration::from_secs(60);
    let owned = |id: u32, lease: Duration| {
        let store = store.clone();
        let k = key(&prefix, &[&id]);
        async move {
            let r = req(&k, lease);
            let Claim::Acquired { .. } = store.claim(&r).await.unwrap() else {
                panic!("{k} not acquired");
            };
            (k, r.token)
        }
    };
    let done = |result: &str| Completion::new(Some(result.as_bytes().to_vec()), minute);
    let (k1, t1) = owned(1, minute).await;
    let (k2, _) = owned(2, minute).await;
    let (k3, t3) = owned(3, minute).await;
    assert!(store.complete(&k3, &t3, &done("r3")).await.unwrap());
    let (k4, t4) = owned(4, minute).await;
    let (k5, _) = owned(5, minute).await;
    let k6 = key(&prefix, &[&6u32]);
    let (k7, t7) = owned(7, Duration::from_millis(5)).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    let (k8, t8) = owned(8, minute).await;
    let (k9, t9) = owned(9, minute).await;
    assert!(store.release(&k9, &t9).await.unwrap());
    let (k10, t10) = owned(10, minute).await;
    let stranger = Token::generate();
    let items = vec![
        Ending::complete(k1.clone(), t1, done("r1")),
        Ending::complete(k2.clone(), stranger, done("r2")),
        Ending::complete(k3.clone(), t3, done("r3")),
        Ending::release(k4.clone(), t4),
        Ending::release(k5.clone(), stranger),
        Ending::complete(k6.clone(), stranger, done("r6")),
        Ending::complete(k7.clone(), t7, done("r7")),
        Ending::complete(k8.clone(), t8, done("r8")),
        Ending::release(k8.clone(), t8),
        Ending::release(k9.clone(), t9),
        Ending::release(k10.clone(), t10),
        Ending::complete(k10.clone(), t10, done("r10")),
    ];
    let answers: Vec<bool> = store
        .complete_many(&items)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        answers,
        [true, false, true, true, false, false, true, true, false, false, true, false]
    );
    let state = |k: &Key| {
        let store = store.clone();
        let k = k.clone();
        async move { store.read(&k).await.unwrap().map(|r| (r.state, r.result)) }
    };
    let completed = |r: &str| Some((RecordState::Completed, Some(r.as_bytes().to_vec())));
    assert_eq!(state(&k1).await, completed("r1"));
    assert!(matches!(
        state(&k2).await,
        Some((RecordState::InProgress { .. }, None))
    ));
    assert_eq!(state(&k3).await, completed("r3"));
    assert_eq!(state(&k4).await, Some((RecordState::Released, None)));
    assert!(matches!(
        state(&k5).await,
        Some((RecordState::InProgress { .. }, None))
    ));
    assert_eq!(state(&k6).await, None);
    assert_eq!(state(&k7).await, completed("r7"));
    assert_eq!(state(&k8).await, completed("r8"));
    assert_eq!(state(&k9).await, Some((RecordState::Released, None)));
    assert_eq!(state(&k10).await, Some((RecordState::Released, None)));
    assert!(store.complete_many(&[]).await.is_empty());
}

/// A batch built with `Idempotency::batch` treats each item as an `Operation` would: its
/// payload fingerprint (a changed payload is a mismatch, the others replay), replayed values
/// and stored errors (with the replay hook called per replayed item), and a business check
/// per item (an item whose effect is applied runs nothing and its record is completed).
pub async fn a_batch_checks_payloads_replays_and_asks_done_per_item(b: impl Backend) {
    // Replays by key prefix: other cases run this one at the same time on other backends.
    static REPLAYS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let replays = |prefix: &str| {
        REPLAYS
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == prefix)
            .count()
    };
    let store = b.store();
    let prefix = unique_prefix(&b, "batch-builder");
    let g = guard(&store);
    let runs = AtomicUsize::new(0);
    let orders = |cents: [u64; 4]| -> Vec<(Key, (u32, u64))> {
        (0..4u32)
            .map(|id| (key(&prefix, &[&id]), (id, cents[id as usize])))
            .collect()
    };
    let handler = |(id, cents): (u32, u64)| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            if id == 3 {
                Err(AppError::Business(format!("card declined for {cents}")))
            } else {
                Ok(format!("receipt-{id}-{cents}"))
            }
        }
    };
    let batch = || {
        g.batch()
            .fingerprint(|&(_, cents): &(u32, u64)| idempotency::store::Fingerprint::of(&[&cents]))
            .replay()
            .store_errors()
            .on_replay(|key| REPLAYS.lock().unwrap().push(key.prefix().to_string()))
    };
    let first: Vec<Result<String, AppError>> = batch().run(orders([10, 20, 30, 40]), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(first[0].as_ref().unwrap(), "receipt-0-10");
    assert!(matches!(&first[3], Err(AppError::Business(_))), "{first:?}");

    // The same payloads: every result, the stored error included, is replayed.
    let replays_before = replays(&prefix);
    let second: Vec<Result<String, AppError>> =
        batch().run(orders([10, 20, 30, 40]), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(format!("{second:?}"), format!("{first:?}"));
    assert_eq!(replays(&prefix) - replays_before, 4);

    // Item 1's payload changed: a mismatch; the others still replay.
    let third: Vec<Result<String, AppError>> = batch().run(orders([10, 99, 30, 40]), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert!(
        matches!(&third[1], Err(AppError::Idem(e)) if e.contains("PayloadMismatch")),
        "{third:?}"
    );
    assert_eq!(third[2].as_ref().unwrap(), "receipt-2-30");

    // A business check per item: items 0 and 2 are already applied elsewhere.
    let fresh = unique_prefix(&b, "batch-done");
    let items: Vec<(Key, (u32, u64))> =
        (0..4u32).map(|id| (key(&fresh, &[&id]), (id, 1))).collect();
    let checked = AtomicUsize::new(0);
    let checked = &checked;
    let out: Vec<Result<String, AppError>> = g
        .batch()
        .done(move |&(id, _): &(u32, u64)| async move {
            checked.fetch_add(1, Ordering::SeqCst);
            Ok::<_, AppError>(id % 2 == 0)
        })
        .run(items, handler)
        .await;
    assert_eq!(checked.load(Ordering::SeqCst), 4);
    assert_eq!(
        runs.load(Ordering::SeqCst),
        6,
        "only items 1 and 3 ran: {out:?}"
    );
    for id in [0u32, 2] {
        assert!(
            matches!(&out[id as usize], Err(AppError::Idem(e)) if e.contains("Duplicate")),
            "{out:?}"
        );
        let record = store.read(&key(&fresh, &[&id])).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed);
    }
    assert_eq!(out[1].as_ref().unwrap(), "receipt-1-1");
}

/// A batch claim that answers fewer items than it was given: every item still gets an
/// answer, in order; the unanswered one fails with a store error and runs nothing.
pub async fn a_batch_claim_that_answers_fewer_items_fails_the_rest(b: impl Backend) {
    let store: SharedStore = instrumented(&b, Quirk::ShortClaims);
    let prefix = unique_prefix(&b, "batch-short");
    let items: Vec<(Key, u32)> = (0..4u32).map(|id| (key(&prefix, &[&id]), id)).collect();
    let runs = AtomicUsize::new(0);
    let out: Vec<Result<u32, TestError>> = guard(&store)
        .run_batch(items, |id| {
            let runs = &runs;
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(id)
            }
        })
        .await;
    assert_eq!(out.len(), 4);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    for (id, answer) in (0..3u32).zip(&out) {
        assert_eq!(answer.as_ref().unwrap(), &id);
    }
    assert!(
        matches!(&out[3], Err(TestError::Idem(Error::Store(e))) if e.kind() == idempotency::store::StoreErrorKind::Protocol),
        "{out:?}"
    );
}

/// A batch whose ending fails (nothing recorded): every body ran once and its value is
/// returned (the effect is applied), the claims are never given back, and each owner
/// records its outcome on its own in the background, so a redelivery runs nothing.
pub async fn a_failed_batch_ending_is_recorded_item_by_item(b: impl Backend) {
    let store = instrumented(&b, Quirk::FailingEndings);
    let shared: SharedStore = store.clone();
    let prefix = unique_prefix(&b, "batch-end-fails");
    let items = || -> Vec<(Key, u32)> { (0..6u32).map(|id| (key(&prefix, &[&id]), id)).collect() };
    let runs = AtomicUsize::new(0);
    let handler = |id: u32| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TestError>(id)
        }
    };
    let first: Vec<Result<u32, TestError>> = guard(&shared).run_batch(items(), handler).await;
    assert_eq!(
        first.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        (0..6u32).collect::<Vec<_>>()
    );
    for (k, _) in items() {
        super::eventually(&shared, &k, |r| {
            r.as_ref()
                .is_some_and(|r| r.state == RecordState::Completed)
        })
        .await;
    }
    let again: Vec<Result<u32, TestError>> = guard(&shared).run_batch(items(), handler).await;
    assert_eq!(runs.load(Ordering::SeqCst), 6, "{again:?}");
    assert_eq!(*store.batches.lock().unwrap(), vec![6]);
}

/// A batch's ending that never answers is abandoned at the bound on a store call (half the
/// lease), as a single completion is: each item then reads its record back and completes it
/// on its own, so the batch answers every item `Ok`, every record is completed, and each body
/// ran once.
pub async fn a_batch_ending_that_never_answers_is_bounded_and_each_item_completes_alone(
    b: impl Backend,
) {
    let store = instrumented(&b, Quirk::HungEndings);
    let shared: SharedStore = store.clone();
    let prefix = unique_prefix(&b, "batch-end-hangs");
    let items: Vec<(Key, u32)> = (0..6u32).map(|id| (key(&prefix, &[&id]), id)).collect();
    let keys: Vec<Key> = items.iter().map(|(k, _)| k.clone()).collect();
    let runs = AtomicUsize::new(0);
    let g = guard(&shared).lease(Duration::from_secs(1));
    let answers: Vec<Result<u32, TestError>> = tokio::time::timeout(
        Duration::from_secs(30),
        g.run_batch(items, |id| {
            let runs = &runs;
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, TestError>(id)
            }
        }),
    )
    .await
    .expect("a batch ending that never answers held the batch");
    assert_eq!(
        answers.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        (0..6u32).collect::<Vec<_>>()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 6);
    assert_eq!(*store.batches.lock().unwrap(), vec![6]);
    assert_eq!(
        store.singles.load(Ordering::SeqCst),
        6,
        "each item completes alone"
    );
    for k in &keys {
        let record = store.read(k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{k}");
    }
}

/// While a batch's ending is in flight, its items' leases are renewed (every third of the
/// lease), as a single completion's is: here the store sends the ending only once every item
/// was renewed, and the ending still answers within its bound, in one call.
pub async fn leases_are_renewed_while_a_batch_ending_is_in_flight(b: impl Backend) {
    let store = instrumented(&b, Quirk::EndingsWaitForRenewals);
    let shared: SharedStore = store.clone();
    let prefix = unique_prefix(&b, "batch-end-renewed");
    let items: Vec<(Key, u32)> = (0..4u32).map(|id| (key(&prefix, &[&id]), id)).collect();
    let keys: Vec<Key> = items.iter().map(|(k, _)| k.clone()).collect();
    // Renewed after 1 s; the ending is abandoned after 1.5 s.
    let g = guard(&shared).lease(Duration::from_secs(3));
    let answers: Vec<Result<u32, TestError>> = tokio::time::timeout(
        Duration::from_secs(30),
        g.run_batch(items, |id| async move { Ok::<_, TestError>(id) }),
    )
    .await
    .expect("the batch did not answer");
    assert_eq!(
        answers.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        (0..4u32).collect::<Vec<_>>()
    );
    assert!(store.renewals.load(Ordering::SeqCst) >= 4);
    assert_eq!(
        *store.batches.lock().unwrap(),
        vec![4],
        "the ending was abandoned"
    );
    assert_eq!(store.singles.load(Ordering::SeqCst), 0);
    for k in &keys {
        let record = store.read(k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{k}");
    }
}

/// A batch claim gives each item its own lease and record lifetime, whether the items share
/// them or not, on fresh keys and on released records taken over: each record read back
/// has the lease its request asked for left, and expires when its request's lifetime says.
pub async fn a_batch_claim_keeps_each_items_lease_and_lifetime(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "batch-leases");
    let secs = Duration::from_secs;
    let k = |id: u32| key(&prefix, &[&id]);
    let ask = |id: u32, lease: u64| {
        ClaimRequest::new(k(id), Token::generate(), secs(lease), secs(10 * lease))
    };
    // Released records, taken over by the batches below.
    for id in [5, 6, 8, 9] {
        let r = req(&k(id), secs(30));
        assert!(matches!(
            store.claim(&r).await.unwrap(),
            Claim::Acquired { .. }
        ));
        assert!(store.release(&k(id), &r.token).await.unwrap());
    }
    let batches = [
        vec![ask(0, 100), ask(1, 200), ask(2, 300)],
        vec![ask(3, 400), ask(4, 400)],
        vec![ask(5, 500), ask(6, 600), ask(7, 700)],
        vec![ask(8, 800), ask(9, 800)],
    ];
    for batch in &batches {
        for (r, claim) in batch.iter().zip(store.claim_many(batch).await) {
            assert!(
                matches!(claim.unwrap(), Claim::Acquired { .. }),
                "{}",
                r.key
            );
            let record = store.read(&r.key).await.unwrap().expect("a claimed record");
            let RecordState::InProgress { lease_left } = record.state else {
                panic!("{} is {:?}", r.key, record.state);
            };
            // Redis's fast claim sets the lease end from its estimate of the server's clock:
            // up to twice the estimate's 1 ms bound later than the server's own clock would,
            // never earlier (`RedisStoreBuilder::fast_claim_max_error`).
            let fast_claim_slack = Duration::from_millis(2);
            assert!(
                lease_left <= r.lease + fast_claim_slack && lease_left > r.lease - secs(60),
                "{}: {lease_left:?} left of {:?}",
                r.key,
                r.lease
            );
            if let Some(expires_in) = record.expires_in {
                let lifetime = r.record_lifetime();
                assert!(
                    expires_in <= lifetime && expires_in > lifetime - secs(60),
                    "{}: expires in {expires_in:?}, lifetime {lifetime:?}",
                    r.key
                );
            }
        }
    }
}
