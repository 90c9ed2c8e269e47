//! `Lock` on every store: the memory store, the Redis at `IDEMPOTENT_REDIS_URL`, a 3-master
//! Redis Cluster the test starts, and PostgreSQL, MariaDB and SQLite. Contenders with real concurrency, exact counts, fences
//! that only grow, a holder that stops renewing, and the watchdog that keeps a long critical
//! section locked. (A paused holder refused by the fence, and a killed one, are in
//! `tests/lock_fence.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency::lock::Lock;
use idempotency::sql::{MySqlStore, PostgresStore, SqliteStore};
use idempotency::store::{Claim, ClaimRequest, Store as _, Token};
use idempotency::{Error, Key, MemoryStore, SharedStore};
use proxy::Proxy;
use redis_server::{connect, delete_matching, redis_url, RedisCluster};
use sql_tables::{Scratch, Server};

#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Redis,
    Postgres,
    MariaDb,
    Sqlite,
}

const BACKENDS: [Backend; 5] = [
    Backend::Memory,
    Backend::Redis,
    Backend::Postgres,
    Backend::MariaDb,
    Backend::Sqlite,
];

/// A store for one scenario, a key prefix of its own, and what it must clean up.
struct Store {
    store: SharedStore,
    prefix: String,
    _table: Option<Scratch>,
    redis: Option<String>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(url) = self.redis.take() {
            let pattern = format!("{}:*", self.prefix);
            let _ = std::thread::spawn(move || delete_matching(&url, &pattern)).join();
        }
    }
}

impl Store {
    fn key(&self, name: &str) -> Key {
        Key::new(&self.prefix, 1, &[&name]).unwrap()
    }
}

async fn store(backend: Backend) -> Store {
    let token = format!("{:?}", Token::generate());
    let prefix = format!("lock-{}", &token[6..token.len() - 1]);
    let (store, table, redis): (SharedStore, _, _) = match backend {
        Backend::Memory => (Arc::new(MemoryStore::new()), None, None),
        Backend::Redis => {
            let url = redis_url();
            (Arc::new(connect(&url).await), None, Some(url))
        }
        Backend::Postgres => {
            let table = Scratch::table(Server::Postgres);
            let store = PostgresStore::builder(table.url())
                .table(table.name().to_string())
                .build()
                .await
                .unwrap();
            (Arc::new(store), Some(table), None)
        }
        Backend::MariaDb => {
            let table = Scratch::table(Server::MySql);
            let store = MySqlStore::builder(table.url())
                .table(table.name().to_string())
                .build()
                .await
                .unwrap();
            (Arc::new(store), Some(table), None)
        }
        Backend::Sqlite => (
            Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap()),
            None,
            None,
        ),
    };
    Store {
        store,
        prefix,
        _table: table,
        redis,
    }
}

/// 50 tasks each add one to a counter with a read, a pause and a write (a race without the
/// lock) under the lock: the counter ends at exactly 50, and each holder's fence is higher
/// than the one before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contenders_increment_a_counter_exactly() {
    for backend in BACKENDS {
        contenders_increment_a_counter_exactly_on(store(backend).await, &format!("{backend:?}"))
            .await;
    }
}

async fn contenders_increment_a_counter_exactly_on(store: Store, backend: &str) {
    let locks =
        Lock::new(store.store.clone(), Duration::from_secs(10)).wait(Duration::from_secs(120));
    let key = store.key("counter");
    let counter = Arc::new(AtomicU64::new(0));
    let fences = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (locks, key, counter, fences) =
                (locks.clone(), key.clone(), counter.clone(), fences.clone());
            tokio::spawn(async move {
                let guard = locks.lock(key).await.unwrap();
                fences.lock().unwrap().push(guard.fence());
                let seen = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
                counter.store(seen + 1, Ordering::SeqCst);
                assert!(guard.unlock().await.unwrap(), "the lock was lost");
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(counter.load(Ordering::SeqCst), 50, "{backend:?}");
    let fences = fences.lock().unwrap().clone();
    assert_eq!(fences.len(), 50);
    assert!(
        fences.windows(2).all(|pair| pair[0] < pair[1]),
        "{backend:?}: fences out of order: {fences:?}"
    );
}

/// While held, `try_lock` is `None` and `lock` gives up at its bound with the holder's fence;
/// after `unlock` (which reports it still owned the key) the next holder's fence is higher.
#[tokio::test]
async fn a_held_lock_is_refused_and_unlock_frees_it() {
    for backend in BACKENDS {
        a_held_lock_is_refused_and_unlock_frees_it_on(
            store(backend).await,
            &format!("{backend:?}"),
        )
        .await;
    }
}

async fn a_held_lock_is_refused_and_unlock_frees_it_on(store: Store, backend: &str) {
    let locks =
        Lock::new(store.store.clone(), Duration::from_secs(10)).wait(Duration::from_millis(50));
    let key = store.key("account-1");
    let first = locks.lock(key.clone()).await.unwrap();
    assert_eq!(first.key(), &key);
    assert!(
        locks.try_lock(key.clone()).await.unwrap().is_none(),
        "{backend:?}"
    );
    match locks.lock(key.clone()).await {
        Err(Error::InProgress { fence, .. }) => assert_eq!(fence, first.fence()),
        other => panic!("{backend:?}: expected the key held, got {other:?}"),
    }
    let fence = first.fence();
    assert!(first.unlock().await.unwrap());
    let second = locks
        .try_lock(key)
        .await
        .unwrap()
        .expect("free after unlock");
    assert!(second.fence() > fence, "{backend:?}");
}

/// A dropped guard gives the key back in the background: the next `lock` gets it long before
/// the lease (60 s) would have run out.
#[tokio::test]
async fn a_dropped_guard_releases_the_key() {
    for backend in BACKENDS {
        a_dropped_guard_releases_the_key_on(store(backend).await, &format!("{backend:?}")).await;
    }
}

async fn a_dropped_guard_releases_the_key_on(store: Store, backend: &str) {
    let locks =
        Lock::new(store.store.clone(), Duration::from_secs(60)).wait(Duration::from_secs(10));
    let key = store.key("dropped");
    let fence = {
        let guard = locks.lock(key.clone()).await.unwrap();
        guard.fence()
    };
    let started = tokio::time::Instant::now();
    let next = locks.lock(key).await.unwrap();
    assert!(next.fence() > fence);
    assert!(started.elapsed() < Duration::from_secs(10), "{backend:?}");
}

/// A holder that stopped renewing (here a raw claim, as a crashed process leaves it) keeps
/// the key until its lease runs out; then `lock` takes it with that holder's fence + 1.
#[tokio::test]
async fn a_holder_that_stopped_renewing_is_taken_over_after_its_lease() {
    for backend in BACKENDS {
        a_holder_that_stopped_renewing_is_taken_over_after_its_lease_on(
            store(backend).await,
            &format!("{backend:?}"),
        )
        .await;
    }
}

async fn a_holder_that_stopped_renewing_is_taken_over_after_its_lease_on(
    store: Store,
    backend: &str,
) {
    let key = store.key("crashed");
    let lease = Duration::from_secs(1);
    // What `Lock` claims: the lease, and a record that lives twice as long.
    let crashed = ClaimRequest::new(key.clone(), Token::generate(), lease, lease * 2);
    let Claim::Acquired { fence } = store.store.claim(&crashed).await.unwrap() else {
        panic!("{backend:?}: the raw claim was refused");
    };
    let locks =
        Lock::new(store.store.clone(), Duration::from_secs(10)).wait(Duration::from_secs(10));
    assert!(
        locks.try_lock(key.clone()).await.unwrap().is_none(),
        "{backend:?}"
    );
    let next = locks.lock(key).await.unwrap();
    assert_eq!(next.fence(), fence + 1, "{backend:?}");
}

/// A critical section three times longer than the lease stays locked: the guard's watchdog
/// renews the lease, so no one else gets the key and the guard is not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_keeps_a_long_critical_section_locked() {
    for backend in BACKENDS {
        the_watchdog_keeps_a_long_critical_section_locked_on(
            store(backend).await,
            &format!("{backend:?}"),
        )
        .await;
    }
}

async fn the_watchdog_keeps_a_long_critical_section_locked_on(store: Store, backend: &str) {
    let lease = Duration::from_secs(1);
    let locks = Lock::new(store.store.clone(), lease);
    let key = store.key("long");
    let guard = locks.lock(key.clone()).await.unwrap();
    let until = tokio::time::Instant::now() + lease * 3;
    while tokio::time::Instant::now() < until {
        assert!(
            locks.try_lock(key.clone()).await.unwrap().is_none(),
            "{backend:?}"
        );
        tokio::time::sleep(lease / 4).await;
    }
    assert!(!guard.is_lost(), "{backend:?}");
    assert!(guard.unlock().await.unwrap(), "{backend:?}");
}

/// Every scenario above on a 3-master Redis Cluster this test starts (on free loopback
/// ports, removed at the end): each lock's record lives in its key's slot, on one node, and
/// the scenarios' keys spread over the masters.
#[test]
fn every_scenario_on_a_three_master_cluster() {
    let cluster = RedisCluster::start(3);
    let url = cluster.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let on = || async {
            let token = format!("{:?}", Token::generate());
            Store {
                store: Arc::new(connect(&url).await),
                prefix: format!("lock-{}", &token[6..token.len() - 1]),
                _table: None,
                // The cluster goes away with the test.
                redis: None,
            }
        };
        contenders_increment_a_counter_exactly_on(on().await, "cluster").await;
        a_held_lock_is_refused_and_unlock_frees_it_on(on().await, "cluster").await;
        a_dropped_guard_releases_the_key_on(on().await, "cluster").await;
        a_holder_that_stopped_renewing_is_taken_over_after_its_lease_on(on().await, "cluster")
            .await;
        the_watchdog_keeps_a_long_critical_section_locked_on(on().await, "cluster").await;
    });
}

/// A lease outside the supported range is refused before the store is asked.
#[tokio::test]
async fn an_invalid_lease_is_refused() {
    let locks = Lock::new(Arc::new(MemoryStore::new()), Duration::ZERO);
    let key = Key::new("lock", 1, &[&"k"]).unwrap();
    assert!(matches!(
        locks.lock(key).await,
        Err(Error::InvalidDuration {
            setting: "lease",
            ..
        })
    ));
}

/// A wait of `Duration::MAX` (no bound meant) waits, at most the longest supported duration,
/// instead of overflowing the clock: the free key is locked, and a held one is waited for
/// until its holder unlocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_wait_locks_and_waits_for_the_holder() {
    let locks =
        Lock::new(Arc::new(MemoryStore::new()), Duration::from_secs(30)).wait(Duration::MAX);
    let key = Key::new("lock", 1, &[&"forever"]).unwrap();
    let held = locks.lock(key.clone()).await.unwrap();
    let fence = held.fence();
    let waiter = tokio::spawn({
        let (locks, key) = (locks.clone(), key.clone());
        async move { locks.lock(key).await.map(|next| next.fence()) }
    });
    // The waiter is refused while the key is held, then takes it once it is unlocked.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(held.unlock().await.unwrap());
    assert!(waiter.await.unwrap().unwrap() > fence);
}

/// Outside a Tokio runtime a held lock could not renew its lease: `try_lock` and `lock` say
/// so with `Error::NoRuntime` before claiming, so the key is not left held until its lease
/// runs out.
#[test]
fn a_lock_outside_a_tokio_runtime_is_refused_and_holds_nothing() {
    let store = Arc::new(MemoryStore::new());
    let locks = Lock::new(store.clone(), Duration::from_secs(3600));
    let key = Key::new("lock", 1, &[&"no-runtime"]).unwrap();
    use futures_util::future::FutureExt as _;
    assert!(matches!(
        locks.try_lock(key.clone()).now_or_never(),
        Some(Err(Error::NoRuntime))
    ));
    assert!(matches!(
        locks.lock(key.clone()).now_or_never(),
        Some(Err(Error::NoRuntime))
    ));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        assert_eq!(store.read(&key).await.unwrap(), None, "a claim was left");
        assert!(locks.try_lock(key).await.unwrap().is_some());
    });
}

/// Behind a proxy that cuts every request, `lock` fails with `Error::Store` and leaves
/// nothing held; `unlock` that cannot reach the store fails too, and the key is given back in
/// the background once the store answers again, long before its 60 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_holds_nothing_and_an_unlock_is_retried() {
    let url = redis_url();
    let upstream = url.trim_start_matches("redis://").parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let through_proxy: SharedStore = Arc::new(connect(&proxy.url()).await);
    let direct = store(Backend::Redis).await;
    let key = direct.key("outage");
    let locks = Lock::new(through_proxy, Duration::from_secs(60)).wait(Duration::from_secs(10));

    proxy.chaos(1000, 0, 1);
    assert!(matches!(
        locks.lock(key.clone()).await,
        Err(Error::Store(_))
    ));
    proxy.calm();
    let guard = locks
        .try_lock(key.clone())
        .await
        .unwrap()
        .expect("the failed lock left the key held");

    proxy.chaos(1000, 0, 2);
    assert!(matches!(guard.unlock().await, Err(Error::Store(_))));
    proxy.calm();
    let others =
        Lock::new(direct.store.clone(), Duration::from_secs(60)).wait(Duration::from_secs(20));
    let started = tokio::time::Instant::now();
    let next = others.lock(key).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(next.unlock().await.unwrap());
    assert!(proxy.cut() > 0);
}
