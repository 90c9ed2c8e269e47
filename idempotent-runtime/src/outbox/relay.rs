//! [`Relay`]: publishes committed outbox rows and marks them published once confirmed.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{StoreError, StoreErrorKind};
use crate::outbox::dialect::{self, Arg, Listener, ReadRow};
use crate::outbox::publish::Publisher;
use crate::outbox::{db_error, Outbox, OutboxDialect, OutboxMessage};
use crate::store::Token;
use crate::store::MAX_DURATION;

/// The most rows one marking statement names.
const MARK_CHUNK: usize = 500;

/// What a relay did ([`Relay::run_once`], [`Relay::run`]).
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
    /// ([`Relay::dead_letter_to`]).
    pub dead_lettered: u64,
    /// Publications that met an unreachable broker ([`PublishError::is_unavailable`]): the
    /// round stopped there and gave its rows back, their attempt not counted.
    ///
    /// [`PublishError::is_unavailable`]: crate::outbox::PublishError::is_unavailable
    pub unavailable: u64,
}

impl RelayStats {
    fn add(&mut self, other: RelayStats) {
        self.claimed += other.claimed;
        self.published += other.published;
        self.failed += other.failed;
        self.dead += other.dead;
        self.unmarked += other.unmarked;
        self.dead_lettered += other.dead_lettered;
        self.unavailable += other.unavailable;
    }
}

/// Publishes an [`Outbox`]'s committed rows through a [`Publisher`].
///
/// Each round claims at most [`batch`](Relay::batch) due rows with a fresh token for
/// [`lease`](Relay::lease) (PostgreSQL: `FOR UPDATE SKIP LOCKED`; MySQL and SQLite: an
/// `UPDATE` that writes the token on the rows it takes; either way other relays take other
/// rows), publishes
/// them in order, and marks the ones the broker confirmed published in one statement at the
/// end of the batch, only while its claim holds. It stops publishing a batch before the lease runs out, so no two relays ever
/// publish a row at the same time. A failed publication is retried after a backoff (1 s,
/// doubling, at most 5 minutes by default); after [`max_attempts`](Relay::max_attempts) the
/// row goes `dead` for an operator ([`Outbox::dead`], [`Outbox::retry`], [`Outbox::discard`]).
/// A broker that cannot be reached ([`PublishError::unavailable`]) is not the rows' fault:
/// the round stops and gives its rows back without counting their attempt, and `run` tries
/// again at its next poll. Every statement the relay sends is abandoned once the lease has
/// passed without an answer (a connection gone silent, a stalled server): past it, the claim
/// the statement acts for has run out. An unanswered claim fails the round
/// ([`StoreErrorKind::OutcomeUnknown`]: its rows, if it took any, wait for the lease); an
/// unanswered mark counts its rows [`unmarked`](RelayStats::unmarked).
///
/// [`PublishError::unavailable`]: crate::outbox::PublishError::unavailable
///
/// ```no_run
/// use std::time::Duration;
/// use idempotent_runtime::outbox::{Outbox, Relay};
/// # async fn f(outbox: Outbox<idempotent_runtime::sql::sqlx::Postgres>, publisher: impl idempotent_runtime::outbox::Publisher) -> Result<(), idempotent_runtime::StoreError> {
/// let relay = Relay::new(outbox, publisher).max_attempts(8);
/// let stop = async { let _ = tokio::signal::ctrl_c().await; };
/// let stats = relay.run(stop).await?;
/// println!("published {}", stats.published);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Relay<DB: OutboxDialect, P> {
    outbox: Outbox<DB>,
    publisher: P,
    batch: u32,
    lease: Duration,
    max_attempts: u32,
    first_backoff: Duration,
    max_backoff: Duration,
    poll: Duration,
    dead_letter: Option<String>,
}

impl<DB: OutboxDialect, P: Publisher> Relay<DB, P> {
    /// A relay of `outbox` through `publisher`: batches of 100, a 30 s claim, 10 attempts,
    /// polling every second besides the notifications.
    pub fn new(outbox: Outbox<DB>, publisher: P) -> Relay<DB, P> {
        Relay {
            outbox,
            publisher,
            batch: 100,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            poll: Duration::from_secs(1),
            dead_letter: None,
        }
    }

    /// Rows claimed per round (at least 1).
    pub fn batch(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// How long a claim holds: a relay that dies keeps its rows this long (10 ms to
    /// [`MAX_DURATION`]; a value outside is clamped).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.clamp(Duration::from_millis(10), MAX_DURATION);
        self
    }

    /// Attempts before a failing row goes `dead` (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait after the first failed attempt, doubling per attempt up to `max` (each at most
    /// [`MAX_DURATION`]; a longer one is clamped).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_backoff = first.min(MAX_DURATION);
        self.max_backoff = max.min(MAX_DURATION).max(self.first_backoff);
        self
    }

    /// How often [`run`](Relay::run) looks for due rows without a notification (retries that
    /// became due, a missed notification).
    pub fn poll(mut self, every: Duration) -> Self {
        self.poll = every.clamp(Duration::from_millis(10), MAX_DURATION);
        self
    }

    /// Also publishes a copy of each message that goes `dead` to `destination` (a RabbitMQ
    /// routing key of a dead-letter queue, a NATS subject), with its original destination in
    /// the header `outbox-destination` and the last error in `outbox-last-error`. The row
    /// stays `dead` for an operator either way; a copy the broker does not confirm is only
    /// logged.
    pub fn dead_letter_to(mut self, destination: impl Into<String>) -> Self {
        self.dead_letter = Some(destination.into());
        self
    }

    /// The outbox.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    fn backoff_after(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first_backoff
            .saturating_mul(1 << doublings)
            .min(self.max_backoff)
    }

    /// One round: claims a batch of due rows and publishes it.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the claim failed (nothing was published). Failures after it are
    /// counted in the stats, not returned.
    pub async fn run_once(&self) -> Result<RelayStats, StoreError> {
        let token = Token::generate();
        let claimed_at = Instant::now();
        let rows = self.bounded("claim", self.claim(&token)).await?;
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
                match tokio::time::timeout(left, self.publisher.publish(row)).await {
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
                    if self.dead_letter(row, destination, &error, left).await {
                        stats.dead_lettered += 1;
                    }
                }
            } else {
                tracing::warn!(id = %row.id, attempts = row.attempts, error, "publication failed; retrying later");
            }
            let args = [
                Arg::Text(&error),
                Arg::Int(i64::from(self.max_attempts)),
                Arg::Int(dialect::ticks::<DB>(self.backoff_after(row.attempts))),
                Arg::Text(row.id.as_str()),
                Arg::Bytes(token.as_bytes()),
            ];
            let failed = self.outbox.exec(&self.outbox.statements().failed, &args);
            let recorded = self.bounded("failed attempt", failed).await;
            if let Err(err) = recorded {
                tracing::warn!(id = %row.id, error = %err, "failed attempt not recorded; the claim will run out");
            }
        }
        self.mark(&token, &confirmed, &mut stats).await;
        if given_back {
            self.give_back(&token).await;
        }
        Ok(stats)
    }

    /// Gives back the rows `token` still holds (neither published nor failed): due again at
    /// once, the attempt their claim counted taken back, as it was not their fault.
    async fn give_back(&self, token: &Token) {
        let args = [Arg::Bytes(token.as_bytes())];
        let release = self.outbox.exec(&self.outbox.statements().release, &args);
        let released = self.bounded("release", release).await;
        if let Err(err) = released {
            tracing::warn!(error = %err, "rows not given back; they wait for the claim to run out");
        }
    }

    /// Marks the `confirmed` rows published, where `token` still holds them.
    async fn mark(&self, token: &Token, confirmed: &[&str], stats: &mut RelayStats) {
        for chunk in confirmed.chunks(MARK_CHUNK) {
            let sql = self
                .outbox
                .statements()
                .published_many(chunk.len(), DB::NUMBERED);
            let mut args = Vec::with_capacity(chunk.len() + 1);
            args.push(Arg::Bytes(token.as_bytes()));
            args.extend(chunk.iter().map(|id| Arg::Text(id)));
            let chunk_len = chunk.len() as u64;
            match self.bounded("mark", self.outbox.exec(&sql, &args)).await {
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
    async fn dead_letter(
        &self,
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
        match tokio::time::timeout(left, self.publisher.publish(&copy)).await {
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

    /// Claims at most a batch of due rows for `token`, counting an attempt on each, oldest
    /// first.
    async fn claim(&self, token: &Token) -> Result<Vec<ReadRow>, StoreError> {
        let sql = self.outbox.statements();
        let claim = [
            Arg::Bytes(token.as_bytes()),
            Arg::Int(dialect::ticks::<DB>(self.lease)),
            Arg::Int(i64::from(self.batch)),
        ];
        if sql.claimed.is_empty() {
            let mut conn = self.outbox.pool().acquire().await.map_err(db_error::<DB>)?;
            return DB::messages(&mut *conn, &sql.claim, &claim)
                .await
                .map_err(db_error::<DB>);
        }
        if self.outbox.exec(&sql.claim, &claim).await? == 0 {
            return Ok(Vec::new());
        }
        // The rows carry the token until they are marked or the claim runs out; if this read
        // fails, they wait for the lease and are claimed again.
        let mut conn = self.outbox.pool().acquire().await.map_err(db_error::<DB>)?;
        DB::messages(&mut *conn, &sql.claimed, &[Arg::Bytes(token.as_bytes())])
            .await
            .map_err(db_error::<DB>)
    }

    /// Publishes until `stop` resolves: a round whenever a transaction that enqueued commits
    /// (on PostgreSQL `LISTEN`/`NOTIFY`, from any process; on every database
    /// [`Outbox::commit`] and [`Outbox::wake`] in this process), at once again while rounds
    /// come back full, and every [`poll`](Relay::poll) interval otherwise. A round that fails
    /// (the database is down) is logged and tried again at the next interval. A database that
    /// cannot be listened on, or does not answer the request to listen within the lease,
    /// leaves the relay polling.
    ///
    /// # Errors
    ///
    /// None today; the `Result` leaves room for unrecoverable setups.
    pub async fn run(&self, stop: impl Future<Output = ()>) -> Result<RelayStats, StoreError> {
        let mut stop = std::pin::pin!(stop);
        let mut total = RelayStats::default();
        let mut local = self.outbox.subscribe();
        let mut listener = self.listen().await;
        loop {
            // A wake-up that comes during the round is kept for the next wait.
            local.mark_unchanged();
            let full = match self.run_once().await {
                Ok(stats) => {
                    total.add(stats);
                    // A broker that is down is tried again at the next interval, not at once.
                    stats.claimed >= u64::from(self.batch) && stats.unavailable == 0
                }
                Err(err) => {
                    tracing::warn!(error = %err, "outbox round failed; retrying");
                    false
                }
            };
            if full {
                continue;
            }
            let notified = async {
                match listener.as_mut() {
                    Some(listening) => {
                        if let Err(err) = listening.recv().await {
                            tracing::warn!(error = %err, "outbox notifications lost; polling");
                            std::future::pending::<()>().await;
                        }
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let woken = async {
                // The sender lives in the outbox this relay holds: `changed` cannot fail.
                let _ = local.changed().await;
            };
            tokio::select! {
                biased;
                () = &mut stop => return Ok(total),
                () = notified => {}
                () = woken => {}
                () = tokio::time::sleep(self.poll) => {}
            }
        }
    }

    /// The notifications' listener, if the database has them and answers within the lease;
    /// otherwise the relay polls.
    async fn listen(&self) -> Option<Box<dyn Listener>> {
        let listen = DB::listen(self.outbox.pool(), self.outbox.channel());
        match tokio::time::timeout(self.lease, listen).await {
            Ok(Ok(listener)) => listener,
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "cannot listen for outbox notifications; polling");
                None
            }
            Err(_) => {
                tracing::warn!(
                    "the database did not answer the request to listen for outbox notifications \
                     within the lease; polling"
                );
                None
            }
        }
    }
}
