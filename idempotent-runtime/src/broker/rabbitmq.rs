//! RabbitMQ consumers through lapin, with manual acknowledgements.
//!
//! [`settle`] acknowledges, requeues or dead-letters one delivery from its handler's outcome
//! (see the [table](super)); [`consume`] runs a handler over a consumer with bounded
//! concurrency and settles every delivery. Neither decodes messages nor knows the business:
//! the handler does that, through an `#[idempotent]` function or a [`Guard`](crate::Guard).
//!
//! ```no_run
//! use idempotent_runtime::broker::{rabbitmq, Policy, Settle};
//! use rabbitmq::lapin::{options::*, types::FieldTable, Connection, ConnectionProperties};
//!
//! # async fn on_order(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let conn = Connection::connect("amqp://127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
//! let channel = conn.create_channel().await?;
//! channel.basic_qos(50, BasicQosOptions::default()).await?;
//! let consumer = channel
//!     .basic_consume("orders".into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
//!     .await?;
//!
//! // Up to 50 handlers at once; returns when the consumer is cancelled.
//! let summary = rabbitmq::consume(consumer, 50, Policy::new(), |delivery| async move {
//!     on_order(&delivery.data).await
//! })
//! .await?;
//! println!("acked {}, redelivered {}", summary.acked, summary.redelivered);
//! # Ok(()) }
//! ```
//!
//! # Queues
//!
//! - **Dead letters**: a dead-lettered delivery is rejected without requeueing; RabbitMQ
//!   routes it to the queue's dead-letter exchange (`x-dead-letter-exchange`), or drops it
//!   when the queue has none. Declare one.
//! - **Delivery counts**: RabbitMQ tells a consumer how often a message was delivered only on
//!   quorum queues (`x-queue-type: quorum`, the `x-delivery-count` header) or through the
//!   `x-death` header of a dead-letter retry topology. On a classic queue a redelivered
//!   message has no count, so a handler that keeps failing is requeued without bound; declare
//!   quorum queues to have it dead-lettered after [`Policy::max_deliveries`]. A quorum queue's
//!   own `x-delivery-limit`, if set, must be above it, since every requeue counts.
//! - **Redelivery delay**: RabbitMQ has no per-message delay. A delivery to redeliver is held
//!   by [`settle`] for the delay, then `basic.nack`ed with requeue, so a message whose key is
//!   being processed elsewhere does not spin through the queue. It keeps its prefetch slot
//!   while held; a consumer that dies meanwhile has it redelivered at once.
//! - **Crashes**: unacknowledged deliveries of a closed channel or connection (a killed
//!   process) are redelivered by RabbitMQ; their claims are taken over when their lease runs
//!   out, or answered by the handler's `done` check.

use std::future::Future;
use std::sync::Arc;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use lapin::types::AMQPValue;
use lapin::{Acker, Consumer};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{Decision, Policy, Settle, Summary};

/// The lapin crate this module speaks, re-exported so its types match.
pub use lapin;

/// Errors of the RabbitMQ integration.
///
/// Neither loses a message: a delivery that was not acknowledged is redelivered by RabbitMQ
/// once its channel closes.
///
/// ```
/// use idempotent_runtime::broker::rabbitmq::Error;
///
/// let err = Error::Unsettled { delivery_tag: 7 };
/// assert!(err.to_string().contains("delivery 7"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The broker refused an operation, or the channel or connection failed.
    #[error("RabbitMQ operation failed")]
    Amqp(#[from] lapin::Error),
    /// The delivery could not be settled: its channel closed, or it was settled already.
    /// An unsettled delivery of a closed channel is redelivered by the broker.
    #[error("delivery {delivery_tag} could not be settled: its channel closed, or it was settled already")]
    Unsettled {
        /// The delivery's tag on its channel.
        delivery_tag: u64,
    },
}

/// Which delivery of its message this is, counting from 1, as far as RabbitMQ tells: from the
/// `x-delivery-count` header of a quorum queue, or the `x-death` counts of a dead-letter
/// retry topology; 1 for a first delivery without either; `None` for a redelivery on a
/// classic queue, which carries no count.
///
/// ```
/// use idempotent_runtime::broker::rabbitmq::{deliveries, lapin::message::Delivery};
///
/// let first = Delivery::mock(1, "".into(), "orders".into(), false, b"{}".to_vec());
/// assert_eq!(deliveries(&first), Some(1));
/// let again = Delivery::mock(2, "".into(), "orders".into(), true, b"{}".to_vec());
/// assert_eq!(deliveries(&again), None);
/// ```
pub fn deliveries(delivery: &Delivery) -> Option<u32> {
    if let Some(headers) = delivery.properties.headers() {
        let headers = headers.inner();
        if let Some(count) = headers.get("x-delivery-count").and_then(count) {
            return Some(attempt(count));
        }
        if let Some(AMQPValue::FieldArray(deaths)) = headers.get("x-death") {
            let died: u64 = deaths
                .as_slice()
                .iter()
                .filter_map(|death| match death {
                    AMQPValue::FieldTable(death) => death.inner().get("count").and_then(count),
                    _ => None,
                })
                .sum();
            if died > 0 {
                return Some(attempt(died));
            }
        }
    }
    (!delivery.redelivered).then_some(1)
}

/// The delivery after `previous` earlier ones.
fn attempt(previous: u64) -> u32 {
    u32::try_from(previous.saturating_add(1)).unwrap_or(u32::MAX)
}

/// A non-negative integer header value.
fn count(value: &AMQPValue) -> Option<u64> {
    let n: i128 = match value {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::Timestamp(n) => (*n).into(),
        _ => return None,
    };
    u64::try_from(n).ok()
}

/// Settles `delivery` from its handler's `result`, per the [table](super): `basic.ack`;
/// `basic.nack` with requeue after holding it for the policy's delay; or `basic.reject`
/// without requeue (to the queue's dead-letter exchange). Returns what it did.
///
/// Call it only after the handler returned: the effect is applied (or known to be) before
/// the message is acknowledged.
///
/// # Errors
///
/// [`Error::Amqp`] when the channel failed while settling, [`Error::Unsettled`] when the
/// delivery can no longer be settled (its channel closed, or it was settled before). Either
/// way RabbitMQ redelivers the message if it was not acknowledged.
///
/// ```no_run
/// use idempotent_runtime::broker::{rabbitmq, Policy};
/// use rabbitmq::lapin::message::Delivery;
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn on_delivery(delivery: Delivery, policy: &Policy) -> Result<(), rabbitmq::Error> {
///     let result = apply(&delivery.data).await;
///     let decision = rabbitmq::settle(&delivery, &result, policy).await?;
///     println!("delivery {} -> {decision}", delivery.delivery_tag);
///     Ok(())
/// }
/// ```
pub async fn settle<T, E: Settle>(
    delivery: &Delivery,
    result: &Result<T, E>,
    policy: &Policy,
) -> Result<Decision, Error> {
    let decision = policy.decide(result, deliveries(delivery));
    apply(&delivery.acker, delivery.delivery_tag, decision).await?;
    Ok(decision)
}

async fn apply(acker: &Acker, delivery_tag: u64, decision: Decision) -> Result<(), Error> {
    let settled = match decision {
        Decision::Ack => acker.ack(BasicAckOptions::default()).await?,
        Decision::Redeliver { delay } => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let requeue = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            acker.nack(requeue).await?
        }
        Decision::DeadLetter => acker.reject(BasicRejectOptions { requeue: false }).await?,
    };
    if settled {
        Ok(())
    } else {
        Err(Error::Unsettled { delivery_tag })
    }
}

/// Runs `handler` on every delivery of `consumer`, at most `concurrency` at once (at least
/// one), and [`settle`]s each delivery from its outcome. A handler that panics is treated as
/// the handler's own error (its claim is given back by the engine).
///
/// Set the channel's prefetch (`basic_qos`) to about `concurrency`: deliveries beyond it
/// wait in the client. Returns once the consumer ends (cancelled with `basic_cancel`, or
/// its channel closed) and every handler in flight has finished and been settled. Dropping
/// the returned future instead cancels the handlers in flight (the engine gives their claims
/// back); their deliveries stay unacknowledged until the channel closes and RabbitMQ
/// redelivers them.
///
/// # Errors
///
/// [`Error::Amqp`] when the consumer fails (its channel or connection closed). Deliveries
/// in flight are finished first; those that could not be settled are redelivered by
/// RabbitMQ and counted as [`Summary::unsettled`].
///
/// ```no_run
/// use idempotent_runtime::broker::{rabbitmq, Policy};
/// use rabbitmq::lapin::{options::*, types::FieldTable, Channel};
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn run(channel: Channel) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     channel.basic_qos(8, BasicQosOptions::default()).await?;
///     let consumer = channel
///         .basic_consume("orders".into(), "worker".into(), BasicConsumeOptions::default(), FieldTable::default())
///         .await?;
///     let summary = rabbitmq::consume(consumer, 8, Policy::new(), |delivery| async move {
///         apply(&delivery.data).await
///     })
///     .await?;
///     println!("{summary:?}");
///     Ok(())
/// }
/// ```
pub async fn consume<F, Fut, T, E>(
    consumer: Consumer,
    concurrency: usize,
    policy: Policy,
    handler: F,
) -> Result<Summary, Error>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Settle + Send + 'static,
{
    let mut consumer = consumer;
    let handler = Arc::new(handler);
    let policy = Arc::new(policy);
    let slots = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = JoinSet::new();
    let mut summary = Summary::default();

    let ended = loop {
        // A free slot first, so deliveries beyond it stay in the client (and unacknowledged).
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        while let Some(done) = tasks.try_join_next() {
            record(&mut summary, done);
        }
        match super::next(&mut consumer).await {
            None => break Ok(()),
            Some(Err(err)) => break Err(Error::Amqp(err)),
            Some(Ok(delivery)) => {
                let (handler, policy) = (handler.clone(), policy.clone());
                tasks.spawn(async move {
                    let settled = handle(&*handler, delivery, &policy).await;
                    drop(slot);
                    settled
                });
            }
        }
    };
    while let Some(done) = tasks.join_next().await {
        record(&mut summary, done);
    }
    ended.map(|()| summary)
}

/// Runs the handler on one delivery (in its own task, so a panic is contained) and settles.
async fn handle<F, Fut, T, E>(
    handler: &F,
    delivery: Delivery,
    policy: &Policy,
) -> Result<Decision, Error>
where
    F: Fn(Delivery) -> Fut,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Settle + Send + 'static,
{
    let acker = delivery.acker.clone();
    let delivery_tag = delivery.delivery_tag;
    let count = deliveries(&delivery);
    let decision = match super::contained(handler(delivery)).await {
        Ok(result) => policy.decide(&result, count),
        Err(err) => {
            tracing::error!(delivery_tag, error = %err, "handler panicked; treating it as a failure");
            policy.handler_failed(count, false)
        }
    };
    let settled = apply(&acker, delivery_tag, decision).await;
    match &settled {
        Ok(()) => tracing::debug!(delivery_tag, deliveries = ?count, %decision, "settled"),
        Err(err) => tracing::warn!(delivery_tag, error = %err, "delivery not settled"),
    }
    settled.map(|()| decision)
}

fn record(summary: &mut Summary, done: Result<Result<Decision, Error>, tokio::task::JoinError>) {
    match done {
        Ok(settled) => summary.record(&settled),
        Err(err) => {
            tracing::error!(error = %err, "settling task failed");
            summary.unsettled += 1;
        }
    }
}
