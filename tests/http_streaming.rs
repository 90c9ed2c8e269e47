//! Streamed responses behind the HTTP layer, over real HTTP (an axum server on 127.0.0.1 and a
//! real HTTP/1.1 client) on the memory store, Redis and PostgreSQL: each frame reaches the
//! client as the handler produces it; the key completes when the body ended (kept for replay
//! when it fits), outgrew the limit, or lost its client.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/forward.rs"]
mod forward;
#[path = "support/http_harness.rs"]
mod http_harness;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use http_harness::{send, serve, BACKENDS};
use tokio::sync::{mpsc, Notify};

const CHUNK: usize = 100 * 1024;

#[derive(Default)]
struct Effects {
    runs: AtomicUsize,
    /// The events `/events` streams, sent by the test.
    events: Mutex<Option<mpsc::UnboundedReceiver<String>>>,
    /// `/events`'s body was dropped (its client, or the layer, let go of it).
    events_dropped: Notify,
}

/// Says when the body it is part of is dropped.
struct Dropped(Arc<Effects>);

impl Drop for Dropped {
    fn drop(&mut self) {
        self.0.events_dropped.notify_one();
    }
}

fn app(effects: Arc<Effects>) -> Router {
    /// Server-sent events: one per message of the test's, until the test closes its sender.
    async fn events(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
        effects.runs.fetch_add(1, Ordering::SeqCst);
        let events = effects.events.lock().unwrap().take().unwrap();
        let stream = futures_util::stream::unfold(
            (events, Dropped(effects.clone())),
            |(mut events, dropped)| async move {
                let event = events.recv().await?;
                let frame = Ok::<_, Infallible>(Bytes::from(format!("data: {event}\n\n")));
                Some((frame, (events, dropped)))
            },
        );
        (
            [("content-type", "text/event-stream")],
            Body::from_stream(stream),
        )
    }
    /// Three chunks of `n` bytes each, chunked (no length known).
    async fn chunked(State(effects): State<Arc<Effects>>, body: String) -> (StatusCode, Body) {
        effects.runs.fetch_add(1, Ordering::SeqCst);
        let n: usize = body.parse().unwrap();
        let chunks = (b'a'..=b'c').map(move |b| Ok::<_, Infallible>(Bytes::from(vec![b; n])));
        (
            StatusCode::CREATED,
            Body::from_stream(futures_util::stream::iter(chunks)),
        )
    }
    Router::new()
        .route("/events", post(events))
        .route("/chunked", post(chunked))
        .with_state(effects)
}

fn events(effects: &Effects) -> mpsc::UnboundedSender<String> {
    let (send, receive) = mpsc::unbounded_channel();
    *effects.events.lock().unwrap() = Some(receive);
    send
}

/// Reads `response` until what it read ends with `expected`.
async fn read_until(response: &mut reqwest::Response, expected: &str) -> String {
    let mut read = String::new();
    while !read.ends_with(expected) {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("the next event in time")
            .unwrap()
            .expect("more of the body");
        read.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    read
}

/// An SSE handler's head and first event reach the client while the handler still streams (at
/// once, as without the layer); a retry meanwhile is `409 in-flight`; once the stream ended,
/// the events (small enough to keep) are replayed. The handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_sent_events_reach_the_client_as_they_are_produced() {
    for backend in BACKENDS {
        let effects = Arc::new(Effects::default());
        let server = serve(backend, app(effects.clone()), |layer| layer).await;
        let events = events(&effects);
        events.send("one".into()).unwrap();
        let mut response =
            tokio::time::timeout(Duration::from_secs(10), server.post("/events", "k").send())
                .await
                .expect("the head while the handler streams")
                .unwrap();
        assert_eq!(response.status(), 200, "{backend:?}");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        assert_eq!(read_until(&mut response, "\n\n").await, "data: one\n\n");
        let busy = send(server.post("/events", "k")).await;
        assert_eq!(busy.problem(), "in-flight", "{backend:?}");
        events.send("two".into()).unwrap();
        assert_eq!(read_until(&mut response, "\n\n").await, "data: two\n\n");
        drop(events);
        assert!(response.chunk().await.unwrap().is_none());

        let retry = send(server.post("/events", "k")).await;
        assert!(retry.replayed(), "{backend:?}");
        assert_eq!(retry.text(), "data: one\n\ndata: two\n\n");
        assert_eq!(effects.runs.load(Ordering::SeqCst), 1);
        let counts = server.layer.counts();
        assert_eq!(
            (counts.fresh, counts.replayed, counts.rejected),
            (1, 1, 1),
            "{backend:?}"
        );
    }
}

/// A chunked body is sent chunked and whole; the key is completed before the client has the
/// body's end, so a retry at once is a replay. One larger than the stored-body limit still
/// reaches its client whole, and its retry is `response-not-stored`, not a second run.
#[tokio::test]
async fn a_chunked_body_is_streamed_and_kept_when_it_fits() {
    for backend in BACKENDS {
        let effects = Arc::new(Effects::default());
        let server = serve(backend, app(effects.clone()), |layer| layer).await;
        let first = send(server.post("/chunked", "k").body("3")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{backend:?}");
        assert_eq!(first.headers["transfer-encoding"], "chunked");
        assert_eq!(first.text(), "aaabbbccc");
        let again = send(server.post("/chunked", "k").body("3")).await;
        assert!(again.replayed(), "{backend:?}");
        assert_eq!(again.text(), "aaabbbccc");

        let big = send(server.post("/chunked", "k2").body(CHUNK.to_string())).await;
        assert_eq!(big.body.len(), 3 * CHUNK, "{backend:?}");
        assert!(big.body[2 * CHUNK..].iter().all(|&b| b == b'c'));
        let again = send(server.post("/chunked", "k2").body(CHUNK.to_string())).await;
        assert_eq!(again.status, StatusCode::CONFLICT, "{backend:?}");
        assert_eq!(again.problem(), "response-not-stored");
        assert_eq!(effects.runs.load(Ordering::SeqCst), 2);
    }
}

/// A client that leaves mid-stream completes the key without a body, though the handler's
/// stream would go on: the retry is `response-not-stored` at once (not `409 in-flight` for as
/// long as the stream lives) and the handler does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_completes_the_key() {
    for backend in BACKENDS {
        let effects = Arc::new(Effects::default());
        let server = serve(backend, app(effects.clone()), |layer| layer).await;
        let events = events(&effects);
        events.send("one".into()).unwrap();
        let mut response = server.post("/events", "k").send().await.unwrap();
        assert_eq!(read_until(&mut response, "\n\n").await, "data: one\n\n");
        let dropped = effects.events_dropped.notified();
        drop(response);
        tokio::time::timeout(Duration::from_secs(10), dropped)
            .await
            .expect("the layer lets go of the stream once its client left");
        assert!(server.layer.shutdown(Duration::from_secs(10)).await);
        let retry = send(server.post("/events", "k")).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{backend:?}");
        assert_eq!(retry.problem(), "response-not-stored");
        assert_eq!(effects.runs.load(Ordering::SeqCst), 1);
        let counts = server.layer.counts();
        assert_eq!((counts.fresh, counts.rejected), (1, 1), "{backend:?}");
        // The handler's stream would have gone on: nobody reads it.
        assert!(events.send("two".into()).is_err());
    }
}

/// The memory store, holding each completion until the test opens it: says on `entered` when
/// a completion arrived. (A wrapper, not a stand-in: every call goes to the real store.)
struct HeldCompletions {
    inner: idempotency::MemoryStore,
    entered: Notify,
    open: Notify,
}

impl idempotency::store::Store for HeldCompletions {
    forward_store!(claim, release, renew, read);

    fn complete<'a>(
        &'a self,
        key: &'a idempotency::Key,
        token: &'a idempotency::store::Token,
        completion: &'a idempotency::store::Completion,
    ) -> idempotency::store::BoxFuture<'a, Result<bool, idempotency::store::StoreError>> {
        Box::pin(async move {
            self.entered.notify_one();
            self.open.notified().await;
            self.inner.complete(key, token, completion).await
        })
    }
}

/// A response of one frame (the common JSON answer) is held, head included, until its
/// completion is recorded, then handed over whole: its head never goes to the socket alone,
/// where, on a server without `TCP_NODELAY` (axum's default), Nagle's algorithm and the
/// client's delayed acknowledgement would hold its body back 40 ms. A body of several frames
/// still gets its head with its first frame (`server_sent_events_reach_the_client_...`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_frame_response_goes_out_with_its_head_once_recorded() {
    use tower::ServiceExt as _;

    let store = Arc::new(HeldCompletions {
        inner: idempotency::MemoryStore::new(),
        entered: Notify::new(),
        open: Notify::new(),
    });
    let layer = idempotency::http::IdempotencyLayer::new(
        idempotency::Idempotency::new(Duration::from_secs(60)).store(store.clone()),
        |_: &http::request::Parts| Some("tenant".to_owned()),
    );
    let app = Router::new()
        .route(
            "/orders",
            post(|| async { (StatusCode::CREATED, r#"{"order":7}"#) }),
        )
        .layer(layer);
    let request = http::Request::post("/orders")
        .header("idempotency-key", "order-7")
        .body(Body::empty())
        .unwrap();
    let mut call = std::pin::pin!(app.oneshot(request));
    tokio::select! {
        _ = &mut call => panic!("the response came before its completion was recorded"),
        () = store.entered.notified() => {}
    }
    // The completion is held: the head must not have been handed over.
    assert!(
        futures_util::poll!(&mut call).is_pending(),
        "the head was handed over alone, before its body"
    );
    store.open.notify_one();
    let response = call.await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body = axum::body::to_bytes(axum::body::Body::new(response.into_body()), 1 << 16)
        .await
        .unwrap();
    assert_eq!(&body[..], br#"{"order":7}"#);
}
