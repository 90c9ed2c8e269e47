//! One constructor that picks the backend from a URL's scheme.

use crate::error::StoreError;
use crate::store::redact::redact;
use crate::store::SharedOperatorStore;

/// Why [`connect`] could not build a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL's scheme names no backend.
    #[error("unsupported store URL `{url}`: expected `memory:`, `redis://`, `rediss://`, `redis+cluster://`, `redis+sentinel://`, `postgres://`, `mysql://` or `sqlite:`")]
    UnknownScheme {
        /// The URL, without credentials.
        url: String,
    },
    /// The backend for the URL's scheme is not compiled in.
    #[error("`{scheme}` URLs need the `{feature}` feature of `idempotency` (add `features = [\"{feature}\"]` to the dependency)")]
    FeatureDisabled {
        /// The URL's scheme.
        scheme: &'static str,
        /// The cargo feature that provides it.
        feature: &'static str,
    },
    /// The backend could not connect or set itself up.
    #[error("could not connect to the idempotency store")]
    Store(#[from] StoreError),
}

/// Builds a store from a URL, choosing the backend by scheme. The store has the operator's
/// methods too ([`SharedOperatorStore`]): hand it to [`Admin`](crate::admin::Admin) as it is,
/// and to handlers through [`IntoStore`](crate::IntoStore) (every method that takes a store
/// does), or as a [`SharedStore`](crate::SharedStore) with `.into_store()`.
///
/// | URL | backend | feature |
/// |---|---|---|
/// | `memory:` | [`MemoryStore`](crate::MemoryStore) | `memory` |
/// | `redis://host:6379/0`, `rediss://...` | `RedisStore` | `redis` |
/// | `redis+cluster://host:7000,host:7001` | `RedisStore` on a cluster | `redis` |
/// | `redis+sentinel://host:26379,host:26380/service` | `RedisStore` on the primary Sentinel names | `redis` |
/// | `postgres://user@host/db` | `PostgresStore` | `postgres` |
/// | `mysql://user@host/db` | `MySqlStore` | `mysql` |
/// | `sqlite:path.db`, `sqlite::memory:` | `SqliteStore` | `sqlite` |
///
/// # Errors
///
/// [`ConnectError`]: an unknown scheme, a backend not compiled in, or a store that cannot be
/// reached or set up.
///
/// ```
/// use std::time::Duration;
/// use idempotent_runtime::admin::Admin;
/// use idempotent_runtime::{Idempotency, IntoStore, SharedStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_runtime::store::ConnectError> {
/// let store = idempotent_runtime::store::connect("memory:").await?;
/// let guard = Idempotency::new(Duration::from_secs(3600)).store(store.clone());
/// let admin = Admin::new(store.clone());
/// let for_handlers: SharedStore = store.into_store();
/// # let _ = (guard, admin, for_handlers);
/// assert!(idempotent_runtime::store::connect("ftp://x").await.is_err());
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<SharedOperatorStore, ConnectError> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "memory" => memory(),
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" | "redis+sentinel" => {
            redis(url).await
        }
        "postgres" | "postgresql" => postgres(url).await,
        "mysql" | "mariadb" => mysql(url).await,
        "sqlite" => sqlite(url).await,
        _ => Err(ConnectError::UnknownScheme { url: redact(url) }),
    }
}

#[cfg(feature = "memory")]
fn memory() -> Result<SharedOperatorStore, ConnectError> {
    Ok(std::sync::Arc::new(super::memory::MemoryStore::new()))
}

#[cfg(not(feature = "memory"))]
fn memory() -> Result<SharedOperatorStore, ConnectError> {
    Err(ConnectError::FeatureDisabled {
        scheme: "memory",
        feature: "memory",
    })
}

/// One server backend of [`connect`]'s table: `$backend(url)` calls `$connect(url)` when
/// `$feature` (the cargo feature, also the scheme errors name) is compiled in; without it the
/// URL fails with [`ConnectError::FeatureDisabled`].
macro_rules! backend {
    ($backend:ident, $feature:literal, $connect:path) => {
        #[cfg(feature = $feature)]
        async fn $backend(url: &str) -> Result<SharedOperatorStore, ConnectError> {
            Ok(std::sync::Arc::new($connect(url).await?))
        }

        #[cfg(not(feature = $feature))]
        async fn $backend(_: &str) -> Result<SharedOperatorStore, ConnectError> {
            Err(ConnectError::FeatureDisabled {
                scheme: $feature,
                feature: $feature,
            })
        }
    };
}

backend!(redis, "redis", super::redis::RedisStore::connect);
backend!(postgres, "postgres", super::sql::PostgresStore::connect);
backend!(mysql, "mysql", super::sql::MySqlStore::connect);
backend!(sqlite, "sqlite", super::sql::SqliteStore::connect);
