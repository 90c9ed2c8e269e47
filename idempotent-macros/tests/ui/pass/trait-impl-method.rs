//! A handler that implements a trait's `async fn`.
#![deny(warnings)]

use std::sync::Arc;

use idempotency::{idempotent, MemoryStore};

#[derive(Debug)]
struct AppError;

impl From<idempotency::Error> for AppError {
    fn from(_: idempotency::Error) -> Self {
        AppError
    }
}

struct Message {
    id: u64,
}

trait Handler {
    #[allow(async_fn_in_trait)]
    async fn handle(&self, msg: &Message) -> Result<u64, AppError>;
}

struct Doubler {
    store: Arc<MemoryStore>,
}

impl Handler for Doubler {
    #[idempotent(prefix = "double", keys = [msg.id], ttl = 60, store = self.store)]
    async fn handle(&self, msg: &Message) -> Result<u64, AppError> {
        Ok(msg.id * 2)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let handler = Doubler {
        store: Arc::new(MemoryStore::new()),
    };
    assert_eq!(handler.handle(&Message { id: 21 }).await.unwrap(), 42);
}
