//! RabbitMQ consumers through lapin, with manual acknowledgements.
//!
//! [`settle`] acknowledges, requeues or dead-letters one delivery from its handler's outcome
//! (see the [table](super)); [`consume`] runs a handler over a consumer with bounded
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
//!   by [`settle`] for the delay, then `basic.nack`ed with requeue, so a message whose key is
//!   being processed elsewhere does not spin through the queue. It keeps its prefetch slot
//!   while held; a consumer that dies meanwhile has it redelivered at once. In a retry
//!   topology it is rejected at once instead, and the retry queue's message TTL is the delay.
//! - **Crashes**: unacknowledged deliveries of a closed channel or connection (a killed
//!   process) are redelivered by RabbitMQ; their claims are taken over when their lease runs
//!   out, or answered by the handler's `done` check.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Consumer};

use super::{Decision, Redelivery, Settle, Summary};

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
    /// A delivery to dead-letter could not be parked: RabbitMQ refused the publication or
    /// could not route it (see [`Queue::retry_through_dead_letter_exchange`]). The delivery
    /// was requeued, and is parked on a later delivery once its parking queue takes it.
    #[error("delivery {delivery_tag} could not be parked: RabbitMQ refused or could not route it; it was requeued")]
    NotParked {
        /// The delivery's tag on its channel.
        delivery_tag: u64,
    },
}

/// The queue deliveries come from: its name, whether it is a quorum queue, and how its
/// failed deliveries come back. RabbitMQ does not say this in a delivery, and delivery
/// counting needs it: only a quorum queue's `x-delivery-count` is RabbitMQ's own, and
/// `x-death` is read only when failures go through the queue's dead-letter exchange.
///
/// ```
/// use idempotent_runtime::broker::rabbitmq::Queue;
///
/// let orders = Queue::quorum("orders");
/// assert_eq!(orders.name(), "orders");
/// assert!(orders.is_quorum());
/// assert!(!Queue::classic("audit").is_quorum());
/// ```
#[derive(Debug, Clone)]
pub struct Queue {
    name: String,
    quorum: bool,
    parking: Option<Parking>,
}

/// Where a retry topology's dead letters are published.
#[derive(Debug, Clone)]
struct Parking {
    channel: Channel,
    exchange: String,
    routing_key: String,
}

impl Queue {
    /// A classic queue: RabbitMQ does not count its redeliveries.
    pub fn classic(name: impl Into<String>) -> Queue {
        Queue {
            name: name.into(),
            quorum: false,
            parking: None,
        }
    }

    /// A quorum queue (`x-queue-type: quorum`): RabbitMQ counts the times a message was
    /// returned to it in `x-delivery-count`.
    pub fn quorum(name: impl Into<String>) -> Queue {
        Queue {
            name: name.into(),
            quorum: true,
            parking: None,
        }
    }

    /// Failed deliveries are retried through the queue's dead-letter exchange: the queue's
    /// `x-dead-letter-exchange` routes to a retry queue whose `x-message-ttl` is the delay
    /// and whose own dead-letter exchange routes back to this queue.
    ///
    /// A delivery to redeliver is then rejected without requeueing (so RabbitMQ records it in
    /// the message's `x-death` and holds it for the TTL), whatever the [`Redelivery`]'s delays. Every
    /// redelivery goes this way, idempotency outcomes included (another owner at work, a
    /// store outage), so each counts as a delivery, as every requeue does on a quorum queue.
    /// A delivery to dead-letter is published unchanged to `park_exchange` with
    /// `park_routing_key` on `channel` (put in confirm mode if it is not), and acknowledged
    /// once RabbitMQ confirmed it; a publication RabbitMQ refuses or cannot route
    /// ([`Error::NotParked`]) requeues the delivery instead.
    ///
    /// RabbitMQ keeps an `x-death` header a publisher sent and adds its own counts to it, so
    /// in this topology a publisher that can write to the queue can have a message parked
    /// early (never lost). Without it, `x-death` is not read at all.
    ///
    /// ```no_run
    /// use idempotent_runtime::broker::rabbitmq::{lapin::Channel, Queue};
    ///
    /// # fn queue(channel: Channel) -> Queue {
    /// // orders --(dead-letter exchange)--> orders.retry (TTL 5 s) --> orders;
    /// // dead letters go to orders.parked through the default exchange.
    /// Queue::classic("orders").retry_through_dead_letter_exchange(channel, "", "orders.parked")
    /// # }
    /// ```
    pub fn retry_through_dead_letter_exchange(
        mut self,
        channel: Channel,
        park_exchange: &str,
        park_routing_key: &str,
    ) -> Queue {
        self.parking = Some(Parking {
            channel,
            exchange: park_exchange.to_owned(),
            routing_key: park_routing_key.to_owned(),
        });
        self
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether it is a quorum queue.
    pub fn is_quorum(&self) -> bool {
        self.quorum
    }
}

/// Which delivery of its message this is from `queue`, counting from 1 and counting only
/// the failed deliveries RabbitMQ itself recorded for `queue`: returns to a quorum queue
/// (its `x-delivery-count`, trusted on a redelivery, when RabbitMQ sets it) and, in a
/// [retry topology](Queue::retry_through_dead_letter_exchange), the times `queue` rejected
/// the message (the `count` of its `x-death` entry for `queue` with reason `rejected`).
/// `None` for a redelivery whose returns RabbitMQ does not count (on a classic queue).
///
/// A publisher's `x-delivery-count` is never read on a classic queue, nor before the first
/// return on a quorum queue; `x-death` entries of other queues or reasons (the retry
/// queue's `expired`, say) are not deliveries of `queue`.
///
/// ```
/// use idempotent_runtime::broker::rabbitmq::{deliveries, lapin, Queue};
/// use lapin::{message::Delivery, types::{AMQPValue, FieldTable}, BasicProperties};
///
/// let with = |redelivered, name: &str, value| {
///     let mut delivery = Delivery::mock(1, "".into(), "orders".into(), redelivered, b"{}".to_vec());
///     let mut headers = FieldTable::default();
///     headers.insert(name.into(), value);
///     delivery.properties = BasicProperties::default().with_headers(headers);
///     delivery
/// };
/// let (classic, quorum) = (Queue::classic("orders"), Queue::quorum("orders"));
///
/// // A quorum queue's count is RabbitMQ's on a redelivery: the third delivery.
/// let again = with(true, "x-delivery-count", AMQPValue::LongLongInt(2));
/// assert_eq!(deliveries(&again, &quorum), Some(3));
/// // On a classic queue the header can only be a publisher's: not read.
/// assert_eq!(deliveries(&again, &classic), None);
/// let forged = with(false, "x-delivery-count", AMQPValue::LongLongInt(1_000_000));
/// assert_eq!(deliveries(&forged, &classic), Some(1));
/// assert_eq!(deliveries(&forged, &quorum), Some(1));
/// ```
pub fn deliveries(delivery: &Delivery, queue: &Queue) -> Option<u32> {
    let headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(FieldTable::inner);
    let header = |name: &str| headers.and_then(|headers| headers.get(name));
    // Returns to the queue since the message last entered it.
    let returned = if !delivery.redelivered {
        0
    } else if queue.quorum {
        header("x-delivery-count").and_then(count)?
    } else {
        return None;
    };
    // Rejections by the queue, each followed by a trip through the retry queue.
    let rejected = match (&queue.parking, header("x-death")) {
        (Some(_), Some(AMQPValue::FieldArray(deaths))) => deaths
            .as_slice()
            .iter()
            .filter_map(|death| match death {
                AMQPValue::FieldTable(death) => rejections(death, &queue.name),
                _ => None,
            })
            .max()
            .unwrap_or(0),
        _ => 0,
    };
    Some(attempt(returned.saturating_add(rejected)))
}

/// The count of an `x-death` entry recording that `queue` rejected the message.
fn rejections(death: &FieldTable, queue: &str) -> Option<u64> {
    let death = death.inner();
    let is = |field: &str, expected: &str| match death.get(field) {
        Some(AMQPValue::LongString(value)) => value.as_bytes() == expected.as_bytes(),
        _ => false,
    };
    if is("queue", queue) && is("reason", "rejected") {
        death.get("count").and_then(count)
    } else {
        None
    }
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
/// `basic.nack` with requeue after holding it for the [`Redelivery`]'s delay; or `basic.reject`
/// without requeue (to the queue's dead-letter exchange). In a
/// [retry topology](Queue::retry_through_dead_letter_exchange) a delivery to redeliver is
/// rejected at once, and one to dead-letter is parked, then acknowledged. `queue` is the
/// queue `delivery` came from. Returns what it did.
///
/// Call it only after the handler returned: the effect is applied (or known to be) before
/// the message is acknowledged.
///
/// # Errors
///
/// [`Error::Amqp`] when the channel failed while settling, [`Error::Unsettled`] when the
/// delivery can no longer be settled (its channel closed, or it was settled before),
/// [`Error::NotParked`] when a dead letter could not be parked. Either way RabbitMQ
/// redelivers the message if it was not acknowledged.
///
/// ```no_run
/// use idempotent_runtime::broker::{rabbitmq, Redelivery};
/// use rabbitmq::{lapin::message::Delivery, Queue};
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn on_delivery(delivery: Delivery, queue: &Queue, redelivery: &Redelivery) -> Result<(), rabbitmq::Error> {
///     let result = apply(&delivery.data).await;
///     let decision = rabbitmq::settle(&delivery, queue, &result, redelivery).await?;
///     println!("delivery {} -> {decision}", delivery.delivery_tag);
///     Ok(())
/// }
/// ```
pub async fn settle<T, E: Settle>(
    delivery: &Delivery,
    queue: &Queue,
    result: &Result<T, E>,
    redelivery: &Redelivery,
) -> Result<Decision, Error> {
    let decision = redelivery.decide(result, deliveries(delivery, queue));
    match decision {
        Decision::Ack => ack(delivery).await?,
        Decision::Redeliver { delay } => redeliver(delivery, queue, delay).await?,
        Decision::DeadLetter => dead_letter(delivery, queue).await?,
    }
    Ok(decision)
}

/// A delivery together with the [`Queue`] it came from: what [`consume`] hands its handler,
/// and the [`Delivery`](super::Delivery) it settles. It dereferences to the lapin
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

impl super::Delivery for Message {
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
        &self.queue.name
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

async fn ack(delivery: &Delivery) -> Result<(), Error> {
    let settled = delivery.acker.ack(BasicAckOptions::default()).await?;
    settled_or_not(settled, delivery)
}

async fn redeliver(delivery: &Delivery, queue: &Queue, delay: Duration) -> Result<(), Error> {
    let settled = if queue.parking.is_some() {
        // Through the dead-letter exchange to the retry queue, which holds it for its TTL.
        delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await?
    } else {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        delivery.acker.nack(requeue()).await?
    };
    settled_or_not(settled, delivery)
}

async fn dead_letter(delivery: &Delivery, queue: &Queue) -> Result<(), Error> {
    let settled = match &queue.parking {
        Some(parking) => match park(parking, &delivery.data, &delivery.properties).await {
            Ok(true) => delivery.acker.ack(BasicAckOptions::default()).await?,
            parked => {
                // Not lost: back to the queue, to be parked on a later delivery.
                delivery.acker.nack(requeue()).await?;
                return Err(parked.err().unwrap_or(Error::NotParked {
                    delivery_tag: delivery.delivery_tag,
                }));
            }
        },
        None => {
            delivery
                .acker
                .reject(BasicRejectOptions { requeue: false })
                .await?
        }
    };
    settled_or_not(settled, delivery)
}

fn settled_or_not(settled: bool, delivery: &Delivery) -> Result<(), Error> {
    if settled {
        Ok(())
    } else {
        Err(Error::Unsettled {
            delivery_tag: delivery.delivery_tag,
        })
    }
}

fn requeue() -> BasicNackOptions {
    BasicNackOptions {
        multiple: false,
        requeue: true,
    }
}

/// Publishes a dead letter to the parking queue and waits for RabbitMQ's confirmation;
/// `false` when RabbitMQ refused it or could not route it.
async fn park(parking: &Parking, data: &[u8], properties: &BasicProperties) -> Result<bool, Error> {
    if !parking.channel.status().confirm() {
        parking
            .channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
    }
    let mandatory = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    let confirmation = parking
        .channel
        .basic_publish(
            parking.exchange.as_str().into(),
            parking.routing_key.as_str().into(),
            mandatory,
            data,
            properties.clone(),
        )
        .await?
        .await?;
    Ok(match confirmation {
        Confirmation::Ack(returned) => returned.is_none(),
        Confirmation::Nack(_) | Confirmation::NotRequested => false,
    })
}

/// Runs `handler` on every delivery of `consumer`, which reads `queue`, at most
/// `concurrency` at once (at least one), and settles each delivery from its outcome as
/// [`settle`] does, until the consumer ends or `stop` completes: the [`consume`](super::consume)
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
    if consumer.queue().as_str() != queue.name {
        tracing::warn!(
            consumer = %consumer.queue(),
            queue = %queue.name,
            "the consumer reads another queue than the one its deliveries are counted for"
        );
    }
    let queue = Arc::new(queue);
    let messages = consumer.map(move |delivery| match delivery {
        Ok(delivery) => Ok(Message::new(delivery, queue.clone())),
        Err(err) => Err(Error::Amqp(err)),
    });
    super::consume(messages, concurrency, redelivery, stop, handler).await
}
