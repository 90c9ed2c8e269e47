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

struct Receipt {
    order_id: String,
}

#[idempotent(prefix = "order:consume", keys = [msg.order_id], ttl = 3600, replay)]
async fn on_order(msg: &OrderMessage) -> Result<Receipt, AppError> {
    Ok(Receipt {
        order_id: msg.order_id.clone(),
    })
}

fn main() {}
