//! Handlers with a `where` clause, lifetimes, an `impl Trait` parameter and an `impl Trait`
//! in the return type.
#![deny(warnings)]

use std::fmt::Display;
use std::sync::Arc;

use idempotency::{idempotent, KeyPart, MemoryStore};

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct Envelope<'a, K> {
    key: &'a K,
    note: &'a str,
}

#[idempotent(prefix = "where", keys = [envelope.key, envelope.note], ttl = 60, store = store)]
async fn handle<'a, K>(
    store: &Arc<MemoryStore>,
    envelope: Envelope<'a, K>,
    label: impl Display,
) -> Result<String, AppError>
where
    K: KeyPart + Display + Sync,
{
    Ok(format!("{label}: {}", envelope.key))
}

#[idempotent(prefix = "opaque", keys = [id], ttl = 60, store = store)]
async fn opaque(store: &Arc<MemoryStore>, id: u64) -> Result<impl Display, AppError> {
    Ok(id * 2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    let envelope = Envelope {
        key: &42u64,
        note: "first",
    };
    assert_eq!(
        handle(&store, envelope, "order").await.unwrap(),
        "order: 42"
    );
    assert_eq!(opaque(&store, 21).await.unwrap().to_string(), "42");
}
