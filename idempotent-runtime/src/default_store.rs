//! The process-default store, set once at start-up, and a default scoped to one future (for
//! the application's tests).

use std::future::Future;
use std::sync::OnceLock;

use crate::store::{IntoStore, SharedStore};

static DEFAULT: OnceLock<SharedStore> = OnceLock::new();

tokio::task_local! {
    static SCOPED: SharedStore;
}

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

/// The default store: the one [`with_default_store`] scoped to the running future, else the
/// one [`set_default_store`] set, if any.
pub fn default_store() -> Option<SharedStore> {
    SCOPED
        .try_with(SharedStore::clone)
        .ok()
        .or_else(|| DEFAULT.get().cloned())
}

/// Runs `fut` with `store` as the default store of the handlers it calls, in place of the
/// process default: the switch for an application's own tests, so each test runs its
/// handlers on a fresh in-memory store (no Redis, no shared state between tests run in
/// parallel) without changing the handlers.
///
/// The scope covers `fut` and what it awaits, not tasks it spawns (give those their own
/// scope); the tasks the HTTP layer and the broker loops spawn for handlers carry it.
///
/// ```
/// use std::sync::Arc;
/// use idempotent_runtime::{with_default_store, Error, Idempotency, Key, MemoryStore};
///
/// // The application's handler, using the default store.
/// async fn grant_coupon(user: &str) -> Result<(), Error> {
///     let key = Key::new("coupon:grant", 1, &[&user])?;
///     Idempotency::new(std::time::Duration::from_secs(60)).run(key, async { Ok(()) }).await
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // In a test: a store of the test's own.
/// with_default_store(Arc::new(MemoryStore::new()), async {
///     grant_coupon("user-7").await.unwrap();
///     assert!(grant_coupon("user-7").await.unwrap_err().is_duplicate());
/// })
/// .await;
/// # }
/// ```
pub async fn with_default_store<F: Future>(store: impl IntoStore, fut: F) -> F::Output {
    SCOPED.scope(store.into_store(), fut).await
}

/// The store [`with_default_store`] scoped to the running future, if any: to carry into a
/// task spawned for it ([`carry`]).
#[cfg(any(feature = "http", feature = "rabbitmq", feature = "nats"))]
pub(crate) fn scoped() -> Option<SharedStore> {
    SCOPED.try_with(SharedStore::clone).ok()
}

/// `fut` in the scope of `store` (from [`scoped`]), or as it is.
#[cfg(any(feature = "http", feature = "rabbitmq", feature = "nats"))]
pub(crate) async fn carry<F: Future>(store: Option<SharedStore>, fut: F) -> F::Output {
    match store {
        Some(store) => SCOPED.scope(store, fut).await,
        None => fut.await,
    }
}
