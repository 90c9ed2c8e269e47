//! Message brokers: what to do with a message once its idempotent handler returned.
//!
//! Every outcome of a handler maps to one action. [`Redelivery::decide`] computes it; each
//! broker integration's `settle`, and the `consume` loop they share, apply it. The HTTP
//! column is the status an HTTP endpoint answers the same outcome with (per the IETF
//! `Idempotency-Key` draft where it says):
//!
//! | outcome | [`Action`] | RabbitMQ | NATS JetStream | HTTP |
//! |---|---|---|---|---|
//! | `Ok`: the handler ran and completed (or, with `replay`, the first run's result was replayed) | `Ack` | `basic.ack` | `+ACK` | 2xx: the handler's response (replayed: the stored one, `Idempotent-Replayed: true`) |
//! | [`Error::Duplicate`]: completed before, nothing replayed; or the `done` check says the effect is applied | `Ack` | `basic.ack` | `+ACK` | 409 Conflict |
//! | [`Error::Skipped`]: a live owner, `on_in_progress = skip` | `Ack` | `basic.ack` | `+ACK` | 409 Conflict |
//! | [`Error::InProgress`]: a live owner, `reject` (or `wait` ran out) | `Redeliver` | hold [`in_progress_delay`](Redelivery::in_progress_delay), then `basic.nack(requeue)` | `-NAK` with delay [`in_progress_delay`](Redelivery::in_progress_delay) | 409 Conflict, `Retry-After` |
//! | [`Error::LostOwnership`]: the handler outlived its lease and a newer owner took over | `Redeliver` | hold [`retry_delay`](Redelivery::retry_delay), then `basic.nack(requeue)` | `-NAK` with delay [`retry_delay`](Redelivery::retry_delay) | 409 Conflict, `Retry-After` |
//! | [`Error::Store`]: the store failed; nothing ran, nothing was released | `Redeliver` | hold `retry_delay`, then `basic.nack(requeue)` | `-NAK` with delay `retry_delay` | 503 Service Unavailable, `Retry-After` |
//! | [`Error::NoStore`]: no store configured | `Redeliver` | hold `retry_delay`, then `basic.nack(requeue)` | `-NAK` with delay `retry_delay` | 500 Internal Server Error |
//! | [`Error::NoRuntime`]: a lock taken outside a Tokio runtime | `Redeliver` | hold `retry_delay`, then `basic.nack(requeue)` | `-NAK` with delay `retry_delay` | 500 Internal Server Error |
//! | [`Error::PayloadMismatch`]: same key, different payload | `DeadLetter` | `basic.reject(requeue = false)` | `+TERM` | 422 Unprocessable Content |
//! | [`Error::Held`]: an earlier run failed with `on_error = hold` | `DeadLetter` | `basic.reject(requeue = false)` | `+TERM` | 422 Unprocessable Content |
//! | [`Error::InvalidKey`]: an empty or oversized key part | `DeadLetter` | `basic.reject(requeue = false)` | `+TERM` | 400 Bad Request |
//! | [`Error::Codec`]: a stored result could not be decoded | `DeadLetter` | `basic.reject(requeue = false)` | `+TERM` | 500 Internal Server Error |
//! | the handler's own `Err`, delivery `n` < [`max_deliveries`](Redelivery::max_deliveries) | `Redeliver` | hold `retry_delay`, then `basic.nack(requeue)` | `-NAK` with delay `retry_delay` | the handler's own error response |
//! | the handler's own `Err`, delivery `n` ≥ `max_deliveries`, or [`Settle::is_permanent`] | `DeadLetter` | `basic.reject(requeue = false)` | `+TERM` | the handler's own error response |
//! | the handler panicked (its claim was given back) | as the handler's own `Err` | as the handler's own `Err` | as the handler's own `Err` | 500 Internal Server Error |
//!
//! The delivery count `n` comes from the broker, and only from what the broker records about
//! the consuming queue: on RabbitMQ a quorum queue's `x-delivery-count` on redeliveries, and in
//! a retry topology (`rabbitmq::Queue::retry_through_dead_letter_exchange`) the consuming
//! queue's `x-death` entry with reason `rejected`; a first delivery is 1. A publisher's
//! `x-delivery-count` is never read. On NATS JetStream it is the message's `delivered` count.
//! When the broker cannot tell (a redelivery on a classic RabbitMQ queue), a failing message
//! is redelivered without bound: use a quorum queue or a retry topology to bound it. Outcomes of the idempotency layer (`InProgress`, `Store`, ...) are never
//! dead-lettered for their count: a store outage redelivers until the store is back, so
//! nothing is lost.
//!
//! A handler's error type tells the integrations whether it carries an [`Error`] by
//! implementing [`Settle`].
//!
//! The integrations, each behind its feature, run the same `consume` loop over their
//! messages, each a `Delivery`:
//!
//! - [`rabbitmq`] (`rabbitmq`): lapin, manual acknowledgements.
//! - [`nats`] (`nats`): async-nats, JetStream pull consumers with explicit acks.
//!
//! [`Action`]: crate::Action

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::error::{Action, Error};

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "rabbitmq", feature = "nats"))))]
pub use consume::{consume, Delivery};

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
mod consume;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

/// Lets a handler's error type say whether it carries an idempotency [`Error`], so a broker
/// integration can tell a duplicate (ack) or a store outage (redeliver) from the handler's
/// own failure (redeliver, then dead-letter after [`Redelivery::max_deliveries`]).
///
/// Implemented for [`Error`] itself and for `Box<dyn Error + Send + Sync>` (which looks for
/// an [`Error`] along the source chain). For your own error type, return the wrapped error:
///
/// ```
/// use idempotent_runtime::broker::Settle;
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Idempotency(#[from] idempotent_runtime::Error),
///     #[error("the kitchen service timed out")]
///     KitchenTimeout,
///     #[error("the message is not a valid order")]
///     Malformed,
/// }
///
/// impl Settle for AppError {
///     fn idempotency_error(&self) -> Option<&idempotent_runtime::Error> {
///         match self {
///             AppError::Idempotency(err) => Some(err),
///             _ => None,
///         }
///     }
///     // A malformed message fails the same way on every delivery: dead-letter it at once.
///     fn is_permanent(&self) -> bool {
///         matches!(self, AppError::Malformed)
///     }
/// }
/// ```
pub trait Settle {
    /// The idempotency error this error carries, if any.
    fn idempotency_error(&self) -> Option<&Error>;

    /// Whether this error, when it is the handler's own, fails the same way on every delivery
    /// (a malformed payload, say), so the message is dead-lettered at once instead of after
    /// [`Redelivery::max_deliveries`]. Not asked for idempotency errors. Default: `false`.
    fn is_permanent(&self) -> bool {
        false
    }
}

impl Settle for Error {
    fn idempotency_error(&self) -> Option<&Error> {
        Some(self)
    }
}

impl Settle for Box<dyn StdError + Send + Sync> {
    fn idempotency_error(&self) -> Option<&Error> {
        let mut next: Option<&(dyn StdError + 'static)> = Some(self.as_ref());
        while let Some(err) = next {
            if let Some(found) = err.downcast_ref::<Error>() {
                return Some(found);
            }
            next = err.source();
        }
        None
    }
}

/// What a broker integration does with one message: [`Action`] plus the redelivery delay.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::broker::Decision;
///
/// let retry = Decision::Redeliver { delay: Duration::from_secs(1) };
/// assert_eq!(retry.to_string(), "redeliver in 1s");
/// assert_eq!(Decision::Ack.to_string(), "ack");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Decision {
    /// Acknowledge: the effect is applied (now or before).
    Ack,
    /// Give the message back to be delivered again after about `delay`.
    Redeliver {
        /// How long the message should wait before it is delivered again.
        delay: Duration,
    },
    /// Route the message to the dead-letter queue (RabbitMQ) or stop its redelivery (NATS).
    DeadLetter,
}

impl Decision {
    /// The [`Action`] this decision carries out.
    ///
    /// ```
    /// use idempotent_runtime::{broker::Decision, Action};
    ///
    /// assert_eq!(Decision::DeadLetter.action(), Action::DeadLetter);
    /// ```
    pub fn action(&self) -> Action {
        match self {
            Decision::Ack => Action::Ack,
            Decision::Redeliver { .. } => Action::Redeliver,
            Decision::DeadLetter => Action::DeadLetter,
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Ack => f.write_str("ack"),
            Decision::Redeliver { delay } if delay.is_zero() => f.write_str("redeliver"),
            Decision::Redeliver { delay } => write!(f, "redeliver in {delay:?}"),
            Decision::DeadLetter => f.write_str("dead-letter"),
        }
    }
}

/// How outcomes become [`Decision`]s: how often a failing handler is retried and how long a
/// redelivered message waits. (The engine's policies, `OnInProgress`, `OnError` and the like,
/// decide what a call does; this one decides what becomes of the message afterwards.)
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::broker::{Decision, Redelivery};
/// use idempotent_runtime::{Error, Key};
///
/// let redelivery = Redelivery::new()
///     .max_deliveries(3)
///     .retry_delay(Duration::from_millis(500))
///     .in_progress_delay(Duration::from_millis(200));
///
/// // The handler's own error: redeliver until the third delivery, then dead-letter.
/// let failed: Result<(), Box<dyn std::error::Error + Send + Sync>> = Err("timeout".into());
/// assert_eq!(redelivery.decide(&failed, Some(1)),
///            Decision::Redeliver { delay: Duration::from_millis(500) });
/// assert_eq!(redelivery.decide(&failed, Some(3)), Decision::DeadLetter);
///
/// // A duplicate is acknowledged, whatever the count.
/// let key = Key::new("order:consume", 1, &[&"A-1"]).unwrap();
/// let duplicate: Result<(), Error> = Err(Error::Duplicate { key });
/// assert_eq!(redelivery.decide(&duplicate, Some(9)), Decision::Ack);
/// ```
#[derive(Debug, Clone)]
pub struct Redelivery {
    max_deliveries: u32,
    retry_delay: Duration,
    in_progress_delay: Duration,
}

impl Default for Redelivery {
    fn default() -> Redelivery {
        Redelivery {
            max_deliveries: 5,
            retry_delay: Duration::from_secs(1),
            in_progress_delay: Duration::from_secs(1),
        }
    }
}

impl Redelivery {
    /// The defaults: a handler's own error is retried until the 5th delivery; redeliveries
    /// wait 1 second.
    pub fn new() -> Redelivery {
        Redelivery::default()
    }

    /// The delivery on which a handler's own error dead-letters the message instead of
    /// redelivering it (at least 1; default 5). Idempotency outcomes are never dead-lettered
    /// for their count.
    ///
    /// On NATS JetStream, keep the consumer's `max_deliver` above it (or unlimited), so the
    /// server does not stop redelivering first; on a RabbitMQ quorum queue with
    /// `x-delivery-limit`, likewise.
    pub fn max_deliveries(mut self, deliveries: u32) -> Redelivery {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// How long a message waits before it is delivered again after the handler's own error,
    /// a store error or a lost ownership (default 1 s).
    pub fn retry_delay(mut self, delay: Duration) -> Redelivery {
        self.retry_delay = delay;
        self
    }

    /// How long a message waits before it is delivered again when another owner is processing
    /// its key ([`Error::InProgress`]; default 1 s). About the handler's usual running time:
    /// a live owner finishes by then and the redelivery is acknowledged as a duplicate. A
    /// crashed owner's claim is taken over once its lease runs out.
    pub fn in_progress_delay(mut self, delay: Duration) -> Redelivery {
        self.in_progress_delay = delay;
        self
    }

    /// What to do with a message whose handler returned `result`, on its `deliveries`-th
    /// delivery (`None` when the broker cannot tell). See the [module table](self).
    pub fn decide<T, E: Settle>(&self, result: &Result<T, E>, deliveries: Option<u32>) -> Decision {
        match result {
            Ok(_) => Decision::Ack,
            Err(err) => match err.idempotency_error() {
                Some(err) => self.decide_error(err),
                None => self.handler_failed(deliveries, err.is_permanent()),
            },
        }
    }

    /// The decision for an idempotency error.
    fn decide_error(&self, err: &Error) -> Decision {
        match err {
            Error::InProgress { .. } => Decision::Redeliver {
                delay: self.in_progress_delay,
            },
            other => match other.action() {
                Action::Ack => Decision::Ack,
                Action::Redeliver => Decision::Redeliver {
                    delay: self.retry_delay,
                },
                Action::DeadLetter => Decision::DeadLetter,
            },
        }
    }

    /// The decision for the handler's own failure (an error or a panic).
    pub(crate) fn handler_failed(&self, deliveries: Option<u32>, permanent: bool) -> Decision {
        match deliveries {
            _ if permanent => Decision::DeadLetter,
            Some(n) if n >= self.max_deliveries => Decision::DeadLetter,
            _ => Decision::Redeliver {
                delay: self.retry_delay,
            },
        }
    }
}

/// What a consume loop did, returned when it stops.
///
/// ```
/// use idempotent_runtime::broker::Summary;
///
/// let summary = Summary::default();
/// assert_eq!(summary.acked + summary.redelivered + summary.dead_lettered, 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Summary {
    /// Messages acknowledged.
    pub acked: u64,
    /// Messages given back for redelivery.
    pub redelivered: u64,
    /// Messages dead-lettered (RabbitMQ) or terminated (NATS).
    pub dead_lettered: u64,
    /// Messages that could not be settled (their channel or connection closed first); the
    /// broker redelivers them.
    pub unsettled: u64,
}

impl Summary {
    pub(crate) fn record<E>(&mut self, settled: &Result<Decision, E>) {
        match settled {
            Ok(Decision::Ack) => self.acked += 1,
            Ok(Decision::Redeliver { .. }) => self.redelivered += 1,
            Ok(Decision::DeadLetter) => self.dead_lettered += 1,
            Err(_) => self.unsettled += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{StoreError, StoreErrorKind};
    use crate::key::Key;

    fn key() -> Key {
        Key::new("broker:test", 1, &[&"k"]).unwrap()
    }

    #[derive(Debug, thiserror::Error)]
    enum AppError {
        #[error(transparent)]
        Idempotency(#[from] Error),
        #[error("flaky")]
        Flaky,
        #[error("malformed")]
        Malformed,
    }

    impl Settle for AppError {
        fn idempotency_error(&self) -> Option<&Error> {
            match self {
                AppError::Idempotency(err) => Some(err),
                _ => None,
            }
        }
        fn is_permanent(&self) -> bool {
            matches!(self, AppError::Malformed)
        }
    }

    fn redelivery() -> Redelivery {
        Redelivery::new()
            .max_deliveries(3)
            .retry_delay(Duration::from_millis(10))
            .in_progress_delay(Duration::from_millis(20))
    }

    fn decide(err: AppError, deliveries: Option<u32>) -> Decision {
        redelivery().decide(&Err::<(), _>(err), deliveries)
    }

    const RETRY: Decision = Decision::Redeliver {
        delay: Duration::from_millis(10),
    };

    #[test]
    fn every_idempotency_error_maps_to_its_action() {
        let store = || StoreError::new(StoreErrorKind::Unavailable, "down");
        let cases: Vec<(Error, Decision)> = vec![
            (Error::Duplicate { key: key() }, Decision::Ack),
            (Error::Skipped { key: key() }, Decision::Ack),
            (
                Error::InProgress {
                    key: key(),
                    fence: 1,
                },
                Decision::Redeliver {
                    delay: Duration::from_millis(20),
                },
            ),
            (
                Error::LostOwnership {
                    key: key(),
                    fence: 1,
                },
                RETRY,
            ),
            (Error::Store(store()), RETRY),
            (Error::NoStore, RETRY),
            (Error::NoRuntime, RETRY),
            (Error::PayloadMismatch { key: key() }, Decision::DeadLetter),
            (Error::Held { key: key() }, Decision::DeadLetter),
            (
                Error::InvalidKey(crate::key::KeyError::EmptyPart { index: 0 }),
                Decision::DeadLetter,
            ),
            (
                Error::Codec {
                    op: "decoded",
                    source: "bad".into(),
                },
                Decision::DeadLetter,
            ),
        ];
        for (err, expected) in cases {
            let shown = err.to_string();
            // The count never matters for idempotency outcomes.
            assert_eq!(decide(AppError::from(err), Some(99)), expected, "{shown}");
        }
        assert_eq!(
            redelivery().decide(&Ok::<(), Error>(()), Some(99)),
            Decision::Ack
        );
    }

    #[test]
    fn handler_errors_redeliver_then_dead_letter() {
        assert_eq!(decide(AppError::Flaky, Some(1)), RETRY);
        assert_eq!(decide(AppError::Flaky, Some(2)), RETRY);
        assert_eq!(decide(AppError::Flaky, Some(3)), Decision::DeadLetter);
        assert_eq!(decide(AppError::Flaky, None), RETRY);
        assert_eq!(decide(AppError::Malformed, Some(1)), Decision::DeadLetter);
    }

    #[test]
    fn boxed_errors_find_the_idempotency_error_in_their_sources() {
        #[derive(Debug, thiserror::Error)]
        #[error("wrapped")]
        struct Wrapper(#[source] Error);

        let boxed: Box<dyn StdError + Send + Sync> =
            Box::new(Wrapper(Error::Duplicate { key: key() }));
        assert!(boxed.idempotency_error().is_some_and(Error::is_duplicate));
        let plain: Box<dyn StdError + Send + Sync> = "failed".into();
        assert!(plain.idempotency_error().is_none());
    }
}
