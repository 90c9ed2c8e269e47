//! The operator's side: look at a key's record, free a key whose owner is stuck, let a held
//! key run again. Separate from the hot path: handlers never call it.
//!
//! Every action reads the record, checks what the operator expects (the fence of the stuck
//! owner, the held state), and then writes only if the record still has the token it read:
//! a record that changed in between (its owner completed, another owner took the key) is left
//! alone and the action answers [`AdminOutcome::Changed`]. Each action is logged (a tracing
//! event at `info`, or `warn` when nothing was changed) and, with the feature `metrics`,
//! counted as `idempotency.admin.actions` (labels `action`, `store`, `outcome`).
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

use crate::codec;
use crate::error::StoreError;
use crate::key::Key;
use crate::store::{IntoStore, Record, RecordState, SharedStore};

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
}

impl Inspection {
    fn of(record: &Record) -> Inspection {
        Inspection {
            state: record.state,
            fence: record.fence,
            held: is_held(record),
            result_size: record.result.as_ref().map(Vec::len),
            fingerprint: record.fingerprint.is_some(),
        }
    }
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
    /// Done: the record is released, so the next claim acquires the key with a fence above
    /// `fence`; a stale owner's completion or renewal is refused.
    Done {
        /// The record's fence.
        fence: u64,
    },
    /// The key has no record (never claimed, expired, purged): nothing to do.
    Missing,
    /// The record's fence is not the one the operator expected (another owner holds the key
    /// now): nothing changed.
    FenceMismatch {
        /// The record's fence.
        fence: u64,
    },
    /// The record is not in a state the action applies to (`force_release` needs an
    /// in-progress record, `unhold` a held one): nothing changed.
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
            AdminOutcome::Missing => "missing",
            AdminOutcome::FenceMismatch { .. } => "fence_mismatch",
            AdminOutcome::WrongState { .. } => "wrong_state",
            AdminOutcome::Changed => "changed",
        }
    }
}

/// The operator's API on a store (see the [module docs](self)).
#[derive(Clone)]
pub struct Admin {
    store: SharedStore,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("store", &self.store.name())
            .finish()
    }
}

impl Admin {
    /// The operator's API on `store`.
    pub fn new(store: impl IntoStore) -> Admin {
        Admin {
            store: store.into_store(),
        }
    }

    /// The record of `key`, or `None` when it has none.
    ///
    /// # Errors
    ///
    /// The store's error (a record it cannot read is
    /// [`StoreErrorKind::Corrupt`](crate::StoreErrorKind::Corrupt)).
    pub async fn inspect(&self, key: &Key) -> Result<Option<Inspection>, StoreError> {
        Ok(self.store.read(key).await?.as_ref().map(Inspection::of))
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
        let outcome = match self.store.read(key).await? {
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
                if self.store.release(key, &record.token).await? {
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
    /// The store's error; nothing changed. A third-party store that does not implement
    /// [`Store::reopen`](crate::Store::reopen) refuses with
    /// [`StoreErrorKind::Protocol`](crate::StoreErrorKind::Protocol).
    pub async fn unhold(&self, key: &Key) -> Result<AdminOutcome, StoreError> {
        let outcome = match self.store.read(key).await? {
            None => AdminOutcome::Missing,
            Some(record) if !is_held(&record) => AdminOutcome::WrongState {
                state: record.state,
            },
            Some(record) => {
                if self.store.reopen(key, &record.token).await? {
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

    fn report(&self, action: &'static str, key: &Key, outcome: AdminOutcome) {
        let store = self.store.name();
        match outcome {
            AdminOutcome::Done { fence } => {
                tracing::info!(action, key = %key, fence, store, "operator action applied");
            }
            other => {
                tracing::warn!(action, key = %key, store, outcome = other.as_str(), "operator action changed nothing");
            }
        }
        crate::metrics::admin_action(action, store, outcome.as_str());
    }
}
