//! The process-default store, set once at start-up.

use std::sync::OnceLock;

use crate::store::{IntoStore, SharedStore};

static DEFAULT: OnceLock<SharedStore> = OnceLock::new();

/// Returned by [`set_default_store`] when a default store was already set.
#[derive(Debug, thiserror::Error)]
#[error("the default idempotency store is already set")]
#[non_exhaustive]
pub struct AlreadySet;

/// Sets the store that handlers use when their attribute names none. Call it once, at
/// start-up, before the first handler runs. A handler that runs before any store is set
/// fails with [`Error::NoStore`](crate::Error::NoStore): there is no silent in-memory
/// fallback.
///
/// # Errors
///
/// [`AlreadySet`] if a default store was set before; the first one stays.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::{set_default_store, MemoryStore};
///
/// set_default_store(Arc::new(MemoryStore::new()))?;
/// assert!(set_default_store(Arc::new(MemoryStore::new())).is_err());
/// # Ok::<(), idempotent_runtime::AlreadySet>(())
/// ```
pub fn set_default_store(store: impl IntoStore) -> Result<(), AlreadySet> {
    DEFAULT.set(store.into_store()).map_err(|_| AlreadySet)
}

/// The process-default store, if one was set.
pub fn default_store() -> Option<SharedStore> {
    DEFAULT.get().cloned()
}
