//! `on_error = <path>` decides per error; `on_error = store` replays a serde error.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, MemoryStore, OnError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum AppError {
    Idempotent(String),
    Timeout,
    Invalid,
}

impl From<idempotency::Error> for AppError {
    fn from(error: idempotency::Error) -> Self {
        AppError::Idempotent(error.to_string())
    }
}

impl AppError {
    fn policy(&self) -> OnError {
        match self {
            AppError::Timeout => OnError::Hold,
            _ => OnError::Release,
        }
    }
}

fn classify(error: &AppError) -> OnError {
    error.policy()
}

struct Request {
    id: u32,
    fail_with: Option<fn() -> AppError>,
}

#[idempotent(prefix = "classify:free", keys = [req.id], ttl = 60, store = store, on_error = classify)]
async fn with_function(store: &Arc<MemoryStore>, req: &Request) -> Result<u32, AppError> {
    match req.fail_with {
        Some(error) => Err(error()),
        None => Ok(req.id),
    }
}

#[idempotent(prefix = "classify:method", keys = [req.id], ttl = 60, store = store, on_error = AppError::policy)]
async fn with_method(store: &Arc<MemoryStore>, req: &Request) -> Result<u32, AppError> {
    match req.fail_with {
        Some(error) => Err(error()),
        None => Ok(req.id),
    }
}

#[idempotent(prefix = "classify:store", keys = [req.id], ttl = 60, store = store, on_error = store)]
async fn stored(store: &Arc<MemoryStore>, req: &Request) -> Result<u32, AppError> {
    match req.fail_with {
        Some(error) => Err(error()),
        None => Ok(req.id),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    let timeout = Request {
        id: 1,
        fail_with: Some(|| AppError::Timeout),
    };
    let invalid = Request {
        id: 2,
        fail_with: Some(|| AppError::Invalid),
    };

    // A held key blocks its duplicates; a released one runs again.
    assert!(matches!(
        with_function(&store, &timeout).await,
        Err(AppError::Timeout)
    ));
    assert!(matches!(
        with_function(&store, &timeout).await,
        Err(AppError::Idempotent(_))
    ));
    assert!(matches!(
        with_method(&store, &invalid).await,
        Err(AppError::Invalid)
    ));
    assert!(matches!(
        with_method(&store, &invalid).await,
        Err(AppError::Invalid)
    ));
    // A stored error is the answer to duplicates.
    assert!(matches!(
        stored(&store, &invalid).await,
        Err(AppError::Invalid)
    ));
    let retry = Request {
        id: 2,
        fail_with: None,
    };
    assert!(matches!(
        stored(&store, &retry).await,
        Err(AppError::Invalid)
    ));
}
