#![allow(dead_code)]

use idempotency::idempotent;

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

#[idempotent(crate = ::no_such_crate, prefix = "order:consume", keys = [id], ttl = 60)]
async fn on_order(id: u64) -> Result<u64, AppError> {
    Ok(id)
}

fn main() {}
