//! The handler's future is `Send` when its parameters are, so it can be spawned.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct OrderMessage {
    order_id: String,
    amount: u64,
}

async fn is_consumed(_: &str) -> Result<bool, AppError> {
    Ok(false)
}

#[idempotent(
    prefix = "order:consume",
    keys = [msg.order_id],
    ttl = 60,
    store = store,
    fingerprint = [msg.amount],
    done = is_consumed(&msg.order_id),
)]
async fn on_order(store: Arc<MemoryStore>, msg: OrderMessage) -> Result<u64, AppError> {
    tokio::task::yield_now().await;
    Ok(msg.amount)
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

#[tokio::main]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    let msg = OrderMessage {
        order_id: "A-1".to_owned(),
        amount: 5,
    };
    let task = tokio::spawn(assert_send(on_order(store, msg)));
    assert_eq!(task.await.unwrap().unwrap(), 5);
}
