#![allow(dead_code)]

use idempotency::idempotent;

fn count(_key: &str) {}

#[idempotent(prefix = "order:consume", keys = [order_id], ttl = 3600, replay, on_replay = count)]
async fn on_order(order_id: &str) -> Result<u64, idempotency::Error> {
    let _ = order_id;
    Ok(1)
}

fn main() {}
