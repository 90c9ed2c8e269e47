//! Conformance cases for the bounds on an owner's store calls: a completion that never
//! answers is abandoned after half the lease and resolved by reading the record back, with
//! the lease renewed meanwhile; a completion lost after its caller was told it succeeded is
//! reported (the `idempotency.completion.lost` counter and the `on_completion_lost` hook).
//!
//! The faults come from [`Faulty`] around the backend's real store: a store that stays silent
//! on one chosen call, or fails completions and renewals for exactly as long as a case needs,
//! is not something a healthy server does on demand (`tests/real_faults.rs` stalls a real
//! PostgreSQL connection through a proxy).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use idempotency::store::{Claim, ClaimRequest, Record, RecordState, Token};
use idempotency::{on_completion_lost, CompletionLost, Idempotency, LossReason, SharedStore};

use super::{eventually, key, unique_prefix, Backend, Faulty, TestError};

/// A completion that never answers neither hangs its caller nor lets the lease lapse: after
/// half the lease it is treated as a lost reply, the record is read back (ours, in progress)
/// and the completion sent again. The body ran once and its caller gets `Ok`.
pub async fn a_completion_that_never_answers_is_bounded_and_read_back(b: impl Backend) {
    let faulty = Faulty::new(b.store());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "silent-complete"), &[&"pay-1"]);
    let lease = Duration::from_secs(1);
    let idem = Idempotency::new(Duration::from_secs(60))
        .lease(lease)
        .store(store.clone());
    let runs = AtomicUsize::new(0);
    faulty.stall_completes.store(1, Ordering::SeqCst);
    let call = idem.run(k.clone(), async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<_, TestError>(())
    });
    tokio::time::timeout(10 * lease, call)
        .await
        .expect("the caller never returned")
        .unwrap();
    assert_eq!(
        faulty.stall_completes.load(Ordering::SeqCst),
        0,
        "no completion stalled"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let record = b.store().read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
}

/// Every lost completion this process reported, whatever the case: the hook is one per
/// process, so it is installed once and each case looks for its own keys.
fn reported() -> &'static Mutex<Vec<CompletionLost>> {
    static REPORTED: Mutex<Vec<CompletionLost>> = Mutex::new(Vec::new());
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| on_completion_lost(|lost| REPORTED.lock().unwrap().push(lost.clone())));
    &REPORTED
}

/// The caller got `Ok` while its completion was retried in the background (the store failed
/// it, and failed the renewals too, so the lease ran out); another owner then took the key,
/// and the background completion was refused. Nobody can be told any more, so the loss goes
/// to the hook, once, with the lost owner's fence.
pub async fn a_completion_lost_after_the_caller_got_ok_is_reported(b: impl Backend) {
    let reported = reported();
    let faulty = Faulty::new(b.store());
    let store: SharedStore = faulty.clone();
    let k = key(&unique_prefix(&b, "lost-complete"), &[&"pay-1"]);
    let lease = Duration::from_secs(1);
    let idem = Idempotency::new(Duration::from_secs(60))
        .lease(lease)
        .store(store.clone());
    faulty.fail_renewals.store(true, Ordering::SeqCst);
    faulty.fail_completes.store(usize::MAX, Ordering::SeqCst);
    let fence = Arc::new(AtomicUsize::new(0));
    let out: Result<(), TestError> = idem
        .run(k.clone(), {
            let fence = fence.clone();
            async move {
                let current = idempotency::current().expect("inside the call");
                fence.store(usize::try_from(current.fence()).unwrap(), Ordering::SeqCst);
                Ok(())
            }
        })
        .await;
    out.expect("the caller is told the effect is applied");

    // The lease runs out on the store; another owner takes the key over.
    let lease_ran_out = |r: &Option<Record>| matches!(r, Some(r) if r.state == RecordState::InProgress { lease_left: Duration::ZERO });
    eventually(&b.store(), &k, lease_ran_out).await;
    let next = ClaimRequest::new(k.clone(), Token::generate(), lease, Duration::from_secs(60));
    assert!(matches!(
        b.store().claim(&next).await.unwrap(),
        Claim::Acquired { .. }
    ));
    assert!(
        reported.lock().unwrap().iter().all(|lost| lost.key != k),
        "reported before the completion was refused"
    );
    faulty.fail_completes.store(0, Ordering::SeqCst);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mine = loop {
        let mine: Vec<CompletionLost> = reported
            .lock()
            .unwrap()
            .iter()
            .filter(|lost| lost.key == k)
            .cloned()
            .collect();
        if !mine.is_empty() || tokio::time::Instant::now() > deadline {
            break mine;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(mine[0].reason, LossReason::Refused);
    assert_eq!(
        mine[0].fence,
        u64::try_from(fence.load(Ordering::SeqCst)).unwrap()
    );
}

/// A batch claim that does not answer within half the lease fails its items closed (nothing
/// runs; the broker redelivers) instead of holding the batch; the claims it made meanwhile are
/// given back once they land, so the redelivered batch runs every item, once.
pub async fn a_batch_claim_that_never_answers_fails_closed_and_gives_back(b: impl Backend) {
    let faulty = Faulty::new(b.store());
    let store: SharedStore = faulty.clone();
    let prefix = unique_prefix(&b, "silent-batch");
    let items: Vec<(idempotency::Key, u32)> = (0..3u32).map(|i| (key(&prefix, &[&i]), i)).collect();
    let lease = Duration::from_secs(1);
    let idem = Idempotency::new(Duration::from_secs(60))
        .lease(lease)
        .store(store.clone());
    let runs = AtomicUsize::new(0);
    let handler = |_: u32| {
        runs.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, TestError>(()) }
    };
    // The claims are applied; their answers never come while the gate is closed.
    faulty.claim_reply.close();
    let out: Vec<Result<(), TestError>> =
        tokio::time::timeout(10 * lease, idem.batch().run(items.clone(), handler))
            .await
            .expect("the batch never answered");
    assert_eq!(out.len(), 3);
    for out in &out {
        assert!(
            matches!(out, Err(TestError::Idem(idempotency::Error::Store(_)))),
            "{out:?}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // The answers arrive late: what was acquired is given back, long before the lease ends.
    faulty.claim_reply.open();
    for (k, _) in &items {
        eventually(
            &b.store(),
            k,
            |r| !matches!(r, Some(r) if matches!(r.state, RecordState::InProgress { .. })),
        )
        .await;
    }
    let again: Vec<Result<(), TestError>> = idem.batch().run(items.clone(), handler).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
