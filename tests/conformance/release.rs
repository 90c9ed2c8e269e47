//! Conformance cases for rule 4: an error releases the claim (only if still ours) and the retry
//! runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::store::{AcquiredClaim, Claim, RecordState};
use idempotency::Key;
use idempotency::{Error, OnError};

use super::{assert_answer, guard, key, req, unique_prefix, AppError, Backend, TestError};

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

/// A release naming its claim (`release_acquired`, what the engine and locks send) answers
/// as a release by token: the claim as its owner acquired it, the claim renewed since (its
/// record is no longer the one the claim wrote), a claim named with a wrong fence, and a
/// claim another owner has taken over.
pub async fn a_release_naming_its_claim_is_decided_by_the_token(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "named-release");
    let lease = Duration::from_secs(30);
    let acquire = |k: Key, lease: Duration| {
        let store = store.clone();
        async move {
            let owner = req(&k, lease);
            let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
                panic!("a new key was not acquired")
            };
            (owner, fence)
        }
    };
    let released = |k: Key, fence: u64| {
        let store = store.clone();
        async move {
            let record = store.read(&k).await.unwrap().expect("the record");
            assert_eq!((record.state, record.fence), (RecordState::Released, fence));
            assert_eq!(
                store.claim(&req(&k, lease)).await.unwrap(),
                Claim::Acquired { fence: fence + 1 },
                "the next claim acquires with the next fence"
            );
        }
    };

    // As acquired.
    let k = key(&prefix, &[&"as-acquired"]);
    let (owner, fence) = acquire(k.clone(), lease).await;
    let named = AcquiredClaim::new(fence, owner.fingerprint).with_lease(lease);
    assert!(store
        .release_acquired(&k, &owner.token, &named)
        .await
        .unwrap());
    assert!(
        !store
            .release_acquired(&k, &owner.token, &named)
            .await
            .unwrap(),
        "a released claim is not released again"
    );
    released(k, fence).await;

    // Renewed since: the record changed, the token still owns it.
    let k = key(&prefix, &[&"renewed"]);
    let (owner, fence) = acquire(k.clone(), lease).await;
    // A longer lease: the renewed record's lease end is not the claimed one's.
    assert!(store.renew(&k, &owner.token, lease * 2).await.unwrap());
    let named = AcquiredClaim::new(fence, owner.fingerprint).with_lease(lease);
    assert!(store
        .release_acquired(&k, &owner.token, &named)
        .await
        .unwrap());
    released(k, fence).await;

    // Named with a fence that is not the claim's: the token decides.
    let k = key(&prefix, &[&"wrong-fence"]);
    let (owner, fence) = acquire(k.clone(), lease).await;
    let named = AcquiredClaim::new(fence + 7, owner.fingerprint).with_lease(lease);
    assert!(store
        .release_acquired(&k, &owner.token, &named)
        .await
        .unwrap());
    released(k, fence).await;

    // Taken over once the lease ran out: the old owner releases nothing.
    let k = key(&prefix, &[&"taken-over"]);
    let short = Duration::from_secs(1);
    let (old, old_fence) = acquire(k.clone(), short).await;
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    let (new, new_fence) = acquire(k.clone(), lease).await;
    let named = AcquiredClaim::new(old_fence, old.fingerprint).with_lease(short);
    assert!(!store
        .release_acquired(&k, &old.token, &named)
        .await
        .unwrap());
    let record = store
        .read(&k)
        .await
        .unwrap()
        .expect("the new owner's record");
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    assert_eq!((record.fence, record.token), (new_fence, new.token));
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
