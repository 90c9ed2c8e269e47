//! The operator's side: look at a key's record, list the records of a prefix (the stuck ones,
//! the held ones), free a key whose owner is stuck, let a held key run again, delete a record
//! (a corrupt one too) or every record of a prefix. Separate from the hot path: handlers never
//! call it.
//!
//! Every action reads the record, checks what the operator expects (the fence of the stuck
//! owner, the held state), and then writes only if the record still has the token it read:
//! a record that changed in between (its owner completed, another owner took the key) is left
//! alone and the action answers [`AdminOutcome::Changed`]. A delete or purge is also refused
//! by the store itself, at the moment of the write, for a record whose lease is live, so an
//! owner that renewed after the read is never removed while it runs. Each action is logged
//! (a tracing event at `info`, or `warn` when nothing was changed) and, with the feature
//! `metrics`, counted as `idempotency.admin.actions` (labels `action`, `store`, `outcome`).
//!
//! Listing pages through the store ([`OperatorStore::scan`]: `SCAN` on each Redis node, a
//! range of the primary key on SQL), a bounded page at a time, so it is safe on a store of
//! any size.
//!
//! An [`Admin`] takes a store that has the operator's methods, [`OperatorStore`], on top of
//! the engine's [`Store`](crate::Store): every store of this crate, and what
//! [`connect`](crate::connect) returns. A store without them is refused when it is handed to
//! [`Admin::new`], at compile time.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idempotent_runtime::admin::{Admin, AdminOutcome};
//! use idempotent_runtime::{Claim, ClaimRequest, Key, MemoryStore, RecordState, Store, Token};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(MemoryStore::new());
//! let key = Key::new("payment:capture", 1, &[&"pay-42"])?;
//! // An owner that crashed mid-handler left its claim, with a long lease.
//! let hour = Duration::from_secs(3600);
//! let stuck = ClaimRequest::new(key.clone(), Token::generate(), hour, hour);
//! let Claim::Acquired { fence } = store.claim(&stuck).await? else { unreachable!() };
//!
//! let admin = Admin::new(store.clone());
//! let seen = admin.inspect(&key).await?.expect("a record");
//! assert!(matches!(seen.state, RecordState::InProgress { .. }));
//! assert_eq!(admin.force_release(&key, fence).await?, AdminOutcome::Done { fence });
//! // The next claim takes the key with a higher fence; the stuck owner's completion is refused.
//! # Ok(()) }
//! ```

use std::time::Duration;

use crate::codec;
use crate::error::{StoreError, StoreErrorKind};
use crate::key::Key;
use crate::store::{
    Expect, IntoOperatorStore, OperatorStore, Record, RecordState, ScanCursor, SharedOperatorStore,
};

/// What an operator sees of a record ([`Admin::inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// In progress (with the lease left), completed or released.
    pub state: RecordState,
    /// The record's fence.
    pub fence: u64,
    /// Completed as failed with `on_error = hold`: duplicates get `Error::Held` until
    /// [`Admin::unhold`] or the record expires.
    pub held: bool,
    /// The size of the stored result in bytes, if there is one (a replayed value, a stored
    /// error).
    pub result_size: Option<usize>,
    /// Whether the claim carried a payload fingerprint.
    pub fingerprint: bool,
    /// How long the record has been in its state (see [`Record::age`]), where the store
    /// keeps it.
    pub age: Option<Duration>,
    /// Time until the record expires, where the store reports it.
    pub expires_in: Option<Duration>,
}

impl Inspection {
    fn of(record: &Record) -> Inspection {
        Inspection {
            state: record.state,
            fence: record.fence,
            held: is_held(record),
            result_size: record.result.as_ref().map(Vec::len),
            fingerprint: record.fingerprint.is_some(),
            age: record.age,
            expires_in: record.expires_in,
        }
    }

    /// An in-progress record whose lease has not run out: its owner may still be running.
    pub fn is_live_claim(&self) -> bool {
        matches!(self.state, RecordState::InProgress { lease_left } if !lease_left.is_zero())
    }
}

mod query;

pub use query::{ListPage, ListQuery, StateFilter};

/// What [`Admin::purge`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Records deleted.
    pub deleted: u64,
    /// Values that were no records, deleted.
    pub corrupt_deleted: u64,
    /// In-progress records with a live lease, left alone (their owner may be running: free
    /// them with [`Admin::force_release`] first).
    pub live_claims_kept: u64,
    /// Records that changed between the read and the delete, left alone.
    pub changed: u64,
}

fn is_held(record: &Record) -> bool {
    record.state == RecordState::Completed
        && record
            .result
            .as_deref()
            .and_then(<[u8]>::first)
            .is_some_and(|&tag| tag == codec::HELD)
}

/// What an operator's action did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AdminOutcome {
    /// Done. After `force_release` and `unhold` the record is released, so the next claim
    /// acquires the key with a fence above `fence`; after `delete` it is gone, as if the key
    /// had never been claimed (the next fence comes from the store's clock, as after expiry).
    /// Either way a stale owner's completion or renewal is refused.
    Done {
        /// The record's fence.
        fence: u64,
    },
    /// `delete` removed a value that was no record.
    DeletedCorrupt,
    /// The key has no record (never claimed, expired, purged): nothing to do.
    Missing,
    /// The record's fence is not the one the operator expected (another owner holds the key
    /// now): nothing changed.
    FenceMismatch {
        /// The record's fence.
        fence: u64,
    },
    /// The record is not in a state the action applies to (`force_release` needs an
    /// in-progress record, `unhold` a held one, `delete` anything but an in-progress record
    /// with a live lease): nothing changed.
    WrongState {
        /// The record's state.
        state: RecordState,
    },
    /// The record changed between the read and the write (completed, taken over): nothing
    /// changed; inspect it again.
    Changed,
}

impl AdminOutcome {
    /// A short name for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            AdminOutcome::Done { .. } => "done",
            AdminOutcome::DeletedCorrupt => "deleted_corrupt",
            AdminOutcome::Missing => "missing",
            AdminOutcome::FenceMismatch { .. } => "fence_mismatch",
            AdminOutcome::WrongState { .. } => "wrong_state",
            AdminOutcome::Changed => "changed",
        }
    }
}

/// The operator's API on a store (see the [module docs](self)).
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::admin::Admin;
/// use idempotent_runtime::MemoryStore;
///
/// let admin = Admin::new(Arc::new(MemoryStore::new()));
/// # let _ = admin;
/// ```
#[derive(Clone)]
pub struct Admin {
    store: SharedOperatorStore,
    timeout: Duration,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("store", &self.store.name())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Admin {
    /// The operator's API on `store`: an `Arc` of any [`OperatorStore`], or a
    /// [`SharedOperatorStore`].
    pub fn new(store: impl IntoOperatorStore) -> Admin {
        Admin {
            store: store.into_operator_store(),
            timeout: Duration::from_secs(30),
        }
    }

    /// How long one store call of an action may go unanswered (30 s by default; at least
    /// 1 ms) before the action fails with [`StoreErrorKind::OutcomeUnknown`]: a silent
    /// connection never hangs an operator. A write abandoned this way that lands later is
    /// still checked against the token (and the lease) the action read.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotent_runtime::admin::Admin;
    /// use idempotent_runtime::MemoryStore;
    ///
    /// let admin = Admin::new(Arc::new(MemoryStore::new())).timeout(Duration::from_secs(5));
    /// # let _ = admin;
    /// ```
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Admin {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    async fn call<T>(
        &self,
        what: &'static str,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        crate::engine::bounded(self.timeout, what, call).await
    }

    /// The record of `key`, or `None` when it has none.
    ///
    /// # Errors
    ///
    /// The store's error (a record it cannot read is
    /// [`StoreErrorKind::Corrupt`]).
    pub async fn inspect(&self, key: &Key) -> Result<Option<Inspection>, StoreError> {
        Ok(self
            .call("read", self.store.read(key))
            .await?
            .as_ref()
            .map(Inspection::of))
    }

    /// Frees `key` from a stuck owner: the in-progress record with fence `expected_fence`
    /// becomes released, whether or not its lease ran out. Use it for an owner known to be
    /// gone (a killed process with a long lease); an owner that is still running loses the
    /// key (its completion is refused with `Error::LostOwnership`) and a fenced business write
    /// of its refuses its fence once the next owner wrote.
    ///
    /// # Errors
    ///
    /// The store's error; nothing changed.
    pub async fn force_release(
        &self,
        key: &Key,
        expected_fence: u64,
    ) -> Result<AdminOutcome, StoreError> {
        let outcome = match self.call("read", self.store.read(key)).await? {
            None => AdminOutcome::Missing,
            Some(record) if record.fence != expected_fence => AdminOutcome::FenceMismatch {
                fence: record.fence,
            },
            Some(record) if !matches!(record.state, RecordState::InProgress { .. }) => {
                AdminOutcome::WrongState {
                    state: record.state,
                }
            }
            Some(record) => {
                if self
                    .call("release", self.store.release(key, &record.token))
                    .await?
                {
                    AdminOutcome::Done {
                        fence: record.fence,
                    }
                } else {
                    AdminOutcome::Changed
                }
            }
        };
        self.report("force_release", key, outcome);
        Ok(outcome)
    }

    /// Lets a held key (completed as failed with `on_error = hold`) run again: the record
    /// becomes released, so the next delivery claims it and runs the handler.
    ///
    /// # Errors
    ///
    /// The store's error; nothing changed.
    pub async fn unhold(&self, key: &Key) -> Result<AdminOutcome, StoreError> {
        let outcome = match self.call("read", self.store.read(key)).await? {
            None => AdminOutcome::Missing,
            Some(record) if !is_held(&record) => AdminOutcome::WrongState {
                state: record.state,
            },
            Some(record) => {
                if self
                    .call("reopen", self.store.reopen(key, &record.token))
                    .await?
                {
                    AdminOutcome::Done {
                        fence: record.fence,
                    }
                } else {
                    AdminOutcome::Changed
                }
            }
        };
        self.report("unhold", key, outcome);
        Ok(outcome)
    }

    /// One page of the records that `query` selects. The CLI's `list` pages through them.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use idempotent_runtime::admin::{Admin, ListQuery, StateFilter};
    /// use idempotent_runtime::{ClaimRequest, Key, MemoryStore, Store, Token};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = Arc::new(MemoryStore::new());
    /// let hour = Duration::from_secs(3600);
    /// for id in ["a", "b"] {
    ///     let key = Key::new("payment:capture", 1, &[&id])?;
    ///     store.claim(&ClaimRequest::new(key, Token::generate(), hour, hour)).await?;
    /// }
    /// let admin = Admin::new(store);
    /// let mut query = ListQuery::new("payment:capture")?.state(StateFilter::InProgress);
    /// let mut found = 0;
    /// loop {
    ///     let page = admin.list(&query).await?;
    ///     found += page.records.len();
    ///     match page.next {
    ///         Some(next) => query = query.cursor(next),
    ///         None => break,
    ///     }
    /// }
    /// assert_eq!(found, 2);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The store's error (a cursor of another store is
    /// [`StoreErrorKind::Rejected`]).
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let scan = self.store.scan(&query.prefix, &query.cursor, query.limit);
        let page = self.call("scan", scan).await?;
        let records = page
            .records
            .into_iter()
            .map(|(key, record)| (key, record.map(|r| Inspection::of(&r))))
            .filter(|(_, record)| query.selects(record))
            .collect();
        Ok(ListPage {
            records,
            next: page.next,
        })
    }

    /// Deletes the record of `key`, so the key is as if it had never been claimed: the next
    /// delivery runs the handler again. For a record whose result is wrong, or a value under
    /// the key that is no record (which claims refuse to touch: the key is blocked until it
    /// is deleted). An in-progress record with a live lease is refused
    /// ([`AdminOutcome::WrongState`]): its owner may be running; free it with
    /// [`force_release`](Admin::force_release) first. The store itself checks the lease at
    /// the moment of the delete, so an owner that renews between this call's read and its
    /// delete keeps its claim.
    ///
    /// # Errors
    ///
    /// The store's error; nothing changed.
    pub async fn delete(&self, key: &Key) -> Result<AdminOutcome, StoreError> {
        let outcome = match self.call("read", self.store.read(key)).await {
            Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                if self
                    .call("delete", self.store.delete(key, Expect::Corrupt))
                    .await?
                {
                    AdminOutcome::DeletedCorrupt
                } else {
                    AdminOutcome::Changed
                }
            }
            Err(err) => return Err(err),
            Ok(None) => AdminOutcome::Missing,
            Ok(Some(record)) => self.delete_read(key, &record).await?,
        };
        self.report("delete", key, outcome);
        Ok(outcome)
    }

    async fn delete_read(&self, key: &Key, record: &Record) -> Result<AdminOutcome, StoreError> {
        if Inspection::of(record).is_live_claim() {
            return Ok(AdminOutcome::WrongState {
                state: record.state,
            });
        }
        if self
            .call(
                "delete",
                self.store.delete(key, Expect::Token(&record.token)),
            )
            .await?
        {
            return Ok(AdminOutcome::Done {
                fence: record.fence,
            });
        }
        // The store refused: the record changed, or its owner renewed since the read (the
        // store never deletes a live claim). Say which, as the read would have.
        Ok(match self.call("read", self.store.read(key)).await {
            Ok(Some(now)) if now.token == record.token && Inspection::of(&now).is_live_claim() => {
                AdminOutcome::WrongState { state: now.state }
            }
            _ => AdminOutcome::Changed,
        })
    }

    /// Deletes every record whose key has `prefix`, and every value under such a key that is
    /// no record, a page at a time, as [`delete`](Admin::delete) would, except in-progress
    /// records with a live lease, which are kept and counted. For a prefix whose operations
    /// are retired, or a test's leftovers; records also expire on their own.
    ///
    /// # Errors
    ///
    /// The [`KeyError`](crate::KeyError) of an invalid prefix, as a [`StoreErrorKind::Rejected`] error; the
    /// store's error, with the records deleted so far deleted (purge again to go on).
    pub async fn purge(&self, prefix: &str) -> Result<PurgeReport, StoreError> {
        let query = ListQuery::new(prefix)
            .map_err(|err| StoreError::new(StoreErrorKind::Rejected, err.to_string()))?
            .limit(500);
        let mut report = PurgeReport::default();
        let mut cursor = ScanCursor::start();
        loop {
            let page = self
                .call("scan", self.store.scan(&query.prefix, &cursor, query.limit))
                .await?;
            for (key, record) in page.records {
                match record {
                    Ok(record) => match self.delete_read(&key, &record).await? {
                        AdminOutcome::Done { .. } => report.deleted += 1,
                        AdminOutcome::WrongState { .. } => report.live_claims_kept += 1,
                        _ => report.changed += 1,
                    },
                    Err(err) if err.kind() == StoreErrorKind::Corrupt => {
                        if self
                            .call("delete", self.store.delete(&key, Expect::Corrupt))
                            .await?
                        {
                            report.corrupt_deleted += 1;
                        } else {
                            report.changed += 1;
                        }
                    }
                    Err(err) => return Err(err),
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        let store = self.store.name();
        tracing::info!(
            action = "purge",
            prefix,
            store,
            deleted = report.deleted,
            corrupt_deleted = report.corrupt_deleted,
            live_claims_kept = report.live_claims_kept,
            changed = report.changed,
            "operator action applied"
        );
        crate::metrics::admin_action("purge", store, "done");
        Ok(report)
    }

    fn report(&self, action: &'static str, key: &Key, outcome: AdminOutcome) {
        let store = self.store.name();
        match outcome {
            AdminOutcome::Done { fence } => {
                tracing::info!(action, key = %key, fence, store, "operator action applied");
            }
            AdminOutcome::DeletedCorrupt => {
                tracing::info!(action, key = %key, store, "operator deleted a value that was no record");
            }
            other => {
                tracing::warn!(action, key = %key, store, outcome = other.as_str(), "operator action changed nothing");
            }
        }
        crate::metrics::admin_action(action, store, outcome.as_str());
    }
}
