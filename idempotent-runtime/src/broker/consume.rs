//! The consume loop every broker integration runs, over a [`Delivery`] trait.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_core::Stream;
use futures_util::StreamExt;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{Decision, Redelivery, Settle, Summary};
use crate::default_store::{carry, scoped};

/// One message from a broker, as the [`consume`] loop needs it: its payload, the delivery
/// count the broker records, and the three ways to settle it.
///
/// Implemented for RabbitMQ ([`rabbitmq::Message`](super::rabbitmq::Message)) and NATS
/// JetStream ([`async_nats::jetstream::Message`]).
/// A clone is the same message: the loop hands one to the handler and settles another.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::broker::Delivery;
///
/// /// A message read from a file, settled by logging what becomes of it.
/// #[derive(Clone)]
/// struct Line(String);
///
/// impl Delivery for Line {
///     type Error = std::io::Error;
///     fn payload(&self) -> &[u8] {
///         self.0.as_bytes()
///     }
///     fn deliveries(&self) -> Option<u32> {
///         Some(1)
///     }
///     async fn ack(&self) -> Result<(), std::io::Error> {
///         println!("done: {}", self.0);
///         Ok(())
///     }
///     async fn redeliver(&self, delay: Duration) -> Result<(), std::io::Error> {
///         println!("again in {delay:?}: {}", self.0);
///         Ok(())
///     }
///     async fn dead_letter(&self) -> Result<(), std::io::Error> {
///         println!("parked: {}", self.0);
///         Ok(())
///     }
/// }
/// ```
pub trait Delivery: Clone + Send + Sync + 'static {
    /// Why settling failed (the broker then redelivers the message).
    type Error: StdError + Send + 'static;

    /// The message's body.
    fn payload(&self) -> &[u8];

    /// Which delivery of its message this is, counting from 1, as the broker records it;
    /// `None` when the broker cannot tell. Never a count the publisher could have written.
    fn deliveries(&self) -> Option<u32>;

    /// Acknowledges the message: its effect is applied (now or before).
    fn ack(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Gives the message back, to be delivered again after about `delay`.
    fn redeliver(&self, delay: Duration) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Dead-letters the message: it is not delivered again.
    fn dead_letter(&self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The broker, as metrics label it (`messaging.system`: `rabbitmq`, `nats`).
    fn system(&self) -> &'static str {
        "unknown"
    }

    /// Where the message was consumed from, as metrics label it
    /// (`messaging.destination.name`: a queue, a subject).
    fn destination(&self) -> &str {
        ""
    }
}

/// Carries out `decision` on `delivery`.
pub(crate) async fn apply<D: Delivery>(delivery: &D, decision: Decision) -> Result<(), D::Error> {
    match decision {
        Decision::Ack => delivery.ack().await,
        Decision::Redeliver { delay } => delivery.redeliver(delay).await,
        Decision::DeadLetter => delivery.dead_letter().await,
    }
}

/// Runs `handler` on every message of `messages`, at most `concurrency` at once (at least
/// one), and settles each from its outcome per `redelivery` (see the [table](super)), until
/// `messages` ends or `stop` completes. A handler that panics is treated as the handler's
/// own error (its claim is given back by the engine). [`rabbitmq::consume`] and
/// [`nats::consume`] are this loop over their broker's messages.
///
/// A free slot is awaited before the next message is taken, so messages beyond
/// `concurrency` stay with the broker's client. When `messages` ends, fails, or `stop`
/// completes, no new message is started; handlers in flight finish and are settled, then the
/// call returns. Dropping the returned future instead cancels the handlers in flight (the
/// engine gives their claims back) and leaves their messages unsettled.
///
/// # Errors
///
/// The first error `messages` yields; the messages in flight are settled first. Messages
/// that could not be settled are counted as [`Summary::unsettled`].
///
/// [`rabbitmq::consume`]: super::rabbitmq::consume
/// [`nats::consume`]: super::nats::consume
pub async fn consume<D, E, M, S, F, Fut, T, HE>(
    messages: M,
    concurrency: usize,
    redelivery: Redelivery,
    stop: S,
    handler: F,
) -> Result<Summary, E>
where
    D: Delivery,
    M: Stream<Item = Result<D, E>>,
    S: Future<Output = ()>,
    F: Fn(D) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HE>> + Send + 'static,
    T: Send + 'static,
    HE: Settle + Send + 'static,
{
    let mut messages = pin!(messages);
    let mut stop = pin!(stop);
    let handler = Arc::new(handler);
    let redelivery = Arc::new(redelivery);
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = JoinSet::new();
    let mut summary = Summary::default();

    let ended = loop {
        // A free slot first, so messages beyond it stay with the client (and unsettled).
        let slot = tokio::select! {
            biased;
            () = &mut stop => break Ok(()),
            slot = slots.clone().acquire_owned() => slot,
        };
        let Ok(slot) = slot else {
            break Ok(());
        };
        while let Some(done) = tasks.try_join_next() {
            record(&mut summary, done);
        }
        let next = tokio::select! {
            biased;
            () = &mut stop => break Ok(()),
            next = messages.next() => next,
        };
        match next {
            None => break Ok(()),
            Some(Err(err)) => break Err(err),
            Some(Ok(message)) => {
                let (handler, redelivery) = (handler.clone(), redelivery.clone());
                tasks.spawn(carry(scoped(), async move {
                    let settled = handle(&*handler, message, &redelivery).await;
                    drop(slot);
                    settled
                }));
            }
        }
    };
    while let Some(done) = tasks.join_next().await {
        record(&mut summary, done);
    }
    ended.map(|()| summary)
}

/// Runs the handler on one message (in its own task, so a panic is contained) and settles.
async fn handle<D, F, Fut, T, HE>(
    handler: &F,
    message: D,
    redelivery: &Redelivery,
) -> Result<Decision, D::Error>
where
    D: Delivery,
    F: Fn(D) -> Fut,
    Fut: Future<Output = Result<T, HE>> + Send + 'static,
    T: Send + 'static,
    HE: Settle + Send + 'static,
{
    let count = message.deliveries();
    let started = crate::metrics::Started::now();
    let decision = match contained(handler(message.clone())).await {
        Ok(result) => redelivery.decide(&result, count),
        Err(err) => {
            tracing::error!(deliveries = ?count, error = %err, "handler panicked; treating it as a failure");
            redelivery.handler_failed(count, false)
        }
    };
    let settled = apply(&message, decision).await;
    crate::metrics::messaging_process(message.system(), message.destination(), started);
    match &settled {
        Ok(()) => tracing::debug!(deliveries = ?count, %decision, "settled"),
        Err(err) => {
            tracing::warn!(deliveries = ?count, %decision, error = %err, "message not settled")
        }
    }
    settled.map(|()| decision)
}

/// Runs a handler's future in its own task, so a panic is contained (and reported as a
/// `JoinError`); dropping the returned future aborts the task, which gives the handler's
/// claim back.
async fn contained<F>(handler: F) -> Result<F::Output, tokio::task::JoinError>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);
    impl<T> Drop for AbortOnDrop<T> {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let mut task = AbortOnDrop(tokio::spawn(carry(scoped(), handler)));
    (&mut task.0).await
}

fn record<E>(summary: &mut Summary, done: Result<Result<Decision, E>, tokio::task::JoinError>) {
    match done {
        Ok(settled) => summary.record(&settled),
        Err(err) => {
            tracing::error!(error = %err, "settling task failed");
            summary.unsettled += 1;
        }
    }
}
