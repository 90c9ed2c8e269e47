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
use std::sync::Arc;
use std::task::{Context, Poll};
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
                renewal_answered(claim, sent_at, renewed);
            }
        }
        let now = Instant::now();
        let lease_until = claim.lease_until();
        check_lease(claim, now);
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
        if due(
            timer.as_mut(),
            cx,
            renewal.is_some(),
            next_renewal,
            lease_until,
        ) {
            continue;
        }
        return Poll::Pending;
    })
    .await
}

/// Sets `timer` to the next moment the watchdog must look (the lease's end, and the next
/// renewal's time unless a renewal is in flight), and says whether that moment has come.
fn due(
    mut timer: Pin<&mut tokio::time::Sleep>,
    cx: &mut Context<'_>,
    renewing: bool,
    next_renewal: Instant,
    lease_until: Instant,
) -> bool {
    let wake_at = if renewing {
        lease_until
    } else {
        next_renewal.min(lease_until)
    };
    if timer.deadline() != wake_at {
        timer.as_mut().reset(wake_at);
    }
    timer.poll(cx).is_ready()
}

/// What a renewal's answer, for a renewal sent at `sent_at`, says of `claim`'s lease.
fn renewal_answered(claim: &Claimed, sent_at: Instant, renewed: Result<bool, StoreError>) {
    match renewed {
        Ok(true) => {
            crate::metrics::lease_renewal(&claim.key, claim.store.name());
            claim.renewed(sent_at);
        }
        Ok(false) => {
            tracing::warn!("lease lost while the handler runs: another owner holds the key");
            claim.set_lost();
        }
        Err(err) => {
            crate::metrics::store_error(claim.store.name(), err.kind());
            tracing::warn!(error = %err, "lease renewal failed; retrying");
        }
    }
}

/// Marks `claim` lost when its lease ran out by `now` on the caller's clock.
fn check_lease(claim: &Claimed, now: Instant) {
    if !claim.is_marked_lost() && now >= claim.lease_until() {
        tracing::warn!("lease ran out before a renewal succeeded; another owner may take the key");
        claim.set_lost();
    }
}

/// Drives `fut` under the leases of `claims` (all of one lease, as a batch's are), as
/// [`watch`] drives a future under one, with one timer for them all: every third of the lease
/// each claim not lost is renewed, and a claim whose lease ran out is marked lost. The future
/// is never cancelled ([`OnLostLease::Continue`]): it is a batch's completions in flight, and
/// each completion tells by its own answer whether its claim was still its owner's.
pub(crate) async fn watch_many<F: Future>(
    mut fut: Pin<&mut F>,
    claims: &[Arc<Claimed>],
) -> F::Output {
    // A future that finishes on its first poll needs no timer.
    if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return out;
    }
    let Some(lease) = claims.iter().map(|claim| claim.lease).min() else {
        return fut.await;
    };
    let every = (lease / 3).max(Duration::from_millis(1));
    type Renewal<'a> = (
        Instant,
        &'a Claimed,
        BoxFuture<'a, Result<bool, StoreError>>,
    );
    let mut renewals: Vec<Renewal<'_>> = Vec::new();
    let mut next_renewal = Instant::now() + every;
    let lease_until = |claims: &[Arc<Claimed>]| {
        claims
            .iter()
            .filter(|claim| !claim.is_marked_lost())
            .map(|claim| claim.lease_until())
            .min()
    };
    let first_end = lease_until(claims).unwrap_or(next_renewal);
    let mut timer = pin!(tokio::time::sleep_until(next_renewal.min(first_end)));
    poll_fn(|cx| loop {
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            return Poll::Ready(out);
        }
        renewals.retain_mut(
            |(sent_at, claim, pending)| match pending.as_mut().poll(cx) {
                Poll::Ready(renewed) => {
                    renewal_answered(claim, *sent_at, renewed);
                    false
                }
                Poll::Pending => true,
            },
        );
        let now = Instant::now();
        for claim in claims {
            check_lease(claim, now);
        }
        if renewals.is_empty() && now >= next_renewal {
            next_renewal = now + every;
            // Bounded: a renewal that never answers is abandoned and the next one sent, well
            // before the lease runs out.
            for claim in claims.iter().filter(|claim| !claim.is_marked_lost()) {
                let renew = claim.store.renew(&claim.key, &claim.token, claim.lease);
                let renew = bounded(call_bound(claim.lease), "renewal", renew);
                renewals.push((now, &**claim, Box::pin(renew)));
            }
            if !renewals.is_empty() {
                // Poll the new renewals (and the rest) once more.
                continue;
            }
        }
        let Some(lease_until) = lease_until(claims) else {
            // Every lease is lost: nothing left to renew; the completions will tell.
            return Poll::Pending;
        };
        if due(
            timer.as_mut(),
            cx,
            !renewals.is_empty(),
            next_renewal,
            lease_until,
        ) {
            continue;
        }
        return Poll::Pending;
    })
    .await
}
