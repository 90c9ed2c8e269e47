//! An owned claim, from its acquisition to its completion or release.
//!
//! The rule this module keeps: **before the body finished, a claim is given back; once the body
//! returned, its outcome is completed, never given back.** Every path that can end an owned
//! claim goes through [`Owner`]: a dropped future, a panic, a failed or unknown completion.
//! (The claim round trip before it, and giving a claim back, are in `pending.rs`.)
//!
//! - [`Owner`] holds an acquired claim. Dropped while the body runs (cancellation, panic), it
//!   releases, token-checked. After the body returned it is *completing*: dropped then, or when
//!   the completion fails, it hands the completion to a background task that retries with
//!   backoff while renewing the lease, until the store records it or tells that someone else
//!   owns the key.
//!
//! Every store call here is bounded ([`call_bound`]: half the lease): a call that never
//! answers is a lost reply, resolved by reading the record back, and a completion in flight
//! runs under the watchdog, so the lease is renewed (or its loss noticed) while it waits. A
//! batch item's first completion goes with its batch's, which the batch bounds and watches
//! for all of them (`coalesce.rs`).

use std::sync::Arc;
use std::time::Duration;

use crate::codec;
use crate::engine::claimed::Claimed;
use crate::engine::coalesce::Coalescing;
use crate::engine::deadline::{bounded, call_bound};
use crate::engine::loss::{self, CompletionLost, LossReason};
use crate::engine::pending::{give_back, run_detached};
use crate::engine::watch::{watch, Watched};
use crate::error::{StoreError, StoreErrorKind};
use crate::policy::OnLostLease;
use crate::store::{AcquiredClaim, Completion, RecordState};

/// What became of a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recording {
    /// The store recorded the outcome.
    Recorded,
    /// Someone else owns the key now: the completion was refused.
    Lost,
    /// Not recorded yet: a background task keeps trying. The caller is told the operation
    /// succeeded; should the background task fail for good, the loss is reported
    /// ([`loss::report`]).
    Deferred,
    /// Not recorded, and the lease ran out (on the caller's clock) while the completion went
    /// unanswered: another owner may take the key. A background task keeps trying; the caller
    /// is told it lost ownership.
    Unconfirmed,
}

enum Phase {
    /// The body has not finished: dropping gives the claim back.
    Running,
    /// The body returned: dropping completes in the background.
    Completing(Completion),
    /// Nothing left to do.
    Done,
}

/// The owner of an acquired claim (see the module docs).
pub(crate) struct Owner {
    claim: Arc<Claimed>,
    phase: Phase,
    /// The caller was told the operation succeeded while its completion was still pending.
    told_done: bool,
    /// The batch the claim is an item of: its first completion goes with the batch's others.
    batch: Option<Arc<Coalescing>>,
}

impl Owner {
    pub(crate) fn new(claim: Arc<Claimed>) -> Owner {
        Owner {
            claim,
            phase: Phase::Running,
            told_done: false,
            batch: None,
        }
    }

    /// The owner of an item of `batch`: its first completion is sent with the others'.
    pub(crate) fn in_batch(claim: Arc<Claimed>, batch: Arc<Coalescing>) -> Owner {
        Owner {
            claim,
            phase: Phase::Running,
            told_done: false,
            batch: Some(batch),
        }
    }

    pub(crate) fn claim(&self) -> &Arc<Claimed> {
        &self.claim
    }

    /// Gives the claim back (the body failed, or a business check failed before it ran).
    pub(crate) async fn release(mut self) {
        match self.release_call().await {
            Ok(true) => self.phase = Phase::Done,
            Ok(false) => {
                self.phase = Phase::Done;
                tracing::debug!("release skipped: the claim is no longer ours");
            }
            // Dropping `self` while running gives the claim back in the background.
            Err(err) => tracing::warn!(error = %err, "release failed; retrying in the background"),
        }
    }

    /// Gives the claim back and says whether it was still ours. When the store does not
    /// answer, the claim is given back in the background (as on drop) and the error returned.
    pub(crate) async fn give_back_now(mut self) -> Result<bool, StoreError> {
        let released = self.release_call().await;
        if released.is_ok() {
            self.phase = Phase::Done;
        }
        released
    }

    /// One bounded release round trip.
    async fn release_call(&self) -> Result<bool, StoreError> {
        let claim = &self.claim;
        // Naming the claim lets the store recognise its record with less work.
        let acquired = AcquiredClaim::new(claim.fence, claim.fingerprint).with_lease(claim.lease);
        let release = claim
            .store
            .release_acquired(&claim.key, &claim.token, &acquired);
        bounded(call_bound(claim.lease), "release", release).await
    }

    /// When the record expires on its own, as far as the caller knows.
    fn expires_at(&self) -> tokio::time::Instant {
        self.claim
            .lease_until()
            .max(self.claim.sent_at + self.claim.ttl)
    }

    /// Records the body's outcome. From here on the claim is never given back: if the store
    /// does not record it now, a background task keeps trying (also when this future is
    /// dropped).
    pub(crate) async fn record(mut self, result: Option<Vec<u8>>) -> Recording {
        let result = fit(result, self.claim.store.max_result_size());
        self.phase = Phase::Completing(
            Completion::new(result, self.claim.ttl).for_claim(
                AcquiredClaim::new(self.claim.fence, self.claim.fingerprint)
                    .with_lease(self.claim.lease),
            ),
        );
        let Phase::Completing(completion) = &self.phase else {
            return Recording::Deferred;
        };
        let recording = match complete_watched(&self.claim, completion, self.batch.as_deref()).await
        {
            Ok(true) => Recording::Recorded,
            Ok(false) => {
                self.claim.set_lost();
                Recording::Lost
            }
            Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                tracing::error!(error = %err, "effect applied but its record is unreadable; an operator must look at the key");
                Recording::Recorded
            }
            Err(err) if self.claim.is_lost() => {
                tracing::error!(error = %err, "effect applied, its completion unanswered and the lease run out; retrying in the background");
                // Dropping `self` while completing hands the completion to the background.
                return Recording::Unconfirmed;
            }
            Err(err) => {
                tracing::error!(error = %err, "effect applied but its completion could not be recorded yet; retrying in the background");
                self.told_done = true;
                return Recording::Deferred;
            }
        };
        self.phase = Phase::Done;
        recording
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Done => {}
            Phase::Running => {
                let claim = &self.claim;
                tracing::debug!(key = %claim.key, "claim given back");
                run_detached(give_back(
                    claim.store.clone(),
                    claim.key.clone(),
                    claim.token,
                    claim.lease,
                    self.expires_at(),
                ));
            }
            Phase::Completing(completion) => {
                run_detached(complete_in_background(
                    self.claim.clone(),
                    completion,
                    self.told_done,
                ));
            }
        }
    }
}

/// A result the store cannot keep is dropped (an `Ok` value: duplicates get `Duplicate`) or
/// turned into a hold (a stored error: duplicates get `Held`), never a reason to re-run.
fn fit(result: Option<Vec<u8>>, max: usize) -> Option<Vec<u8>> {
    match result {
        Some(bytes) if bytes.len() > max => {
            tracing::warn!(
                size = bytes.len(),
                max,
                "result too large for the store; completing without it"
            );
            shrink(&bytes)
        }
        other => other,
    }
}

fn shrink(bytes: &[u8]) -> Option<Vec<u8>> {
    (bytes.first() == Some(&codec::ERR)).then(|| vec![codec::HELD])
}

/// One completion attempt: a lost reply is resolved by reading the record back by token, and
/// a result the store refuses for good is dropped and the record completed without it.
/// `first` is the answer to the completion when it was already sent (with its batch).
async fn complete(
    claim: &Claimed,
    completion: &Completion,
    first: Option<Result<bool, StoreError>>,
) -> Result<bool, StoreError> {
    match complete_resolving(claim, completion, first).await {
        Err(err) if err.kind() == StoreErrorKind::Rejected && completion.result.is_some() => {
            tracing::warn!(error = %err, "store refused the result; completing without it");
            let smaller = Completion {
                result: completion.result.as_deref().and_then(shrink),
                ttl: completion.ttl,
                claim: completion.claim,
            };
            Box::pin(complete_resolving(claim, &smaller, None)).await
        }
        other => other,
    }
}

async fn complete_resolving(
    claim: &Claimed,
    completion: &Completion,
    first: Option<Result<bool, StoreError>>,
) -> Result<bool, StoreError> {
    let store = &claim.store;
    let bound = call_bound(claim.lease);
    let send = || {
        let complete = store.complete(&claim.key, &claim.token, completion);
        bounded(bound, "completion", complete)
    };
    let answer = match first {
        Some(answer) => answer,
        None => send().await,
    };
    match answer {
        Err(err) if err.is_outcome_unknown() => {
            tracing::debug!(error = %err, "completion reply lost; reading the record back");
            // Boxed, as the retry with a smaller result is in `complete`: both are rare, and
            // every completion's future would otherwise carry them.
            Box::pin(async move {
                match bounded(bound, "read", store.read(&claim.key)).await? {
                    Some(record) if record.token == claim.token => match record.state {
                        RecordState::Completed => Ok(true),
                        RecordState::InProgress { .. } => send().await,
                        _ => Ok(false),
                    },
                    _ => Ok(false),
                }
            })
            .await
        }
        other => other,
    }
}

/// One completion attempt ([`complete`]) under the watchdog: the lease is renewed while the
/// completion is in flight, and marked lost if it runs out first.
///
/// An item of a `batch` sends its first completion with the batch's others, which the batch
/// bounds and watches for all of them ([`Coalescing::complete_first`]); only what follows an
/// error there (reading the record back, sending again) runs under this claim's own watchdog.
async fn complete_watched(
    claim: &Arc<Claimed>,
    completion: &Completion,
    batch: Option<&Coalescing>,
) -> Result<bool, StoreError> {
    let first = match batch {
        Some(batch) => batch.complete_first(claim, completion).await,
        None => None,
    };
    if let Some(Ok(answer)) = first {
        return Ok(answer);
    }
    // Boxed: every completion outside a batch runs here, and a batch item's only after its
    // first completion failed; held in place, it would make every batch item's future as
    // large as itself.
    let watched = Box::pin(async move {
        let attempt = std::pin::pin!(complete(claim, completion, first));
        watch(attempt, claim, OnLostLease::Continue).await
    });
    match watched.await {
        Watched::Done(out) => out,
        // Never with `Continue`; an unknown outcome is what it would be.
        Watched::Cancelled => Err(StoreError::new(
            StoreErrorKind::OutcomeUnknown,
            "completion abandoned by the watchdog",
        )),
    }
}

/// The longest pause between two background completion attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Retries a completion until the store records it or says the key is someone else's, with
/// bounded backoff, renewing the lease between attempts so no one takes the key over while the
/// store is failing. Gives up when the record's ttl has passed since the claim (the record is
/// gone by then): the next owner meets an in-progress record after its lease and the business
/// check or the fence decides. When the caller was already told the operation succeeded
/// (`told_done`), a refusal or giving up is reported as a lost completion.
async fn complete_in_background(claim: Arc<Claimed>, completion: Completion, told_done: bool) {
    let lost = |reason| {
        if told_done {
            let lost = CompletionLost {
                key: claim.key.clone(),
                fence: claim.fence,
                reason,
            };
            loss::report(lost, claim.store.name());
        }
    };
    let give_up_at = claim.sent_at + claim.record_lifetime;
    let mut backoff = Duration::from_millis(10).min(claim.lease / 4);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match complete_watched(&claim, &completion, None).await {
            Ok(true) => {
                tracing::info!(key = %claim.key, attempts, "completion recorded after retrying");
                return;
            }
            Ok(false) => {
                claim.set_lost();
                tracing::error!(key = %claim.key, fence = claim.fence, "lost ownership before the completion could be recorded");
                lost(LossReason::Refused);
                return;
            }
            Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                tracing::error!(key = %claim.key, error = %err, "effect applied but its record is unreadable; an operator must look at the key");
                return;
            }
            Err(err) => {
                crate::metrics::store_error(claim.store.name(), err.kind());
                if tokio::time::Instant::now() >= give_up_at {
                    tracing::error!(key = %claim.key, error = %err, attempts, "completion could not be recorded before the record's ttl; giving up");
                    lost(LossReason::GaveUp);
                    return;
                }
                tracing::warn!(key = %claim.key, error = %err, attempts, "completion failed; retrying");
            }
        }
        crate::metrics::completion_retry(&claim.key, claim.store.name());
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF).min(claim.lease / 3);
        let renew = claim.store.renew(&claim.key, &claim.token, claim.lease);
        if let Err(err) = bounded(call_bound(claim.lease), "renewal", renew).await {
            tracing::debug!(key = %claim.key, error = %err, "lease renewal failed while retrying the completion");
        }
    }
}
