//! A real axum server behind the HTTP layer on 127.0.0.1, a real HTTP/1.1 client, and the
//! stores every scenario runs on (memory, the Redis at `IDEMPOTENT_REDIS_URL`, the
//! PostgreSQL of the test suite), each with a unique key prefix or table that is cleaned up.
//! Used with `support/redis_server.rs` and `support/sql_tables.rs` declared by the test file.

#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::Router;
use idempotency::http::IdempotencyLayer;
use idempotency::sql::PostgresStore;
use idempotency::store::Token;
use idempotency::{Idempotency, MemoryStore, SharedStore};

use crate::redis_server::{connect, delete_matching, redis_url};
use crate::sql_tables::{Scratch, Server};

/// The stores every scenario runs on.
#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Memory,
    Redis,
    Postgres,
}

pub const BACKENDS: [Backend; 3] = [Backend::Memory, Backend::Redis, Backend::Postgres];

/// A store for one scenario, and what it must clean up.
pub struct Store {
    pub store: SharedStore,
    pub prefix: String,
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

impl Store {
    /// The same store (and clean-up) seen through `wrap`: a store that injects what the real
    /// one cannot be made to do on cue.
    pub fn wrapped(mut self, wrap: impl FnOnce(SharedStore) -> SharedStore) -> Store {
        self.store = wrap(self.store.clone());
        self
    }
}

pub fn unique(prefix: &str) -> String {
    let token = format!("{:?}", Token::generate());
    format!("{prefix}-{}", &token[6..token.len() - 1])
}

pub async fn store(backend: Backend) -> Store {
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

/// A server on 127.0.0.1: `router` behind the layer (scoped by the `x-tenant` header,
/// `configure`d), and a client.
pub struct Running {
    pub base: String,
    pub layer: IdempotencyLayer,
    pub client: reqwest::Client,
    pub store: Store,
}

/// The caller of a request: its `x-tenant` header.
pub fn tenant(request: &http::request::Parts) -> Option<String> {
    request
        .headers
        .get("x-tenant")?
        .to_str()
        .ok()
        .map(str::to_owned)
}

pub async fn serve(
    backend: Backend,
    router: Router,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> Running {
    serve_wrapped(backend, router, configure, |router| router).await
}

/// [`serve`], with `wrap`'s layers outside the idempotency layer.
pub async fn serve_wrapped(
    backend: Backend,
    router: Router,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    wrap: impl FnOnce(Router) -> Router,
) -> Running {
    serve_on(store(backend).await, router, configure, wrap).await
}

/// [`serve_wrapped`] on `store` (one of [`store`]'s, possibly [`Store::wrapped`]).
pub async fn serve_on(
    store: Store,
    router: Router,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    wrap: impl FnOnce(Router) -> Router,
) -> Running {
    let idempotency = Idempotency::new(Duration::from_secs(3600))
        .lease(Duration::from_secs(10))
        .store(store.store.clone());
    let layer = configure(IdempotencyLayer::new(idempotency, tenant).prefix(store.prefix.clone()));
    let router = wrap(router.layer(layer.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Running {
        base: format!("http://{addr}"),
        layer,
        client: reqwest::Client::new(),
        store,
    }
}

impl Running {
    /// A request with `method` to `path` (sent as written: no re-encoding), from tenant `a`,
    /// with `key`.
    pub fn request(&self, method: &str, path: &str, key: &str) -> reqwest::RequestBuilder {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        self.client
            .request(method, format!("{}{path}", self.base))
            .header("x-tenant", "a")
            .header("idempotency-key", key)
    }

    pub fn post(&self, path: &str, key: &str) -> reqwest::RequestBuilder {
        self.request("POST", path, key)
    }
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

pub async fn send(request: reqwest::RequestBuilder) -> Answer {
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
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem's type name, after the base.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.headers.get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..]),
            "not a problem: {} {}",
            self.status,
            self.text()
        );
        let problem: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(problem["status"], self.status.as_u16());
        assert!(problem["title"].is_string() && problem["detail"].is_string());
        let kind = problem["type"].as_str().unwrap();
        kind.rsplit('#').next().unwrap().to_owned()
    }
}
