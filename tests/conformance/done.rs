//! Conformance cases for rule 6: the business-status fallback keeps effects exactly-once when the
//! store lost data.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::store::{Claim, RecordState};
use idempotency::Error;

use super::{guard, key, req, same_fence, unique_prefix, Backend, TestError};

/// A business table: the set of orders whose effect is applied.
#[derive(Default, Clone)]
pub struct Ledger(Arc<Mutex<HashSet<String>>>);

impl Ledger {
    fn apply(&self, order: &str) -> bool {
        self.0.lock().unwrap().insert(order.to_string())
    }
    async fn is_applied(&self, order: &str) -> Result<bool, TestError> {
        Ok(self.0.lock().unwrap().contains(order))
    }
}

pub async fn done_fallback_survives_lost_store_data(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "done");
    let ledger = Ledger::default();
    let executions = AtomicUsize::new(0);
    let consume = |order: &'static str| {
        let (g, k, ledger, executions) = (
            guard(&store),
            key(&prefix, &[&order]),
            ledger.clone(),
            &executions,
        );
        async move {
            g.operation(k)
                .done(|| ledger.is_applied(order))
                .run(async {
                    executions.fetch_add(1, Ordering::SeqCst);
                    assert!(ledger.apply(order), "effect applied twice");
                    Ok::<_, TestError>(())
                })
                .await
        }
    };
    consume("A-1").await.unwrap();
    b.lose_data(&prefix).await;
    assert!(store
        .read(&key(&prefix, &[&"A-1"]))
        .await
        .unwrap()
        .is_none());

    // The store forgot the key; the business check catches the duplicate.
    match consume("A-1").await {
        Err(TestError::Idem(Error::Duplicate { .. })) => {}
        other => panic!("expected a filtered duplicate, got {other:?}"),
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // ... and marked the record completed, so the next duplicate is filtered by the store.
    let record = store.read(&key(&prefix, &[&"A-1"])).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);

    // A new order still runs.
    consume("A-2").await.unwrap();
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

pub async fn done_fallback_answers_an_in_progress_claim(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "done-in-progress");
    let k = key(&prefix, &[&"A-3"]);
    // An owner that crashed after applying the effect: its lease is still live.
    let crashed = req(&k, Duration::from_secs(30));
    let Claim::Acquired { fence: f } = store.claim(&crashed).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    let ledger = Ledger::default();
    ledger.apply("A-3");

    let out: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .done(|| ledger.is_applied("A-3"))
        .run(async { panic!("the handler must not run") })
        .await;
    assert!(matches!(out, Err(TestError::Idem(Error::Duplicate { .. }))));

    // Without the fallback the same call is an in-progress duplicate.
    let out: Result<(), TestError> = guard(&store).run(k, async { Ok(()) }).await;
    assert!(
        matches!(out, Err(TestError::Idem(Error::InProgress { fence, .. })) if same_fence(&b, fence, f)),
        "{out:?}, owner fence {f}"
    );
}

pub async fn failing_done_check_runs_nothing(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "done-fails"), &[&"A-4"]);
    let out: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .done(|| async { Err(TestError::Business("orders database down".into())) })
        .run(async { panic!("the handler must not run") })
        .await;
    assert!(matches!(out, Err(TestError::Business(_))));
    // The claim was given back: the redelivery can run.
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
}
