//! The one error type of the framework, and what a consumer should do with each case.

use std::error::Error as StdError;
use std::fmt;

use crate::key::{Key, KeyError};

/// What a message consumer should do with a message whose handler returned an [`Error`].
///
/// | action | RabbitMQ | NATS JetStream | HTTP |
/// |---|---|---|---|
/// | [`Ack`](Action::Ack) | `basic.ack` | `ack` | 2xx (replay) or 409 |
/// | [`Redeliver`](Action::Redeliver) | `basic.nack(requeue)` | `nak` (with delay) | 409 / 503 |
/// | [`DeadLetter`](Action::DeadLetter) | `basic.reject(requeue=false)` | `term` | 422 / 400 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Action {
    /// The message is done with: acknowledge it.
    Ack,
    /// Nothing was lost, but the message must be tried again later: negative-acknowledge it
    /// so the broker redelivers it (with a delay where the broker supports one).
    Redeliver,
    /// Retrying cannot help: route the message to a dead-letter queue for an operator.
    DeadLetter,
}

/// Errors returned by idempotent handlers, the builder API and stores.
///
/// Handlers convert it into their own error type (`AppError: From<idempotency::Error>`), so a
/// duplicate or a store outage arrives as an ordinary `Err`. [`Error::action`] tells a
/// consumer what to do with the message.
///
/// ```
/// use idempotent_runtime::{Action, Error, Key};
///
/// let key = Key::new("order:consume", 1, &[&42u64]).unwrap();
/// let err = Error::Duplicate { key };
/// assert_eq!(err.action(), Action::Ack);
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The operation was already completed by an earlier call and no result is replayed
    /// (the handler has no `replay`, or the first run stored none). The handler did not run.
    ///
    /// Consumer: [`Action::Ack`]; the effect is applied exactly once already.
    #[error("`{key}` was already processed; the handler did not run again")]
    Duplicate {
        /// The operation key.
        key: Key,
    },

    /// Another owner holds a live claim on the key (a concurrent duplicate, or a crashed
    /// owner whose lease has not yet run out). The handler did not run.
    ///
    /// Consumer: [`Action::Redeliver`], preferably with a delay of about the lease.
    #[error("`{key}` is being processed by another owner (fence {fence})")]
    InProgress {
        /// The operation key.
        key: Key,
        /// The fence of the live claim.
        fence: u64,
    },

    /// Another owner holds a live claim and the policy is [`OnInProgress::Skip`](crate::OnInProgress::Skip):
    /// the message is dropped in favour of the one being processed.
    ///
    /// Consumer: [`Action::Ack`].
    #[error("`{key}` is being processed by another owner; this duplicate was skipped")]
    Skipped {
        /// The operation key.
        key: Key,
    },

    /// The key was seen before with a different payload fingerprint. Nothing ran and nothing
    /// was replayed: someone else's result is never returned.
    ///
    /// Consumer: [`Action::DeadLetter`]; the producer reused a key for a different request.
    #[error("`{key}` was already used with a different payload")]
    PayloadMismatch {
        /// The operation key.
        key: Key,
    },

    /// The handler ran, but its claim was taken over (its lease ran out without renewal and a
    /// newer owner, with a higher fence, claimed the key) before it could complete. The
    /// completion was refused; the newer owner's record stands.
    ///
    /// Consumer: [`Action::Redeliver`]: the redelivered message meets the newer owner's
    /// record. Whether the effect happened twice depends on the business check (`done`, a
    /// status compare-and-set or the fence); this error is how such cases are counted.
    #[error("lost ownership of `{key}` (fence {fence}) before completing")]
    LostOwnership {
        /// The operation key.
        key: Key,
        /// The fence this caller held.
        fence: u64,
    },

    /// An earlier run failed and its policy was [`OnError::Hold`](crate::OnError::Hold): the
    /// key stays blocked until its record expires or an operator clears it.
    ///
    /// Consumer: [`Action::DeadLetter`].
    #[error("`{key}` is held after a failed run; an operator must look at it")]
    Held {
        /// The operation key.
        key: Key,
    },

    /// The store failed or could not be reached. With the default fail-closed policy the
    /// handler did not run and nothing was released.
    ///
    /// Consumer: [`Action::Redeliver`]; processing resumes when the store is back. Two kinds
    /// are not outages and dead-letter instead: a record the store holds but cannot be read
    /// ([`StoreErrorKind::Corrupt`]) and a command the store refuses for good
    /// ([`StoreErrorKind::Rejected`]).
    #[error("idempotency store error")]
    Store(#[from] StoreError),

    /// A handler ran before any store was configured: neither `store = ...` on the attribute
    /// nor [`set_default_store`](crate::set_default_store) at start-up. Nothing ran.
    ///
    /// Consumer: [`Action::Redeliver`]; fix the start-up code.
    #[error("no idempotency store is configured: call `idempotency::set_default_store` at start-up or pass `store = ...`")]
    NoStore,

    /// A duration setting (`ttl`, `lease`) is outside [`MIN_DURATION`](crate::store::MIN_DURATION)
    /// ..= [`MAX_DURATION`](crate::store::MAX_DURATION). Nothing ran and the store was not
    /// touched, whatever the backend. The attribute rejects such literals at compile time;
    /// [`Idempotency::check`](crate::Idempotency::check) finds them at start-up.
    ///
    /// Consumer: [`Action::Redeliver`]; fix the configuration.
    #[error("`{setting}` of {value:?} is outside the supported range of 1 ms to 36500 days")]
    InvalidDuration {
        /// `"ttl"` or `"lease"`.
        setting: &'static str,
        /// The value given.
        value: std::time::Duration,
    },

    /// The call needs a Tokio runtime (to renew a held lease on a task of its own) and was
    /// made outside one, from another executor or plain `block_on`. Nothing was claimed.
    ///
    /// Consumer: [`Action::Redeliver`]; run the call on a Tokio runtime.
    #[error("called outside a Tokio runtime: a held lease is renewed on a Tokio task")]
    NoRuntime,

    /// The key could not be built from the message (an empty identifier, say). Nothing ran.
    ///
    /// Consumer: [`Action::DeadLetter`].
    #[error("invalid idempotency key")]
    InvalidKey(#[from] KeyError),

    /// A stored result could not be encoded or decoded (the result type changed between
    /// deployments, say).
    ///
    /// Consumer: [`Action::DeadLetter`]; the first run's effect stands.
    #[error("stored result could not be {op}")]
    Codec {
        /// `"encoded"` or `"decoded"`.
        op: &'static str,
        /// The codec's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

impl Error {
    /// What a message consumer should do with the message.
    pub fn action(&self) -> Action {
        match self {
            Error::Duplicate { .. } | Error::Skipped { .. } => Action::Ack,
            Error::Store(err) if err.is_permanent() => Action::DeadLetter,
            Error::InProgress { .. }
            | Error::LostOwnership { .. }
            | Error::Store(_)
            | Error::NoStore
            | Error::NoRuntime
            | Error::InvalidDuration { .. } => Action::Redeliver,
            Error::PayloadMismatch { .. }
            | Error::Held { .. }
            | Error::InvalidKey(_)
            | Error::Codec { .. } => Action::DeadLetter,
        }
    }

    /// The operation key the error is about, when there is one.
    pub fn key(&self) -> Option<&Key> {
        match self {
            Error::Duplicate { key }
            | Error::InProgress { key, .. }
            | Error::Skipped { key }
            | Error::PayloadMismatch { key }
            | Error::LostOwnership { key, .. }
            | Error::Held { key } => Some(key),
            Error::Store(_)
            | Error::NoStore
            | Error::NoRuntime
            | Error::InvalidDuration { .. }
            | Error::InvalidKey(_)
            | Error::Codec { .. } => None,
        }
    }

    /// Whether the handler's work is known to be done already, so the message can be
    /// acknowledged: true for [`Error::Duplicate`] and [`Error::Skipped`].
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Error::Duplicate { .. } | Error::Skipped { .. })
    }
}

/// What kind of failure a [`StoreError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store could not be reached, or refused the command before applying it.
    Unavailable,
    /// The command was sent but its reply was lost or timed out: it may or may not have been
    /// applied. The engine resolves this by reading the record back by token.
    OutcomeUnknown,
    /// The store answered with something the backend does not understand (an unexpected
    /// reply shape, a server too old for the backend).
    Protocol,
    /// The store holds a record under the key that the backend cannot read: corrupt, written
    /// by something else, or of an unknown format. Not an outage: retrying meets the same
    /// record, so a consumer dead-letters the message and an operator looks at the key.
    Corrupt,
    /// The store refused this command for good, without applying it: a value too large for
    /// it, data too long for a column, a constraint. Not an outage: sending it again fails
    /// the same way. A completion refused this way is retried without its stored result.
    Rejected,
    /// The store's configuration is unsafe for idempotency records (an eviction policy that
    /// drops live claims, a read-only replica).
    Unsafe,
}

impl StoreErrorKind {
    /// The kind as a short lowercase name (`unavailable`, `outcome_unknown`, `protocol`,
    /// `corrupt`, `rejected`, `unsafe`), as metrics label it.
    ///
    /// ```
    /// use idempotent_runtime::StoreErrorKind;
    /// assert_eq!(StoreErrorKind::OutcomeUnknown.as_str(), "outcome_unknown");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::OutcomeUnknown => "outcome_unknown",
            StoreErrorKind::Protocol => "protocol",
            StoreErrorKind::Corrupt => "corrupt",
            StoreErrorKind::Rejected => "rejected",
            StoreErrorKind::Unsafe => "unsafe",
        }
    }
}

/// An error from a [`Store`](crate::Store). The backend's own error is kept as the source,
/// never turned into a string.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl StoreError {
    /// A new error of `kind` with a message.
    ///
    /// ```
    /// use idempotent_runtime::{StoreError, StoreErrorKind};
    ///
    /// let err = StoreError::new(StoreErrorKind::Unavailable, "connection refused");
    /// assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    /// ```
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> StoreError {
        StoreError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the backend's error as the source.
    pub fn with_source(mut self, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The kind of failure.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// Whether the command may have been applied although no reply arrived.
    pub fn is_outcome_unknown(&self) -> bool {
        self.kind == StoreErrorKind::OutcomeUnknown
    }

    /// Whether sending the same command again cannot succeed: [`StoreErrorKind::Corrupt`] and
    /// [`StoreErrorKind::Rejected`].
    ///
    /// ```
    /// use idempotent_runtime::{StoreError, StoreErrorKind};
    ///
    /// assert!(StoreError::new(StoreErrorKind::Corrupt, "bad record").is_permanent());
    /// assert!(!StoreError::new(StoreErrorKind::Unavailable, "down").is_permanent());
    /// ```
    pub fn is_permanent(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::Corrupt | StoreErrorKind::Rejected
        )
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            StoreErrorKind::Unavailable => "store unavailable",
            StoreErrorKind::OutcomeUnknown => "store reply lost",
            StoreErrorKind::Protocol => "unexpected store reply",
            StoreErrorKind::Unsafe => "unsafe store configuration",
            StoreErrorKind::Corrupt => "unreadable record",
            StoreErrorKind::Rejected => "store refused the command",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
