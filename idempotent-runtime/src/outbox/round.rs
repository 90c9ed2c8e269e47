//! One round of a relay over a source of outbox rows: what [`Relay::run_once`] runs on an
//! [`Outbox`] table, and what the relay's simulation runs on rows in memory.
//!
//! [`Relay::run_once`]: crate::outbox::Relay::run_once

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{StoreError, StoreErrorKind};
use crate::outbox::dialect::{self, Arg, ReadRow};
use crate::outbox::publish::Publisher;
use crate::outbox::{db_error, Outbox, OutboxDialect, OutboxMessage};
use crate::store::{BoxFuture, Token};

/// The most rows one marking statement names.
const MARK_CHUNK: usize = 500;

/// What a relay did ([`Relay::run_once`], [`Relay::run`]).
///
/// [`Relay::run_once`]: crate::outbox::Relay::run_once
/// [`Relay::run`]: crate::outbox::Relay::run
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Rows claimed.
    pub claimed: u64,
    /// Messages the broker confirmed and that were marked published.
    pub published: u64,
    /// Publications that failed (retried later, or dead-lettered).
    pub failed: u64,
    /// Rows that went `dead` on their last attempt.
    pub dead: u64,
    /// Messages confirmed whose row could not be marked (the claim ran out, or the database
    /// failed): they are published again later, and consumers filter the duplicate.
    pub unmarked: u64,
    /// Dead rows whose copy the broker confirmed at the dead-letter destination
    /// ([`Relay::dead_letter_to`](crate::outbox::Relay::dead_letter_to)).
    pub dead_lettered: u64,
    /// Publications that met an unreachable broker ([`PublishError::is_unavailable`]): the
    /// round stopped there and gave its rows back, their attempt not counted.
    ///
    /// [`PublishError::is_unavailable`]: crate::outbox::PublishError::is_unavailable
    pub unavailable: u64,
}

impl RelayStats {
    pub(crate) fn add(&mut self, other: RelayStats) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.failed += other.failed;
        self.dead += other.dead;
        self.unmarked += other.unmarked;
        self.dead_lettered += other.dead_lettered;
        self.unavailable += other.unavailable;
    }
}

/// Where a relay's rows live: the statements of one round, each against the rows that carry
/// the round's token.
pub(crate) trait RowSource: Send + Sync {
    /// Claims at most `batch` due rows for `token` until `lease` has passed (on the source's
    /// clock), counting an attempt on each, oldest first.
    fn claim<'a>(
        &'a self,
        token: &'a Token,
        lease: Duration,
        batch: u32,
    ) -> BoxFuture<'a, Result<Vec<ReadRow>, StoreError>>;

    /// Records a failed attempt on row `id` while `token` holds it: `dead` once its attempts
    /// reached `max_attempts`, otherwise due again after `backoff`; the claim is let go.
    fn failed<'a>(
        &'a self,
        token: &'a Token,
        id: &'a str,
        error: &'a str,
        max_attempts: u32,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// Gives back the `pending` rows `token` still holds, their attempt taken back.
    fn release<'a>(&'a self, token: &'a Token) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// Marks the rows `ids` that `token` still holds published: how many it marked.
    fn published<'a>(
        &'a self,
        token: &'a Token,
        ids: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, StoreError>>;
}

impl<DB: OutboxDialect> RowSource for Outbox<DB> {
    fn claim<'a>(
        &'a self,
        token: &'a Token,
        lease: Duration,
        batch: u32,
    ) -> BoxFuture<'a, Result<Vec<ReadRow>, StoreError>> {
        Box::pin(self.claim_rows(token, lease, batch))
    }

    fn failed<'a>(
        &'a self,
        token: &'a Token,
        id: &'a str,
        error: &'a str,
        max_attempts: u32,
        backoff: Duration,
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let args = [
                Arg::Text(error),
                Arg::Int(i64::from(max_attempts)),
                Arg::Int(dialect::ticks::<DB>(backoff)),
                Arg::Text(id),
                Arg::Bytes(token.as_bytes()),
            ];
            self.exec(&self.statements().failed, &args).await
        })
    }

    fn release<'a>(&'a self, token: &'a Token) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let args = [Arg::Bytes(token.as_bytes())];
            self.exec(&self.statements().release, &args).await
        })
    }

    fn published<'a>(
        &'a self,
        token: &'a Token,
        ids: &'a [&'a str],
    ) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let sql = self.statements().published_many(ids.len(), DB::NUMBERED);
            let mut args = Vec::with_capacity(ids.len() + 1);
            args.push(Arg::Bytes(token.as_bytes()));
            args.extend(ids.iter().map(|id| Arg::Text(id)));
            self.exec(&sql, &args).await
        })
    }
}

impl<DB: OutboxDialect> Outbox<DB> {
    /// [`RowSource::claim`] in SQL: one statement that returns the rows, or (MySQL, SQLite)
    /// one that writes the token on them and one that reads them back.
    async fn claim_rows(
        &self,
        token: &Token,
        lease: Duration,
        batch: u32,
    ) -> Result<Vec<ReadRow>, StoreError> {
        let sql = self.statements();
        let claim = [
            Arg::Bytes(token.as_bytes()),
            Arg::Int(dialect::ticks::<DB>(lease)),
            Arg::Int(i64::from(batch)),
        ];
        if sql.claimed.is_empty() {
            let mut conn = self.pool().acquire().await.map_err(db_error::<DB>)?;
            return DB::messages(&mut *conn, &sql.claim, &claim)
                .await
                .map_err(db_error::<DB>);
        }
        if self.exec(&sql.claim, &claim).await? == 0 {
            return Ok(Vec::new());
        }
        // The rows carry the token until they are marked or the claim runs out; if this read
        // fails, they wait for the lease and are claimed again.
        let mut conn = self.pool().acquire().await.map_err(db_error::<DB>)?;
        DB::messages(&mut *conn, &sql.claimed, &[Arg::Bytes(token.as_bytes())])
            .await
            .map_err(db_error::<DB>)
    }
}

/// A relay's settings ([`Relay`](crate::outbox::Relay)'s builder sets them).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) batch: u32,
    pub(crate) lease: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) first_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) poll: Duration,
    pub(crate) dead_letter: Option<String>,
}

impl Default for Settings {
    /// Batches of 100, a 30 s claim, 10 attempts, backoff from 1 s to 5 minutes, polling every
    /// second.
    fn default() -> Settings {
        Settings {
            batch: 100,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            poll: Duration::from_secs(1),
            dead_letter: None,
        }
    }
}

impl Settings {
    fn backoff_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }

    /// One round: claims a batch of due rows from `source` and publishes it through
    /// `publisher` ([`Relay::run_once`](crate::outbox::Relay::run_once)).
    pub(crate) async fn round<S: RowSource + ?Sized, P: Publisher + ?Sized>(
        &self,
        source: &S,
        publisher: &P,
    ) -> Result<RelayStats, StoreError> {
        let token = Token::generate();
        let claimed_at = Instant::now();
        let rows = self
            .bounded("claim", source.claim(&token, self.lease, self.batch))
            .await?;
        // Stop a tenth of the lease early: the claim is counted on the database's clock.
        let publish_until = claimed_at + self.lease - self.lease / 10;
        let mut stats = RelayStats {
            claimed: rows.len() as u64,
            ..RelayStats::default()
        };
        // Confirmed rows are marked together once the batch is through: one statement per
        // batch, not per row. A relay that dies before marking publishes them again.
        let mut confirmed: Vec<&str> = Vec::with_capacity(rows.len());
        // Rows left untried: given back at the end, their attempt not counted.
        let mut given_back = false;
        for ReadRow {
            message: row,
            unreadable,
        } in &rows
        {
            let left = publish_until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(id = %row.id, "claim ran out; giving the rest of the batch back");
                given_back = true;
                break;
            }
            let error = if let Some(why) = unreadable {
                // Written by another producer: it fails alone, every attempt, and goes dead.
                format!("the row cannot be read: {why}")
            } else {
                match tokio::time::timeout(left, publisher.publish(row)).await {
                    Ok(Ok(())) => {
                        confirmed.push(row.id.as_str());
                        continue;
                    }
                    Ok(Err(err)) if err.is_unavailable() => {
                        // Not the row's fault, and the rest would meet the same broker.
                        tracing::warn!(id = %row.id, error = %err, "broker unavailable; giving the batch back");
                        stats.unavailable += 1;
                        given_back = true;
                        break;
                    }
                    Ok(Err(err)) => err.to_string(),
                    Err(_) => "the broker did not confirm before the claim ran out".to_owned(),
                }
            };
            stats.failed += 1;
            let dead = row.attempts >= self.max_attempts;
            if dead {
                stats.dead += 1;
                tracing::error!(id = %row.id, attempts = row.attempts, error, "publication failed for the last time; the message is dead");
                // A row that cannot be read has no whole message to copy.
                if let (Some(destination), None) = (&self.dead_letter, unreadable) {
                    let left = publish_until.saturating_duration_since(Instant::now());
                    if self
                        .dead_letter(publisher, row, destination, &error, left)
                        .await
                    {
                        stats.dead_lettered += 1;
                    }
                }
            } else {
                tracing::warn!(id = %row.id, attempts = row.attempts, error, "publication failed; retrying later");
            }
            let backoff = self.backoff_after(row.attempts);
            let failed = source.failed(&token, row.id.as_str(), &error, self.max_attempts, backoff);
            let recorded = self.bounded("failed attempt", failed).await;
            if let Err(err) = recorded {
                tracing::warn!(id = %row.id, error = %err, "failed attempt not recorded; the claim will run out");
            }
        }
        self.mark(source, &token, &confirmed, &mut stats).await;
        if given_back {
            self.give_back(source, &token).await;
        }
        Ok(stats)
    }

    /// Gives back the rows `token` still holds (neither published nor failed): due again at
    /// once, the attempt their claim counted taken back, as it was not their fault.
    async fn give_back<S: RowSource + ?Sized>(&self, source: &S, token: &Token) {
        let released = self.bounded("release", source.release(token)).await;
        if let Err(err) = released {
            tracing::warn!(error = %err, "rows not given back; they wait for the claim to run out");
        }
    }

    /// Marks the `confirmed` rows published, where `token` still holds them.
    async fn mark<S: RowSource + ?Sized>(
        &self,
        source: &S,
        token: &Token,
        confirmed: &[&str],
        stats: &mut RelayStats,
    ) {
        for chunk in confirmed.chunks(MARK_CHUNK) {
            let chunk_len = chunk.len() as u64;
            match self.bounded("mark", source.published(token, chunk)).await {
                Ok(marked) => {
                    let marked = marked.min(chunk_len);
                    stats.published += marked;
                    if marked < chunk_len {
                        tracing::warn!(
                            unmarked = chunk_len - marked,
                            "published, but the claim had run out; they will be published again"
                        );
                        stats.unmarked += chunk_len - marked;
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, rows = chunk_len, "published, but not marked; they will be published again");
                    stats.unmarked += chunk_len;
                }
            }
        }
    }

    /// `call`, one of the relay's statements (`what`), abandoned once the lease has passed
    /// without an answer: [`StoreErrorKind::OutcomeUnknown`], as it may have been applied.
    async fn bounded<T>(
        &self,
        what: &str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.lease, call).await {
            Ok(answer) => answer,
            Err(_) => Err(StoreError::new(
                StoreErrorKind::OutcomeUnknown,
                format!(
                    "the outbox {what} got no answer from the database within the lease ({} ms)",
                    self.lease.as_millis()
                ),
            )),
        }
    }

    /// Publishes a copy of the dead `row` to `destination` within `left`: whether the broker
    /// confirmed it.
    async fn dead_letter<P: Publisher + ?Sized>(
        &self,
        publisher: &P,
        row: &OutboxMessage,
        destination: &str,
        error: &str,
        left: Duration,
    ) -> bool {
        let mut copy = row.clone();
        copy.destination = destination.to_owned();
        copy.headers
            .insert("outbox-destination".into(), row.destination.clone());
        copy.headers
            .insert("outbox-last-error".into(), error.to_owned());
        match tokio::time::timeout(left, publisher.publish(&copy)).await {
            Ok(Ok(())) => true,
            Ok(Err(err)) => {
                tracing::error!(id = %row.id, error = %err, "the dead message's copy was not dead-lettered");
                false
            }
            Err(_) => {
                tracing::error!(id = %row.id, "the dead message's copy was not confirmed before the claim ran out");
                false
            }
        }
    }
}
