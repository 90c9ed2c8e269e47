//! One constructor that picks the backend from a URL's scheme.

use crate::error::StoreError;
use crate::store::SharedStore;

/// Why [`connect`] could not build a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL's scheme names no backend.
    #[error("unsupported store URL `{url}`: expected `memory:`, `redis://`, `rediss://`, `redis+cluster://`, `postgres://`, `mysql://` or `sqlite:`")]
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

/// Builds a store from a URL, choosing the backend by scheme:
///
/// | URL | backend | feature |
/// |---|---|---|
/// | `memory:` | [`MemoryStore`](crate::MemoryStore) | `memory` |
/// | `redis://host:6379/0`, `rediss://...` | `RedisStore` | `redis` |
/// | `redis+cluster://host:7000,host:7001` | `RedisStore` on a cluster | `redis` |
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
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idempotent_runtime::store::ConnectError> {
/// let store = idempotent_runtime::store::connect("memory:").await?;
/// # let _ = store;
/// assert!(idempotent_runtime::store::connect("ftp://x").await.is_err());
/// # Ok(()) }
/// ```
pub async fn connect(url: &str) -> Result<SharedStore, ConnectError> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "memory" => memory(),
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => redis(url).await,
        "postgres" | "postgresql" => sql(url, "postgres", "postgres").await,
        "mysql" | "mariadb" => sql(url, "mysql", "mysql").await,
        "sqlite" => sql(url, "sqlite", "sqlite").await,
        _ => Err(ConnectError::UnknownScheme { url: redact(url) }),
    }
}

#[cfg(feature = "memory")]
fn memory() -> Result<SharedStore, ConnectError> {
    Ok(std::sync::Arc::new(crate::MemoryStore::new()))
}

#[cfg(not(feature = "memory"))]
fn memory() -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled {
        scheme: "memory",
        feature: "memory",
    })
}

#[cfg(feature = "redis")]
async fn redis(url: &str) -> Result<SharedStore, ConnectError> {
    Ok(std::sync::Arc::new(
        crate::store::redis::RedisStore::connect(url).await?,
    ))
}

#[cfg(not(feature = "redis"))]
async fn redis(_: &str) -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled {
        scheme: "redis",
        feature: "redis",
    })
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
async fn sql(
    url: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    crate::store::sql::connect(url, scheme, feature).await
}

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
async fn sql(
    _: &str,
    scheme: &'static str,
    feature: &'static str,
) -> Result<SharedStore, ConnectError> {
    Err(ConnectError::FeatureDisabled { scheme, feature })
}

/// The URL with any password replaced, for error messages.
pub(crate) fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            let userinfo = &url[start + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..start + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("redis://user:secret@host:6379"),
            "redis://user:***@host:6379"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact("postgres://u@h/db"), "postgres://u@h/db");
    }
}
