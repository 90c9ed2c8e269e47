//! NATS JetStream consumers through async-nats: pull consumers with explicit acks.
//!
//! [`settle`] acknowledges, naks (with a delay) or terminates one message from its handler's
//! outcome (see the [table](super)); [`consume`] runs a handler over a pull consumer with
//! bounded concurrency and settles every message. For batches, fetch messages, run them
//! through [`Idempotency::run_batch`](crate::Idempotency::run_batch) and [`settle`] each with its own result.
//!
//! ```no_run
//! use idempotent_runtime::broker::{nats, Redelivery};
//! use nats::async_nats::jetstream::{self, consumer::{pull, AckPolicy}};
//!
//! # async fn on_order(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let client = nats::async_nats::connect("127.0.0.1:4222").await?;
//! let js = jetstream::new(client);
//! let stream = js.get_stream("ORDERS").await?;
//! let consumer = stream
//!     .get_or_create_consumer("kitchen", pull::Config {
//!         durable_name: Some("kitchen".into()),
//!         ack_policy: AckPolicy::Explicit,
//!         ..Default::default()
//!     })
//!     .await?;
//!
//! // Up to 50 handlers at once, until Ctrl-C.
//! let stop = async { let _ = tokio::signal::ctrl_c().await; };
//! let summary = nats::consume(&consumer, 50, Redelivery::new(), stop, |message| async move {
//!     on_order(&message.payload).await
//! })
//! .await?;
//! println!("acked {}, redelivered {}", summary.acked, summary.redelivered);
//! # Ok(()) }
//! ```
//!
//! # Consumers
//!
//! - **Acks** must be explicit (`AckPolicy::Explicit`), so a message is acknowledged only
//!   after its effect.
//! - **Dead letters**: a terminated message (`+TERM`) is not redelivered; the server
//!   publishes a `$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED` advisory with its stream
//!   sequence, which an operator's tool can subscribe to (or copy the message to a
//!   dead-letter stream).
//! - **Delivery counts** come from the message's metadata (`delivered`). Keep the consumer's
//!   `max_deliver` above [`Redelivery::max_deliveries`] (or unlimited), so the server does not
//!   stop redelivering first.
//! - **`ack_wait`** longer than the handler's usual running time: a message not acknowledged
//!   within it is redelivered while its handler still runs, and the redelivery is answered
//!   with [`Error::InProgress`](crate::Error::InProgress) (nak with delay).
//! - **Crashes**: a message of a dead consumer is redelivered after `ack_wait`; its claim is
//!   taken over when its lease runs out, or answered by the handler's `done` check.
//! - Acks are published without waiting for the server; flush the client before the process
//!   exits. A lost ack only means a redelivery, which is filtered as a duplicate.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::{MessagesError, MessagesErrorKind};
use async_nats::jetstream::consumer::{PullConsumer, StreamError};
use async_nats::jetstream::{AckKind, Message};
use futures_util::StreamExt;

use super::{Decision, Redelivery, Settle, Summary};

/// The async-nats crate this module speaks, re-exported so its types match.
pub use async_nats;

/// Errors of the NATS JetStream integration.
///
/// None loses a message: a message that was not acknowledged is redelivered by JetStream
/// after the consumer's `ack_wait`.
///
/// ```
/// use idempotent_runtime::broker::nats::Error;
///
/// let err = Error::NotJetStream;
/// assert!(err.to_string().starts_with("not a JetStream message"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The message has no JetStream reply subject, so it cannot be acknowledged: it did not
    /// come from a JetStream consumer.
    #[error("not a JetStream message: it has no `$JS.ACK` reply subject")]
    NotJetStream,
    /// Sending the ack, nak or term failed (the connection is closed, say). The server
    /// redelivers the message after `ack_wait`.
    #[error("could not settle a JetStream message")]
    Ack(#[source] async_nats::Error),
    /// The pull subscription could not be started.
    #[error("could not start pulling messages")]
    Pull(#[from] StreamError),
    /// Pulling messages failed for good (the consumer was deleted, say).
    #[error("pulling messages failed")]
    Messages(#[from] MessagesError),
}

/// Which delivery of its message this is, counting from 1 (JetStream's `delivered`), or
/// `None` for a message without JetStream metadata.
///
/// ```no_run
/// use idempotent_runtime::broker::nats::{self, async_nats::jetstream::Message};
///
/// fn log(message: &Message) {
///     if nats::deliveries(message).is_some_and(|n| n > 1) {
///         println!("redelivered: {}", message.subject);
///     }
/// }
/// ```
pub fn deliveries(message: &Message) -> Option<u32> {
    let info = message.info().ok()?;
    u32::try_from(info.delivered.max(1)).ok()
}

/// Settles `message` from its handler's `result`, per the [table](super): `+ACK`; `-NAK`
/// with the [`Redelivery`]'s delay; or `+TERM`. Returns what it did.
///
/// Call it only after the handler returned: the effect is applied (or known to be) before
/// the message is acknowledged.
///
/// # Errors
///
/// [`Error::NotJetStream`] for a message that did not come from a JetStream consumer;
/// [`Error::Ack`] when the ack could not be sent (the server then redelivers the message
/// after `ack_wait`).
///
/// ```no_run
/// use idempotent_runtime::broker::{nats, Redelivery};
/// use nats::async_nats::jetstream::Message;
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn on_message(message: Message, redelivery: &Redelivery) -> Result<(), nats::Error> {
///     let result = apply(&message.payload).await;
///     let decision = nats::settle(&message, &result, redelivery).await?;
///     println!("{} -> {decision}", message.subject);
///     Ok(())
/// }
/// ```
pub async fn settle<T, E: Settle>(
    message: &Message,
    result: &Result<T, E>,
    redelivery: &Redelivery,
) -> Result<Decision, Error> {
    if message.reply.is_none() {
        return Err(Error::NotJetStream);
    }
    let decision = redelivery.decide(result, deliveries(message));
    super::consume::apply(message, decision).await?;
    Ok(decision)
}

impl super::Delivery for Message {
    type Error = Error;

    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn deliveries(&self) -> Option<u32> {
        deliveries(self)
    }

    fn system(&self) -> &'static str {
        "nats"
    }

    fn destination(&self) -> &str {
        self.subject.as_str()
    }

    /// `+ACK`.
    async fn ack(&self) -> Result<(), Error> {
        ack_with(self, AckKind::Ack).await
    }

    /// `-NAK` with `delay` (none when it is zero).
    async fn redeliver(&self, delay: Duration) -> Result<(), Error> {
        let delay = (!delay.is_zero()).then_some(delay);
        ack_with(self, AckKind::Nak(delay)).await
    }

    /// `+TERM`.
    async fn dead_letter(&self) -> Result<(), Error> {
        ack_with(self, AckKind::Term).await
    }
}

async fn ack_with(message: &Message, kind: AckKind) -> Result<(), Error> {
    if message.reply.is_none() {
        return Err(Error::NotJetStream);
    }
    message.ack_with(kind).await.map_err(Error::Ack)
}

/// Runs `handler` on the messages of a pull `consumer`, at most `concurrency` at once (at
/// least one), and settles each message from its outcome as [`settle`] does, until `stop`
/// completes: the [`consume`](fn@super::consume) loop over JetStream messages. A handler that
/// panics is treated as the handler's own error (its claim is given back by the engine).
///
/// When `stop` completes, no new message is started; handlers in flight finish and are
/// settled, then the call returns. Messages pulled but not yet started are left
/// unacknowledged and redelivered after the consumer's `ack_wait`. Dropping the returned
/// future instead cancels the handlers in flight (the engine gives their claims back); their
/// messages are redelivered after `ack_wait`.
///
/// # Errors
///
/// [`Error::Pull`] when pulling cannot start; [`Error::Messages`] when it fails for good
/// (the consumer was deleted). Transient pull errors (a missed heartbeat, a server
/// restarting) are logged and pulling goes on.
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::broker::{nats, Redelivery};
/// use nats::async_nats::jetstream::consumer::PullConsumer;
///
/// # async fn apply(_: &[u8]) -> Result<(), idempotent_runtime::Error> { Ok(()) }
/// async fn run(consumer: PullConsumer) -> Result<(), nats::Error> {
///     // Consume for a minute.
///     let stop = tokio::time::sleep(Duration::from_secs(60));
///     let summary = nats::consume(&consumer, 8, Redelivery::new(), stop, |message| async move {
///         apply(&message.payload).await
///     })
///     .await?;
///     println!("{summary:?}");
///     Ok(())
/// }
/// ```
pub async fn consume<S, F, Fut, T, E>(
    consumer: &PullConsumer,
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
    let concurrency = concurrency.max(1);
    let messages = consumer
        .stream()
        .max_messages_per_batch(concurrency)
        .expires(Duration::from_secs(30))
        .heartbeat(Duration::from_secs(15))
        .messages()
        .await?
        .filter_map(|next| {
            std::future::ready(match next {
                Ok(message) => Some(Ok(message)),
                Err(err) => match err.kind() {
                    MessagesErrorKind::ConsumerDeleted
                    | MessagesErrorKind::PushBasedConsumer
                    | MessagesErrorKind::RequestLimitExceeded => Some(Err(Error::Messages(err))),
                    _ => {
                        tracing::warn!(error = %err, "pulling messages failed; retrying");
                        None
                    }
                },
            })
        });
    super::consume(messages, concurrency, redelivery, stop, handler).await
}
