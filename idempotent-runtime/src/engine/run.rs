//! Running the body: under an acquired claim ([`own`]: the business check, the body under the
//! watchdog, the outcome recorded or the claim given back), or unguarded when the store failed
//! and the policy says fail open ([`run_unguarded`]). Both conclude through [`Report`].

use std::future::Future;
use std::sync::Arc;

use crate::engine::claimed::Claimed;
use crate::engine::conclude::{Outcome, Report};
use crate::engine::current::Current;
use crate::engine::handler::{BusinessCheck, DoneKey, HandlerResult};
use crate::engine::owner::{Owner, Recording};
use crate::engine::results::{Kept, Results};
use crate::engine::watch::{watch, Watched};
use crate::error::{Error, StoreError, StoreErrorKind};
use crate::metrics;
use crate::policy::OnLostLease;
use crate::store::{ClaimRequest, SharedStore};

/// The request back out of its `Arc` once no claim round trip holds it (a clone otherwise).
pub(crate) fn unwrap_req(req: Arc<ClaimRequest>) -> ClaimRequest {
    Arc::try_unwrap(req).unwrap_or_else(|shared| (*shared).clone())
}

/// The error of a call whose body was already taken: never returned, since every caller
/// hands its body over once.
fn body_taken() -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        "internal: the handler of this call was already started",
    )
}

/// The store failed and the policy says fail open: runs `body` without a claim, with
/// [`current()`](crate::current) set as for a claimed run (fence 0, never lost).
pub(crate) async fn run_unguarded<R, B, F>(
    report: &Report,
    store: SharedStore,
    req: ClaimRequest,
    err: &StoreError,
    body: &mut Option<B>,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    B: FnOnce(Current) -> F,
    F: Future<Output = R>,
{
    tracing::warn!(error = %err, "store failed; running unguarded (fail open)");
    report.conclude(&req.key, Outcome::FailOpen);
    let Some(body) = body.take() else {
        return Err(Error::Store(body_taken()).into());
    };
    let sent_at = tokio::time::Instant::now();
    let current = Current::new(Arc::new(Claimed::new(store, req, 0, sent_at)));
    current.clone().scope(body(current)).await.into_result()
}

/// After an acquired claim: the business check, the body under the watchdog, then the
/// outcome recorded (or the claim given back when the body failed and the policy says so).
/// `body` is taken out where it starts, so the handler's future is stored once, in this
/// future, however many futures the body passed through before.
pub(crate) async fn own<R, D, B, F>(
    report: &Report,
    owner: Owner,
    (done_key, done): (Option<&mut DoneKey>, &mut D),
    results: &Results<R>,
    on_lost: OnLostLease,
    body: &mut Option<B>,
) -> Result<R::Ok, R::Err>
where
    R: HandlerResult,
    D: BusinessCheck,
    R::Err: From<D::Error>,
    B: FnOnce(Current) -> F,
    F: Future<Output = R>,
{
    let claim = owner.claim().clone();
    let key = &claim.key;
    let name = report.store();
    let _active = metrics::Active::new(key, name);
    let lost = || {
        report.conclude(key, Outcome::LostOwnership);
        Error::LostOwnership {
            key: key.clone(),
            fence: claim.fence,
        }
    };
    // The done key first, then the business check, each under the watchdog; a lost lease
    // ends neither (the body's own watch notices it).
    let mut applied: Result<bool, R::Err> = Ok(false);
    if let Some(done_key) = done_key {
        let check = done_key.applied(&claim.store, claim.lease);
        if let Watched::Done(read) =
            watch(std::pin::pin!(check), &claim, OnLostLease::Continue).await
        {
            applied = read.map_err(|err| Error::Store(err).into());
        }
    }
    if matches!(applied, Ok(false)) {
        if let Some(check) = done.start() {
            let checked = watch(std::pin::pin!(check), &claim, OnLostLease::Continue).await;
            if let Watched::Done(checked) = checked {
                applied = checked.map_err(Into::into);
            }
        }
    }
    match applied {
        Ok(true) => {
            report.conclude(key, Outcome::DoneFallback);
            // The effect is applied: record it, never give the claim back.
            owner.record(None).await;
            return Err(Error::Duplicate { key: key.clone() }.into());
        }
        Ok(false) => {}
        Err(err) => {
            // Nothing ran: the call failed as a handler error would, and the claim is given
            // back.
            report.conclude(key, Outcome::Failed);
            owner.release().await;
            return Err(err);
        }
    }

    let current = Current::new(claim.clone());
    let started = metrics::Started::now();
    // One expression without an await, so that nothing holds the body (or the future it
    // makes) but the pinned future polled below.
    let body = std::pin::pin!(match body.take() {
        Some(start) => current.clone().scope(start(current)),
        // Never: every caller hands its body over once. The owner, dropped, gives the claim
        // back.
        None => return Err(Error::Store(body_taken()).into()),
    });
    let watched = watch(body, &claim, on_lost).await;
    metrics::handler_duration(key, name, started);
    let out = match watched {
        Watched::Done(out) => out.into_result(),
        Watched::Cancelled => {
            let err = lost();
            owner.release().await;
            return Err(err.into());
        }
    };
    match out {
        Ok(value) => match owner.record(results.keep_ok(&value)).await {
            Recording::Recorded => {
                report.conclude(key, Outcome::Executed);
                Ok(value)
            }
            Recording::Lost | Recording::Unconfirmed => {
                tracing::warn!("lost ownership before completing");
                Err(lost().into())
            }
            Recording::Deferred => {
                // The effect is applied: reporting failure would make the broker redeliver
                // and run it again. The completion is retried in the background.
                tracing::debug!("the outcome is being recorded in the background");
                report.conclude(key, Outcome::Executed);
                Ok(value)
            }
        },
        Err(err) => {
            report.conclude(key, Outcome::Failed);
            match results.keep_err(&err) {
                Kept::Release => owner.release().await,
                Kept::Record(result) => {
                    if owner.record(Some(result)).await == Recording::Lost {
                        tracing::warn!("lost ownership before the failure could be stored");
                    }
                }
            }
            Err(err)
        }
    }
}
