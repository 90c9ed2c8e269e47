//! The store's three statements in the caller's transaction: [`SqlStore::claim_in`],
//! [`SqlStore::complete_in`], [`SqlStore::release_in`]. The engine drives them for
//! [`SqlStore::run_in_tx`].

use sqlx::Transaction;

use crate::error::StoreError;
use crate::key::Key;
#[cfg(doc)]
use crate::store::Store;
use crate::store::{Claim, ClaimRequest, Completion, Token};

use crate::store::sql::dialect::Dialect;
use crate::store::sql::exec::{claim_on, complete_on, refuse_oversized, release_on};
use crate::store::sql::store::SqlStore;

impl<DB: Dialect> SqlStore<DB> {
    /// Claims `req.key` inside `tx`: [`Store::claim`], with the record written in the
    /// caller's transaction. On [`Claim::Acquired`] the transaction holds the record's row
    /// lock until it ends; complete it with [`complete_in`](Self::complete_in) in the same
    /// transaction before committing. A rollback removes the claim.
    ///
    /// # Errors
    ///
    /// As [`Store::claim`]; a failed statement may have aborted the transaction (on
    /// PostgreSQL it has): roll it back.
    pub async fn claim_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        claim_on::<DB>(&mut **tx, &self.tx_sql, req, false, true).await
    }

    /// Completes `key` for `token` inside `tx`: [`Store::complete`] in the caller's
    /// transaction, so the record is completed exactly when the transaction commits.
    ///
    /// # Errors
    ///
    /// As [`Store::complete`].
    pub async fn complete_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: &Key,
        token: &Token,
        completion: &Completion,
    ) -> Result<bool, StoreError> {
        refuse_oversized(completion, self.max_result_size)?;
        complete_on::<DB>(&mut **tx, &self.tx_sql, key, token, completion, false).await
    }

    /// Releases `key` for `token` inside `tx`: [`Store::release`] in the caller's
    /// transaction.
    ///
    /// # Errors
    ///
    /// As [`Store::release`].
    pub async fn release_in(
        &self,
        tx: &mut Transaction<'_, DB>,
        key: &Key,
        token: &Token,
    ) -> Result<bool, StoreError> {
        release_on::<DB>(&mut **tx, &self.tx_sql, key, token, false).await
    }
}
