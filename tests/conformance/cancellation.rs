//! Conformance cases for rule 8: a dropped handler future gives its claim back.

use std::sync::Arc;

use idempotency::store::RecordState;
use tokio::sync::Notify;

use super::{eventually, guard, key, unique_prefix, Backend, TestError};

pub async fn dropped_future_gives_its_claim_back(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "cancel"), &[&"order-8"]);
    let entered = Arc::new(Notify::new());
    let call = {
        let (g, k, entered) = (guard(&store), k.clone(), entered.clone());
        tokio::spawn(async move {
            g.run(k, async move {
                entered.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, TestError>(())
            })
            .await
        })
    };
    entered.notified().await;
    let record = store.read(&k).await.unwrap().unwrap();
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    let f = record.fence;
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    eventually(&store, &k, |r| {
        r.as_ref().is_some_and(|r| r.state == RecordState::Released)
    })
    .await;

    // The redelivery runs at once, with the next fence.
    let retry: Result<(), TestError> = guard(&store).run(k.clone(), async { Ok(()) }).await;
    retry.unwrap();
    assert_eq!(store.read(&k).await.unwrap().unwrap().fence, f + 1);
}
