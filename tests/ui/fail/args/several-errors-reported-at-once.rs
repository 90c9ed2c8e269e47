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

#[idempotent(prefix = "", keys = [msg.order_id, message.activity_id], ttl = 0, lease = 0)]
fn on_order(msg: &OrderMessage) -> Result<u64, AppError> {
    Ok(msg.activity_id)
}

fn main() {}
