//! RabbitMQ consumers through lapin, with manual acknowledgements.
//!
//! [`settle`](fn@settle) acknowledges, requeues or dead-letters one delivery from its handler's outcome
//! (see the [table](super)); [`consume`](fn@consume) runs a handler over a consumer with bounded
//! concurrency and settles every delivery. Neither decodes messages nor knows the business:
//! the handler does that, through an `#[idempotent]` function or a [`Idempotency`](crate::Idempotency).
//! Both need the [`Queue`] the deliveries come from: its type and how its failed deliveries
//! come back decide how they are counted and settled.
//!
//! ```no_run
//! use idempotent_runtime::broker::{rabbitmq, Redelivery, Settle};
//! use rabbitmq::lapin::{options::*, types::FieldTable, Connection, ConnectionProperties};
//! use rabbitmq::Queue;
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
//! let queue = Queue::quorum("orders");
//! let stop = async { let _ = tokio::signal::ctrl_c().await; };
//! let summary = rabbitmq::consume(consumer, queue, 50, Redelivery::new(), stop, |delivery| async move {
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
//!   when the queue has none. Declare one. In a [retry topology](Queue::retry_through_dead_letter_exchange)
//!   the dead-letter exchange is the way back for retries instead, and a message to
//!   dead-letter is published to a parking queue, then acknowledged.
//! - **Delivery counts** decide when a handler that keeps failing has its message
//!   dead-lettered ([`Redelivery::max_deliveries`]). Only what RabbitMQ itself records about the
//!   consuming queue is counted: on a quorum queue, the `x-delivery-count` RabbitMQ sets on
//!   every redelivery (the times the message was returned to the queue; RabbitMQ overwrites a
//!   publisher's value); in a retry topology, the `x-death` entry of the consuming queue with
//!   reason `rejected` (the times that queue delivered the message and it failed; the retry
//!   queue's `expired` entries are not deliveries). RabbitMQ never sets `x-delivery-count`
//!   on a classic queue, so a value there is the publisher's and is ignored: a redelivery on
//!   a classic queue has no count, and a handler that keeps failing is requeued without
//!   bound. Declare quorum queues, or a retry topology, to have it dead-lettered. A quorum
//!   queue's own `x-delivery-limit`, if set, must be above [`Redelivery::max_deliveries`], since
//!   every requeue counts. See [`deliveries`].
//! - **Redelivery delay**: RabbitMQ has no per-message delay. A delivery to redeliver is held
//!   by [`settle`](fn@settle) for the delay, then `basic.nack`ed with requeue, so a message whose key is
//!   being processed elsewhere does not spin through the queue. It keeps its prefetch slot
//!   while held; a consumer that dies meanwhile has it redelivered at once. In a retry
//!   topology it is rejected at once instead, and the retry queue's message TTL is the delay.
//! - **Crashes**: unacknowledged deliveries of a closed channel or connection (a killed
//!   process) are redelivered by RabbitMQ; their claims are taken over when their lease runs
//!   out, or answered by the handler's `done` check.

#[cfg(doc)]
use super::Redelivery;

mod consume;
mod error;
mod queue;
mod settle;

/// The lapin crate this module speaks, re-exported so its types match.
pub use lapin;

pub use consume::{consume, Message};
pub use error::Error;
pub use queue::{deliveries, Queue};
pub use settle::settle;
