//! What a store answers: the [`Claim`] outcome, and the [`Record`] it reads.

use std::time::Duration;

use crate::store::{Fingerprint, Token};

/// The outcome of [`Store::claim`](crate::store::Store::claim).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The caller owns the key now. `fence` grows by one on every acquisition of the key.
    Acquired {
        /// The new fence.
        fence: u64,
    },
    /// The operation was completed before; `result` is what the first run stored.
    Completed {
        /// The fence of the completed run.
        fence: u64,
        /// The stored result, if any.
        result: Option<Vec<u8>>,
    },
    /// Another owner holds a live lease.
    InProgress {
        /// The fence of the live claim.
        fence: u64,
    },
    /// The key's record carries a different payload fingerprint.
    Mismatch {
        /// The fence of the existing record.
        fence: u64,
    },
}

/// The state of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An owner holds (or held, if the lease ran out) the claim.
    InProgress {
        /// Time left on the lease; zero when it has run out.
        lease_left: Duration,
    },
    /// The operation completed.
    Completed,
    /// The owner gave the claim back.
    Released,
}

/// A record as returned by [`Store::read`](crate::store::Store::read). Built with [`Record::new`] (for a third-party
/// store); fields may be added in later releases.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// The record's state.
    pub state: RecordState,
    /// The token of the record's last owner.
    pub token: Token,
    /// The record's fence.
    pub fence: u64,
    /// The fingerprint stored with the claim.
    pub fingerprint: Option<Fingerprint>,
    /// The stored result, for a completed record.
    pub result: Option<Vec<u8>>,
    /// How long the record has been in its state, on the store's clock: since the claim for
    /// an in-progress record (renewals do not count), since the completion or release
    /// otherwise. `None` where the store does not keep it (Redis keeps it for in-progress
    /// records only) or for records written before it was kept.
    pub age: Option<Duration>,
    /// Time until the record expires, on the store's clock, where the store reports it.
    pub expires_in: Option<Duration>,
}

impl Record {
    /// A record in `state`, last owned by `token`, with `fence`, no fingerprint and no stored
    /// result: for third-party stores answering [`Store::read`](crate::store::Store::read).
    ///
    /// ```
    /// use idempotent_runtime::{Record, RecordState, Token};
    ///
    /// let record = Record::new(RecordState::Completed, Token::generate(), 42)
    ///     .with_result(Some(b"receipt".to_vec()));
    /// assert_eq!(record.fence, 42);
    /// ```
    pub fn new(state: RecordState, token: Token, fence: u64) -> Record {
        Record {
            state,
            token,
            fence,
            fingerprint: None,
            result: None,
            age: None,
            expires_in: None,
        }
    }

    /// The same record with a stored fingerprint.
    pub fn with_fingerprint(mut self, fingerprint: Option<Fingerprint>) -> Record {
        self.fingerprint = fingerprint;
        self
    }

    /// The same record with a stored result.
    pub fn with_result(mut self, result: Option<Vec<u8>>) -> Record {
        self.result = result;
        self
    }

    /// The same record with how long it has been in its state ([`Record::age`]).
    pub fn with_age(mut self, age: Option<Duration>) -> Record {
        self.age = age;
        self
    }

    /// The same record with the time until it expires ([`Record::expires_in`]).
    pub fn with_expires_in(mut self, expires_in: Option<Duration>) -> Record {
        self.expires_in = expires_in;
        self
    }
}
