//! The HTTP layer when things go wrong, over real HTTP (an axum server on 127.0.0.1 and a real
//! HTTP/1.1 client) on the memory store, Redis and PostgreSQL: a handler that panics, a client
//! that hangs up while its handler runs, a `Retry-After` setting out of range.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/http_harness.rs"]
mod http_harness;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::routing::post;
use axum::Router;
use http_harness::{send, serve, serve_wrapped, Backend, BACKENDS};
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;

#[derive(Default)]
struct Effects {
    runs: AtomicUsize,
    /// `/slow` says here that it reached its gate.
    at_gate: Notify,
    /// `/slow` waits here until the test lets it finish.
    gate: Notify,
    /// `/slow` says here that it finished.
    finished: Notify,
    /// The request's future (outside the layer) was dropped or finished.
    request_ended: Notify,
}

fn app(effects: Arc<Effects>) -> Router {
    /// Panics on its first run, `201` after.
    async fn boom(State(effects): State<Arc<Effects>>) -> (StatusCode, String) {
        let n = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            panic!("the handler's first run panics");
        }
        (StatusCode::CREATED, format!("run {n}"))
    }
    async fn slow(State(effects): State<Arc<Effects>>) -> (StatusCode, String) {
        effects.at_gate.notify_one();
        effects.gate.notified().await;
        let n = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
        effects.finished.notify_one();
        (StatusCode::CREATED, format!("slow {n}"))
    }
    Router::new()
        .route("/boom", post(boom))
        .route("/slow", post(slow))
        .with_state(effects)
}

/// Outside the layer: says when the server is done with a request's future.
fn watch_requests(effects: Arc<Effects>) -> impl FnOnce(Router) -> Router {
    struct Ended(Arc<Effects>);
    impl Drop for Ended {
        fn drop(&mut self) {
            self.0.request_ended.notify_one();
        }
    }
    move |router| {
        router.layer(axum::middleware::from_fn(
            move |request: Request, next: Next| {
                let ended = Ended(effects.clone());
                async move {
                    let _ended = ended;
                    next.run(request).await
                }
            },
        ))
    }
}

/// A handler that panics is answered `500 internal` (the connection is not dropped) and its
/// key is released: the retry runs the handler, and the retry after it is a replay.
#[tokio::test]
async fn a_panicking_handler_is_500_and_releases_its_key() {
    for backend in BACKENDS {
        let effects = Arc::new(Effects::default());
        let server = serve(backend, app(effects.clone()), |layer| layer).await;
        let first = send(server.post("/boom", "k")).await;
        assert_eq!(
            first.status,
            StatusCode::INTERNAL_SERVER_ERROR,
            "{backend:?}"
        );
        assert_eq!(first.problem(), "internal");
        let retry = send(server.post("/boom", "k")).await;
        assert_eq!(
            (retry.status, retry.text()),
            (StatusCode::CREATED, "run 2".into()),
            "{backend:?}"
        );
        assert!(!retry.replayed());
        let again = send(server.post("/boom", "k")).await;
        assert!(again.replayed(), "{backend:?}");
        assert_eq!(again.body, retry.body);
        assert_eq!(effects.runs.load(Ordering::SeqCst), 2);
        let counts = server.layer.counts();
        assert_eq!(
            (counts.rejected, counts.fresh, counts.replayed),
            (1, 1, 1),
            "{backend:?}"
        );
    }
}

/// A fresh run whose client hung up while the handler ran is counted once the handler's
/// response is stored, though the server dropped the request's future; the retry is counted
/// as a replay. Exact counts, one run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_up_clients_fresh_run_is_counted() {
    for backend in BACKENDS {
        let effects = Arc::new(Effects::default());
        let server = serve_wrapped(
            backend,
            app(effects.clone()),
            |layer| layer,
            watch_requests(effects.clone()),
        )
        .await;
        let at_gate = effects.at_gate.notified();
        // A client of its own on a connection of its own, that it closes.
        let mut client = tokio::net::TcpStream::connect(server.base.trim_start_matches("http://"))
            .await
            .unwrap();
        let request = "POST /slow HTTP/1.1\r\nhost: test\r\nx-tenant: a\r\n\
                       idempotency-key: k\r\ncontent-length: 0\r\n\r\n";
        client.write_all(request.as_bytes()).await.unwrap();
        at_gate.await;
        // The client leaves; the server drops the request's future.
        let ended = effects.request_ended.notified();
        drop(client);
        tokio::time::timeout(Duration::from_secs(10), ended)
            .await
            .expect("the server noticed the hang-up");
        let finished = effects.finished.notified();
        effects.gate.notify_one();
        tokio::time::timeout(Duration::from_secs(30), finished)
            .await
            .expect("the handler ran on to its end after its client left");
        assert!(server.layer.shutdown(Duration::from_secs(10)).await);
        let counts = server.layer.counts();
        assert_eq!(
            (counts.fresh, counts.replayed, counts.rejected),
            (1, 0, 0),
            "{backend:?}"
        );
        let retry = send(server.post("/slow", "k")).await;
        assert_eq!(retry.text(), "slow 1", "{backend:?}");
        assert!(retry.replayed());
        let counts = server.layer.counts();
        assert_eq!((counts.fresh, counts.replayed), (1, 1), "{backend:?}");
        assert_eq!(effects.runs.load(Ordering::SeqCst), 1);
    }
}

/// `retry_after(Duration::MAX)` is clamped to 36,500 days: the `409 in-flight` is sent with
/// `Retry-After: 3153600000`, and nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_retry_after_is_clamped() {
    let effects = Arc::new(Effects::default());
    let server = serve(Backend::Memory, app(effects.clone()), |layer| {
        layer.retry_after(Duration::MAX)
    })
    .await;
    let at_gate = effects.at_gate.notified();
    let first = tokio::spawn(send(server.post("/slow", "k")));
    at_gate.await;
    let busy = send(server.post("/slow", "k")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.problem(), "in-flight");
    assert_eq!(busy.headers["retry-after"], "3153600000");
    effects.gate.notify_one();
    assert_eq!(first.await.unwrap().text(), "slow 1");
}
