//! Publishing outbox messages to RabbitMQ with publisher confirms, reconnecting when the
//! connection is lost.

use std::fmt;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;
use tokio::time::{timeout, Instant};

use crate::outbox::{OutboxMessage, PublishError};
use crate::store::BoxFuture;

/// Publishes to an exchange of RabbitMQ with publisher confirms, the message's destination as
/// the routing key. Each message is persistent (`delivery_mode` 2), mandatory (an unroutable
/// message is a failure, not a silent drop), and carries the outbox id as `message_id`, the
/// event type as `type` and the headers as AMQP headers; `publish` resolves once the broker
/// acknowledged it.
///
/// [`Publisher::connect`] connects at the first publication and again, with backoff, whenever
/// the connection is lost (a new connection and channel, confirms enabled again), so a relay
/// starts while the broker is down and publishes once it is back. A broker that cannot be
/// reached, or does not confirm within [`confirm_timeout`](Publisher::confirm_timeout), is
/// reported [unavailable](PublishError::unavailable): the relay does not count the attempt.
///
/// ```no_run
/// use idempotent_runtime::outbox::{rabbitmq, Outbox, OutboxDialect, Relay};
/// # fn f<DB: OutboxDialect>(outbox: Outbox<DB>) -> Result<(), Box<dyn std::error::Error>> {
/// let publisher = rabbitmq::Publisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f", "orders")?;
/// let relay = Relay::new(outbox, publisher);
/// # Ok(()) }
/// ```
pub struct Publisher {
    target: Target,
    exchange: ShortString,
    confirm_timeout: Duration,
    connect_timeout: Duration,
    first_backoff: Duration,
    max_backoff: Duration,
    link: Mutex<Link>,
}

enum Target {
    /// A channel the application opened: used as is, never reopened.
    Channel,
    /// A broker to connect (and reconnect) to.
    Uri(String, ConnectionProperties),
}

#[derive(Default)]
struct Link {
    connection: Option<Connection>,
    channel: Option<Channel>,
    failures: u32,
    retry_at: Option<Instant>,
}

impl fmt::Debug for Publisher {
    // Not the URI: it may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("exchange", &self.exchange.as_str())
            .field("reconnects", &matches!(self.target, Target::Uri(..)))
            .finish_non_exhaustive()
    }
}

fn short(field: &str, value: &str) -> Result<ShortString, PublishError> {
    ShortString::try_new(value).map_err(|_| {
        PublishError::new(format!(
            "the message's {field} is {} bytes, more than the 255 AMQP carries",
            value.len()
        ))
    })
}

impl Publisher {
    /// A publisher to `exchange` (`""`: the default exchange, where the routing key is the
    /// queue's name) of the broker at `uri` (`amqp://user:password@host:5672/%2f`), with
    /// lapin's default connection properties. Nothing is connected until the first
    /// publication.
    ///
    /// # Errors
    ///
    /// An exchange name over 255 bytes.
    pub fn connect(uri: impl Into<String>, exchange: &str) -> Result<Publisher, PublishError> {
        Publisher::connect_with(uri, ConnectionProperties::default(), exchange)
    }

    /// [`connect`](Publisher::connect) with `properties` (a connection name, TLS settings).
    ///
    /// # Errors
    ///
    /// An exchange name over 255 bytes.
    pub fn connect_with(
        uri: impl Into<String>,
        properties: ConnectionProperties,
        exchange: &str,
    ) -> Result<Publisher, PublishError> {
        Ok(Publisher::build(
            Target::Uri(uri.into(), properties),
            short("exchange", exchange)?,
        ))
    }

    /// Puts `channel` in confirm mode and publishes to `exchange` on it. The channel is the
    /// application's: once its connection is lost every publication fails as unavailable
    /// until the application builds a new publisher. Prefer [`connect`](Publisher::connect),
    /// which reconnects.
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
        let publisher = Publisher::build(Target::Channel, exchange);
        publisher.link.lock().await.channel = Some(channel);
        Ok(publisher)
    }

    fn build(target: Target, exchange: ShortString) -> Publisher {
        Publisher {
            target,
            exchange,
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            link: Mutex::new(Link::default()),
        }
    }

    /// How long a publication waits for the broker's confirm (10 s by default); past it the
    /// broker is taken as unreachable and the connection is opened again.
    pub fn confirm_timeout(mut self, wait: Duration) -> Self {
        self.confirm_timeout = wait;
        self
    }

    /// How long opening a connection and a channel may take (10 s by default).
    pub fn connect_timeout(mut self, wait: Duration) -> Self {
        self.connect_timeout = wait;
        self
    }

    /// The wait before connecting again after a failed connection, doubling per failure up
    /// to `max` (100 ms to 10 s by default); publications in between fail at once as
    /// unavailable.
    pub fn reconnect_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The channel to publish on: the open one, or a new connection and channel in confirm
    /// mode once the backoff allows.
    async fn channel(&self) -> Result<Channel, PublishError> {
        let mut link = self.link.lock().await;
        if let Some(channel) = &link.channel {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        let Target::Uri(uri, properties) = &self.target else {
            return Err(PublishError::unavailable(
                "the RabbitMQ channel is closed (a publisher built on a channel does not reconnect)",
            ));
        };
        link.channel = None;
        if let Some(connection) = link.connection.take() {
            drop_connection(connection);
        }
        if let Some(at) = link.retry_at {
            if Instant::now() < at {
                return Err(PublishError::unavailable(
                    "RabbitMQ is unreachable; waiting to connect again",
                ));
            }
        }
        let opened = timeout(self.connect_timeout, async {
            let connection = Connection::connect(uri, properties.clone()).await?;
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>((connection, channel))
        })
        .await;
        match opened {
            Ok(Ok((connection, channel))) => {
                link.failures = 0;
                link.retry_at = None;
                link.connection = Some(connection);
                link.channel = Some(channel.clone());
                Ok(channel)
            }
            failed => {
                link.failures = link.failures.saturating_add(1);
                let doublings = (link.failures - 1).min(30);
                let wait = self
                    .first_backoff
                    .saturating_mul(1 << doublings)
                    .min(self.max_backoff);
                link.retry_at = Some(Instant::now() + wait);
                let why = match failed {
                    Ok(Err(err)) => err.to_string(),
                    _ => format!("no answer within {:?}", self.connect_timeout),
                };
                Err(PublishError::unavailable(format!(
                    "cannot connect to RabbitMQ: {why}"
                )))
            }
        }
    }

    /// Forgets `channel` (and its connection) if it is still the one in use: the next
    /// publication opens new ones.
    async fn reset(&self, channel: &Channel) {
        let mut link = self.link.lock().await;
        if matches!(self.target, Target::Uri(..))
            && link.channel.as_ref().map(Channel::id) == Some(channel.id())
        {
            link.channel = None;
            if let Some(connection) = link.connection.take() {
                drop_connection(connection);
            }
        }
    }

    async fn send(&self, message: &OutboxMessage) -> Result<(), PublishError> {
        // Short strings: a row another producer wrote may not fit (`From` would panic).
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
        let channel = self.channel().await?;
        let sent = timeout(self.confirm_timeout, async {
            channel
                .basic_publish(
                    self.exchange.clone(),
                    routing_key,
                    options,
                    &message.payload,
                    properties,
                )
                .await?
                .await
        })
        .await;
        let confirm = match sent {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(err)) => {
                let connected = self
                    .link
                    .lock()
                    .await
                    .connection
                    .as_ref()
                    .is_some_and(|c| c.status().connected());
                self.reset(&channel).await;
                let err = PublishError::with_source("RabbitMQ did not take the message", err);
                // A channel the broker closed over this message (its connection still up) is
                // the message's failure; a lost connection is not.
                return Err(if connected && matches!(self.target, Target::Uri(..)) {
                    err
                } else {
                    err.as_unavailable()
                });
            }
            Err(_) => {
                self.reset(&channel).await;
                return Err(PublishError::unavailable(format!(
                    "RabbitMQ did not confirm within {:?}",
                    self.confirm_timeout
                )));
            }
        };
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
    }
}

/// Closes a connection that is being replaced, in the background and bounded: a connection
/// to a broker that does not answer must not hold up the next one.
fn drop_connection(connection: Connection) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ = timeout(
                Duration::from_secs(1),
                connection.close(320, "outbox publisher reconnecting".into()),
            )
            .await;
        });
    }
}

impl crate::outbox::Publisher for Publisher {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(self.send(message))
    }
}
