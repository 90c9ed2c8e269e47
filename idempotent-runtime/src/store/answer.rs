//! What a store answers: the [`Claim`] outcome, the [`Record`] it reads, and
//! [`claim_answer`], the one rule that decides what a claim answers for a record it finds.

use std::time::Duration;

use crate::store::{next_fence, ClaimRequest, Fingerprint, Token};

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

/// What a claim does with the live record it finds under its key: see [`claim_answer`].
///
/// ```
/// use idempotent_runtime::store::ClaimAnswer;
/// use idempotent_runtime::Claim;
///
/// // How a store answers either: a take-over is the acquisition it writes.
/// fn answered(answer: ClaimAnswer) -> Option<Claim> {
///     match answer {
///         ClaimAnswer::Answer(claim) => Some(claim),
///         ClaimAnswer::TakeOver { fence } => {
///             // ... write the in-progress record with `fence` ...
///             Some(Claim::Acquired { fence })
///         }
///         _ => None,
///     }
/// }
/// assert_eq!(answered(ClaimAnswer::TakeOver { fence: 7 }), Some(Claim::Acquired { fence: 7 }));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimAnswer {
    /// The claim answers this and writes nothing: the request's own claim again (a claim
    /// retried after a lost reply is `Acquired` with the record's fence), a completed
    /// record (with its result), another owner's live claim, or a payload mismatch.
    Answer(Claim),
    /// The key is free (the record was released, or its lease ran out with no other
    /// payload): the claim writes its in-progress record with `fence`, one more than the
    /// record's ([`next_fence`]), and answers [`Claim::Acquired`] with it.
    TakeOver {
        /// The fence of the new claim.
        fence: u64,
    },
}

/// The rule every store applies when a claim finds a live record under its key (a key
/// without one is acquired with [`next_fence`]`(None, now)`):
///
/// | the record | the claim answers |
/// |---|---|
/// | in progress, with the request's token (lease run out or not) | `Acquired` with its fence |
/// | completed, both fingerprints set and different | `Mismatch` |
/// | completed | `Completed`, with its result |
/// | in progress, another token, both fingerprints set and different | `Mismatch` |
/// | in progress, another token, lease left | `InProgress` |
/// | in progress, another token, lease run out | taken over with the next fence |
/// | released | taken over with the next fence |
///
/// `found.state`'s `lease_left` decides whether a lease is live: a store that knows the time
/// left only within an error subtracts the error first, so that a lease it cannot be sure
/// of reads as run out (and is then taken over only by a store that knows). The result of
/// a `Completed` answer is `found.result`.
///
/// Every store of this crate decides a claim by this function (the Redis script, in Lua,
/// is held to it by the repository's tests); a third-party store may too.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::store::{claim_answer, ClaimAnswer};
/// use idempotent_runtime::{Claim, ClaimRequest, Key, Record, RecordState, Token};
///
/// let key = Key::new("doc", 1, &[&"a"]).unwrap();
/// let minute = Duration::from_secs(60);
/// let req = ClaimRequest::new(key, Token::generate(), minute, minute);
/// let live = RecordState::InProgress { lease_left: Duration::from_secs(5) };
/// let others = Record::new(live, Token::generate(), 41);
/// assert_eq!(claim_answer(&req, others), ClaimAnswer::Answer(Claim::InProgress { fence: 41 }));
/// let released = Record::new(RecordState::Released, Token::generate(), 41);
/// assert_eq!(claim_answer(&req, released), ClaimAnswer::TakeOver { fence: 42 });
/// ```
pub fn claim_answer(req: &ClaimRequest, found: Record) -> ClaimAnswer {
    let fence = found.fence;
    let mismatch = matches!(
        (req.fingerprint, found.fingerprint),
        (Some(given), Some(stored)) if given != stored
    );
    let answer = match found.state {
        RecordState::InProgress { .. } if found.token == req.token => Claim::Acquired { fence },
        RecordState::Completed | RecordState::InProgress { .. } if mismatch => {
            Claim::Mismatch { fence }
        }
        RecordState::Completed => Claim::Completed {
            fence,
            result: found.result,
        },
        RecordState::InProgress { lease_left } if !lease_left.is_zero() => {
            Claim::InProgress { fence }
        }
        RecordState::InProgress { .. } | RecordState::Released => {
            return ClaimAnswer::TakeOver {
                fence: next_fence(Some(fence), 0),
            }
        }
    };
    ClaimAnswer::Answer(answer)
}
