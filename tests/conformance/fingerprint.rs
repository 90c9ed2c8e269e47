//! Conformance cases for rule 7: a duplicate key with a different payload is refused.

use std::time::Duration;

use idempotency::store::Claim;
use idempotency::Error;

use super::{assert_answer, guard, key, req, unique_prefix, Backend, TestError};

pub async fn payload_mismatch_is_refused(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fingerprint"), &[&"pay-3"]);
    let call = |amount: u64| {
        let (g, k) = (guard(&store), k.clone());
        async move {
            g.operation(k)
                .fingerprint(&[&"EUR", &amount])
                .replay()
                .run(async move { Ok::<_, TestError>(amount) })
                .await
        }
    };
    assert_eq!(call(1250).await.unwrap(), 1250);
    assert_eq!(call(1250).await.unwrap(), 1250);
    match call(9999).await {
        Err(TestError::Idem(err @ Error::PayloadMismatch { .. })) => {
            assert_eq!(err.action(), idempotency::Action::DeadLetter)
        }
        other => panic!("someone else's result was replayed: {other:?}"),
    }
}

pub async fn payload_mismatch_is_refused_while_in_progress(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "fingerprint-live"), &[&"pay-4"]);
    let mut first = req(&k, Duration::from_secs(30));
    first.fingerprint = Some(idempotency::store::Fingerprint::of(&[&1u8]));
    let Claim::Acquired { fence: f } = store.claim(&first).await.unwrap() else {
        panic!("a new key was not acquired")
    };
    let mut same = req(&k, Duration::from_secs(30));
    same.fingerprint = first.fingerprint;
    assert_answer(
        &b,
        store.claim(&same).await.unwrap(),
        Claim::InProgress { fence: f },
    );
    let mut other = req(&k, Duration::from_secs(30));
    other.fingerprint = Some(idempotency::store::Fingerprint::of(&[&2u8]));
    assert_answer(
        &b,
        store.claim(&other).await.unwrap(),
        Claim::Mismatch { fence: f },
    );
}
