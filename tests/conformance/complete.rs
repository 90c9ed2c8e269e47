//! Conformance cases for rule 3: complete is compare-and-set on the token.

use std::time::Duration;

use idempotency::store::{AcquiredClaim, Claim, Completion, Fingerprint, RecordState, Token};

use super::{key, req, unique_prefix, Backend};

pub async fn complete_and_renew_check_the_token(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "cas"), &[&"x"]);
    let owner = req(&k, Duration::from_secs(30));
    store.claim(&owner).await.unwrap();
    let stranger = Token::generate();
    let done = Completion::new(Some(b"r".to_vec()), Duration::from_secs(60));
    assert!(!store.complete(&k, &stranger, &done).await.unwrap());
    assert!(!store
        .renew(&k, &stranger, Duration::from_secs(30))
        .await
        .unwrap());
    assert!(store
        .renew(&k, &owner.token, Duration::from_secs(30))
        .await
        .unwrap());
    assert!(store.complete(&k, &owner.token, &done).await.unwrap());
    // A retried completion by the same owner is harmless.
    assert!(store.complete(&k, &owner.token, &done).await.unwrap());
    // A completed record cannot be released or renewed.
    assert!(!store.release(&k, &owner.token).await.unwrap());
    assert!(!store
        .renew(&k, &owner.token, Duration::from_secs(30))
        .await
        .unwrap());
    let record = store.read(&k).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.result.as_deref(), Some(&b"r"[..]));
}

/// A completion that names its claim (as the engine's do) answers what the token alone
/// decides, whatever the named fence, fingerprint or lease: the claim it names is a hint a
/// store may use to recognise the record, never a second condition.
pub async fn a_completion_naming_its_claim_is_decided_by_the_token(b: impl Backend) {
    let store = b.store();
    let prefix = unique_prefix(&b, "named");
    let minute = Duration::from_secs(60);
    let lease = Duration::from_secs(30);
    let fp = Fingerprint::of(&[&"EUR", &1250u64]);
    for (case, fingerprint, leased) in [
        ("plain", None, false),
        ("fingerprinted", Some(fp), false),
        ("plain-leased", None, true),
        ("fingerprinted-leased", Some(fp), true),
    ] {
        let k = key(&prefix, &[&case]);
        let mut owner = req(&k, lease);
        owner.fingerprint = fingerprint;
        let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
            panic!("{case}: a fresh key is acquired");
        };
        let named_with = |fence, fingerprint, lease: Duration| {
            let claim = AcquiredClaim::new(fence, fingerprint);
            Completion::new(Some(b"r".to_vec()), minute).for_claim(if leased {
                claim.with_lease(lease)
            } else {
                claim
            })
        };
        let named = |fence, fingerprint| named_with(fence, fingerprint, lease);
        // A stranger naming the owner's claim exactly is still a stranger.
        assert!(!store
            .complete(&k, &Token::generate(), &named(fence, fingerprint))
            .await
            .unwrap());
        // The owner naming a wrong fence, fingerprint or lease completes by its token.
        let wrong = match (fingerprint, leased) {
            (None, false) => named(fence + 1, None),
            (Some(_), false) => named(fence, Some(Fingerprint::of(&[&"other"]))),
            (_, true) => named_with(fence, fingerprint, lease * 2),
        };
        assert!(
            store.complete(&k, &owner.token, &wrong).await.unwrap(),
            "{case}"
        );
        // A retry naming the claim exactly: already completed, harmless.
        assert!(store
            .complete(&k, &owner.token, &named(fence, fingerprint))
            .await
            .unwrap());
        let record = store.read(&k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{case}");
        assert_eq!(
            record.fence, fence,
            "{case}: the record's own fence is kept"
        );
        assert_eq!(
            record.fingerprint, fingerprint,
            "{case}: the claim's fingerprint is kept"
        );
        assert_eq!(record.result.as_deref(), Some(&b"r"[..]));
        assert!(!store.release(&k, &owner.token).await.unwrap());

        // The common case: the owner names its claim exactly, the record is completed with
        // the claim's fence and fingerprint, and duplicates replay the result.
        // Named with its lease, not renewed: what a store may have written for the claim.
        let k = key(&prefix, &[&case, &"exact"]);
        let mut owner = req(&k, lease);
        owner.fingerprint = fingerprint;
        let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
            panic!("{case}: a fresh key is acquired");
        };
        if !leased {
            assert!(store.renew(&k, &owner.token, lease).await.unwrap());
        }
        assert!(store
            .complete(&k, &owner.token, &named(fence, fingerprint))
            .await
            .unwrap());
        let record = store.read(&k).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{case}");
        assert_eq!((record.fence, record.fingerprint), (fence, fingerprint));
        let mut again = req(&k, Duration::from_secs(30));
        again.fingerprint = fingerprint;
        match store.claim(&again).await.unwrap() {
            // (A tiered store answers a duplicate from its front, with the front's fence.)
            Claim::Completed { result, .. } => {
                assert_eq!(result.as_deref(), Some(&b"r"[..]), "{case}");
            }
            other => panic!("{case}: a duplicate of a completed claim got {other:?}"),
        }
    }
}

pub async fn completing_a_missing_record_is_refused(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "missing"), &[&"x"]);
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(!store.complete(&k, &Token::generate(), &done).await.unwrap());
    assert!(store.read(&k).await.unwrap().is_none());
}
