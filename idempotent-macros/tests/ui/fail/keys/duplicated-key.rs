#![allow(dead_code)]

use idempotency::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct OrderMessage {
    order_id: String,
    activity_id: u64,
}

#[idempotent(prefix = "order:consume", keys = [msg.order_id, msg.activity_id, msg.order_id], ttl = 3600)]
async fn on_order(msg: &OrderMessage) -> Result<u64, AppError> {
    Ok(msg.activity_id)
}

fn main() {}
