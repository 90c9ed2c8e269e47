//! `on_replay = <path or closure>` is called with the key when a stored result is returned,
//! and not on a fresh run.
#![deny(warnings)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::{idempotent, Key, MemoryStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
enum AppError {
    Idempotent(String),
    Invalid(u32),
}

impl From<idempotency::Error> for AppError {
    fn from(error: idempotency::Error) -> Self {
        AppError::Idempotent(error.to_string())
    }
}

static REPLAYS: AtomicUsize = AtomicUsize::new(0);
static STORED_ERRORS: AtomicUsize = AtomicUsize::new(0);

fn count_replay(_key: &Key) {
    REPLAYS.fetch_add(1, Ordering::SeqCst);
}

#[idempotent(prefix = "hook:value", keys = [id], ttl = 60, store = store, replay, on_replay = count_replay)]
async fn value(store: &Arc<MemoryStore>, id: u32) -> Result<u32, idempotency::Error> {
    Ok(id * 2)
}

#[idempotent(
    prefix = "hook:error",
    keys = [id],
    ttl = 60,
    store = store,
    on_error = store,
    on_replay = |_| {
        STORED_ERRORS.fetch_add(1, Ordering::SeqCst);
    }
)]
async fn error(store: &Arc<MemoryStore>, id: u32) -> Result<u32, AppError> {
    Err(AppError::Invalid(id))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    assert_eq!(value(&store, 4).await.unwrap(), 8);
    assert_eq!(REPLAYS.load(Ordering::SeqCst), 0);
    assert_eq!(value(&store, 4).await.unwrap(), 8);
    assert_eq!(value(&store, 4).await.unwrap(), 8);
    assert_eq!(REPLAYS.load(Ordering::SeqCst), 2);

    assert!(matches!(error(&store, 1).await, Err(AppError::Invalid(1))));
    assert!(matches!(error(&store, 1).await, Err(AppError::Invalid(1))));
    assert_eq!(STORED_ERRORS.load(Ordering::SeqCst), 1);
}
