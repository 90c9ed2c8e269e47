//! Conformance cases for rule 3: complete is compare-and-set on the token.

use std::time::Duration;

use idempotency::{Completion, RecordState, Token};

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

pub async fn completing_a_missing_record_is_refused(b: impl Backend) {
    let store = b.store();
    let k = key(&unique_prefix(&b, "missing"), &[&"x"]);
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(!store.complete(&k, &Token::generate(), &done).await.unwrap());
    assert!(store.read(&k).await.unwrap().is_none());
}
