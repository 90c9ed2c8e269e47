//! What the engine and the stores count, through the [`metrics`](https://docs.rs/metrics)
//! facade (feature `metrics`): the application installs the recorder (Prometheus,
//! OpenTelemetry, StatsD exporters); without one nothing is recorded, and without the
//! feature these functions are empty and compiled away.
//!
//! Names follow the OpenTelemetry conventions (dot-separated, lowercase, durations in
//! seconds); no label ever carries a key or a payload.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idempotency.operations` | counter | `prefix`, `store`, `outcome` |
//! | `idempotency.claim.duration` | histogram (s) | `prefix`, `store` |
//! | `idempotency.handler.duration` | histogram (s) | `prefix`, `store` |
//! | `idempotency.wait.duration` | histogram (s) | `prefix`, `store` |
//! | `idempotency.lease.renewals` | counter | `prefix`, `store` |
//! | `idempotency.store.errors` | counter | `store`, `error.type` |
//! | `idempotency.completion.retries` | counter | `prefix`, `store` |
//! | `idempotency.completion.lost` | counter | `prefix`, `store`, `outcome` (`refused`, `gave_up`) |
//! | `idempotency.claims.active` | gauge (up-down) | `prefix`, `store` |
//! | `idempotency.history.resets` | counter | `store` |
//! | `idempotency.purged.records` | counter | `store` |
//! | `messaging.process.duration` | histogram (s) | `messaging.system`, `messaging.destination.name` |
//! | `idempotency.admin.actions` | counter | `action`, `store`, `outcome` |
//!
//! `outcome` is one of `executed` (the handler ran and its outcome was recorded, or is being
//! recorded in the background), `duplicate`, `replayed`, `held`, `in_progress`, `skipped`,
//! `mismatch`, `lost_ownership`, `store_error`, `fail_open`, `done_fallback` (the business
//! check said the effect was already applied), `failed` (the handler, or the business
//! check, returned an error: released for a retry, or stored) and, for a
//! [`Lock`](crate::Lock), `acquired`. Every door counts here: the attribute and
//! [`Operation`](crate::Operation), each item of a [`Batch`](crate::Batch), a call in the
//! caller's transaction, the HTTP layer, and locks. The call's `idempotency` tracing span
//! carries the same name in its `outcome` field.
//!
//! `store` is the store's [`name`](crate::Store::name): `memory`, `redis`, `redis_cluster`,
//! `postgresql`, `mysql`, `sqlite`, `tiered`, or what a third-party store reports.

#[cfg(feature = "metrics")]
use std::time::Duration;

use crate::error::StoreErrorKind;
use crate::key::Key;

/// The handles of the series labelled by a key's prefix, kept per thread once registered, so
/// a call costs a lookup, not the label allocations and registration of the `metrics`
/// macros. The cache is dropped when the recorder in force changes (one installed after the
/// first calls, a local one in a test) and when it holds more than [`MAX_PREFIXES`](cache::MAX_PREFIXES)
/// prefixes.
#[cfg(feature = "metrics")]
mod cache {
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// The most prefixes a thread keeps handles for before it starts again.
    pub(super) const MAX_PREFIXES: usize = 1024;

    #[derive(Clone)]
    pub(super) enum Handle {
        Counter(metrics::Counter),
        Histogram(metrics::Histogram),
        Gauge(metrics::Gauge),
    }

    /// A series by name, store and one more label value (an outcome, or "").
    type Series = HashMap<(&'static str, &'static str, &'static str), Handle>;

    #[derive(Default)]
    struct Cache {
        recorder: usize,
        by_prefix: HashMap<String, Series>,
    }

    thread_local! {
        static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    }

    /// Which recorder is in force (its address; the no-op one when none is installed).
    fn recorder() -> usize {
        metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize)
    }

    /// The handle of series `(name, store, extra)` for `prefix`, made by `make` the first time.
    pub(super) fn handle(
        prefix: &str,
        name: &'static str,
        store: &'static str,
        extra: &'static str,
        make: impl FnOnce() -> Handle,
    ) -> Handle {
        let recorder = recorder();
        CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            if cache.recorder != recorder || cache.by_prefix.len() > MAX_PREFIXES {
                cache.by_prefix.clear();
                cache.recorder = recorder;
            }
            if let Some(handle) = cache
                .by_prefix
                .get(prefix)
                .and_then(|series| series.get(&(name, store, extra)))
            {
                return handle.clone();
            }
            let handle = make();
            cache
                .by_prefix
                .entry(prefix.to_owned())
                .or_default()
                .insert((name, store, extra), handle.clone());
            handle
        })
    }
}

/// Adds `by` to the counter `name` of `key`'s prefix and `store`, labelled `outcome` when not
/// empty.
#[cfg(feature = "metrics")]
fn count(name: &'static str, key: &Key, store: &'static str, outcome: &'static str, by: u64) {
    let handle = cache::handle(key.prefix(), name, store, outcome, || {
        let prefix = key.prefix().to_owned();
        cache::Handle::Counter(if outcome.is_empty() {
            metrics::counter!(name, "prefix" => prefix, "store" => store)
        } else {
            metrics::counter!(name, "prefix" => prefix, "store" => store, "outcome" => outcome)
        })
    });
    if let cache::Handle::Counter(counter) = handle {
        counter.increment(by);
    }
}

/// Records `took` in the histogram `name` of `key`'s prefix and `store`.
#[cfg(feature = "metrics")]
fn time(name: &'static str, key: &Key, store: &'static str, since: Started) {
    let handle = cache::handle(key.prefix(), name, store, "", || {
        cache::Handle::Histogram(
            metrics::histogram!(name, "prefix" => key.prefix().to_owned(), "store" => store),
        )
    });
    if let cache::Handle::Histogram(histogram) = handle {
        histogram.record(since.elapsed().as_secs_f64());
    }
}

/// When something timed for a histogram started: the clock is read only with the feature,
/// so without it timing costs nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    #[cfg(feature = "metrics")]
    at: tokio::time::Instant,
}

impl Started {
    /// Now.
    #[inline]
    pub(crate) fn now() -> Started {
        Started {
            #[cfg(feature = "metrics")]
            at: tokio::time::Instant::now(),
        }
    }

    /// From `at`, an instant the caller read anyway.
    #[inline]
    pub(crate) fn at(at: tokio::time::Instant) -> Started {
        #[cfg(not(feature = "metrics"))]
        let _ = at;
        Started {
            #[cfg(feature = "metrics")]
            at,
        }
    }

    #[cfg(feature = "metrics")]
    fn elapsed(self) -> Duration {
        self.at.elapsed()
    }
}

/// One operation's outcome (see the module docs for the values).
#[inline]
pub(crate) fn outcome(key: &Key, store: &'static str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    count("idempotency.operations", key, store, outcome, 1);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, outcome);
}

/// How long a claim round trip took.
#[inline]
pub(crate) fn claim_duration(key: &Key, store: &'static str, since: Started) {
    #[cfg(feature = "metrics")]
    time("idempotency.claim.duration", key, store, since);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, since);
}

/// How long a handler's body ran.
#[inline]
pub(crate) fn handler_duration(key: &Key, store: &'static str, since: Started) {
    #[cfg(feature = "metrics")]
    time("idempotency.handler.duration", key, store, since);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, since);
}

/// How long a call waited for another owner (`OnInProgress::Wait`) before its outcome.
#[inline]
pub(crate) fn wait_duration(key: &Key, store: &'static str, since: Started) {
    #[cfg(feature = "metrics")]
    time("idempotency.wait.duration", key, store, since);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, since);
}

/// A lease renewed by the watchdog.
#[inline]
pub(crate) fn lease_renewal(key: &Key, store: &'static str) {
    #[cfg(feature = "metrics")]
    count("idempotency.lease.renewals", key, store, "", 1);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store);
}

/// A store call that failed.
#[inline]
pub(crate) fn store_error(store: &'static str, kind: StoreErrorKind) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency.store.errors",
        "store" => store,
        "error.type" => kind.as_str()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (store, kind);
}

/// A completion sent again after it failed.
#[inline]
pub(crate) fn completion_retry(key: &Key, store: &'static str) {
    #[cfg(feature = "metrics")]
    count("idempotency.completion.retries", key, store, "", 1);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store);
}

/// A completion lost after its caller got `Ok` (see `engine::loss`); `reason` is `refused`
/// or `gave_up`.
#[inline]
pub(crate) fn completion_lost(key: &Key, store: &'static str, reason: &'static str) {
    #[cfg(feature = "metrics")]
    count("idempotency.completion.lost", key, store, reason, 1);
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, reason);
}

/// A claim acquired (`+1`) or ended (`-1`).
#[inline]
pub(crate) fn claims_active(key: &Key, store: &'static str, delta: i8) {
    #[cfg(feature = "metrics")]
    {
        let handle = cache::handle(key.prefix(), "idempotency.claims.active", store, "", || {
            cache::Handle::Gauge(metrics::gauge!(
                "idempotency.claims.active",
                "prefix" => key.prefix().to_owned(),
                "store" => store
            ))
        });
        if let cache::Handle::Gauge(gauge) = handle {
            if delta >= 0 {
                gauge.increment(f64::from(delta));
            } else {
                gauge.decrement(f64::from(-delta));
            }
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (key, store, delta);
}

/// A store that found its server changed (restarted, failed over): earlier records may be
/// gone.
#[inline]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn history_reset(store: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency.history.resets", "store" => store).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = store;
}

/// Expired records a purge deleted.
#[inline]
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(dead_code)
)]
pub(crate) fn purged(store: &'static str, records: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency.purged.records", "store" => store).increment(records);
    #[cfg(not(feature = "metrics"))]
    let _ = (store, records);
}

/// How long a broker consumer took to process a message (handler and ending).
#[inline]
#[cfg_attr(not(any(feature = "rabbitmq", feature = "nats")), allow(dead_code))]
pub(crate) fn messaging_process(system: &'static str, destination: &str, since: Started) {
    #[cfg(feature = "metrics")]
    metrics::histogram!(
        "messaging.process.duration",
        "messaging.system" => system,
        "messaging.destination.name" => destination.to_owned()
    )
    .record(since.elapsed().as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (system, destination, since);
}

/// An operator's action ([`Admin`](crate::admin::Admin)) and what it did.
#[inline]
pub(crate) fn admin_action(action: &'static str, store: &'static str, outcome: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency.admin.actions",
        "action" => action,
        "store" => store,
        "outcome" => outcome
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (action, store, outcome);
}

/// Counts an acquired claim as active until dropped.
pub(crate) struct Active {
    #[cfg(feature = "metrics")]
    key: Key,
    #[cfg(feature = "metrics")]
    store: &'static str,
}

impl Active {
    pub(crate) fn new(key: &Key, store: &'static str) -> Active {
        claims_active(key, store, 1);
        #[cfg(feature = "metrics")]
        return Active {
            key: key.clone(),
            store,
        };
        #[cfg(not(feature = "metrics"))]
        Active {}
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        claims_active(&self.key, self.store, -1);
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;

    /// Handles kept while no recorder was in force are not reused once one is: the series is
    /// registered with the new recorder and counts there.
    #[test]
    fn a_recorder_installed_after_the_first_calls_gets_every_series() {
        let key = Key::new("metrics:cache", 1, &[&"k"]).unwrap_or_else(|_| unreachable!());
        // No recorder in force on this thread: a no-op handle is kept.
        outcome(&key, "memory", "executed");
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            outcome(&key, "memory", "executed");
            outcome(&key, "memory", "executed");
            claim_duration(&key, "memory", Started::now());
        });
        let mut counted = 0;
        let mut timed = Vec::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            match (key.key().name(), value) {
                ("idempotency.operations", DebugValue::Counter(n)) => counted += n,
                ("idempotency.claim.duration", DebugValue::Histogram(samples)) => {
                    timed.extend(samples.into_iter().map(|s| s.into_inner()));
                }
                _ => {}
            }
        }
        assert_eq!(counted, 2);
        assert_eq!(timed.len(), 1);
        assert!((0.0..1.0).contains(&timed[0]), "{timed:?}");
        // Back without a recorder: nothing reaches the debugging one.
        outcome(&key, "memory", "executed");
        assert!(snapshotter
            .snapshot()
            .into_vec()
            .iter()
            .all(|(_, _, _, v)| !matches!(v, DebugValue::Counter(n) if *n > 0)));
    }
}
