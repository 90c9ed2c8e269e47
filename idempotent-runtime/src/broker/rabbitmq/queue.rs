//! The queue deliveries come from, and how its deliveries are counted.

use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;

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
    pub(super) parking: Option<Parking>,
}

/// Where a retry topology's dead letters are published.
#[derive(Debug, Clone)]
pub(super) struct Parking {
    pub(super) channel: Channel,
    pub(super) exchange: String,
    pub(super) routing_key: String,
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
    /// the message's `x-death` and holds it for the TTL), whatever the [`Redelivery`](crate::broker::Redelivery)'s delays. Every
    /// redelivery goes this way, idempotency outcomes included (another owner at work, a
    /// store outage), so each counts as a delivery, as every requeue does on a quorum queue.
    /// A delivery to dead-letter is published unchanged to `park_exchange` with
    /// `park_routing_key` on `channel` (put in confirm mode if it is not), and acknowledged
    /// once RabbitMQ confirmed it; a publication RabbitMQ refuses or cannot route
    /// ([`Error::NotParked`](super::Error::NotParked)) requeues the delivery instead.
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
