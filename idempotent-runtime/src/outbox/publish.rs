//! What the relay publishes through: a broker client that says when the broker has the
//! message.

use crate::outbox::OutboxMessage;
use crate::store::BoxFuture;

/// Why a publication failed: the relay records it on the row and tries again later (or
/// dead-letters the row after its last attempt).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
#[non_exhaustive]
pub struct PublishError {
    message: String,
    unavailable: bool,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl PublishError {
    /// An error with `message`.
    pub fn new(message: impl Into<String>) -> PublishError {
        PublishError {
            message: message.into(),
            unavailable: false,
            source: None,
        }
    }

    /// The broker cannot be reached (the connection is down, it does not answer): not the
    /// message's fault, so the relay gives the row back without counting the attempt, and
    /// leaves the rest of its batch for when the broker is back.
    ///
    /// ```
    /// use idempotent_runtime::outbox::PublishError;
    /// assert!(PublishError::unavailable("connection refused").is_unavailable());
    /// assert!(!PublishError::new("nacked").is_unavailable());
    /// ```
    pub fn unavailable(message: impl Into<String>) -> PublishError {
        PublishError {
            message: message.into(),
            unavailable: true,
            source: None,
        }
    }

    /// Marks the error as [`unavailable`](PublishError::unavailable).
    pub fn as_unavailable(mut self) -> PublishError {
        self.unavailable = true;
        self
    }

    /// Whether the broker could not be reached, rather than refusing this message.
    pub fn is_unavailable(&self) -> bool {
        self.unavailable
    }

    /// An error with `message`, caused by `source`.
    pub fn with_source(
        message: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> PublishError {
        PublishError {
            message: message.into(),
            unavailable: false,
            source: Some(Box::new(source)),
        }
    }
}

/// A broker client the [`Relay`](crate::outbox::Relay) publishes through. `publish` resolves
/// once the broker has **confirmed** the message (a RabbitMQ publisher confirm, a JetStream
/// ack): the relay marks the row published only then. It sends `message.id` as the broker's
/// message id.
///
/// Implemented for RabbitMQ ([`rabbitmq::Publisher`](crate::outbox::rabbitmq::Publisher),
/// feature `rabbitmq`) and NATS JetStream ([`nats::Publisher`](crate::outbox::nats::Publisher),
/// feature `nats`); implement it for another broker.
pub trait Publisher: Send + Sync {
    /// Publishes `message` and waits for the broker's confirmation.
    fn publish<'a>(&'a self, message: &'a OutboxMessage)
        -> BoxFuture<'a, Result<(), PublishError>>;
}
