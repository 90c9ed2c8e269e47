//! The RabbitMQ integration's errors.

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
    /// could not route it (see
    /// [`Queue::retry_through_dead_letter_exchange`](super::Queue::retry_through_dead_letter_exchange)).
    /// The delivery was requeued, and is parked on a later delivery once its parking queue
    /// takes it.
    #[error("delivery {delivery_tag} could not be parked: RabbitMQ refused or could not route it; it was requeued")]
    NotParked {
        /// The delivery's tag on its channel.
        delivery_tag: u64,
    },
}
