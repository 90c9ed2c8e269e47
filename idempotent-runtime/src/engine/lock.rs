//! [`Lock`]: a fenced lease lock on any store, for update-type operations that must not run
//! concurrently (deduct a balance, rebuild a cache entry) but may run again later.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::engine::claimed::Claimed;
use crate::engine::conclude::{Outcome, Report};
use crate::engine::decide::{decide, Busy, Next, Waiting};
use crate::engine::idempotency::Lifetime;
use crate::engine::owner::Owner;
use crate::engine::pending::PendingClaim;
use crate::engine::run::unwrap_req;
use crate::engine::watch::watch;
use crate::error::Error;
use crate::key::Key;
use crate::policy::{OnInProgress, OnLostLease};
use crate::store::{ClaimRequest, IntoStore, SharedStore, Token};
#[cfg(doc)]
use crate::store::{MAX_DURATION, MIN_DURATION};

/// A lease lock on a store: one holder per key at a time, each holder with a **fence** that
/// is higher than every earlier holder's.
///
/// A lock is a claim that is never completed: [`lock`](Lock::lock) claims the key with a
/// random token and the lease; the returned [`LockGuard`] renews the lease (every third of it)
/// while it lives and gives the key back when dropped or [`unlock`](LockGuard::unlock)ed,
/// only if its token still holds it. A holder that crashes holds the key until its lease runs
/// out; the next holder gets a higher fence (the crashed holder's + 1 while its record still
/// exists; once the record expired, the store's clock, which is higher still).
///
/// A lease lock cannot stop a holder that was paused (a long GC pause, a stopped VM) past
/// its lease from writing after someone else took over. The **fence** can: make the protected
/// resource refuse writes whose fence is not higher than the last one it accepted:
///
/// ```sql
/// UPDATE accounts SET balance = balance - $amount, fence = $fence
///  WHERE id = $id AND fence < $fence
/// ```
///
/// Lock keys share the store with operation keys: give locks prefixes of their own.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use idempotent_runtime::{Key, Lock, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_runtime::Error> {
/// let locks = Lock::new(Arc::new(MemoryStore::new()), Duration::from_secs(30))
///     .wait(Duration::from_secs(5));
/// let key = Key::new("balance:deduct", 1, &[&"user-7"])?;
///
/// let held = locks.lock(key.clone()).await?;
/// assert!(locks.try_lock(key.clone()).await?.is_none()); // held
/// let fence = held.fence(); // pass it to the writes the lock protects
/// assert!(held.unlock().await?);
///
/// let next = locks.try_lock(key).await?.expect("free again");
/// assert!(next.fence() > fence);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Lock {
    store: SharedStore,
    lease: Duration,
    wait: Duration,
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lock")
            .field("lease", &self.lease)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl Lock {
    /// Locks on `store` with `lease`: how long a holder that stopped renewing (crashed,
    /// partitioned, paused) keeps others out. [`lock`](Lock::lock) waits up to 10 seconds by
    /// default.
    pub fn new(store: impl IntoStore, lease: Duration) -> Lock {
        Lock {
            store: store.into_store(),
            lease,
            wait: Duration::from_secs(10),
        }
    }

    /// How long [`lock`](Lock::lock) waits for a held key before it gives up. A wait above
    /// [`MAX_DURATION`] (`Duration::MAX` included) waits `MAX_DURATION`.
    pub fn wait(mut self, max: Duration) -> Lock {
        self.wait = max;
        self
    }

    /// Takes the lock on `key`, waiting up to the [`wait`](Lock::wait) bound while another
    /// holder has it (claims again with a jittered backoff from 5 ms to 250 ms).
    ///
    /// # Errors
    ///
    /// [`Error::InProgress`] (with the holder's fence) when the key was still held at the
    /// bound; [`Error::Store`] when the store failed (nothing is held then: a claim whose
    /// reply was lost is read back or given back); [`Error::InvalidDuration`] for a lease
    /// outside [`MIN_DURATION`] ..= [`MAX_DURATION`]; [`Error::Duplicate`] when the key belongs
    /// to a completed operation, not to a lock; [`Error::NoRuntime`] outside a Tokio runtime
    /// (a held lock renews its lease on a task of the runtime). In every error case the key
    /// is left free.
    pub async fn lock(&self, key: Key) -> Result<LockGuard, Error> {
        self.acquire(key, OnInProgress::Wait(self.wait)).await
    }

    /// Takes the lock on `key` if no one holds it: `Ok(None)` when someone does.
    ///
    /// # Errors
    ///
    /// As [`lock`](Lock::lock), but never [`Error::InProgress`].
    pub async fn try_lock(&self, key: Key) -> Result<Option<LockGuard>, Error> {
        match self.acquire(key, OnInProgress::Reject).await {
            Ok(held) => Ok(Some(held)),
            Err(Error::InProgress { .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    async fn acquire(&self, key: Key, policy: OnInProgress) -> Result<LockGuard, Error> {
        // Checked before the claim: without a runtime the guard could not renew its lease,
        // and a claim taken then would hold the key until its lease ran out.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoRuntime);
        }
        let lifetime = Lifetime::of_lock(self.lease)?;
        let span = Report::span(&key);
        self.claim(lifetime.request(key, None), policy, span.clone())
            .instrument(span)
            .await
    }

    async fn claim(
        &self,
        req: ClaimRequest,
        policy: OnInProgress,
        span: tracing::Span,
    ) -> Result<LockGuard, Error> {
        let report = Report::new(span, self.store.name());
        let req = Arc::new(req);
        let mut waiting = Waiting::new(policy);
        loop {
            let sent_at = tokio::time::Instant::now();
            let claim = match PendingClaim::new(&self.store, &req).await {
                Ok(claim) => claim,
                Err(err) => {
                    report.conclude(&req.key, Outcome::StoreError);
                    return Err(err.into());
                }
            };
            let next = decide(claim, policy, &mut waiting);
            report.fence(next.fence());
            let (outcome, err) = match next {
                Next::Run { fence } => {
                    report.conclude(&req.key, Outcome::Acquired);
                    let claimed = Claimed::new(self.store.clone(), unwrap_req(req), fence, sent_at);
                    return Ok(LockGuard::new(Arc::new(claimed)));
                }
                Next::Busy {
                    then: Busy::Retry(pause),
                    ..
                } => {
                    tokio::time::sleep(jitter(pause)).await;
                    continue;
                }
                Next::Busy { fence, .. } => (
                    Outcome::InProgress,
                    Error::InProgress {
                        key: req.key.clone(),
                        fence,
                    },
                ),
                // The key belongs to an operation, not to a lock.
                Next::Completed { .. } | Next::Mismatch { .. } => (
                    Outcome::Duplicate,
                    Error::Duplicate {
                        key: req.key.clone(),
                    },
                ),
            };
            report.conclude(&req.key, outcome);
            return Err(err);
        }
    }
}

/// `pause` scaled by a random factor in 0.5 ..= 1.5, so waiting holders do not claim in step.
fn jitter(pause: Duration) -> Duration {
    // A fresh token is a per-process random salt and a counter: mixed (splitmix64), a
    // different number on every call and in every process.
    let token = Token::generate();
    let (salt, count) = token.as_bytes().split_at(8);
    let word = |b: &[u8]| b.iter().fold(0u64, |n, &x| (n << 8) | u64::from(x));
    let mut z = word(salt) ^ word(count).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    pause / 2 + pause * u32::from((z & 0xff) as u8) / 255
}

/// A held lock (see [`Lock`]): its fence, its lost-lease signal, and the lease renewal that
/// runs while it lives. Dropping it gives the key back in the background (only if this holder
/// still owns it); [`unlock`](LockGuard::unlock) does so and reports.
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    owner: Option<Owner>,
    claim: Arc<Claimed>,
    watchdog: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.claim.key)
            .field("fence", &self.claim.fence)
            .field("lost", &self.claim.is_lost())
            .finish()
    }
}

impl LockGuard {
    fn new(claim: Arc<Claimed>) -> LockGuard {
        let watched = claim.clone();
        // Renews until aborted; once the lease is lost it stops renewing and only waits.
        let watchdog = tokio::spawn(async move {
            watch(
                std::pin::pin!(std::future::pending::<()>()),
                &watched,
                OnLostLease::Continue,
            )
            .await;
        });
        LockGuard {
            owner: Some(Owner::new(claim.clone())),
            claim,
            watchdog: Some(watchdog),
        }
    }

    /// The locked key.
    pub fn key(&self) -> &Key {
        &self.claim.key
    }

    /// This holder's fence: higher than every earlier holder's of the key. Pass it to the
    /// writes the lock protects, and have them refuse a fence that is not higher than the last
    /// one they accepted.
    pub fn fence(&self) -> u64 {
        self.claim.fence
    }

    /// Whether the lease was lost: the store said another holder has the key, or no renewal
    /// succeeded before the lease ran out (counted from when each renewal was sent, so this
    /// turns true early rather than late).
    pub fn is_lost(&self) -> bool {
        self.claim.is_lost()
    }

    /// Resolves once the lease is lost: `select!` on it to stop a critical section whose
    /// exclusivity is gone.
    pub async fn lost(&self) {
        self.claim.lost().await;
    }

    /// Gives the key back: `Ok(true)` when this holder still owned it, `Ok(false)` when the
    /// lease had run out and the key is someone else's (or free).
    ///
    /// # Errors
    ///
    /// [`Error::Store`] when the store did not answer; the key is then given back in the
    /// background until the lease would run out.
    pub async fn unlock(mut self) -> Result<bool, Error> {
        self.stop_watchdog();
        match self.owner.take() {
            Some(owner) => Ok(owner.give_back_now().await?),
            None => Ok(false),
        }
    }

    fn stop_watchdog(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.abort();
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        self.stop_watchdog();
        // `Owner`'s drop gives the key back in the background.
        self.owner.take();
    }
}
