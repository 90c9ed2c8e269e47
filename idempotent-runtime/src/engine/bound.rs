//! A call whose claim lives in a resource the caller owns (a SQL transaction): the same
//! decisions as [`Operation::run`](crate::Operation::run), made on the caller's connection
//! instead of through [`Store`](crate::Store).

use std::time::Duration;

use crate::engine::decide::{decide, Next, Waiting};
use crate::engine::idempotency::Idempotency;
use crate::engine::operation::{completed, Outcomes};
use crate::error::{Error, StoreError};
use crate::key::Key;
use crate::policy::InProgress;
use crate::store::{Claim, ClaimRequest, Completion, Fingerprint, Token};

/// The three calls of a claim's life, made on a resource the engine does not own. A rollback
/// of that resource undoes all of them, so nothing here is given back on drop.
pub(crate) trait Bound {
    /// What the body runs its own statements on.
    type Conn: ?Sized;

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
pub(crate) struct BoundCall<T, E: From<Error>> {
    pub(crate) key: Key,
    pub(crate) ttl: Duration,
    pub(crate) fingerprint: Option<Fingerprint>,
    /// Replay of the `Ok` value (the default: none, duplicates get `Error::Duplicate`).
    pub(crate) outcomes: Outcomes<Result<T, E>>,
}

impl<T, E: From<Error>> BoundCall<T, E> {
    pub(crate) fn new(key: Key, ttl: Duration) -> Self {
        BoundCall {
            key,
            ttl,
            fingerprint: None,
            outcomes: Outcomes::default(),
        }
    }
}

/// Runs `body` at most once for `call.key` inside `bound`: claim, [`decide`], body, then
/// complete (or release when the body failed). A live owner outside the resource is
/// rejected: waiting would hold the caller's transaction open.
pub(crate) async fn run_bound<B, T, E>(
    bound: &mut B,
    call: BoundCall<T, E>,
    body: impl AsyncFnOnce(&mut B::Conn) -> Result<T, E>,
) -> Result<T, E>
where
    B: Bound,
    E: From<Error>,
{
    let BoundCall {
        key,
        ttl,
        fingerprint,
        outcomes,
    } = call;
    let settings = Idempotency::new(ttl);
    settings.check()?;
    let mut req = ClaimRequest::new(key, Token::generate(), settings.lease_duration(), ttl);
    req.fingerprint = fingerprint;
    let claim = bound.claim(&req).await.map_err(Error::Store)?;
    let policy = InProgress::Reject;
    let fence = match decide(claim, policy, &mut Waiting::new(policy)) {
        Next::Run { fence } => fence,
        Next::Completed { result, .. } => {
            return completed::<Result<T, E>>(req.key, result, &outcomes)
        }
        Next::Mismatch { .. } => return Err(Error::PayloadMismatch { key: req.key }.into()),
        Next::Busy { fence, .. } => {
            return Err(Error::InProgress {
                key: req.key,
                fence,
            }
            .into())
        }
    };
    match body(bound.conn()).await {
        Ok(value) => {
            let completion = Completion::new(outcomes.encode_ok(&value)?, ttl);
            if bound
                .complete(&req, &completion)
                .await
                .map_err(Error::Store)?
            {
                Ok(value)
            } else {
                Err(Error::LostOwnership {
                    key: req.key,
                    fence,
                }
                .into())
            }
        }
        Err(err) => {
            // When the body's failure aborted the transaction this fails too, and the
            // rollback removes the claim.
            if let Err(release) = bound.release(&req).await {
                tracing::debug!(error = %release, "release in a failed transaction skipped");
            }
            Err(err)
        }
    }
}
