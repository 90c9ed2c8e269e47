//! [`Relay`]: publishes committed outbox rows and marks them published once confirmed.

use std::future::Future;
use std::time::Duration;

use crate::error::StoreError;
use crate::outbox::dialect::Listener;
use crate::outbox::publish::Publisher;
use crate::outbox::round::{RelayStats, Settings};
use crate::outbox::{Outbox, OutboxDialect};
use crate::store::MAX_DURATION;

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
/// [`StoreErrorKind::OutcomeUnknown`]: crate::StoreErrorKind::OutcomeUnknown
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
    settings: Settings,
}

impl<DB: OutboxDialect, P: Publisher> Relay<DB, P> {
    /// A relay of `outbox` through `publisher`: batches of 100, a 30 s claim, 10 attempts,
    /// polling every second besides the notifications.
    pub fn new(outbox: Outbox<DB>, publisher: P) -> Relay<DB, P> {
        Relay {
            outbox,
            publisher,
            settings: Settings::default(),
        }
    }

    /// Rows claimed per round (at least 1).
    pub fn batch(mut self, rows: u32) -> Self {
        self.settings.batch = rows.max(1);
        self
    }

    /// How long a claim holds: a relay that dies keeps its rows this long (10 ms to
    /// [`MAX_DURATION`]; a value outside is clamped).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease.clamp(Duration::from_millis(10), MAX_DURATION);
        self
    }

    /// Attempts before a failing row goes `dead` (at least 1).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.settings.max_attempts = attempts.max(1);
        self
    }

    /// The wait after the first failed attempt, doubling per attempt up to `max` (each at most
    /// [`MAX_DURATION`]; a longer one is clamped).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.first_backoff = first.min(MAX_DURATION);
        self.settings.max_backoff = max.min(MAX_DURATION).max(self.settings.first_backoff);
        self
    }

    /// How often [`run`](Relay::run) looks for due rows without a notification (retries that
    /// became due, a missed notification).
    pub fn poll(mut self, every: Duration) -> Self {
        self.settings.poll = every.clamp(Duration::from_millis(10), MAX_DURATION);
        self
    }

    /// Also publishes a copy of each message that goes `dead` to `destination` (a RabbitMQ
    /// routing key of a dead-letter queue, a NATS subject), with its original destination in
    /// the header `outbox-destination` and the last error in `outbox-last-error`. The row
    /// stays `dead` for an operator either way; a copy the broker does not confirm is only
    /// logged.
    pub fn dead_letter_to(mut self, destination: impl Into<String>) -> Self {
        self.settings.dead_letter = Some(destination.into());
        self
    }

    /// The outbox.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    /// One round: claims a batch of due rows and publishes it.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the claim failed (nothing was published). Failures after it are
    /// counted in the stats, not returned.
    pub async fn run_once(&self) -> Result<RelayStats, StoreError> {
        self.settings.round(&self.outbox, &self.publisher).await
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
                    stats.claimed >= u64::from(self.settings.batch) && stats.unavailable == 0
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
                () = tokio::time::sleep(self.settings.poll) => {}
            }
        }
    }

    /// The notifications' listener, if the database has them and answers within the lease;
    /// otherwise the relay polls.
    async fn listen(&self) -> Option<Box<dyn Listener>> {
        let listen = DB::listen(self.outbox.pool(), self.outbox.channel());
        match tokio::time::timeout(self.settings.lease, listen).await {
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
