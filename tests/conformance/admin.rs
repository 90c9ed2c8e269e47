//! Conformance cases for the operator's API (`admin::Admin`): inspecting a record, listing a
//! prefix's records by state and age, freeing a stuck owner's key with the fence it was seen
//! with, letting a held key run again, deleting a record, purging a prefix. Every action
//! leaves a record that changed since the operator looked at it alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotency::admin::{Admin, AdminOutcome, Inspection, ListQuery, StateFilter};
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Expect, OperatorStore, Record, RecordState,
    ScanCursor, ScanPage, SharedOperatorStore, Store, StoreError, Token,
};
use idempotency::{Error, Key, OnError};

use super::{eventually, guard, key, req, unique_prefix, OperatorBackend, TestError};

/// A stuck owner (a crashed process with a long lease) is seen in progress; `force_release`
/// with another fence changes nothing; with its fence the key is free at once: the next
/// claim acquires with a higher fence and the stuck owner's completion is refused. Missing
/// keys and completed records are reported as such.
pub async fn an_operator_frees_a_stuck_key_with_its_fence(b: impl OperatorBackend) {
    let store = b.operator_store();
    let admin = Admin::new(store.clone());
    let k = key(&unique_prefix(&b, "admin-stuck"), &[&"pay-1"]);
    assert_eq!(admin.inspect(&k).await.unwrap(), None);
    assert_eq!(
        admin.force_release(&k, 1).await.unwrap(),
        AdminOutcome::Missing
    );

    let stuck = req(&k, Duration::from_secs(60))
        .with_fingerprint(idempotency::store::Fingerprint::of(&[&"payload"]));
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
pub async fn an_operator_unholds_a_held_key(b: impl OperatorBackend) {
    let store = b.operator_store();
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

/// Every record of a listing, paged until the scan ends: the keys (a store may return a key
/// twice: each is kept once) with what was seen of them. The first pages examine two keys
/// each, so that a scan goes on from its cursor many times; then a thousand, since a Redis
/// scan examines the whole server, which other tests share.
async fn list_all(
    admin: &Admin,
    query: ListQuery,
) -> std::collections::BTreeMap<Key, Result<Inspection, idempotency::store::StoreError>> {
    let mut found = std::collections::BTreeMap::new();
    let mut query = query.limit(2);
    for page_number in 0..100_000 {
        if page_number == 50 {
            query = query.limit(1_000);
        }
        let page = admin.list(&query).await.unwrap();
        found.extend(page.records);
        match page.next {
            Some(next) => query = query.cursor(next),
            None => return found,
        }
    }
    panic!("the listing never ended");
}

/// A listing pages through exactly the records of its prefix (not those of a longer prefix
/// that starts the same, nor of another), whatever the page size, and filters them by state
/// and by how long they have been in it; an inspection shows the time to expiry.
pub async fn an_operator_lists_the_records_of_a_prefix(b: impl OperatorBackend) {
    let store = b.operator_store();
    let admin = Admin::new(store.clone());
    let prefix = unique_prefix(&b, "admin-list");
    let hour = Duration::from_secs(3600);
    let claim = |k: &Key| {
        let store = store.clone();
        let k = k.clone();
        async move {
            let owner = ClaimRequest::new(k.clone(), Token::generate(), hour, hour);
            let Claim::Acquired { .. } = store.claim(&owner).await.unwrap() else {
                panic!("{k} not acquired");
            };
            owner
        }
    };
    // The oldest claim, well before the others.
    let old = key(&prefix, &[&"old"]);
    claim(&old).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let mut in_progress = vec![old.clone()];
    for i in 0..2u32 {
        let k = key(&prefix, &[&"live", &i]);
        claim(&k).await;
        in_progress.push(k);
    }
    let mut completed = Vec::new();
    for i in 0..3u32 {
        let k = key(&prefix, &[&"done", &i]);
        let owner = claim(&k).await;
        let done = Completion::new(Some(b"receipt".to_vec()), hour);
        assert!(store.complete(&k, &owner.token, &done).await.unwrap());
        completed.push(k);
    }
    let released = key(&prefix, &[&"released"]);
    let owner = claim(&released).await;
    assert!(store.release(&released, &owner.token).await.unwrap());
    let held = key(&prefix, &[&"held"]);
    let failed: Result<(), TestError> = guard(&store)
        .operation(held.clone())
        .on_error(|_| OnError::Hold)
        .run(async { Err(TestError::Business("unknown outcome".into())) })
        .await;
    assert!(failed.is_err());
    // Records of other prefixes: one that starts like this one's keys, one nested under it.
    let lookalike = key(&format!("{prefix}:vx"), &[&"other"]);
    let nested = key(&format!("{prefix}:nested"), &[&"other"]);
    claim(&lookalike).await;
    claim(&nested).await;

    let all = list_all(&admin, ListQuery::new(&prefix).unwrap()).await;
    let mut want: Vec<Key> = in_progress.iter().chain(&completed).cloned().collect();
    want.extend([released.clone(), held.clone()]);
    want.sort();
    assert_eq!(all.keys().cloned().collect::<Vec<_>>(), want);
    for (k, seen) in &all {
        let seen = seen.as_ref().unwrap();
        let expires_in = seen.expires_in.expect("the time to expiry");
        // The held record was written by the engine, with its ttl of a minute.
        let ttl = if *k == held {
            Duration::from_secs(60)
        } else {
            hour
        };
        assert!(
            expires_in <= ttl && expires_in > ttl - Duration::from_secs(30),
            "{k}: {seen:?}"
        );
    }

    let states = |filter| {
        let admin = admin.clone();
        let query = ListQuery::new(&prefix).unwrap().state(filter);
        async move {
            list_all(&admin, query)
                .await
                .into_keys()
                .collect::<Vec<_>>()
        }
    };
    let sorted = |mut keys: Vec<Key>| {
        keys.sort();
        keys
    };
    assert_eq!(
        states(StateFilter::InProgress).await,
        sorted(in_progress.clone())
    );
    let mut done_or_held = completed.clone();
    done_or_held.push(held.clone());
    assert_eq!(states(StateFilter::Completed).await, sorted(done_or_held));
    assert_eq!(states(StateFilter::Held).await, vec![held.clone()]);
    assert_eq!(states(StateFilter::Released).await, vec![released.clone()]);
    assert!(states(StateFilter::Corrupt).await.is_empty());

    // Every store keeps the age of an in-progress record: the oldest claim is the only one
    // claimed over a second ago, and nothing has been in progress for an hour.
    let stuck = |age| {
        let admin = admin.clone();
        let query = ListQuery::new(&prefix)
            .unwrap()
            .state(StateFilter::InProgress)
            .older_than(age);
        async move { list_all(&admin, query).await }
    };
    let over_a_second = stuck(Duration::from_secs(1)).await;
    assert!(over_a_second.contains_key(&old), "{over_a_second:?}");
    let ages: Vec<Duration> = all
        .iter()
        .filter(|(k, _)| in_progress.contains(k))
        .map(|(_, seen)| {
            seen.as_ref()
                .unwrap()
                .age
                .expect("an in-progress record's age")
        })
        .collect();
    let oldest = all[&old].as_ref().unwrap().age.unwrap();
    assert!(ages.iter().all(|&age| age <= oldest), "{ages:?}");
    assert!(stuck(hour).await.is_empty());

    // A cursor of another kind of store, or none at all, is refused.
    let bad = ListQuery::new(&prefix)
        .unwrap()
        .cursor("not-a-cursor:zz".parse().unwrap());
    assert!(admin.list(&bad).await.is_err());
}

/// `delete` removes a record so the key runs again, once; it refuses a live claim (whose
/// owner may still be running) and leaves a record whose token changed. `purge` deletes a
/// prefix's records but its live claims, and nothing of another prefix.
pub async fn an_operator_deletes_records_and_purges_a_prefix(b: impl OperatorBackend) {
    let store = b.operator_store();
    let admin = Admin::new(store.clone());
    let prefix = unique_prefix(&b, "admin-delete");
    let hour = Duration::from_secs(3600);
    let k = key(&prefix, &[&"coupon-1"]);
    assert_eq!(admin.delete(&k).await.unwrap(), AdminOutcome::Missing);

    let runs = AtomicUsize::new(0);
    let idem = guard(&store);
    let run = || {
        idem.run(k.clone(), async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, TestError>(())
        })
    };
    run().await.unwrap();
    assert!(matches!(
        run().await,
        Err(TestError::Idem(Error::Duplicate { .. }))
    ));
    let fence = admin.inspect(&k).await.unwrap().unwrap().fence;
    // A token that is not the record's deletes nothing, nor does a readable record count as
    // corrupt.
    assert!(!store
        .delete(&k, Expect::Token(&Token::generate()))
        .await
        .unwrap());
    assert!(!store.delete(&k, Expect::Corrupt).await.unwrap());
    assert!(admin.inspect(&k).await.unwrap().is_some());
    assert_eq!(
        admin.delete(&k).await.unwrap(),
        AdminOutcome::Done { fence }
    );
    assert_eq!(admin.inspect(&k).await.unwrap(), None);
    run().await.unwrap();
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the deleted key ran exactly once more"
    );

    // A live claim is refused; once force-released, it can be deleted.
    let live = key(&prefix, &[&"live"]);
    let owner = ClaimRequest::new(live.clone(), Token::generate(), hour, hour);
    let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
        panic!("not acquired");
    };
    assert!(matches!(
        admin.delete(&live).await.unwrap(),
        AdminOutcome::WrongState {
            state: RecordState::InProgress { .. }
        }
    ));
    assert_eq!(
        admin.force_release(&live, fence).await.unwrap(),
        AdminOutcome::Done { fence }
    );
    assert_eq!(
        admin.delete(&live).await.unwrap(),
        AdminOutcome::Done { fence }
    );
    let done = Completion::new(None, hour);
    assert!(
        !store.complete(&live, &owner.token, &done).await.unwrap(),
        "the deleted owner's completion went through"
    );

    // Purge: everything of the prefix but its live claims; another prefix untouched.
    let purged = unique_prefix(&b, "admin-purge");
    let mut live_claims = Vec::new();
    for i in 0..7u32 {
        let k = key(&purged, &[&i]);
        let owner = ClaimRequest::new(k.clone(), Token::generate(), hour, hour);
        assert!(matches!(
            store.claim(&owner).await.unwrap(),
            Claim::Acquired { .. }
        ));
        match i {
            0..=3 => assert!(store.complete(&k, &owner.token, &done).await.unwrap()),
            4 => assert!(store.release(&k, &owner.token).await.unwrap()),
            _ => live_claims.push(k),
        }
    }
    let other = key(&format!("{purged}:other"), &[&"kept"]);
    let owner = ClaimRequest::new(other.clone(), Token::generate(), hour, hour);
    store.claim(&owner).await.unwrap();
    assert!(store.complete(&other, &owner.token, &done).await.unwrap());

    let report = admin.purge(&purged).await.unwrap();
    assert_eq!(
        (
            report.deleted,
            report.live_claims_kept,
            report.corrupt_deleted,
            report.changed
        ),
        (5, 2, 0, 0),
        "{report:?}"
    );
    let left = list_all(&admin, ListQuery::new(&purged).unwrap()).await;
    assert_eq!(left.into_keys().collect::<Vec<_>>(), live_claims);
    assert!(admin.inspect(&other).await.unwrap().is_some());
    assert_eq!(admin.purge(&purged).await.unwrap().deleted, 0);
    assert!(admin.purge("has space").await.is_err());
}

/// A store that, once armed, renews one owner's claim right after it answers the operator's
/// `read` or `scan`: the owner that stalled past its lease resumes exactly between the
/// operator's look and its write. No real store can be made to interleave there on demand.
struct RenewsAfterLook {
    inner: SharedOperatorStore,
    owner: std::sync::Mutex<Option<(Key, Token)>>,
}

impl RenewsAfterLook {
    fn arm(&self, key: &Key, token: &Token) {
        *self.owner.lock().unwrap() = Some((key.clone(), *token));
    }

    async fn owner_resumes(&self) {
        let owner = self.owner.lock().unwrap().take();
        if let Some((key, token)) = owner {
            let renewed = self.inner.renew(&key, &token, Duration::from_secs(3600));
            assert!(renewed.await.unwrap(), "the stalled owner could not renew");
        }
    }
}

impl Store for RenewsAfterLook {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        self.inner.claim(req)
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let seen = self.inner.read(key).await;
            self.owner_resumes().await;
            seen
        })
    }
}

impl OperatorStore for RenewsAfterLook {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.reopen(key, token)
    }
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        Box::pin(async move {
            let page = self.inner.scan(prefix, cursor, limit).await;
            self.owner_resumes().await;
            page
        })
    }
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.delete(key, expect)
    }
}

/// An owner whose lease ran out is stalled, not necessarily dead: if it resumes and renews
/// after the operator read its record, the delete (and the purge) must still leave its claim
/// alone, because the store checks the lease at the moment of the write. Otherwise a second
/// owner acquires the key while the first one runs, and the effect happens twice.
pub async fn an_operator_never_deletes_a_claim_renewed_after_the_read(b: impl OperatorBackend) {
    let store = b.operator_store();
    let prefix = unique_prefix(&b, "admin-renewed");
    let hour = Duration::from_secs(3600);
    let brief = Duration::from_millis(50);
    let stalled = |k: &Key| ClaimRequest::new(k.clone(), Token::generate(), brief, hour);
    let lease_ran_out = |r: &Option<Record>| matches!(r, Some(r) if r.state == RecordState::InProgress { lease_left: Duration::ZERO });
    let done = Completion::new(None, hour);

    // The store's own delete, after the owner renewed a lease that had run out.
    let k = key(&prefix, &[&"store"]);
    let owner = stalled(&k);
    assert!(matches!(
        store.claim(&owner).await.unwrap(),
        Claim::Acquired { .. }
    ));
    eventually(&store, &k, lease_ran_out).await;
    assert!(store.renew(&k, &owner.token, hour).await.unwrap());
    assert!(
        !store.delete(&k, Expect::Token(&owner.token)).await.unwrap(),
        "the store deleted a live claim"
    );
    assert!(matches!(
        store.claim(&req(&k, hour)).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert!(store.complete(&k, &owner.token, &done).await.unwrap());

    // `delete` and `purge`, with the owner renewing between the operator's read and write.
    let resuming = std::sync::Arc::new(RenewsAfterLook {
        inner: store.clone(),
        owner: std::sync::Mutex::new(None),
    });
    let admin = Admin::new(resuming.clone());
    let k = key(&prefix, &[&"delete"]);
    let owner = stalled(&k);
    let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
        panic!("not acquired");
    };
    eventually(&store, &k, lease_ran_out).await;
    resuming.arm(&k, &owner.token);
    assert!(matches!(
        admin.delete(&k).await.unwrap(),
        AdminOutcome::WrongState {
            state: RecordState::InProgress { .. }
        }
    ));
    assert!(matches!(
        store.claim(&req(&k, hour)).await.unwrap(),
        Claim::InProgress { fence: f } if !b.answers_carry_the_owners_fence() || f == fence
    ));
    assert!(
        store.complete(&k, &owner.token, &done).await.unwrap(),
        "the resumed owner lost its claim to the delete"
    );

    let purged = format!("{prefix}:purge");
    let k = key(&purged, &[&"owner"]);
    let owner = stalled(&k);
    assert!(matches!(
        store.claim(&owner).await.unwrap(),
        Claim::Acquired { .. }
    ));
    eventually(&store, &k, lease_ran_out).await;
    resuming.arm(&k, &owner.token);
    let report = admin.purge(&purged).await.unwrap();
    assert_eq!(
        (report.deleted, report.live_claims_kept, report.changed),
        (0, 1, 0),
        "{report:?}"
    );
    assert!(matches!(
        store.claim(&req(&k, hour)).await.unwrap(),
        Claim::InProgress { .. }
    ));
    assert!(
        store.complete(&k, &owner.token, &done).await.unwrap(),
        "the resumed owner lost its claim to the purge"
    );
}
