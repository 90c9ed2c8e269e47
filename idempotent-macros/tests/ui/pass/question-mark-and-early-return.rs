//! A body that uses `?` (with a conversion into the handler's error) and early `return`s.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};

#[derive(Debug)]
enum AppError {
    Idempotent,
    Parse(std::num::ParseIntError),
}

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError::Idempotent
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(error: std::num::ParseIntError) -> Self {
        AppError::Parse(error)
    }
}

#[idempotent(prefix = "parse", keys = [text], ttl = 60, store = store)]
async fn parse(store: &Arc<MemoryStore>, text: &str) -> Result<u32, AppError> {
    if text.is_empty() {
        return Ok(0);
    }
    let value: u32 = text.trim().parse()?;
    if value > 100 {
        return Err(AppError::Idempotent);
    }
    Ok(value * 2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    assert_eq!(parse(&store, "21").await.unwrap(), 42);
    match parse(&store, "x").await {
        Err(AppError::Parse(error)) => {
            assert_eq!(error.to_string(), "invalid digit found in string")
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    // The failed run released its claim: the same key runs again.
    assert!(matches!(parse(&store, "x").await, Err(AppError::Parse(_))));
    assert!(matches!(
        parse(&store, "101").await,
        Err(AppError::Idempotent)
    ));
}
