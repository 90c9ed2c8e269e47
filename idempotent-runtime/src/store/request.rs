//! What a store is asked to write: [`ClaimRequest`], [`Completion`] (with the
//! [`AcquiredClaim`] it may name), and the [`Ending`]s of a batch.

use std::time::Duration;

use crate::key::Key;
use crate::store::{Fingerprint, Token};

/// What [`Store::claim`](crate::store::Store::claim) is asked to do. Built with [`ClaimRequest::new`]; fields may be
/// added in later releases.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// The operation key.
    pub key: Key,
    /// The new owner's token.
    pub token: Token,
    /// How long the claim stays live without renewal.
    pub lease: Duration,
    /// How long the record is kept.
    pub ttl: Duration,
    /// The payload's fingerprint, if the caller checks payloads.
    pub fingerprint: Option<Fingerprint>,
}

impl ClaimRequest {
    /// A claim of `key` for `token`, live for `lease` without renewal, its record kept `ttl`,
    /// without a payload fingerprint.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{ClaimRequest, Fingerprint, Key, Token};
    ///
    /// let key = Key::new("order", 1, &[&7u32]).unwrap();
    /// let req = ClaimRequest::new(key, Token::generate(), Duration::from_secs(30), Duration::from_secs(3600))
    ///     .with_fingerprint(Fingerprint::of(&[&"EUR", &1250u64]));
    /// assert!(req.fingerprint.is_some());
    /// ```
    pub fn new(key: Key, token: Token, lease: Duration, ttl: Duration) -> ClaimRequest {
        ClaimRequest {
            key,
            token,
            lease,
            ttl,
            fingerprint: None,
        }
    }

    /// The same claim, checking the payload's fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Fingerprint) -> ClaimRequest {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// How long the record this claim writes lives: the longer of [`ttl`](Self::ttl) and
    /// [`lease`](Self::lease), so that a claim's record never expires while its lease runs.
    /// Every store sets the expiry of the record it claims from it (clamped as every
    /// duration is, [`clamped_millis`](crate::store::clamped_millis)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{ClaimRequest, Key, Token};
    ///
    /// let key = Key::new("order", 1, &[&7u32]).unwrap();
    /// let (lease, ttl) = (Duration::from_secs(600), Duration::from_secs(60));
    /// let req = ClaimRequest::new(key, Token::generate(), lease, ttl);
    /// assert_eq!(req.record_lifetime(), lease);
    /// ```
    pub fn record_lifetime(&self) -> Duration {
        self.ttl.max(self.lease)
    }
}

/// What [`Store::complete`](crate::store::Store::complete) writes. Built with [`Completion::new`]; fields may be added in
/// later releases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completion {
    /// The result to replay to duplicates, opaque to the store.
    pub result: Option<Vec<u8>>,
    /// How long the completed record is kept.
    pub ttl: Duration,
    /// The claim this completes, as its owner acquired it, when the owner knows it (see
    /// [`Completion::for_claim`]); `None` for a completion by token alone.
    pub claim: Option<AcquiredClaim>,
}

impl Completion {
    /// A completion storing `result` (if any), the record kept `ttl` from now.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::Completion;
    ///
    /// let done = Completion::new(Some(b"receipt-1".to_vec()), Duration::from_secs(3600));
    /// assert_eq!(done.ttl, Duration::from_secs(3600));
    /// ```
    pub fn new(result: Option<Vec<u8>>, ttl: Duration) -> Completion {
        Completion {
            result,
            ttl,
            claim: None,
        }
    }

    /// The same completion, naming the claim it completes (see [`AcquiredClaim`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::{AcquiredClaim, Completion};
    ///
    /// let done = Completion::new(None, Duration::from_secs(3600))
    ///     .for_claim(AcquiredClaim::new(42, None));
    /// assert_eq!(done.claim.map(|c| c.fence), Some(42));
    /// ```
    #[must_use]
    pub fn for_claim(mut self, claim: AcquiredClaim) -> Completion {
        self.claim = Some(claim);
        self
    }
}

/// How a claim was acquired: its fence, the fingerprint and the lease it was sent with.
/// Carried by a [`Completion`] so that a store can recognise the owner's record cheaply; it
/// never changes what a completion decides (the token does).
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::{AcquiredClaim, Fingerprint};
///
/// let claim = AcquiredClaim::new(1_796_130_461_329_139, Some(Fingerprint::of(&[&"EUR"])))
///     .with_lease(Duration::from_secs(30));
/// assert_eq!(claim.fence, 1_796_130_461_329_139);
/// assert_eq!(claim.lease, Some(Duration::from_secs(30)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquiredClaim {
    /// The fence [`Claim::Acquired`](crate::store::Claim::Acquired) answered.
    pub fence: u64,
    /// The fingerprint of the [`ClaimRequest`], if it had one.
    pub fingerprint: Option<Fingerprint>,
    /// The lease of the [`ClaimRequest`], when the owner names it.
    pub lease: Option<Duration>,
}

impl AcquiredClaim {
    /// The claim acquired with `fence`, sent with `fingerprint`.
    pub fn new(fence: u64, fingerprint: Option<Fingerprint>) -> AcquiredClaim {
        AcquiredClaim {
            fence,
            fingerprint,
            lease: None,
        }
    }

    /// The same claim, sent with a lease of `lease` ([`ClaimRequest::lease`]).
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> AcquiredClaim {
        self.lease = Some(lease);
        self
    }
}

/// The end of one claim in a [`Store::complete_many`](crate::store::Store::complete_many)
/// batch: `action` on `key`, if `token` still owns it.
///
/// A claim ends by a completion or a release; the store answers an ending as it answers the
/// single [`Store::complete`](crate::store::Store::complete) or
/// [`Store::release`](crate::store::Store::release). "End" is kept for what a broker consumer does
/// with a message: ack, redeliver or dead-letter it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ending {
    /// The operation key.
    pub key: Key,
    /// The owner's token.
    pub token: Token,
    /// Complete or release.
    pub action: End,
}

impl Ending {
    /// A completion of `key` by `token`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_runtime::store::{End, Ending};
    /// use idempotent_runtime::{Completion, Key, Token};
    ///
    /// let key = Key::new("order", 1, &[&7u32]).unwrap();
    /// let done = Ending::complete(key, Token::generate(), Completion::new(None, Duration::from_secs(60)));
    /// assert!(matches!(done.action, End::Complete(_)));
    /// ```
    pub fn complete(key: Key, token: Token, completion: Completion) -> Ending {
        Ending {
            key,
            token,
            action: End::Complete(completion),
        }
    }

    /// A release of `key` by `token`.
    pub fn release(key: Key, token: Token) -> Ending {
        Ending {
            key,
            token,
            action: End::Release,
        }
    }
}

/// How an [`Ending`] ends its claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum End {
    /// [`Store::complete`](crate::store::Store::complete) with this completion.
    Complete(Completion),
    /// [`Store::release`](crate::store::Store::release).
    Release,
}
