#![allow(dead_code)]

use idempotency::{idempotent, Key};

fn count(_key: &Key) {}

#[idempotent(prefix = "order:consume", keys = [order_id], ttl = 3600, on_replay = count)]
async fn on_order(order_id: &str) -> Result<(), idempotency::Error> {
    let _ = order_id;
    Ok(())
}

fn main() {}
