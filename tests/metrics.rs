//! The `metrics` feature: a recorder installed once for this test binary
//! (`metrics-util`'s debugging recorder, which keeps every value), and each counter and
//! histogram checked to move as `idempotent_runtime::metrics` documents. Every case uses a key
//! prefix of its own and reads only its own series, so the cases run in parallel.
//!
//! The stores are real: the in-memory store, the Redis at `IDEMPOTENT_REDIS_URL` behind a
//! proxy that cuts requests (for store errors and completion retries), and SQLite (purging).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idempotency::sql::SqliteStore;
use idempotency::store::Token;
use idempotency::{
    Error, Idempotency, Key, MemoryStore, OnError, OnInProgress, OnStoreError, SharedStore,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::CompositeKey;

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this binary");
        snapshotter
    })
}

fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
}

/// What the recorder took for one series, over the whole run.
#[derive(Debug, Default, Clone)]
struct Seen {
    counter: u64,
    gauge: f64,
    samples: Vec<f64>,
}

/// Every series the recorder took so far. A snapshot drains the recorder (counters and
/// gauges restart from zero, histograms are emptied), so each snapshot is added here and the
/// cases read this sum, whichever case took the snapshot.
fn totals() -> std::sync::MutexGuard<'static, HashMap<CompositeKey, Seen>> {
    static TOTALS: OnceLock<Mutex<HashMap<CompositeKey, Seen>>> = OnceLock::new();
    let mut totals = TOTALS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let entry = totals.entry(key).or_default();
        match value {
            DebugValue::Counter(n) => entry.counter += n,
            DebugValue::Gauge(g) => entry.gauge += g.into_inner(),
            DebugValue::Histogram(samples) => entry
                .samples
                .extend(samples.into_iter().map(|s| s.into_inner())),
        }
    }
    totals
}

/// The sum of the series named `name` with every label in `labels` (others may be there).
fn seen(name: &str, labels: &[(&str, &str)]) -> Seen {
    let mut out = Seen::default();
    for (key, value) in totals().iter() {
        let key = key.key();
        let matches = key.name() == name
            && labels.iter().all(|(k, v)| {
                key.labels()
                    .any(|label| label.key() == *k && label.value() == *v)
            });
        if matches {
            out.counter += value.counter;
            out.gauge += value.gauge;
            out.samples.extend(&value.samples);
        }
    }
    out
}

fn outcomes(prefix: &str, outcome: &str) -> u64 {
    seen(
        "idempotency.operations",
        &[("prefix", prefix), ("outcome", outcome)],
    )
    .counter
}

fn memory() -> SharedStore {
    snapshotter();
    Arc::new(MemoryStore::new())
}

/// A run, its duplicate, a replayed duplicate, a handler error and a held key, on the memory
/// store: one count each under its outcome, the claim and handler durations recorded per
/// call, and no claim left active.
#[tokio::test]
async fn outcomes_and_durations_are_counted() {
    let guard = Idempotency::new(Duration::from_secs(60)).store(memory());
    let prefix = unique("metrics");
    let key = |name: &str| Key::new(&prefix, 1, &[&name]).unwrap();

    let first: Result<(), Error> = guard.run(key("a"), async { Ok(()) }).await;
    first.unwrap();
    let again: Result<(), Error> = guard.run(key("a"), async { Ok(()) }).await;
    assert!(matches!(again, Err(Error::Duplicate { .. })));

    let stored: Result<u32, Error> = guard
        .operation(key("b"))
        .replay()
        .run(async { Ok(7) })
        .await;
    assert_eq!(stored.unwrap(), 7);
    let replayed: Result<u32, Error> = guard
        .operation(key("b"))
        .replay()
        .run(async { Ok(8) })
        .await;
    assert_eq!(replayed.unwrap(), 7);

    let failed: Result<(), Error> = guard
        .run(key("c"), async {
            Err(Error::InvalidKey(idempotency::key::KeyError::EmptyPrefix))
        })
        .await;
    assert!(failed.is_err());
    let held: Result<(), Error> = guard
        .operation(key("d"))
        .on_error(|_| OnError::Hold)
        .run(async { Err(Error::InvalidKey(idempotency::key::KeyError::EmptyPrefix)) })
        .await;
    assert!(held.is_err());
    let blocked: Result<(), Error> = guard.run(key("d"), async { Ok(()) }).await;
    assert!(matches!(blocked, Err(Error::Held { .. })));

    for (outcome, n) in [
        ("executed", 2),
        ("duplicate", 1),
        ("replayed", 1),
        ("failed", 2),
        ("held", 1),
    ] {
        assert_eq!(outcomes(&prefix, outcome), n, "{outcome}");
    }
    let labels = [("prefix", prefix.as_str()), ("store", "memory")];
    assert_eq!(seen("idempotency.claim.duration", &labels).samples.len(), 7);
    // The body ran for the two executions and the two failures.
    let handled = seen("idempotency.handler.duration", &labels).samples;
    assert_eq!(handled.len(), 4);
    assert!(
        handled.iter().all(|s| (0.0..1.0).contains(s)),
        "{handled:?}"
    );
    assert_eq!(seen("idempotency.claims.active", &labels).gauge, 0.0);
}

/// A live claim met by `Reject`, `Skip` and `Wait`, a payload mismatch and a business check
/// that says the effect is applied: each counted under its outcome; the wait's duration is
/// recorded and the active claim shows while its handler runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_keys_mismatches_and_the_done_fallback_are_counted() {
    let store = memory();
    let guard = Idempotency::new(Duration::from_secs(60)).store(store.clone());
    let prefix = unique("metrics");
    let key = |name: &str| Key::new(&prefix, 1, &[&name]).unwrap();
    let labels = [("prefix", prefix.as_str()), ("store", "memory")];

    let (started, wait_started) = tokio::sync::oneshot::channel::<()>();
    let (finish, finished) = tokio::sync::oneshot::channel::<()>();
    let owner = tokio::spawn({
        let guard = guard.clone();
        let key = key("busy");
        async move {
            let out: Result<(), Error> = guard
                .run(key, async move {
                    started.send(()).unwrap();
                    finished.await.unwrap();
                    Ok(())
                })
                .await;
            out
        }
    });
    wait_started.await.unwrap();
    assert_eq!(seen("idempotency.claims.active", &labels).gauge, 1.0);
    let rejected: Result<(), Error> = guard.run(key("busy"), async { Ok(()) }).await;
    assert!(matches!(rejected, Err(Error::InProgress { .. })));
    let skipped: Result<(), Error> = guard
        .clone()
        .on_in_progress(OnInProgress::Skip)
        .run(key("busy"), async { Ok(()) })
        .await;
    assert!(matches!(skipped, Err(Error::Skipped { .. })));
    let claims_before = seen("idempotency.claim.duration", &labels).samples.len();
    let waiter = tokio::spawn({
        let guard = guard
            .clone()
            .on_in_progress(OnInProgress::Wait(Duration::from_secs(30)));
        let key = key("busy");
        async move {
            let out: Result<(), Error> = guard.run(key, async { Ok(()) }).await;
            out
        }
    });
    // The owner finishes only once the waiter's first claim met its live claim.
    while seen("idempotency.claim.duration", &labels).samples.len() == claims_before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    finish.send(()).unwrap();
    owner.await.unwrap().unwrap();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(Error::Duplicate { .. })
    ));
    let waited = seen("idempotency.wait.duration", &labels).samples;
    assert_eq!(waited.len(), 1);
    assert!(waited[0] > 0.0, "{waited:?}");

    let one: Result<(), Error> = guard
        .operation(key("fp"))
        .fingerprint(&[&"payload-1"])
        .run(async { Ok(()) })
        .await;
    one.unwrap();
    let other: Result<(), Error> = guard
        .operation(key("fp"))
        .fingerprint(&[&"payload-2"])
        .run(async { Ok(()) })
        .await;
    assert!(matches!(other, Err(Error::PayloadMismatch { .. })));

    let applied: Result<(), Error> = guard
        .operation(key("done"))
        .done(|| async { Ok::<_, Error>(true) })
        .run(async { panic!("the effect is applied already") })
        .await;
    assert!(matches!(applied, Err(Error::Duplicate { .. })));

    for (outcome, n) in [
        ("executed", 2),
        ("in_progress", 1),
        ("skipped", 1),
        ("duplicate", 1),
        ("mismatch", 1),
        ("done_fallback", 1),
    ] {
        assert_eq!(outcomes(&prefix, outcome), n, "{outcome}");
    }
    assert_eq!(seen("idempotency.claims.active", &labels).gauge, 0.0);
}

/// A handler that outlives its lease several times over has it renewed by the watchdog,
/// each renewal counted.
#[tokio::test(start_paused = true)]
async fn lease_renewals_are_counted() {
    let guard = Idempotency::new(Duration::from_secs(60))
        .lease(Duration::from_millis(300))
        .store(memory());
    let prefix = unique("metrics");
    let out: Result<(), Error> = guard
        .run(Key::new(&prefix, 1, &[&"long"]).unwrap(), async {
            tokio::time::sleep(Duration::from_millis(1_050)).await;
            Ok(())
        })
        .await;
    out.unwrap();
    // Every 100 ms (a third of the lease) over 1.05 s.
    let renewals = seen(
        "idempotency.lease.renewals",
        &[("prefix", prefix.as_str()), ("store", "memory")],
    )
    .counter;
    assert_eq!(renewals, 10);
}

/// Redis behind a proxy that cuts every request: a fail-closed call is a `store_error`, a
/// fail-open one a `fail_open`, each with a store error by kind; a completion cut while the
/// handler ran is retried in the background (counted) until the proxy lets it through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_and_completion_retries_are_counted() {
    snapshotter();
    let url = redis_server::redis_url();
    let upstream = url.trim_start_matches("redis://").parse().unwrap();
    let proxy = Arc::new(proxy::Proxy::start(upstream).await);
    let store: SharedStore = Arc::new(
        idempotency::redis::RedisStore::builder(&proxy.url())
            .on_unsafe_config(idempotency::redis::UnsafeConfig::Warn)
            .response_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap(),
    );
    let guard = Idempotency::new(Duration::from_secs(60)).store(store);
    let prefix = unique("metrics");
    let key = |name: &str| Key::new(&prefix, 1, &[&name]).unwrap();

    proxy.chaos(1000, 0, 1);
    let closed: Result<(), Error> = guard.run(key("closed"), async { Ok(()) }).await;
    assert!(matches!(closed, Err(Error::Store(_))));
    let open: Result<(), Error> = guard
        .clone()
        .on_store_error(OnStoreError::FailOpen)
        .run(key("open"), async { Ok(()) })
        .await;
    open.unwrap();
    proxy.calm();
    assert_eq!(outcomes(&prefix, "store_error"), 1);
    assert_eq!(outcomes(&prefix, "fail_open"), 1);
    assert!(seen("idempotency.store.errors", &[("store", "redis")]).counter >= 2);

    // The claim goes through; the proxy then cuts everything until the completion was
    // retried at least once.
    let cutting = proxy.clone();
    let out: Result<(), Error> = guard
        .run(key("retried"), async move {
            cutting.chaos(1000, 0, 2);
            Ok(())
        })
        .await;
    out.unwrap();
    let labels = [("prefix", prefix.as_str()), ("store", "redis")];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen("idempotency.completion.retries", &labels).counter == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never retried");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.calm();
    // Recorded once the proxy lets the retry through.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let again: Result<(), Error> = guard.run(key("retried"), async { Ok(()) }).await;
        match again {
            Err(Error::Duplicate { .. }) => break,
            Err(Error::InProgress { .. }) | Err(Error::Store(_)) => {}
            other => panic!("the effect ran again: {other:?}"),
        }
        assert!(tokio::time::Instant::now() < deadline, "never recorded");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The retried one; the unguarded run is `fail_open`, not `executed`.
    assert_eq!(outcomes(&prefix, "executed"), 1);
    redis_server::delete_matching(&url, &format!("{prefix}:*"));
}

/// A completion lost after its caller got `Ok` is counted, labelled with why: the caller's
/// completion and renewals are cut (the proxy cuts every connection), so it is retried in the
/// background while the lease runs out on Redis; another owner takes the key over on a direct
/// connection, and once the proxy lets the retry through, the store refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_lost_after_the_caller_got_ok_are_counted() {
    snapshotter();
    let url = redis_server::redis_url();
    let upstream = url.trim_start_matches("redis://").parse().unwrap();
    let proxy = Arc::new(proxy::Proxy::start(upstream).await);
    let build = |url: String| async move {
        idempotency::redis::RedisStore::builder(&url)
            .on_unsafe_config(idempotency::redis::UnsafeConfig::Warn)
            .response_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap()
    };
    let proxied: SharedStore = Arc::new(build(proxy.url()).await);
    let direct: SharedStore = Arc::new(build(url.clone()).await);
    let lease = Duration::from_secs(1);
    let guard = Idempotency::new(Duration::from_secs(60))
        .lease(lease)
        .store(proxied);
    let prefix = unique("metrics");
    let key = Key::new(&prefix, 1, &[&"lost"]).unwrap();
    let cutting = proxy.clone();
    let out: Result<(), Error> = guard
        .run(key.clone(), async move {
            cutting.chaos(1000, 0, 3);
            Ok(())
        })
        .await;
    out.expect("the caller is told the effect is applied");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let next =
        idempotency::store::ClaimRequest::new(key.clone(), Token::generate(), lease, lease * 10);
    loop {
        match direct.claim(&next).await.unwrap() {
            idempotency::store::Claim::Acquired { .. } => break,
            idempotency::store::Claim::InProgress { .. } => {}
            other => panic!("the lost owner's record: {other:?}"),
        }
        assert!(tokio::time::Instant::now() < deadline, "never taken over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.calm();
    let labels = [
        ("prefix", prefix.as_str()),
        ("store", "redis"),
        ("outcome", "refused"),
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while seen("idempotency.completion.lost", &labels).counter == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the loss was never counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen("idempotency.completion.lost", &labels).counter, 1);
    redis_server::delete_matching(&url, &format!("{prefix}:*"));
}

/// A SQL purge counts the expired records it deleted.
#[tokio::test]
async fn purged_records_are_counted() {
    snapshotter();
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    let before = seen("idempotency.purged.records", &[("store", "sqlite")]).counter;
    let guard = Idempotency::new(Duration::from_millis(200)).store(Arc::new(store.clone()));
    let prefix = unique("metrics");
    for n in 0..3 {
        let out: Result<(), Error> = guard
            .run(Key::new(&prefix, 1, &[&n]).unwrap(), async { Ok(()) })
            .await;
        out.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 3);
    let after = seen("idempotency.purged.records", &[("store", "sqlite")]).counter;
    // Other cases purge nothing on SQLite: exactly these three.
    assert_eq!(after - before, 3);
}
