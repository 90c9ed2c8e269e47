//! Publishing outbox messages to NATS JetStream, acknowledged by the stream.

use async_nats::connection::State;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::Context;
use async_nats::HeaderMap;

use crate::outbox::{OutboxMessage, PublishError};
use crate::store::BoxFuture;

/// Publishes to NATS JetStream, the message's destination as the subject, and resolves once
/// the stream acknowledged it. Each message carries the outbox id as `Nats-Msg-Id` (so the
/// stream's own duplicate window drops a second publication of it), the event type as
/// `Outbox-Event-Type`, and the headers.
///
/// The client reconnects on its own (build it with `retry_on_initial_connect` so a relay
/// starts while the server is down). Every publication is bounded by the context's timeout
/// (`Context::set_timeout`, 5 s by default). A publication that meets a disconnected client,
/// times out or loses its connection is reported
/// [unavailable](PublishError::unavailable): the relay does not count the attempt (the
/// client may still send it after reconnecting; the stream's duplicate window drops a second
/// copy of the same `Nats-Msg-Id`).
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
            let unavailable = |kind: PublishErrorKind| {
                matches!(
                    kind,
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe
                ) || self.jetstream.client().connection_state() != State::Connected
            };
            let ack = self
                .jetstream
                .publish_with_headers(
                    message.destination.clone(),
                    headers,
                    message.payload.clone().into(),
                )
                .await
                .map_err(|e| {
                    let down = unavailable(e.kind());
                    let err = PublishError::with_source("JetStream refused the publish", e);
                    if down {
                        err.as_unavailable()
                    } else {
                        err
                    }
                })?;
            ack.await.map_err(|e| {
                let down = unavailable(e.kind());
                let err = PublishError::with_source("JetStream did not acknowledge", e);
                if down {
                    err.as_unavailable()
                } else {
                    err
                }
            })?;
            Ok(())
        })
    }
}
