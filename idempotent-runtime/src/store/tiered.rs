//! Two stores in layers: a fast one in front (Redis) for the short window, a durable one
//! behind (SQL) as the record of truth.
//!
//! - A **duplicate** of a completed operation costs one round trip to the front.
//! - A **first delivery** claims the front, then the back (same token), and completes the back,
//!   then the front. The back's answer is authoritative: its fence is the one returned, and a
//!   back that knows the operation (completed, or claimed by someone else) wins over a front
//!   that forgot it. A claim given back is released on the front, then on the back: once the
//!   back says released, the front does too, and the next delivery is acquired at once.
//! - **The front loses data** (restart, eviction, failover): the front says `Acquired`, the
//!   back says `Completed` or `InProgress`, and that is the answer (the front is repaired for
//!   a completed record). Nothing runs twice.
//! - **The front is down**: claims go to the back alone (logged); semantics are intact, only
//!   duplicates are slower.
//! - **The back is down**: the call fails closed, like any store error; a front claim taken
//!   for it is given back.
//! - **The back loses data** (a restore from an old backup): the front still filters its
//!   window; beyond it, the `done` fallback is what keeps effects exactly-once.
//!
//! Writes to the front after the back answered are best effort: a failure there is logged and
//! costs only speed (the next duplicate asks the back).
//!
//! **A front that does not answer** holds up each call until it does or fails: claims and
//! give-backs go to the front first. Give it a reply timeout well under half the lease (the
//! engine's bound on a store call), as `RedisStoreBuilder::response_timeout` does (1 s by
//! default): a timeout is a front that is down. A give-back whose front write outlasts the
//! engine's bound never reaches the back, which then holds the claim until its lease ends.
//!
//! **Fences.** An acquired claim carries the back's fence: that is the one to check at the
//! effect. Duplicates answered by the front (in progress, completed, mismatch) carry the
//! front's own fence, which each layer takes from its own clock: read it as information, not
//! as the owner's fence.

use std::collections::HashSet;
use std::time::Duration;

use crate::error::StoreError;
use crate::key::Key;
use crate::store::{
    AcquiredClaim, BoxFuture, Claim, ClaimRequest, Completion, End, Ending, Expect,
    IntoOperatorStore, OperatorStore, Record, ScanCursor, ScanPage, SharedOperatorStore, Store,
    Token,
};

/// A [`Store`] of two layers: a fast `front` and a durable, authoritative `back`.
///
/// Both layers are [`OperatorStore`]s, so that an operator's calls reach both (every store of
/// this crate is one).
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::{store::TieredStore, MemoryStore};
///
/// // In production: a RedisStore in front of a PostgresStore.
/// let store = TieredStore::new(Arc::new(MemoryStore::new()), Arc::new(MemoryStore::new()));
/// # let _ = store;
/// ```
pub struct TieredStore {
    front: SharedOperatorStore,
    back: SharedOperatorStore,
}

impl std::fmt::Debug for TieredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieredStore").finish_non_exhaustive()
    }
}

impl TieredStore {
    /// Layers `front` over `back`.
    pub fn new(front: impl IntoOperatorStore, back: impl IntoOperatorStore) -> TieredStore {
        TieredStore {
            front: front.into_operator_store(),
            back: back.into_operator_store(),
        }
    }

    async fn claim_back(&self, req: &ClaimRequest, front_owned: bool) -> Result<Claim, StoreError> {
        let back = self.back.claim(req).await;
        match &back {
            Ok(Claim::Acquired { .. }) => {}
            Ok(Claim::Completed { result, .. }) if front_owned => {
                // The front forgot a completed operation: teach it again.
                let completion = Completion::new(result.clone(), req.ttl);
                self.best_effort(
                    "repair",
                    self.front.complete(&req.key, &req.token, &completion),
                )
                .await;
            }
            // Not ours after all, or the back failed (its outcome is resolved by reading the
            // back by token, which does not need the front's claim either).
            _ if front_owned => {
                self.best_effort("release", self.front.release(&req.key, &req.token))
                    .await;
            }
            _ => {}
        }
        back
    }

    /// Ends `items` on the front, best effort (nothing is sent for none).
    async fn front_batch(&self, items: &[Ending]) {
        if items.is_empty() {
            return;
        }
        for answer in self.front.complete_many(items).await {
            if let Err(err) = answer {
                tracing::warn!(error = %err, "front store ending failed; the back store stays authoritative");
            }
        }
    }

    async fn best_effort(&self, what: &str, op: BoxFuture<'_, Result<bool, StoreError>>) {
        if let Err(err) = op.await {
            tracing::warn!(error = %err, "front store {what} failed; the back store stays authoritative");
        }
    }
}

impl Store for TieredStore {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            match self.front.claim(req).await {
                Ok(Claim::Acquired { .. }) => self.claim_back(req, true).await,
                Ok(other) => Ok(other),
                Err(err) => {
                    tracing::warn!(error = %err, "front store unavailable; claiming on the back store alone");
                    self.claim_back(req, false).await
                }
            }
        })
    }

    /// The front's batch, then the back's for the items the front acquired or could not
    /// answer, then the front's repairs and releases in one more batch: each item answered as
    /// [`claim`](Store::claim) answers it, in four round trips for the whole batch.
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Vec<Result<Claim, StoreError>>> {
        Box::pin(async move {
            let mut answers = self.front.claim_many(reqs).await;
            let to_back: Vec<usize> = answers
                .iter()
                .enumerate()
                .filter(|(_, answer)| matches!(answer, Ok(Claim::Acquired { .. }) | Err(_)))
                .map(|(i, _)| i)
                .collect();
            if to_back.is_empty() {
                return answers;
            }
            if answers.iter().any(Result::is_err) {
                tracing::warn!("front store unavailable for part of a batch; claiming those keys on the back store alone");
            }
            let back_reqs: Vec<ClaimRequest> = to_back.iter().map(|&i| reqs[i].clone()).collect();
            let back = self.back.claim_many(&back_reqs).await;
            let mut fixes = Vec::new();
            for ((&i, req), answer) in to_back.iter().zip(&back_reqs).zip(back) {
                let front_owned = matches!(answers[i], Ok(Claim::Acquired { .. }));
                match &answer {
                    Ok(Claim::Acquired { .. }) => {}
                    // The front forgot a completed operation: teach it again.
                    Ok(Claim::Completed { result, .. }) if front_owned => {
                        let completion = Completion::new(result.clone(), req.ttl);
                        fixes.push(Ending::complete(req.key.clone(), req.token, completion));
                    }
                    _ if front_owned => fixes.push(Ending::release(req.key.clone(), req.token)),
                    _ => {}
                }
                answers[i] = answer;
            }
            if !fixes.is_empty() {
                for fixed in self.front.complete_many(&fixes).await {
                    if let Err(err) = fixed {
                        tracing::warn!(error = %err, "front store repair failed; the back store stays authoritative");
                    }
                }
            }
            answers
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = self.back.complete(key, token, completion).await?;
            if done {
                self.best_effort("complete", self.front.complete(key, token, completion))
                    .await;
            }
            Ok(done)
        })
    }

    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        // The front first: once the back, the record of truth, says released, the front no
        // longer holds the claim either (unless its release failed), so the next delivery is
        // acquired instead of being told by the front that the call is still in flight.
        Box::pin(async move {
            self.best_effort("release", self.front.release(key, token))
                .await;
            self.back.release(key, token).await
        })
    }

    fn release_acquired<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        claim: &'a AcquiredClaim,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        // As `release`; the claim's fence is the back's, so only the back is told it.
        Box::pin(async move {
            self.best_effort("release", self.front.release(key, token))
                .await;
            self.back.release_acquired(key, token, claim).await
        })
    }

    /// As the single calls do, a layer at a time: the front's releases, best effort; the
    /// back's batch (the answers); the front's completions, best effort, for the items the
    /// back completed. A key the batch also completes keeps its endings' order on the
    /// front: its release goes there after the back's answer, as its completion does.
    fn complete_many<'a>(
        &'a self,
        items: &'a [Ending],
    ) -> BoxFuture<'a, Vec<Result<bool, StoreError>>> {
        Box::pin(async move {
            let completing: HashSet<&[u8]> = items
                .iter()
                .filter(|item| matches!(item.action, End::Complete(_)))
                .map(|item| item.key.as_bytes())
                .collect();
            let release_first = |item: &Ending| !completing.contains(item.key.as_bytes());
            let releases: Vec<Ending> = items
                .iter()
                .filter(|item| matches!(item.action, End::Release) && release_first(item))
                .cloned()
                .collect();
            self.front_batch(&releases).await;
            let ended = self.back.complete_many(items).await;
            let after: Vec<Ending> = items
                .iter()
                .zip(&ended)
                .filter(|(item, answer)| match item.action {
                    End::Complete(_) => matches!(answer, Ok(true)),
                    _ => !release_first(item) && answer.is_ok(),
                })
                .map(|(item, _)| item.clone())
                .collect();
            self.front_batch(&after).await;
            ended
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let renewed = self.back.renew(key, token, lease).await?;
            if renewed {
                self.best_effort("renew", self.front.renew(key, token, lease))
                    .await;
            }
            Ok(renewed)
        })
    }

    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.back.read(key)
    }

    /// The back store's answer, as a read's.
    fn is_completed<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.back.is_completed(key)
    }

    /// The smaller of the two layers' limits: a result is kept by both or by neither.
    fn max_result_size(&self) -> usize {
        self.front
            .max_result_size()
            .min(self.back.max_result_size())
    }

    fn name(&self) -> &'static str {
        "tiered"
    }
}

impl OperatorStore for TieredStore {
    fn reopen<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let reopened = self.back.reopen(key, token).await?;
            self.best_effort("reopen", self.front.reopen(key, token))
                .await;
            Ok(reopened)
        })
    }

    /// The back's records: the front holds a window of them.
    fn scan<'a>(
        &'a self,
        prefix: &'a str,
        cursor: &'a ScanCursor,
        limit: usize,
    ) -> BoxFuture<'a, Result<ScanPage, StoreError>> {
        self.back.scan(prefix, cursor, limit)
    }

    /// Deletes from the back (the answer), then from the front, best effort. The front's
    /// record of the key has the back's token whenever both layers took the claim.
    fn delete<'a>(
        &'a self,
        key: &'a Key,
        expect: Expect<'a>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let deleted = self.back.delete(key, expect).await?;
            self.best_effort("delete", self.front.delete(key, expect))
                .await;
            Ok(deleted)
        })
    }
}
