//! Cases every SQL store must pass beyond the conformance suite, written once: the
//! business-transaction API, batched expiry and the purger task, exact-byte keys. Each SQL
//! test file implements [`Harness`] (the few statements whose text differs per database) and
//! calls these.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotent::sql::sqlx::{self, Database};
use idempotent::sql::{Dialect, SqlStore};
use idempotent::{
    BoxFuture, Claim, ClaimRequest, Completion, Error, Fingerprint, Key, RecordState, Store, Token,
};

/// The statements of the cases whose SQL differs per database.
pub trait Harness: Send + Sync + 'static {
    type Db: Dialect;
    /// Rows in `table`.
    fn count<'a>(store: &'a SqlStore<Self::Db>, table: &'a str) -> BoxFuture<'a, i64>;
    /// Creates the business table `table (payment, amount)`.
    fn create_payments<'a>(store: &'a SqlStore<Self::Db>, table: &'a str) -> BoxFuture<'a, ()>;
    /// Inserts one payment row on `conn`.
    fn insert_payment<'c>(
        conn: &'c mut <Self::Db as Database>::Connection,
        table: &'c str,
        payment: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;
    /// Starts counting the claim statements sent on the store's table, where the database
    /// can count them (PostgreSQL: a statement-level trigger).
    fn count_claim_statements<'a>(_store: &'a SqlStore<Self::Db>) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
    /// The claim statements counted so far, or `None` where they are not counted.
    fn claim_statements<'a>(_store: &'a SqlStore<Self::Db>) -> BoxFuture<'a, Option<i64>> {
        Box::pin(async { None })
    }
}

/// The error of the business code in the transactional cases.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

pub fn req(key: &Key, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        key: key.clone(),
        token: Token::generate(),
        lease,
        ttl,
        fingerprint: None,
    }
}

/// Captures `payment` inside `tx`: the business write and the idempotency record together.
async fn capture<H: Harness>(
    store: &SqlStore<H::Db>,
    tx: &mut sqlx::Transaction<'_, H::Db>,
    payments: &str,
    payment: &str,
    runs: &AtomicUsize,
) -> Result<(), AppError> {
    let key = Key::new("payment:capture", 1, &[&payment]).unwrap();
    store
        .run_in_tx(tx, key, Duration::from_secs(3600), async |conn| {
            runs.fetch_add(1, Ordering::SeqCst);
            H::insert_payment(conn, payments, payment).await?;
            Ok(())
        })
        .await
}

/// A rolled-back business transaction leaves the key claimable; a committed one makes the
/// next call a duplicate that does not run.
pub async fn business_transaction_commits_or_rolls_back_with_its_record<H: Harness>(
    store: &SqlStore<H::Db>,
    payments: &str,
) {
    H::create_payments(store, payments).await;
    let key = Key::new("payment:capture", 1, &[&"pay-1"]).unwrap();
    let runs = AtomicUsize::new(0);

    let mut tx = store.pool().begin().await.unwrap();
    capture::<H>(store, &mut tx, payments, "pay-1", &runs)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(H::count(store, payments).await, 0);
    assert!(store.read(&key).await.unwrap().is_none());

    let mut tx = store.pool().begin().await.unwrap();
    capture::<H>(store, &mut tx, payments, "pay-1", &runs)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(H::count(store, payments).await, 1);
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!((record.state, record.fence), (RecordState::Completed, 1));

    let mut tx = store.pool().begin().await.unwrap();
    match capture::<H>(store, &mut tx, payments, "pay-1", &runs).await {
        Err(AppError::Idem(Error::Duplicate { .. })) => {}
        other => panic!("expected a duplicate, got {other:?}"),
    }
    tx.rollback().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(H::count(store, payments).await, 1);
}

/// A second transaction on the same key waits for the first: after its commit it is a
/// duplicate, after its rollback it runs.
pub async fn concurrent_transactions_on_one_key_wait_for_the_first<H: Harness>(
    store: &SqlStore<H::Db>,
    payments: &str,
) {
    H::create_payments(store, payments).await;
    let runs = Arc::new(AtomicUsize::new(0));
    for (payment, first_commits) in [("pay-2", true), ("pay-3", false)] {
        let mut first = store.pool().begin().await.unwrap();
        capture::<H>(store, &mut first, payments, payment, &runs)
            .await
            .unwrap();
        let second = {
            let (store, runs, payments) = (store.clone(), runs.clone(), payments.to_string());
            tokio::spawn(async move {
                let mut tx = store.pool().begin().await.unwrap();
                let out = capture::<H>(&store, &mut tx, &payments, payment, &runs).await;
                if out.is_ok() {
                    tx.commit().await.unwrap();
                }
                out
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!second.is_finished(), "the duplicate did not wait");
        if first_commits {
            first.commit().await.unwrap();
            match second.await.unwrap() {
                Err(AppError::Idem(Error::Duplicate { .. })) => {}
                other => panic!("expected a duplicate, got {other:?}"),
            }
        } else {
            first.rollback().await.unwrap();
            second.await.unwrap().unwrap();
        }
    }
    // pay-2 ran once (its duplicate waited and was filtered); pay-3 ran twice (the first run
    // was rolled back) and was applied once.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(H::count(store, payments).await, 2);
}

/// `purge_expired` deletes exactly the expired records (in-progress, completed, released),
/// in batches, and nothing live.
pub async fn expired_records_are_purged_in_batches<H: Harness>(store: &SqlStore<H::Db>) {
    let short = Duration::from_millis(500);
    for i in 0..250u32 {
        let key = Key::new("purge", 1, &[&i]).unwrap();
        let r = req(&key, short, short);
        assert!(matches!(
            store.claim(&r).await.unwrap(),
            Claim::Acquired { .. }
        ));
        match i % 3 {
            0 => {
                let done = Completion {
                    result: Some(b"r".to_vec()),
                    ttl: short,
                };
                assert!(store.complete(&key, &r.token, &done).await.unwrap());
            }
            1 => assert!(store.release(&key, &r.token).await.unwrap()),
            _ => {}
        }
    }
    let hour = Duration::from_secs(3600);
    for i in 0..10u32 {
        let key = Key::new("keep", 1, &[&i]).unwrap();
        store.claim(&req(&key, hour, hour)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(H::count(store, store.table()).await, 260);
    assert_eq!(store.purge_expired(100).await.unwrap(), 250);
    assert_eq!(H::count(store, store.table()).await, 10);
    assert_eq!(store.purge_expired(100).await.unwrap(), 0);
    for i in 0..10u32 {
        let key = Key::new("keep", 1, &[&i]).unwrap();
        assert!(store.read(&key).await.unwrap().is_some());
    }
}

/// The purger task deletes expired records every interval, and stops when dropped.
pub async fn purger_task_purges_until_dropped<H: Harness>(store: &SqlStore<H::Db>) {
    let short = Duration::from_millis(300);
    let claim_many = |prefix: &'static str, n: u32, ttl: Duration| async move {
        for i in 0..n {
            let key = Key::new(prefix, 1, &[&i]).unwrap();
            store.claim(&req(&key, ttl, ttl)).await.unwrap();
        }
    };
    let purger = store.spawn_purger(Duration::from_millis(100), 50);
    claim_many("expiring", 120, short).await;
    claim_many("live", 5, Duration::from_secs(3600)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = H::count(store, store.table()).await;
        if left == 5 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the purger left {left} rows"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(purger);
    claim_many("after", 30, short).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(H::count(store, store.table()).await, 35);
}

/// Keys that differ only in case, trailing spaces or invalid UTF-8 are different records.
pub async fn keys_are_exact_bytes<H: Harness>(store: &SqlStore<H::Db>) {
    let parts: [&[u8]; 7] = [
        b"Order-1",
        b"order-1",
        b"ORDER-1",
        b"order-1 ",
        b"order-\xc3\xa9",
        &[0xff, 0xfe, 0x00],
        &[0xff, 0xfe],
    ];
    for part in parts {
        let key = Key::new("exact", 1, &[&part]).unwrap();
        let claim = store
            .claim(&req(&key, Duration::from_secs(30), Duration::from_secs(60)))
            .await
            .unwrap();
        assert_eq!(claim, Claim::Acquired { fence: 1 }, "{part:?}");
    }
    assert_eq!(H::count(store, store.table()).await, 7);
}

/// A claim sent again with the same token (a retry after a lost reply) finds its own record:
/// acquired, with the same fence, never a duplicate of itself.
pub async fn claim_sent_again_with_its_token_is_acquired<H: Harness>(store: &SqlStore<H::Db>) {
    let key = Key::new("again", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired { fence: 1 });
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired { fence: 1 });
    let other = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    assert_eq!(
        store.claim(&other).await.unwrap(),
        Claim::InProgress { fence: 1 }
    );
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!((record.token, record.fence), (r.token, 1));
}

/// Sets up one key per case under `prefix` and returns the requests of the batch, in order:
/// a new key twice (two tokens), a completed key, a live foreign claim, a claim whose lease
/// ran out, an expired record, a released key, a fingerprint mismatch, and a retry by the
/// token that holds the live claim. Leaves 300 ms for the short leases to run out.
async fn batch_cases(store: &impl Store, prefix: &str) -> Vec<ClaimRequest> {
    let hour = Duration::from_secs(3600);
    let short = Duration::from_millis(200);
    let key = |case: &str| Key::new(prefix, 1, &[&case]).unwrap();
    let fp = |n: u8| Some(Fingerprint::of(&[&n]));
    let completion = Completion {
        result: Some(b"done".to_vec()),
        ttl: hour,
    };

    let completed = req(&key("completed"), hour, hour);
    assert_eq!(
        store.claim(&completed).await.unwrap(),
        Claim::Acquired { fence: 1 }
    );
    assert!(store
        .complete(&completed.key, &completed.token, &completion)
        .await
        .unwrap());
    let live = req(&key("live"), hour, hour);
    store.claim(&live).await.unwrap();
    let lapsed = req(&key("lapsed"), short, hour);
    store.claim(&lapsed).await.unwrap();
    let expired = req(&key("expired"), short, short);
    store.claim(&expired).await.unwrap();
    let released = req(&key("released"), hour, hour);
    store.claim(&released).await.unwrap();
    assert!(store.release(&released.key, &released.token).await.unwrap());
    let mismatch = ClaimRequest {
        fingerprint: fp(1),
        ..req(&key("mismatch"), hour, hour)
    };
    store.claim(&mismatch).await.unwrap();
    assert!(store
        .complete(&mismatch.key, &mismatch.token, &completion)
        .await
        .unwrap());
    let own = req(&key("own"), hour, hour);
    store.claim(&own).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    vec![
        req(&key("new"), hour, hour),
        req(&key("completed"), hour, hour),
        req(&key("new"), hour, hour),
        req(&key("live"), hour, hour),
        req(&key("lapsed"), hour, hour),
        req(&key("expired"), hour, hour),
        req(&key("released"), hour, hour),
        ClaimRequest {
            fingerprint: fp(2),
            ..req(&key("mismatch"), hour, hour)
        },
        own,
    ]
}

/// A batch with a duplicated key, a completed key, a live foreign claim, a run-out lease
/// (taken over: fence + 1), an expired record (fence 1 again), a released key (fence + 1),
/// a fingerprint mismatch and a retry by the owner's token gets exactly the answers the same
/// claims sent one by one get; where the database counts statements, the batch is one claim
/// statement, plus one single claim for the key's second occurrence. A batch of 1001 new keys
/// is acquired whole, in three statements.
pub async fn batch_answers_as_single_claims_would<H: Harness>(store: &SqlStore<H::Db>) {
    let singles = batch_cases(store, "single").await;
    let batch = batch_cases(store, "batch").await;
    let mut one_by_one = Vec::new();
    for r in &singles {
        one_by_one.push(store.claim(r).await.unwrap());
    }
    H::count_claim_statements(store).await;
    let before = H::claim_statements(store).await;
    let batched: Vec<Claim> = store
        .claim_many(&batch)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let after = H::claim_statements(store).await;

    let expected = vec![
        Claim::Acquired { fence: 1 },
        Claim::Completed {
            fence: 1,
            result: Some(b"done".to_vec()),
        },
        Claim::InProgress { fence: 1 },
        Claim::InProgress { fence: 1 },
        Claim::Acquired { fence: 2 },
        Claim::Acquired { fence: 1 },
        Claim::Acquired { fence: 2 },
        Claim::Mismatch { fence: 1 },
        Claim::Acquired { fence: 1 },
    ];
    assert_eq!(one_by_one, expected);
    assert_eq!(batched, expected);
    for (r, claim) in batch.iter().zip(&batched) {
        if let Claim::Acquired { fence } = claim {
            let record = store.read(&r.key).await.unwrap().unwrap();
            assert_eq!((record.token, record.fence), (r.token, *fence));
        }
    }
    if let (Some(before), Some(after)) = (before, after) {
        assert_eq!(after - before, 2, "claim statements sent for the batch");
    }

    // A batch larger than one statement takes (500 keys) is claimed in chunks.
    let hour = Duration::from_secs(3600);
    let many: Vec<ClaimRequest> = (0..1001u32)
        .map(|i| req(&Key::new("many", 1, &[&i]).unwrap(), hour, hour))
        .collect();
    let before = H::claim_statements(store).await;
    for claim in store.claim_many(&many).await {
        assert_eq!(claim.unwrap(), Claim::Acquired { fence: 1 });
    }
    let after = H::claim_statements(store).await;
    if let (Some(before), Some(after)) = (before, after) {
        assert_eq!(after - before, 3, "claim statements sent for 1001 keys");
    }
}
