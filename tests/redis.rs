//! The Redis backend against real servers: the conformance suite on the Redis at
//! `IDEMPOTENT_REDIS_URL` (default `redis://127.0.0.1:6379`) and on a 3-master Redis Cluster
//! started from `redis-server`; lost replies through a proxy that drops them; outages of a
//! server the test kills and restarts; the start-up safety checks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/claim_rule.rs"]
mod claim_rule;
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
use idempotency::admin::{Admin, AdminOutcome, ListQuery, StateFilter};
use idempotency::redis::{RedisStore, UnsafeConfig};
use idempotency::store::{
    BoxFuture, Claim, ClaimRequest, Completion, Ending, Expect, OperatorStore, RecordState,
    SharedOperatorStore, Store, StoreErrorKind, Token, DEFAULT_MAX_RESULT_SIZE, MAX_DURATION,
};
use idempotency::{Action, Error, Idempotency, Key, SharedStore};
use redis_server::{
    connect, connect_with_clock_error, delete_matching, redis_url, RedisCluster, RedisServer,
};

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

impl conformance::OperatorBackend for Standalone {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
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

/// The conformance suite again with every claim by script (no `SET ... NX GET` fast claim),
/// so both claim paths meet every rule.
mod script_claims {
    use super::*;

    async fn standalone_by_script() -> Standalone {
        let url = redis_url();
        Standalone {
            store: Arc::new(redis_server::connect_with(&url, false).await),
            url,
            namespace: unique_namespace(),
        }
    }

    conformance_suite!(standalone_by_script);
}

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

impl conformance::OperatorBackend for Cluster {
    fn operator_store(&self) -> SharedOperatorStore {
        self.store.clone()
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
        let client = redis::cluster::ClusterClient::new(nodes.clone()).unwrap();
        let store: SharedStore = Arc::new(
            RedisStore::from_cluster_client(client)
                .on_unsafe_config(UnsafeConfig::Warn)
                .build()
                .await
                .unwrap(),
        );
        let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
        let run = |id: u32| {
            guard.run(Key::new("from-client", 1, &[&id]).unwrap(), async {
                Ok::<_, Error>(())
            })
        };
        run(1).await.unwrap();
        assert!(matches!(run(1).await, Err(Error::Duplicate { .. })));

        // Values that are not records, on whichever master holds their slot.
        let client = redis::cluster::ClusterClient::new(nodes).unwrap();
        let mut conn = client.get_async_connection().await.unwrap();
        for (i, command) in ["SET", "HSET"].into_iter().enumerate() {
            let key = Key::new("cluster-corrupt", 1, &[&(i as u64)]).unwrap();
            let mut cmd = redis::cmd(command);
            cmd.arg(key.as_bytes());
            if command == "HSET" {
                cmd.arg("field");
            }
            let () = cmd
                .arg("not a record")
                .query_async::<redis::Value>(&mut conn)
                .await
                .map(drop)
                .unwrap();
            let req = claim_request(&key, Duration::from_secs(60), Duration::from_secs(60));
            let kinds = [
                store.claim(&req).await.err().map(|e| e.kind()),
                store.read(&key).await.err().map(|e| e.kind()),
                store.is_completed(&key).await.err().map(|e| e.kind()),
                store.claim_many(std::slice::from_ref(&req)).await[0]
                    .as_ref()
                    .err()
                    .map(|e| e.kind()),
            ];
            assert_eq!(kinds, [Some(StoreErrorKind::Corrupt); 4], "{command}");
        }
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

/// Batches while the cluster moves slots between masters: the store groups a batch's keys by
/// the node its map of the slots names, so after a reshard the old node answers `MOVED` for
/// the keys it gave away; each such key is sent again on its own and the handlers still run
/// once per key. The slots move twice: between two batches (the second batch's claims meet
/// `MOVED`, the map read by the first batch being fresh enough to be kept), and while a
/// batch's handlers run (its endings meet `MOVED`). The nodes' `INFO errorstats` show
/// that the `MOVED` replies happened.
#[test]
fn batches_follow_slots_moved_during_a_reshard_and_run_each_key_once() {
    let cluster = RedisCluster::start(3);
    let ports: Vec<u16> = cluster.nodes.iter().map(RedisServer::port).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store: SharedStore = Arc::new(connect(&cluster.url()).await);
        let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
        let key = |id: u32| Key::new("reshard", 1, &[&id]).unwrap();
        let items = |ids: std::ops::Range<u32>| -> Vec<(Key, u32)> {
            ids.map(|id| (key(id), id)).collect()
        };
        let executions = Arc::new(AtomicUsize::new(0));
        let counted = |id: u32| {
            let executions = executions.clone();
            async move {
                executions.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(id)
            }
        };

        let first: Vec<Result<u32, Error>> = guard.run_batch(items(0..40), counted).await;
        assert!(first.iter().all(Result::is_ok), "{first:?}");

        // The slots of the keys of every batch that the first master serves now.
        let keys: Vec<Vec<u8>> = (0..120).map(|id| key(id).as_bytes().to_vec()).collect();
        let slots = {
            let ports = ports.clone();
            tokio::task::spawn_blocking(move || slots_served_by(&ports, 0, &keys))
                .await
                .unwrap()
        };
        assert!(
            slots.len() > 5,
            "the first master serves few of the keys: {slots:?}"
        );

        // Between two batches: from the first master to the second.
        let moved_before = moved_replies(ports[0]);
        {
            let (ports, slots) = (ports.clone(), slots.clone());
            tokio::task::spawn_blocking(move || migrate_slots(&ports, &slots, 0, 1))
                .await
                .unwrap();
        }
        let second: Vec<Result<u32, Error>> = guard.run_batch(items(0..80), counted).await;
        for (id, out) in (0..80u32).zip(&second) {
            match (id < 40, out) {
                (true, Err(Error::Duplicate { .. })) | (false, Ok(_)) => {}
                other => panic!("key {id}: {other:?}"),
            }
        }
        assert!(
            moved_replies(ports[0]) > moved_before,
            "the claims never met a MOVED reply"
        );
        assert_eq!(executions.load(Ordering::SeqCst), 80);

        // While the handlers run: from the second master to the third, before any of the
        // batch's items ends.
        let moved_before = moved_replies(ports[1]);
        let resharded = Arc::new(tokio::sync::Notify::new());
        let moving = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let moved = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let third: Vec<Result<u32, Error>> = guard
            .run_batch(items(80..120), |id| {
                let (ports, slots) = (ports.clone(), slots.clone());
                let (resharded, moving, moved, executions) = (
                    resharded.clone(),
                    moving.clone(),
                    moved.clone(),
                    executions.clone(),
                );
                async move {
                    executions.fetch_add(1, Ordering::SeqCst);
                    // Registered before the flag is read: no wake-up is missed.
                    let wait = resharded.notified();
                    if moving.swap(true, Ordering::SeqCst) {
                        if !moved.load(Ordering::SeqCst) {
                            wait.await;
                        }
                    } else {
                        tokio::task::spawn_blocking(move || migrate_slots(&ports, &slots, 1, 2))
                            .await
                            .unwrap();
                        moved.store(true, Ordering::SeqCst);
                        resharded.notify_waiters();
                    }
                    Ok::<_, Error>(id)
                }
            })
            .await;
        assert!(third.iter().all(Result::is_ok), "{third:?}");
        assert!(
            moved_replies(ports[1]) > moved_before,
            "the endings never met a MOVED reply"
        );
        assert_eq!(executions.load(Ordering::SeqCst), 120);

        // Every record is completed where the cluster now keeps it, and a redelivery of every
        // key runs nothing.
        for id in 0..120 {
            let record = store.read(&key(id)).await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Completed, "key {id}");
        }
        let again: Vec<Result<u32, Error>> = guard.run_batch(items(0..120), counted).await;
        assert!(again
            .iter()
            .all(|out| matches!(out, Err(Error::Duplicate { .. }))));
        assert_eq!(executions.load(Ordering::SeqCst), 120);
    });
}

/// A plain connection to one node of a test cluster.
fn node(port: u16) -> redis::Connection {
    raw(&format!("redis://127.0.0.1:{port}"))
}

/// The `MOVED` replies a node has sent so far (`INFO errorstats`).
fn moved_replies(port: u16) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("errorstats")
        .query(&mut node(port))
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("errorstat_MOVED:count="))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// The distinct slots of `keys` that the node `ports[owner]` serves.
fn slots_served_by(ports: &[u16], owner: usize, keys: &[Vec<u8>]) -> Vec<u16> {
    let mut conn = node(ports[owner]);
    let ranges: redis::Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).unwrap();
    let redis::Value::Array(ranges) = ranges else {
        panic!("CLUSTER SLOTS: {ranges:?}");
    };
    let served: Vec<(u16, u16)> = ranges
        .iter()
        .filter_map(|range| {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let int = |v: &redis::Value| match v {
                redis::Value::Int(n) => *n,
                other => panic!("CLUSTER SLOTS field: {other:?}"),
            };
            let redis::Value::Array(primary) = &fields[2] else {
                panic!("CLUSTER SLOTS node: {:?}", fields[2]);
            };
            (int(&primary[1]) == i64::from(ports[owner]))
                .then(|| (int(&fields[0]) as u16, int(&fields[1]) as u16))
        })
        .collect();
    let mut slots: Vec<u16> = keys
        .iter()
        .map(|key| {
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(key)
                .query::<u16>(&mut conn)
                .unwrap()
        })
        .filter(|slot| served.iter().any(|(lo, hi)| (lo..=hi).contains(&slot)))
        .collect();
    slots.sort_unstable();
    slots.dedup();
    slots
}

/// Moves `slots` with their keys from the node `ports[from]` to the node `ports[to]`, as
/// `redis-cli --cluster reshard` does: importing and migrating, `MIGRATE` of the keys, then
/// the new owner announced to every node.
fn migrate_slots(ports: &[u16], slots: &[u16], from: usize, to: usize) {
    let id = |port: u16| -> String {
        redis::cmd("CLUSTER")
            .arg("MYID")
            .query(&mut node(port))
            .unwrap()
    };
    let (source_id, target_id) = (id(ports[from]), id(ports[to]));
    let (mut source, mut target) = (node(ports[from]), node(ports[to]));
    for &slot in slots {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("IMPORTING")
            .arg(&source_id)
            .query(&mut target)
            .unwrap();
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("MIGRATING")
            .arg(&target_id)
            .query(&mut source)
            .unwrap();
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(100)
                .query(&mut source)
                .unwrap();
            if keys.is_empty() {
                break;
            }
            let _: redis::Value = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(ports[to])
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query(&mut source)
                .unwrap();
        }
        for &port in [ports[to], ports[from]].iter().chain(
            ports
                .iter()
                .filter(|&&p| p != ports[to] && p != ports[from]),
        ) {
            let () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("NODE")
                .arg(&target_id)
                .query(&mut node(port))
                .unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Lost replies on a real connection.

/// A claim whose reply is lost (the proxy drops it after the server applied the claim) is
/// resolved by reading the record back by token: ours, so the handler runs once. For the
/// fast claim (`SET ... NX GET`) and for the claim script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_claim_reply_on_a_real_connection_is_resolved_as_ours() {
    for (fast, marker) in [(true, &b"\r\nNX\r\n"[..]), (false, &b"\r\nclaim\r\n"[..])] {
        lost_claim_reply(fast, marker).await;
    }
}

async fn lost_claim_reply(fast: bool, marker: &[u8]) {
    let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    // Without the wider clock error, a loaded machine's fast claim could go to the script,
    // and the proxy would never see its marker. 20 ms, for a 30 s lease.
    let clock_error = Duration::from_millis(20);
    let store: SharedStore =
        Arc::new(connect_with_clock_error(&proxy.url(), fast, Some(clock_error)).await);
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:lost-claim"), 1, &[&"order-1"]).unwrap();
    let executions = AtomicUsize::new(0);
    let before = server_micros(&redis_url());

    proxy.lose_reply_to(marker);
    let out: Result<(), Error> = Idempotency::new(Duration::from_secs(60))
        .lease(Duration::from_secs(30))
        .store(store.clone())
        .run(key.clone(), async {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    out.unwrap();
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply (fast: {fast})");
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    let record = store.read(&key).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
    // One acquisition of a new key: its fence is the server's clock at the claim (the fast
    // claim's fence is at most twice the clock's error above it).
    let slack = if fast {
        2 * u64::try_from(clock_error.as_micros()).unwrap()
    } else {
        0
    };
    assert!(
        (before..=server_micros(&redis_url()) + slack).contains(&record.fence),
        "fence {} is not the time of the only claim (fast: {fast})",
        record.fence
    );
    delete_matching(&redis_url(), &format!("{namespace}:*"));
}

/// A batch whose claim pipeline loses its reply (the server applied every claim, the
/// connection is cut before the answers come back): each item reads its record back by token
/// and finds its own claim, so every handler runs once and nothing is left claimed. For the
/// pipeline of fast claims (`SET ... NX GET`) and for the pipeline of scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_reply_to_a_batch_claim_is_resolved_item_by_item() {
    for (fast, marker) in [(true, &b"\r\nNX\r\n"[..]), (false, &b"\r\nclaim\r\n"[..])] {
        let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
        // Without the wider clock error, a loaded machine's claims could go to the script,
        // and no pipeline would carry the fast claim's marker. 20 ms, for a 30 s lease.
        let store: SharedStore = Arc::new(
            connect_with_clock_error(&proxy.url(), fast, Some(Duration::from_millis(20))).await,
        );
        let namespace = unique_namespace();
        let items: Vec<(Key, u32)> = (0..30u32)
            .map(|id| {
                let key = Key::new(&format!("{namespace}:lost-batch-claim"), 1, &[&id]).unwrap();
                (key, id)
            })
            .collect();
        let guard = Idempotency::new(Duration::from_secs(60))
            .lease(Duration::from_secs(30))
            .store(store.clone());
        let executions = AtomicUsize::new(0);
        let handler = |id: u32| {
            let executions = &executions;
            async move {
                executions.fetch_add(1, Ordering::SeqCst);
                Ok::<_, Error>(id)
            }
        };
        proxy.lose_reply_to(marker);
        let out: Vec<Result<u32, Error>> = guard.run_batch(items.clone(), handler).await;
        assert_eq!(proxy.lost(), 1, "the proxy lost no reply (fast: {fast})");
        assert_eq!(
            out.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            (0..30u32).collect::<Vec<_>>(),
            "fast: {fast}"
        );
        assert_eq!(executions.load(Ordering::SeqCst), 30, "fast: {fast}");
        for (key, _) in &items {
            let record = store.read(key).await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Completed, "{key} (fast: {fast})");
        }
        delete_matching(&redis_url(), &format!("{namespace}:*"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_complete_reply_on_a_real_connection_is_resolved_as_completed() {
    let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    let store: SharedStore = Arc::new(connect(&proxy.url()).await);
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:lost-complete"), 1, &[&"order-2"]).unwrap();
    let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());

    proxy.lose_reply_to(&ending_script_sha());
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

/// A server that does not have the scripts (a fresh server, or after `SCRIPT FLUSH`): the
/// claim and ending pipelines meet `NOSCRIPT` for every item, the script is loaded and the
/// items are sent again in one more pipeline, and the batch runs each handler once. A server
/// of the test's own, so that flushing its scripts touches no other test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_on_a_server_without_the_scripts_load_them_and_run_once() {
    let server = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(connect(&server.url()).await);
    let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
    let executions = AtomicUsize::new(0);
    let handler = |id: u32| {
        let executions = &executions;
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(id)
        }
    };
    let mut conn = raw(&server.url());
    for round in 0..2u32 {
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
        let items: Vec<(Key, u32)> = (0..20u32)
            .map(|id| (Key::new("noscript", 1, &[&round, &id]).unwrap(), id))
            .collect();
        let out: Vec<Result<u32, Error>> = guard.run_batch(items.clone(), handler).await;
        assert_eq!(
            out.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            (0..20u32).collect::<Vec<_>>()
        );
        for (key, _) in &items {
            let record = store.read(key).await.unwrap().unwrap();
            assert_eq!(record.state, RecordState::Completed, "{key}");
        }
        let again: Vec<Result<u32, Error>> = guard.run_batch(items, handler).await;
        assert!(again
            .iter()
            .all(|out| matches!(out, Err(Error::Duplicate { .. }))));
    }
    assert_eq!(executions.load(Ordering::SeqCst), 40);
}

/// A batch whose ending pipeline loses its reply (the server applied every completion,
/// the connection is cut before the answers come back): each item reads its record back by
/// token and finds it completed, every handler ran once, and a redelivery of the batch
/// replays every result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_reply_to_a_batch_ending_is_resolved_item_by_item() {
    let proxy = proxy::Proxy::start("127.0.0.1:6379".parse().unwrap()).await;
    let store: SharedStore = Arc::new(connect(&proxy.url()).await);
    let namespace = unique_namespace();
    let items = || -> Vec<(Key, u32)> {
        (0..40u32)
            .map(|id| {
                (
                    Key::new(&format!("{namespace}:lost-batch"), 1, &[&id]).unwrap(),
                    id,
                )
            })
            .collect()
    };
    let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
    let executions = AtomicUsize::new(0);
    let handler = |id: u32| {
        let executions = &executions;
        async move {
            executions.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>(id * 3)
        }
    };
    proxy.lose_reply_to(&ending_script_sha());
    let first: Vec<Result<u32, Error>> = guard.batch().replay().run(items(), handler).await;
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    assert_eq!(executions.load(Ordering::SeqCst), 40);
    for (id, out) in (0..40u32).zip(&first) {
        assert_eq!(out.as_ref().unwrap(), &(id * 3), "{id}");
    }
    for (key, _) in items() {
        let record = store.read(&key).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed, "{key}");
    }
    let again: Vec<Result<u32, Error>> = guard.batch().replay().run(items(), handler).await;
    assert_eq!(executions.load(Ordering::SeqCst), 40);
    assert_eq!(
        again.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        (0..40u32).map(|id| id * 3).collect::<Vec<_>>()
    );
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
        let out: Result<(), Error> = Idempotency::new(Duration::from_secs(300))
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
                assert!(attempts < 2_000, "message {id} never ended: {e:?}");
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
    let guard = Idempotency::new(Duration::from_secs(300)).store(shared.clone());
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
    // The state-only read (the HTTP layer's upgrade check) fails as a read does: never a
    // "not completed" that would let a request completed before run again.
    let done = Key::new("outage", 1, &[&0u32]).unwrap();
    // So does the read sent with a claim, and the claim fails with it.
    let minute = Duration::from_secs(60);
    let fresh = Key::new("outage", 1, &[&99u32]).unwrap();
    let fresh = Arc::new(ClaimRequest::new(fresh, Token::generate(), minute, minute));
    let (claimed, read) = store
        .clone()
        .claim_and_is_completed(fresh, done.clone())
        .expect("a Redis store on one server sends a claim and a read together")
        .await;
    assert!(claimed.is_err(), "claimed without Redis: {claimed:?}");
    for (what, err) in [
        ("read", store.read(&done).await.err()),
        ("is_completed", store.is_completed(&done).await.err()),
        ("claim_and_is_completed", read.err()),
    ] {
        let err = err.unwrap_or_else(|| panic!("{what} answered without Redis"));
        assert!(!err.is_permanent(), "{what}: {err:?}");
    }
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

/// The futures of the calls a run makes (its claim, its completion, the check of a key's
/// record) stay small: the paths of a call through Sentinel (which may follow a failover)
/// and of a durable write (a pipeline with its `WAIT`) are boxed where they branch off, so a
/// call on one server does not carry them (with them, each was 3.5 to 4 KB). Every call is
/// boxed, so copied whole, as it is made, three a request through the HTTP layer. Each call
/// is awaited, so the futures measured are the ones that run.
#[tokio::test]
async fn a_store_call_future_does_not_carry_the_failover_or_durable_paths() {
    const AT_MOST: usize = 1024;
    let backend = standalone().await;
    let store = backend.store.as_ref();
    let key = Key::new(&format!("{}:future-size", backend.namespace), 1, &[&1u32]).unwrap();
    let token = Token::generate();
    let minute = Duration::from_secs(60);
    let req = ClaimRequest::new(key.clone(), token, minute, minute * 10);
    let claim = store.claim(&req);
    let claim_size = std::mem::size_of_val(&*claim);
    let fence = match claim.await.unwrap() {
        Claim::Acquired { fence } => fence,
        other => panic!("a fresh key was not acquired: {other:?}"),
    };
    let done = Completion::new(Some(b"receipt".to_vec()), minute)
        .for_claim(idempotency::store::AcquiredClaim::new(fence, None));
    let complete = store.complete(&key, &token, &done);
    let complete_size = std::mem::size_of_val(&*complete);
    assert!(complete.await.unwrap());
    let is_completed = store.is_completed(&key);
    let is_completed_size = std::mem::size_of_val(&*is_completed);
    assert!(is_completed.await.unwrap());
    // A claim with a read in its round trip (the HTTP layer's fresh requests).
    let other = Key::new(&format!("{}:future-size", backend.namespace), 1, &[&2u32]).unwrap();
    let again = ClaimRequest::new(other, Token::generate(), minute, minute * 10);
    let both = backend
        .store
        .clone()
        .claim_and_is_completed(Arc::new(again), key.clone())
        .expect("a Redis store on one server sends a claim and a read together");
    let both_size = std::mem::size_of_val(&*both);
    let (claimed, read) = both.await;
    assert!(matches!(claimed, Ok(Claim::Acquired { .. })), "{claimed:?}");
    assert!(read.unwrap());
    for (call, size) in [
        ("claim", claim_size),
        ("complete", complete_size),
        ("is_completed", is_completed_size),
        ("claim_and_is_completed", both_size),
    ] {
        assert!(size <= AT_MOST, "{call}: a {size}-byte future");
    }
}

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
    let out: Result<(), Error> = Idempotency::new(Duration::from_secs(60))
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
    let guard = Idempotency::new(Duration::from_secs(60)).store(store);
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
    let guard = Idempotency::new(Duration::from_secs(60)).store(store);
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
    let Err(err) = idempotency::connect(&format!("redis://user:secret@127.0.0.1:{port}")).await
    else {
        panic!("connected to a closed port");
    };
    assert!(
        !format!("{err} {err:?}").contains("secret"),
        "the password leaked: {err:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Fences, unreadable records, result sizes and durations.

/// The server's clock, in microseconds since the Unix epoch.
fn server_micros(url: &str) -> u64 {
    let mut conn = raw(url);
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    secs * 1_000_000 + micros
}

/// A plain connection, for writing what the store never would.
fn raw(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

/// Calls of `command` the server `server` has answered (`INFO commandstats`).
fn calls(server: &RedisServer, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// Over a link whose round trip is longer than 2 ms, the server's clock cannot be read
/// precisely enough for the fast claim's default bound (1 ms), and claims go through the
/// script; a store that accepts a larger error claims there with `SET ... NX GET`. A bound
/// over 100 ms is refused. (A private server: its command counts are this test's alone.)
#[tokio::test]
async fn a_larger_clock_error_bound_keeps_claims_fast_over_a_slow_link() {
    let server = RedisServer::start(&[]);
    let proxy = proxy::Proxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    // Each reply 6 ms late: half a round trip, the reading's error, is at least 3 ms.
    proxy.delay_replies(Duration::from_millis(6));
    let minute = Duration::from_secs(60);
    for (bound, fast) in [(None, false), (Some(Duration::from_millis(20)), true)] {
        let mut builder = RedisStore::builder(&proxy.url()).on_unsafe_config(UnsafeConfig::Warn);
        if let Some(bound) = bound {
            builder = builder.fast_claim_max_error(bound);
        }
        let store = builder.build().await.unwrap();
        let scripts = || calls(&server, "evalsha") + calls(&server, "eval");
        let (sets, scripted) = (calls(&server, "set"), scripts());
        for i in 0..5u32 {
            let key = Key::new("slow-link", 1, &[&u32::from(fast), &i]).unwrap();
            let claim = store
                .claim(&claim_request(&key, minute, minute))
                .await
                .unwrap();
            assert!(matches!(claim, Claim::Acquired { .. }), "{claim:?}");
        }
        let (sets, scripted) = (calls(&server, "set") - sets, scripts() - scripted);
        // (`INFO commandstats` counts the commands a script runs too.)
        if fast {
            assert_eq!(
                (sets, scripted),
                (5, 0),
                "bound {bound:?}: every claim a SET"
            );
        } else {
            assert!(scripted >= 5, "bound {bound:?}: every claim by the script");
        }
    }
    let refused = RedisStore::builder(&proxy.url())
        .fast_claim_max_error(Duration::from_millis(101))
        .build()
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), StoreErrorKind::Rejected, "{refused}");
}

/// The store reads the server's clock when it is built. On a loaded machine that first reply
/// can come late, too late for the fast claim's bound: the clock is then read again on a
/// claim after 5 ms (doubling while readings stay imprecise), not after the usual 500 ms, so
/// claims go back to one `SET` within milliseconds. (A private server: its script count is
/// this test's alone.)
#[tokio::test]
async fn a_late_first_clock_reading_is_taken_again_on_the_next_claim() {
    let server = RedisServer::start(&[]);
    let proxy = proxy::Proxy::start(format!("127.0.0.1:{}", server.port()).parse().unwrap()).await;
    // The build's replies 6 ms late: its reading's error is at least 3 ms, over the 1 ms bound.
    proxy.delay_replies(Duration::from_millis(6));
    let store = RedisStore::builder(&proxy.url())
        .on_unsafe_config(UnsafeConfig::Warn)
        .build()
        .await
        .unwrap();
    proxy.delay_replies(Duration::ZERO);
    // The proxy counts the store's next `TIME` (the claim script reads the clock too, but
    // inside the server).
    proxy.before_requests(b"$4\r\nTIME\r\n", 1, &["PING"]);
    tokio::time::sleep(Duration::from_millis(10)).await;

    // One claim, by the script (no precise reading yet); it starts a new reading at once.
    let hour = Duration::from_secs(3600);
    let scripts = || calls(&server, "evalsha") + calls(&server, "eval");
    let before = scripts();
    let key = Key::new("late-clock", 1, &[&"first"]).unwrap();
    acquired(store.claim(&claim_request(&key, hour, hour)).await.unwrap());
    assert!(
        scripts() > before,
        "the first claim went through the script"
    );
    let started = std::time::Instant::now();
    while proxy.befores() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the claim did not read the server's clock again"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The reading is precise unless the machine is loaded: then the next readings are.
    until_claims_are_fast(&store, &server.url(), "late-clock").await;
}

fn claim_request(key: &Key, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(key.clone(), Token::generate(), lease, ttl)
}

/// The SHA1 of the store's ending script, which every completion and release names:
/// what the proxy looks for to lose the reply to an ending.
fn ending_script_sha() -> Vec<u8> {
    redis::Script::new(include_str!(
        "../idempotent-runtime/src/store/redis/ending.lua"
    ))
    .get_hash()
    .as_bytes()
    .to_vec()
}

fn acquired(claim: Claim) -> u64 {
    match claim {
        Claim::Acquired { fence } => fence,
        other => panic!("expected an acquired claim, got {other:?}"),
    }
}

/// How many times the server ran each of `commands` so far (`INFO commandstats`).
fn command_calls(url: &str, commands: &[&str]) -> Vec<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut raw(url))
        .unwrap();
    commands
        .iter()
        .map(|name| {
            info.lines()
                .find_map(|line| line.strip_prefix(&format!("cmdstat_{name}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        })
        .collect()
}

/// The `SET`s and `EVALSHA`s the server ran since `before` (`command_calls` of both).
fn set_and_script_calls_since(url: &str, before: &[u64]) -> (u64, u64) {
    let now = command_calls(url, &["set", "evalsha"]);
    (now[0] - before[0], now[1] - before[1])
}

/// Claims `key` with a short lease, which the script claims: the script is loaded after it.
async fn load_the_claim_script(store: &RedisStore, key: &Key) {
    let short = claim_request(key, Duration::from_millis(500), Duration::from_secs(3600));
    acquired(store.claim(&short).await.unwrap());
}

/// How far above the server's clock a fast claim's fence may be: the estimate is at most the
/// reading's error (the store's default bound, 1 ms) above the server's clock, and the fence
/// adds that error once more so that it is never below it.
const FAST_FENCE_ABOVE_CLOCK_US: u64 = 2 * 1_000;

/// Claims fresh keys under `prefix` until one is decided by one `SET` and no script: the
/// store's reading of the server's clock is then precise enough for the fast claim, and the
/// counts a test takes next are the fast claim's. The reading taken when the store was built
/// can be too imprecise on a loaded machine (a reply later than 2 ms); the store then reads
/// the clock again on a claim after 5 ms, then less and less often, up to every 500 ms.
/// Gives up after 10 s.
async fn until_claims_are_fast(store: &RedisStore, url: &str, prefix: &str) {
    let hour = Duration::from_secs(3600);
    for attempt in 0..40u32 {
        let key = Key::new(prefix, 1, &[&"until-fast", &attempt]).unwrap();
        let before = command_calls(url, &["set", "evalsha"]);
        acquired(store.claim(&claim_request(&key, hour, hour)).await.unwrap());
        if set_and_script_calls_since(url, &before) == (1, 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("no claim took the fast path in 10 s: the server's clock was never read within 1 ms");
}

/// The fast claim on a server of the test's own, counted by the server: a fresh key, a
/// duplicate of a completed record (with its result), a live claim and a payload mismatch
/// each cost one `SET` and no script; a released record and a run-out lease are decided by
/// the script, with the fence + 1; a fresh claim after the record expired gets a higher
/// fence; a value that is no record is reported corrupt and left alone. With the fast claim
/// off, every claim is a script run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fast_claim_is_one_set_and_leaves_the_rest_to_the_script() {
    let server = RedisServer::start(&[]);
    let url = server.url();
    let store = connect(&url).await;
    let key = |name: &str| Key::new("fast", 1, &[&name]).unwrap();
    let (sec, hour) = (Duration::from_secs(1), Duration::from_secs(3600));
    let counted = |before: &[u64]| set_and_script_calls_since(&url, before);

    // The claim script loaded once, so no count below includes the `EVALSHA` that finds it
    // missing.
    load_the_claim_script(&store, &key("warm")).await;
    until_claims_are_fast(&store, &url, "fast").await;

    // A fresh key: one SET, no script; the fence is the server's clock (an estimate at most
    // two milliseconds above it).
    let before = command_calls(&url, &["set", "evalsha"]);
    let t0 = server_micros(&url);
    let first = claim_request(&key("a"), hour, hour)
        .with_fingerprint(idempotency::store::Fingerprint::of(&[&"payload-1"]));
    let fence = acquired(store.claim(&first).await.unwrap());
    assert!(
        (t0..=server_micros(&url) + FAST_FENCE_ABOVE_CLOCK_US).contains(&fence),
        "{fence}"
    );
    assert_eq!(counted(&before), (1, 0));

    // A live claim, the same owner again, another payload: one SET each.
    let before = command_calls(&url, &["set", "evalsha"]);
    let other = claim_request(&key("a"), hour, hour);
    assert_eq!(
        store.claim(&other).await.unwrap(),
        Claim::InProgress { fence }
    );
    assert_eq!(
        store.claim(&first).await.unwrap(),
        Claim::Acquired { fence },
        "a retry of the owner's own claim"
    );
    let mismatched = claim_request(&key("a"), hour, hour)
        .with_fingerprint(idempotency::store::Fingerprint::of(&[&"payload-2"]));
    assert_eq!(
        store.claim(&mismatched).await.unwrap(),
        Claim::Mismatch { fence }
    );
    assert_eq!(counted(&before), (3, 0));

    // Completed: the duplicate gets the result from its one SET.
    let done = Completion::new(Some(b"receipt-1".to_vec()), hour);
    assert!(store
        .complete(&key("a"), &first.token, &done)
        .await
        .unwrap());
    let before = command_calls(&url, &["set", "evalsha"]);
    assert_eq!(
        store.claim(&other).await.unwrap(),
        Claim::Completed {
            fence,
            result: Some(b"receipt-1".to_vec())
        }
    );
    assert_eq!(counted(&before), (1, 0));

    // Released: the SET finds it, the script takes it with the next fence.
    let b1 = claim_request(&key("b"), hour, hour);
    let fb = acquired(store.claim(&b1).await.unwrap());
    assert!(store.release(&key("b"), &b1.token).await.unwrap());
    let before = command_calls(&url, &["set", "evalsha"]);
    let b2 = claim_request(&key("b"), hour, hour);
    assert_eq!(acquired(store.claim(&b2).await.unwrap()), fb + 1);
    // (The server counts the script's own `SET` too.)
    assert_eq!(counted(&before), (2, 1));

    // A lease that ran out (an owner that crashed): taken over by the script with fence + 1.
    let c1 = claim_request(&key("c"), sec, hour);
    let fc = acquired(store.claim(&c1).await.unwrap());
    tokio::time::sleep(sec + Duration::from_millis(50)).await;
    let c2 = claim_request(&key("c"), hour, hour);
    assert_eq!(acquired(store.claim(&c2).await.unwrap()), fc + 1);

    // A record that expired: the next fresh claim's fence is higher still.
    let d1 = claim_request(&key("d"), sec, sec);
    let fd = acquired(store.claim(&d1).await.unwrap());
    assert!(store
        .complete(&key("d"), &d1.token, &Completion::new(None, sec))
        .await
        .unwrap());
    tokio::time::sleep(sec + Duration::from_millis(50)).await;
    let d2 = claim_request(&key("d"), hour, hour);
    assert!(acquired(store.claim(&d2).await.unwrap()) > fd);

    // Values that are no record: corrupt, and left as they are.
    let mut conn = raw(&url);
    let _: () = redis::cmd("SET")
        .arg(key("e").as_bytes())
        .arg("not a record")
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(key("f").as_bytes())
        .arg("field")
        .arg("value")
        .query(&mut conn)
        .unwrap();
    for name in ["e", "f"] {
        let err = store
            .claim(&claim_request(&key(name), hour, hour))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{name}");
    }
    let left: String = redis::cmd("GET")
        .arg(key("e").as_bytes())
        .query(&mut conn)
        .unwrap();
    assert_eq!(left, "not a record");

    // Short durations, and a store with the fast claim off: the script.
    let scripted = redis_server::connect_with(&url, false).await;
    let before = command_calls(&url, &["set", "evalsha"]);
    acquired(
        store
            .claim(&claim_request(&key("g"), Duration::from_millis(500), hour))
            .await
            .unwrap(),
    );
    acquired(
        scripted
            .claim(&claim_request(&key("h"), hour, hour))
            .await
            .unwrap(),
    );
    // Two script runs, each with its own `SET` inside.
    assert_eq!(counted(&before), (2, 2));
}

/// A batch claim with the fast claim on, counted by a server of the test's own: one `SET`
/// per item, the script only for the items the `SET` cannot decide (a released record, a
/// value that is no record), and every answer the single claims give.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claims_with_one_set_per_item_and_the_script_only_where_needed() {
    let server = RedisServer::start(&[]);
    let url = server.url();
    let store = connect(&url).await;
    let key = |name: &str| Key::new("fast-batch", 1, &[&name]).unwrap();
    let hour = Duration::from_secs(3600);
    load_the_claim_script(&store, &key("warm")).await;
    let released = claim_request(&key("released"), hour, hour);
    let released_fence = acquired(store.claim(&released).await.unwrap());
    assert!(store
        .release(&key("released"), &released.token)
        .await
        .unwrap());
    let live = claim_request(&key("live"), hour, hour);
    let live_fence = acquired(store.claim(&live).await.unwrap());
    let done = claim_request(&key("done"), hour, hour);
    let done_fence = acquired(store.claim(&done).await.unwrap());
    assert!(store
        .complete(
            &key("done"),
            &done.token,
            &Completion::new(Some(b"receipt".to_vec()), hour)
        )
        .await
        .unwrap());
    let _: () = redis::cmd("SET")
        .arg(key("foreign").as_bytes())
        .arg("not a record")
        .query(&mut raw(&url))
        .unwrap();

    let fresh: Vec<ClaimRequest> = (0..20)
        .map(|i| claim_request(&key(&format!("fresh-{i}")), hour, hour))
        .collect();
    let mut batch = fresh.clone();
    batch.push(claim_request(&key("released"), hour, hour));
    batch.push(claim_request(&key("live"), hour, hour));
    batch.push(claim_request(&key("done"), hour, hour));
    batch.push(claim_request(&key("foreign"), hour, hour));
    // The same fresh key twice: the first takes it, the second finds the first's claim.
    batch.push(claim_request(&key("twice"), hour, hour));
    batch.push(claim_request(&key("twice"), hour, hour));
    until_claims_are_fast(&store, &url, "fast-batch").await;
    let before = command_calls(&url, &["set", "evalsha"]);
    let t0 = server_micros(&url);
    let answers = store.claim_many(&batch).await;
    let t1 = server_micros(&url);
    let (sets, scripts) = set_and_script_calls_since(&url, &before);
    assert_eq!(answers.len(), batch.len());
    for answer in &answers[..20] {
        let fence = acquired(answer.as_ref().unwrap().clone());
        assert!(
            (t0..=t1 + FAST_FENCE_ABOVE_CLOCK_US).contains(&fence),
            "{fence}"
        );
    }
    assert_eq!(
        acquired(answers[20].as_ref().unwrap().clone()),
        released_fence + 1,
        "a released record is taken by the script with the next fence"
    );
    assert_eq!(
        answers[21].as_ref().unwrap().clone(),
        Claim::InProgress { fence: live_fence }
    );
    assert_eq!(
        answers[22].as_ref().unwrap().clone(),
        Claim::Completed {
            fence: done_fence,
            result: Some(b"receipt".to_vec())
        }
    );
    assert_eq!(
        answers[23].as_ref().unwrap_err().kind(),
        StoreErrorKind::Corrupt
    );
    let twice = acquired(answers[24].as_ref().unwrap().clone());
    assert_eq!(
        answers[25].as_ref().unwrap().clone(),
        Claim::InProgress { fence: twice }
    );
    // 26 `SET`s, and the script's own `SET` for the released record; two script runs.
    assert_eq!((sets, scripts), (27, 2));
    let left: String = redis::cmd("GET")
        .arg(key("foreign").as_bytes())
        .query(&mut raw(&url))
        .unwrap();
    assert_eq!(left, "not a record");
}

/// A completion that names its claim (the engine's) is matched by the record's head and
/// writes, byte for byte, the completed record a completion by token alone writes: the
/// state, the token, the fingerprint, the fence, no lease, the result; also after a renewal
/// rewrote the lease, with and without a fingerprint, and for a claim the script made.
#[tokio::test]
async fn a_completion_naming_its_claim_writes_the_record_a_token_completion_writes() {
    let server = RedisServer::start(&[]);
    let url = server.url();
    let store = connect(&url).await;
    let scripted = redis_server::connect_with(&url, false).await;
    let hour = Duration::from_secs(3600);
    let mut conn = raw(&url);
    let fp = idempotency::store::Fingerprint::of(&[&"EUR", &1250u64]);
    for (case, fingerprint, by_script) in [
        ("plain", None, false),
        ("fingerprinted", Some(fp), false),
        ("scripted", Some(fp), true),
    ] {
        let claimer = if by_script { &scripted } else { &store };
        let token = Token::generate();
        let mut fences = Vec::new();
        // By token; naming the fence (renewed: the head matches, the rest does not); naming
        // fence and lease, renewed or as claimed (a fast claim's record, written again by
        // its owner; a scripted claim's differs).
        let keys = [
            Key::new("named", 1, &[&case, &"by-token"]).unwrap(),
            Key::new("named", 1, &[&case, &"by-claim"]).unwrap(),
            Key::new("named", 1, &[&case, &"by-lease-renewed"]).unwrap(),
            Key::new("named", 1, &[&case, &"by-lease"]).unwrap(),
        ];
        for (i, key) in keys.iter().enumerate() {
            let mut req = ClaimRequest::new(key.clone(), token, hour, hour);
            req.fingerprint = fingerprint;
            fences.push(acquired(claimer.claim(&req).await.unwrap()));
            if i < 3 {
                assert!(store.renew(key, &token, hour).await.unwrap(), "{case}");
            }
        }
        let done = Completion::new(Some(b"receipt-7".to_vec()), hour);
        assert!(store.complete(&keys[0], &token, &done).await.unwrap());
        let claim = |i: usize| idempotency::store::AcquiredClaim::new(fences[i], fingerprint);
        let named = done.clone().for_claim(claim(1));
        assert!(store.complete(&keys[1], &token, &named).await.unwrap());
        for i in [2, 3] {
            let named = done.clone().for_claim(claim(i).with_lease(hour));
            assert!(store.complete(&keys[i], &token, &named).await.unwrap());
            // Sent again (a lost reply): the record is the owner's completed one.
            assert!(store.complete(&keys[i], &token, &named).await.unwrap());
            // Another owner's completion naming the same claim changes nothing.
            let other = Token::generate();
            assert!(!store.complete(&keys[i], &other, &named).await.unwrap());
        }
        for (key, fence) in keys.iter().zip(&fences) {
            let mut expected = b"C".to_vec();
            expected.extend_from_slice(token.as_bytes());
            match fingerprint {
                Some(fp) => {
                    expected.push(b'F');
                    expected.extend_from_slice(fp.as_bytes());
                }
                None => expected.push(b'-'),
            }
            expected.extend_from_slice(format!("{fence}:0:receipt-7").as_bytes());
            let value: Vec<u8> = redis::cmd("GET")
                .arg(key.as_bytes())
                .query(&mut conn)
                .unwrap();
            assert_eq!(value, expected, "{case}: {key}");
            let ttl: i64 = redis::cmd("PTTL")
                .arg(key.as_bytes())
                .query(&mut conn)
                .unwrap();
            assert!(ttl > 3_590_000, "{case}: the completion's ttl, {ttl} ms");
        }
    }
}

#[tokio::test]
async fn fences_keep_growing_after_a_record_expires() {
    let url = redis_url();
    let store = connect(&url).await;
    let namespace = unique_namespace();
    let key = Key::new(&format!("{namespace}:fence"), 1, &[&"order-1"]).unwrap();
    let short = Duration::from_millis(200);
    let mut conn = raw(&url);

    // A key never seen: the fence is the server's clock in microseconds.
    let before = server_micros(&url);
    let first = claim_request(&key, short, short);
    let f1 = acquired(store.claim(&first).await.unwrap());
    assert!(
        (before..=server_micros(&url)).contains(&f1),
        "fence {f1} is not the server's clock"
    );
    // Stored and read back as the exact integer.
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(key.as_bytes())
        .query(&mut conn)
        .unwrap();
    assert!(
        stored[18..].starts_with(format!("{f1}:").as_bytes()),
        "stored fence is not {f1}: {:?}",
        String::from_utf8_lossy(&stored[18..])
    );
    assert_eq!(store.read(&key).await.unwrap().unwrap().fence, f1);

    // The record lives: one more.
    assert!(store.release(&key, &first.token).await.unwrap());
    let second = claim_request(&key, short, short);
    assert_eq!(acquired(store.claim(&second).await.unwrap()), f1 + 1);

    // The record expires; the next owner's fence is still above every earlier one.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let exists: u32 = redis::cmd("EXISTS")
            .arg(key.as_bytes())
            .query(&mut conn)
            .unwrap();
        if exists == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the record never expired"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let third = claim_request(&key, Duration::from_secs(60), Duration::from_secs(60));
    let f3 = acquired(store.claim(&third).await.unwrap());
    assert!(
        f3 > f1 + 1,
        "fence {f3} repeats an earlier one ({f1}, {})",
        f1 + 1
    );
    // Completed and claimed again, it keeps its fence.
    let done = Completion::new(None, Duration::from_secs(60));
    assert!(store.complete(&key, &third.token, &done).await.unwrap());
    assert_eq!(
        store
            .claim(&claim_request(&key, short, short))
            .await
            .unwrap(),
        Claim::Completed {
            fence: f3,
            result: None
        }
    );
    delete_matching(&url, &format!("{namespace}:*"));
}

/// Values no store wrote: random bytes, cut-off and record-shaped ones.
fn unreadable_values(token: &Token) -> Vec<(String, Vec<u8>)> {
    let shaped = |state: u8, marker: u8, fence: &[u8], lease_end: &[u8]| {
        let mut v = vec![state];
        v.extend_from_slice(token.as_bytes());
        v.push(marker);
        v.extend_from_slice(fence);
        v.push(b':');
        v.extend_from_slice(lease_end);
        v.extend_from_slice(b":result");
        v
    };
    let mut values = vec![
        ("empty".to_string(), Vec::new()),
        ("too short".to_string(), b"P0123456789".to_vec()),
        (
            "cut before the fence".to_string(),
            shaped(b'P', b'-', b"", b"")[..18].to_vec(),
        ),
        (
            "unknown state letter".to_string(),
            shaped(b'X', b'-', b"7", b"0"),
        ),
        (
            "lower-case state letter".to_string(),
            shaped(b'p', b'-', b"7", b"0"),
        ),
        (
            "non-numeric fence".to_string(),
            shaped(b'P', b'-', b"seven", b"0"),
        ),
        ("signed fence".to_string(), shaped(b'C', b'-', b"+7", b"0")),
        ("empty fence".to_string(), shaped(b'C', b'-', b"", b"0")),
        (
            "fence beyond exact integers".to_string(),
            shaped(b'C', b'-', b"99999999999999999999", b"0"),
        ),
        (
            "non-numeric lease end".to_string(),
            shaped(b'P', b'-', b"7", b"soon"),
        ),
        (
            "no fingerprint marker".to_string(),
            shaped(b'C', b'?', b"7", b"0"),
        ),
        (
            "fingerprint cut short".to_string(),
            shaped(b'C', b'F', b"7", b"0"),
        ),
    ];
    // Random bytes from a fixed seed, of every length up to 80.
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    for len in (0..=80).step_by(4) {
        let bytes = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed.to_le_bytes()[0]
            })
            .collect();
        values.push((format!("{len} random bytes"), bytes));
    }
    values
}

async fn assert_corrupt_everywhere(store: &Arc<RedisStore>, key: &Key, token: &Token, what: &str) {
    let long = Duration::from_secs(60);
    let mut mine = claim_request(key, long, long);
    mine.token = *token;
    let done = Completion::new(None, long);
    // As the engine completes: naming a claim (a fence no unreadable value holds) and lease.
    let named = done.clone().for_claim(
        idempotency::store::AcquiredClaim::new(1_796_130_461_329_139, None).with_lease(long),
    );
    let outcomes = [
        (
            "claim",
            store.claim(&claim_request(key, long, long)).await.err(),
        ),
        ("claim by its token", store.claim(&mine).await.err()),
        ("complete", store.complete(key, token, &done).await.err()),
        (
            "complete naming its claim",
            store.complete(key, token, &named).await.err(),
        ),
        ("release", store.release(key, token).await.err()),
        ("renew", store.renew(key, token, long).await.err()),
        ("reopen", store.reopen(key, token).await.err()),
        ("read", store.read(key).await.err()),
        ("is_completed", store.is_completed(key).await.err()),
        (
            "delete by its token",
            store.delete(key, Expect::Token(token)).await.err(),
        ),
        (
            "batch completion",
            store
                .complete_many(&[Ending::complete(key.clone(), *token, done.clone())])
                .await
                .pop()
                .and_then(Result::err),
        ),
        (
            "batch release",
            store
                .complete_many(&[Ending::release(key.clone(), *token)])
                .await
                .pop()
                .and_then(Result::err),
        ),
    ];
    for (op, err) in outcomes {
        let kind = err.map(|e| e.kind());
        assert_eq!(kind, Some(StoreErrorKind::Corrupt), "{what}: {op}");
    }
    // In a batch, only the unreadable key fails.
    let fresh = Key::new(&format!("{}:fresh", key.prefix()), 1, &[&what]).unwrap();
    let batch = store
        .claim_many(&[
            claim_request(key, long, long),
            claim_request(&fresh, long, long),
        ])
        .await;
    match &batch[..] {
        [Err(err), Ok(Claim::Acquired { .. })] => {
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{what}: batch claim");
            assert!(err.is_permanent());
        }
        other => panic!("{what}: batch claim gave {other:?}"),
    }
    // Through the engine: dead-lettered, and the body never runs.
    let ran = AtomicUsize::new(0);
    let out: Result<(), Error> = Idempotency::new(long)
        .store(store.clone() as SharedStore)
        .run(key.clone(), async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await;
    match out {
        Err(err @ Error::Store(_)) => assert_eq!(err.action(), Action::DeadLetter, "{what}"),
        other => panic!("{what}: the engine gave {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "{what}: the body ran");
}

#[tokio::test]
async fn unreadable_records_are_corrupt_for_every_operation_and_left_alone() {
    let url = redis_url();
    let store = Arc::new(connect(&url).await);
    let namespace = unique_namespace();
    let mut conn = raw(&url);
    let token = Token::generate();
    for (i, (what, value)) in unreadable_values(&token).into_iter().enumerate() {
        let key = Key::new(&format!("{namespace}:corrupt"), 1, &[&(i as u64)]).unwrap();
        let () = redis::cmd("SET")
            .arg(key.as_bytes())
            .arg(&value)
            .query(&mut conn)
            .unwrap();
        assert_corrupt_everywhere(&store, &key, &token, &what).await;
        let now: Vec<u8> = redis::cmd("GET")
            .arg(key.as_bytes())
            .query(&mut conn)
            .unwrap();
        assert_eq!(now, value, "{what}: the value was overwritten");
    }
    // Keys of another type, written by someone else.
    for (what, command) in [("a hash", "HSET"), ("a sorted set", "ZADD")] {
        let key = Key::new(&format!("{namespace}:foreign"), 1, &[&what]).unwrap();
        let _: i64 = redis::cmd(command)
            .arg(key.as_bytes())
            .arg("1")
            .arg("member")
            .query(&mut conn)
            .unwrap();
        assert_corrupt_everywhere(&store, &key, &token, what).await;
        let kind: String = redis::cmd("TYPE")
            .arg(key.as_bytes())
            .query(&mut conn)
            .unwrap();
        assert_ne!(kind, "string", "{what} was overwritten");
    }
    // An operator lists them as corrupt and deletes them; the keys are free again.
    let admin = Admin::new(store.clone());
    for prefix in ["corrupt", "foreign"] {
        let prefix = format!("{namespace}:{prefix}");
        let mut query = ListQuery::new(&prefix).unwrap().state(StateFilter::Corrupt);
        let mut listed = HashSet::new();
        loop {
            let page = admin.list(&query).await.unwrap();
            for (key, seen) in page.records {
                let err = seen.expect_err("a value that is no record");
                assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{key}");
                listed.insert(key);
            }
            match page.next {
                Some(next) => query = query.cursor(next),
                None => break,
            }
        }
        let expected = if prefix.ends_with("corrupt") {
            unreadable_values(&token).len()
        } else {
            2
        };
        assert_eq!(listed.len(), expected, "{prefix}");
        for key in &listed {
            assert_eq!(
                admin.delete(key).await.unwrap(),
                AdminOutcome::DeletedCorrupt,
                "{key}"
            );
            let long = Duration::from_secs(60);
            assert!(matches!(
                store.claim(&claim_request(key, long, long)).await.unwrap(),
                Claim::Acquired { .. }
            ));
        }
    }
    delete_matching(&url, &format!("{namespace}:*"));
}

#[tokio::test]
async fn max_result_size_is_configurable_and_never_above_what_the_server_takes() {
    let url = redis_url();
    assert_eq!(
        connect(&url).await.max_result_size(),
        DEFAULT_MAX_RESULT_SIZE
    );
    let store = RedisStore::builder(&url)
        .on_unsafe_config(UnsafeConfig::Warn)
        .max_result_size(8 << 20)
        .build()
        .await
        .unwrap();
    assert_eq!(store.max_result_size(), 8 << 20);

    // A server that takes at most 1 MiB per argument: the store's limit is a bit below it,
    // whether asked for more or left at the default.
    let server = RedisServer::start(&["--proto-max-bulk-len", "1mb"]);
    let store = RedisStore::builder(&server.url())
        .on_unsafe_config(UnsafeConfig::Warn)
        .max_result_size(64 << 20)
        .build()
        .await
        .unwrap();
    let limit = store.max_result_size();
    assert!(
        ((1 << 20) - 1024..1 << 20).contains(&limit),
        "limit {limit} on a 1 MiB server"
    );
    assert_eq!(connect(&server.url()).await.max_result_size(), limit);

    // A result of exactly the limit is stored and replayed.
    let long = Duration::from_secs(60);
    let key = Key::new("result-size", 1, &[&1u8]).unwrap();
    let req = claim_request(&key, long, long);
    acquired(store.claim(&req).await.unwrap());
    let result = vec![b'r'; limit];
    let done = Completion::new(Some(result.clone()), long);
    assert!(store.complete(&key, &req.token, &done).await.unwrap());
    match store.claim(&claim_request(&key, long, long)).await.unwrap() {
        Claim::Completed { result: r, .. } => assert!(r == Some(result), "result not replayed"),
        other => panic!("expected the completed record, got {other:?}"),
    }

    // One byte more is refused for good, before it reaches the server; the store stays usable.
    let key = Key::new("result-size", 1, &[&2u8]).unwrap();
    let req = claim_request(&key, long, long);
    acquired(store.claim(&req).await.unwrap());
    let too_large = Completion::new(Some(vec![b'r'; limit + 1]), long);
    let err = store
        .complete(&key, &req.token, &too_large)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Rejected, "{err}");
    let done = Completion::new(None, long);
    assert!(store.complete(&key, &req.token, &done).await.unwrap());

    // Where CONFIG is not allowed, the limit is Redis' default of 512 MiB.
    let server = RedisServer::start(&["--rename-command", "CONFIG", ""]);
    let store = RedisStore::builder(&server.url())
        .on_unsafe_config(UnsafeConfig::Warn)
        .max_result_size(usize::MAX)
        .build()
        .await
        .unwrap();
    let limit = store.max_result_size();
    assert!(
        ((512 << 20) - 1024..512 << 20).contains(&limit),
        "limit {limit} without CONFIG"
    );
}

#[tokio::test]
async fn durations_beyond_a_century_are_clamped_to_a_century() {
    let url = redis_url();
    let store = connect(&url).await;
    let namespace = unique_namespace();
    let mut conn = raw(&url);
    let century = i64::try_from(MAX_DURATION.as_millis()).unwrap();
    let mut pttl = |key: &Key, what: &str| {
        let ms: i64 = redis::cmd("PTTL")
            .arg(key.as_bytes())
            .query(&mut conn)
            .unwrap();
        assert!(
            (century - 60_000..=century).contains(&ms),
            "{what}: PTTL {ms} ms is not a century"
        );
    };
    for (i, huge) in [Duration::MAX, Duration::from_millis(u64::MAX)]
        .into_iter()
        .enumerate()
    {
        let key = Key::new(&format!("{namespace}:huge"), 1, &[&(i as u64)]).unwrap();
        let req = claim_request(&key, huge, huge);
        acquired(store.claim(&req).await.unwrap());
        pttl(&key, "claim");
        match store.read(&key).await.unwrap().unwrap().state {
            RecordState::InProgress { lease_left } => assert!(
                lease_left > MAX_DURATION - Duration::from_secs(60) && lease_left <= MAX_DURATION,
                "lease left {lease_left:?}"
            ),
            other => panic!("expected a claim in progress, got {other:?}"),
        }
        assert!(store.renew(&key, &req.token, huge).await.unwrap());
        pttl(&key, "renew");
        let done = Completion::new(Some(b"ok".to_vec()), huge);
        assert!(store.complete(&key, &req.token, &done).await.unwrap());
        pttl(&key, "complete");

        let batched = Key::new(&format!("{namespace}:huge-batch"), 1, &[&(i as u64)]).unwrap();
        match &store
            .claim_many(&[claim_request(&batched, huge, huge)])
            .await[..]
        {
            [Ok(Claim::Acquired { .. })] => {}
            other => panic!("batch claim gave {other:?}"),
        }
        pttl(&batched, "batch claim");
    }
    delete_matching(&url, &format!("{namespace}:*"));
}

/// The claim script (`record.lua`, which cannot call Rust) and the store's claims (the fast
/// claim's `SET ... NX GET` with the script after it) answer every record as the rule's one
/// table says, and so does `store::claim_answer`: each case's record is written under a key
/// as the script writes records, then claimed by the script itself and by the store.
#[tokio::test]
async fn the_claim_script_answers_every_record_by_the_rule_table() {
    claim_rule::check_claim_answer();
    let url = redis_url();
    let store = connect(&url).await;
    let mut conn = raw(&url);
    let namespace = unique_namespace();
    let script = include_str!("../idempotent-runtime/src/store/redis/record.lua");
    let minute_ms = 60_000u64;
    for (i, case) in claim_rule::cases().iter().enumerate() {
        let key = Key::new(&namespace, 1, &[&(i as u64)]).unwrap();
        let token = Token::generate();
        let req = case.request(&key, token);
        let held_by = case.record_token(token);
        let fence = 1_796_130_461_329_139 + i as u64;
        let seed = |conn: &mut redis::Connection| {
            let (seconds, micros): (u64, u64) = redis::cmd("TIME").query(conn).unwrap();
            let now_ms = seconds * 1_000 + micros / 1_000;
            let (state, lease_end, last) = match case.found {
                claim_rule::Found::Live => ('P', now_ms + minute_ms, (now_ms - 5_000).to_string()),
                claim_rule::Found::RunOut => ('P', now_ms - 1_000, (now_ms - 5_000).to_string()),
                claim_rule::Found::Completed => (
                    'C',
                    0,
                    String::from_utf8(claim_rule::RESULT.to_vec()).unwrap(),
                ),
                claim_rule::Found::Released => ('R', 0, String::new()),
            };
            let mut value = vec![state as u8];
            value.extend_from_slice(held_by.as_bytes());
            match claim_rule::fingerprint(case.stored) {
                Some(fp) => {
                    value.push(b'F');
                    value.extend_from_slice(fp.as_bytes());
                }
                None => value.push(b'-'),
            }
            value.extend_from_slice(format!("{fence}:{lease_end}:{last}").as_bytes());
            let _: () = redis::cmd("SET")
                .arg(key.as_bytes())
                .arg(value)
                .arg("PX")
                .arg(minute_ms)
                .query(conn)
                .unwrap();
        };
        let want = case.expected(fence);

        seed(&mut conn);
        let fingerprint = claim_rule::fingerprint(case.given);
        let reply: redis::Value = redis::cmd("EVAL")
            .arg(script)
            .arg(1)
            .arg(key.as_bytes())
            .arg("claim")
            .arg(token.as_bytes())
            .arg(minute_ms)
            .arg(minute_ms)
            .arg(fingerprint.as_ref().map_or(&[][..], |f| &f.as_bytes()[..]))
            .query(&mut conn)
            .unwrap();
        assert_eq!(script_claim(reply), want, "the script, {case:?}");

        seed(&mut conn);
        assert_eq!(
            store.claim(&req).await.unwrap(),
            want,
            "the store, {case:?}"
        );
    }
    delete_matching(&url, &format!("{namespace}:*"));
}

/// A claim as the script answers it: `{code, fence, result?}`.
fn script_claim(reply: redis::Value) -> Claim {
    let redis::Value::Array(items) = reply else {
        panic!("not a claim reply: {reply:?}");
    };
    let int = |v: Option<&redis::Value>| match v {
        Some(redis::Value::Int(n)) => *n,
        other => panic!("not a number: {other:?}"),
    };
    let fence = u64::try_from(int(items.get(1))).unwrap();
    match int(items.first()) {
        1 => Claim::Acquired { fence },
        2 => Claim::Completed {
            fence,
            result: match items.get(2) {
                Some(redis::Value::BulkString(bytes)) if !bytes.is_empty() => Some(bytes.clone()),
                _ => None,
            },
        },
        3 => Claim::InProgress { fence },
        4 => Claim::Mismatch { fence },
        code => panic!("claim code {code}"),
    }
}
