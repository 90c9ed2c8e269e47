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

fn classify(_: AppError) -> bool {
    true
}

#[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, on_error = classify)]
async fn on_order(msg: &OrderMessage) -> Result<u64, AppError> {
    Ok(msg.activity_id)
}

fn main() {}
