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
//! outbox.commit(tx).await?; // the order and its message, or neither
//! println!("message {id} will be published");
//! # Ok(()) }
//! ```
//!
//! The outbox runs on PostgreSQL, MySQL / MariaDB and SQLite ([`PostgresOutbox`],
//! [`MySqlOutbox`], [`SqliteOutbox`]), with the schema shipped in
//! `migrations/outbox/<database>/` ([`Outbox::create_table`] applies it). Relays claim due
//! rows with a claim token, so several relays share the work and never publish a row
//! concurrently (each stops publishing its batch once its claim's lease is over): on
//! PostgreSQL with `FOR UPDATE SKIP LOCKED`, elsewhere with an `UPDATE ... LIMIT` that writes
//! the token, then a read by token. A committed message is published at once: on PostgreSQL
//! [`Outbox::enqueue`] notifies relays in every process (`LISTEN`/`NOTIFY`, delivered at
//! commit); on every database [`Outbox::commit`] wakes the relays of the same process. Relays
//! poll as a fallback.
//!
//! The semantics are specified in `docs/semantics.md` ("Outbox").

mod dialect;
#[cfg(feature = "mysql")]
mod mysql;
mod operate;
#[cfg(feature = "postgres")]
mod postgres;
mod publish;
mod relay;
mod round;
#[cfg(test)]
mod simulation;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use std::sync::Arc;

use sqlx::{Pool, Transaction};
use tokio::sync::watch;

use crate::database::{is_conflict, store_error, Phase, TableName};
use crate::error::{StoreError, StoreErrorKind};
use crate::key::hex_string;
use crate::store::Token;
use dialect::{Arg, OutboxStatements};

pub use dialect::OutboxDialect;
pub use operate::{DeadMessage, Discarded, MessageState, OutboxCounts, StoredMessage};
pub use publish::{PublishError, Publisher};
pub use relay::Relay;
pub use round::RelayStats;

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
/// Building one cannot fail; [`Outbox::enqueue`] checks it ([`Message::validate`]) and
/// refuses, in the caller's transaction, one a broker cannot carry: a destination, an event
/// type or a header name over [`MAX_NAME_BYTES`] (AMQP short strings).
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

    /// Checks that a broker can carry the message: its destination, event type and header
    /// names are at most [`MAX_NAME_BYTES`] bytes each. [`Outbox::enqueue`] calls it.
    ///
    /// ```
    /// use idempotent_runtime::outbox::Message;
    ///
    /// let message = Message::new("order", "A-1", "order.created", "k".repeat(256), vec![]);
    /// let err = message.validate().unwrap_err();
    /// assert_eq!((err.field(), err.len()), ("destination", 256));
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidMessage`] naming the first field that is too long.
    pub fn validate(&self) -> Result<(), InvalidMessage> {
        let fields = [
            ("destination", self.destination.as_str()),
            ("event_type", self.event_type.as_str()),
        ];
        let names = self
            .headers
            .keys()
            .map(|name| ("header name", name.as_str()));
        for (field, value) in fields.into_iter().chain(names) {
            if value.len() > MAX_NAME_BYTES {
                return Err(InvalidMessage {
                    field,
                    len: value.len(),
                });
            }
        }
        Ok(())
    }
}

/// The longest destination, event type or header name a message may have, in bytes: AMQP
/// carries them as short strings (the routing key, the `type` property, header names).
pub const MAX_NAME_BYTES: usize = 255;

/// A message no broker can carry ([`Message::validate`]): [`Outbox::enqueue`] refuses it with
/// a [`StoreErrorKind::Rejected`] error whose source is this.
///
/// ```
/// use idempotent_runtime::outbox::{InvalidMessage, Message};
///
/// let message = Message::new("order", "A-1", "order.created", "orders", vec![])
///     .header("h".repeat(300), "v");
/// let err: InvalidMessage = message.validate().unwrap_err();
/// assert_eq!(err.field(), "header name");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the message's {field} is {len} bytes, more than the {MAX_NAME_BYTES} a broker carries")]
pub struct InvalidMessage {
    field: &'static str,
    len: usize,
}

impl InvalidMessage {
    /// The field that is too long: `destination`, `event_type` or `header name`.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// Its length in bytes.
    #[allow(clippy::len_without_is_empty)] // a length of a field, not a collection
    pub fn len(&self) -> usize {
        self.len
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

/// An outbox table on a sqlx pool of PostgreSQL, MySQL / MariaDB or SQLite: enqueue in
/// transactions, operate on dead rows. The [`Relay`] publishes it. Cloning is cheap (the pool
/// and the statements are shared).
///
/// The relay bounds every statement it sends by its lease; the operator's calls
/// ([`retry`](Outbox::retry), [`discard`](Outbox::discard),
/// [`purge_published`](Outbox::purge_published), ...) are not bounded in time: on a connection
/// that goes silent they wait until it fails. Wrap them in `tokio::time::timeout` where a
/// caller must not wait (the `idempotent-admin` command line does, with `--timeout`); a
/// change abandoned that way may still have been applied.
pub struct Outbox<DB: OutboxDialect> {
    pool: Pool<DB>,
    table: TableName,
    /// The PostgreSQL channel of the table ([`Outbox::channel`]).
    channel: Arc<str>,
    sql: Arc<OutboxStatements>,
    // Wakes the relays of this process: bumped by `commit` and `wake`.
    wake: Arc<watch::Sender<u64>>,
}

impl<DB: OutboxDialect> Clone for Outbox<DB> {
    fn clone(&self) -> Self {
        Outbox {
            pool: self.pool.clone(),
            table: self.table.clone(),
            channel: self.channel.clone(),
            sql: self.sql.clone(),
            wake: self.wake.clone(),
        }
    }
}

impl<DB: OutboxDialect> fmt::Debug for Outbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("database", &DB::NAME)
            .field("table", &self.table.as_str())
            .finish_non_exhaustive()
    }
}

impl<DB: OutboxDialect> Outbox<DB> {
    /// The outbox in the table `idempotent_outbox` of `pool`'s database.
    pub fn new(pool: Pool<DB>) -> Outbox<DB> {
        let table = TableName::parse(DEFAULT_TABLE, DB::SCHEMA_QUALIFIED, DB::NAME)
            .unwrap_or_else(|_| unreachable!("the default table name is valid"));
        Outbox::build(pool, table)
    }

    /// The outbox in `table` (`[A-Za-z_][A-Za-z0-9_]{0,62}`, or `schema.table` on
    /// PostgreSQL).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unsafe`] for any other name: it is written into SQL text.
    pub fn with_table(pool: Pool<DB>, table: &str) -> Result<Outbox<DB>, StoreError> {
        let table = TableName::parse(table, DB::SCHEMA_QUALIFIED, DB::NAME)?;
        Ok(Outbox::build(pool, table))
    }

    fn build(pool: Pool<DB>, table: TableName) -> Outbox<DB> {
        Outbox {
            sql: Arc::new(OutboxStatements::render(&DB::OUTBOX, &table)),
            channel: channel_of(table.as_str()).into(),
            pool,
            table,
            wake: Arc::new(watch::Sender::new(0)),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// The channel `enqueue` notifies and relays listen on (PostgreSQL): the table's name,
    /// or, for a name longer than PostgreSQL takes for a channel (63 bytes: a long schema
    /// name), `outbox_` and a digest of it, the same in every process.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    pub(crate) fn statements(&self) -> &OutboxStatements {
        &self.sql
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.wake.subscribe()
    }

    /// Creates the table and its indexes when missing (the shipped file
    /// `migrations/outbox/<database>/0001_create_idempotent_outbox.sql`, for the configured
    /// name; `<database>` is `postgres`, `mysql` or `sqlite`).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the database refuses or does not answer.
    pub async fn create_table(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
        if let Some(schema) = self.table.schema() {
            let sql = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
            DB::create(&mut *conn, &sql).await.map_err(db_error::<DB>)?;
        }
        DB::create(&mut *conn, &self.sql.create)
            .await
            .map_err(db_error::<DB>)
    }

    /// Writes `message` on `conn`, the caller's open transaction, and returns its id. The
    /// message is published after the transaction commits, never if it rolls back. Pass
    /// `&mut tx` for a sqlx [`Transaction`], or the connection that
    /// [`SqlStore::run_in_tx`](crate::sql::SqlStore::run_in_tx) hands its body, so the
    /// idempotency record, the business change and the message commit as one.
    ///
    /// On PostgreSQL relays in every process are notified when the transaction commits
    /// (`NOTIFY`); on MySQL and SQLite, commit with [`commit`](Outbox::commit) (or call
    /// [`wake`](Outbox::wake) after committing) to wake this process's relays at once;
    /// relays elsewhere find the message at their next poll.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Rejected`] with an [`InvalidMessage`] as its source for a message a
    /// broker cannot carry ([`Message::validate`]): nothing is sent, and the transaction is
    /// still usable. [`StoreError`] when the statement fails (the transaction may be aborted:
    /// roll it back).
    pub async fn enqueue(
        &self,
        conn: &mut DB::Connection,
        message: &Message,
    ) -> Result<MessageId, StoreError> {
        message.validate().map_err(|invalid| {
            StoreError::new(StoreErrorKind::Rejected, invalid.to_string()).with_source(invalid)
        })?;
        let id = MessageId::generate();
        let headers = serde_json::to_string(&message.headers).map_err(|e| {
            StoreError::new(StoreErrorKind::Rejected, format!("message headers: {e}"))
        })?;
        let mut args = vec![
            Arg::Text(id.as_str()),
            Arg::Text(&message.aggregate_type),
            Arg::Text(&message.aggregate_id),
            Arg::Text(&message.event_type),
            Arg::Text(&message.destination),
            Arg::Bytes(&message.payload),
            Arg::Text(&headers),
        ];
        if DB::NOTIFIES {
            args.push(Arg::Text(&self.channel));
        }
        DB::exec(conn, &self.sql.enqueue, &args)
            .await
            .map_err(db_error::<DB>)?;
        Ok(id)
    }

    /// Commits `tx` and wakes this process's relays: the message is published at once, on
    /// every database.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the commit fails (nothing was enqueued then).
    pub async fn commit(&self, tx: Transaction<'_, DB>) -> Result<(), StoreError> {
        tx.commit().await.map_err(db_error::<DB>)?;
        self.wake();
        Ok(())
    }

    /// Wakes this process's relays: call it after committing a transaction that enqueued
    /// (not needed on PostgreSQL, whose relays are notified at commit).
    pub fn wake(&self) {
        self.wake.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Executes an autocommit statement on the pool, sent again (a few times) when a
    /// conflict rolled it back.
    pub(crate) async fn exec(&self, sql: &str, args: &[Arg<'_>]) -> Result<u64, StoreError> {
        let mut attempt = 0;
        loop {
            let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
            match DB::exec(&mut *conn, sql, args).await {
                Ok(rows) => return Ok(rows),
                Err(err) if attempt < CONFLICT_RETRIES && is_conflict::<DB>(&err) => {
                    attempt += 1;
                    drop(conn);
                    tokio::time::sleep(Duration::from_millis(2 << attempt)).await;
                }
                Err(err) => return Err(db_error::<DB>(err)),
            }
        }
    }
}

/// The outbox on PostgreSQL.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub type PostgresOutbox = Outbox<sqlx::Postgres>;

/// The outbox on MySQL or MariaDB.
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub type MySqlOutbox = Outbox<sqlx::MySql>;

/// The outbox on SQLite.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub type SqliteOutbox = Outbox<sqlx::Sqlite>;

/// How often an autocommit outbox statement rolled back by a conflict (a deadlock, a lock
/// wait timeout, a busy SQLite database) is sent again.
const CONFLICT_RETRIES: u32 = 4;

/// The longest channel name PostgreSQL takes (`NAMEDATALEN - 1`).
const MAX_CHANNEL_LEN: usize = 63;

fn channel_of(table: &str) -> String {
    use sha2::{Digest, Sha256};

    if table.len() <= MAX_CHANNEL_LEN {
        return table.to_owned();
    }
    let digest = Sha256::digest(table.as_bytes());
    format!("outbox_{}", &hex_string(&digest)[..40])
}

fn db_error<DB: OutboxDialect>(err: sqlx::Error) -> StoreError {
    store_error::<DB>(err, Phase::Write, "outbox statement")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_fit_postgres_and_are_the_same_for_one_table() {
        assert_eq!(channel_of("idempotent_outbox"), "idempotent_outbox");
        let long = format!("{}.idempotent_outbox", "s".repeat(63));
        let channel = channel_of(&long);
        assert!(channel.len() <= MAX_CHANNEL_LEN, "{channel}");
        assert_eq!(channel, channel_of(&long));
        assert_ne!(
            channel,
            channel_of(&format!("{}.idempotent_outbox", "t".repeat(63)))
        );
    }
}
