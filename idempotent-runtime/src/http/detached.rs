//! [`Detached`]: a run polled in place by its request's future, moved to a task of its own
//! when that future goes before the run ended.
//!
//! A request's run must end once it started, whatever the client does: a client that hangs
//! up (or a server whose deadline expires) drops the request's future, and a handler dropped
//! halfway gives its claim back after it may have done its effect. Spawning every run as a
//! task keeps it going, at the price of a task per request: its allocation, a second wake-up
//! through the scheduler for every event of the run, and a channel back. [`Detached`] pays
//! that only for the runs that need it: the request's future polls the run itself, and only
//! when it is dropped first (or lets go of the run on purpose, a streamed response whose
//! tail runs on) is the run spawned, where it stands, into the layer's tracker.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::task_tracker::TaskTrackerToken;
use tokio_util::task::TaskTracker;

/// What ended a run without its output: a panic, or a poll after it ended.
pub(crate) enum Ended {
    /// The run panicked; the payload.
    Panicked(Box<dyn Any + Send>),
    /// The run had already ended (or panicked) when it was polled again.
    Gone,
}

impl Ended {
    /// The panic's payload, to resume it where the run is awaited.
    #[cfg(feature = "grpc")]
    pub(crate) fn into_panic(self) -> Option<Box<dyn Any + Send>> {
        match self {
            Ended::Panicked(panic) => Some(panic),
            Ended::Gone => None,
        }
    }
}

/// A run counted by a [`TaskTracker`] from the start, polled where it is awaited, and spawned
/// into the tracker, where it stands, if it is dropped before it ended.
///
/// The tracker counts it throughout, so that a layer's `shutdown` waits for the runs polled in
/// place as for the detached ones: the token taken here is given back only after the task
/// that carries the run on holds its own.
pub(crate) struct Detached<F: Future<Output: Send + 'static> + Send + 'static> {
    run: Option<Pin<Box<F>>>,
    token: TaskTrackerToken,
}

impl<F: Future<Output: Send + 'static> + Send + 'static> Detached<F> {
    /// `run`, boxed once (it then moves as a pointer), counted by `tasks`.
    pub(crate) fn new(run: F, tasks: &TaskTracker) -> Self {
        Detached {
            run: Some(Box::pin(run)),
            token: tasks.token(),
        }
    }

    /// Polls the run; a panic of the run is caught and returned, and the run is dropped then.
    pub(crate) fn poll_run(&mut self, cx: &mut Context<'_>) -> Poll<Result<F::Output, Ended>> {
        let Some(run) = self.run.as_mut() else {
            return Poll::Ready(Err(Ended::Gone));
        };
        let polled = catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.run = None;
                Poll::Ready(Ok(output))
            }
            Err(panic) => {
                self.run = None;
                Poll::Ready(Err(Ended::Panicked(panic)))
            }
        }
    }
}

impl<F: Future<Output: Send + 'static> + Send + 'static> Future for Detached<F> {
    type Output = Result<F::Output, Ended>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut().poll_run(cx)
    }
}

impl<F: Future<Output: Send + 'static> + Send + 'static> Drop for Detached<F> {
    fn drop(&mut self) {
        let Some(run) = self.run.take() else {
            return;
        };
        // Outside a runtime nothing could poll the run again (a runtime that shuts down drops
        // its tasks too): it is dropped, as a spawned run would be.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            // The task's own token is taken before this one goes: the tracker's count never
            // drops to zero in between.
            drop(self.token.task_tracker().spawn_on(run, &runtime));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::sync::Notify;

    use super::*;

    /// A run whose awaiting future is dropped halfway goes on in a task to its end, counted by
    /// the tracker throughout.
    #[tokio::test]
    async fn a_run_dropped_halfway_goes_on_in_a_task() {
        let tasks = TaskTracker::new();
        let gate = Arc::new(Notify::new());
        let ended = Arc::new(AtomicBool::new(false));
        let run = {
            let (gate, ended) = (gate.clone(), ended.clone());
            async move {
                gate.notified().await;
                ended.store(true, Ordering::SeqCst);
            }
        };
        let mut detached = Detached::new(run, &tasks);
        assert_eq!(tasks.len(), 1);
        // Polled once in place: it waits at its gate.
        let polled = std::future::poll_fn(|cx| Poll::Ready(detached.poll_run(cx))).await;
        assert!(polled.is_pending());
        drop(detached);
        assert_eq!(tasks.len(), 1, "the spawned run holds the tracker's count");
        gate.notify_one();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(10), tasks.wait())
            .await
            .unwrap();
        assert!(ended.load(Ordering::SeqCst));
        assert_eq!(tasks.len(), 0);
    }

    /// A run that ends in place is not spawned and gives its count back.
    #[tokio::test]
    async fn a_run_that_ends_in_place_is_not_spawned() {
        let tasks = TaskTracker::new();
        let out = Detached::new(async { 7 }, &tasks).await;
        assert!(matches!(out, Ok(7)));
        assert_eq!(tasks.len(), 0);
    }

    /// A run that panics is caught: its payload is returned, a later poll says it is gone.
    #[tokio::test]
    async fn a_panicking_run_is_caught() {
        let tasks = TaskTracker::new();
        let mut detached = Detached::new(
            async {
                if always() {
                    panic!("the run failed");
                }
            },
            &tasks,
        );
        let first = std::future::poll_fn(|cx| detached.poll_run(cx)).await;
        let Err(Ended::Panicked(payload)) = first else {
            panic!("the panic was not caught");
        };
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"the run failed"));
        let again = std::future::poll_fn(|cx| detached.poll_run(cx)).await;
        assert!(matches!(again, Err(Ended::Gone)));
        drop(detached);
        assert_eq!(tasks.len(), 0);
    }

    /// True, opaquely: the run's panic stays conditional to the compiler.
    fn always() -> bool {
        std::hint::black_box(true)
    }

    /// Dropped outside a runtime, a run that did not end is dropped, not spawned.
    #[test]
    fn a_run_dropped_outside_a_runtime_is_dropped() {
        let tasks = TaskTracker::new();
        let dropped = Arc::new(AtomicBool::new(false));
        struct Mark(Arc<AtomicBool>);
        impl Drop for Mark {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let mark = Mark(dropped.clone());
        let detached = Detached::new(
            async move {
                let _mark = mark;
                std::future::pending::<()>().await;
            },
            &tasks,
        );
        drop(detached);
        assert!(dropped.load(Ordering::SeqCst));
        assert_eq!(tasks.len(), 0);
    }
}
