//! A call in the caller's SQL transaction: [`SqlStore::run_in_tx`], the engine's bound run
//! ([`run_bound`]) driving the three statements the SQL store exposes
//! ([`SqlStore::claim_in`], [`SqlStore::complete_in`], [`SqlStore::release_in`]).

use std::time::Duration;

use sqlx::Transaction;

use crate::engine::{run_bound, Bound, BoundCall};
use crate::error::{Error, StoreError};
use crate::key::Key;
use crate::store::sql::{Dialect, SqlStore};
use crate::store::{Claim, ClaimRequest, Completion, Store};
#[cfg(doc)]
use crate::store::{MAX_DURATION, MIN_DURATION};

impl<DB: Dialect> SqlStore<DB> {
    /// Runs `body` at most once for `key`, in the caller's transaction `tx`: claims the key,
    /// runs `body` on the transaction's connection, and completes the record in the same
    /// transaction. Commit `tx` afterwards to make both the business change and the record
    /// durable; roll it back (or drop it) and neither happened, so the key can be claimed
    /// again. The record is kept `ttl` after completion.
    ///
    /// Outcomes, as for [`Idempotency::run`](crate::Idempotency::run): `body`'s value; `body`'s error
    /// (the claim is released in the transaction: roll back, or commit and the key is free);
    /// [`Error::Duplicate`] when an earlier transaction committed the key (there is no replay
    /// of results here), [`Error::Held`] for a key held by the engine,
    /// [`Error::InProgress`] when a call outside a transaction holds a live claim,
    /// [`Error::Store`] when a statement failed (roll back: the transaction may be aborted),
    /// [`Error::InvalidDuration`] for a `ttl` outside [`MIN_DURATION`] ..= [`MAX_DURATION`]
    /// (nothing is sent).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idempotent_runtime::{Error, Key};
    /// use idempotent_runtime::sql::{sqlx, PostgresStore};
    ///
    /// #[derive(Debug)]
    /// enum AppError { Idempotency(Error), Db(sqlx::Error) }
    /// impl From<Error> for AppError { fn from(e: Error) -> Self { AppError::Idempotency(e) } }
    /// impl From<sqlx::Error> for AppError { fn from(e: sqlx::Error) -> Self { AppError::Db(e) } }
    ///
    /// # async fn f(store: PostgresStore) -> Result<(), AppError> {
    /// let key = Key::new("payment:capture", 1, &[&"pay-42"]).map_err(Error::from)?;
    /// let mut tx = store.pool().begin().await?;
    /// let captured = store
    ///     .run_in_tx(&mut tx, key, Duration::from_secs(86_400), async |conn| {
    ///         sqlx::query("UPDATE payments SET state = 'captured' WHERE id = 'pay-42'")
    ///             .execute(&mut *conn)
    ///             .await?;
    ///         Ok::<_, AppError>(())
    ///     })
    ///     .await;
    /// match captured {
    ///     Ok(()) => tx.commit().await?,
    ///     Err(AppError::Idempotency(e)) if e.is_duplicate() => {} // already captured
    ///     Err(e) => return Err(e), // dropping `tx` rolls everything back
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// See above.
    pub async fn run_in_tx<T, E>(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: Key,
        ttl: Duration,
        body: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<Error>,
    {
        run_bound(
            &mut InTx { store: self, tx },
            BoundCall::new(key, ttl),
            body,
        )
        .await
    }
}

/// A store and the caller's transaction: where [`run_bound`] makes its calls.
pub(crate) struct InTx<'s, 't, 'c, DB: Dialect> {
    pub(crate) store: &'s SqlStore<DB>,
    pub(crate) tx: &'t mut Transaction<'c, DB>,
}

impl<DB: Dialect> Bound for InTx<'_, '_, '_, DB> {
    type Conn = DB::Connection;

    fn store_name(&self) -> &'static str {
        Store::name(self.store)
    }

    fn conn(&mut self) -> &mut DB::Connection {
        self.tx
    }

    async fn claim(&mut self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.store.claim_in(self.tx, req).await
    }

    async fn complete(
        &mut self,
        req: &ClaimRequest,
        completion: &Completion,
    ) -> Result<bool, StoreError> {
        self.store
            .complete_in(self.tx, &req.key, &req.token, completion)
            .await
    }

    async fn release(&mut self, req: &ClaimRequest) -> Result<bool, StoreError> {
        self.store.release_in(self.tx, &req.key, &req.token).await
    }
}
