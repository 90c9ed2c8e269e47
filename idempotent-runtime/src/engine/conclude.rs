//! The one place a call's outcome is concluded. Every door (the attribute and [`Operation`],
//! a batch item, a call in the caller's transaction, a lock, and the HTTP layer built on
//! them) asks [`decide`](super::decide) what a claim's answer means, and ends here: the
//! outcome is recorded on the call's span (`outcome`), counted in `idempotency.operations`
//! under the same name, and, when the body does not run, turned into the caller's answer by
//! [`Report::refuse`].
//!
//! [`Operation`]: crate::Operation

use tracing::Span;

use crate::codec;
use crate::engine::handler::HandlerResult;
use crate::engine::results::Results;
use crate::error::{Error, StoreError};
use crate::key::Key;
use crate::metrics;

/// Every outcome of a call, by the one name its span and its metric carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The body ran and its outcome is recorded (or being recorded in the background).
    Executed,
    /// The body returned an error: the claim was given back, or the error stored.
    Failed,
    /// A completed record, nothing to replay: [`Error::Duplicate`].
    Duplicate,
    /// A completed record whose stored result was answered.
    Replayed,
    /// A record held after an unknown outcome: [`Error::Held`].
    Held,
    /// Another owner's live claim: [`Error::InProgress`].
    InProgress,
    /// Another owner's live claim, skipped: [`Error::Skipped`].
    Skipped,
    /// The key was used with another payload: [`Error::PayloadMismatch`].
    Mismatch,
    /// The lease was lost before the outcome was recorded: [`Error::LostOwnership`].
    LostOwnership,
    /// The store failed and nothing ran: [`Error::Store`].
    StoreError,
    /// The store failed and the body ran unguarded ([`OnStoreError::FailOpen`]).
    ///
    /// [`OnStoreError::FailOpen`]: crate::OnStoreError::FailOpen
    FailOpen,
    /// The business check said the effect is applied: [`Error::Duplicate`], nothing ran.
    DoneFallback,
    /// A lock was taken.
    Acquired,
}

impl Outcome {
    /// The name on the span's `outcome` field and the metric's `outcome` label.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Failed => "failed",
            Outcome::Duplicate => "duplicate",
            Outcome::Replayed => "replayed",
            Outcome::Held => "held",
            Outcome::InProgress => "in_progress",
            Outcome::Skipped => "skipped",
            Outcome::Mismatch => "mismatch",
            Outcome::LostOwnership => "lost_ownership",
            Outcome::StoreError => "store_error",
            Outcome::FailOpen => "fail_open",
            Outcome::DoneFallback => "done_fallback",
            Outcome::Acquired => "acquired",
        }
    }
}

/// A claim's answer (or the store's failure) that ends a call without running its body.
#[derive(Debug)]
pub(crate) enum Refusal {
    /// The record is completed, with this stored result.
    Completed(Option<Vec<u8>>),
    /// The key was used with another payload.
    Mismatch,
    /// Another owner holds the key, and the business check says the effect is applied; or
    /// the key was ours and the check said so before the body ran.
    DoneBefore,
    /// Another owner holds the key: skip ([`OnInProgress::Skip`](crate::OnInProgress::Skip)).
    Skipped,
    /// Another owner holds the key under `fence`.
    InProgress { fence: u64 },
    /// The store failed; nothing ran.
    Store(StoreError),
}

/// Where one call tells its outcome: its span, and the series of its store.
#[derive(Debug, Clone)]
pub(crate) struct Report {
    span: Span,
    store: &'static str,
}

impl Report {
    /// The call whose span is `span` (made by [`Report::span`]: the call records into its
    /// own span, never into a caller's), on the store called `store`.
    pub(crate) fn new(span: Span, store: &'static str) -> Report {
        Report { span, store }
    }

    /// The span every door's call runs in, with the fields this module records.
    pub(crate) fn span(key: &Key) -> Span {
        quiet(tracing::debug_span!(
            "idempotency",
            key = %key,
            fence = tracing::field::Empty,
            outcome = tracing::field::Empty,
        ))
    }

    /// The name of the store the call uses.
    pub(crate) fn store(&self) -> &'static str {
        self.store
    }

    /// The fence the claim answered with.
    pub(crate) fn fence(&self, fence: u64) {
        self.span.record("fence", fence);
    }

    /// Records and counts `outcome` for `key`.
    pub(crate) fn conclude(&self, key: &Key, outcome: Outcome) {
        self.span.record("outcome", outcome.name());
        metrics::outcome(key, self.store, outcome.name());
    }

    /// Concludes a call whose body does not run, and returns its answer.
    pub(crate) fn refuse<R: HandlerResult>(
        &self,
        key: Key,
        refusal: Refusal,
        results: &Results<R>,
    ) -> Result<R::Ok, R::Err> {
        match refusal {
            Refusal::Completed(result) => {
                self.conclude(&key, completed_outcome(results, result.as_deref()));
                results.answer_completed(key, result)
            }
            Refusal::Mismatch => {
                self.conclude(&key, Outcome::Mismatch);
                Err(Error::PayloadMismatch { key }.into())
            }
            Refusal::DoneBefore => {
                self.conclude(&key, Outcome::DoneFallback);
                Err(Error::Duplicate { key }.into())
            }
            Refusal::Skipped => {
                self.conclude(&key, Outcome::Skipped);
                Err(Error::Skipped { key }.into())
            }
            Refusal::InProgress { fence } => {
                self.conclude(&key, Outcome::InProgress);
                Err(Error::InProgress { key, fence }.into())
            }
            Refusal::Store(err) => {
                tracing::warn!(error = %err, "store failed; not running (fail closed)");
                self.conclude(&key, Outcome::StoreError);
                Err(Error::Store(err).into())
            }
        }
    }
}

/// The outcome of a claim that met a completed record holding `result`: what
/// [`Results::answer_completed`] answers.
fn completed_outcome<R: HandlerResult>(results: &Results<R>, result: Option<&[u8]>) -> Outcome {
    match result.and_then(<[u8]>::split_first) {
        Some((&codec::HELD, _)) => Outcome::Held,
        Some((&tag, _)) if results.replays(tag) => Outcome::Replayed,
        _ => Outcome::Duplicate,
    }
}

/// `span`, or no span at all when nothing would ever see it: no subscriber records it, and no
/// `log` logger would print it (tracing hands a span to `log` while no subscriber is set).
/// Entering a span no one sees still costs every poll of the call's future, and recording
/// its fields costs every call.
pub(crate) fn quiet(span: Span) -> Span {
    let logged = !tracing::dispatcher::has_been_set() && log::max_level() >= log::Level::Debug;
    if span.is_disabled() && !logged {
        Span::none()
    } else {
        span
    }
}
