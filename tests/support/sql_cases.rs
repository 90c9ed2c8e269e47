//! Cases every SQL store must pass beyond the conformance suite, written once: the
//! business-transaction API, batched expiry and the purger task, exact-byte keys, fences from
//! the database's clock, corrupt rows, refused results and the longest durations. Each SQL
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

use idempotency::admin::{Admin, AdminOutcome, ListQuery, StateFilter};
use idempotency::sql::sqlx::{self, Database};
use idempotency::sql::{Dialect, SqlStore};
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Expect, Fingerprint, OperatorStore,
    RecordState, Store, StoreError, StoreErrorKind, Token, MAX_DURATION,
};
use idempotency::{Error, Idempotency, Key, OnError};

/// A fence taken from the database's clock (microseconds since the Unix epoch) is above this:
/// September 2020.
pub const CLOCK_FENCE_FLOOR: u64 = 1_600_000_000_000_000;

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
    /// The `SET` assignments, in the database's SQL, that make a record row unreadable and
    /// that the database lets a row carry (once [`corrupt`](Harness::corrupt) has the `state`
    /// check out of the way).
    fn corruptions() -> &'static [&'static str];
    /// Writes `assignment` into the record row of `key` by hand, with the table's check on
    /// `state` out of the way.
    fn corrupt<'a>(
        store: &'a SqlStore<Self::Db>,
        key: &'a Key,
        assignment: &'a str,
    ) -> BoxFuture<'a, ()>;
    /// Makes the table refuse a stored result longer than 100 bytes (a constraint, or a
    /// smaller column), as a schema managed by hand might.
    fn limit_results<'a>(store: &'a SqlStore<Self::Db>) -> BoxFuture<'a, ()>;
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
    ClaimRequest::new(key.clone(), Token::generate(), lease, ttl)
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
    assert_eq!(record.state, RecordState::Completed);
    assert!(record.fence > CLOCK_FENCE_FLOOR, "{}", record.fence);

    let mut tx = store.pool().begin().await.unwrap();
    match capture::<H>(store, &mut tx, payments, "pay-1", &runs).await {
        Err(AppError::Idem(Error::Duplicate { .. })) => {}
        other => panic!("expected a duplicate, got {other:?}"),
    }
    tx.rollback().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(H::count(store, payments).await, 1);
}

/// `run_in_tx` refuses a ttl outside the supported range as the engine does
/// (`Error::InvalidDuration`), before it claims anything or runs the body.
pub async fn transaction_refuses_a_ttl_out_of_range<H: Harness>(store: &SqlStore<H::Db>) {
    let key = Key::new("payment:capture", 1, &[&"pay-range"]).unwrap();
    let runs = AtomicUsize::new(0);
    for ttl in [
        Duration::ZERO,
        MAX_DURATION + Duration::from_secs(1),
        Duration::MAX,
    ] {
        let mut tx = store.pool().begin().await.unwrap();
        let out = store
            .run_in_tx(&mut tx, key.clone(), ttl, async |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, AppError>(())
            })
            .await;
        match out {
            Err(AppError::Idem(Error::InvalidDuration {
                setting: "ttl",
                value,
            })) => {
                assert_eq!(value, ttl);
            }
            other => panic!("expected an invalid duration, got {other:?}"),
        }
        tx.rollback().await.unwrap();
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(store.read(&key).await.unwrap().is_none());
}

/// `run_in_tx` answers a key the engine left as a single call would: held -> `Held`,
/// claimed by a live owner outside the transaction -> `InProgress` with that owner's fence,
/// completed with a replayable result -> `Duplicate` (no replay in a transaction). The body
/// runs in none of them, and nothing is changed.
pub async fn transaction_answers_keys_as_the_engine_does<H: Harness>(store: Arc<SqlStore<H::Db>>) {
    let ttl = Duration::from_secs(3600);
    let engine = Idempotency::new(ttl).store(store.clone());
    let held = Key::new("payment:capture", 1, &[&"pay-held"]).unwrap();
    let live = Key::new("payment:capture", 1, &[&"pay-live"]).unwrap();
    let replayed = Key::new("payment:capture", 1, &[&"pay-replayed"]).unwrap();

    let failed: Result<(), AppError> = engine
        .operation(held.clone())
        .on_error(|_| OnError::Hold)
        .run(async { Err(AppError::Idem(Error::NoStore)) })
        .await;
    assert!(failed.is_err());
    let first: Result<u32, AppError> = engine
        .operation(replayed.clone())
        .replay()
        .run(async { Ok(5) })
        .await;
    assert_eq!(first.unwrap(), 5);
    let live_fence = match store
        .claim(&req(&live, Duration::from_secs(60), ttl))
        .await
        .unwrap()
    {
        Claim::Acquired { fence } => fence,
        other => panic!("expected the key, got {other:?}"),
    };

    let runs = AtomicUsize::new(0);
    for key in [&held, &live, &replayed] {
        // What a record is, without the lease left (which runs down meanwhile).
        let seen = async |key| {
            store.read(key).await.unwrap().map(|r| {
                let live = matches!(r.state, RecordState::InProgress { .. });
                (live, r.token, r.fence, r.result)
            })
        };
        let before = seen(key).await;
        let mut tx = store.pool().begin().await.unwrap();
        let out = store
            .run_in_tx(&mut tx, key.clone(), ttl, async |_| {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, AppError>(())
            })
            .await;
        tx.commit().await.unwrap();
        match (key, out) {
            (k, Err(AppError::Idem(Error::Held { key }))) if k == &held => assert_eq!(&key, k),
            (k, Err(AppError::Idem(Error::InProgress { key, fence }))) if k == &live => {
                assert_eq!(&key, k);
                assert_eq!(fence, live_fence);
            }
            (k, Err(AppError::Idem(Error::Duplicate { key }))) if k == &replayed => {
                assert_eq!(&key, k)
            }
            (k, other) => panic!("{k}: unexpected {other:?}"),
        }
        assert_eq!(seen(key).await, before, "{key} was changed");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
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
                let done = Completion::new(Some(b"r".to_vec()), short);
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
        assert!(
            matches!(claim, Claim::Acquired { .. }),
            "{part:?}: {claim:?}"
        );
    }
    assert_eq!(H::count(store, store.table()).await, 7);
}

/// A claim sent again with the same token (a retry after a lost reply) finds its own record:
/// acquired, with the same fence, never a duplicate of itself.
pub async fn claim_sent_again_with_its_token_is_acquired<H: Harness>(store: &SqlStore<H::Db>) {
    let key = Key::new("again", 1, &[&1u8]).unwrap();
    let r = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    let fence = acquired(store.claim(&r).await);
    assert_eq!(store.claim(&r).await.unwrap(), Claim::Acquired { fence });
    let other = req(&key, Duration::from_secs(30), Duration::from_secs(60));
    assert_eq!(
        store.claim(&other).await.unwrap(),
        Claim::InProgress { fence }
    );
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!((record.token, record.fence), (r.token, fence));
}

/// The fence of an acquisition; panics on any other outcome.
pub fn acquired(claim: Result<Claim, StoreError>) -> u64 {
    match claim {
        Ok(Claim::Acquired { fence }) => fence,
        other => panic!("expected an acquisition, got {other:?}"),
    }
}

/// The batch of [`batch_cases`] and the fences its keys' records had before it was sent.
struct BatchCases {
    reqs: Vec<ClaimRequest>,
    completed: u64,
    live: u64,
    lapsed: u64,
    expired: u64,
    released: u64,
    mismatch: u64,
    own: u64,
}

/// Sets up one key per case under `prefix` and returns the requests of the batch, in order:
/// a new key twice (two tokens), a completed key, a live foreign claim, a claim whose lease
/// ran out, an expired record, a released key, a fingerprint mismatch, and a retry by the
/// token that holds the live claim. Leaves 300 ms for the short leases to run out.
async fn batch_cases(store: &impl Store, prefix: &str) -> BatchCases {
    let hour = Duration::from_secs(3600);
    let short = Duration::from_millis(200);
    let key = |case: &str| Key::new(prefix, 1, &[&case]).unwrap();
    let fp = |n: u8| Some(Fingerprint::of(&[&n]));
    let completion = Completion::new(Some(b"done".to_vec()), hour);

    let completed = req(&key("completed"), hour, hour);
    let completed_fence = acquired(store.claim(&completed).await);
    assert!(store
        .complete(&completed.key, &completed.token, &completion)
        .await
        .unwrap());
    let live = req(&key("live"), hour, hour);
    let live_fence = acquired(store.claim(&live).await);
    let lapsed = req(&key("lapsed"), short, hour);
    let lapsed_fence = acquired(store.claim(&lapsed).await);
    let expired = req(&key("expired"), short, short);
    let expired_fence = acquired(store.claim(&expired).await);
    let released = req(&key("released"), hour, hour);
    let released_fence = acquired(store.claim(&released).await);
    assert!(store.release(&released.key, &released.token).await.unwrap());
    let mut mismatch = req(&key("mismatch"), hour, hour);
    mismatch.fingerprint = fp(1);
    let mismatch_fence = acquired(store.claim(&mismatch).await);
    assert!(store
        .complete(&mismatch.key, &mismatch.token, &completion)
        .await
        .unwrap());
    let own = req(&key("own"), hour, hour);
    let own_fence = acquired(store.claim(&own).await);
    tokio::time::sleep(Duration::from_millis(300)).await;

    BatchCases {
        reqs: vec![
            req(&key("new"), hour, hour),
            req(&key("completed"), hour, hour),
            req(&key("new"), hour, hour),
            req(&key("live"), hour, hour),
            req(&key("lapsed"), hour, hour),
            req(&key("expired"), hour, hour),
            req(&key("released"), hour, hour),
            {
                let mut other = req(&key("mismatch"), hour, hour);
                other.fingerprint = fp(2);
                other
            },
            own,
        ],
        completed: completed_fence,
        live: live_fence,
        lapsed: lapsed_fence,
        expired: expired_fence,
        released: released_fence,
        mismatch: mismatch_fence,
        own: own_fence,
    }
}

/// Checks the answers to a [`batch_cases`] batch: a new key takes its fence from the clock,
/// an expired record a fence above its old one, a taken-over or released record its fence
/// plus one.
fn assert_batch_answers(cases: &BatchCases, answers: &[Claim]) {
    let new = match answers.first() {
        Some(Claim::Acquired { fence }) => *fence,
        other => panic!("the new key was not acquired: {other:?}"),
    };
    assert!(
        new > CLOCK_FENCE_FLOOR,
        "a new key's fence is the clock: {new}"
    );
    let expired = match answers.get(5) {
        Some(Claim::Acquired { fence }) => *fence,
        other => panic!("the expired key was not acquired: {other:?}"),
    };
    assert!(
        expired > cases.expired,
        "an expired record is claimed again with a higher fence: {expired} after {}",
        cases.expired
    );
    let expected = vec![
        Claim::Acquired { fence: new },
        Claim::Completed {
            fence: cases.completed,
            result: Some(b"done".to_vec()),
        },
        Claim::InProgress { fence: new },
        Claim::InProgress { fence: cases.live },
        Claim::Acquired {
            fence: cases.lapsed + 1,
        },
        Claim::Acquired { fence: expired },
        Claim::Acquired {
            fence: cases.released + 1,
        },
        Claim::Mismatch {
            fence: cases.mismatch,
        },
        Claim::Acquired { fence: cases.own },
    ];
    assert_eq!(answers, expected);
}

/// A batch with a duplicated key, a completed key, a live foreign claim, a run-out lease
/// (taken over: fence + 1), an expired record (a fence from the clock, above the old one),
/// a released key (fence + 1), a fingerprint mismatch and a retry by the owner's token gets
/// the answers the same claims sent one by one get; where the database counts statements,
/// the batch is one claim statement, plus one single claim for the key's second occurrence.
/// A batch of 1001 new keys is acquired whole, in three statements.
pub async fn batch_answers_as_single_claims_would<H: Harness>(store: &SqlStore<H::Db>) {
    let singles = batch_cases(store, "single").await;
    let batch = batch_cases(store, "batch").await;
    let mut one_by_one = Vec::new();
    for r in &singles.reqs {
        one_by_one.push(store.claim(r).await.unwrap());
    }
    H::count_claim_statements(store).await;
    let before = H::claim_statements(store).await;
    let batched: Vec<Claim> = store
        .claim_many(&batch.reqs)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let after = H::claim_statements(store).await;

    assert_batch_answers(&singles, &one_by_one);
    assert_batch_answers(&batch, &batched);
    for (r, claim) in batch.reqs.iter().zip(&batched) {
        if let Claim::Acquired { fence } = claim {
            let record = store.read(&r.key).await.unwrap().unwrap();
            assert_eq!((record.token, record.fence), (r.token, *fence));
        }
    }
    if let (Some(before), Some(after)) = (before, after) {
        // The insert-only claim of the batch where the store sends one first, the claim of
        // the keys it did not take (all of them otherwise), and the later occurrence of a
        // key, alone.
        let fresh_first = i64::from(store.statements().claim_fresh().is_some());
        assert_eq!(
            after - before,
            2 + fresh_first,
            "claim statements sent for the batch"
        );
    }

    // A batch larger than one statement takes (500 keys) is claimed in chunks.
    let hour = Duration::from_secs(3600);
    let many: Vec<ClaimRequest> = (0..1001u32)
        .map(|i| req(&Key::new("many", 1, &[&i]).unwrap(), hour, hour))
        .collect();
    let before = H::claim_statements(store).await;
    for claim in store.claim_many(&many).await {
        assert!(acquired(claim) > CLOCK_FENCE_FLOOR);
    }
    let after = H::claim_statements(store).await;
    if let (Some(before), Some(after)) = (before, after) {
        assert_eq!(after - before, 3, "claim statements sent for 1001 keys");
    }
}

/// A new key's fence is the database's clock in microseconds; a released key's next fence is
/// one higher; once the record expired, the key is claimed again, alone or in a batch, with a
/// fence above every earlier one (never 1 again).
pub async fn expired_record_is_claimed_again_with_a_higher_fence<H: Harness>(
    store: &SqlStore<H::Db>,
) {
    let short = Duration::from_millis(200);
    let hour = Duration::from_secs(3600);
    let single = Key::new("expiry", 1, &[&"single"]).unwrap();
    let batched = Key::new("expiry", 1, &[&"batched"]).unwrap();

    let first = req(&single, short, short);
    let f1 = acquired(store.claim(&first).await);
    assert!(
        f1 > CLOCK_FENCE_FLOOR,
        "a new key's fence is the clock: {f1}"
    );
    assert!(store.release(&single, &first.token).await.unwrap());
    let second = req(&single, short, short);
    assert_eq!(acquired(store.claim(&second).await), f1 + 1);
    let g1 = acquired(store.claim(&req(&batched, short, short)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(store.read(&single).await.unwrap().is_none(), "expired");

    let f3 = acquired(store.claim(&req(&single, hour, hour)).await);
    assert!(f3 > f1 + 1, "{f3} after {}", f1 + 1);
    let fresh = Key::new("expiry", 1, &[&"fresh"]).unwrap();
    let claims = store
        .claim_many(&[req(&batched, hour, hour), req(&fresh, hour, hour)])
        .await;
    let mut claims = claims.into_iter();
    let g2 = acquired(claims.next().unwrap());
    assert!(g2 > g1, "{g2} after {g1}");
    assert!(acquired(claims.next().unwrap()) > CLOCK_FENCE_FLOOR);
}

fn assert_corrupt<T: std::fmt::Debug>(out: Result<T, StoreError>, what: &str) {
    match out {
        Err(err) => assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{what}: {err:?}"),
        Ok(value) => panic!("{what}: a corrupt record gave {value:?}"),
    }
}

/// A record row the store cannot read (each of [`Harness::corruptions`], written by hand) is
/// `Corrupt` for claim (alone and in a batch, whatever the token), complete, release, renew
/// and read; it is never taken as free, live or released, and a batch answers its other
/// keys.
pub async fn corrupt_records_are_reported_as_corrupt<H: Harness>(store: &SqlStore<H::Db>) {
    let hour = Duration::from_secs(3600);
    let done = Completion::new(Some(b"r".to_vec()), hour);
    for (i, assignment) in H::corruptions().iter().enumerate() {
        let n = u32::try_from(i).unwrap();
        let live = Key::new("corrupt", 1, &[&n, &"live"]).unwrap();
        let released = Key::new("corrupt", 1, &[&n, &"released"]).unwrap();
        let owner = req(&live, hour, hour);
        acquired(store.claim(&owner).await);
        H::corrupt(store, &live, assignment).await;
        let gone = req(&released, hour, hour);
        acquired(store.claim(&gone).await);
        assert!(store.release(&released, &gone.token).await.unwrap());
        H::corrupt(store, &released, assignment).await;

        for _ in 0..2 {
            let what = |op: &str| format!("{op} of a record with {assignment}");
            assert_corrupt(store.read(&live).await, &what("read"));
            assert_corrupt(store.claim(&owner).await, &what("claim by its owner"));
            assert_corrupt(store.claim(&req(&live, hour, hour)).await, &what("claim"));
            assert_corrupt(
                store.complete(&live, &owner.token, &done).await,
                &what("complete"),
            );
            assert_corrupt(store.renew(&live, &owner.token, hour).await, &what("renew"));
            assert_corrupt(store.release(&live, &owner.token).await, &what("release"));
            assert_corrupt(store.reopen(&live, &owner.token).await, &what("reopen"));
            assert_corrupt(store.read(&released).await, &what("read of released"));
            assert_corrupt(
                store.claim(&req(&released, hour, hour)).await,
                &what("claim of released"),
            );
            let fresh = Key::new("corrupt", 1, &[&n, &"fresh"]).unwrap();
            let batch = [
                req(&released, hour, hour),
                req(&fresh, hour, hour),
                req(&live, hour, hour),
            ];
            let mut claims = store.claim_many(&batch).await.into_iter();
            assert_corrupt(claims.next().unwrap(), &what("batch claim of released"));
            let fresh_claim = claims.next().unwrap();
            assert_corrupt(claims.next().unwrap(), &what("batch claim"));
            // The second round meets the fresh key's own live claim.
            assert!(
                matches!(
                    fresh_claim,
                    Ok(Claim::Acquired { .. } | Claim::InProgress { .. })
                ),
                "{fresh_claim:?}"
            );
            assert_corrupt(
                store.delete(&live, Expect::Token(&owner.token)).await,
                &what("delete by its token"),
            );
            let ended = store
                .complete_many(&[
                    Ending::complete(live.clone(), owner.token, done.clone()),
                    Ending::release(released.clone(), gone.token),
                ])
                .await;
            for (answer, op) in ended.into_iter().zip(["batch completion", "batch release"]) {
                assert_corrupt(answer, &what(op));
            }
        }
        // An operator lists both as corrupt and deletes them; the keys are free again.
        let admin = Admin::new(Arc::new(store.clone()));
        let page = admin
            .list(
                &ListQuery::new("corrupt")
                    .unwrap()
                    .state(StateFilter::Corrupt)
                    .limit(1000),
            )
            .await
            .unwrap();
        let listed: Vec<&Key> = page.records.iter().map(|(key, _)| key).collect();
        assert!(
            listed.contains(&&live) && listed.contains(&&released),
            "{assignment}: {listed:?}"
        );
        for key in [&live, &released] {
            assert_eq!(
                admin.delete(key).await.unwrap(),
                AdminOutcome::DeletedCorrupt,
                "{assignment}: {key}"
            );
            acquired(store.claim(&req(key, hour, hour)).await);
        }
    }
}

/// A result the table refuses (a constraint, or a column too small: a schema managed by hand)
/// is `Rejected`, not an outage; the record stays in progress, and completing it without the
/// result succeeds.
pub async fn result_refused_by_the_table_is_rejected<H: Harness>(store: &SqlStore<H::Db>) {
    H::limit_results(store).await;
    let hour = Duration::from_secs(3600);
    let key = Key::new("refused", 1, &[&1u8]).unwrap();
    let owner = req(&key, hour, hour);
    let fence = acquired(store.claim(&owner).await);
    let big = Completion::new(Some(vec![7; 1000]), hour);
    let err = store.complete(&key, &owner.token, &big).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Rejected, "{err:?}");
    assert!(err.is_permanent());
    let record = store.read(&key).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    let small = Completion::new(None, hour);
    assert!(store.complete(&key, &owner.token, &small).await.unwrap());
    assert_eq!(
        store.claim(&req(&key, hour, hour)).await.unwrap(),
        Claim::Completed {
            fence,
            result: None
        }
    );
}

/// A store built with `max_result_size(n)` reports `n`; a result longer than that is
/// `Rejected` without being sent (the record stays in progress), and one of exactly `n` bytes
/// is stored and replayed.
pub async fn result_above_the_store_limit_is_rejected<H: Harness>(store: &SqlStore<H::Db>) {
    let limit = store.max_result_size();
    let hour = Duration::from_secs(3600);
    let key = Key::new("limit", 1, &[&1u8]).unwrap();
    let owner = req(&key, hour, hour);
    let fence = acquired(store.claim(&owner).await);
    let over = Completion::new(Some(vec![7; limit + 1]), hour);
    let err = store.complete(&key, &owner.token, &over).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Rejected, "{err:?}");
    let record = store.read(&key).await.unwrap().unwrap();
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
    let exact = Completion::new(Some(vec![7; limit]), hour);
    assert!(store.complete(&key, &owner.token, &exact).await.unwrap());
    assert_eq!(
        store.claim(&req(&key, hour, hour)).await.unwrap(),
        Claim::Completed {
            fence,
            result: Some(vec![7; limit])
        }
    );
}

/// `Duration::MAX` as lease and ttl works for claim (alone and in a batch), renew and
/// complete, and means the same as the longest duration, `MAX_DURATION`.
pub async fn longest_durations_work<H: Harness>(store: &SqlStore<H::Db>) {
    let max = Duration::MAX;
    let key = Key::new("longest", 1, &[&"max"]).unwrap();
    let century = Key::new("longest", 1, &[&"century"]).unwrap();
    let owner = req(&key, max, max);
    let fence = acquired(store.claim(&owner).await);
    acquired(
        store
            .claim(&req(&century, MAX_DURATION, MAX_DURATION))
            .await,
    );
    let lease_left = |record: Option<idempotency::store::Record>| match record.map(|r| r.state) {
        Some(RecordState::InProgress { lease_left }) => lease_left,
        other => panic!("expected a live claim, got {other:?}"),
    };
    let a = lease_left(store.read(&key).await.unwrap());
    let b = lease_left(store.read(&century).await.unwrap());
    assert!(a <= MAX_DURATION, "{a:?}");
    assert!(a.abs_diff(b) < Duration::from_secs(10), "{a:?} vs {b:?}");

    assert!(store.renew(&key, &owner.token, max).await.unwrap());
    let a = lease_left(store.read(&key).await.unwrap());
    assert!(a <= MAX_DURATION, "{a:?}");
    assert!(MAX_DURATION - a < Duration::from_secs(10), "{a:?}");

    let done = Completion::new(Some(b"kept".to_vec()), max);
    assert!(store.complete(&key, &owner.token, &done).await.unwrap());
    assert_eq!(
        store.claim(&req(&key, max, max)).await.unwrap(),
        Claim::Completed {
            fence,
            result: Some(b"kept".to_vec())
        }
    );

    let batch = [
        req(&Key::new("longest", 1, &[&"batch-1"]).unwrap(), max, max),
        req(&Key::new("longest", 1, &[&"batch-2"]).unwrap(), max, max),
        req(&key, max, max),
    ];
    let claims = store.claim_many(&batch).await;
    let mut claims = claims.into_iter();
    acquired(claims.next().unwrap());
    acquired(claims.next().unwrap());
    assert!(matches!(
        claims.next().unwrap(),
        Ok(Claim::Completed { .. })
    ));
}

/// The cases that need only a fresh store, as `#[tokio::test]` functions of the including
/// file: `$harness` is its [`Harness`], `$fresh` an async fn returning what keeps the store's
/// table alive (dropped last) and the store.
#[macro_export]
macro_rules! fresh_store_cases {
    ($harness:ty, $fresh:ident) => {
        $crate::fresh_store_cases!(@each $harness, $fresh;
            claim_sent_again_with_its_token_is_acquired,
            keys_are_exact_bytes,
            transaction_refuses_a_ttl_out_of_range,
            expired_record_is_claimed_again_with_a_higher_fence,
            result_refused_by_the_table_is_rejected,
            longest_durations_work,
        );

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn purger_task_purges_until_dropped() {
            let (_keep, store) = $fresh().await;
            sql_cases::purger_task_purges_until_dropped::<$harness>(&store).await;
        }

        #[tokio::test]
        async fn transaction_answers_keys_as_the_engine_does() {
            let (_keep, store) = $fresh().await;
            sql_cases::transaction_answers_keys_as_the_engine_does::<$harness>(
                ::std::sync::Arc::new(store),
            )
            .await;
        }
    };
    (@each $harness:ty, $fresh:ident; $($case:ident,)*) => {
        $(
            #[tokio::test]
            async fn $case() {
                let (_keep, store) = $fresh().await;
                sql_cases::$case::<$harness>(&store).await;
            }
        )*
    };
}
