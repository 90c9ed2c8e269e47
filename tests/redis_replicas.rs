//! The Redis store with replicas, on topologies the tests start themselves on free loopback
//! ports and tear down at the end of each case.
//!
//! Behind Sentinel (a primary, a replica and three `redis-server --sentinel`): a
//! `redis+sentinel://` URL reaches the primary; a graceful failover (the old primary demoted
//! to a replica), a killed primary and a paused primary are each followed to the new primary
//! without a restart, with every handler run once; bad Sentinel settings are typed errors at
//! build time or fail-closed calls, never a hang.
//!
//! Durable writes (`wait_for_replicas`, a primary and a replica): with the replica paused
//! (SIGSTOP, so it acknowledges nothing), a claim is given back and the call fails closed, a
//! renewal fails, and a completion is retried, never released, until the replica is back; a
//! batch waits once per pipeline, not once per item, and is given back whole, also when the
//! reply to its pipeline is lost. A script call is sent again after each load of its script,
//! up to three sends, durable or not.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/failover.rs"]
mod failover;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idempotency::redis::{RedisStore, UnsafeConfig};
use idempotency::store::{
    Claim, ClaimRequest, Completion, Ending, RecordState, Store, StoreErrorKind, Token,
};
use idempotency::{Error, Idempotency, Key, SharedStore};
use redis_server::{free_port, redis_cli, RedisServer, SentinelGroup};

/// Bounds every build and call: a case that hangs fails instead.
const NO_HANG: Duration = Duration::from_secs(60);

async fn build(url: &str) -> RedisStore {
    tokio::time::timeout(
        NO_HANG,
        RedisStore::builder(url)
            .on_unsafe_config(UnsafeConfig::Warn)
            .build(),
    )
    .await
    .expect("building the store hung")
    .expect("the store could not reach the primary through Sentinel")
}

fn key(name: &str) -> Key {
    Key::new("sentinel", 1, &[&name]).unwrap()
}

/// Runs `name`'s operation once on `store`, counting the handler's runs in `runs`.
async fn run(store: &SharedStore, name: &str, runs: &AtomicUsize) -> Result<u32, Error> {
    tokio::time::timeout(
        NO_HANG,
        Idempotency::new(Duration::from_secs(600))
            .store(store.clone())
            .run(key(name), async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<u32, Error>(7)
            }),
    )
    .await
    .expect("the call hung")
}

/// Whether the record of `name` is on the server at `port`.
fn on_server(port: u16, name: &str) -> bool {
    let pattern = format!("*sentinel*{name}*");
    !redis_cli(port, &["--scan", "--pattern", &pattern])
        .trim()
        .is_empty()
}

/// A `redis+sentinel://` URL reaches the primary the sentinels name; the store warns that the
/// primary takes writes no replica has acknowledged (`min-replicas-to-write 0`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_reaches_the_primary() {
    let group = SentinelGroup::start(1, &[]);
    let primary = group.primary_port().unwrap();
    let store: SharedStore = Arc::new(build(&group.url()).await);
    let runs = AtomicUsize::new(0);
    assert_eq!(run(&store, "first", &runs).await.unwrap(), 7);
    assert!(
        on_server(primary, "first"),
        "the record is not on the primary"
    );

    let again = run(&store, "first", &runs).await;
    assert!(matches!(again, Err(Error::Duplicate { .. })), "{again:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let direct = build(&group.url()).await;
    let health = direct.check().await.unwrap();
    assert!(
        health
            .warnings
            .iter()
            .any(|w| w.contains("min-replicas-to-write 0")),
        "{:?}",
        health.warnings
    );

    // `connect` takes the same URL.
    let connected = tokio::time::timeout(NO_HANG, idempotency::connect(&group.url()))
        .await
        .expect("connect hung");
    if let Err(err) = connected {
        panic!("connect refused the Sentinel URL: {err}");
    }
}

/// Waits until the replicas have every write `primary` applied so far: a write of its own,
/// then `WAIT` on the same connection (the replication stream is in the order the primary
/// applied its writes).
fn replicated(primary: u16) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "printf 'SET replicated-marker 1\\nWAIT 1 10000\\n' | redis-cli -p {primary}"
        ))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.trim_end().ends_with('1'),
        "the replica did not catch up: {out}"
    );
}

/// A graceful failover (`SENTINEL FAILOVER`): the old primary becomes a replica and refuses
/// writes with `READONLY`; the store asks the sentinels again, moves to the new primary and
/// sends the refused claim there, so the next call succeeds at once. Records written before
/// the failover were replicated and still filter duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_is_left_for_the_new_one() {
    let group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let store: SharedStore = Arc::new(build(&group.url()).await);
    let runs = AtomicUsize::new(0);
    run(&store, "before", &runs).await.unwrap();
    replicated(old);

    let new = group.failover();
    assert_ne!(new, old);

    assert_eq!(run(&store, "after", &runs).await.unwrap(), 7);
    assert!(
        on_server(new, "after"),
        "the record is not on the new primary"
    );
    let dup = run(&store, "before", &runs).await;
    assert!(matches!(dup, Err(Error::Duplicate { .. })), "{dup:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // A batch after the move goes to the new primary too.
    let record = store.read(&key("after")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed);
}

/// A script call that meets the demoted primary first, which no longer has the script (a
/// restart or `SCRIPT FLUSH` empties the cache): the store loads the script there, the call
/// is refused (`READONLY`) and moved to the new primary, which never had the script either (a
/// script call's writes reach replicas as plain commands). The store loads it there too, and
/// the call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_call_moved_to_a_new_primary_loads_the_script_there() {
    let group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let store = build(&group.url()).await;
    // Leases under a second are claimed by the script, never by the plain `SET`.
    let short = Duration::from_millis(500);
    let claim = |name: &str| ClaimRequest::new(key(name), Token::generate(), short, short);
    assert!(matches!(
        store.claim(&claim("script-before")).await.unwrap(),
        Claim::Acquired { .. }
    ));

    let new = group.failover();
    let deadline = std::time::Instant::now() + NO_HANG;
    while !redis_cli(old, &["info", "replication"]).contains("master_link_status:up") {
        assert!(
            std::time::Instant::now() < deadline,
            "the demoted primary never synced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(redis_cli(old, &["script", "flush"]).contains("OK"));
    let got = store.claim(&claim("script-after")).await;
    assert!(matches!(got, Ok(Claim::Acquired { .. })), "{got:?}");
    assert!(on_server(new, "script-after"));
}

/// Calls `name`-prefixed operations on fresh keys until one succeeds, and returns how many
/// failed first. Each failure is a store error (fail closed: the handler did not run).
async fn until_served(store: &SharedStore, name: &str, runs: &AtomicUsize) -> usize {
    let deadline = tokio::time::Instant::now() + NO_HANG;
    let mut failed = 0;
    loop {
        let before = runs.load(Ordering::SeqCst);
        match run(store, &format!("{name}-{failed}"), runs).await {
            Ok(7) => return failed,
            Ok(other) => panic!("unexpected value {other}"),
            Err(Error::Store(err)) => {
                assert_eq!(
                    runs.load(Ordering::SeqCst),
                    before,
                    "a handler ran although its call failed: {err:?}"
                );
                failed += 1;
            }
            Err(other) => panic!("unexpected error {other:?}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the store never reached a primary again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A primary killed (SIGKILL): calls fail closed while no primary answers, and once the
/// sentinels promote the replica the store finds it by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_by_the_promoted_replica() {
    let mut group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let store: SharedStore = Arc::new(build(&group.url()).await);
    let runs = AtomicUsize::new(0);
    run(&store, "before", &runs).await.unwrap();

    group.server_mut(old).kill();
    let new = group.wait_promoted(old);
    let failed = until_served(&store, "after", &runs).await;
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert!(
        on_server(new, &format!("after-{failed}")),
        "the served call's record is not on the promoted replica"
    );
}

/// A primary paused (SIGSTOP) long enough for the sentinels to promote the replica: the
/// store stops waiting on it (its commands time out), moves to the new primary, and when the
/// old one resumes it is demoted, not written to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_primary_is_left_and_demoted_when_it_resumes() {
    let group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let store: SharedStore = Arc::new(build(&group.url()).await);
    let runs = AtomicUsize::new(0);
    run(&store, "before", &runs).await.unwrap();

    group.server(old).pause();
    let new = group.wait_promoted(old);
    until_served(&store, "after", &runs).await;
    group.server(old).resume();
    tokio::task::block_in_place(|| group.demote(old, new));
    // Served by the new primary from now on.
    let runs_before = runs.load(Ordering::SeqCst);
    run(&store, "resumed", &runs).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), runs_before + 1);
    assert!(on_server(new, "resumed"));
}

/// A proxy in front of each of the group's sentinels, and a [`quick`] store that reaches the
/// sentinels through them only.
async fn behind_proxies(group: &SentinelGroup) -> (Vec<proxy::Proxy>, RedisStore) {
    let mut proxies = Vec::new();
    for s in &group.sentinels {
        proxies.push(proxy::Proxy::start(([127, 0, 0, 1], s.port()).into()).await);
    }
    let hosts: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    let url = format!("redis+sentinel://{}/{}", hosts.join(","), group.name);
    (proxies, quick(&url).await)
}

/// A store whose commands time out after 300 ms: a stalled primary is suspected quickly.
async fn quick(url: &str) -> RedisStore {
    RedisStore::builder(url)
        .on_unsafe_config(UnsafeConfig::Warn)
        .response_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap()
}

/// A claim of `name` with a minute's lease and ttl.
fn minute_claim(name: &str) -> ClaimRequest {
    let minute = Duration::from_secs(60);
    ClaimRequest::new(key(name), Token::generate(), minute, minute)
}

/// Claims `req` until the store acquires it; fails with `never` after [`NO_HANG`].
async fn until_acquired(store: &RedisStore, req: &ClaimRequest, never: &str) {
    let until = std::time::Instant::now() + NO_HANG;
    while !matches!(store.claim(req).await, Ok(Claim::Acquired { .. })) {
        assert!(std::time::Instant::now() < until, "{never}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Claims `last` until the store acquires it (it reached the primary on `port`), then checks
/// that every claim in `acquired` and `last` are on that primary: a claim the old primary
/// took in a failover's window would be lost with its data.
async fn all_on(store: &RedisStore, port: u16, mut acquired: Vec<Key>, last: ClaimRequest) {
    until_acquired(store, &last, "the store never reached the new primary").await;
    acquired.push(last.key);
    let direct = build(&format!("redis://127.0.0.1:{port}")).await;
    let mut lost = Vec::new();
    for key in &acquired {
        if direct.read(key).await.unwrap().is_none() {
            lost.push(key.to_string());
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} claims reported acquired were lost with the old primary (the first: {:?})",
        lost.len(),
        acquired.len(),
        &lost[..lost.len().min(3)]
    );
}

/// Whether a sentinel of `group` reports a failover of its primary under way.
fn failing_over(group: &SentinelGroup) -> bool {
    group.sentinels.iter().any(|s| {
        s.cli(&["sentinel", "master", &group.name])
            .contains("failover_in_progress")
    })
}

/// A primary that stalls (SIGSTOP) and comes back while the sentinels fail it over: until the
/// failover ends, the sentinels that have not heard of it name the old primary again, no
/// longer down, and it still answers as a master. Every claim the store reports
/// acquired meanwhile must be on the new primary at the end; a claim the old primary took
/// would be lost with its data when the sentinels demote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_back_during_its_failover_is_not_written_to() {
    let group = SentinelGroup::start(2, &[]);
    let old = group.primary_port().unwrap();
    let store = quick(&group.url()).await;
    let claim = |i: usize| minute_claim(&format!("back-during-failover-{i}"));
    assert!(matches!(
        store.claim(&claim(0)).await.unwrap(),
        Claim::Acquired { .. }
    ));

    group.server(old).pause();
    let deadline = std::time::Instant::now() + NO_HANG;
    let mut i = 1;
    // Claims while it is paused: they time out, and the store suspects the primary.
    while !failing_over(&group) {
        assert!(std::time::Instant::now() < deadline, "no failover started");
        let _ = store.claim(&claim(i)).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    group.server(old).resume();
    // Claims until the old primary is demoted: each acquired one must survive.
    let mut acquired = Vec::new();
    while !redis_cli(old, &["role"]).starts_with("slave") {
        assert!(
            std::time::Instant::now() < deadline,
            "the old primary was never demoted"
        );
        let req = claim(i);
        if let Ok(Claim::Acquired { .. }) = store.claim(&req).await {
            acquired.push(req.key);
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let new = group.primary_port().unwrap();
    assert_ne!(new, old);
    // Served by the new primary once the old one is demoted.
    all_on(&store, new, acquired, claim(i)).await;
}

/// The same window with the leader's answer lost: once the replica is promoted, the store
/// can no longer reach the sentinel leading the failover (its proxy refuses connections), and
/// the old primary comes back. The leader stalls for 1.5 s (SIGSTOP, under Sentinel's 2 s
/// tilt trigger), so the two other sentinels hear of the failover late: meanwhile they name
/// the old primary, no longer down, and it answers as a master. The promoted replica answers
/// as a master too, its previous history the old primary's: a failover is under way, and the
/// store confirms no primary until it ends. Every claim the store reports acquired must be on
/// the new primary at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_back_while_its_failovers_leader_is_unreachable_is_not_written_to() {
    let group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let replica = group.servers[1].port();
    let (proxies, store) = behind_proxies(&group).await;
    let claim = |i: usize| minute_claim(&format!("back-leader-unreachable-{i}"));
    assert!(matches!(
        store.claim(&claim(0)).await.unwrap(),
        Claim::Acquired { .. }
    ));

    group.server(old).pause();
    // A claim on the stalled primary times out: the store suspects it, and looks the primary
    // up before it sends anything more.
    assert!(store.claim(&claim(1)).await.is_err());
    let deadline = std::time::Instant::now() + NO_HANG;
    // The leader is the sentinel that reports the failover under way.
    let leader = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica was never promoted"
        );
        let leading = group.sentinels.iter().position(|s| {
            s.cli(&["sentinel", "master", &group.name])
                .contains("failover_in_progress")
        });
        if let Some(leader) = leading {
            if redis_cli(replica, &["role"]).starts_with("master") {
                group.sentinels[leader].pause();
                proxies[leader].down();
                break leader;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let stalled_until = std::time::Instant::now() + Duration::from_millis(1500);
    group.server(old).resume();
    // Claims while the store hears only the sentinels that have not heard of the failover,
    // and the old primary answers again.
    let mut acquired = Vec::new();
    let mut i = 2;
    let mut leader_stalled = true;
    let window_ends = std::time::Instant::now() + Duration::from_secs(4);
    while std::time::Instant::now() < window_ends {
        if leader_stalled && std::time::Instant::now() >= stalled_until {
            group.sentinels[leader].resume();
            leader_stalled = false;
        }
        let req = claim(i);
        if let Ok(Claim::Acquired { .. }) = store.claim(&req).await {
            acquired.push(req.key);
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if leader_stalled {
        group.sentinels[leader].resume();
    }
    tokio::task::block_in_place(|| group.demote(old, replica));
    // Served by the new primary once the failover ended.
    all_on(&store, replica, acquired, claim(i)).await;
}

/// A lookup's answer from the primary can come late: the primary stalled (SIGSTOP) after the
/// sentinels named it, and answers `INFO` once it resumes. If a replica was promoted
/// meanwhile, the two are primaries at once, and what the old one takes is lost when it is
/// demoted. The store asks the replicas after the primary answered, so the promoted replica
/// vetoes it: no claim is reported acquired until the replica follows the primary again.
///
/// The promotion here is made by hand (`REPLICAOF NO ONE`) within the sentinels' 1 s
/// down-after period, so that they never see the primary down: a failover whose leader
/// cannot be heard, at the exact moment the lookup waits on the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_answers_a_lookup_late_is_not_confirmed_over_a_replica_promoted_meanwhile() {
    let group = SentinelGroup::start(1, &[]);
    let old = group.primary_port().unwrap();
    let replica = group.servers[1].port();
    let (proxies, store) = behind_proxies(&group).await;
    let store = Arc::new(store);
    let claim = |i: usize| minute_claim(&format!("late-primary-{i}"));
    assert!(matches!(
        store.claim(&claim(0)).await.unwrap(),
        Claim::Acquired { .. }
    ));

    let asked: Vec<usize> = proxies.iter().map(|p| p.requests()).collect();
    group.server(old).pause();
    // A claim on the stalled primary times out (300 ms): the store suspects it and looks the
    // primary up; the sentinels name it, and its `INFO` waits for it to resume.
    let stalled = tokio::spawn({
        let store = store.clone();
        async move { store.claim(&claim(1)).await }
    });
    let deadline = std::time::Instant::now() + NO_HANG;
    while proxies.iter().zip(&asked).any(|(p, &n)| p.requests() == n) {
        assert!(
            std::time::Instant::now() < deadline,
            "the store never asked the sentinels"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Time for the replicas' answers, had they been asked with the primary.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(redis_cli(replica, &["replicaof", "no", "one"]).contains("OK"));
    group.server(old).resume();
    assert!(stalled.await.unwrap().is_err(), "the stalled claim failed");

    // Two primaries: no claim is acquired, on either.
    for i in 2..12 {
        let outcome = store.claim(&claim(i)).await;
        assert!(
            outcome.is_err(),
            "claim {i} was {outcome:?} while a promoted replica answers as a primary"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The replica follows the primary again: claims are served.
    assert!(redis_cli(replica, &["replicaof", "127.0.0.1", &old.to_string()]).contains("OK"));
    until_acquired(&store, &claim(12), "no claim was served").await;
}

/// No sentinel answers: a typed error at build time, not a hang.
#[tokio::test]
async fn no_reachable_sentinel_is_a_typed_error() {
    let url = format!(
        "redis+sentinel://127.0.0.1:{},127.0.0.1:{}/orders",
        free_port(),
        free_port()
    );
    let built = tokio::time::timeout(NO_HANG, RedisStore::connect(&url))
        .await
        .expect("building hung");
    let err = built.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
}

/// Sentinels that do not know the service: a typed error that says so.
#[tokio::test]
async fn an_unknown_service_is_a_typed_error() {
    let group = SentinelGroup::start(0, &[]);
    let url = group.url().replace(&group.name, "no-such-service");
    let built = tokio::time::timeout(NO_HANG, RedisStore::connect(&url))
        .await
        .expect("building hung");
    let err = built.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    assert!(err.to_string().contains("no-such-service"), "{err}");
}

/// A malformed Sentinel URL: rejected before anything is sent.
#[tokio::test]
async fn a_malformed_sentinel_url_is_rejected() {
    for url in [
        "redis+sentinel://127.0.0.1:26379",
        "redis+sentinel://127.0.0.1:1/svc/x",
    ] {
        let err = RedisStore::connect(url).await.unwrap_err();
        assert_eq!(err.kind(), StoreErrorKind::Rejected, "{url}: {err:?}");
    }
}

/// A primary that refuses writes (`min-replicas-to-write 1` with no replica attached): the
/// call fails closed with a store error and the handler does not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_refuses_writes_fails_closed() {
    let group = SentinelGroup::start(0, &["--min-replicas-to-write", "1"]);
    let store: SharedStore = Arc::new(build(&group.url()).await);
    let runs = AtomicUsize::new(0);
    let out = run(&store, "refused", &runs).await;
    match out {
        Err(Error::Store(err)) => {
            assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}")
        }
        other => panic!("expected a store error, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// A primary and one replica, linked.
fn primary_and_replica() -> (RedisServer, RedisServer) {
    let primary = RedisServer::start(&[]);
    let port = primary.port().to_string();
    let replica = RedisServer::start(&["--replicaof", "127.0.0.1", &port]);
    let deadline = std::time::Instant::now() + NO_HANG;
    while !replica
        .cli(&["info", "replication"])
        .contains("master_link_status:up")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the replica never linked"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (primary, replica)
}

/// A store on `primary` whose writes wait for one replica, at most 300 ms.
async fn durable(primary: &RedisServer, fast_claims: bool) -> RedisStore {
    durable_at(&primary.url(), fast_claims).await
}

async fn durable_at(url: &str, fast_claims: bool) -> RedisStore {
    RedisStore::builder(url)
        .on_unsafe_config(UnsafeConfig::Warn)
        .fast_claims(fast_claims)
        .wait_for_replicas(1, Duration::from_millis(300))
        .build()
        .await
        .unwrap()
}

/// A claim the replica did not acknowledge is given back and the call fails closed; once the
/// replica is back the same key is claimed, and a reported claim is on the replica. For the
/// fast claim (`SET ... NX GET`) and the script, alone and with a read in its round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_claim_is_given_back_and_fails_closed() {
    let (primary, replica) = primary_and_replica();
    for fast in [true, false] {
        let raw = durable(&primary, fast).await;
        let store: SharedStore = Arc::new(raw.clone());
        let name = format!("unreplicated-claim-{fast}");
        let runs = AtomicUsize::new(0);

        replica.pause();
        let out = run(&store, &name, &runs).await;
        replica.resume();
        match out {
            Err(Error::Store(err)) => {
                assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}")
            }
            other => panic!("expected a fail-closed store error, got {other:?}"),
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            0,
            "the handler ran on an unreplicated claim"
        );
        let record = raw.read(&key(&name)).await.unwrap();
        assert!(
            !matches!(record, Some(ref r) if matches!(r.state, RecordState::InProgress { .. })),
            "the claim was not given back: {record:?}"
        );

        // The same for a claim sent with a read in its round trip (an HTTP request's).
        let with_read = Arc::new(minute_claim(&format!("{name}-with-read")));
        replica.pause();
        let (claimed, _) = Arc::new(raw.clone())
            .claim_and_is_completed(with_read.clone(), key(&name))
            .expect("a Redis store on one server sends a claim and a read together")
            .await;
        replica.resume();
        let err = claimed.expect_err("an unreplicated claim with a read was acquired");
        assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
        let record = raw.read(&with_read.key).await.unwrap();
        assert!(
            !matches!(record, Some(ref r) if matches!(r.state, RecordState::InProgress { .. })),
            "the claim sent with a read was not given back: {record:?}"
        );

        assert_eq!(run(&store, &name, &runs).await.unwrap(), 7);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(
            on_server(replica.port(), &name),
            "a reported claim is not on the replica"
        );
    }
}

/// A script call that finds its script gone loads it and is sent again, however often the
/// script vanishes between a load and the next send (a failover that moves the call to a
/// primary without it), up to three sends in all; a third `NOSCRIPT` fails the call with
/// nothing written. For a durable write (its `WAIT` in the same pipeline) and a plain one.
/// The proxy flushes the server's scripts right before a send, so the place is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_call_is_sent_again_after_each_load_up_to_three_sends() {
    let (primary, _replica) = primary_and_replica();
    let flush = ["SCRIPT", "FLUSH"];
    for durable in [true, false] {
        let upstream = format!("127.0.0.1:{}", primary.port()).parse().unwrap();
        let proxy = proxy::Proxy::start(upstream).await;
        let mut builder = RedisStore::builder(&proxy.url())
            .on_unsafe_config(UnsafeConfig::Warn)
            .fast_claims(false);
        if durable {
            builder = builder.wait_for_replicas(1, Duration::from_millis(300));
        }
        let store = builder.build().await.unwrap();

        // Gone before the first send and again before the send after the first load.
        proxy.before_requests(b"EVALSHA", 2, &flush);
        let req = minute_claim(&format!("no-script-twice-{durable}"));
        let claim = tokio::time::timeout(NO_HANG, store.claim(&req))
            .await
            .expect("the claim hung");
        assert!(matches!(claim, Ok(Claim::Acquired { .. })), "{claim:?}");
        assert_eq!(proxy.befores(), 2, "durable: {durable}");

        // Gone before each of three sends: the call fails, and writes nothing.
        proxy.before_requests(b"EVALSHA", 3, &flush);
        let req = minute_claim(&format!("no-script-thrice-{durable}"));
        let claim = tokio::time::timeout(NO_HANG, store.claim(&req))
            .await
            .expect("the claim hung");
        assert!(claim.is_err(), "durable: {durable}: {claim:?}");
        assert_eq!(proxy.befores(), 5, "durable: {durable}");
        let record = store.read(&req.key).await.unwrap();
        assert!(record.is_none(), "durable: {durable}: {record:?}");
    }
}

/// A completion with the result `7` of each claim in `reqs`.
fn completions(reqs: &[ClaimRequest]) -> Vec<Ending> {
    reqs.iter()
        .map(|req| {
            Ending::complete(
                req.key.clone(),
                req.token,
                Completion::new(Some(b"7".to_vec()), Duration::from_secs(60)),
            )
        })
        .collect()
}

/// Every claim of `reqs` failed closed (unavailable) and was given back.
async fn failed_closed(
    store: &RedisStore,
    reqs: &[ClaimRequest],
    claims: &[Result<Claim, idempotency::store::StoreError>],
) {
    for (req, claim) in reqs.iter().zip(claims) {
        match claim {
            Err(err) => assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}"),
            Ok(other) => panic!("{}: expected an error, got {other:?}", req.key),
        }
        let record = store.read(&req.key).await.unwrap();
        assert!(
            !matches!(record, Some(ref r) if matches!(r.state, RecordState::InProgress { .. })),
            "{}: the claim was not given back: {record:?}",
            req.key
        );
    }
}

/// The most pipelines a batch is sent in, each with one `WAIT`: the fast claims, the scripts
/// for the items they leave undecided (released records here), and once more after loading a
/// script the server did not have (a new server). A `WAIT` per item would be 20 here.
const MAX_PIPELINES: u64 = 3;

/// How many `WAIT`s the server has answered.
fn waits(server: &RedisServer) -> u64 {
    server
        .cli(&["info", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_wait:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

fn batch_requests(name: &str, count: usize) -> Vec<ClaimRequest> {
    let minute = Duration::from_secs(60);
    (0..count)
        .map(|i| {
            ClaimRequest::new(
                key(&format!("{name}-{i}")),
                Token::generate(),
                minute,
                minute,
            )
        })
        .collect()
}

/// A batch's claims with the replica paused: every item fails closed and is given back, for
/// the fast claim and the script. The batch waits once per pipeline, not once per item:
/// items waiting one after the other would answer past the response timeout (1 s + the
/// wait) and their give-backs with them, leaving keys held until their leases run out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_batch_claim_fails_every_item_closed() {
    let (primary, replica) = primary_and_replica();
    for fast in [true, false] {
        let store = durable(&primary, fast).await;
        let reqs = batch_requests(&format!("batch-{fast}"), 20);
        replica.pause();
        let before = waits(&primary);
        let claims = tokio::time::timeout(NO_HANG, store.claim_many(&reqs))
            .await
            .expect("the batch hung");
        let waited = waits(&primary) - before;
        replica.resume();
        assert!(
            waited <= MAX_PIPELINES,
            "{waited} WAITs for one batch (fast claims: {fast})"
        );
        failed_closed(&store, &reqs, &claims).await;
        let before = waits(&primary);
        let again = store.claim_many(&reqs).await;
        assert!(waits(&primary) - before <= MAX_PIPELINES);
        assert!(
            again
                .iter()
                .all(|c| matches!(c, Ok(Claim::Acquired { .. }))),
            "{again:?}"
        );
        assert!(
            on_server(replica.port(), &format!("batch-{fast}-19")),
            "a reported claim is not on the replica"
        );
    }
}

/// A batch's completions with the replica paused: every completion fails as unavailable (the
/// engine sends it again), waiting once per pipeline; none is released, and sent again with the replica
/// back they all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_batch_completion_fails_until_replicated() {
    let (primary, replica) = primary_and_replica();
    let store = durable(&primary, true).await;
    let reqs = batch_requests("batch-completion", 20);
    let claims = store.claim_many(&reqs).await;
    assert!(claims
        .iter()
        .all(|c| matches!(c, Ok(Claim::Acquired { .. }))));
    let endings = completions(&reqs);
    replica.pause();
    let before = waits(&primary);
    let ended = tokio::time::timeout(NO_HANG, store.complete_many(&endings))
        .await
        .expect("the batch hung");
    let waited = waits(&primary) - before;
    replica.resume();
    assert!(waited <= MAX_PIPELINES, "{waited} WAITs for one batch");
    for (req, end) in reqs.iter().zip(&ended) {
        assert_eq!(
            end.as_ref().unwrap_err().kind(),
            StoreErrorKind::Unavailable,
            "{}: {end:?}",
            req.key
        );
    }
    let again = store.complete_many(&endings).await;
    assert!(again.iter().all(|e| matches!(e, Ok(true))), "{again:?}");
    for req in &reqs {
        let record = store.read(&req.key).await.unwrap().unwrap();
        assert!(matches!(record.state, RecordState::Completed), "{record:?}");
    }
}

/// Through the engine's batch door: with the replica paused every item fails closed and no
/// handler runs; with the replica back each handler runs once, and a redelivery of the batch
/// runs none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_batch_runs_no_handler_then_each_once() {
    let (primary, replica) = primary_and_replica();
    let store: SharedStore = Arc::new(durable(&primary, true).await);
    let idem = Idempotency::new(Duration::from_secs(600)).store(store);
    let runs = AtomicUsize::new(0);
    let items = || -> Vec<(Key, u32)> {
        (0..20u32)
            .map(|i| (key(&format!("engine-batch-{i}")), i))
            .collect()
    };
    let handler = |i: u32| {
        let runs = &runs;
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<u32, Error>(i * 2)
        }
    };
    replica.pause();
    let first: Vec<Result<u32, Error>> =
        tokio::time::timeout(NO_HANG, idem.run_batch(items(), handler))
            .await
            .expect("the batch hung");
    replica.resume();
    for out in &first {
        match out {
            Err(Error::Store(err)) => assert_eq!(err.kind(), StoreErrorKind::Unavailable),
            other => panic!("expected a fail-closed store error, got {other:?}"),
        }
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "a handler ran on an unreplicated claim"
    );
    let second: Vec<Result<u32, Error>> = idem.run_batch(items(), handler).await;
    assert_eq!(
        second.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        (0..20u32).map(|i| i * 2).collect::<Vec<_>>()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 20);
    let third: Vec<Result<u32, Error>> = idem.run_batch(items(), handler).await;
    assert!(
        third
            .iter()
            .all(|out| matches!(out, Err(Error::Duplicate { .. }))),
        "{third:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 20);
}

/// A durable store on `primary` reached through a proxy that can lose a reply.
async fn durable_behind_proxy(
    primary: &RedisServer,
    fast_claims: bool,
) -> (proxy::Proxy, RedisStore) {
    let upstream = format!("127.0.0.1:{}", primary.port()).parse().unwrap();
    let proxy = proxy::Proxy::start(upstream).await;
    let store = durable_at(&proxy.url(), fast_claims).await;
    (proxy, store)
}

/// A durable batch claim whose pipeline reached the server but whose reply was lost (the
/// connection cut before the answers came back): its replication is unknown, so every item
/// is given back and fails closed, none is read back as held; the same batch claimed again
/// is acquired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_batch_claim_whose_reply_is_lost_is_given_back() {
    let (primary, _replica) = primary_and_replica();
    for fast in [true, false] {
        let (proxy, store) = durable_behind_proxy(&primary, fast).await;
        let reqs = batch_requests(&format!("lost-claims-{fast}"), 20);
        proxy.lose_reply_to(b"WAIT");
        let claims = tokio::time::timeout(NO_HANG, store.claim_many(&reqs))
            .await
            .expect("the batch hung");
        assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
        failed_closed(&store, &reqs, &claims).await;
        let again = store.claim_many(&reqs).await;
        assert!(
            again
                .iter()
                .all(|c| matches!(c, Ok(Claim::Acquired { .. }))),
            "{again:?}"
        );
    }
}

/// A durable batch claim whose pipeline never reaches the server and is never answered (a
/// silent connection): the batch answers, every item failed, none acquired, and no key is
/// held. Its give-backs go out in one pipeline, not one by one: on the silent connection 60
/// single give-backs would each wait out the reply timeout (1.3 s), past `NO_HANG`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_batch_claim_that_is_never_answered_fails_every_item() {
    let (primary, _replica) = primary_and_replica();
    let (proxy, store) = durable_behind_proxy(&primary, true).await;
    let reqs = batch_requests("stalled-claims", 60);
    proxy.stall_request(b"WAIT");
    let claims = tokio::time::timeout(NO_HANG, store.claim_many(&reqs))
        .await
        .expect("the batch hung on a silent connection");
    assert_eq!(proxy.stalled(), 1, "the batch was not stalled");
    assert!(
        claims.iter().all(Result::is_err),
        "an item of a batch never answered was reported: {claims:?}"
    );
    let direct = durable(&primary, true).await;
    for req in &reqs {
        let record = direct.read(&req.key).await.unwrap();
        assert!(record.is_none(), "{}: {record:?}", req.key);
    }
}

/// A durable batch of completions whose reply was lost: each completion is unavailable (the
/// engine sends it again with its `WAIT`), none is taken as applied or released, and sent
/// again they all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_batch_completion_whose_reply_is_lost_is_sent_again() {
    let (primary, _replica) = primary_and_replica();
    let (proxy, store) = durable_behind_proxy(&primary, true).await;
    let reqs = batch_requests("lost-completions", 20);
    let claims = store.claim_many(&reqs).await;
    assert!(claims
        .iter()
        .all(|c| matches!(c, Ok(Claim::Acquired { .. }))));
    let endings = completions(&reqs);
    proxy.lose_reply_to(b"WAIT");
    let ended = tokio::time::timeout(NO_HANG, store.complete_many(&endings))
        .await
        .expect("the batch hung");
    assert_eq!(proxy.lost(), 1, "the proxy lost no reply");
    for (req, end) in reqs.iter().zip(&ended) {
        assert_eq!(
            end.as_ref().unwrap_err().kind(),
            StoreErrorKind::Unavailable,
            "{}: {end:?}",
            req.key
        );
    }
    let again = store.complete_many(&endings).await;
    assert!(again.iter().all(|e| matches!(e, Ok(true))), "{again:?}");
}

/// A renewal the replica did not acknowledge fails (the watchdog treats it as a failed
/// renewal); with the replica back it succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_renewal_fails() {
    let (primary, replica) = primary_and_replica();
    let store = durable(&primary, true).await;
    let minute = Duration::from_secs(60);
    let req = ClaimRequest::new(key("renewal"), Token::generate(), minute, minute);
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        Claim::Acquired { .. }
    ));
    replica.pause();
    let renewed = store.renew(&req.key, &req.token, minute).await;
    replica.resume();
    assert_eq!(renewed.unwrap_err().kind(), StoreErrorKind::Unavailable);
    assert!(store.renew(&req.key, &req.token, minute).await.unwrap());
}

/// A completion the replica did not acknowledge is not counted: `complete` fails (the engine
/// then retries it in the background, never releasing the key), and the same completion sent
/// again once the replica is back succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_completion_fails_until_replicated() {
    let (primary, replica) = primary_and_replica();
    let store = durable(&primary, true).await;
    let minute = Duration::from_secs(60);
    let req = ClaimRequest::new(key("store-completion"), Token::generate(), minute, minute);
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        Claim::Acquired { .. }
    ));
    let done = Completion::new(Some(b"7".to_vec()), minute);
    replica.pause();
    let completed = store.complete(&req.key, &req.token, &done).await;
    replica.resume();
    assert_eq!(completed.unwrap_err().kind(), StoreErrorKind::Unavailable);
    assert!(store.complete(&req.key, &req.token, &done).await.unwrap());
}

/// Through the engine: the caller has its result although the completion was not
/// replicated; the completion is retried in the background until it is, and the key is never
/// released, so no duplicate runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreplicated_completion_is_retried_and_never_released() {
    let (primary, replica) = primary_and_replica();
    let raw = durable(&primary, true).await;
    let store: SharedStore = Arc::new(raw.clone());
    let runs = AtomicUsize::new(0);
    let idem = Idempotency::new(Duration::from_secs(600)).store(store.clone());
    let first = idem
        .run(key("completion"), async {
            runs.fetch_add(1, Ordering::SeqCst);
            // The effect is done; the replica stops acknowledging before the completion.
            replica.pause();
            Ok::<u32, Error>(7)
        })
        .await;
    assert_eq!(first.unwrap(), 7);
    let dup = run(&store, "completion", &runs).await;
    assert!(dup.is_err(), "{dup:?}");
    replica.resume();

    // The background retry goes through once the replica acknowledges.
    let deadline = tokio::time::Instant::now() + NO_HANG;
    loop {
        let record = raw.read(&key("completion")).await.unwrap().unwrap();
        if record.state == RecordState::Completed && on_server(replica.port(), "completion") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completion was never recorded: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dup = run(&store, "completion", &runs).await;
    assert!(matches!(dup, Err(Error::Duplicate { .. })), "{dup:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The seed's load across a failover (1,000 keys x 3 identical deliveries, 24 consumers
/// per configuration, effects counted in PostgreSQL), one failover per scenario shared by
/// every configuration: nothing is lost anywhere, and no effect runs twice with a `done`
/// check, durable writes or the tiered store. The plain store's duplicates are printed, not
/// asserted: they depend on what the failover lost (`unreplicated_bytes`); `cargo run
/// --release --example failover_test` runs the full measurement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failovers_under_load_lose_nothing_and_safe_configurations_run_each_effect_once() {
    use failover::{Config, Load, Scenario};
    let load = Load {
        keys: 1_000,
        copies: 3,
        consumers: 24,
        pace: Duration::from_millis(60),
    };
    for scenario in [Scenario::Kill, Scenario::Pause, Scenario::KillLagging] {
        for outcome in failover::run(scenario, load).await {
            println!("{outcome}");
            assert_eq!(outcome.lost, 0, "{outcome}");
            if outcome.config != Config::Plain {
                assert_eq!(outcome.duplicate_effects, 0, "{outcome}");
            }
        }
    }
}
