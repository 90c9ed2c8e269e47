//! [`Idempotency`]: the settings shared by many calls, and batches.

use std::future::Future;
use std::time::Duration;

use crate::engine::batch::Batch;
use crate::engine::handler::HandlerResult;
use crate::engine::operation::Operation;
use crate::error::Error;
use crate::key::Key;
use crate::policy::{default_lease, InProgress, OnLostLease, OnStoreError};
use crate::store::{IntoStore, SharedStore, MAX_DURATION, MIN_DURATION};

/// Idempotent calls without the attribute: the settings many calls share (store, ttl, lease
/// and policies), and the calls themselves ([`run`](Idempotency::run),
/// [`operation`](Idempotency::operation), [`run_batch`](Idempotency::run_batch)).
///
/// This is the API for code that cannot use the attribute: closures, keys computed at run
/// time, generic plumbing. It is cheap to clone: build one per kind of operation at start-up
/// and share it.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let guard = Idempotency::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("coupon:grant", 1, &[&"user-7", &"spring-sale"]).unwrap();
///
/// let first: Result<u32, Error> = guard.run(key.clone(), async { Ok(42) }).await;
/// assert_eq!(first.unwrap(), 42);
///
/// let again: Result<u32, Error> = guard.run(key, async { Ok(43) }).await;
/// assert!(matches!(again, Err(Error::Duplicate { .. })));
/// # }
/// ```
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) store: Option<SharedStore>,
    pub(crate) ttl: Duration,
    pub(crate) lease: Option<Duration>,
    pub(crate) in_progress: InProgress,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) on_lost_lease: OnLostLease,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("store", &self.store.as_ref().map(|_| "..."))
            .field("ttl", &self.ttl)
            .field("lease", &self.lease_duration())
            .field("in_progress", &self.in_progress)
            .field("on_store_error", &self.on_store_error)
            .field("on_lost_lease", &self.on_lost_lease)
            .finish()
    }
}

impl Idempotency {
    /// Settings with the given record ttl, the process-default store, the default lease
    /// (30 s, or a third of the ttl when that is shorter) and the default policies (reject
    /// in-progress duplicates, fail closed).
    ///
    /// Choose `ttl` to cover the worst handler time plus the broker's longest redelivery delay:
    /// a duplicate that arrives after the record expired runs again.
    ///
    /// `ttl` and the lease must lie within [`MIN_DURATION`] ..= [`MAX_DURATION`]; settings
    /// outside that range run nothing and every call returns [`Error::InvalidDuration`], on
    /// every store alike. [`check`](Idempotency::check) finds such settings at start-up.
    pub fn new(ttl: Duration) -> Idempotency {
        Idempotency {
            store: None,
            ttl,
            lease: None,
            in_progress: InProgress::default(),
            on_store_error: OnStoreError::default(),
            on_lost_lease: OnLostLease::default(),
        }
    }

    /// Uses this store instead of the process default.
    pub fn store(mut self, store: impl IntoStore) -> Idempotency {
        self.store = Some(store.into_store());
        self
    }

    /// How long a claim stays live without renewal. While the handler runs the lease is
    /// renewed every third of it, so it only bounds how long a crashed owner blocks the key.
    pub fn lease(mut self, lease: Duration) -> Idempotency {
        self.lease = Some(lease);
        self
    }

    /// What to do when another owner holds a live claim.
    pub fn on_in_progress(mut self, policy: InProgress) -> Idempotency {
        self.in_progress = policy;
        self
    }

    /// What to do when the store fails before the handler ran.
    pub fn on_store_error(mut self, policy: OnStoreError) -> Idempotency {
        self.on_store_error = policy;
        self
    }

    /// What to do with a body whose lease is lost while it runs.
    pub fn on_lost_lease(mut self, policy: OnLostLease) -> Idempotency {
        self.on_lost_lease = policy;
        self
    }

    /// Checks the durations: `Err(`[`Error::InvalidDuration`]`)` when the ttl or the lease lies
    /// outside [`MIN_DURATION`] ..= [`MAX_DURATION`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{Error, Idempotency};
    ///
    /// assert!(Idempotency::new(Duration::from_secs(3600)).check().is_ok());
    /// assert!(matches!(
    ///     Idempotency::new(Duration::MAX).check(),
    ///     Err(Error::InvalidDuration { setting: "ttl", .. })
    /// ));
    /// ```
    pub fn check(&self) -> Result<(), Error> {
        let range = MIN_DURATION..=MAX_DURATION;
        if !range.contains(&self.ttl) {
            return Err(Error::InvalidDuration {
                setting: "ttl",
                value: self.ttl,
            });
        }
        let lease = self.lease_duration();
        if !range.contains(&lease) {
            return Err(Error::InvalidDuration {
                setting: "lease",
                value: lease,
            });
        }
        Ok(())
    }

    /// The record ttl.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The effective lease: the one set, or the default for the ttl.
    pub fn lease_duration(&self) -> Duration {
        self.lease.unwrap_or_else(|| default_lease(self.ttl))
    }

    /// One call on `key`, to refine and [`run`](Operation::run).
    pub fn operation<R: HandlerResult>(&self, key: Key) -> Operation<R> {
        Operation::new(self.clone(), Ok(key))
    }

    /// Many calls at once, to refine and [`run`](Batch::run): claimed in one store call and
    /// settled in one (see [`Batch`]).
    pub fn batch<T, R: HandlerResult>(&self) -> Batch<T, R> {
        Batch::new(self.clone())
    }

    /// Runs `handler` for a batch of items, claiming all their keys with one
    /// [`Store::claim_many`](crate::Store::claim_many) (one round trip on Redis) and
    /// recording their outcomes with one [`Store::complete_many`](crate::Store::complete_many):
    /// a shorthand for `self.batch().run(items, handler)`. Results come back in input order,
    /// each what [`Operation::run`] would have returned for that item alone. Acquired items
    /// run concurrently, each under its own lease renewal; items held by a live owner follow
    /// the in-progress policy (with [`InProgress::Wait`] they are claimed again one by one).
    /// For a fingerprint, replay or business check per item, use [`batch`](Self::batch).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotent_runtime::{Error, Idempotency, Key, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let guard = Idempotency::new(Duration::from_secs(60)).store(Arc::new(MemoryStore::new()));
    /// let batch = |ids: &[u32]| {
    ///     ids.iter().map(|id| (Key::new("order", 1, &[id]).unwrap(), *id)).collect::<Vec<_>>()
    /// };
    /// let first: Vec<Result<u32, Error>> =
    ///     guard.run_batch(batch(&[1, 2]), |id| async move { Ok(id) }).await;
    /// assert_eq!(first.into_iter().collect::<Result<Vec<_>, _>>().unwrap(), [1, 2]);
    ///
    /// let second: Vec<Result<u32, Error>> =
    ///     guard.run_batch(batch(&[2, 3]), |id| async move { Ok(id) }).await;
    /// assert!(matches!(second[0], Err(Error::Duplicate { .. })));
    /// assert_eq!(second[1].as_ref().unwrap(), &3);
    /// # }
    /// ```
    pub async fn run_batch<T, F, Fut, R>(&self, items: Vec<(Key, T)>, handler: F) -> Vec<R>
    where
        F: Fn(T) -> Fut,
        Fut: Future<Output = R>,
        R: HandlerResult,
    {
        self.batch().run(items, handler).await
    }

    /// Runs `body` at most once for `key`, with these settings: a shorthand for
    /// `self.operation(key).run(body)`.
    pub fn run<R, F>(&self, key: Key, body: F) -> impl Future<Output = R>
    where
        R: HandlerResult,
        F: Future<Output = R>,
    {
        self.operation(key).run(body)
    }
}
