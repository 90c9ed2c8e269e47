//! Conformance cases for rule 5: store errors fail closed; fail open is an opt-in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::store::RecordState;
use idempotency::{Error, OnStoreError, SharedStore};

use super::{guard, key, req, unique_prefix, Backend, Down, TestError};

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
