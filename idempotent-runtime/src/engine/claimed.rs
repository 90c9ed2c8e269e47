//! [`Claimed`]: an acquired claim, as its owner, the watchdog and the body see it: key,
//! token, fence, lease, and whether the lease is lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use crate::key::Key;
use crate::store::{ClaimRequest, Fingerprint, SharedStore, Token};

/// Everything that travels with an acquired claim.
pub(crate) struct Claimed {
    pub(crate) store: SharedStore,
    pub(crate) key: Key,
    pub(crate) token: Token,
    pub(crate) fence: u64,
    /// The fingerprint the claim was sent with.
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) lease: Duration,
    pub(crate) ttl: Duration,
    /// How long the record lives from the claim ([`ClaimRequest::record_lifetime`]).
    pub(crate) record_lifetime: Duration,
    /// When the claim was sent: the lease is measured from here on the caller's clock, which
    /// can only make the caller think it lost the lease early, never late.
    pub(crate) sent_at: tokio::time::Instant,
    /// When the last renewal that succeeded was sent (the claim's own send time at first).
    renewed_at: Mutex<tokio::time::Instant>,
    lost: AtomicBool,
    lost_notify: Notify,
}

impl Claimed {
    pub(crate) fn new(
        store: SharedStore,
        req: ClaimRequest,
        fence: u64,
        sent_at: tokio::time::Instant,
    ) -> Claimed {
        let record_lifetime = req.record_lifetime();
        Claimed {
            store,
            key: req.key,
            token: req.token,
            fence,
            fingerprint: req.fingerprint,
            lease: req.lease,
            ttl: req.ttl,
            record_lifetime,
            sent_at,
            renewed_at: Mutex::new(sent_at),
            lost: AtomicBool::new(false),
            lost_notify: Notify::new(),
        }
    }

    /// When the lease runs out, as far as the caller knows.
    pub(crate) fn lease_until(&self) -> tokio::time::Instant {
        *self
            .renewed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            + self.lease
    }

    /// Records a renewal that succeeded, sent at `sent_at`.
    pub(crate) fn renewed(&self, sent_at: tokio::time::Instant) {
        let mut at = self
            .renewed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *at = (*at).max(sent_at);
    }

    /// Marks the lease lost and wakes whoever waits for that.
    pub(crate) fn set_lost(&self) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            self.lost_notify.notify_waiters();
        }
    }

    /// Whether the lease is lost: marked lost (the store said so, or the watchdog saw it run
    /// out), or past its end on the caller's clock even if no watchdog has looked yet (one
    /// starved of the CPU, a paused process), so the answer is never late.
    pub(crate) fn is_lost(&self) -> bool {
        self.is_marked_lost() || tokio::time::Instant::now() >= self.lease_until()
    }

    /// Whether the lease was marked lost ([`set_lost`](Claimed::set_lost)).
    pub(crate) fn is_marked_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Resolves once the lease is lost.
    pub(crate) async fn lost(&self) {
        let notified = self.lost_notify.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        if self.is_lost() {
            return;
        }
        notified.await;
    }
}
