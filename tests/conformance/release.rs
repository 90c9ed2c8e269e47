//! Conformance cases for rule 4: an error releases the claim (only if still ours) and the retry
//! runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::store::{Claim, RecordState};
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
