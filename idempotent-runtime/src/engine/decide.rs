//! The one place that decides what a call does with a claim's outcome. The single call, the
//! batch and every later path (HTTP, a transaction) ask it, so they cannot drift apart.

use std::time::Duration;

use tokio::time::Instant;

use crate::policy::OnInProgress;
use crate::store::{Claim, MAX_DURATION};

/// What to do next, after a claim answered.
#[derive(Debug)]
pub(crate) enum Next {
    /// The key is ours: run the body under `fence`.
    Run { fence: u64 },
    /// The operation was completed before: answer from its stored result.
    Completed { fence: u64, result: Option<Vec<u8>> },
    /// The key was used with another payload.
    Mismatch { fence: u64 },
    /// Another owner holds a live claim. Ask the business check first (if any), then `then`.
    Busy { fence: u64, then: Busy },
}

impl Next {
    /// The fence the claim answered with.
    pub(crate) fn fence(&self) -> u64 {
        match *self {
            Next::Run { fence }
            | Next::Completed { fence, .. }
            | Next::Mismatch { fence }
            | Next::Busy { fence, .. } => fence,
        }
    }
}

/// What a call does about a live owner, once the business check (if any) said "not done".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Busy {
    /// Return `Error::InProgress`.
    Reject,
    /// Return `Error::Skipped`.
    Skip,
    /// Sleep this long, then claim again.
    Retry(Duration),
}

/// How long to wait for a live owner, across a call's claim attempts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waiting {
    until: Option<Instant>,
    backoff: Duration,
}

const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_millis(250);

impl Waiting {
    /// The wait budget of a policy, starting now. A wait longer than [`MAX_DURATION`] (up to
    /// `Duration::MAX`) waits `MAX_DURATION`: far beyond any lease, and a deadline the clock
    /// can always represent.
    pub(crate) fn new(policy: OnInProgress) -> Waiting {
        let until = match policy {
            OnInProgress::Wait(max) => Some(Instant::now() + max.min(MAX_DURATION)),
            _ => None,
        };
        Waiting {
            until,
            backoff: FIRST_BACKOFF,
        }
    }
}

/// Maps a claim's outcome and the in-progress policy to the next step. Advances `waiting`'s
/// backoff when it says [`Busy::Retry`].
pub(crate) fn decide(claim: Claim, policy: OnInProgress, waiting: &mut Waiting) -> Next {
    match claim {
        Claim::Acquired { fence } => Next::Run { fence },
        Claim::Completed { fence, result } => Next::Completed { fence, result },
        Claim::Mismatch { fence } => Next::Mismatch { fence },
        Claim::InProgress { fence } => {
            let then = match (policy, waiting.until) {
                (OnInProgress::Skip, _) => Busy::Skip,
                (OnInProgress::Wait(_), Some(until)) => {
                    let now = Instant::now();
                    if now < until {
                        let pause = waiting.backoff.min(until - now);
                        waiting.backoff = (waiting.backoff * 2).min(MAX_BACKOFF);
                        Busy::Retry(pause)
                    } else {
                        Busy::Reject
                    }
                }
                _ => Busy::Reject,
            };
            Next::Busy { fence, then }
        }
    }
}
