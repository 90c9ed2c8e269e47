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
    parts: Vec<String>,
    activity_id: u64,
}

impl OrderMessage {
    fn part(&self, index: usize) -> &str {
        &self.parts[index]
    }
}

// A method call in a key takes literal arguments only: the key is a path into the
// parameters, not a computation.
#[idempotent(prefix = "order:consume", keys = [msg.part(index)], ttl = 3600)]
async fn on_order(msg: &OrderMessage, index: usize) -> Result<u64, AppError> {
    Ok(msg.activity_id + index as u64)
}

fn main() {}
