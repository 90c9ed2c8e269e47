//! `#[idempotent]` on a tonic method over real gRPC: a tonic server on 127.0.0.1 and its
//! generated client, orders inserted into a PostgreSQL table, records in the PostgreSQL store
//! of the test suite (or the Redis at `IDEMPOTENT_REDIS_URL`, or a throwaway Redis that is
//! killed for the outage).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../examples/grpc_orders/orders.rs"]
mod orders;
#[path = "support/redis_server.rs"]
mod redis_server;
#[path = "support/sql_tables.rs"]
mod sql_tables;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use idempotency::grpc::{DetachLayer, REPLAYED};
use idempotency::sql::sqlx::{self, AssertSqlSafe};
use idempotency::sql::PostgresStore;
use idempotency::store::Token;
use idempotency::{idempotent, SharedStore};
use orders::orders_client::OrdersClient;
use orders::orders_server::{Orders, OrdersServer};
use orders::{CreateOrderRequest, Order};
use redis_server::{connect, delete_matching, redis_url, RedisServer};
use sql_tables::{Scratch, Server};
use tokio::sync::{Notify, Semaphore};
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

/// Holds a call after its insert until the test lets it go.
struct Hold {
    inserted: Notify,
    release: Semaphore,
}

impl Default for Hold {
    fn default() -> Hold {
        Hold {
            inserted: Notify::new(),
            release: Semaphore::new(0),
        }
    }
}

/// Says when the server dropped a call's future before it answered (the client reset the
/// stream, or the server's `grpc-timeout` fired): the outermost of the test server's layers,
/// so it sees what every layer inside it sees. Waiting for it makes the deadline cases
/// deterministic: whatever runs on after that point runs in a task of its own.
#[derive(Clone)]
struct Probe<S> {
    inner: S,
    abandoned: Arc<Notify>,
}

struct Probed<F> {
    /// `None` once dropped: the layers inside go before the probe says so.
    inner: Option<Pin<Box<F>>>,
    answered: bool,
    abandoned: Arc<Notify>,
}

impl<F: Future> Future for Probed<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let answer = self
            .inner
            .as_mut()
            .expect("polled after drop")
            .as_mut()
            .poll(cx);
        if answer.is_ready() {
            self.answered = true;
        }
        answer
    }
}

impl<F> Drop for Probed<F> {
    fn drop(&mut self) {
        // Everything inside is dropped first (a detached run spawned, the in-place count
        // given back), so what the test reads after the notice is settled.
        drop(self.inner.take());
        if !self.answered {
            self.abandoned.notify_one();
        }
    }
}

impl<S: tower::Service<R>, R> tower::Service<R> for Probe<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = Probed<S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        Probed {
            inner: Some(Box::pin(self.inner.call(request))),
            answered: false,
            abandoned: self.abandoned.clone(),
        }
    }
}

#[derive(Clone)]
struct ProbeLayer(Arc<Notify>);

impl<S> tower::Layer<S> for ProbeLayer {
    type Service = Probe<S>;
    fn layer(&self, inner: S) -> Probe<S> {
        Probe {
            inner,
            abandoned: self.0.clone(),
        }
    }
}

/// The service under test: one order row per call that runs.
struct OrderService {
    /// Part of every key, so runs of the suite never meet each other's records.
    run: String,
    store: SharedStore,
    pool: sqlx::PgPool,
    insert: String,
    hold: Option<Arc<Hold>>,
}

#[tonic::async_trait]
impl Orders for OrderService {
    #[idempotent(
        prefix = "grpc-test:create",
        keys = [self.run, request.get_ref().request_id],
        fingerprint = [request.get_ref().customer, request.get_ref().amount_cents],
        ttl = 3600,
        on_in_progress = wait(30),
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        insert_order(
            &self.pool,
            &self.insert,
            request.into_inner(),
            self.hold.as_deref(),
        )
        .await
    }
}

/// The effect of every service here: one order row, held after its insert when asked; the
/// reply carries an `x-order-state` metadata entry.
async fn insert_order(
    pool: &sqlx::PgPool,
    insert: &str,
    message: CreateOrderRequest,
    hold: Option<&Hold>,
) -> Result<Response<Order>, Status> {
    let id: i64 = sqlx::query_scalar(AssertSqlSafe(insert.to_owned()))
        .bind(&message.request_id)
        .bind(&message.customer)
        .bind(i64::try_from(message.amount_cents).map_err(|_| Status::out_of_range("amount"))?)
        .fetch_one(pool)
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
    if let Some(hold) = hold {
        hold.inserted.notify_one();
        hold.release.acquire().await.unwrap().forget();
    }
    let mut response = Response::new(Order {
        id: u64::try_from(id).unwrap(),
        customer: message.customer,
        amount_cents: message.amount_cents,
    });
    response
        .metadata_mut()
        .insert("x-order-state", "created".parse().unwrap());
    Ok(response)
}

/// The orders table of a case, and a pool on it.
struct OrdersTable {
    table: Scratch,
    pool: sqlx::PgPool,
}

impl OrdersTable {
    async fn new() -> OrdersTable {
        let table = Scratch::table(Server::Postgres);
        let pool = sqlx::PgPool::connect(table.url()).await.unwrap();
        let create = format!(
            "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, request_id TEXT NOT NULL, \
             customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
            table.name()
        );
        sqlx::query(AssertSqlSafe(create))
            .execute(&pool)
            .await
            .unwrap();
        OrdersTable { table, pool }
    }

    fn insert(&self) -> String {
        format!(
            "INSERT INTO {} (request_id, customer, amount_cents) VALUES ($1, $2, $3) RETURNING id",
            self.table.name()
        )
    }

    async fn rows(&self) -> i64 {
        let count = format!("SELECT COUNT(*) FROM {}", self.table.name());
        sqlx::query_scalar(AssertSqlSafe(count))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl OrderService {
    fn new(store: SharedStore, orders: &OrdersTable, hold: Option<Arc<Hold>>) -> OrderService {
        OrderService {
            run: unique_run(),
            store,
            pool: orders.pool.clone(),
            insert: orders.insert(),
            hold,
        }
    }
}

/// A PostgreSQL store on a table of its own (dropped with the guard).
async fn postgres_store() -> (SharedStore, Scratch) {
    let records = Scratch::table(Server::Postgres);
    let store = PostgresStore::builder(records.url())
        .table(records.name().to_string())
        .build()
        .await
        .unwrap();
    (Arc::new(store), records)
}

fn unique_run() -> String {
    format!("{:?}", Token::generate())
}

/// Serves `service` on a free port behind a [`DetachLayer`]; returns a connected client and
/// the layer.
async fn serve(service: OrderService) -> (OrdersClient<Channel>, DetachLayer, Arc<Notify>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let detach = DetachLayer::new();
    let abandoned = Arc::new(Notify::new());
    let server = tonic::transport::Server::builder()
        .layer(ProbeLayer(abandoned.clone()))
        .layer(detach.clone())
        .add_service(OrdersServer::new(service))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.unwrap() });
    let client = OrdersClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (client, detach, abandoned)
}

fn order(request_id: &str, amount_cents: u64) -> CreateOrderRequest {
    CreateOrderRequest {
        request_id: request_id.into(),
        customer: "c-7".into(),
        amount_cents,
    }
}

fn replayed(response: &Response<Order>) -> bool {
    response
        .metadata()
        .get(REPLAYED)
        .is_some_and(|value| value == "true")
}

/// First call runs; the retry with the same id gets the same message and metadata, marked
/// replayed; another id runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_first_reply_marked_replayed() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let (mut client, _detach, _) = serve(OrderService::new(store, &orders, None)).await;

    let first = client.create_order(order("r-1", 1250)).await.unwrap();
    assert!(!replayed(&first));
    let retry = client.create_order(order("r-1", 1250)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(retry.metadata().get("x-order-state").unwrap(), "created");
    assert_eq!(orders.rows().await, 1);

    let other = client.create_order(order("r-2", 1250)).await.unwrap();
    assert!(!replayed(&other));
    assert_ne!(other.get_ref().id, first.get_ref().id);
    assert_eq!(orders.rows().await, 2);
}

/// The same id with another payload is `INVALID_ARGUMENT` and runs nothing; a request
/// without an id (proto3's empty string) is `INVALID_ARGUMENT` and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_id_with_another_payload_and_a_missing_id_are_refused() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let (mut client, _detach, _) = serve(OrderService::new(store, &orders, None)).await;

    client.create_order(order("r-1", 1250)).await.unwrap();
    let mismatch = client.create_order(order("r-1", 9999)).await.unwrap_err();
    assert_eq!(mismatch.code(), Code::InvalidArgument, "{mismatch:?}");
    assert!(
        mismatch.message().contains("different payload"),
        "{mismatch:?}"
    );

    let missing = client.create_order(order("", 1250)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert!(
        missing.message().contains("invalid idempotency key"),
        "{missing:?}"
    );
    assert_eq!(orders.rows().await, 1);
}

/// 100 concurrent identical calls on one HTTP/2 connection make exactly one order row, on the
/// PostgreSQL and the Redis store: one runs, the 99 others wait for it and get its reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundred_concurrent_identical_calls_make_one_order() {
    for backend in ["postgres", "redis"] {
        let orders = OrdersTable::new().await;
        let (store, _records): (SharedStore, Option<Scratch>) = match backend {
            "postgres" => {
                let (store, records) = postgres_store().await;
                (store, Some(records))
            }
            _ => (Arc::new(connect(&redis_url()).await), None),
        };
        let (client, _detach, _) = serve(OrderService::new(store, &orders, None)).await;

        let start = Arc::new(Semaphore::new(0));
        let calls: Vec<_> = (0..100)
            .map(|_| {
                let (mut client, start) = (client.clone(), start.clone());
                tokio::spawn(async move {
                    let _go = start.acquire().await.unwrap();
                    client.create_order(order("r-1", 1250)).await
                })
            })
            .collect();
        start.add_permits(100);
        let mut ids = Vec::new();
        let mut replays = 0;
        for call in calls {
            let reply = call.await.unwrap().unwrap();
            replays += usize::from(replayed(&reply));
            ids.push(reply.get_ref().id);
        }
        ids.dedup();
        assert_eq!(ids.len(), 1, "{backend}: every call got the same order");
        assert_eq!(replays, 99, "{backend}");
        assert_eq!(orders.rows().await, 1, "{backend}");
        if backend == "redis" {
            let url = redis_url();
            std::thread::spawn(move || delete_matching(&url, "grpc-test:create:*"))
                .join()
                .unwrap();
        }
    }
}

/// A client whose deadline expires while the method runs gets `DEADLINE_EXCEEDED`; the
/// method still finishes (the server dropped the call, the `DetachLayer` did not), and the
/// retry gets its reply: one order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_deadline_expired_finishes_and_its_retry_replays() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let hold = Arc::new(Hold::default());
    let (mut client, detach, abandoned) =
        serve(OrderService::new(store, &orders, Some(hold.clone()))).await;

    let mut first = Request::new(order("r-1", 1250));
    first.set_timeout(Duration::from_millis(300));
    let mut first_client = client.clone();
    let first = tokio::spawn(async move { first_client.create_order(first).await });
    // The insert happened; the call is held past its deadline.
    hold.inserted.notified().await;
    let expired = first.await.unwrap().unwrap_err();
    assert!(
        matches!(expired.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{expired:?}"
    );
    // The server dropped the call (its deadline): what runs on, runs in the layer's task.
    abandoned.notified().await;
    assert_eq!(
        detach.running(),
        1,
        "the call runs on after its client left"
    );

    // The retry arrives while the first still runs: it waits for it (`wait(30)`).
    let retry = tokio::spawn(async move { client.create_order(order("r-1", 1250)).await });
    hold.release.add_permits(1);
    let retry = retry.await.unwrap().unwrap();
    assert!(replayed(&retry));
    assert_eq!(orders.rows().await, 1);
    assert!(detach.shutdown(Duration::from_secs(10)).await);
}

/// The store is down: `UNAVAILABLE`, and the method does not run. Back up, the call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_is_unavailable_and_runs_nothing() {
    let orders = OrdersTable::new().await;
    let mut redis = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(connect(&redis.url()).await);
    let (mut client, _detach, _) = serve(OrderService::new(store, &orders, None)).await;

    redis.kill();
    let down = client.create_order(order("r-1", 1250)).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(orders.rows().await, 0);

    redis.restart();
    let mut up = None;
    // The store reconnects on its own; a call made while it does is refused, never run.
    for _ in 0..50 {
        match client.create_order(order("r-1", 1250)).await {
            Ok(reply) => {
                up = Some(reply);
                break;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "{status:?}");
                assert_eq!(orders.rows().await, 0);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(!replayed(&up.expect("the store came back")));
    assert_eq!(orders.rows().await, 1);
}

/// Keyed by a metadata entry: a call without it is `INVALID_ARGUMENT` and runs nothing.
struct MetadataKeyed {
    store: SharedStore,
    runs: std::sync::atomic::AtomicU64,
}

#[tonic::async_trait]
impl Orders for MetadataKeyed {
    #[idempotent(
        prefix = "grpc-test:metadata",
        keys = [request.metadata().get("x-request-id")],
        ttl = 60,
        store = self.store,
        replay
    )]
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        let id = self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        Ok(Response::new(Order {
            id,
            customer: request.into_inner().customer,
            amount_cents: 0,
        }))
    }
}

#[tokio::test]
async fn a_key_from_metadata_is_required_and_deduplicates() {
    let service = MetadataKeyed {
        store: Arc::new(idempotency::MemoryStore::new()),
        runs: Default::default(),
    };
    let missing = service
        .create_order(Request::new(order("", 1)))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");

    let with_id = || {
        let mut request = Request::new(order("", 1));
        request
            .metadata_mut()
            .insert("x-request-id", "9f1c".parse().unwrap());
        request
    };
    let first = service.create_order(with_id()).await.unwrap();
    let retry = service.create_order(with_id()).await.unwrap();
    assert_eq!(retry.get_ref(), first.get_ref());
    assert!(replayed(&retry) && !replayed(&first));
    assert_eq!(service.runs.load(std::sync::atomic::Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------
// `grpc::IdempotencyLayer`: the same method without the attribute, keyed by the
// `idempotency-key` metadata entry.

/// The method as a service that cannot change its messages writes it: no guard of its own.
struct PlainOrders {
    pool: sqlx::PgPool,
    insert: String,
    hold: Option<Arc<Hold>>,
    /// Calls that reached the method.
    calls: std::sync::atomic::AtomicUsize,
}

impl PlainOrders {
    fn new(orders: &OrdersTable, hold: Option<Arc<Hold>>) -> PlainOrders {
        PlainOrders {
            pool: orders.pool.clone(),
            insert: orders.insert(),
            hold,
            calls: Default::default(),
        }
    }
}

#[tonic::async_trait]
impl Orders for Arc<PlainOrders> {
    async fn create_order(
        &self,
        request: Request<CreateOrderRequest>,
    ) -> Result<Response<Order>, Status> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let message = request.into_inner();
        match message.customer.as_str() {
            // Nothing done: the layer gives the key back.
            "busy" => return Err(Status::unavailable("try again")),
            // A definitive answer: kept and replayed.
            "nobody" => return Err(Status::not_found("no such customer")),
            _ => {}
        }
        insert_order(&self.pool, &self.insert, message, self.hold.as_deref()).await
    }
}

const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";

/// A layer on `store` with a prefix of its own, callers waiting for a call in flight.
fn layer(store: SharedStore) -> idempotency::grpc::IdempotencyLayer {
    let idempotency = idempotency::Idempotency::new(Duration::from_secs(3600))
        .on_in_progress(idempotency::OnInProgress::Wait(Duration::from_secs(30)))
        .store(store);
    idempotency::grpc::IdempotencyLayer::new(idempotency, |call: &http::request::Parts| {
        Some(call.headers.get("x-tenant")?.to_str().ok()?.to_owned())
    })
    .prefix(format!("grpc-test-layer-{}", unique_run()))
}

/// Serves `service` behind `layer` on a free port; a connected client.
async fn serve_layered(
    layer: idempotency::grpc::IdempotencyLayer,
    service: Arc<PlainOrders>,
) -> OrdersClient<Channel> {
    serve_probed(layer, service, Arc::new(Notify::new())).await
}

/// [`serve_layered`], with a [`Probe`] outside the layer.
async fn serve_probed(
    layer: idempotency::grpc::IdempotencyLayer,
    service: Arc<PlainOrders>,
    abandoned: Arc<Notify>,
) -> OrdersClient<Channel> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .layer(ProbeLayer(abandoned))
        .layer(layer)
        .add_service(OrdersServer::new(service))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(async move { server.await.unwrap() });
    OrdersClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

/// A call of tenant `t-1`, with `key` as its `idempotency-key` when given.
fn keyed(key: Option<&str>, message: CreateOrderRequest) -> Request<CreateOrderRequest> {
    let mut request = Request::new(message);
    request
        .metadata_mut()
        .insert("x-tenant", "t-1".parse().unwrap());
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request
}

/// The retry with the same key gets the first reply (message and metadata) marked replayed;
/// another message under the key is `INVALID_ARGUMENT` and runs nothing; a call without a key
/// passes through, unless its method requires one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_replays_a_call_by_its_metadata_key() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let service = Arc::new(PlainOrders::new(&orders, None));
    let mut client = serve_layered(layer(store.clone()), service.clone()).await;

    let first = client
        .create_order(keyed(Some("k-1"), order("", 1250)))
        .await
        .unwrap();
    assert!(!replayed(&first));
    let retry = client
        .create_order(keyed(Some("k-1"), order("", 1250)))
        .await
        .unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(retry.metadata().get("x-order-state").unwrap(), "created");
    assert_eq!(orders.rows().await, 1);

    let mismatch = client
        .create_order(keyed(Some("k-1"), order("", 9999)))
        .await
        .unwrap_err();
    assert_eq!(mismatch.code(), Code::InvalidArgument, "{mismatch:?}");
    assert_eq!(orders.rows().await, 1);

    // No key: not guarded.
    client
        .create_order(keyed(None, order("", 1250)))
        .await
        .unwrap();
    assert_eq!(orders.rows().await, 2);
    assert_eq!(service.calls.load(std::sync::atomic::Ordering::SeqCst), 2);

    // A method that requires a key refuses a call without one, and runs nothing.
    let mut strict = serve_layered(layer(store).require_key(CREATE_ORDER), service.clone()).await;
    let missing = strict
        .create_order(keyed(None, order("", 1250)))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument, "{missing:?}");
    assert_eq!(orders.rows().await, 2);
}

/// A status that says nothing was done (`UNAVAILABLE`) gives the key back: the retry runs
/// again. A definitive one (`NOT_FOUND`) is kept: the retry gets it without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_releases_transient_statuses_and_replays_definitive_ones() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let service = Arc::new(PlainOrders::new(&orders, None));
    let mut client = serve_layered(layer(store), service.clone()).await;
    let calls = || service.calls.load(std::sync::atomic::Ordering::SeqCst);

    for _ in 0..2 {
        let busy = CreateOrderRequest {
            customer: "busy".into(),
            ..order("", 1)
        };
        let status = client
            .create_order(keyed(Some("k-busy"), busy))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
    }
    assert_eq!(calls(), 2, "a released key runs again");

    for _ in 0..2 {
        let nobody = CreateOrderRequest {
            customer: "nobody".into(),
            ..order("", 1)
        };
        let status = client
            .create_order(keyed(Some("k-nobody"), nobody))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::NotFound);
        assert_eq!(status.message(), "no such customer");
    }
    assert_eq!(calls(), 3, "a kept status is replayed, not run again");
}

/// 100 concurrent calls with one key: one order; a deadline that expires mid-call: the call
/// finishes in the layer's task and the retry gets its reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_layer_runs_concurrent_calls_once_and_outlives_a_deadline() {
    let orders = OrdersTable::new().await;
    let (store, _records) = postgres_store().await;
    let client = serve_layered(
        layer(store.clone()),
        Arc::new(PlainOrders::new(&orders, None)),
    )
    .await;
    let start = Arc::new(Semaphore::new(0));
    let calls: Vec<_> = (0..100)
        .map(|_| {
            let (mut client, start) = (client.clone(), start.clone());
            tokio::spawn(async move {
                let _go = start.acquire().await.unwrap();
                client
                    .create_order(keyed(Some("k-many"), order("", 1250)))
                    .await
            })
        })
        .collect();
    start.add_permits(100);
    let mut ids = Vec::new();
    for call in calls {
        ids.push(call.await.unwrap().unwrap().get_ref().id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1);
    assert_eq!(orders.rows().await, 1);

    let held = OrdersTable::new().await;
    let hold = Arc::new(Hold::default());
    let layer = layer(store);
    let abandoned = Arc::new(Notify::new());
    let mut client = serve_probed(
        layer.clone(),
        Arc::new(PlainOrders::new(&held, Some(hold.clone()))),
        abandoned.clone(),
    )
    .await;
    let mut first = keyed(Some("k-late"), order("", 1250));
    first.set_timeout(Duration::from_millis(300));
    let mut first_client = client.clone();
    let first = tokio::spawn(async move { first_client.create_order(first).await });
    hold.inserted.notified().await;
    let expired = first.await.unwrap().unwrap_err();
    assert!(
        matches!(expired.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{expired:?}"
    );
    abandoned.notified().await;
    let retry = tokio::spawn(async move {
        client
            .create_order(keyed(Some("k-late"), order("", 1250)))
            .await
    });
    hold.release.add_permits(1);
    assert!(replayed(&retry.await.unwrap().unwrap()));
    assert_eq!(held.rows().await, 1);
    assert!(layer.shutdown(Duration::from_secs(10)).await);
}

/// The store is down: `UNAVAILABLE`, and the method does not run. A method named streaming
/// passes through unguarded, key or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_fails_closed_and_passes_streaming_methods_through() {
    let orders = OrdersTable::new().await;
    let mut redis = RedisServer::start(&[]);
    let store: SharedStore = Arc::new(connect(&redis.url()).await);
    let service = Arc::new(PlainOrders::new(&orders, None));
    let mut client = serve_layered(layer(store.clone()), service.clone()).await;
    redis.kill();
    let down = client
        .create_order(keyed(Some("k-1"), order("", 1250)))
        .await
        .unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(service.calls.load(std::sync::atomic::Ordering::SeqCst), 0);

    let mut streaming = serve_layered(layer(store).streaming(CREATE_ORDER), service.clone()).await;
    for _ in 0..2 {
        streaming
            .create_order(keyed(Some("k-1"), order("", 1250)))
            .await
            .unwrap();
    }
    assert_eq!(orders.rows().await, 2, "not guarded, so run twice");
}
