//! Conformance cases for the in-progress policies (wait, skip), record expiry and keys.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::store::Claim;
use idempotency::{Error, Idempotency, OnInProgress, SharedStore};
use tokio::sync::Notify;

use super::{guard, key, req, same_fence, unique_prefix, Backend, Observed, TestError};

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
            g.on_in_progress(OnInProgress::Wait(Duration::from_secs(10)))
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
        .on_in_progress(OnInProgress::Wait(Duration::from_millis(200)))
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
        .on_in_progress(OnInProgress::Skip)
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
    // The lease plays no part here. It bounds each store call at half of it, so a short
    // one (300 ms) let a loaded machine's slow claim fail the call.
    let g = Idempotency::new(ttl).lease(ttl).store(store.clone());
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
