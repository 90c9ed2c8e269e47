//! Deleting expired records: [`SqlStore::purge_expired`] and the [`Purger`] task.

use std::time::Duration;

use crate::error::StoreError;

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
    /// # Errors
    ///
    /// The first failed batch's error; the batches before it stay deleted.
    pub async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        let mut total = 0;
        loop {
            let mut conn = self.acquire().await?;
            let args = [Arg::Int(i64::from(batch))];
            let deleted = write::<DB>(&mut conn, &self.sql.purge, &args, "purge", true).await?;
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
        let task = self.runtime.spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                match store.purge_expired(batch).await {
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
