//! The transactional outbox: messages written in the business transaction, published after
//! commit by a [`Relay`], re-sent until the broker confirms them, dead-lettered for a person
//! after repeated failures.
//!
//! A service that must both change its database and tell other services cannot do both
//! atomically: publishing before the commit announces orders that may roll back, publishing
//! after it loses messages when the process dies in between. The outbox makes the message
//! part of the transaction: [`Outbox::enqueue`] inserts a row on the caller's transaction
//! (usable inside [`SqlStore::run_in_tx`](crate::sql::SqlStore::run_in_tx), so "claim the
//! key + create the order + record the message" commits or rolls back as one); the relay
//! publishes committed rows and marks them published only once the broker confirmed them
//! (RabbitMQ publisher confirms, NATS JetStream acks). Delivery is at least once: a relay
//! that dies between the confirm and the mark publishes the row again. Every message carries
//! its outbox id as its message id (AMQP `message_id`, `Nats-Msg-Id`), so consumers key
//! `#[idempotent]` on it and the effect happens once.
//!
//! ```no_run
//! use idempotent_runtime::outbox::{Message, Outbox};
//! use idempotent_runtime::sql::sqlx::{self, PgPool};
//!
//! # async fn f(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = Outbox::new(pool.clone());
//! outbox.create_table().await?;
//!
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders (id, item) VALUES ('A-1001', 'pizza')")
//!     .execute(&mut *tx)
//!     .await?;
//! let message = Message::new("order", "A-1001", "order.created", "orders.created", br#"{"id":"A-1001"}"#.to_vec());
//! let id = outbox.enqueue(&mut tx, &message).await?;
//! tx.commit().await?; // the order and its message, or neither
//! println!("message {id} will be published");
//! # Ok(()) }
//! ```
//!
//! PostgreSQL for now. The relay claims due rows with `FOR UPDATE SKIP LOCKED` and a claim
//! token, so several relays share the work and never publish a row concurrently (each stops
//! publishing its batch once its claim's lease is over); [`Outbox::enqueue`] notifies the
//! relays (`LISTEN`/`NOTIFY`, delivered at commit) so a committed message is published at
//! once, and the relays poll as a fallback.

mod postgres;
mod publish;
mod relay;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use crate::error::{StoreError, StoreErrorKind};
use crate::key::hex_string;
use crate::store::sql::table::TableName;
use crate::store::Token;

pub use publish::{PublishError, Publisher};
pub use relay::{Relay, RelayStats};

/// The table used when none is configured.
pub const DEFAULT_TABLE: &str = "idempotent_outbox";

/// A message's id: 32 hex characters, unique, written with the row and sent as the broker's
/// message id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    /// A fresh id (a per-process random salt and a counter, like a [`Token`]).
    pub fn generate() -> MessageId {
        MessageId(hex_string(Token::generate().as_bytes()))
    }

    /// An id as read back from the table or a message.
    pub fn from_string(id: String) -> MessageId {
        MessageId(id)
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A message to enqueue: what it is about (aggregate type and id, event type, as Debezium's
/// outbox columns), where it goes (a RabbitMQ routing key or a NATS subject), its payload and
/// headers.
///
/// ```
/// use idempotent_runtime::outbox::Message;
///
/// let message = Message::new("order", "A-1001", "order.created", "orders.created", b"{}".to_vec())
///     .header("tenant", "acme");
/// assert_eq!(message.destination(), "orders.created");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    destination: String,
    payload: Vec<u8>,
    headers: BTreeMap<String, String>,
}

impl Message {
    /// A message about `aggregate_type` `aggregate_id`, of `event_type`, to `destination`.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        destination: impl Into<String>,
        payload: Vec<u8>,
    ) -> Message {
        Message {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            destination: destination.into(),
            payload,
            headers: BTreeMap::new(),
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Message {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// The routing key or subject.
    pub fn destination(&self) -> &str {
        &self.destination
    }
}

/// A committed message as the relay publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxMessage {
    /// The message id: send it as the broker's message id.
    pub id: MessageId,
    /// What the message is about.
    pub aggregate_type: String,
    /// Which one.
    pub aggregate_id: String,
    /// What happened.
    pub event_type: String,
    /// The routing key or subject.
    pub destination: String,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers.
    pub headers: BTreeMap<String, String>,
    /// Publication attempts, this one included.
    pub attempts: u32,
}

/// A message that failed its attempts and waits for an operator ([`Outbox::dead`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadMessage {
    /// The message.
    pub message: OutboxMessage,
    /// The last publication error.
    pub last_error: Option<String>,
    /// Seconds since it was enqueued.
    pub age_seconds: f64,
}

/// An outbox table on a PostgreSQL pool: enqueue in transactions, operate on dead rows. The
/// [`Relay`] publishes it.
#[derive(Debug, Clone)]
pub struct Outbox {
    pool: PgPool,
    table: TableName,
}

impl Outbox {
    /// The outbox in the table `idempotent_outbox` of `pool`'s database.
    pub fn new(pool: PgPool) -> Outbox {
        Outbox {
            pool,
            table: TableName::parse(DEFAULT_TABLE, true, "PostgreSQL")
                .unwrap_or_else(|_| unreachable!("the default table name is valid")),
        }
    }

    /// The outbox in `table` (`[A-Za-z_][A-Za-z0-9_]{0,62}`, optionally `schema.table`).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unsafe`] for any other name: it is written into SQL text.
    pub fn with_table(pool: PgPool, table: &str) -> Result<Outbox, StoreError> {
        Ok(Outbox {
            pool,
            table: TableName::parse(table, true, "PostgreSQL")?,
        })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The channel `enqueue` notifies and relays listen on: the table's name.
    pub(crate) fn channel(&self) -> &str {
        self.table.as_str()
    }

    /// Creates the table and its indexes when missing (the shipped file
    /// `migrations/outbox/postgres/0001_create_idempotent_outbox.sql`, for the configured
    /// name).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database refuses or does not answer.
    pub async fn create_table(&self) -> Result<(), StoreError> {
        postgres::create_table(&self.pool, &self.table)
            .await
            .map_err(db_error)
    }

    /// Writes `message` in the caller's transaction `tx` and returns its id. The message is
    /// published after `tx` commits, never if it rolls back. Relays listening on the table
    /// are notified at commit.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails (the transaction may be aborted: roll it
    /// back).
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        message: &Message,
    ) -> Result<MessageId, StoreError> {
        let id = MessageId::generate();
        let headers = serde_json::to_string(&message.headers).map_err(|e| {
            StoreError::new(StoreErrorKind::Rejected, format!("message headers: {e}"))
        })?;
        postgres::enqueue(
            &mut *tx,
            &self.table,
            self.channel(),
            &id,
            message,
            &headers,
        )
        .await
        .map_err(db_error)?;
        Ok(id)
    }

    /// The message `id`, whatever its state (`None` once purged or discarded, or for an id
    /// this outbox never had).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn get(&self, id: &MessageId) -> Result<Option<OutboxMessage>, StoreError> {
        postgres::get(&self.pool, &self.table, id)
            .await
            .map_err(db_error)
    }

    /// Messages that went `dead` (their attempts ran out), oldest first, at most `limit`.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn dead(&self, limit: u32) -> Result<Vec<DeadMessage>, StoreError> {
        postgres::dead(&self.pool, &self.table, limit)
            .await
            .map_err(db_error)
    }

    /// Puts a dead message back in the queue with its attempts reset: `true` when `id` was
    /// dead.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails.
    pub async fn retry(&self, id: &MessageId) -> Result<bool, StoreError> {
        postgres::retry(&self.pool, &self.table, id)
            .await
            .map_err(db_error)
    }

    /// Deletes a dead message: `true` when `id` was dead.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails.
    pub async fn discard(&self, id: &MessageId) -> Result<bool, StoreError> {
        postgres::discard(&self.pool, &self.table, id)
            .await
            .map_err(db_error)
    }

    /// Deletes at most `limit` messages published more than `older_than` ago; returns how
    /// many. Call it periodically (a bounded batch keeps each statement short).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails.
    pub async fn purge_published(
        &self,
        older_than: Duration,
        limit: u32,
    ) -> Result<u64, StoreError> {
        postgres::purge_published(&self.pool, &self.table, older_than, limit)
            .await
            .map_err(db_error)
    }

    /// How many messages are `pending`, `published` and `dead`.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        postgres::counts(&self.pool, &self.table)
            .await
            .map_err(db_error)
    }
}

/// Rows of an outbox by state ([`Outbox::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxCounts {
    /// Waiting to be published (or retried).
    pub pending: u64,
    /// Published, not purged yet.
    pub published: u64,
    /// Out of attempts, waiting for an operator.
    pub dead: u64,
}

fn db_error(err: sqlx::Error) -> StoreError {
    use crate::store::sql::error::{store_error, Phase};
    store_error::<Postgres>(err, Phase::Write, "outbox statement")
}
