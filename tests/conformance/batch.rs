//! Conformance cases for batches and retried claims: each item of a batch is settled by its own
//! outcome, and a claim retried by its owner is acquired again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::{Claim, Error, Key, RecordState};
use tokio::sync::Barrier;

use super::{assert_answer, guard, key, req, same_fence, unique_prefix, Backend, TestError};

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
