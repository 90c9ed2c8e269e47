#![allow(dead_code)]

use idempotent::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idempotent::Error> for AppError {
    fn from(_: idempotent::Error) -> Self {
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
