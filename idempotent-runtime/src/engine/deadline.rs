//! Bounds on the store calls of an owner's path: a call that never answers (a silent
//! connection, a stalled server) is abandoned after a time derived from the lease and treated
//! as a lost reply ([`StoreErrorKind::OutcomeUnknown`]), which the read-back and retry rules
//! then resolve. The lease goes on being renewed meanwhile (the caller runs the call under the
//! watchdog), so the bound never lets the lease lapse by itself.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::error::{StoreError, StoreErrorKind};
pub(crate) use crate::store::deadline::call_bound;

/// `call`, abandoned with an [`StoreErrorKind::OutcomeUnknown`] error when it has not answered
/// within `bound`. A call that answers on its first poll (an in-memory store) sets no timer,
/// so it needs no Tokio runtime.
pub(crate) fn bounded<F, T>(bound: Duration, what: &'static str, call: F) -> Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    Bounded {
        call: Box::pin(call),
        bound,
        what,
        timer: None,
    }
}

/// The future of [`bounded`].
pub(crate) struct Bounded<F> {
    call: Pin<Box<F>>,
    bound: Duration,
    what: &'static str,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<F, T> Future for Bounded<F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    type Output = Result<T, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(out) = self.call.as_mut().poll(cx) {
            return Poll::Ready(out);
        }
        let bound = self.bound;
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(bound)));
        if timer.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                format!("no answer to the {} within {bound:?}", self.what),
            )));
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
