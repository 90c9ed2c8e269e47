//! The handler keeps its doc comments, attributes and visibility.
#![deny(warnings, missing_docs)]

use std::sync::Arc;

use idempotency::MemoryStore;

/// The handlers.
pub mod handlers {
    use idempotency::idempotent;

    /// The application's error.
    #[derive(Debug)]
    pub struct AppError;

    impl From<idempotency::Error> for AppError {
        fn from(_: idempotency::Error) -> Self {
            AppError
        }
    }

    /// Handles one delivery. Without this comment `missing_docs` fails the build.
    #[idempotent(prefix = "docs", keys = [id], ttl = 60, store = store)]
    #[inline]
    #[allow(clippy::needless_lifetimes, clippy::mixed_attributes_style)]
    pub async fn handle<'a>(
        store: &std::sync::Arc<idempotency::MemoryStore>,
        id: &'a str,
    ) -> Result<&'a str, AppError> {
        #![allow(unused_mut)]
        let mut id = id;
        Ok(id)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = Arc::new(MemoryStore::new());
    assert_eq!(handlers::handle(&store, "x").await.unwrap(), "x");
}
