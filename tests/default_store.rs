//! The process-default store: unset, handlers fail closed with `Error::NoStore` (never a
//! silent in-memory fallback); set once, handlers use it; a second set is refused.
//!
//! Its own test binary, because the default store is process-wide.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::{idempotent, Action, Error, MemoryStore};

#[derive(Debug)]
enum AppError {
    Idem(Error),
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(e)
    }
}

static EXECUTIONS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(prefix = "default-store", keys = [id], ttl = 60)]
async fn handler(id: u64) -> Result<u64, AppError> {
    EXECUTIONS.fetch_add(1, Ordering::SeqCst);
    Ok(id)
}

#[tokio::test]
async fn handlers_use_the_default_store_once_it_is_set() {
    match handler(1).await {
        Err(AppError::Idem(err @ Error::NoStore)) => assert_eq!(err.action(), Action::Redeliver),
        other => panic!("a handler ran without a store: {other:?}"),
    }
    assert_eq!(EXECUTIONS.load(Ordering::SeqCst), 0);

    let store = Arc::new(MemoryStore::new());
    idempotency::set_default_store(store.clone()).unwrap();
    assert_eq!(handler(1).await.unwrap(), 1);
    assert!(matches!(
        handler(1).await,
        Err(AppError::Idem(Error::Duplicate { .. }))
    ));
    assert_eq!(EXECUTIONS.load(Ordering::SeqCst), 1);
    assert_eq!(store.len(), 1);

    // The first default stays.
    assert!(idempotency::set_default_store(Arc::new(MemoryStore::new())).is_err());
    assert!(matches!(
        handler(1).await,
        Err(AppError::Idem(Error::Duplicate { .. }))
    ));
}
