//! `crate = path` points the expansion at the facade under another name (a renamed
//! dependency: `idem = { package = "idempotency", ... }` in Cargo.toml).
#![deny(warnings)]

extern crate idempotency as idem;

use std::sync::Arc;

use idem::{idempotent, MemoryStore};

#[derive(Debug)]
struct AppError(idem::Error);

impl From<idem::Error> for AppError {
    fn from(error: idem::Error) -> Self {
        AppError(error)
    }
}

#[idempotent(crate = ::idem, prefix = "coupon:grant", keys = [user], ttl = 60, replay)]
async fn grant(user: &str) -> Result<String, AppError> {
    Ok(format!("coupon for {user}"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    idem::set_default_store(Arc::new(MemoryStore::new())).unwrap();
    assert_eq!(grant("u-1").await.unwrap(), "coupon for u-1");
    assert_eq!(grant("u-1").await.unwrap(), "coupon for u-1");
}
