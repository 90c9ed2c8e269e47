//! The operator's side of an [`Outbox`]: counts, dead rows, inspecting a row, retrying and
//! discarding, purging published rows.

use std::time::Duration;

use crate::error::{StoreError, StoreErrorKind};
use crate::outbox::dialect::{self, Arg, ReadRow};
use crate::outbox::{db_error, MessageId, Outbox, OutboxDialect, OutboxMessage};

/// A message that failed its attempts and waits for an operator ([`Outbox::dead`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadMessage {
    /// The message (the fields that cannot be read are empty: see `unreadable`).
    pub message: OutboxMessage,
    /// The last publication error.
    pub last_error: Option<String>,
    /// Seconds since it was enqueued.
    pub age_seconds: f64,
    /// Why a part of the row cannot be read (written by another producer: headers that are
    /// not a JSON object of strings, text that is not UTF-8), if one cannot.
    pub unreadable: Option<String>,
}

/// Where a message is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageState {
    /// Waiting to be published, or retried after a failure.
    Pending,
    /// The broker confirmed it.
    Published,
    /// Out of attempts, waiting for an operator.
    Dead,
}

impl MessageState {
    /// The state as the table writes it: `pending`, `published` or `dead`.
    ///
    /// ```
    /// use idempotent_runtime::outbox::MessageState;
    /// assert_eq!(MessageState::Dead.as_str(), "dead");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::Published => "published",
            MessageState::Dead => "dead",
        }
    }

    pub(crate) fn parse(state: &str) -> Option<MessageState> {
        match state {
            "pending" => Some(MessageState::Pending),
            "published" => Some(MessageState::Published),
            "dead" => Some(MessageState::Dead),
            _ => None,
        }
    }
}

/// A row as an operator sees it ([`Outbox::inspect`]), readable or not.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StoredMessage {
    /// The message (the fields that cannot be read are empty: see `unreadable`), with its
    /// attempts so far.
    pub message: OutboxMessage,
    /// Its state.
    pub state: MessageState,
    /// The last publication error.
    pub last_error: Option<String>,
    /// Seconds since it was enqueued.
    pub age_seconds: f64,
    /// Whether a relay's claim holds it now (it is being published).
    pub claimed: bool,
    /// Why a part of the row cannot be read, if one cannot: the relay fails it on every
    /// attempt, and it goes `dead` at the relay's maximum.
    pub unreadable: Option<String>,
}

/// What [`Outbox::force_discard`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Discarded {
    /// The row was `pending` or `dead` and is deleted: it is never published (again).
    Deleted,
    /// Nothing deleted: a relay's claim holds the row, it is being published now.
    Claimed,
    /// Nothing deleted: the row is published.
    Published,
    /// No such row (never enqueued, or already purged or discarded).
    NotFound,
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

impl<DB: OutboxDialect> Outbox<DB> {
    /// The message `id`, whatever its state (`None` once purged or discarded, or for an id
    /// this outbox never had).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Corrupt`] for a row that cannot be read (another producer wrote it:
    /// [`inspect`](Outbox::inspect) shows what it can of it); [`StoreError`] when the query
    /// fails.
    pub async fn get(&self, id: &MessageId) -> Result<Option<OutboxMessage>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
        let mut rows = DB::messages(&mut *conn, &self.sql.get, &[Arg::Text(id.as_str())])
            .await
            .map_err(db_error::<DB>)?;
        match rows.pop() {
            None => Ok(None),
            Some(ReadRow {
                unreadable: Some(why),
                ..
            }) => Err(StoreError::new(
                StoreErrorKind::Corrupt,
                format!("outbox row {id} cannot be read: {why}"),
            )),
            Some(ReadRow { message, .. }) => Ok(Some(message)),
        }
    }

    /// The row `id` as an operator sees it, whatever its state and even when it cannot be read
    /// (`None` once purged or discarded, or for an id this outbox never had): its state,
    /// attempts, last error, why it cannot be read, whether a relay holds it now.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn inspect(&self, id: &MessageId) -> Result<Option<StoredMessage>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
        let mut rows = DB::stored(&mut *conn, &self.sql.inspect, &[Arg::Text(id.as_str())])
            .await
            .map_err(db_error::<DB>)?;
        Ok(rows.pop())
    }

    /// Messages that went `dead` (their attempts ran out), oldest first, at most `limit`;
    /// rows that cannot be read are listed too, with [`DeadMessage::unreadable`] set.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn dead(&self, limit: u32) -> Result<Vec<DeadMessage>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
        DB::dead(&mut *conn, &self.sql.dead, &[Arg::Int(i64::from(limit))])
            .await
            .map_err(db_error::<DB>)
    }

    /// Puts a dead message back in the queue with its attempts reset: `true` when `id` was
    /// dead.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails.
    pub async fn retry(&self, id: &MessageId) -> Result<bool, StoreError> {
        let done = self
            .exec(&self.sql.retry, &[Arg::Text(id.as_str())])
            .await?
            == 1;
        if done {
            self.wake();
        }
        Ok(done)
    }

    /// Deletes a dead message: `true` when `id` was dead. A `pending` row that keeps
    /// failing is discarded with [`force_discard`](Outbox::force_discard).
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the statement fails.
    pub async fn discard(&self, id: &MessageId) -> Result<bool, StoreError> {
        Ok(self
            .exec(&self.sql.discard, &[Arg::Text(id.as_str())])
            .await?
            == 1)
    }

    /// Deletes a `dead` **or `pending`** message, so it is never published (again): for a row
    /// that is stuck before going dead (one that cannot be read or published, with attempts
    /// and backoff still to run). A row a relay is publishing right now (its claim holds) is
    /// left alone ([`Discarded::Claimed`]): try again once the relay gave it back, at most a
    /// lease later. A published row is not deleted ([`Discarded::Published`]:
    /// [`purge_published`](Outbox::purge_published) removes those).
    ///
    /// A pending row may have reached the broker already (a relay that published it but could
    /// not mark it, before its claim ran out): discarding it does not take that copy back.
    ///
    /// ```no_run
    /// use idempotent_runtime::outbox::{Discarded, MessageId, Outbox, OutboxDialect};
    /// # async fn f<DB: OutboxDialect>(outbox: Outbox<DB>, id: MessageId) -> Result<(), idempotent_runtime::StoreError> {
    /// match outbox.force_discard(&id).await? {
    ///     Discarded::Deleted => println!("{id} will never be published"),
    ///     Discarded::Claimed => println!("a relay is publishing {id} now; try again later"),
    ///     other => println!("{id} not deleted: {other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`StoreError`] when a statement fails.
    pub async fn force_discard(&self, id: &MessageId) -> Result<Discarded, StoreError> {
        if self
            .exec(&self.sql.force_discard, &[Arg::Text(id.as_str())])
            .await?
            == 1
        {
            return Ok(Discarded::Deleted);
        }
        Ok(match self.inspect(id).await? {
            None => Discarded::NotFound,
            Some(row) if row.state == MessageState::Published => Discarded::Published,
            // A claim holds it (or took it between the two statements).
            Some(_) => Discarded::Claimed,
        })
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
        let older = dialect::ticks::<DB>(older_than);
        self.exec(
            &self.sql.purge,
            &[Arg::Int(older), Arg::Int(i64::from(limit))],
        )
        .await
    }

    /// How many messages are `pending`, `published` and `dead`.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the query fails.
    pub async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(db_error::<DB>)?;
        DB::counts(&mut *conn, &self.sql.counts)
            .await
            .map_err(db_error::<DB>)
    }
}
