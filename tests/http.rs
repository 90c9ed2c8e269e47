//! The HTTP `Idempotency-Key` layer over real HTTP: an axum server on 127.0.0.1 and a real
//! HTTP/1.1 client, on the memory store, the Redis at `IDEMPOTENT_REDIS_URL` and the
//! PostgreSQL of the test suite. Business effects are rows in a PostgreSQL table or counted
//! by the handlers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use idempotency::http::{IdempotencyLayer, Replayed};
use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::PostgresStore;
use idempotency::store::{BoxFuture, Claim, ClaimRequest, Completion, Record, StoreError, Token};
use idempotency::{Idempotency, Key, MemoryStore, OnInProgress, SharedStore};
use proxy::Proxy;
use redis_server::{connect, delete_matching, redis_url};
use sql_tables::{Scratch, Server};
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio::time::Instant;

/// The stores every scenario runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Redis,
    Postgres,
}

const BACKENDS: [Backend; 3] = [Backend::Memory, Backend::Redis, Backend::Postgres];

/// A store for one scenario, and what it must clean up.
struct Store {
    store: SharedStore,
    prefix: String,
    _table: Option<Scratch>,
    redis: Option<String>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(url) = self.redis.take() {
            let pattern = format!("{}:*", self.prefix);
            let _ = std::thread::spawn(move || delete_matching(&url, &pattern)).join();
        }
    }
}

fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
}

async fn store(backend: Backend) -> Store {
    let prefix = unique("http");
    match backend {
        Backend::Memory => Store {
            store: Arc::new(MemoryStore::new()),
            prefix,
            _table: None,
            redis: None,
        },
        Backend::Redis => {
            let url = redis_url();
            Store {
                store: Arc::new(connect(&url).await),
                prefix,
                _table: None,
                redis: Some(url),
            }
        }
        Backend::Postgres => {
            let table = Scratch::table(Server::Postgres);
            let store = PostgresStore::builder(table.url())
                .table(table.name().to_string())
                .build()
                .await
                .unwrap();
            Store {
                store: Arc::new(store),
                prefix,
                _table: Some(table),
                redis: None,
            }
        }
    }
}

/// What the handlers count and wait on.
#[derive(Default)]
struct Effects {
    runs: AtomicUsize,
    /// `/slow` says here that it reached its gate.
    at_gate: Notify,
    /// `/slow` waits here until the test lets it finish.
    gate: Notify,
    /// `/slow` says here that it finished.
    finished: Notify,
}

const BIG: usize = 300 * 1024;

fn app(effects: Arc<Effects>) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .route("/flaky", post(flaky))
        .route("/rejected", post(rejected))
        .route("/big", post(big))
        .route("/big-located", post(big_located))
        .route("/slow", post(slow))
        .with_state(effects)
}

async fn create_order(State(effects): State<Arc<Effects>>, body: String) -> impl IntoResponse {
    let n = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [
            ("location", format!("/orders/{n}")),
            ("set-cookie", "session=secret".to_owned()),
            ("content-type", "application/json".to_owned()),
        ],
        format!("{{\"order\":{n},\"echo\":{body:?}}}"),
    )
}

/// `503` on its first run, `201` after.
async fn flaky(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
    match effects.runs.fetch_add(1, Ordering::SeqCst) {
        0 => (StatusCode::SERVICE_UNAVAILABLE, "try again"),
        _ => (StatusCode::CREATED, "done"),
    }
}

/// A definitive `422` of the handler's own: stored and replayed.
async fn rejected(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
    effects.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::UNPROCESSABLE_ENTITY, "no such product")
}

async fn big(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
    effects.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::OK, vec![b'x'; BIG])
}

async fn big_located(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
    let n = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        [("location", format!("/reports/{n}"))],
        vec![b'y'; BIG],
    )
}

async fn slow(State(effects): State<Arc<Effects>>) -> impl IntoResponse {
    effects.at_gate.notify_one();
    effects.gate.notified().await;
    let n = effects.runs.fetch_add(1, Ordering::SeqCst) + 1;
    effects.finished.notify_one();
    (StatusCode::CREATED, format!("slow {n}"))
}

struct Running {
    base: String,
    layer: IdempotencyLayer,
    effects: Arc<Effects>,
    client: reqwest::Client,
    store: Store,
}

/// The caller of a request: its `x-tenant` header.
fn tenant(request: &http::request::Parts) -> Option<String> {
    request
        .headers
        .get("x-tenant")?
        .to_str()
        .ok()
        .map(str::to_owned)
}

/// A server on 127.0.0.1 behind the layer (scoped by the `x-tenant` header), and a client.
async fn start(
    backend: Backend,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Running {
    start_with(backend, |idempotency, _| idempotency, configure).await
}

/// [`start`], with `settings` applied to the engine's settings (given the scenario's store).
async fn start_with(
    backend: Backend,
    settings: impl FnOnce(Idempotency, &SharedStore) -> Idempotency,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Running {
    let store = store(backend).await;
    let idempotency = settings(
        Idempotency::new(Duration::from_secs(3600))
            .lease(Duration::from_secs(10))
            .store(store.store.clone()),
        &store.store,
    );
    let layer = configure(IdempotencyLayer::new(idempotency, tenant).prefix(store.prefix.clone()));
    let effects = Arc::new(Effects::default());
    let replays = Arc::new(AtomicUsize::new(0));
    let seen = replays.clone();
    let router = app(effects.clone())
        .layer(layer.clone())
        // Outside the layer: what middleware sees of a replay.
        .layer(axum::middleware::map_response(
            move |response: axum::response::Response| {
                let seen = seen.clone();
                async move {
                    if response.extensions().get::<Replayed>() == Some(&Replayed(true)) {
                        seen.fetch_add(1, Ordering::SeqCst);
                    }
                    response
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Running {
        base: format!("http://{addr}"),
        layer,
        effects,
        client: reqwest::Client::new(),
        store,
    }
}

impl Running {
    fn post(&self, path: &str, tenant: &str, key: Option<&str>) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(format!("{}{path}", self.base))
            .header("x-tenant", tenant);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request
    }

    fn runs(&self) -> usize {
        self.effects.runs.load(Ordering::SeqCst)
    }
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

async fn send(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.unwrap();
    let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
    let headers = response.headers().clone();
    let body = response.bytes().await.unwrap().to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The problem's type name, after the base.
    fn problem(&self) -> String {
        assert_eq!(
            self.headers["content-type"],
            "application/problem+json",
            "not a problem: {} {}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(problem["status"], self.status.as_u16());
        assert!(problem["title"].is_string() && problem["detail"].is_string());
        let kind = problem["type"].as_str().unwrap();
        kind.rsplit('#').next().unwrap().to_owned()
    }
}

/// 100 concurrent identical `POST /orders` create exactly one order row in PostgreSQL (on
/// every store); each answer is the first response or a `409 in-flight` problem with
/// `Retry-After`; once the first completed, retries replay it byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_identical_posts_create_one_order() {
    for backend in BACKENDS {
        let orders = Scratch::table(Server::Postgres);
        let pool = sqlx::PgPool::connect(orders.url()).await.unwrap();
        let create = format!(
            "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, body TEXT)",
            orders.name()
        );
        sqlx::query(AssertSqlSafe(create))
            .execute(&pool)
            .await
            .unwrap();

        let store = store(backend).await;
        let idempotency = Idempotency::new(Duration::from_secs(3600)).store(store.store.clone());
        let layer =
            IdempotencyLayer::new(idempotency, |_: &http::request::Parts| Some(String::new()))
                .prefix(store.prefix.clone());
        let insert = format!(
            "INSERT INTO {} (body) VALUES ($1) RETURNING id",
            orders.name()
        );
        let handler_pool = pool.clone();
        let router = Router::new()
            .route(
                "/orders",
                post(move |body: String| {
                    let (pool, insert) = (handler_pool.clone(), insert.clone());
                    async move {
                        let id: i64 = sqlx::query_scalar(AssertSqlSafe(insert))
                            .bind(&body)
                            .fetch_one(&pool)
                            .await
                            .unwrap();
                        (StatusCode::CREATED, format!("{{\"id\":{id}}}"))
                    }
                }),
            )
            .layer(layer);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/orders", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

        let client = reqwest::Client::new();
        let start = Arc::new(Semaphore::new(0));
        let calls: Vec<_> = (0..100)
            .map(|_| {
                let (client, url, start) = (client.clone(), url.clone(), start.clone());
                tokio::spawn(async move {
                    let _go = start.acquire().await.unwrap();
                    send(
                        client
                            .post(url)
                            .header("idempotency-key", "order-1")
                            .body("pizza"),
                    )
                    .await
                })
            })
            .collect();
        start.add_permits(100);
        let mut created = Vec::new();
        for call in calls {
            let answer = call.await.unwrap();
            match answer.status {
                StatusCode::CREATED => created.push(answer.body),
                StatusCode::CONFLICT => {
                    assert_eq!(answer.problem(), "in-flight");
                    assert_eq!(answer.headers["retry-after"], "1");
                }
                other => panic!("{backend:?}: unexpected {other}"),
            }
        }
        let count = format!("SELECT COUNT(*) FROM {}", orders.name());
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count.clone()))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1, "{backend:?}");
        assert!(!created.is_empty(), "{backend:?}");
        assert!(
            created.iter().all(|body| body == &created[0]),
            "{backend:?}"
        );
        for _ in 0..5 {
            let retry = send(
                client
                    .post(&url)
                    .header("idempotency-key", "order-1")
                    .body("pizza"),
            )
            .await;
            assert_eq!(retry.status, StatusCode::CREATED, "{backend:?}");
            assert!(retry.replayed(), "{backend:?}");
            assert_eq!(retry.body, created[0], "{backend:?}");
        }
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1, "{backend:?}");
    }
}

/// A retry gets the stored status, headers and body with `Idempotent-Replayed: true` (and
/// middleware outside the layer sees the `Replayed` extension); `Set-Cookie` and `Date` are
/// not replayed; the first response is not marked.
#[tokio::test]
async fn retries_replay_the_first_response() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        let first = send(server.post("/orders", "a", Some("k1")).body("pizza")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(!first.replayed());
        assert_eq!(first.headers["set-cookie"], "session=secret");
        for _ in 0..3 {
            let again = send(server.post("/orders", "a", Some("k1")).body("pizza")).await;
            assert_eq!(again.status, StatusCode::CREATED, "{backend:?}");
            assert!(again.replayed());
            assert_eq!(again.body, first.body);
            assert_eq!(again.headers["location"], "/orders/1");
            assert_eq!(again.headers["content-type"], "application/json");
            assert!(again.headers.get("set-cookie").is_none());
        }
        assert_eq!(server.runs(), 1, "{backend:?}");
        let counts = server.layer.counts();
        assert_eq!((counts.fresh, counts.replayed), (1, 3), "{backend:?}");
    }
}

/// The same key from two tenants is two operations: tenant B never gets A's response.
#[tokio::test]
async fn one_tenants_key_never_replays_for_another() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        let a = send(server.post("/orders", "tenant-a", Some("same")).body("x")).await;
        let b = send(server.post("/orders", "tenant-b", Some("same")).body("x")).await;
        assert_eq!(
            (a.status, b.status),
            (StatusCode::CREATED, StatusCode::CREATED)
        );
        assert!(!b.replayed(), "{backend:?}");
        assert_ne!(a.body, b.body);
        assert_eq!(server.runs(), 2);
        let no_tenant = send(
            server
                .client
                .post(format!("{}/orders", server.base))
                .header("idempotency-key", "k"),
        )
        .await;
        assert_eq!(no_tenant.status, StatusCode::BAD_REQUEST);
        assert_eq!(no_tenant.problem(), "missing-scope");
        assert_eq!(server.runs(), 2);
    }
}

/// The same key with another body is `422 payload-mismatch`; nothing runs.
#[tokio::test]
async fn a_key_reused_with_another_payload_is_422() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        send(server.post("/orders", "a", Some("k")).body("pizza")).await;
        let other = send(server.post("/orders", "a", Some("k")).body("sushi")).await;
        assert_eq!(
            other.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{backend:?}"
        );
        assert_eq!(other.problem(), "payload-mismatch");
        assert_eq!(server.runs(), 1);
    }
}

/// Missing, empty, non-ASCII, 10 KB and repeated keys are `400`s with their problem types,
/// and nothing is stored or run. Requests of other methods pass through.
#[tokio::test]
async fn bad_keys_are_400_and_store_nothing() {
    let server = start(Backend::Memory, |layer| layer).await;
    let missing = send(server.post("/orders", "a", None)).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem(), "missing-key");
    let long = "k".repeat(10 * 1024);
    for bad in [
        &b""[..],
        "caf\u{e9}".as_bytes(),
        long.as_bytes(),
        b"\"unterminated",
        b"a, b",
    ] {
        let value = reqwest::header::HeaderValue::from_bytes(bad).unwrap();
        let answer = send(
            server
                .post("/orders", "a", None)
                .header("idempotency-key", value),
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::BAD_REQUEST,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
        assert_eq!(answer.problem(), "invalid-key");
    }
    let twice = send(
        server
            .post("/orders", "a", Some("k"))
            .header("x-idempotency-key", "k"),
    )
    .await;
    assert_eq!(twice.problem(), "invalid-key");
    assert_eq!(server.runs(), 0);
    // A good key afterwards runs: nothing was claimed by the bad ones.
    let good = send(server.post("/orders", "a", Some("\"k\"")).body("x")).await;
    assert_eq!(good.status, StatusCode::CREATED);
    assert_eq!(server.runs(), 1);
    assert_eq!(server.layer.counts().rejected, 7);
}

/// A request body above the limit is `413` before anything is claimed.
#[tokio::test]
async fn an_oversized_request_is_413() {
    let server = start(Backend::Memory, |layer| layer.max_request_body(1024)).await;
    let answer = send(
        server
            .post("/orders", "a", Some("k"))
            .body(vec![b'a'; 2048]),
    )
    .await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(answer.problem(), "request-too-large");
    // A chunked body (no Content-Length) is cut off at the limit too.
    let chunks =
        futures_util::stream::iter((0..4).map(|_| Ok::<_, std::io::Error>(vec![b'a'; 512])));
    let answer = send(
        server
            .post("/orders", "a", Some("k"))
            .body(reqwest::Body::wrap_stream(chunks)),
    )
    .await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(server.runs(), 0);
    let fits = send(
        server
            .post("/orders", "a", Some("k"))
            .body(vec![b'a'; 1024]),
    )
    .await;
    assert_eq!(fits.status, StatusCode::CREATED);
}

/// A response too large to keep completes the key without its body: the first client gets
/// it whole, retries get `303` to its `Location`, or `409 response-not-stored` without one;
/// the handler never runs again.
#[tokio::test]
async fn an_oversized_response_completes_without_rerunning() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        let first = send(server.post("/big", "a", Some("k"))).await;
        assert_eq!((first.status, first.body.len()), (StatusCode::OK, BIG));
        let again = send(server.post("/big", "a", Some("k"))).await;
        assert_eq!(again.status, StatusCode::CONFLICT, "{backend:?}");
        assert_eq!(again.problem(), "response-not-stored");

        let located = send(server.post("/big-located", "a", Some("k2"))).await;
        assert_eq!(located.body.len(), BIG);
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let again = send(
            client
                .post(format!("{}/big-located", server.base))
                .header("x-tenant", "a")
                .header("idempotency-key", "k2"),
        )
        .await;
        assert_eq!(again.status, StatusCode::SEE_OTHER);
        assert_eq!(again.headers["location"], "/reports/2");
        assert!(again.replayed());
        assert_eq!(server.runs(), 2, "{backend:?}");
    }
}

/// A `503` of the handler releases the key: the retry runs and its `201` is stored. A
/// definitive `422` of the handler is stored and replayed.
#[tokio::test]
async fn server_errors_release_and_client_errors_are_stored() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        let first = send(server.post("/flaky", "a", Some("k"))).await;
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        let second = send(server.post("/flaky", "a", Some("k"))).await;
        assert_eq!(second.status, StatusCode::CREATED, "{backend:?}");
        assert!(!second.replayed());
        let third = send(server.post("/flaky", "a", Some("k"))).await;
        assert_eq!(third.status, StatusCode::CREATED);
        assert!(third.replayed());
        assert_eq!(server.runs(), 2);

        let rejected = send(server.post("/rejected", "a", Some("k2"))).await;
        let again = send(server.post("/rejected", "a", Some("k2"))).await;
        assert_eq!(
            (rejected.status, again.status),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                StatusCode::UNPROCESSABLE_ENTITY
            )
        );
        assert!(again.replayed());
        assert_eq!(again.body, b"no such product");
        assert_eq!(server.runs(), 3);
        assert_eq!(server.layer.counts().released, 1);
    }
}

/// A client that hangs up while its handler runs does not cancel it: the handler finishes,
/// its response is stored, and the client's retry gets the replay. Exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_does_not_cancel_the_handler() {
    for backend in BACKENDS {
        let server = start(backend, |layer| layer).await;
        // The handler is held at its gate while the client gives up.
        let hung_up = server
            .post("/slow", "a", Some("k"))
            .timeout(Duration::from_millis(200))
            .send()
            .await;
        assert!(hung_up.unwrap_err().is_timeout());
        // While the handler runs, a retry is told it is in flight.
        let busy = send(server.post("/slow", "a", Some("k"))).await;
        assert_eq!(busy.problem(), "in-flight", "{backend:?}");
        let finished = server.effects.finished.notified();
        server.effects.gate.notify_one();
        tokio::time::timeout(Duration::from_secs(30), finished)
            .await
            .expect("the handler ran on to its end after its client left");
        assert!(server.layer.shutdown(Duration::from_secs(10)).await);
        let retry = send(server.post("/slow", "a", Some("k"))).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{backend:?}");
        assert!(retry.replayed());
        assert_eq!(retry.body, b"slow 1");
        assert_eq!(server.runs(), 1);
    }
}

/// A store that does not answer fails closed: `503 store-unavailable` with `Retry-After`,
/// and the handler does not run.
#[tokio::test]
async fn a_store_outage_is_503_and_runs_nothing() {
    // A real Redis behind a proxy that, once the store is connected, cuts every request.
    let upstream = redis_url().trim_start_matches("redis://").parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let store = connect(&proxy.url()).await;
    proxy.chaos(1000, 0, 7);
    let idempotency = Idempotency::new(Duration::from_secs(60)).store(Arc::new(store));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let router = Router::new()
        .route(
            "/orders",
            post(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { StatusCode::CREATED }
            }),
        )
        .layer(IdempotencyLayer::new(
            idempotency,
            |_: &http::request::Parts| Some(String::new()),
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let answer = send(
        reqwest::Client::new()
            .post(url)
            .header("idempotency-key", "k"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "store-unavailable");
    assert_eq!(answer.headers["retry-after"], "1");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(proxy.cut() > 0);
}

/// The real store of a scenario, saying on `busy` each time it answers a claim with
/// `InProgress`: the moment a duplicate learned that the first request is running.
struct Watched {
    inner: SharedStore,
    busy: Arc<Notify>,
}

impl idempotency::store::Store for Watched {
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            let claim = self.inner.claim(req).await;
            if matches!(claim, Ok(Claim::InProgress { .. })) {
                self.busy.notify_one();
            }
            claim
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        completion: &'a Completion,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.complete(key, token, completion)
    }
    fn release<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.release(key, token)
    }
    fn renew<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.renew(key, token, lease)
    }
    fn read<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        self.inner.read(key)
    }
    fn max_result_size(&self) -> usize {
        self.inner.max_result_size()
    }
}

/// With `OnInProgress::Wait`, a duplicate sent while the first request's handler runs is not
/// refused with `409`: it waits, and once the first completed it gets the first response
/// replayed. The handler runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_flight_waits_for_the_first_response_with_wait_policy() {
    for backend in BACKENDS {
        let busy = Arc::new(Notify::new());
        let seen = busy.clone();
        let server = start_with(
            backend,
            move |idempotency, store| {
                idempotency
                    .on_in_progress(OnInProgress::Wait(Duration::from_secs(5)))
                    .store(Arc::new(Watched {
                        inner: store.clone(),
                        busy: seen,
                    }))
            },
            |layer| layer,
        )
        .await;
        let first = tokio::spawn(send(server.post("/slow", "a", Some("k"))));
        server.effects.at_gate.notified().await;
        let duplicate = tokio::spawn(send(server.post("/slow", "a", Some("k"))));
        // The store told the duplicate that the first request is in flight: it is waiting.
        tokio::time::timeout(Duration::from_secs(10), busy.notified())
            .await
            .expect("the duplicate's claim never met the first request's");
        assert!(!duplicate.is_finished(), "{backend:?}");
        assert_eq!(server.layer.counts().rejected, 0, "{backend:?}");
        server.effects.gate.notify_one();
        let first = first.await.unwrap();
        let duplicate = duplicate.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED, "{backend:?}");
        assert!(!first.replayed());
        assert_eq!(
            duplicate.status,
            StatusCode::CREATED,
            "{backend:?}: {}",
            String::from_utf8_lossy(&duplicate.body)
        );
        assert!(duplicate.replayed(), "{backend:?}");
        assert_eq!(duplicate.body, first.body);
        assert_eq!(first.body, b"slow 1");
        assert_eq!(server.runs(), 1, "{backend:?}");
        let counts = server.layer.counts();
        assert_eq!(
            (counts.fresh, counts.replayed, counts.rejected),
            (1, 1, 0),
            "{backend:?}"
        );
    }
}

/// The lease of [`killed_server_child`]'s engine and of the server that takes over from it.
const CHILD_LEASE: Duration = Duration::from_secs(1);
/// What [`killed_server_child`] prints once it listens, before its address.
const LISTENING: &str = "killed-server-child listening on ";
/// What [`killed_server_child`]'s handler prints when it starts.
const HANDLER_STARTED: &str = "killed-server-child handler started";

/// This test binary re-run as a child process running one `#[ignore]`d test that serves
/// HTTP; its stdout lines come through `lines`. SIGKILLed on drop.
struct ChildServer {
    child: Child,
    /// Kept open: the child exits when it closes (this process died first).
    _stdin: ChildStdin,
    lines: mpsc::UnboundedReceiver<String>,
    base: String,
}

impl ChildServer {
    /// Starts `test` with `env` and waits until it listens.
    async fn spawn(test: &str, env: &[(&str, &str)]) -> ChildServer {
        let exe = std::env::current_exe().expect("no path to the test binary");
        let mut command = Command::new(exe);
        command
            .args([
                test,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .expect("cannot re-run the test binary as a server");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = ChildServer {
            child,
            _stdin: stdin,
            lines,
            base: String::new(),
        };
        let addr = server.wait_for(LISTENING).await;
        server.base = format!("http://{addr}");
        server
    }

    /// Waits (30 s at most) until the child prints `marker`; returns the rest of its line.
    async fn wait_for(&mut self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("the child did not print {marker:?} within 30 s"))
                .unwrap_or_else(|| panic!("the child exited before printing {marker:?}"));
            // libtest may have printed the test's name on the same line.
            if let Some((_, rest)) = line.split_once(marker) {
                return rest.trim().to_owned();
            }
        }
    }

    /// SIGKILL; returns how the process ended.
    fn kill(&mut self) -> std::process::ExitStatus {
        let _ = self.child.kill();
        self.child.wait().unwrap()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server SIGKILLed while its handler runs leaves the key claimed until the lease runs
/// out: a retry meanwhile (to another server on the same Redis) is `409 in-flight`; then a
/// retry runs the handler and gets a fresh `201`, which later retries get replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_request_lets_the_retry_run_after_the_lease() {
    use std::os::unix::process::ExitStatusExt;

    let server = start_with(
        Backend::Redis,
        |idempotency, _| idempotency.lease(CHILD_LEASE),
        |layer| layer,
    )
    .await;
    let mut child = ChildServer::spawn(
        "killed_server_child",
        &[("HTTP_CHILD_PREFIX", &server.store.prefix)],
    )
    .await;
    let first = tokio::spawn(
        server
            .client
            .post(format!("{}/orders", child.base))
            .header("x-tenant", "a")
            .header("idempotency-key", "k")
            .body("pizza")
            .send(),
    );
    child.wait_for(HANDLER_STARTED).await;
    assert_eq!(child.kill().signal(), Some(9));
    let lost = first.await.unwrap();
    assert!(lost.is_err(), "the killed server answered: {lost:?}");

    // The dead server's lease is still live.
    let busy = send(server.post("/orders", "a", Some("k")).body("pizza")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.problem(), "in-flight");
    assert_eq!(server.runs(), 0);

    // Once it ran out, the retry runs the handler.
    let deadline = Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let answer = send(server.post("/orders", "a", Some("k")).body("pizza")).await;
        if answer.status == StatusCode::CREATED {
            break answer;
        }
        assert_eq!(answer.problem(), "in-flight");
        assert!(
            Instant::now() < deadline,
            "the key was still in flight 10 s after its server was killed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!retry.replayed());
    assert_eq!(retry.headers["location"], "/orders/1");
    assert_eq!(server.runs(), 1);
    let again = send(server.post("/orders", "a", Some("k")).body("pizza")).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(server.runs(), 1);
    let counts = server.layer.counts();
    assert_eq!((counts.fresh, counts.replayed), (1, 1));
}

/// The server of [`a_server_killed_mid_request_lets_the_retry_run_after_the_lease`]: a child
/// process (this test binary re-run) on the shared Redis, whose `POST /orders` handler says
/// it started and never finishes, so it is always killed mid-request. Does nothing when run
/// without the parent's environment.
#[test]
#[ignore = "a child process of a_server_killed_mid_request_lets_the_retry_run_after_the_lease"]
fn killed_server_child() {
    let Ok(prefix) = std::env::var("HTTP_CHILD_PREFIX") else {
        return;
    };
    // Gone with the parent, whatever ended it: the parent's end of stdin closes.
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(1);
    });
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let idempotency = Idempotency::new(Duration::from_secs(3600))
            .lease(CHILD_LEASE)
            .store(Arc::new(connect(&redis_url()).await));
        let router = Router::new()
            .route(
                "/orders",
                post(|| async {
                    println!("{HANDLER_STARTED}");
                    std::future::pending::<StatusCode>().await
                }),
            )
            .layer(IdempotencyLayer::new(idempotency, tenant).prefix(prefix));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("{LISTENING}{}", listener.local_addr().unwrap());
        axum::serve(listener, router).await.unwrap();
    });
}
