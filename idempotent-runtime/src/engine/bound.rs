//! A call whose claim lives in a resource the caller owns (a SQL transaction): the same
//! decisions as [`Operation::run`](crate::Operation::run), made on the caller's connection
//! instead of through [`Store`](crate::Store).

use std::time::Duration;

use tracing::Instrument;

use crate::engine::conclude::{Outcome, Refusal, Report};
use crate::engine::decide::{decide, Next, Waiting};
use crate::engine::handler::{BusinessCheck, NoCheck};
use crate::engine::idempotency::Idempotency;
use crate::engine::results::Results;
use crate::error::{Error, StoreError};
use crate::key::Key;
use crate::policy::OnInProgress;
use crate::store::{Claim, ClaimRequest, Completion, Fingerprint};

/// The three calls of a claim's life, made on a resource the engine does not own. A rollback
/// of that resource undoes all of them, so nothing here is given back on drop.
pub(crate) trait Bound {
    /// What the body runs its own statements on.
    type Conn: ?Sized;

    /// The name of the store the calls go to ([`Store::name`](crate::Store::name)).
    fn store_name(&self) -> &'static str;

    /// The resource's connection, for the body.
    fn conn(&mut self) -> &mut Self::Conn;

    /// [`Store::claim`](crate::Store::claim) in the resource.
    async fn claim(&mut self, req: &ClaimRequest) -> Result<Claim, StoreError>;

    /// [`Store::complete`](crate::Store::complete) in the resource.
    async fn complete(
        &mut self,
        req: &ClaimRequest,
        completion: &Completion,
    ) -> Result<bool, StoreError>;

    /// [`Store::release`](crate::Store::release) in the resource.
    async fn release(&mut self, req: &ClaimRequest) -> Result<bool, StoreError>;
}

/// One call in a bound resource: what [`run_bound`] claims and how it stores the value.
pub(crate) struct BoundCall<T, E: From<Error>, D = NoCheck> {
    pub(crate) key: Key,
    pub(crate) ttl: Duration,
    pub(crate) fingerprint: Option<Fingerprint>,
    /// Replay of the `Ok` value (the default: none, duplicates get `Error::Duplicate`).
    pub(crate) results: Results<Result<T, E>>,
    /// The business check, asked as [`Operation::done`](crate::Operation::done)'s is.
    pub(crate) done: D,
}

impl<T, E: From<Error>> BoundCall<T, E> {
    pub(crate) fn new(key: Key, ttl: Duration) -> Self {
        BoundCall {
            key,
            ttl,
            fingerprint: None,
            results: Results::default(),
            done: NoCheck,
        }
    }
}

/// Runs `body` at most once for `call.key` inside `bound`: claim, [`decide`], body, then
/// complete (or release when the body failed). A live owner outside the resource is
/// rejected: waiting would hold the caller's transaction open. The outcome is concluded as
/// every door's is ([`Report`]).
pub(crate) async fn run_bound<B, T, E, D>(
    bound: &mut B,
    call: BoundCall<T, E, D>,
    body: impl AsyncFnOnce(&mut B::Conn) -> Result<T, E>,
) -> Result<T, E>
where
    B: Bound,
    E: From<Error> + From<D::Error>,
    D: BusinessCheck,
{
    let span = Report::span(&call.key);
    run_in(bound, call, body, span.clone())
        .instrument(span)
        .await
}

async fn run_in<B, T, E, D>(
    bound: &mut B,
    call: BoundCall<T, E, D>,
    body: impl AsyncFnOnce(&mut B::Conn) -> Result<T, E>,
    span: tracing::Span,
) -> Result<T, E>
where
    B: Bound,
    E: From<Error> + From<D::Error>,
    D: BusinessCheck,
{
    let BoundCall {
        key,
        ttl,
        fingerprint,
        results,
        mut done,
    } = call;
    let req = Idempotency::new(ttl).lifetime()?.request(key, fingerprint);
    let report = Report::new(span, bound.store_name());
    let claim = match bound.claim(&req).await {
        Ok(claim) => claim,
        Err(err) => return report.refuse(req.key, Refusal::Store(err), &results),
    };
    let policy = OnInProgress::Reject;
    let next = decide(claim, policy, &mut Waiting::new(policy));
    let next_fence = next.fence();
    report.fence(next_fence);
    let refusal = match next {
        Next::Run { .. } => None,
        Next::Completed { result, .. } => Some(Refusal::Completed(result)),
        Next::Mismatch { .. } => Some(Refusal::Mismatch),
        Next::Busy { fence, .. } => Some(Refusal::InProgress { fence }),
    };
    // The business check, where a single call asks it: before the body of an acquired
    // claim, and before refusing a live owner. Its "done" leaves the claim to the
    // transaction, whose rollback removes it.
    if matches!(refusal, None | Some(Refusal::InProgress { .. })) {
        if let Some(check) = done.start() {
            let applied = match check.await {
                Ok(applied) => applied,
                Err(err) => {
                    report.conclude(&req.key, Outcome::Failed);
                    return Err(err.into());
                }
            };
            if applied {
                return report.refuse(req.key, Refusal::DoneBefore, &results);
            }
        }
    }
    if let Some(refusal) = refusal {
        return report.refuse(req.key, refusal, &results);
    }
    let fence = next_fence;
    match body(bound.conn()).await {
        Ok(value) => {
            let completion = Completion::new(results.encode_ok(&value)?, ttl);
            match bound.complete(&req, &completion).await {
                Ok(true) => {
                    report.conclude(&req.key, Outcome::Executed);
                    Ok(value)
                }
                // Another owner took the key over: the transaction must not commit.
                Ok(false) => {
                    report.conclude(&req.key, Outcome::LostOwnership);
                    Err(Error::LostOwnership {
                        key: req.key,
                        fence,
                    }
                    .into())
                }
                // The effect is in the transaction, which cannot be committed without its
                // record: the call fails, and the caller rolls back.
                Err(err) => {
                    report.conclude(&req.key, Outcome::StoreError);
                    Err(Error::Store(err).into())
                }
            }
        }
        Err(err) => {
            report.conclude(&req.key, Outcome::Failed);
            // When the body's failure aborted the transaction this fails too, and the
            // rollback removes the claim.
            if let Err(release) = bound.release(&req).await {
                tracing::debug!(error = %release, "release in a failed transaction skipped");
            }
            Err(err)
        }
    }
}
