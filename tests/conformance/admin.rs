//! Conformance cases for the operator's API (`admin::Admin`): inspecting a record, freeing a
//! stuck owner's key with the fence it was seen with, letting a held key run again. Every
//! action leaves a record that changed since the operator looked at it alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::admin::{Admin, AdminOutcome};
use idempotency::{Claim, Completion, Error, OnError, RecordState, Token};

use super::{guard, key, req, unique_prefix, Backend, TestError};

/// A stuck owner (a crashed process with a long lease) is seen in progress; `force_release`
/// with another fence changes nothing; with its fence the key is free at once: the next
/// claim acquires with a higher fence and the stuck owner's completion is refused. Missing
/// keys and completed records are reported as such.
pub async fn an_operator_frees_a_stuck_key_with_its_fence(b: impl Backend) {
    let store = b.store();
    let admin = Admin::new(store.clone());
    let k = key(&unique_prefix(&b, "admin-stuck"), &[&"pay-1"]);
    assert_eq!(admin.inspect(&k).await.unwrap(), None);
    assert_eq!(
        admin.force_release(&k, 1).await.unwrap(),
        AdminOutcome::Missing
    );

    let stuck = req(&k, Duration::from_secs(60))
        .with_fingerprint(idempotency::Fingerprint::of(&[&"payload"]));
    let Claim::Acquired { fence } = store.claim(&stuck).await.unwrap() else {
        panic!("not acquired");
    };
    let seen = admin.inspect(&k).await.unwrap().expect("a record");
    assert!(
        matches!(seen.state, RecordState::InProgress { lease_left } if lease_left > Duration::from_secs(30)),
        "{seen:?}"
    );
    assert_eq!(seen.fence, fence);
    assert!(seen.fingerprint);
    assert!(!seen.held);
    assert_eq!(seen.result_size, None);

    assert_eq!(
        admin.force_release(&k, fence + 7).await.unwrap(),
        AdminOutcome::FenceMismatch { fence }
    );
    assert!(matches!(
        store
            .claim(&req(&k, Duration::from_secs(60)))
            .await
            .unwrap(),
        Claim::InProgress { .. }
    ));
    assert_eq!(
        admin.force_release(&k, fence).await.unwrap(),
        AdminOutcome::Done { fence }
    );
    let next = req(&k, Duration::from_secs(60));
    let Claim::Acquired { fence: next_fence } = store.claim(&next).await.unwrap() else {
        panic!("the released key was not free");
    };
    assert!(next_fence > fence);
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(
        !store.complete(&k, &stuck.token, &done).await.unwrap(),
        "the stuck owner's completion went through"
    );
    assert!(store.complete(&k, &next.token, &done).await.unwrap());
    assert_eq!(
        admin.force_release(&k, next_fence).await.unwrap(),
        AdminOutcome::WrongState {
            state: RecordState::Completed
        }
    );
}

/// A key held after a failure (`on_error = hold`) is seen as held; `unhold` lets the next
/// delivery run the handler, once. A completed record that is not held, a missing key, and a
/// stale token are left alone.
pub async fn an_operator_unholds_a_held_key(b: impl Backend) {
    let store = b.store();
    let admin = Admin::new(store.clone());
    let k = key(&unique_prefix(&b, "admin-held"), &[&"pay-2"]);
    assert_eq!(admin.unhold(&k).await.unwrap(), AdminOutcome::Missing);
    let failed: Result<(), TestError> = guard(&store)
        .operation(k.clone())
        .on_error(|_| OnError::Hold)
        .run(async { Err(TestError::Business("unknown outcome".into())) })
        .await;
    assert!(matches!(failed, Err(TestError::Business(_))));
    let seen = admin.inspect(&k).await.unwrap().expect("a record");
    assert_eq!(seen.state, RecordState::Completed);
    assert!(seen.held, "{seen:?}");
    assert!(seen.result_size.is_some());

    // A stale token never reopens a record.
    assert!(!store.reopen(&k, &Token::generate()).await.unwrap());
    let AdminOutcome::Done { fence } = admin.unhold(&k).await.unwrap() else {
        panic!("not unheld");
    };
    assert_eq!(fence, seen.fence);
    assert_eq!(
        admin.inspect(&k).await.unwrap().map(|i| i.state),
        Some(RecordState::Released)
    );
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let out: Result<(), TestError> = guard(&store)
            .run(k.clone(), async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await;
        assert!(matches!(
            out,
            Ok(()) | Err(TestError::Idem(Error::Duplicate { .. }))
        ));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(admin.inspect(&k).await.unwrap().unwrap().fence > fence);
    // Completed, not held: left alone.
    assert_eq!(
        admin.unhold(&k).await.unwrap(),
        AdminOutcome::WrongState {
            state: RecordState::Completed
        }
    );
}
