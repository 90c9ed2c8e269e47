//! The tiered store: a fast front over a durable back. The conformance suite on a real Redis
//! in front of a real PostgreSQL, and what happens when either layer loses its data or goes
//! down.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/forward.rs"]
#[macro_use]
mod forward;

mod conformance;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use conformance::{unique_namespace, Backend, Down};
use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::PostgresStore;
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, RecordState, SharedOperatorStore, Store,
    StoreError, TieredStore, Token,
};
use idempotency::{Error, Idempotency, Key, MemoryStore, SharedStore};
use redis_server::{delete_matching, redis_url};

struct Tiered {
    store: Arc<TieredStore>,
    back: Arc<PostgresStore>,
    namespace: String,
    // Dropped after the store: drops the case's table.
    _table: sql_tables::Scratch,
}

impl Backend for Tiered {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    // Duplicates are answered from the front (Redis), whose fences come from its own clock;
    // acquired claims carry the back's (PostgreSQL) fence.
    fn answers_carry_the_owners_fence(&self) -> bool {
        false
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        let pattern = format!("{prefix}:*");
        Box::pin(async move {
            let sql = format!("DELETE FROM {}", self.back.table());
            sqlx::query(AssertSqlSafe(sql))
                .execute(self.back.pool())
                .await
                .unwrap();
            tokio::task::spawn_blocking(move || delete_matching(&redis_url(), &pattern))
                .await
                .unwrap();
        })
    }
}

impl conformance::OperatorBackend for Tiered {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
    }
}

impl Drop for Tiered {
    fn drop(&mut self) {
        let pattern = format!("{}:*", self.namespace);
        let _ = std::thread::spawn(move || delete_matching(&redis_url(), &pattern)).join();
    }
}

async fn redis_over_postgres() -> Tiered {
    let table = sql_tables::Scratch::table(sql_tables::Server::Postgres);
    let back = Arc::new(
        PostgresStore::builder(table.url())
            .table(table.name().to_string())
            .build()
            .await
            .unwrap(),
    );
    let front = Arc::new(redis_server::connect(&redis_url()).await);
    Tiered {
        store: Arc::new(TieredStore::new(front, back.clone())),
        back,
        namespace: unique_namespace(),
        _table: table,
    }
}

conformance_suite!(redis_over_postgres);

fn guard(store: SharedStore) -> Idempotency {
    Idempotency::new(Duration::from_secs(60)).store(store)
}

/// A real in-memory store whose releases wait for the case to let them through, so that a
/// case can look at the other layer while a release is under way (no real store can be held
/// at that point on demand).
struct HeldReleases {
    inner: MemoryStore,
    entered: tokio::sync::Semaphore,
    gate: tokio::sync::Semaphore,
}

impl HeldReleases {
    fn new() -> HeldReleases {
        HeldReleases {
            inner: MemoryStore::new(),
            entered: tokio::sync::Semaphore::new(0),
            gate: tokio::sync::Semaphore::new(0),
        }
    }
    /// Returns once a release reached this store, and holds it there.
    async fn release_entered(&self) {
        self.entered.acquire().await.unwrap().forget();
    }
    /// Lets one held release through.
    fn let_through(&self) {
        self.gate.add_permits(1);
    }
}

impl Store for HeldReleases {
    forward_store!(claim, complete, renew, read);

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            self.entered.add_permits(1);
            self.gate.acquire().await.unwrap().forget();
            self.inner.release(key, token).await
        })
    }
}

forward_operator_store!(HeldReleases);

/// A claim given back is released on the front first, then on the back (single and batch
/// endings): while the front's release is under way the back still holds the claim, so
/// whoever sees the back released (the record of truth) finds the front released too, and
/// the next delivery is acquired at once with the next fence instead of being told by the
/// front that the call is still in flight.
#[tokio::test]
async fn a_claim_given_back_is_released_on_the_front_before_the_back() {
    let front = Arc::new(HeldReleases::new());
    let back = Arc::new(MemoryStore::new());
    let store = Arc::new(TieredStore::new(front.clone(), back.clone()));
    for batch in [false, true] {
        let key = Key::new("tiered-release", 1, &[&batch]).unwrap();
        let minute = Duration::from_secs(60);
        let owner = ClaimRequest::new(key.clone(), Token::generate(), minute, minute);
        let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        let release = tokio::spawn({
            let (store, key, token) = (store.clone(), key.clone(), owner.token);
            async move {
                if batch {
                    let mut answers = store.complete_many(&[Ending::release(key, token)]).await;
                    answers.pop().unwrap()
                } else {
                    store.release(&key, &token).await
                }
            }
        });
        front.release_entered().await;
        let held = back.read(&key).await.unwrap().unwrap();
        assert!(
            matches!(held.state, RecordState::InProgress { .. }),
            "batch: {batch}: the back was released before the front: {:?}",
            held.state
        );
        front.let_through();
        assert!(release.await.unwrap().unwrap(), "batch: {batch}");
        for layer in [front.read(&key), back.read(&key)] {
            let record = layer.await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Released, "batch: {batch}");
        }
        let next = ClaimRequest::new(key.clone(), Token::generate(), minute, minute);
        match store.claim(&next).await.unwrap() {
            Claim::Acquired { fence: next } => assert_eq!(next, fence + 1, "batch: {batch}"),
            other => panic!("batch: {batch}: the next delivery got {other:?}"),
        }
    }
}

/// A release dropped after the front let the claim go and before the back did (the caller's
/// task cancelled mid-release) leaves the back, the record of truth, holding the claim: the
/// next delivery is told the call is in flight, whatever the front says, until the lease
/// runs out; then it is acquired with the next fence. Nothing runs twice, and the key is
/// busy no longer than the lease (single and batch releases).
#[tokio::test]
async fn a_release_dropped_between_the_layers_keeps_the_key_busy_until_the_lease() {
    let front = Arc::new(MemoryStore::new());
    let back = Arc::new(HeldReleases::new());
    let store = Arc::new(TieredStore::new(front.clone(), back.clone()));
    let lease = Duration::from_millis(400);
    let ttl = Duration::from_secs(60);
    for batch in [false, true] {
        let key = Key::new("tiered-dropped-release", 1, &[&batch]).unwrap();
        let owner = ClaimRequest::new(key.clone(), Token::generate(), lease, ttl);
        let Claim::Acquired { fence } = store.claim(&owner).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        let release = tokio::spawn({
            let (store, key, token) = (store.clone(), key.clone(), owner.token);
            async move {
                if batch {
                    drop(store.complete_many(&[Ending::release(key, token)]).await);
                } else {
                    drop(store.release(&key, &token).await);
                }
            }
        });
        back.release_entered().await;
        release.abort();
        assert!(release.await.unwrap_err().is_cancelled(), "batch: {batch}");
        let front_record = front.read(&key).await.unwrap().unwrap();
        assert_eq!(front_record.state, RecordState::Released, "batch: {batch}");
        let held = back.read(&key).await.unwrap().unwrap();
        assert!(
            matches!(held.state, RecordState::InProgress { .. }),
            "batch: {batch}: the dropped release reached the back: {:?}",
            held.state
        );
        let early = ClaimRequest::new(key.clone(), Token::generate(), lease, ttl);
        assert_eq!(
            store.claim(&early).await.unwrap(),
            Claim::InProgress { fence },
            "batch: {batch}: a delivery while the back holds the claim"
        );
        let early_many = store.claim_many(std::slice::from_ref(&early)).await;
        assert_eq!(
            early_many.into_iter().next().unwrap().unwrap(),
            Claim::InProgress { fence },
            "batch: {batch}: a batch delivery while the back holds the claim"
        );
        // The lease is on the stores' clock: once it has run out, the claim is free.
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        let next = ClaimRequest::new(key.clone(), Token::generate(), lease, ttl);
        assert_eq!(
            store.claim(&next).await.unwrap(),
            Claim::Acquired { fence: fence + 1 },
            "batch: {batch}: the delivery after the lease"
        );
        assert!(
            !store
                .complete(&key, &owner.token, &Completion::new(None, ttl))
                .await
                .unwrap(),
            "batch: {batch}: the first owner completes after the takeover"
        );
    }
}

#[tokio::test]
async fn front_losing_its_data_runs_nothing_twice() {
    let mut front_server = redis_server::RedisServer::start(&[]);
    let front = Arc::new(redis_server::connect(&front_server.url()).await);
    let back = Arc::new(MemoryStore::new());
    let store: SharedStore = Arc::new(TieredStore::new(front.clone(), back.clone()));
    let executions = AtomicUsize::new(0);
    let run = |id: u32| {
        let (store, executions) = (store.clone(), &executions);
        async move {
            guard(store)
                .operation(Key::new("tiered", 1, &[&id]).unwrap())
                .replay()
                .run(async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(id * 10)
                })
                .await
        }
    };
    assert_eq!(run(1).await.unwrap(), 10);
    front_server.restart();
    // Wait for the front's connection to come back, so the next call goes through it.
    while front.check().await.is_err() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The front forgot; the back answers, and the result is still replayed.
    let replayed = run(1).await;
    assert_eq!(replayed.unwrap(), 10);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // ... and the front was repaired: it answers the next duplicate alone.
    back.clear();
    assert_eq!(run(1).await.unwrap(), 10);
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn front_down_falls_back_to_the_back() {
    let back = Arc::new(MemoryStore::new());
    let front = Arc::new(Down::new(Arc::new(MemoryStore::new())));
    let store: SharedStore = Arc::new(TieredStore::new(front, back.clone()));
    let executions = AtomicUsize::new(0);
    let run = || {
        let (store, executions) = (store.clone(), &executions);
        async move {
            guard(store)
                .run(Key::new("tiered-down", 1, &[&1u8]).unwrap(), async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Error>(())
                })
                .await
        }
    };
    run().await.unwrap();
    assert!(matches!(run().await, Err(Error::Duplicate { .. })));
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    let record = back
        .read(&Key::new("tiered-down", 1, &[&1u8]).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.state, RecordState::Completed);
}

#[tokio::test]
async fn back_down_fails_closed_and_gives_the_front_claim_back() {
    let front = Arc::new(MemoryStore::new());
    let back = Arc::new(Down::new(Arc::new(MemoryStore::new())));
    let store: SharedStore = Arc::new(TieredStore::new(front.clone(), back));
    let key = Key::new("tiered-back-down", 1, &[&1u8]).unwrap();
    let out: Result<(), Error> = guard(store)
        .run(key.clone(), async { panic!("must not run") })
        .await;
    assert!(matches!(out, Err(Error::Store(_))));
    let record = front.read(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
}

#[tokio::test]
async fn duplicates_cost_one_front_round_trip() {
    let front = Arc::new(MemoryStore::new());
    let back = Arc::new(MemoryStore::new());
    let store: SharedStore = Arc::new(TieredStore::new(front.clone(), back.clone()));
    let key = Key::new("tiered-fast", 1, &[&1u8]).unwrap();
    guard(store.clone())
        .run(key.clone(), async { Ok::<_, Error>(()) })
        .await
        .unwrap();
    // With the back gone, a duplicate is still filtered by the front alone.
    back.clear();
    assert!(matches!(
        guard(store).run(key, async { Ok::<_, Error>(()) }).await,
        Err(Error::Duplicate { .. })
    ));
}

/// Batches take the same paths as single calls, a layer at a time: a front that forgot
/// completed operations is answered by the back and repaired (the next batch is answered by
/// the front alone), a front that is down leaves the batch to the back, and a back that is
/// down fails the batch closed and gives the front's claims back.
#[tokio::test]
async fn batches_take_the_single_call_paths_through_the_layers() {
    let items = |prefix: &str| -> Vec<(Key, u32)> {
        (0..5u32)
            .map(|id| (Key::new(prefix, 1, &[&id]).unwrap(), id))
            .collect()
    };
    let executions = AtomicUsize::new(0);
    let handler = |id: u32| {
        let executions = &executions;
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(id * 10)
        }
    };
    let values =
        |out: Vec<Result<u32, Error>>| out.into_iter().map(Result::unwrap).collect::<Vec<_>>();
    let want: Vec<u32> = (0..5).map(|id| id * 10).collect();

    // The front forgets; the back answers and the front is repaired.
    let (front, back) = (Arc::new(MemoryStore::new()), Arc::new(MemoryStore::new()));
    let g = guard(Arc::new(TieredStore::new(front.clone(), back.clone())));
    assert_eq!(
        values(g.batch().replay().run(items("tiered-batch"), handler).await),
        want
    );
    front.clear();
    assert_eq!(
        values(g.batch().replay().run(items("tiered-batch"), handler).await),
        want
    );
    back.clear();
    assert_eq!(
        values(g.batch().replay().run(items("tiered-batch"), handler).await),
        want
    );
    assert_eq!(executions.load(Ordering::SeqCst), 5);

    // The front is down: the back alone.
    let back = Arc::new(MemoryStore::new());
    let down = Arc::new(Down::new(Arc::new(MemoryStore::new())));
    let g = guard(Arc::new(TieredStore::new(down, back.clone())));
    assert_eq!(
        values(g.run_batch(items("tiered-batch-down"), handler).await),
        want
    );
    assert_eq!(executions.load(Ordering::SeqCst), 10);
    let again: Vec<Result<u32, Error>> = g.run_batch(items("tiered-batch-down"), handler).await;
    assert!(
        again
            .iter()
            .all(|out| matches!(out, Err(Error::Duplicate { .. }))),
        "{again:?}"
    );
    for (key, _) in items("tiered-batch-down") {
        assert_eq!(
            back.read(&key).await.unwrap().unwrap().state,
            RecordState::Completed
        );
    }

    // The back is down: nothing runs, and the front's claims are given back.
    let front = Arc::new(MemoryStore::new());
    let down = Arc::new(Down::new(Arc::new(MemoryStore::new())));
    let g = guard(Arc::new(TieredStore::new(front.clone(), down)));
    let closed: Vec<Result<u32, Error>> = g.run_batch(items("tiered-batch-back"), handler).await;
    assert!(
        closed.iter().all(|out| matches!(out, Err(Error::Store(_)))),
        "{closed:?}"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 10);
    for (key, _) in items("tiered-batch-back") {
        assert_eq!(
            front.read(&key).await.unwrap().unwrap().state,
            RecordState::Released
        );
    }
}

/// A batch that completes and then releases one key (the release meets the completion and
/// changes nothing) leaves the front completed, as the back is: a key the batch completes
/// keeps its endings' order on the front.
#[tokio::test]
async fn a_batch_completing_and_releasing_one_key_keeps_the_front_completed() {
    let front = Arc::new(MemoryStore::new());
    let back = Arc::new(MemoryStore::new());
    let store = TieredStore::new(front.clone(), back.clone());
    let key = Key::new("tiered-order", 1, &[&1u8]).unwrap();
    let minute = Duration::from_secs(60);
    let owner = ClaimRequest::new(key.clone(), Token::generate(), minute, minute);
    assert!(matches!(
        store.claim(&owner).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let answers: Vec<bool> = store
        .complete_many(&[
            Ending::complete(key.clone(), owner.token, Completion::new(None, minute)),
            Ending::release(key.clone(), owner.token),
        ])
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(answers, [true, false]);
    for layer in [front.read(&key), back.read(&key)] {
        assert_eq!(layer.await.unwrap().unwrap().state, RecordState::Completed);
    }
}
