//! Generic handlers: a generic key type and a generic output type.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, KeyPart, MemoryStore};

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

#[idempotent(prefix = "generic", keys = [id], ttl = 60, store = store)]
async fn handle<K: KeyPart + ?Sized, T: Clone>(
    store: &Arc<MemoryStore>,
    id: &K,
    value: &T,
) -> Result<T, AppError> {
    Ok(value.clone())
}

#[idempotent(prefix = "generic:pair", keys = [pair.0, pair.1], ttl = 60, store = store)]
async fn pair<'a, A: KeyPart, B: KeyPart>(
    store: &Arc<MemoryStore>,
    pair: (&'a A, B),
) -> Result<&'a A, AppError> {
    Ok(pair.0)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    assert_eq!(handle(&store, "id-1", &vec![1, 2]).await.unwrap(), [1, 2]);
    assert_eq!(handle(&store, &5u32, &'x').await.unwrap(), 'x');
    assert_eq!(*pair(&store, (&1u8, 2u16)).await.unwrap(), 1);
}
