//! Publishing outbox messages to NATS JetStream, acknowledged by the stream.

use async_nats::jetstream::Context;
use async_nats::HeaderMap;

use crate::outbox::{OutboxMessage, PublishError};
use crate::store::BoxFuture;

/// Publishes to NATS JetStream, the message's destination as the subject, and resolves once
/// the stream acknowledged it. Each message carries the outbox id as `Nats-Msg-Id` (so the
/// stream's own duplicate window drops a second publication of it), the event type as
/// `Outbox-Event-Type`, and the headers.
///
/// ```no_run
/// use idempotent_runtime::outbox::{nats, Outbox, OutboxDialect, Relay};
/// # async fn f<DB: OutboxDialect>(client: async_nats::Client, outbox: Outbox<DB>) {
/// let relay = Relay::new(outbox, nats::Publisher::new(async_nats::jetstream::new(client)));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Publisher {
    jetstream: Context,
}

impl Publisher {
    /// Publishes through `jetstream`.
    pub fn new(jetstream: Context) -> Publisher {
        Publisher { jetstream }
    }
}

impl crate::outbox::Publisher for Publisher {
    fn publish<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(async move {
            let mut headers = HeaderMap::new();
            for (name, value) in &message.headers {
                headers.insert(name.as_str(), value.as_str());
            }
            headers.insert("Nats-Msg-Id", message.id.as_str());
            headers.insert("Outbox-Event-Type", message.event_type.as_str());
            let ack = self
                .jetstream
                .publish_with_headers(
                    message.destination.clone(),
                    headers,
                    message.payload.clone().into(),
                )
                .await
                .map_err(|e| PublishError::with_source("JetStream refused the publish", e))?;
            ack.await
                .map_err(|e| PublishError::with_source("JetStream did not acknowledge", e))?;
            Ok(())
        })
    }
}
