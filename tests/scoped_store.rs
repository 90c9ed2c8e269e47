//! `with_default_store`: a default store scoped to one future, the switch for an
//! application's own tests. No process default is ever set in this binary, so outside a
//! scope handlers fail closed with `Error::NoStore`.

#![allow(clippy::unwrap_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::{idempotent, with_default_store, Error, Idempotency, MemoryStore};
use tower::ServiceExt;

static EXECUTIONS: AtomicUsize = AtomicUsize::new(0);

#[idempotent(prefix = "scoped", keys = [id], ttl = 60)]
async fn handler(id: u64) -> Result<u64, Error> {
    EXECUTIONS.fetch_add(1, Ordering::SeqCst);
    Ok(id)
}

/// Each scope is a store of its own: the same key runs once per scope, its duplicate is
/// filtered inside the scope, and outside any scope there is no store.
#[tokio::test]
async fn each_scope_has_its_own_store() {
    let first = Arc::new(MemoryStore::new());
    with_default_store(first.clone(), async {
        assert_eq!(handler(1).await.unwrap(), 1);
        assert!(handler(1).await.unwrap_err().is_duplicate());
    })
    .await;
    assert_eq!(first.len(), 1);
    with_default_store(Arc::new(MemoryStore::new()), async {
        assert_eq!(handler(1).await.unwrap(), 1);
    })
    .await;
    assert_eq!(EXECUTIONS.load(Ordering::SeqCst), 2);
    assert!(matches!(handler(1).await, Err(Error::NoStore)));
    assert_eq!(EXECUTIONS.load(Ordering::SeqCst), 2);
}

/// The HTTP layer runs handlers in tasks of its own; a scoped store reaches them.
#[tokio::test]
async fn the_scope_reaches_the_http_layers_tasks() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "created") }
            }),
        )
        .layer(IdempotencyLayer::new(
            Idempotency::new(Duration::from_secs(60)),
            |_: &http::request::Parts| Some(String::new()),
        ));
    let post_order = || {
        Request::post("/orders")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap()
    };
    let store = Arc::new(MemoryStore::new());
    with_default_store(store.clone(), async {
        let first = app.clone().oneshot(post_order()).await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let again = app.clone().oneshot(post_order()).await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true");
    })
    .await;
    assert_eq!(store.len(), 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // Outside the scope there is no store: the layer answers 500, nothing runs.
    let outside = app.oneshot(post_order()).await.unwrap();
    assert_eq!(outside.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
