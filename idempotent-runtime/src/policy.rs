//! Policies: what to do when a claim meets a live owner, when the store fails, and when the
//! handler fails. Each has a safe default.

use std::time::Duration;

/// What a call does when another owner holds a live claim on its key.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::OnInProgress;
///
/// assert_eq!(OnInProgress::default(), OnInProgress::Reject);
/// let wait = OnInProgress::Wait(Duration::from_secs(5));
/// # let _ = wait;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnInProgress {
    /// Return [`Error::InProgress`](crate::Error::InProgress) at once; the broker redelivers
    /// the message later. The default.
    #[default]
    Reject,
    /// Poll until the owner completes (then behave as for a completed key: replay or
    /// [`Error::Duplicate`](crate::Error::Duplicate)), releases or loses its lease (then claim
    /// and run), for at most the given time; then [`Error::InProgress`](crate::Error::InProgress).
    /// For HTTP clients that should get the first request's response. A time above
    /// [`MAX_DURATION`](crate::store::MAX_DURATION) (`Duration::MAX` included) waits
    /// `MAX_DURATION`.
    Wait(Duration),
    /// Drop this duplicate: return [`Error::Skipped`](crate::Error::Skipped), which a consumer
    /// acknowledges. Only for messages whose redelivery the live owner's own message covers.
    Skip,
}

/// What a call does when the store fails before the handler ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Return [`Error::Store`](crate::Error::Store); the handler does not run and nothing is
    /// released, so the broker redelivers the message once the store is back. The default.
    #[default]
    FailClosed,
    /// Run the handler unguarded (logged at `warn`): availability over exactly-once. Only for
    /// handlers whose duplicates are harmless or caught by the business itself.
    FailOpen,
}

/// What happens to the claim when the handler returns `Err`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnError {
    /// Give the claim back (only if this call still owns it), so a redelivery runs the
    /// handler again. The default: most errors are transient.
    #[default]
    Release,
    /// Keep the key blocked (the record is completed as failed): duplicates get
    /// [`Error::Held`](crate::Error::Held) until the record expires or an operator clears it.
    /// For errors after which a retry could do harm (a payment of unknown outcome, say).
    Hold,
    /// Store the error and replay it to duplicates, as the first call's answer (a validation
    /// error, say). Needs a serde error type: set it with
    /// [`Operation::store_errors`](crate::Operation::store_errors); a classifier that returns
    /// `Store` without it holds the key instead.
    Store,
}

/// The lease used when none is given: 30 seconds, or a third of the ttl when that is shorter.
pub(crate) fn default_lease(ttl: Duration) -> Duration {
    Duration::from_secs(30)
        .min(ttl / 3)
        .max(Duration::from_millis(1))
}

/// What the engine does with a body whose lease is lost while it runs: the store said another
/// owner holds the key, or no renewal succeeded before the lease ran out (the store was
/// unreachable for longer than the lease).
///
/// Either way the body can see it through [`Current::lost`](crate::Current::lost), and its
/// completion is refused with [`Error::LostOwnership`](crate::Error::LostOwnership) if another
/// owner took the key over.
///
/// ```
/// use idempotent_runtime::OnLostLease;
///
/// assert_eq!(OnLostLease::default(), OnLostLease::Continue);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLostLease {
    /// Let the body run on; it can watch [`Current::lost`](crate::Current::lost) itself. The
    /// default: stopping a body half-way can be worse than finishing it.
    #[default]
    Continue,
    /// Drop the body at its next `.await` and return
    /// [`Error::LostOwnership`](crate::Error::LostOwnership); the claim is given back if it is
    /// still ours. For bodies made of steps that are safe to stop between.
    Cancel,
}
