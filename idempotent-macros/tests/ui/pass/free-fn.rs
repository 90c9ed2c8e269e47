//! A free `async fn` handler: the body runs once per key, and a duplicate gets
//! `Error::Duplicate` through the handler's own error type.
#![deny(warnings)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};

#[derive(Debug)]
enum AppError {
    Idempotent(idempotency::Error),
}

impl From<idempotency::Error> for AppError {
    fn from(error: idempotency::Error) -> Self {
        AppError::Idempotent(error)
    }
}

struct OrderMessage {
    order_id: String,
    activity_id: u64,
}

static RUNS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id], ttl = 3600)]
async fn on_order(msg: &OrderMessage) -> Result<u64, AppError> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    Ok(msg.activity_id)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    idempotency::set_default_store(Arc::new(MemoryStore::new())).unwrap();
    let msg = OrderMessage {
        order_id: "A-100".to_owned(),
        activity_id: 7,
    };

    assert_eq!(on_order(&msg).await.unwrap(), 7);
    match on_order(&msg).await {
        Err(AppError::Idempotent(error)) => assert!(error.is_duplicate(), "{error}"),
        other => panic!("expected a duplicate, got {other:?}"),
    }
    let other = OrderMessage {
        order_id: "A-100".to_owned(),
        activity_id: 8,
    };
    assert_eq!(on_order(&other).await.unwrap(), 8);
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);
}
