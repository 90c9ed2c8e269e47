//! The consume loop over RabbitMQ deliveries, each a [`Message`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::Consumer;

use super::error::Error;
use super::queue::{deliveries, Queue};
#[cfg(doc)]
use super::settle::settle;
use super::settle::{ack, dead_letter, redeliver};
use crate::broker::{self, Redelivery, Settle, Summary};

/// A delivery together with the [`Queue`] it came from: what [`consume`] hands its handler,
/// and the [`Delivery`](crate::broker::Delivery) it settles. It dereferences to the lapin
/// [`Delivery`]; a clone is the same delivery.
///
/// ```
/// use idempotent_runtime::broker::{rabbitmq::{lapin::message::Delivery, Message, Queue}, Delivery as _};
///
/// let delivery = Delivery::mock(7, "".into(), "orders".into(), false, b"{}".to_vec());
/// let message = Message::new(delivery, Queue::quorum("orders").into());
/// assert_eq!(message.payload(), b"{}");
/// assert_eq!(message.deliveries(), Some(1));
/// assert_eq!(message.delivery_tag, 7);
/// assert_eq!(message.queue().name(), "orders");
/// ```
#[derive(Debug, Clone)]
pub struct Message {
    delivery: Arc<Delivery>,
    queue: Arc<Queue>,
}

impl Message {
    /// `delivery`, which came from `queue`.
    pub fn new(delivery: Delivery, queue: Arc<Queue>) -> Message {
        Message {
            delivery: Arc::new(delivery),
            queue,
        }
    }

    /// The lapin delivery.
    pub fn delivery(&self) -> &Delivery {
        &self.delivery
    }

    /// The queue it came from.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }
}

impl std::ops::Deref for Message {
    type Target = Delivery;

    fn deref(&self) -> &Delivery {
        &self.delivery
    }
}

impl broker::Delivery for Message {
    type Error = Error;

    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    fn deliveries(&self) -> Option<u32> {
        deliveries(&self.delivery, &self.queue)
    }

    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    fn destination(&self) -> &str {
        self.queue.name()
    }

    /// `basic.ack`.
    async fn ack(&self) -> Result<(), Error> {
        ack(&self.delivery).await
    }

    /// `basic.nack` with requeue after holding the delivery for `delay`; in a retry
    /// topology, `basic.reject` without requeue at once (the retry queue's TTL is the delay).
    async fn redeliver(&self, delay: Duration) -> Result<(), Error> {
        redeliver(&self.delivery, &self.queue, delay).await
    }

    /// `basic.reject` without requeue; in a retry topology, parked, then acknowledged.
    async fn dead_letter(&self) -> Result<(), Error> {
        dead_letter(&self.delivery, &self.queue).await
    }
}

/// Runs `handler` on every delivery of `consumer`, which reads `queue`, at most
/// `concurrency` at once (at least one), and settles each delivery from its outcome as
/// [`settle`] does, until the consumer ends or `stop` completes: the [`consume`](fn@crate::broker::consume)
/// loop over RabbitMQ [`Message`]s. A handler that panics is treated as the handler's own
/// error (its claim is given back by the engine).
///
/// Set the channel's prefetch (`basic_qos`) to about `concurrency`: deliveries beyond it
/// wait in the client. Returns once the consumer ends (cancelled with `basic_cancel`, or
/// its channel closed) or `stop` completes, and every handler in flight has finished and
/// been settled; deliveries the client received but no handler started stay unacknowledged
/// until the channel closes (cancel the consumer first to have none). Pass
/// `std::future::pending()` as `stop` to run until the consumer ends. Dropping the returned
/// future instead cancels the handlers in flight (the engine gives their claims back); their
/// deliveries stay unacknowledged until the channel closes and RabbitMQ redelivers them.
///
/// # Errors
///
/// [`Error::Amqp`] when the consumer fails (its channel or connection closed). Deliveries
/// in flight are finished first; those that could not be settled are redelivered by
/// RabbitMQ and counted as [`Summary::unsettled`].
///
/// ```no_run
/// use idempotent_runtime::broker::{rabbitmq, Redelivery};
/// use rabbitmq::lapin::{options::*, types::FieldTable, Channel};
/// use rabbitmq::Queue;
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn run(channel: Channel) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///     channel.basic_qos(8, BasicQosOptions::default()).await?;
///     let consumer = channel
///         .basic_consume("orders".into(), "worker".into(), BasicConsumeOptions::default(), FieldTable::default())
///         .await?;
///     let queue = Queue::quorum("orders");
///     let stop = std::future::pending();
///     let summary = rabbitmq::consume(consumer, queue, 8, Redelivery::new(), stop, |delivery| async move {
///         apply(&delivery.data).await
///     })
///     .await?;
///     println!("{summary:?}");
///     Ok(())
/// }
/// ```
pub async fn consume<S, F, Fut, T, E>(
    consumer: Consumer,
    queue: Queue,
    concurrency: usize,
    redelivery: Redelivery,
    stop: S,
    handler: F,
) -> Result<Summary, Error>
where
    S: Future<Output = ()>,
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Settle + Send + 'static,
{
    if consumer.queue().as_str() != queue.name() {
        tracing::warn!(
            consumer = %consumer.queue(),
            queue = %queue.name(),
            "the consumer reads another queue than the one its deliveries are counted for"
        );
    }
    let queue = Arc::new(queue);
    let messages = consumer.map(move |delivery| match delivery {
        Ok(delivery) => Ok(Message::new(delivery, queue.clone())),
        Err(err) => Err(Error::Amqp(err)),
    });
    broker::consume(messages, concurrency, redelivery, stop, handler).await
}
