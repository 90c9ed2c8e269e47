//! The Redis backend against real servers: the conformance suite on the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`) and on a 3-master Redis Cluster
//! started from `redis-server`; lost replies through a proxy that drops them; outages of a
//! server the test kills and restarts; the start-up safety checks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod conformance;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use conformance::{unique_namespace, Backend};
use idempotent::redis::{RedisStore, UnsafeConfig};
use idempotent::{
    Action, BoxFuture, Error, Guard, Key, RecordState, SharedStore, Store, StoreErrorKind,
};
use redis_server::{connect, delete_matching, redis_url, RedisCluster, RedisServer};

struct Standalone {
    store: Arc<RedisStore>,
    url: String,
    namespace: String,
}

impl Backend for Standalone {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        let (url, pattern) = (self.url.clone(), format!("{prefix}:*"));
        Box::pin(async move {
            tokio::task::spawn_blocking(move || delete_matching(&url, &pattern))
                .await
                .unwrap();
        })
    }
}

impl Drop for Standalone {
    fn drop(&mut self) {
        let (url, pattern) = (self.url.clone(), format!("{}:*", self.namespace));
        // A plain thread: the runtime may be shutting down.
        let _ = std::thread::spawn(move || delete_matching(&url, &pattern)).join();
    }
}

async fn standalone() -> Standalone {
    let url = redis_url();
    Standalone {
        store: Arc::new(connect(&url).await),
        url,
        namespace: unique_namespace(),
    }
}

conformance_suite!(standalone);

struct Cluster {
    store: Arc<RedisStore>,
    nodes: Vec<String>,
    namespace: String,
}

impl Backend for Cluster {
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn store(&self) -> SharedStore {
        self.store.clone()
    }
    fn lose_data<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, ()> {
        let (nodes, pattern) = (self.nodes.clone(), format!("{prefix}:*"));
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                for node in nodes {
                    delete_matching(&node, &pattern);
                }
            })
            .await
            .unwrap();
        })
    }
}

async fn on_cluster(cluster: &RedisCluster) -> Cluster {
    Cluster {
        store: Arc::new(connect(&cluster.url()).await),
        nodes: cluster.nodes.iter().map(RedisServer::url).collect(),
        namespace: unique_namespace(),
    }
}

/// The whole conformance suite on a 3-master cluster, started once for the sequence.
#[test]
fn conformance_on_a_three_master_cluster() {
    let cluster = RedisCluster::start(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        conformance_sequence!(on_cluster(&cluster));

        // A store on the application's own cluster client.
        let nodes: Vec<String> = cluster.nodes.iter().map(RedisServer::url).collect();
        let client = redis::cluster::ClusterClient::new(nodes).unwrap();
        let store: SharedStore = Arc::new(
            RedisStore::from_cluster_client(client)
                .on_unsafe_config(UnsafeConfig::Warn)
                .build()
                .await
                .unwrap(),
        );
        let guard = Guard::new(Duration::from_secs(60)).store(store);
        let run = |id: u32| {
            guard.run(Key::new("from-client", 1, &[&id]).unwrap(), async {
                Ok::<_, Error>(())
            })
        };
        run(1).await.unwrap();
        assert!(matches!(run(1).await, Err(Error::Duplicate { .. })));
    });
    // Records of many keys landed on every master: the hash tags spread them.
    for node in &cluster.nodes {
        let keys = node.cli(&["dbsize"]);
        assert!(
            keys.trim().parse::<u64>().unwrap() > 0,
            "a master got no keys"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Lost replies on a real connection.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_claim_reply_on_a_real_connection_is_resolved_as_ours() {
    let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    let store: SharedStore = Arc::new(connect(&proxy.url()).await);
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:lost-claim"), 1, &[&"order-1"]).unwrap();
    let executions = AtomicUsize::new(0);

    proxy.lose_reply_to(b"\r\nclaim\r\n");
    let out: Result<(), Error> = Guard::new(Duration::from_secs(60))
        .store(store.clone())
        .run(key.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    out.unwrap();
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!((record.state, record.fence), (RecordState::Completed, 1));
    delete_matching(&redis_url(), &format!("{namespace}:*"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_complete_reply_on_a_real_connection_is_resolved_as_completed() {
    let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    let store: SharedStore = Arc::new(connect(&proxy.url()).await);
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:lost-complete"), 1, &[&"order-2"]).unwrap();
    let guard = Guard::new(Duration::from_secs(60)).store(store.clone());

    proxy.lose_reply_to(b"\r\ncomplete\r\n");
    let first: Result<u32, Error> = guard
        .operation(key.clone())
        .replay()
        .run(async { Ok(7) })
        .await;
    assert_eq!(first.unwrap(), 7);
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    let again: Result<u32, Error> = guard.operation(key).replay().run(async { Ok(8) }).await;
    assert_eq!(again.unwrap(), 7);
    delete_matching(&redis_url(), &format!("{namespace}:*"));
}

// ---------------------------------------------------------------------------------------
// Outages.

/// A business table: applying an order's effect is a compare-and-set, like
/// `UPDATE orders SET status = 'CONSUMED' WHERE id = $1 AND status = 'INIT'`.
#[derive(Default, Clone)]
struct Orders(Arc<Mutex<HashSet<u32>>>);

impl Orders {
    fn consume(&self, id: u32) -> bool {
        self.0.lock().unwrap().insert(id)
    }
    async fn is_consumed(&self, id: u32) -> Result<bool, Error> {
        Ok(self.0.lock().unwrap().contains(&id))
    }
    fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Delivers one message the way a broker does: redelivered until the consumer acks it.
async fn deliver(
    store: &SharedStore,
    orders: &Orders,
    executions: &AtomicUsize,
    effects: &AtomicUsize,
    id: u32,
) -> usize {
    let key = Key::new("outage:order", 1, &[&id]).unwrap();
    let mut attempts = 0;
    loop {
        attempts += 1;
        let out: Result<(), Error> = Guard::new(Duration::from_secs(300))
            .lease(Duration::from_secs(2))
            .store(store.clone())
            .operation(key.clone())
            .done(|| orders.is_consumed(id))
            .run(async {
                executions.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
                if orders.consume(id) {
                    effects.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            })
            .await;
        match out {
            Ok(()) => return attempts,
            Err(e) if e.action() == Action::Ack => return attempts,
            Err(e) => {
                assert!(attempts < 2_000, "message {id} never settled: {e:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_fails_closed_and_processing_resumes() {
    let mut server = RedisServer::start(&[]);
    let store = Arc::new(connect(&server.url()).await);
    let shared: SharedStore = store.clone();
    let guard = Guard::new(Duration::from_secs(300)).store(shared.clone());
    let executions = AtomicUsize::new(0);

    for id in 0..10u32 {
        let key = Key::new("outage", 1, &[&id]).unwrap();
        let out: Result<(), Error> = guard
            .run(key, async {
                executions.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await;
        out.unwrap();
    }

    server.kill();
    for id in 10..20u32 {
        let key = Key::new("outage", 1, &[&id]).unwrap();
        let out: Result<(), Error> = guard
            .run(key, async {
                executions.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await;
        match out {
            Err(err @ Error::Store(_)) => assert_eq!(err.action(), Action::Redeliver),
            other => panic!("a handler ran or succeeded without Redis: {other:?}"),
        }
    }
    assert_eq!(
        executions.load(Ordering::SeqCst),
        10,
        "handlers ran while the store was down"
    );

    // Back, empty: the first commands may still meet the reconnection.
    server.restart();
    let orders = Orders::default();
    let effects = AtomicUsize::new(0);
    for id in 10..20u32 {
        deliver(&shared, &orders, &executions, &effects, id).await;
    }
    assert_eq!(effects.load(Ordering::SeqCst), 10);
    assert_eq!(executions.load(Ordering::SeqCst), 20);
    assert_eq!(store.history_resets(), 1, "the restart was not noticed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restart_mid_run_keeps_effects_exactly_once_with_the_done_fallback() {
    let mut server = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(connect(&server.url()).await);
    let orders = Orders::default();
    let executions = Arc::new(AtomicUsize::new(0));
    let effects = Arc::new(AtomicUsize::new(0));
    const ORDERS: u32 = 300;

    // Every order arrives three times, from 24 concurrent consumers.
    let queue: Arc<Mutex<Vec<u32>>> = Arc::new(Mutex::new(
        (0..ORDERS).flat_map(|id| [id, id, id]).rev().collect(),
    ));
    let consumers: Vec<_> = (0..24)
        .map(|_| {
            let (store, orders, queue) = (store.clone(), orders.clone(), queue.clone());
            let (executions, effects) = (executions.clone(), effects.clone());
            tokio::spawn(async move {
                loop {
                    let Some(id) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    deliver(&store, &orders, &executions, &effects, id).await;
                }
            })
        })
        .collect();

    // Restart Redis, empty, once a third of the orders are consumed.
    while orders.count() < ORDERS as usize / 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.restart();
    for c in consumers {
        c.await.unwrap();
    }
    assert_eq!(
        effects.load(Ordering::SeqCst),
        ORDERS as usize,
        "effects are not exactly once"
    );
    assert_eq!(orders.count(), ORDERS as usize);
    let executions = executions.load(Ordering::SeqCst);
    eprintln!(
        "orders={ORDERS} deliveries={} executions={executions} effects={ORDERS}",
        ORDERS * 3
    );
    assert!(executions >= ORDERS as usize);
}

// ---------------------------------------------------------------------------------------
// Start-up safety checks and server replies.

#[tokio::test]
async fn eviction_policies_that_drop_records_are_refused() {
    for policy in ["allkeys-lru", "volatile-ttl", "volatile-lru"] {
        let server = RedisServer::start(&["--maxmemory-policy", policy]);
        let err = RedisStore::connect(&server.url()).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Unsafe, "{policy}: {err}");
        assert!(err.to_string().contains(policy), "{err}");
        // By option, a warning instead.
        RedisStore::builder(&server.url())
            .on_unsafe_config(UnsafeConfig::Warn)
            .build()
            .await
            .unwrap();
    }
    let server = RedisServer::start(&["--maxmemory-policy", "noeviction"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let health = store.check().await.unwrap();
    assert!(health.unsafe_config.is_empty());
    assert!(health.run_id.is_some());
    assert!(
        health.warnings.iter().any(|w| w.contains("no persistence")),
        "{health:?}"
    );
}

#[tokio::test]
async fn a_replica_is_refused() {
    let primary = RedisServer::start(&[]);
    let port = primary.port().to_string();
    let replica = RedisServer::start(&["--replicaof", "127.0.0.1", &port]);
    let err = RedisStore::connect(&replica.url()).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unsafe);
    assert!(
        err.to_string().contains("slave") || err.to_string().contains("replica"),
        "{err}"
    );
}

#[tokio::test]
async fn persistence_is_not_warned_about_when_enabled() {
    let server = RedisServer::start(&["--appendonly", "yes"]);
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let health = store.check().await.unwrap();
    assert!(
        !health.warnings.iter().any(|w| w.contains("persistence")),
        "{health:?}"
    );
}

#[tokio::test]
async fn out_of_memory_fails_closed() {
    let server = RedisServer::start(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"]);
    let store: SharedStore = Arc::new(RedisStore::connect(&server.url()).await.unwrap());
    // Fill the server until it refuses writes.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    // Large values first, then small ones: Redis counts a command's own size, so only small
    // writes show that the memory is really full.
    for size in [64 * 1024, 1024, 64] {
        let blob = vec![b'x'; size];
        for i in 0.. {
            let r: redis::RedisResult<()> = redis::cmd("SET")
                .arg(format!("fill:{size}:{i}"))
                .arg(&blob)
                .query(&mut conn);
            if r.is_err() {
                break;
            }
            assert!(i < 1_000_000, "the server never ran out of memory");
        }
    }
    let executions = AtomicUsize::new(0);
    let out: Result<(), Error> = Guard::new(Duration::from_secs(60))
        .store(store)
        .run(Key::new("oom", 1, &[&1u8]).unwrap(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    match out {
        Err(Error::Store(err)) => assert_eq!(err.kind(), StoreErrorKind::Unavailable),
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(executions.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn scripts_are_reloaded_after_a_flush() {
    let server = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(RedisStore::connect(&server.url()).await.unwrap());
    let guard = Guard::new(Duration::from_secs(60)).store(store);
    let run = |id: u32| {
        guard.run(Key::new("flush", 1, &[&id]).unwrap(), async {
            Ok::<_, Error>(())
        })
    };
    run(1).await.unwrap();
    assert!(server.cli(&["script", "flush"]).contains("OK"));
    run(2).await.unwrap();
    assert!(matches!(run(1).await, Err(Error::Duplicate { .. })));
}

#[tokio::test]
async fn a_store_on_an_existing_client() {
    let client = redis::Client::open(redis_url()).unwrap();
    let store: SharedStore = Arc::new(
        RedisStore::from_client(client)
            .on_unsafe_config(UnsafeConfig::Warn)
            .build()
            .await
            .unwrap(),
    );
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:client"), 1, &[&1u8]).unwrap();
    let guard = Guard::new(Duration::from_secs(60)).store(store);
    guard
        .run(key.clone(), async { Ok::<_, Error>(()) })
        .await
        .unwrap();
    assert!(matches!(
        guard.run(key, async { Ok::<_, Error>(()) }).await,
        Err(Error::Duplicate { .. })
    ));
    delete_matching(&redis_url(), &format!("{namespace}:*"));
}

#[tokio::test]
async fn unreachable_server_is_a_typed_error() {
    let port = redis_server::free_port();
    let err = RedisStore::connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    let Err(err) = idempotent::connect(&format!("redis://user:secret@127.0.0.1:{port}")).await
    else {
        panic!("connected to a closed port");
    };
    assert!(
        !format!("{err} {err:?}").contains("secret"),
        "the password leaked: {err:?}"
    );
}
