//! [`Idempotency`]: the settings shared by many calls.

use std::time::Duration;

use crate::error::Error;
use crate::key::Key;
use crate::policy::{default_lease, OnInProgress, OnLostLease, OnStoreError};
use crate::store::{
    ClaimRequest, Fingerprint, IntoStore, SharedStore, Token, MAX_DURATION, MIN_DURATION,
};

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
/// let coupons = Idempotency::new(Duration::from_secs(3600)).store(Arc::new(MemoryStore::new()));
/// let key = Key::new("coupon:grant", 1, &[&"user-7", &"spring-sale"]).unwrap();
///
/// let first: Result<u32, Error> = coupons.run(key.clone(), async { Ok(42) }).await;
/// assert_eq!(first.unwrap(), 42);
///
/// let again: Result<u32, Error> = coupons.run(key, async { Ok(43) }).await;
/// assert!(matches!(again, Err(Error::Duplicate { .. })));
/// # }
/// ```
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) store: Option<SharedStore>,
    pub(crate) ttl: Duration,
    pub(crate) lease: Option<Duration>,
    pub(crate) in_progress: OnInProgress,
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
            in_progress: OnInProgress::default(),
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
    pub fn on_in_progress(mut self, policy: OnInProgress) -> Idempotency {
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
        self.lifetime().map(drop)
    }

    /// The ttl and the lease, checked.
    pub(crate) fn lifetime(&self) -> Result<Lifetime, Error> {
        Lifetime::new(self.ttl, self.lease_duration())
    }

    /// The record ttl.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The effective lease: the one set, or the default for the ttl.
    pub fn lease_duration(&self) -> Duration {
        self.lease.unwrap_or_else(|| default_lease(self.ttl))
    }
}

/// A claim's ttl and lease, each checked to lie in [`MIN_DURATION`] ..= [`MAX_DURATION`]:
/// the one place durations are validated, for every door ([`Idempotency`], a lock, a call in
/// the caller's transaction).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lifetime {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
}

impl Lifetime {
    /// `ttl` and `lease`, checked in that order.
    pub(crate) fn new(ttl: Duration, lease: Duration) -> Result<Lifetime, Error> {
        Ok(Lifetime {
            ttl: in_range("ttl", ttl)?,
            lease: in_range("lease", lease)?,
        })
    }

    /// A lock's: its record lives twice the lease (renewals keep at least one lease ahead),
    /// so a holder that stopped renewing is taken over with its fence + 1 while the record
    /// exists; once it expired, the store's clock makes the next fence higher anyway.
    pub(crate) fn of_lock(lease: Duration) -> Result<Lifetime, Error> {
        let lease = in_range("lease", lease)?;
        Ok(Lifetime {
            ttl: lease.saturating_mul(2).min(MAX_DURATION),
            lease,
        })
    }

    /// The claim of `key` with these durations and a fresh token.
    pub(crate) fn request(self, key: Key, fingerprint: Option<Fingerprint>) -> ClaimRequest {
        let mut req = ClaimRequest::new(key, Token::generate(), self.lease, self.ttl);
        req.fingerprint = fingerprint;
        req
    }
}

/// `value` when it lies in [`MIN_DURATION`] ..= [`MAX_DURATION`].
fn in_range(setting: &'static str, value: Duration) -> Result<Duration, Error> {
    if (MIN_DURATION..=MAX_DURATION).contains(&value) {
        Ok(value)
    } else {
        Err(Error::InvalidDuration { setting, value })
    }
}
