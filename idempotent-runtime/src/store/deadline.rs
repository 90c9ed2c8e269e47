//! How long one store call on an owner's path may go unanswered, derived from the lease: the
//! engine bounds each call of an owner with it, and [`CombiningStore`](super::CombiningStore)
//! each batch it sends, so the two agree; and [`bounded`], the bound itself, which a store's
//! own maintenance (the SQL purger) uses too.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::{StoreError, StoreErrorKind};

/// The shortest bound, for the shortest leases: below it a healthy store's round trip on a
/// loaded machine would be cut.
const MIN_BOUND: Duration = Duration::from_millis(100);

/// Half the lease (at least 100 ms). The watchdog renews every third of the lease, so a
/// renewal that is cut is followed by another well before the lease runs out.
pub(crate) fn call_bound(lease: Duration) -> Duration {
    (lease / 2).max(MIN_BOUND)
}

/// `call`, abandoned with an [`StoreErrorKind::OutcomeUnknown`] error when it has not answered
/// within `bound`. A call that answers on its first poll (an in-memory store) sets no timer,
/// so it needs no Tokio runtime.
pub(crate) fn bounded<F, T>(bound: Duration, what: &'static str, call: F) -> Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    Bounded {
        call,
        bound,
        what,
        timer: None,
    }
}

pin_project_lite::pin_project! {
    /// The future of [`bounded`]. The call is held in place, not boxed: a store's call is a
    /// boxed future already, and a box around it would be one allocation more for each call
    /// of an owner's path. The timer is boxed: a Tokio `Sleep` held in place makes every future
    /// that holds a store call larger, and the futures that are moved whole (the HTTP
    /// layer's run, as it is boxed) copy it each time.
    pub(crate) struct Bounded<F> {
        #[pin]
        call: F,
        bound: Duration,
        what: &'static str,
        // Set on the first poll that finds the call pending.
        timer: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F, T> Future for Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(out) = this.call.poll(cx) {
            return Poll::Ready(out);
        }
        let bound = *this.bound;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                format!("no answer to the {} within {bound:?}", this.what),
            )));
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_is_half_the_lease_and_never_below_the_minimum() {
        assert_eq!(call_bound(Duration::from_secs(30)), Duration::from_secs(15));
        assert_eq!(call_bound(Duration::from_millis(10)), MIN_BOUND);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_never_answers_is_an_unknown_outcome_at_its_bound() {
        let started = tokio::time::Instant::now();
        let never = std::future::pending::<Result<(), StoreError>>();
        let err = bounded(Duration::from_secs(3), "completion", never)
            .await
            .err()
            .map(|e| e.kind());
        assert_eq!(err, Some(StoreErrorKind::OutcomeUnknown));
        assert_eq!(started.elapsed(), Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_answers_before_its_bound_gives_its_own_answer() {
        let started = tokio::time::Instant::now();
        let late = async {
            tokio::time::sleep(Duration::from_millis(2_999)).await;
            Ok::<_, StoreError>(7)
        };
        let out = bounded(Duration::from_secs(3), "read", late).await;
        assert_eq!(out.ok(), Some(7));
        assert_eq!(started.elapsed(), Duration::from_millis(2_999));
        // A call's own error goes through as it is, not as an unknown outcome.
        let refused = async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            Err::<(), _>(StoreError::new(StoreErrorKind::Unavailable, "refused"))
        };
        let err = bounded(Duration::from_secs(3), "claim", refused)
            .await
            .err()
            .map(|e| e.kind());
        assert_eq!(err, Some(StoreErrorKind::Unavailable));
    }

    /// Sets its flag when dropped.
    struct Dropped(std::sync::Arc<std::sync::atomic::AtomicBool>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_bound_dropped_before_or_after_its_expiry_drops_its_call() {
        for expire in [false, true] {
            let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let guard = Dropped(dropped.clone());
            let call = async move {
                let _guard = guard;
                std::future::pending::<Result<(), StoreError>>().await
            };
            let mut bound = Box::pin(bounded(Duration::from_secs(1), "release", call));
            let polled = futures_util::poll!(bound.as_mut());
            assert!(polled.is_pending());
            assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
            if expire {
                assert!(bound.as_mut().await.is_err());
            }
            drop(bound);
            assert!(
                dropped.load(std::sync::atomic::Ordering::SeqCst),
                "expire: {expire}"
            );
        }
    }

    #[test]
    fn a_call_that_answers_at_once_needs_no_runtime() {
        let ready = std::future::ready(Ok::<_, StoreError>(7));
        let out = futures_lite_block_on(bounded(Duration::from_secs(1), "read", ready));
        assert_eq!(out.ok(), Some(7));
    }

    /// Polls once with a no-op waker: enough for a future that is ready at once.
    fn futures_lite_block_on<F: Future>(fut: F) -> F::Output {
        let mut fut = std::pin::pin!(fut);
        match fut
            .as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
        {
            Poll::Ready(out) => out,
            Poll::Pending => unreachable!("the future was not ready"),
        }
    }
}
