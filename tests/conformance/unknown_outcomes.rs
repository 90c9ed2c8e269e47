//! Conformance cases for rule 9: a lost reply is resolved by reading the record back by token.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::store::{Claim, RecordState};
use idempotency::SharedStore;

use super::{guard, key, unique_prefix, Backend, LostReplies, TestError};

pub async fn lost_claim_reply_is_resolved_as_ours(b: impl Backend) {
    let inner = b.store();
    let lossy = Arc::new(LostReplies::new(inner.clone()));
    lossy.lose_next_claim_reply();
    let store: SharedStore = lossy.clone();
    let k = key(&unique_prefix(&b, "lost-claim"), &[&"order-9"]);
    let executions = AtomicUsize::new(0);
    let out: Result<(), TestError> = guard(&store)
        .run(k.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    out.unwrap();
    assert_eq!(lossy.lost(), 1, "the fault was not injected");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // The record is the lost claim's own acquisition, not a second one.
    let Some(Claim::Acquired { fence: f }) = lossy.lost_claim() else {
        panic!(
            "the lost claim was not an acquisition: {:?}",
            lossy.lost_claim()
        )
    };
    let record = inner.read(&k).await.unwrap().unwrap();
    assert_eq!((record.state, record.fence), (RecordState::Completed, f));
}

pub async fn lost_complete_reply_is_resolved_as_completed(b: impl Backend) {
    let inner = b.store();
    let lossy = Arc::new(LostReplies::new(inner.clone()));
    lossy.lose_next_complete_reply();
    let store: SharedStore = lossy.clone();
    let k = key(&unique_prefix(&b, "lost-complete"), &[&"order-10"]);
    let out: Result<u32, TestError> = guard(&store)
        .operation(k.clone())
        .replay()
        .run(async { Ok(7) })
        .await;
    assert_eq!(out.unwrap(), 7);
    assert_eq!(lossy.lost(), 1, "the fault was not injected");
    let replay: Result<u32, TestError> = guard(&store)
        .operation(k)
        .replay()
        .run(async { Ok(8) })
        .await;
    assert_eq!(replay.unwrap(), 7);
}
