//! Publishing outbox messages to RabbitMQ with publisher confirms.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::Confirmation;
use lapin::{BasicProperties, Channel};

use crate::outbox::{OutboxMessage, PublishError};
use crate::store::BoxFuture;

/// Publishes to an exchange of a RabbitMQ channel with publisher confirms, the message's
/// destination as the routing key. Each message is persistent (`delivery_mode` 2), mandatory
/// (an unroutable message is a failure, not a silent drop), and carries the outbox id as
/// `message_id`, the event type as `type` and the headers as AMQP headers; `publish`
/// resolves once the broker acknowledged it.
///
/// ```no_run
/// use idempotent_runtime::outbox::{rabbitmq, Outbox, OutboxDialect, Relay};
/// # async fn f<DB: OutboxDialect>(conn: lapin::Connection, outbox: Outbox<DB>) -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = rabbitmq::Publisher::new(conn.create_channel().await?, "orders").await?;
/// let relay = Relay::new(outbox, publisher);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Publisher {
    channel: Channel,
    exchange: ShortString,
}

impl Publisher {
    /// Puts `channel` in confirm mode and publishes to `exchange` (`""`: the default
    /// exchange, where the routing key is the queue's name).
    ///
    /// # Errors
    ///
    /// The channel's error when it refuses confirm mode, or an exchange name over 255 bytes.
    pub async fn new(channel: Channel, exchange: &str) -> Result<Publisher, lapin::Error> {
        let exchange = ShortString::try_new(exchange)
            .map_err(|e| lapin::Error::from(std::io::Error::other(e)))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Publisher { channel, exchange })
    }
}

impl crate::outbox::Publisher for Publisher {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            // Short strings: a row another producer wrote may not fit (`From` would panic).
            let short = |field: &str, value: &str| {
                ShortString::try_new(value).map_err(|_| {
                    PublishError::new(format!(
                        "the message's {field} is {} bytes, more than the 255 AMQP carries",
                        value.len()
                    ))
                })
            };
            let mut headers = FieldTable::default();
            for (name, value) in &message.headers {
                headers.insert(
                    short("header name", name)?,
                    AMQPValue::LongString(LongString::from(value.as_str())),
                );
            }
            let routing_key = short("destination", &message.destination)?;
            let properties = BasicProperties::default()
                .with_message_id(short("id", message.id.as_str())?)
                .with_type(short("event_type", &message.event_type)?)
                .with_delivery_mode(2)
                .with_headers(headers);
            let options = BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            };
            let confirm = self
                .channel
                .basic_publish(
                    self.exchange.clone(),
                    routing_key,
                    options,
                    &message.payload,
                    properties,
                )
                .await
                .map_err(|e| PublishError::with_source("RabbitMQ refused the publish", e))?
                .await
                .map_err(|e| PublishError::with_source("RabbitMQ did not confirm", e))?;
            match confirm {
                Confirmation::Ack(None) => Ok(()),
                Confirmation::Ack(Some(_)) => Err(PublishError::new(format!(
                    "no queue is bound to routing key {:?} on exchange {:?}",
                    message.destination,
                    self.exchange.as_str()
                ))),
                Confirmation::Nack(_) => Err(PublishError::new("RabbitMQ nacked the message")),
                Confirmation::NotRequested => {
                    Err(PublishError::new("the channel is not in confirm mode"))
                }
            }
        })
    }
}
