//! `crate = idempotent_runtime`: the attribute used with the runtime crate and the macro
//! crate directly, without the facade.
#![deny(warnings)]

use std::sync::Arc;

use idempotent_macros::idempotent;
use idempotent_runtime::MemoryStore;

#[derive(Debug)]
struct AppError(idempotent_runtime::Error);

impl From<idempotent_runtime::Error> for AppError {
    fn from(error: idempotent_runtime::Error) -> Self {
        AppError(error)
    }
}

#[idempotent(
    crate = idempotent_runtime,
    prefix = "order:consume",
    keys = [order_id],
    ttl = 60,
    on_in_progress = reject,
    on_store_error = fail_closed,
    on_error = hold
)]
async fn consume(order_id: u64) -> Result<u64, AppError> {
    Ok(order_id * 10)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    idempotent_runtime::set_default_store(Arc::new(MemoryStore::new())).unwrap();
    assert_eq!(consume(7).await.unwrap(), 70);
    assert!(consume(7).await.unwrap_err().0.is_duplicate());
}
