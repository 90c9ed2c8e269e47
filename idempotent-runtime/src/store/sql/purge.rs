//! Deleting expired records: [`SqlStore::purge_expired`] and the [`Purger`] task.

use std::time::Duration;

use crate::error::StoreError;
use crate::store::deadline::bounded;

use crate::store::sql::dialect::Arg;
use crate::store::sql::dialect::Dialect;
use crate::store::sql::exec::write;
use crate::store::sql::store::SqlStore;

impl<DB: Dialect> SqlStore<DB> {
    /// Deletes expired records in batches of at most `batch` rows (one statement each, so
    /// no statement holds locks on more than `batch` rows), until a batch deletes fewer;
    /// returns how many rows were deleted. Records are expired for the store as soon as their
    /// expiry passes, purged or not: purging only reclaims space.
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::sql::PostgresStore) -> Result<(), idempotent_runtime::StoreError> {
    /// let deleted = store.purge_expired(1_000).await?;
    /// println!("{deleted} expired idempotency records deleted");
    /// # Ok(()) }
    /// ```
    ///
    /// A batch's statement is not bounded in time here: a connection that goes silent holds
    /// the call until the connection fails. Bound the call with `tokio::time::timeout` where
    /// that matters; [`spawn_purger`](Self::spawn_purger) bounds each batch itself.
    ///
    /// # Errors
    ///
    /// The first failed batch's error; the batches before it stay deleted.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        self.purge_within(batch, None).await
    }

    /// [`purge_expired`](Self::purge_expired), each batch's statement abandoned after `bound`
    /// without an answer ([`StoreErrorKind::OutcomeUnknown`](crate::StoreErrorKind::OutcomeUnknown), as it
    /// may have deleted its rows).
    async fn purge_within(&self, batch: u32, bound: Option<Duration>) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let mut conn = self.acquire().await?;
            let args = [Arg::Int(i64::from(batch))];
            let statement = write::<DB>(&mut conn, &self.sql.purge, &args, "purge", true);
            let deleted = match bound {
                Some(bound) => bounded(bound, "purge batch", statement).await?,
                None => statement.await?,
            };
            drop(conn);
            total += deleted;
            crate::metrics::purged(crate::store::Store::name(self), deleted);
            if deleted < u64::from(batch) {
                return Ok(total);
            }
            tokio::task::yield_now().await;
        }
    }

    /// Starts a task that runs [`purge_expired`](Self::purge_expired)`(batch)` now and then
    /// every `every`, on the runtime the store was built on. Failures are logged (`warn`)
    /// and retried at the next interval. The task stops when the returned [`Purger`] is
    /// dropped.
    ///
    /// A batch that has not answered within `every` (at least 1 s, at most 30 s) is taken
    /// for a silent connection: it is abandoned, logged, and the purge runs again at the next
    /// tick, on another of the pool's connections. The abandoned statement may still delete
    /// its rows; its connection is not reused before it answers or fails (the pool tests it
    /// first).
    ///
    /// ```no_run
    /// # async fn f(store: idempotent_runtime::sql::PostgresStore) {
    /// use std::time::Duration;
    ///
    /// let purger = store.spawn_purger(Duration::from_secs(60), 1_000);
    /// // ... serve ...
    /// drop(purger); // stops purging
    /// # }
    /// ```
    pub fn spawn_purger(&self, every: Duration, batch: u32) -> Purger {
        let store = self.clone();
        let every = every.max(Duration::from_millis(1));
        let bound = batch_bound(every);
        let task = self.runtime.spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                match store.purge_within(batch, Some(bound)).await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::debug!(
                        deleted,
                        table = store.table(),
                        "purged expired idempotency records"
                    ),
                    Err(err) => tracing::warn!(
                        error = %err,
                        table = store.table(),
                        "purging expired idempotency records failed; retrying at the next interval"
                    ),
                }
            }
        });
        Purger { task }
    }
}

/// How long a batch of the purger's task may go unanswered: the interval, within bounds. Below
/// 1 s a healthy batch on a loaded database would be cut; above 30 s a silent connection would
/// hold the purge up longer than an operator's call waits by default
/// ([`Admin::timeout`](crate::admin::Admin::timeout)).
fn batch_bound(every: Duration) -> Duration {
    every.clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// The task started by [`SqlStore::spawn_purger`]; dropping it stops the task.
#[derive(Debug)]
#[must_use = "the purger stops when this handle is dropped"]
pub struct Purger {
    task: tokio::task::JoinHandle<()>,
}

impl Purger {
    /// Stops purging (the same as dropping the handle).
    pub fn stop(self) {}
}

impl Drop for Purger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_bounded_by_the_interval_within_one_and_thirty_seconds() {
        assert_eq!(
            batch_bound(Duration::from_millis(1)),
            Duration::from_secs(1)
        );
        assert_eq!(batch_bound(Duration::from_secs(7)), Duration::from_secs(7));
        assert_eq!(batch_bound(Duration::MAX), Duration::from_secs(30));
    }
}
