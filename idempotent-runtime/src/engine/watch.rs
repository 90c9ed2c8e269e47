//! The watchdog: drives a future while renewing its claim's lease every third of it.
//!
//! Renewal runs beside the future, in the same task: a renewal round trip in flight never
//! stops the future from being polled, and a future that finishes on its first poll needs no
//! timer at all. The lease is counted on the caller's clock from when the claim (or the last
//! renewal that succeeded) was *sent*, so the watchdog can only think the lease lost too early,
//! never too late. When the store says the claim is someone else's, or no renewal succeeded
//! before the lease ran out, the claim is marked lost: the body can see it (see
//! [`Current`](crate::Current)) and, if the policy says so, is cancelled.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::claimed::Claimed;
use crate::engine::deadline::{bounded, call_bound};
use crate::error::StoreError;
use crate::policy::OnLostLease;
use crate::store::BoxFuture;

/// How a watched future ended.
pub(crate) enum Watched<T> {
    /// It finished.
    Done(T),
    /// The lease was lost and the policy cancelled it.
    Cancelled,
}

/// Drives `fut` under `claim`'s lease (see the module docs). The future is pinned by the
/// caller: taken by value, it would be stored twice in this one (as the argument and as
/// the pinned local), and a handler's future can be large.
pub(crate) async fn watch<F: Future>(
    mut fut: Pin<&mut F>,
    claim: &Claimed,
    on_lost: OnLostLease,
) -> Watched<F::Output> {
    // A future that finishes on its first poll needs no timer.
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return Watched::Done(out);
    }
    let every = (claim.lease / 3).max(Duration::from_millis(1));
    let mut renewal: Option<(Instant, BoxFuture<'_, Result<bool, StoreError>>)> = None;
    let mut next_renewal = Instant::now() + every;
    let mut timer = pin!(tokio::time::sleep_until(
        next_renewal.min(claim.lease_until())
    ));
    poll_fn(|cx| loop {
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            return Poll::Ready(Watched::Done(out));
        }
        if let Some((sent_at, pending)) = renewal.as_mut() {
            if let Poll::Ready(renewed) = pending.as_mut().poll(cx) {
                let sent_at = *sent_at;
                renewal = None;
                match renewed {
                    Ok(true) => {
                        crate::metrics::lease_renewal(&claim.key, claim.store.name());
                        claim.renewed(sent_at);
                    }
                    Ok(false) => {
                        tracing::warn!(
                            "lease lost while the handler runs: another owner holds the key"
                        );
                        claim.set_lost();
                    }
                    Err(err) => {
                        crate::metrics::store_error(claim.store.name(), err.kind());
                        tracing::warn!(error = %err, "lease renewal failed; retrying");
                    }
                }
            }
        }
        let now = Instant::now();
        let lease_until = claim.lease_until();
        if !claim.is_marked_lost() && now >= lease_until {
            tracing::warn!(
                "lease ran out before a renewal succeeded; another owner may take the key"
            );
            claim.set_lost();
        }
        if claim.is_marked_lost() {
            if on_lost == OnLostLease::Cancel {
                return Poll::Ready(Watched::Cancelled);
            }
            // Nothing left to renew; the completion will tell whether the claim is still ours.
            renewal = None;
            return Poll::Pending;
        }
        if renewal.is_none() && now >= next_renewal {
            next_renewal = now + every;
            // Bounded: a renewal that never answers is abandoned and the next one sent, well
            // before the lease runs out.
            let renew = claim.store.renew(&claim.key, &claim.token, claim.lease);
            renewal = Some((
                now,
                Box::pin(bounded(call_bound(claim.lease), "renewal", renew)),
            ));
            // Poll the new renewal (and the rest) once more.
            continue;
        }
        let wake_at = if renewal.is_some() {
            lease_until
        } else {
            next_renewal.min(lease_until)
        };
        if timer.deadline() != wake_at {
            timer.as_mut().reset(wake_at);
        }
        if timer.as_mut().poll(cx).is_ready() {
            continue;
        }
        return Poll::Pending;
    })
    .await
}
