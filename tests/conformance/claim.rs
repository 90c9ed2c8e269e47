//! Conformance cases for rule 1: claim is one atomic operation; fences grow by one per acquisition.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{Claim, ClaimRequest, Completion, RecordState};
use idempotency::Error;
use tokio::sync::{Barrier, Notify};

use super::{assert_answer, guard, key, req, same_fence, unique_prefix, Backend, TestError};

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
    let done = Completion::new(None, Duration::from_millis(300));
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
    // write is refused by `... WHERE fence < $fence`. (A claim on a completed record changes
    // nothing: a layered store's front, completed a moment after its back, may still answer
    // `Completed` until its own copy expires.)
    let third = req(&k, Duration::from_secs(30));
    let g = loop {
        match store.claim(&third).await.unwrap() {
            Claim::Acquired { fence } => break fence,
            Claim::Completed { .. } if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("an expired key was not acquired: {other:?}"),
        }
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
    let lease = Duration::from_secs(1);
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
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(!store.complete(&k, &old.token, &done).await.unwrap());
    assert!(!store.release(&k, &old.token).await.unwrap());
    assert!(!store.renew(&k, &old.token, lease).await.unwrap());
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!((record.fence, record.token), (f + 1, new.token));
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    assert!(store.complete(&k, &new.token, &done).await.unwrap());
}

/// [`Store::claim_and_is_completed`](idempotency::store::Store::claim_and_is_completed)
/// answers as `claim` and `is_completed` would, each for its own key, whatever state either
/// key is in. A store that cannot send the two together answers `None` (the engine then sends
/// the two calls apart, and the other cases cover them): this case asserts that much only.
pub async fn a_claim_with_a_read_answers_as_the_two_calls(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "claim-read");
    let minute = Duration::from_secs(60);
    let [fresh, also_fresh, running, done, absent] =
        ["fresh", "also-fresh", "running", "done", "absent"].map(|name| key(&prefix, &[&name]));
    let owner = req(&running, minute);
    let Claim::Acquired {
        fence: running_fence,
    } = store.claim(&owner).await.unwrap()
    else {
        panic!("a fresh key was not acquired");
    };
    let finished = req(&done, minute);
    let Claim::Acquired { fence: done_fence } = store.claim(&finished).await.unwrap() else {
        panic!("a fresh key was not acquired");
    };
    let paid = Completion::new(Some(b"paid".to_vec()), minute);
    assert!(store.complete(&done, &finished.token, &paid).await.unwrap());

    let both = |claim: &ClaimRequest, other: &idempotency::Key| {
        store
            .clone()
            .claim_and_is_completed(Arc::new(claim.clone()), other.clone())
    };
    let first = req(&fresh, minute);
    let Some(answer) = both(&first, &absent) else {
        return;
    };
    let (claim, read) = answer.await;
    let Ok(Claim::Acquired { fence }) = claim else {
        panic!("a fresh key was not acquired: {claim:?}");
    };
    assert!(!read.unwrap(), "a key without a record read as completed");
    let record = store.read(&fresh).await.unwrap().unwrap();
    assert_eq!(
        (record.token, record.fence),
        (first.token, fence),
        "the claim was not written as `claim` writes it"
    );
    assert!(matches!(record.state, RecordState::InProgress { .. }));

    // The same owner again (a retry after a lost reply): the same fence; a live claim read.
    let (claim, read) = both(&first, &running).unwrap().await;
    assert_eq!(claim.unwrap(), Claim::Acquired { fence });
    assert!(!read.unwrap(), "an in-progress record read as completed");

    let (claim, read) = both(&req(&also_fresh, minute), &done).unwrap().await;
    assert!(matches!(claim, Ok(Claim::Acquired { .. })), "{claim:?}");
    assert!(read.unwrap(), "a completed record read as not completed");

    let (claim, read) = both(&req(&running, minute), &done).unwrap().await;
    assert_answer(
        &b,
        claim.unwrap(),
        Claim::InProgress {
            fence: running_fence,
        },
    );
    assert!(read.unwrap(), "a completed record read as not completed");

    let (claim, read) = both(&req(&done, minute), &fresh).unwrap().await;
    assert_answer(
        &b,
        claim.unwrap(),
        Claim::Completed {
            fence: done_fence,
            result: Some(b"paid".to_vec()),
        },
    );
    assert!(!read.unwrap(), "an in-progress record read as completed");
}
