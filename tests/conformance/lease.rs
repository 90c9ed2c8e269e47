//! Conformance cases for rule 2: the watchdog renews while the handler runs; a handler that
//! outlives its lease without renewal loses ownership and its completion is refused.

use std::sync::Arc;
use std::time::Duration;

use idempotency::store::{Claim, RecordState};
use idempotency::{Error, OnInProgress};
use tokio::sync::Notify;

use super::{guard, key, req, same_fence, unique_prefix, Backend, TestError};

pub async fn watchdog_keeps_a_slow_handler_owner(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "watchdog"), &[&"slow"]);
    let lease = Duration::from_secs(1);
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
    // Not shorter: each store call is bounded at half the lease, and a loaded machine's
    // claim took longer than 150 ms.
    let lease = Duration::from_secs(1);
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
        .on_in_progress(OnInProgress::Wait(Duration::from_secs(10)))
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
